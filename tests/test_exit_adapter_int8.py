"""Format 3 of the exit adapter file: projections (exit blocks, LoRA pairs) stored as weight-only int8
with per-row scales. The round trip against Int8Weight's quantization, the merged model against
the same pairs from a float file, the file's size, the refusals, and the shrink command (the
trainer's --save-dtype int8 is tested in test_exit_ready.py)."""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import eecore
from eecore.models.exit_adapter import FORMAT_INT8, FORMAT_LORA, AdapterBlock, ExitAdapters, model_fingerprint
from eecore.models.int8_weights import Int8Weight
from eecore.models.lora import LLAMA_TARGETS, LoraDeltas
from eecore.train.truncate_lora import main as shrink_main
from engine_utils import random_prompts
from model_factory import make_peaked_tiny_model

L, VOCAB, D, M = 3, 320, 64, 96


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_peaked_tiny_model(tmp_path_factory.mktemp("int8"), num_layers=L, vocab_size=VOCAB, hidden_size=D)


def _adapters(seed: int = 0, base: dict | None = None, rank: int = 4) -> ExitAdapters:
    """Random exit blocks at 1 and 2, a draft vocabulary and pairs on every projection of the tiny model."""
    g = torch.Generator().manual_seed(seed)
    blocks = {E: AdapterBlock(1 + 0.1 * torch.randn(D, generator=g), torch.randn(2 * 16, D, generator=g) / 8,
                              torch.randn(D, 16, generator=g) / 4) for E in (1, 2)}
    shapes = {"self_attn.q_proj": (D, D), "self_attn.k_proj": (D // 2, D), "self_attn.v_proj": (D // 2, D),
              "self_attn.o_proj": (D, D), "mlp.gate_proj": (M, D), "mlp.up_proj": (M, D), "mlp.down_proj": (D, M)}
    pairs = {f"model.layers.{i}.{t}": (0.3 * torch.randn(rank, shapes[t][1], generator=g),
                                       0.3 * torch.randn(shapes[t][0], rank, generator=g))
             for i in range(L) for t in LLAMA_TARGETS}
    return ExitAdapters(blocks, torch.arange(0, VOCAB, 3), base or {}, {"recipe": "test"}, LoraDeltas(pairs, 0.5))


def _int8_round_trip(t: torch.Tensor) -> torch.Tensor:
    return Int8Weight.quantize(t).dequantize(torch.float32)


def test_round_trip_stores_int8_and_widens_to_the_quantized_weights(tmp_path):
    adapters = _adapters()
    path = str(tmp_path / "a.safetensors")
    adapters.save(path, int8=True)
    with safe_open(path, framework="pt") as f:
        assert f.metadata()["format"] == FORMAT_INT8
        dtypes = {k: f.get_tensor(k).dtype for k in f.keys()}
    assert dtypes["exit.1.gate_up"] == dtypes["lora.model.layers.0.mlp.up_proj.a"] == torch.int8
    assert dtypes["exit.1.gate_up.scale"] == torch.float32 and dtypes["exit.1.norm"] == torch.float32
    back = ExitAdapters.load(path)
    assert back.lora.scale == 0.5 and set(back.lora.pairs) == set(adapters.lora.pairs)
    assert torch.equal(back.vocab, adapters.vocab) and back.info == adapters.info
    for E, block in adapters.blocks.items():
        assert torch.equal(back.blocks[E].norm, block.norm)
        for got, want in ((back.blocks[E].gate_up, block.gate_up), (back.blocks[E].down, block.down)):
            assert got.dtype == torch.float32 and torch.equal(got, _int8_round_trip(want))
            # symmetric per-row int8: within half a step of each row's scale
            assert bool(((got - want).abs() <= want.abs().amax(1, keepdim=True) / 254 * 1.0001).all())
    for p, (a, b) in adapters.lora.pairs.items():
        assert torch.equal(back.lora.pairs[p][0], _int8_round_trip(a))
        assert torch.equal(back.lora.pairs[p][1], _int8_round_trip(b))


def test_int8_file_is_about_half_a_bf16_one(tmp_path):
    adapters = _adapters(rank=64)  # a B row of r int8 values carries a 4-byte scale: 68 bytes against 128
    bf16 = dataclasses.replace(adapters, blocks={E: b.to(torch.bfloat16, "cpu") for E, b in adapters.blocks.items()},
                               lora=LoraDeltas({p: (a.bfloat16(), b.bfloat16()) for p, (a, b) in adapters.lora.pairs.items()},
                                               adapters.lora.scale))
    bf16.save(str(tmp_path / "bf16.safetensors"))
    adapters.save(str(tmp_path / "int8.safetensors"), int8=True)
    ratio = os.path.getsize(tmp_path / "int8.safetensors") / os.path.getsize(tmp_path / "bf16.safetensors")
    assert ratio < 0.6, ratio


def test_a_file_without_pairs_stays_without_them(tmp_path):
    adapters = dataclasses.replace(_adapters(), lora=None)
    path = str(tmp_path / "a.safetensors")
    adapters.save(path, int8=True)
    back = ExitAdapters.load(path)
    assert back.lora is None and back.exit_layers() == [1, 2]


def test_merged_model_is_the_one_of_the_widened_pairs(tiny, tmp_path):
    """LLM(exit_adapter=int8 file) is exactly the model of a float file holding the widened pairs and
    blocks: the same greedy tokens and top-5 logprobs at full depth."""
    path, _ = tiny
    llm = eecore.LLM(path, dtype="float32", device="cpu")
    adapters = _adapters(seed=1, base=model_fingerprint(llm.model))
    int8_file, float_file = str(tmp_path / "int8.safetensors"), str(tmp_path / "float.safetensors")
    adapters.save(int8_file, int8=True)
    widened = ExitAdapters.load(int8_file)
    widened.save(float_file)
    with safe_open(float_file, framework="pt") as f:
        assert f.metadata()["format"] == FORMAT_LORA
    prompts = random_prompts(VOCAB, [7, 3], seed=5)
    params = eecore.SamplingParams(max_tokens=6, temperature=0.0, logprobs=5)
    runs = []
    for file in (int8_file, float_file):
        ee = eecore.LLM(path, dtype="float32", device="cpu", exit_adapter=file)
        runs.append([(o.token_ids, o.logprobs) for o in ee.generate(prompts, params)])
    assert runs[0] == runs[1]
    plain = [o.token_ids for o in llm.generate(prompts, params)]
    assert [r[0] for r in runs[0]] != plain  # the pairs changed the model


def _valid_tensors() -> dict[str, torch.Tensor]:
    q = Int8Weight.quantize(torch.randn(8, D))
    return {"lora.model.layers.0.mlp.up_proj.a": q.data, "lora.model.layers.0.mlp.up_proj.a.scale": q.scale,
            "lora.model.layers.0.mlp.up_proj.b": Int8Weight.quantize(torch.randn(M, 8)).data,
            "lora.model.layers.0.mlp.up_proj.b.scale": Int8Weight.quantize(torch.randn(M, 8)).scale}


@pytest.mark.parametrize("case, change, match", [
    ("no scales", lambda t: t.pop("lora.model.layers.0.mlp.up_proj.a.scale"), "and no scales"),
    ("float projection", lambda t: t.update({"lora.model.layers.0.mlp.up_proj.a": torch.randn(8, D)}),
     "as 2-D int8"),
    ("scales too short", lambda t: t.update({"lora.model.layers.0.mlp.up_proj.a.scale": torch.ones(3)}),
     "must be 8 finite float32 scales"),
    ("scales in fp16", lambda t: t.update({"lora.model.layers.0.mlp.up_proj.a.scale": torch.ones(8).half()}),
     "must be 8 finite float32 scales"),
    ("infinite scale", lambda t: t.update({"lora.model.layers.0.mlp.up_proj.a.scale": torch.full((8,), float("inf"))}),
     "must be 8 finite float32 scales"),
    ("orphan scales", lambda t: t.update({"exit.1.down.scale": torch.ones(4)}), "belong to no tensor"),
    ("scales of a norm", lambda t: t.update({"exit.1.norm": torch.ones(D), "exit.1.norm.scale": torch.ones(D)}),
     "is not a projection"),
])
def test_malformed_int8_files_are_refused(tmp_path, case, change, match):
    tensors = _valid_tensors()
    change(tensors)
    path = str(tmp_path / "bad.safetensors")
    save_file(tensors, path, metadata={"format": FORMAT_INT8, "lora_scale": "1.0"})
    with pytest.raises(ValueError, match=match):
        ExitAdapters.load(path)


def test_pairs_without_their_scale_factor_are_refused(tmp_path):
    path = str(tmp_path / "bad.safetensors")
    save_file(_valid_tensors(), path, metadata={"format": FORMAT_INT8})
    with pytest.raises(ValueError, match="scale"):
        ExitAdapters.load(path)


def test_the_shrink_command_writes_int8_with_or_without_a_new_rank(tmp_path, capsys):
    src = str(tmp_path / "in.safetensors")
    _adapters(rank=8).save(src)
    for extra, rank in (([], 8), (["--rank", "4"], 4)):
        dst = str(tmp_path / f"out{rank}.safetensors")
        shrink_main([src, dst, "--int8"] + extra)
        assert "(int8)" in capsys.readouterr().out
        with safe_open(dst, framework="pt") as f:
            assert f.metadata()["format"] == FORMAT_INT8
        assert ExitAdapters.load(dst).lora.rank == rank
    with pytest.raises(SystemExit):
        shrink_main([src, str(tmp_path / "x.safetensors")])
    assert "nothing to shrink" in capsys.readouterr().err

