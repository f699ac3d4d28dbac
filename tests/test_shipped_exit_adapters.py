"""The exit adapters shipped inside the package for the embedded SmolLM2-135M-Instruct: the file
loads, fits the model it was trained for, and `LLM(exit_adapter=True)` runs with it."""
import os

import pytest
import torch

import eecore
from eecore.models.amx_weights import amx_available
from eecore.models.exit_adapter import SHIPPED_FILE, DraftHead, ExitAdapters
from eecore.models.int8_weights import dense
from engine_utils import greedy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def shipped():
    return ExitAdapters.load(SHIPPED_FILE)


def test_the_file_is_in_the_package_and_small(shipped):
    assert os.path.getsize(SHIPPED_FILE) <= 25 * 2 ** 20  # the budget for a shipped file
    assert shipped.exit_layers() == [8, 12, 16]
    assert shipped.vocab is not None and len(shipped.vocab) == 8192
    # the card's figures come from the training run recorded in the file
    info = shipped.info
    assert info["trained_tokens"] > 0 and set(info["final_heldout"]) == {"8", "12", "16"}


def test_it_fits_the_embedded_model(shipped):
    llm = eecore.LLM(dtype="float32", device="cpu", max_num_seqs=2, exit_adapter=True)
    assert llm.exit_adapters.exit_layers() == shipped.exit_layers()
    shipped.check_model(llm.model)  # fingerprint, width, layers, token ids
    # trained adapters are not the identity: they move the exit's distribution
    head = DraftHead(llm.model, 12, shipped, max_rows=1)
    h = torch.randn(1, llm.model.config.hidden_size)
    assert not torch.allclose(head.adapted(h), h)


def test_speculation_and_early_exit_with_the_shipped_adapters():
    prompts = ["def fibonacci(n):", "The capital of France is"]
    full = eecore.LLM(dtype="float32", device="cpu", max_num_seqs=2).generate(prompts, greedy(24))
    spec = eecore.LLM(dtype="float32", device="cpu", max_num_seqs=2, exit_adapter=True,
                      speculative=eecore.SelfSpeculativeConfig(exit_layer=12, num_speculations=3))
    outs = spec.generate(prompts, greedy(24))
    assert [o.token_ids for o in outs] == [o.token_ids for o in full]
    # a trained draft is accepted more often than never
    assert sum(o.metrics["num_accepted_tokens"] for o in outs) > 0
    ee = eecore.LLM(dtype="float32", device="cpu", max_num_seqs=2, exit_adapter=True,
                    early_exit=eecore.EarlyExitConfig(measure="static", exit_layer=16))
    outs = ee.generate(prompts, greedy(8))
    assert all(o.exit_layers[1:] == [16] * 7 for o in outs)


def test_the_draft_layers_file_loads_and_leaves_full_depth_alone():
    """`exit_adapter=True` with separate draft layers loads the shipped draft-layers file: its LoRA
    pairs go into the draft copy of layers 0..7 only, so outputs are the original model's."""
    from eecore.models.exit_adapter import SHIPPED_DRAFT_FILE

    assert os.path.getsize(SHIPPED_DRAFT_FILE) + os.path.getsize(SHIPPED_FILE) <= 25 * 2 ** 20
    draft = ExitAdapters.load(SHIPPED_DRAFT_FILE)
    assert draft.exit_layers() == [8] and draft.lora is not None
    assert {int(p.split("layers.")[1].split(".")[0]) for p in draft.lora.pairs} == set(range(8))
    prompts = ["def fibonacci(n):", "import numpy as np\n\ndef normalize(x):"]
    full = eecore.LLM(dtype="float32", device="cpu", max_num_seqs=2).generate(prompts, greedy(24))
    spec = eecore.LLM(dtype="float32", device="cpu", max_num_seqs=2, exit_adapter=True,
                      speculative=eecore.SelfSpeculativeConfig(
                          num_speculations=2, layer=eecore.LayerDrafts(exit_layer=8,
                                                                       copy=eecore.DraftCopy(dtype="bfloat16"))))
    assert spec.exit_adapters.source == SHIPPED_DRAFT_FILE
    outs = spec.generate(prompts, greedy(24))
    assert [o.token_ids for o in outs] == [o.token_ids for o in full]
    # the copy's layers are the base's plus the pairs; the model's are the base's
    base = dense(spec.model.layers[0].qkv, torch.float32)  # the Q4_1 file's blocks
    copy = dense(spec.engine.strategy.draft_stack.model.layers[0].qkv, torch.float32)  # bf16: maybe AMX tiles
    assert not torch.allclose(copy, base, atol=1e-2)
    assert sum(o.metrics["num_accepted_tokens"] for o in outs) > 0


def test_layer_preset_drafts_up_to_2_sequences_without_amx_int8(monkeypatch):
    """Without the copy on AMX-INT8 tiles (EECORE_AMX=0 here) the layer preset stops drafting above 2
    running sequences, where d = 4 stopped paying on CPUs without them; an override still wins."""
    monkeypatch.setenv("EECORE_AMX", "0")
    assert eecore.SelfSpeculativeConfig.exit_ready().disable_by_batch_size == 2
    hybrid = eecore.SelfSpeculativeConfig.exit_ready("hybrid")
    assert (hybrid.disable_by_batch_size, hybrid.layer.disable_by_batch_size) == (4, None)
    from eecore.cli.speculative_flags import preset_with

    assert preset_with(eecore.SelfSpeculativeConfig.exit_ready(), dict(disable_by_batch_size=6)).disable_by_batch_size == 6


@pytest.mark.skipif(not amx_available(torch.bfloat16), reason="no AMX-BF16 on this CPU (or build, or OS)")
def test_hybrid_preset_goes_on_with_lookup_drafts_up_to_8_sequences_on_amx_bf16():
    """Where bf16 verify rows run on AMX-BF16 tiles, the hybrid preset's layer drafts stop above 4
    running sequences and its lookup drafts above 8; an overall limit given alone (--disable-by-batch-size)
    lowers both."""
    from eecore.cli.speculative_flags import preset_with

    hybrid = eecore.SelfSpeculativeConfig.exit_ready("hybrid")
    assert (hybrid.disable_by_batch_size, hybrid.layer.disable_by_batch_size) == (8, 4)
    low = preset_with(hybrid, dict(disable_by_batch_size=2))
    assert (low.disable_by_batch_size, low.layer.disable_by_batch_size) == (2, 2)
    high = preset_with(hybrid, dict(disable_by_batch_size=16))
    assert (high.disable_by_batch_size, high.layer.disable_by_batch_size) == (16, 4)
    both = preset_with(hybrid, dict(disable_by_batch_size=6, layer_disable_by_batch_size=1))
    assert (both.disable_by_batch_size, both.layer.disable_by_batch_size) == (6, 1)


def test_exit_ready_presets():
    """SelfSpeculativeConfig.exit_ready: the shipped draft layers' settings, and the CLI's
    --exit-ready stands for --speculate --exit-adapter with them (flags given as well win)."""
    from eecore import cli
    from eecore.cli.speculative_flags import preset_with
    layer = eecore.SelfSpeculativeConfig.exit_ready()
    # drafting stops above 2 running sequences, or 4 where the int8 copy runs on AMX-INT8 tiles; on a
    # CPU lookup first, then the copy or the shipped head (a draft of layers and lookup: "hybrid")
    assert (layer.exit_layer, layer.num_speculations, layer.layer.stop_below, layer.layer.copy, layer.draft,
            layer.hybrid_switch, layer.disable_by_batch_size) == (8, 4, 0.15, eecore.DraftCopy(dtype="int8"), "hybrid",
                                                                 "round", 4 if amx_available(torch.int8) else 2)
    assert layer == eecore.SelfSpeculativeConfig(
        num_speculations=4, disable_by_batch_size=4 if amx_available(torch.int8) else 2, adaptive=True,
        layer=eecore.LayerDrafts(exit_layer=8, stop_below=0.15, long_draft_acceptance=0.5,
                                 copy=eecore.DraftCopy(dtype="int8")),
        feature=eecore.FeatureDrafts(top_k=3, max_length=2), lookup=eecore.LookupDrafts(min_ngram=2, max_ngram=4))
    assert eecore.SelfSpeculativeConfig.exit_ready(device="cpu").feature is not None
    # flags the head does not combine with leave it out, and the lookup that comes with it
    for flags in (dict(adaptive_drafts=False), dict(exit_threshold=0.8), dict(min_acceptance=0.3)):
        alone = preset_with(layer, flags)
        assert alone.feature is None and alone.lookup is None and alone.draft == "layer"
    hybrid = preset_with(eecore.SelfSpeculativeConfig.exit_ready("hybrid"), dict(num_speculations=6))
    assert (hybrid.draft, hybrid.hybrid_switch, hybrid.num_speculations, hybrid.layer.max_length,
            hybrid.lookup.min_ngram, hybrid.lookup.max_ngram, hybrid.layer.stop_below) == \
        ("hybrid", "token", 6, 3, 2, 4, 0.15)
    assert hybrid.layer.copy == eecore.DraftCopy(dtype="int8") and hybrid.layer.long_draft_acceptance == 0.5
    assert hybrid.adaptive and not preset_with(hybrid, dict(adaptive_drafts=False)).adaptive
    with pytest.raises(ValueError, match="'preset' must be one of layer, hybrid, got 'tree'"):
        eecore.SelfSpeculativeConfig.exit_ready("tree")
    with pytest.raises(ValueError, match=r"LayerDrafts: 'stop_below' \(--draft-threshold\) must be a number in "
                                         r"\[0, 1\] or None, got 2.0"):
        preset_with(eecore.SelfSpeculativeConfig.exit_ready(), dict(draft_threshold=2.0))

    def parsed(*flags):
        return cli.parse_args(["generate", "hello", *flags])

    args = parsed("--exit-ready")
    assert args.speculate and args.exit_adapter is True
    assert cli.speculative_config(args) == eecore.SelfSpeculativeConfig.exit_ready("layer")
    args = parsed("--exit-ready", "hybrid", "--num-speculations", "6", "--exit-adapter", "my.safetensors")
    assert args.exit_adapter == "my.safetensors"
    assert cli.speculative_config(args) == hybrid
    args = parsed("--exit-ready", "--draft-threshold", "0.3", "--exit-threshold", "0.9")
    config = cli.speculative_config(args)
    assert (config.layer.stop_below, config.trusts_drafts, config.layer.exit_threshold, config.layer.copy.dtype) == \
        (0.3, True, 0.9, "int8")
    # without the preset the flags keep SelfSpeculativeConfig's defaults
    args = parsed("--speculate", "--exit-layer", "3")
    assert cli.speculative_config(args) == eecore.SelfSpeculativeConfig(exit_layer=3)
    with pytest.raises(SystemExit, match="--speculate needs --exit-layer"):
        cli.speculative_config(parsed("--speculate"))


def test_exit_ready_before_the_prompt():
    """`eecore generate --exit-ready "def f():"`: a word after the flag that is not a preset is the
    prompt, and the flag means the default preset; a preset's misspelling is refused, not generated."""
    from eecore import cli
    from eecore.speculative.presets import PRESETS

    assert set(PRESETS) == {"layer", "hybrid"}
    for preset in PRESETS:  # the flag takes every preset
        assert cli.parse_args(["generate", "--exit-ready", preset, "def f():"]).exit_ready == preset
    args = cli.parse_args(["generate", "--exit-ready", "def f():", "second prompt", "--max-tokens", "4"])
    assert (args.exit_ready, args.prompt, args.max_tokens, args.speculate) == \
        ("layer", ["def f():", "second prompt"], 4, True)
    args = cli.parse_args(["generate", "--exit-ready", "hybrid", "def f():"])
    assert (args.exit_ready, args.prompt) == ("hybrid", ["def f():"])
    args = cli.parse_args(["generate", "--exit-ready", "--", "--not-a-flag"])  # after "--" every word is a prompt
    assert (args.exit_ready, args.prompt) == ("layer", ["--not-a-flag"])
    for typo in ("hybird", "layers"):
        with pytest.raises(SystemExit):
            cli.parse_args(["generate", "--exit-ready", typo, "def f():"])


def test_a_prompt_after_exit_adapter_is_refused_with_a_hint(capsys, tmp_path):
    """--exit-adapter's FILE is optional too, but a path cannot be told from a prompt: a word after it
    that names no file (and no .safetensors) is refused with what to write instead; a file, a
    .safetensors path (test_exit_ready_presets) or no word stays as it was."""
    from eecore import cli

    with pytest.raises(SystemExit):
        cli.parse_args(["generate", "--exit-adapter", "def f():"])
    assert "--exit-adapter: 'def f():' is no file. The FILE is optional" in capsys.readouterr().err
    args = cli.parse_args(["generate", "def f():", "--exit-adapter"])
    assert (args.exit_adapter, args.prompt) == (True, ["def f():"])
    path = tmp_path / "mine.safetensors"
    path.write_bytes(b"")
    args = cli.parse_args(["generate", "--exit-adapter", str(path), "def f():"])
    assert (args.exit_adapter, args.prompt) == (str(path), ["def f():"])


@pytest.mark.parametrize("preset", ["layer", "hybrid"])
def test_exit_ready_outputs_are_full_depths(preset):
    prompts = ["def fibonacci(n):", "import numpy as np\n\ndef normalize(x):"]
    full = eecore.LLM(dtype="float32", device="cpu", max_num_seqs=2).generate(prompts, greedy(24))
    spec = eecore.LLM(dtype="float32", device="cpu", max_num_seqs=2, exit_adapter=True,
                      speculative=eecore.SelfSpeculativeConfig.exit_ready(preset))
    outs = spec.generate(prompts, greedy(24))
    assert [o.token_ids for o in outs] == [o.token_ids for o in full]
    assert sum(o.metrics["num_accepted_tokens"] for o in outs) > 0



def test_exit_ready_presets_on_a_gpu_use_the_model_dtype_and_the_gpu_batch_limits(monkeypatch):
    """device="cuda": no CPU batch limits (the hybrid preset's own GPU limit, measured on an H200),
    the copy in the model's dtype (CUDA widens int8 weights on every call), the planner on; options
    still override. Built without a GPU: only the config."""
    from eecore.speculative import presets
    monkeypatch.setattr(presets, "preset_device", lambda device: "cuda" if device == "cuda" else "cpu")
    layer = eecore.SelfSpeculativeConfig.exit_ready("layer", device="cuda")
    assert layer == eecore.SelfSpeculativeConfig(
        num_speculations=4, adaptive=True,
        layer=eecore.LayerDrafts(exit_layer=8, stop_below=0.15, long_draft_acceptance=0.5, copy=eecore.DraftCopy()))
    hybrid = eecore.SelfSpeculativeConfig.exit_ready("hybrid", device="cuda")
    assert hybrid.disable_by_batch_size == presets.HYBRID_PRESET_GPU_MAX_BATCH == 2
    assert hybrid.layer.disable_by_batch_size is None
    assert hybrid.layer.copy == eecore.DraftCopy() and hybrid.hybrid_switch == "token"
    assert eecore.SelfSpeculativeConfig.exit_ready("layer", device="cpu").layer.copy == eecore.DraftCopy(dtype="int8")


def test_exit_ready_preset_device_is_checked():
    with pytest.raises(ValueError, match="SelfSpeculativeConfig.exit_ready: 'device'"):
        eecore.SelfSpeculativeConfig.exit_ready("layer", device="tpu")


def test_the_shipped_decision_file_is_fit_for_the_shipped_adapters():
    """measure="agreement" without a decision_path reads the shipped decision file: it loads for the
    embedded model with its shipped exit adapters (at any precision the model runs in), checks
    their three layers, and is refused without them."""
    from eecore.exits.agreement import SHIPPED, DecisionFileError

    assert os.path.getsize(SHIPPED) < 16 * 2 ** 10
    for dtype in ("auto", "float32"):
        llm = eecore.LLM(dtype=dtype, device="cpu", max_num_seqs=2, exit_adapter=True,
                         early_exit=eecore.EarlyExitConfig(measure="agreement", threshold=0.5, batch_rule="compact"))
        assert sorted(llm.engine.strategy.checks) == [8, 12, 16]
    outs = llm.generate(["def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n"], greedy(16))
    assert min(outs[0].exit_layers) < 30  # the decision lets some tokens exit at threshold 0.5
    with pytest.raises(DecisionFileError, match="runs without them"):
        eecore.LLM(device="cpu", max_num_seqs=2, early_exit=eecore.EarlyExitConfig(measure="agreement"))
