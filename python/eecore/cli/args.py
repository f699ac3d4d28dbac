"""What the `eecore` subcommands share: the model, strategy and sampling flags, and what they build
(the LLM, its strategy configs, sampling params, a prompt in or out of the chat template)."""
from __future__ import annotations

import argparse

from eecore.exits.config import MEASURES
from eecore.speculative.options import DRAFT_MODES
from eecore.speculative.presets import PRESETS




def parse_min_acceptance(text: str):
    """`--min-acceptance`: a number, or 'break-even' (shared with bench/e2e_self_speculation.py)."""
    if text == "break-even":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1] or 'break-even', got {text!r}") from None


def on_off(text: str) -> bool:
    """A switch's value: on/true/1 or off/false/0 (a bare switch flag means on)."""
    value = {"on": True, "true": True, "1": True, "off": False, "false": False, "0": False}.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An argparse type: an int >= 1 (argparse names the flag in its error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def add_precision_flags(group) -> None:
    """--dtype and --quantization (LLM's `dtype` and `quantization`)."""
    group.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                       help="activations' dtype (auto: the checkpoint's own; fp32 for a quantized GGUF)")
    group.add_argument("--quantization", default=None,
                       choices=["none", "int8", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k"],
                       help="default: the checkpoint's own weights (a GGUF file's blocks on the CPU); none: "
                            "dequantized to --dtype; the others quantize a float checkpoint at load")


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """The model, the decoding strategy (common flags first, then the advanced ones) and the engine's
    sizes. Subcommands add their own arguments and the sampling flags before these."""
    m = p.add_argument_group("model")
    m.add_argument("--model", default=None, help="HF model directory or .gguf file (default: embedded SmolLM2-135M)")
    add_precision_flags(m)
    m.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    m.add_argument("--exit-adapter", nargs="?", const=True, default=None, metavar="FILE",
                   help="exit adapters: the ones shipped for the default model (no FILE), or a file")
    add_strategy_flags(p)
    add_early_exit_flags(p)
    add_speculation_flags(p)
    add_engine_flags(p)


def add_strategy_flags(p: argparse.ArgumentParser) -> None:
    """The decoding strategy: full depth unless early exit or self-speculation is asked for."""
    t = p.add_argument_group("strategy (default: full depth)")
    t.add_argument("--early-exit", choices=MEASURES, default=None,
                   help="the early-exit measure: the softmax top-2 gap, the hidden state's cosine, CALM's classifier "
                        "(--classifier), the learned agreement with full depth (--exit-decision; default: the "
                        "shipped one, with --exit-adapter), or a static exit layer (--exit-layer)")
    t.add_argument("--threshold", type=threshold_arg, nargs="+", default=[0.9],
                   help="one value, one per layer, or a thresholds file from `eecore calibrate` (which also "
                        "sets the measure and exit settings it was calibrated for)")
    t.add_argument("--exit-layer", type=int, default=None,
                   help="static exit layer, or the speculation draft depth (not used by --draft lookup)")
    t.add_argument("--speculate", action="store_true")
    t.add_argument("--exit-ready", nargs="?", const="layer", default=None, choices=PRESETS,
                   help="the embedded model's exit-ready self-speculation in one flag: --speculate --exit-adapter "
                        "with SelfSpeculativeConfig.exit_ready (its shipped draft layers as an int8 copy of layers "
                        "0-7; hybrid: with prompt lookup); self-speculation flags given as well override it")
    # (None: SelfSpeculativeConfig's default, or --exit-ready's)
    t.add_argument("--draft", choices=list(DRAFT_MODES), default=None,
                   help="where drafts come from: layers 0..E-1 (layer, the default), prompt lookup: the tokens "
                        "that followed the last earlier occurrence of the sequence's last n tokens (lookup; "
                        "needs no --exit-layer), lookup where it finds a match and layer E elsewhere (hybrid), or "
                        "a feature head over the model's own states (feature: the shipped head, or --feature-head FILE)")
    t.add_argument("--num-speculations", type=int, default=None, help="(default: 4)")


def add_early_exit_flags(p: argparse.ArgumentParser) -> None:
    """The early-exit settings past the measure, threshold and exit layer."""
    e = p.add_argument_group("early exit, advanced")
    # None: EarlyExitConfig's default, or the thresholds file's value
    e.add_argument("--min-exit-layer", type=int, default=None, help="(default: 1)")
    e.add_argument("--check-every", type=int, default=None, help="(default: 1)")
    e.add_argument("--decay", type=float, default=None, help="CALM's decaying-threshold tau")
    e.add_argument("--batch-rule", choices=["all", "compact"], default=None, help="(default: all)")
    e.add_argument("--classifier", default=None, help="exit classifier file (measure 'classifier')")
    e.add_argument("--exit-decision", default=None, metavar="FILE",
                   help="decision file of measure 'agreement' (python -m eecore.train.exit_decision; default: the "
                        "shipped one, fit for the default model's shipped exit adapters)")


def add_speculation_flags(p: argparse.ArgumentParser) -> None:
    """The self-speculation settings past the draft source and length (`--exit-ready` sets them):
    one flag per field of SelfSpeculativeConfig's parts, named and explained in the field's metadata
    (eecore.speculative.options)."""
    from eecore.speculative.config import SelfSpeculativeConfig
    from eecore.cli.speculative_flags import walk

    s = p.add_argument_group("self-speculation, advanced (--exit-ready sets these)")
    s.add_argument("--draft-layers", choices=["shared", "separate"], default=None,
                   help="layer drafts run the model's own layers 0..E-1 (shared, LayerSkip, the default) or a copy of "
                        "them with a KV cache of its own (separate): an exit-ready file's LoRA pairs then change the "
                        "copy alone, and full depth stays the original model")
    for path, f in walk(SelfSpeculativeConfig):
        flag = f.metadata["flag"]
        if flag in STRATEGY_FLAGS:
            continue
        # None: the field's default, or --exit-ready's setting
        kind = _flag_type(f)
        if kind is on_off:  # `--flag` alone turns it on; `--flag off` turns off what a preset turned on
            s.add_argument(flag, type=on_off, nargs="?", const=True, default=None, metavar="on|off",
                           help=f"{f.metadata['help']} ({'.'.join(path)})")
            continue
        metavar = None if f.metadata["choices"] else {int: "N", float: "P"}.get(kind, "A")
        s.add_argument(flag, type=kind, choices=f.metadata["choices"], default=None, metavar=metavar,
                       help=f"{f.metadata['help']} ({'.'.join(path)})")


# speculation flags declared with the strategy (the common path), not among the advanced ones
STRATEGY_FLAGS = ("--exit-layer", "--num-speculations")


def _flag_type(f):
    """The argparse type of a config field, from its annotation."""
    if f.metadata["choices"]:
        return str
    if str(f.type) == "bool":
        return on_off
    if "Union[float, str]" in str(f.type):
        return parse_min_acceptance
    if "str" in str(f.type):
        return str
    return float if "float" in str(f.type) else int


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """The engine's sizes: the running batch, the token budget of a step, the KV cache."""
    b = p.add_argument_group("engine")
    b.add_argument("--max-num-seqs", type=positive_int, default=32,
                   help="sequences in the running batch (default: %(default)s)")
    b.add_argument("--max-num-batched-tokens", type=positive_int, default=1024,
                   help="tokens one step computes: the decodes first, prefill chunks share the rest, so a "
                        "longer prompt is split over steps (default: %(default)s)")
    b.add_argument("--num-blocks", type=int, default=None, help="KV cache blocks (default: from free memory)")
    b.add_argument("--block-size", type=int, default=16)
    b.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=False,
                   help="share the K/V of full blocks of prompt tokens between requests, so a common prefix "
                        "(a system prompt) is computed once (default: off; eecore serve: on)")
    b.add_argument("--enforce-eager", action="store_true",
                   help="launch every kernel from Python: no CUDA graphs of the decode step (on a GPU they are on)")
    d = p.add_argument_group("tensor parallelism (docs/distributed.md)")
    d.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=1,
                   help="split the model over this many processes (GPUs, or CPU cores shared out); "
                        "under torchrun, the number of processes it starts (default: %(default)s)")
    d.add_argument("--distributed-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="a rank that does not answer within this long fails the engine (default: %(default)s)")
    add_runtime_flags(p)


# LLM's run-time options (each also an EECORE_* switch: eecore.envs); a flag left out leaves the option
# to the environment and its default.
RUNTIME_OPTIONS = ("decode_ahead", "draft_ahead", "verify_ahead", "fused_rounds", "fused_projections",
                   "gguf_activations", "batch_invariant", "huge_pages", "amx")


def add_runtime_flags(p: argparse.ArgumentParser) -> None:
    from eecore import envs

    g = p.add_argument_group("how it runs (docs/configuration.md)")
    for option in RUNTIME_OPTIONS:
        switch = envs.switch_for_option(option)
        flag = "--" + option.replace("_", "-")
        default = {"0": "off", "1": "on", "": "on a GPU only"}.get(switch.default, switch.default)
        text = f"{switch.effect} (default: {switch.name} if set, else {default})"
        if option == "gguf_activations":
            g.add_argument(flag, choices=switch.choices, default=None, help=text)
        else:
            g.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=text)


def runtime_options(args) -> dict:
    """LLM keyword arguments of the run-time flags that were given."""
    return {name: getattr(args, name) for name in RUNTIME_OPTIONS if getattr(args, name, None) is not None}


def threshold_arg(text: str):
    """`--threshold`: a number, or the path of a thresholds file (`eecore calibrate --out`)."""
    try:
        return float(text)
    except ValueError:
        return text


def add_sampling_flags(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")


def early_exit_config(args):
    """The EarlyExitConfig the early-exit flags ask for, or None (no --early-exit and no thresholds
    file). A bad combination or setting raises ValueError with the message to show (a wrong
    thresholds file: ThresholdsFileError, also a ValueError)."""
    import eecore

    if args.early_exit and args.speculate:
        raise ValueError("choose --early-exit or --speculate, not both")
    threshold = args.threshold[0] if len(args.threshold) == 1 else args.threshold
    if any(isinstance(t, str) for t in args.threshold) and not isinstance(threshold, str):
        raise ValueError("--threshold takes numbers, or a single thresholds file")
    if not (args.early_exit or isinstance(threshold, str)):  # a thresholds file knows its measure
        return None
    return eecore.EarlyExitConfig(
        measure=args.early_exit, threshold=threshold, exit_layer=args.exit_layer,
        min_exit_layer=args.min_exit_layer, check_every=args.check_every, decay=args.decay,
        batch_rule=args.batch_rule, classifier_path=args.classifier, decision_path=args.exit_decision)


def build_llm(args, num_blocks=None):
    """The LLM the flags ask for; `num_blocks`: the KV cache's size when --num-blocks is not given
    (None: from the memory budget)."""
    import eecore
    from eecore.exits.agreement import DecisionFileError
    from eecore.exits.thresholds_file import ThresholdsFileError

    try:
        early_exit = early_exit_config(args)
    except ValueError as exc:  # a bad setting or thresholds file: a message, not a traceback
        raise SystemExit(f"eecore: {exc}") from None
    speculative = speculative_config(args) if args.speculate else None
    try:
        return eecore.LLM(args.model, dtype=args.dtype, device=args.device, early_exit=early_exit,
                          speculative=speculative, exit_adapter=args.exit_adapter, quantization=args.quantization,
                          max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          num_blocks=args.num_blocks if args.num_blocks is not None else num_blocks,
                          block_size=args.block_size,
                          enable_prefix_caching=args.enable_prefix_caching, enforce_eager=args.enforce_eager,
                          tensor_parallel_size=args.tensor_parallel_size,
                          distributed_timeout_s=args.distributed_timeout, **runtime_options(args))
    except (ThresholdsFileError, DecisionFileError) as exc:  # a file made for another model: a message
        raise SystemExit(f"eecore: {exc}") from None


def apply_exit_ready(args) -> None:
    """--exit-ready stands for --speculate --exit-adapter (the shipped files; a FILE given stays)."""
    if getattr(args, "exit_ready", None) is not None:
        args.speculate = True
        if args.exit_adapter is None:
            args.exit_adapter = True


def speculative_config(args):
    """The SelfSpeculativeConfig of the self-speculation flags (a bad combination exits with a message)."""
    import eecore

    from eecore.cli.speculative_flags import PART_CHOICES, from_flat, option_paths, preset_with

    # every option with a flag; a flag left out (None) keeps the config's default, or --exit-ready's
    names = [*option_paths(eecore.SelfSpeculativeConfig), *PART_CHOICES]
    given = {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
    preset = getattr(args, "exit_ready", None)
    draft = given.get("draft", "layer")
    if preset is None and "exit_layer" not in given and draft in ("layer", "hybrid"):
        which = "--speculate" if draft == "layer" else f"--draft {draft}"
        raise SystemExit(f"eecore: {which} needs --exit-layer E (--draft lookup and feature run without one)")
    try:
        if preset is not None:
            return preset_with(eecore.SelfSpeculativeConfig.exit_ready(preset, device=getattr(args, "device", None)),
                               given)
        return from_flat(eecore.SelfSpeculativeConfig, given)
    except ValueError as exc:
        raise SystemExit(f"eecore: {exc}") from None


def sampling_params(args):
    import eecore

    return eecore.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                 top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos)


def prompt_input(llm, prompt: str, chat: str):
    use_chat = chat == "on" or (chat == "auto" and llm.tokenizer is not None and llm.tokenizer.chat_template)
    if not use_chat:
        return prompt
    return llm.chat_prompt([{"role": "user", "content": prompt}])[1]  # the prompt is text, never control tokens
