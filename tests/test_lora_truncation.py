"""LoraDeltas.truncated and `python -m eecore.train.truncate_lora`: the best low-rank approximation of
each delta (checked against the singular values), the file round trip, and the refusals."""
from __future__ import annotations

import pytest
import torch

from eecore.models.exit_adapter import AdapterBlock, ExitAdapters
from eecore.models.lora import LoraDeltas
from eecore.train.truncate_lora import main, truncate_file


def _deltas(rank=8, seed=0) -> LoraDeltas:
    g = torch.Generator().manual_seed(seed)
    shapes = {"model.layers.0.self_attn.q_proj": (24, 40), "model.layers.1.mlp.down_proj": (40, 56)}
    pairs = {p: (torch.randn(rank, n_in, generator=g), torch.randn(n_out, rank, generator=g))
             for p, (n_out, n_in) in shapes.items()}
    return LoraDeltas(pairs, scale=2.0)


def test_full_rank_truncation_keeps_every_delta():
    lora = _deltas()
    same = lora.truncated(lora.rank)
    for p in lora.pairs:
        torch.testing.assert_close(same.delta(p), lora.delta(p), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rank", [1, 3, 6])
def test_truncation_is_the_best_approximation_of_its_rank(rank):
    lora = _deltas(seed=rank)
    low = lora.truncated(rank)
    assert low.rank == rank and low.scale == lora.scale
    for p in lora.pairs:
        s = torch.linalg.svdvals(lora.delta(p))
        # Eckart-Young: the error of the best rank-r approximation is the norm of the dropped values
        err = torch.linalg.norm(lora.delta(p) - low.delta(p))
        torch.testing.assert_close(err, torch.linalg.norm(s[rank:]), rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(torch.linalg.svdvals(low.delta(p))[:rank], s[:rank], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("rank", [0, 9, 2.0])
def test_truncation_rank_must_fit(rank):
    with pytest.raises(ValueError, match=r"truncation rank must be an int in \[1, 8\]"):
        _deltas().truncated(rank)


def _adapter_file(path, lora):
    g = torch.Generator().manual_seed(1)
    block = AdapterBlock(torch.ones(40), torch.randn(32, 40, generator=g), torch.randn(40, 16, generator=g))
    ExitAdapters({2: block}, torch.arange(10), {"num_layers": 2}, {"recipe": "test"}, lora).save(str(path))


def test_the_command_writes_a_truncated_file(tmp_path, capsys):
    src, dst = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    lora = _deltas()
    _adapter_file(src, lora)
    main([str(src), str(dst), "--rank", "4"])
    assert "rank 8 -> 4" in capsys.readouterr().out
    before, after = ExitAdapters.load(str(src)), ExitAdapters.load(str(dst))
    assert after.lora.rank == 4 and after.lora.scale == before.lora.scale
    assert torch.equal(after.blocks[2].gate_up, before.blocks[2].gate_up) and torch.equal(after.vocab, before.vocab)
    t = after.info["truncated"]
    assert t["from_rank"] == 8 and t["to_rank"] == 4 and 0 < t["energy_kept_min"] <= t["energy_kept_mean"] < 1
    assert after.info["recipe"] == "test"


def test_a_file_without_pairs_is_refused(tmp_path):
    src = tmp_path / "in.safetensors"
    _adapter_file(src, None)
    with pytest.raises(ValueError, match="has no LoRA pairs to truncate"):
        truncate_file(str(src), str(tmp_path / "out.safetensors"), 4)
