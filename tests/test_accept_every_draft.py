"""eecore.testing.accept_every_draft, the benchmarks' perfect drafts: every pass runs and every
greedy draft is accepted, so each round emits d + 1 tokens, with the chain read pass by pass and
with draft ahead and verify ahead alike."""
from __future__ import annotations

import pytest

import eecore
from eecore.testing import accept_every_draft
from model_factory import make_tiny_hf_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("perfect"), num_layers=4)[0]


@pytest.mark.parametrize("ahead", [False, True])
def test_every_round_emits_every_draft_and_the_model_s_token(tiny, ahead):
    d = 3
    llm = eecore.LLM(tiny, dtype="float32", device="cpu", block_size=4, draft_ahead=ahead, verify_ahead=ahead,
                     speculative=eecore.SelfSpeculativeConfig(
                         num_speculations=d, layer=eecore.LayerDrafts(exit_layer=1, copy=eecore.DraftCopy())))
    accept_every_draft(llm)
    outs = llm.generate([[5, 6, 7, 8], [9, 10, 11]], eecore.SamplingParams(max_tokens=16, temperature=0.0,
                                                                             ignore_eos=True))
    for out in outs:
        assert len(out.token_ids) == 16
        assert out.metrics["acceptance_rate"] == 1.0
        assert out.metrics["num_verify_steps"] == 16 // (d + 1)


def test_it_needs_self_speculation(tiny):
    with pytest.raises(ValueError, match="accept_every_draft: the LLM has no self-speculation"):
        accept_every_draft(eecore.LLM(tiny, dtype="float32", device="cpu", block_size=4))
