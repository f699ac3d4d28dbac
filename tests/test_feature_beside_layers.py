"""A feature head beside a draft copy (`SelfSpeculativeConfig(layer=LayerDrafts(copy=...),
feature=FeatureDrafts(...), adaptive=True)`): the draft planner gives each sequence, each round,
the source that emits more tokens a second at the measured costs and that sequence's acceptance;
outputs stay full depth's whichever it picks."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import eecore
from eecore.models.feature_head import FeatureHead
from eecore.speculative.draft import Draft
from eecore.speculative.draft_planner import DraftPlanner
from engine_utils import greedy
from test_draft_planner import StubClock, _seq
from test_hybrid_switch import _prompts
from test_separate_draft_layers import lora_file, tiny  # noqa: F401 (fixtures)


def _planner(verify, copy: float, feature: float, width: int = 1) -> DraftPlanner:
    planner = DraftPlanner(max_layer=4, max_lookup=0, max_feature=4, feature_rows=lambda d: width * d)
    planner.clock = StubClock(verify, copy)
    planner.clock.feature_pass = feature
    return planner


def _rounds(planner, seq, source: str, accepted: int, n: int = 12) -> None:
    for _ in range(n):
        draft = Draft(tokens=[1, 2, 3], from_lookup=[False] * 3, source=source, copy_ran=source == "layer")
        planner.record(seq, draft, accepted)


def test_each_sequence_gets_the_source_its_own_acceptance_and_the_costs_favour():
    planner = _planner(lambda rows: 1.0 + 0.01 * rows, copy=0.3, feature=0.05)
    good_head, good_copy = _seq(), _seq()
    _rounds(planner, good_head, "feature", accepted=3)
    _rounds(planner, good_head, "layer", accepted=0)
    _rounds(planner, good_copy, "feature", accepted=0)
    _rounds(planner, good_copy, "layer", accepted=3)
    head_plan, copy_plan = planner.plan(good_head, 1, 4, room=1000), planner.plan(good_copy, 1, 4, room=1000)
    assert head_plan.feature > 0 and head_plan.layer == 0
    assert copy_plan.layer > 0 and copy_plan.feature == 0


def test_at_equal_acceptance_the_cheaper_pass_wins_and_tree_rows_are_priced():
    seq = _seq()
    planner = _planner(lambda rows: 1.0 + 0.01 * rows, copy=0.3, feature=0.05)
    _rounds(planner, seq, "feature", accepted=2)
    _rounds(planner, seq, "layer", accepted=2)
    plan = planner.plan(seq, 1, 4, room=1000)
    assert plan.feature > 0 and plan.layer == 0
    # a head whose positions verify 4 rows each, where every row costs a step: the copy's chain wins
    planner = _planner(lambda rows: float(rows) ** 0.5, copy=0.05, feature=0.05, width=4)
    _rounds(planner, seq, "feature", accepted=2)
    _rounds(planner, seq, "layer", accepted=2)
    plan = planner.plan(seq, 1, 4, room=1000)
    assert plan.layer > 0 and plan.feature == 0


def test_the_clock_times_the_heads_passes_apart_from_the_copys():
    clock = StubClock(lambda rows: 1.0, copy=0.25)
    clock.record_feature(4, 0.2)
    assert clock.draft_pass("feature") == pytest.approx(0.05)
    assert clock.draft_pass("layer") == 0.25 and clock.draft_pass("lookup") == 0.0


@pytest.fixture(scope="module")
def head_file(tiny, tmp_path_factory):  # noqa: F811
    """A feature head for `tiny` (random weights: the planner's choice, not its drafts, is under test)."""
    llm = eecore.LLM(tiny[0], dtype="float32", device="cpu")
    path = str(tmp_path_factory.mktemp("beside") / "head.safetensors")
    FeatureHead.initialized(llm.model, seed=4).save(path, dtype=torch.float32)
    return path


def _both(path, file, head, top_k=1):
    return eecore.LLM(path, dtype="float32", device="cpu", block_size=4, max_num_seqs=8, exit_adapter=file,
                      speculative=eecore.SelfSpeculativeConfig(
                          num_speculations=3, layer=eecore.LayerDrafts(exit_layer=2, copy=eecore.DraftCopy()),
                          feature=eecore.FeatureDrafts(head=head, top_k=top_k), adaptive=True))


@pytest.mark.parametrize("cheap", ["feature", "layer"])
def test_greedy_is_full_depth_whichever_source_drafts(tiny, lora_file, head_file, cheap):  # noqa: F811
    """Verify rows cost nothing and the other source's pass costs more than a step: every drafted
    token comes from the cheap source, and the tokens are full depth's."""
    path, _ = tiny
    prompts, params = _prompts(3), [greedy(24 + 4 * i) for i in range(3)]
    expected = [o.token_ids for o in eecore.LLM(path, dtype="float32", device="cpu", block_size=4).generate(
        prompts, params)]
    llm = _both(path, lora_file[0], head_file, top_k=2)
    clock = llm.engine.strategy.planner.clock = StubClock(lambda rows: 1.0, copy=0.0 if cheap == "layer" else 5.0)
    clock.feature_pass = 0.0 if cheap == "feature" else 5.0
    clock.record_feature = lambda passes, seconds: None  # (the stub learns nothing)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == expected
    drafted = {kind: sum(o.metrics[f"num_{kind}_drafted_tokens"] for o in outs) for kind in ("feature", "layer")}
    other = "layer" if cheap == "feature" else "feature"
    assert drafted[cheap] > 0 and drafted[other] == 0, drafted


def test_greedy_is_full_depth_with_the_clock_measuring(tiny, lora_file, head_file):  # noqa: F811
    """The clock times this machine's passes (which source drafts then depends on them: on this
    tiny model usually both, in turns) and the outputs are full depth's."""
    path, _ = tiny
    prompts, params = _prompts(4), [greedy(40) for _ in range(4)]
    expected = [o.token_ids for o in eecore.LLM(path, dtype="float32", device="cpu", block_size=4).generate(
        prompts, params)]
    llm = _both(path, lora_file[0], head_file)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == expected
    assert sum(o.metrics["num_drafted_tokens"] for o in outs) > 0
    assert len(llm.engine.strategy.planner) == 0


def test_the_layer_preset_on_another_model_drafts_with_its_copy_alone(tiny, lora_file):  # noqa: F811
    """The exit-ready layer preset's head is the one shipped for the embedded model: with another
    model's exit-ready file the copy drafts alone (a warning says why); a head named by file must fit."""
    path, _ = tiny
    preset = replace(eecore.SelfSpeculativeConfig.exit_ready("layer", device="cpu"),
                     layer=eecore.LayerDrafts(exit_layer=2, copy=eecore.DraftCopy()))
    assert preset.feature is not None and preset.feature.head is None
    with pytest.warns(UserWarning, match="shipped feature head does not fit this model"):
        llm = eecore.LLM(path, dtype="float32", device="cpu", block_size=4, exit_adapter=lora_file[0],
                         speculative=preset)
    assert llm.engine.strategy.features is None
    prompts, params = _prompts(2), greedy(12)
    expected = eecore.LLM(path, dtype="float32", device="cpu", block_size=4).generate(prompts, params)
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in expected]
    from eecore.models.feature_head import SHIPPED_FILE

    named = replace(preset, feature=eecore.FeatureDrafts(head=SHIPPED_FILE))
    with pytest.raises(ValueError, match="made for a model with"):
        eecore.LLM(path, dtype="float32", device="cpu", exit_adapter=lora_file[0], speculative=named)
