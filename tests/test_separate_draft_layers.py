"""Self-speculation with separate draft layers (LayerDrafts(copy=DraftCopy())): a
copy of layers 0..E-1 with its own KV cache drafts, with an exit-ready file's LoRA pairs merged into
the copy alone; verification runs the original model's L layers."""
from __future__ import annotations

import pytest
import torch

import eecore
from eecore import _C
from eecore.models import int8_weights
from eecore.models.exit_adapter import ExitAdapters, model_fingerprint
from eecore.speculative.decoder import SelfSpeculativeDecoder
from eecore.speculative.guard import break_even_acceptance
from engine_utils import (assert_copy_logits_match, greedy, int8_rounded, q8_0_rounded, random_prompts,
                          truncated_merged)
from model_factory import make_peaked_tiny_model, random_lora

L, VOCAB = 4, 320


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(path, hf_model): a 4-layer random Llama with peaked distributions (drafts get accepted)."""
    return make_peaked_tiny_model(tmp_path_factory.mktemp("sep"), num_layers=L, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def lora_file(tiny, tmp_path_factory):
    """(file, lora): an exit-ready file holding LoRA pairs only (no adapter blocks, no vocabulary)."""
    path, hf = tiny
    base = eecore.LLM(path, dtype="float32", device="cpu")
    lora = random_lora(hf, seed=5)
    file = str(tmp_path_factory.mktemp("sepfile") / "draft.safetensors")
    ExitAdapters({}, None, model_fingerprint(base.model), {}, lora).save(file)
    return file, lora


def _separate(path, E, d, file=None, draft_dtype=None, **kw):
    layer = eecore.LayerDrafts(exit_layer=E, copy=eecore.DraftCopy(dtype=draft_dtype))
    return eecore.LLM(path, dtype="float32", device="cpu", block_size=4, exit_adapter=file,
                      speculative=eecore.SelfSpeculativeConfig(num_speculations=d, layer=layer), **kw)


@pytest.mark.parametrize("E, d, draft_dtype", [(1, 1, None), (2, 3, None), (3, 2, None), (2, 2, "bfloat16"),
                                                (2, 3, "int8")])
def test_greedy_is_the_original_full_depth(tiny, lora_file, E, d, draft_dtype):
    """The LoRA pairs change only the drafts: outputs are the original model's (not the merged one's)."""
    path, hf = tiny
    file, _ = lora_file
    for batch in (1, 3, 8):
        prompts = random_prompts(VOCAB, [2 + (7 * i) % 13 for i in range(batch)], seed=batch)
        params = [greedy(5 + 3 * i) for i in range(batch)]
        full = eecore.LLM(path, dtype="float32", device="cpu", block_size=4).generate(prompts, params)
        outs = _separate(path, E, d, file, draft_dtype).generate(prompts, params)
        assert [o.token_ids for o in outs] == [o.token_ids for o in full]
        assert sum(o.metrics["num_drafted_tokens"] for o in outs) > 0
        for o in outs:
            assert 1.0 <= o.metrics["mean_accepted_tokens_per_step"] <= d + 1
    merged = eecore.LLM(path, dtype="float32", device="cpu", exit_adapter=file).generate(prompts, params)
    assert [o.token_ids for o in merged] != [o.token_ids for o in full]  # the pairs do change the model


def _record_drafts(llm):
    """Every (context, draft logits) a d=1 round proposes from: with one draft per round, the
    context is the sequence's tokens through its pending one."""
    strategy = llm.engine.strategy
    seen = []
    original = strategy.picker.propose

    def propose(logits, seqs, drafted=None):
        for row, seq in zip(logits, seqs):
            seen.append((seq.token_slice(0, seq.num_computed_tokens + 1), row.clone()))
        return original(logits, seqs, drafted)

    strategy.picker.propose = propose
    return seen


@pytest.mark.parametrize("budget, num_blocks", [(256, None), (7, None), (256, 24)],
                         ids=["one-pass", "chunked-catch-up", "preempted"])
def test_draft_logits_are_the_copys_own(tiny, lora_file, budget, num_blocks):
    """Each draft is what HF's truncated, LoRA-merged model says after the whole context, so the
    copy's KV cache holds the right K/V: after catching up in chunks, and after a preemption freed
    a sequence's blocks."""
    path, hf = tiny
    file, lora = lora_file
    E = 2
    llm = _separate(path, E, 1, file, max_num_batched_tokens=budget, num_blocks=num_blocks, max_num_seqs=6)
    seen = _record_drafts(llm)
    prompts = random_prompts(VOCAB, [3, 19, 11, 8, 14, 5], seed=13)
    outs = llm.generate(prompts, [greedy(10 + i) for i in range(6)])
    if num_blocks is not None:
        assert sum(o.metrics["num_preemptions"] for o in outs) > 0
    assert len(seen) > 20
    reference = truncated_merged(hf, lora, E)
    with torch.no_grad():
        for context, logits in seen:
            want = reference(torch.tensor([context])).logits[0, -1]
            torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("blocks", [False, pytest.param(True, marks=pytest.mark.skipif(
    not _C.gguf_q8_vectorized(), reason="linear_gguf_q8 has no vector kernel in this build"))],
    ids=["per-row-int8", "q8_0-blocks"])
def test_an_int8_copy_drafts_with_its_8_bit_weights(tiny, lora_file, monkeypatch, blocks):
    """DraftCopy(dtype="int8"): the copy's projections, after the LoRA merge, and its LM head are
    8-bit (int8_weights.eight_bit): per-row int8 (no VNNI kernel for GGUF blocks, or AMX-INT8), or
    Q8_0 blocks with 8-bit activations. Each draft is what HF's truncated, merged model says with
    those weights rounded the same way and its projections' inputs rounded as the kernel rounds them
    (int16 rows; int8 blocks of 32), and the outputs stay the original full depth's. The tolerance is
    looser than fp32's: a value that sits on a rounding boundary in one engine can round the other
    way in the other (~1e-3 of logits up to 15 here), while the weights' rounding moves the logits
    by ~0.4, far outside it."""
    from eecore.models.gguf_weights import GGUFWeight

    path, hf = tiny
    file, lora = lora_file
    E = 2
    monkeypatch.setattr(int8_weights, "integer_gguf_kernel", lambda: blocks)
    llm = _separate(path, E, 1, file, draft_dtype="int8", max_num_batched_tokens=7, max_num_seqs=4)
    copy = llm.engine.strategy.draft_stack.model
    for weight in [copy.lm_head] + [getattr(layer, n) for layer in copy.layers for n in ("qkv", "o_proj", "down")]:
        if blocks:
            assert isinstance(weight, GGUFWeight) and weight.quant_type == 8 and weight.packed is not None
        else:
            assert isinstance(weight, int8_weights.Int8Weight)
    seen = _record_drafts(llm)
    prompts = random_prompts(VOCAB, [3, 19, 11, 8], seed=21)
    params = [greedy(10 + i) for i in range(4)]
    outs = llm.generate(prompts, params)
    full = eecore.LLM(path, dtype="float32", device="cpu", block_size=4).generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in full]
    assert len(seen) > 10
    merged = truncated_merged(hf, lora, E)
    reference = (q8_0_rounded if blocks else int8_rounded)(merged)
    moved = 0.0
    with torch.no_grad():
        for context, logits in seen:
            ids = torch.tensor([context])
            torch.testing.assert_close(logits, reference(ids).logits[0, -1], atol=5e-3, rtol=1e-3)
            moved = max(moved, float((logits - merged(ids).logits[0, -1]).abs().max()))
    assert moved > 0.05


def test_without_a_file_the_copy_is_the_models_first_layers(tiny):
    """No LoRA pairs: the copy computes the model's own layer-E logits (its drafts are those of
    shared draft layers), and it rejoins the original after a lookup round left it behind."""
    path, hf = tiny
    E = 2
    llm = _separate(path, E, 1)
    seen = _record_drafts(llm)
    llm.generate(random_prompts(VOCAB, [6, 9], seed=4), greedy(12))
    assert_copy_logits_match(hf, None, E, seen)


def test_hybrid_rounds_leave_the_copy_behind_and_it_catches_up(tiny, lora_file):
    """Hybrid: lookup rounds do not run the copy; a later layer round catches up on those tokens."""
    path, hf = tiny
    file, lora = lora_file
    llm = eecore.LLM(path, dtype="float32", device="cpu", block_size=4, exit_adapter=file,
                     speculative=eecore.SelfSpeculativeConfig(
                         num_speculations=1, layer=eecore.LayerDrafts(exit_layer=2, copy=eecore.DraftCopy()),
                         lookup=eecore.LookupDrafts()))
    seen = _record_drafts(llm)
    # repetitive prompts: lookup finds matches for some rounds, not for others
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 12, 9, 10]]
    outs = llm.generate(prompts, greedy(16))
    full = eecore.LLM(path, dtype="float32", device="cpu").generate(prompts, greedy(16))
    assert [o.token_ids for o in outs] == [o.token_ids for o in full]
    assert sum(o.metrics["num_lookup_rounds"] for o in outs) > 0 and seen
    assert_copy_logits_match(hf, lora, 2, seen)


def test_blocks_come_back(tiny, lora_file):
    path, _ = tiny
    llm = _separate(path, 2, 3, lora_file[0], num_blocks=30, max_num_seqs=4)
    llm.generate(random_prompts(VOCAB, [4, 9, 13, 6, 7], seed=2), [greedy(6 + i) for i in range(5)])
    assert llm.engine.blocks.num_free_blocks == 30
    assert llm.engine.strategy.draft_stack.tracked() == 0  # released with their sequences


def test_break_even_of_a_copy(tiny):
    """A float32 copy reads what shared layers read per round (d passes of E layers + L layers
    against d + 1 passes of E + L - E), so the break-even is the same; a bfloat16 copy lowers it,
    an int8 copy more."""
    path, _ = tiny
    shared = eecore.LLM(path, dtype="float32", device="cpu",
                        speculative=eecore.SelfSpeculativeConfig(exit_layer=2, num_speculations=3))
    model = shared.model
    s: SelfSpeculativeDecoder = shared.engine.strategy
    want = break_even_acceptance(model, 2, 3, s.draft_head.weight_bytes())
    dtypes = ("float32", "bfloat16", "int8")
    stacks = {dt: _separate(path, 2, 3, draft_dtype=dt).engine.strategy.draft_stack for dt in dtypes}
    got = {dt: break_even_acceptance(model, 2, 3, st.head.weight_bytes(), st.weight_bytes()) for dt, st in stacks.items()}
    assert got["float32"] == pytest.approx(want, abs=1e-9)
    assert 0 < got["int8"] < got["bfloat16"] < want


@pytest.mark.parametrize("make, match", [
    (lambda: eecore.DraftCopy(dtype="int4"),
     r"DraftCopy: 'dtype' \(--draft-dtype\) must be one of float32, bfloat16, float16, int8 or None, got 'int4'"),
    (lambda: eecore.LayerDrafts(exit_layer=2, copy="separate"),
     r"LayerDrafts: 'copy' must be a DraftCopy or None, got 'separate'"),
], ids=["dtype", "not-a-copy"])
def test_bad_config(make, match):
    """(A dtype or a copy without layer drafts cannot be written any more; the deprecated flat
    spellings that could: test_speculative_config.py.)"""
    with pytest.raises(ValueError, match=match):
        make()


def test_exit_layer_must_be_below_the_depth(tiny):
    with pytest.raises(ValueError, match="'exit_layer' must be below"):
        _separate(tiny[0], L, 1)


def test_cli_flags(tiny, capsys):
    from eecore.cli import main

    path, _ = tiny
    assert main(["generate", "Hello", "--model", path, "--dtype", "float32", "--max-tokens", "6", "--speculate",
                 "--exit-layer", "2", "--num-speculations", "2", "--draft-layers", "separate",
                 "--draft-dtype", "bfloat16", "--draft-top-k", "3"]) == 0
    assert main(["generate", "Hello", "--model", path, "--dtype", "float32", "--max-tokens", "6", "--speculate",
                 "--exit-layer", "2", "--num-speculations", "2", "--draft-layers", "separate",
                 "--draft-dtype", "int8"]) == 0
    with pytest.raises(SystemExit, match=r"'draft_dtype' applies to a draft copy \(draft_layers='separate'\), and "
                                         r"this config has none"):
        main(["generate", "Hello", "--model", path, "--speculate", "--exit-layer", "2", "--draft-dtype", "bfloat16"])
    with pytest.raises(SystemExit, match=r"'draft_top_k' applies to a draft copy \(draft_layers='separate'\), and "
                                         r"this config has none"):
        main(["generate", "Hello", "--model", path, "--speculate", "--exit-layer", "2", "--draft-top-k", "3"])
    with pytest.raises(SystemExit, match=r"draft_layers='separate' applies to layer drafts"):
        main(["generate", "Hello", "--model", path, "--speculate", "--draft", "lookup", "--draft-layers", "separate"])
