"""`eecore calibrate`: turn a tolerance on the inconsistency with full depth into early-exit
thresholds (CALM's Learn-then-Test; eecore.exits.calibrator), written to a thresholds file that
`eecore generate/bench --threshold FILE` and `EarlyExitConfig(threshold=FILE)` load.

Prompt files are `eecore eval`'s (eecore.evaluation.prompt_sets: one prompt per line, or JSONL objects with
a "prompt"). A "reference" is accepted and ignored: calibration compares with the model's own
full-depth output, not with a reference.
The prompts must be drawn like the ones the thresholds will serve (the guarantee assumes i.i.d.).

`--exit-ready` calibrates the exit threshold of the exit-ready layer preset's drafts instead
(`LayerDrafts.exit_threshold`, drafts emitted unverified; `--exit-measure agreement` to calibrate on
the learned exit decision), by textual consistency only (eecore.speculative.exit_calibration). The
file it writes records every candidate; use the threshold it prints with `eecore generate
--exit-ready --exit-threshold T` (and the same `--exit-measure`).
"""
from __future__ import annotations

import argparse
import sys


def add_parser(sub) -> argparse.ArgumentParser:
    from eecore.cli.args import add_precision_flags
    from eecore.exits.thresholds_file import CALIBRATED_MEASURES

    c = sub.add_parser("calibrate", help="calibrate early-exit thresholds (CALM's Learn-then-Test)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("--prompts", required=True, help="calibration prompts: text (one per line) or JSONL")
    c.add_argument("--out", required=True, help="the thresholds file to write (JSON)")
    c.add_argument("--tolerance", type=float, required=True,
                   help="delta: the tolerated expected inconsistency with full depth, per prompt")
    c.add_argument("--epsilon", type=float, required=True,
                   help="the allowed probability that the guarantee fails")
    c.add_argument("--measure", choices=CALIBRATED_MEASURES, default=None,
                   help="the early-exit measure to calibrate (required unless --exit-ready)")
    c.add_argument("--exit-ready", action="store_const", const="layer", default=None,
                   help="calibrate the exit threshold of the exit-ready layer preset's drafts (--consistency text)")
    c.add_argument("--exit-measure", default=None,
                   help="--exit-ready: what the exit threshold compares with ('agreement': the learned exit "
                        "decision; default: the draft's top-1 probability)")
    c.add_argument("--batch-rule", choices=["all", "compact"], default="all")
    c.add_argument("--classifier", default=None, help="exit classifier file (measure 'classifier')")
    c.add_argument("--exit-decision", default=None, metavar="FILE",
                   help="decision file of measure 'agreement' (default: the shipped one, with --exit-adapter)")
    c.add_argument("--min-exit-layer", type=int, default=1)
    c.add_argument("--check-every", type=int, default=1)
    c.add_argument("--decay", type=float, default=None, help="calibrate CALM's decaying threshold with this tau")
    c.add_argument("--consistency", choices=["token", "text"], default="token",
                   help="token: per-token agreement from one teacher-forced full-depth pass; text: generate "
                        "with each candidate and compare the whole output with full depth")
    c.add_argument("--text-loss", choices=["rouge-l", "exact"], default="rouge-l")
    c.add_argument("--family", choices=["global", "per-layer"], default="global",
                   help="one threshold, or one per layer along a 1-D family shaped on half the prompts")
    c.add_argument("--p-value", choices=["hoeffding-bentkus", "binomial"], default="hoeffding-bentkus")
    c.add_argument("--candidates", type=int, default=None, metavar="N",
                   help="test N evenly spaced thresholds from 1 down to 0 (default: steps of 0.01 plus "
                        "points close to 1)")
    c.add_argument("--max-tokens", type=int, default=64, help="generation length of calibration (and decay's N)")
    c.add_argument("--ignore-eos", action="store_true")
    c.add_argument("--chat", choices=["auto", "on", "off"], default="auto",
                   help="wrap each prompt in the model's chat template (auto: when it has one)")
    g = c.add_argument_group("model")
    g.add_argument("--model", default=None, help="HF model directory or .gguf file (default: embedded SmolLM2-135M)")
    add_precision_flags(g)
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    g.add_argument("--max-num-seqs", type=int, default=32)
    g.add_argument("--num-blocks", type=int, default=None, help="KV cache blocks (default: from free memory)")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--exit-adapter", nargs="?", const=True, default=None, metavar="FILE",
                   help="calibrate exits read through exit adapters: the shipped ones (no FILE), or a file")
    c.set_defaults(func=cmd_calibrate)
    return c


def cmd_calibrate(args) -> int:
    if args.exit_ready is not None:
        return _calibrate_draft_exits(args)
    if args.measure is None:
        print("eecore calibrate: --measure is required (softmax, cosine, classifier or agreement), unless "
              "--exit-ready",
              file=sys.stderr)
        return 2
    import eecore
    from eecore.cli.args import prompt_input
    from eecore.exits import thresholds_file
    from eecore.exits.calibrator import CalibrationSettings, calibrate
    from eecore.evaluation.prompt_sets import read_prompt_file

    try:
        candidates = None
        if args.candidates is not None:
            if args.candidates < 2:
                raise ValueError(f"--candidates must be >= 2, got {args.candidates}")
            candidates = [1.0 - i / (args.candidates - 1) for i in range(args.candidates)]
        settings = CalibrationSettings(
            measure=args.measure, tolerance=args.tolerance, epsilon=args.epsilon, batch_rule=args.batch_rule,
            classifier_path=args.classifier, decision_path=args.exit_decision, min_exit_layer=args.min_exit_layer, check_every=args.check_every,
            decay=args.decay, p_value=args.p_value, consistency=args.consistency, text_loss=args.text_loss,
            family=args.family, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos, candidates=candidates)
        settings.early_exit()  # the early-exit settings' own checks, before loading anything
        texts = [p.prompt for p in read_prompt_file(args.prompts)]
        llm = eecore.LLM(args.model, dtype=args.dtype, device=args.device, exit_adapter=args.exit_adapter,
                         quantization=args.quantization, max_num_seqs=args.max_num_seqs,
                         num_blocks=args.num_blocks, block_size=args.block_size)
        prompts = [prompt_input(llm, p, args.chat) for p in texts]
        result = calibrate(llm, prompts, settings, prompts_file=args.prompts)
    except ValueError as exc:
        print(f"eecore calibrate: {exc}", file=sys.stderr)
        return 2
    if not result.passed:
        print(f"eecore calibrate: {result.summary()}; {args.out} not written. Loosen --tolerance / --epsilon, "
              f"add prompts, or use a better exit signal (exit adapters, a classifier).", file=sys.stderr)
        return 1
    thresholds_file.save(result.data, args.out)
    print(f"eecore calibrate: {result.summary()}; wrote {args.out}")
    return 0


def _calibrate_draft_exits(args) -> int:
    import json

    import eecore
    from eecore.cli.args import prompt_input
    from eecore.cli.speculative_flags import preset_with
    from eecore.evaluation.prompt_sets import read_prompt_file
    from eecore.speculative.exit_calibration import calibrate_exit_threshold

    try:
        if args.consistency != "text":
            raise ValueError("--exit-ready calibrates by textual consistency: give --consistency text")
        if args.measure is not None or args.exit_adapter not in (None, True) or args.model is not None:
            raise ValueError("--exit-ready calibrates the shipped draft layers on the default model: leave out "
                             "--measure, --exit-adapter and --model")
        candidates = None
        if args.candidates is not None:
            if args.candidates < 2:
                raise ValueError(f"--candidates must be >= 2, got {args.candidates}")
            candidates = [1.0 - i / (args.candidates - 1) for i in range(args.candidates)]
        spec = preset_with(eecore.SelfSpeculativeConfig.exit_ready("layer", device=args.device),
                           dict(exit_threshold=1.0, exit_measure=args.exit_measure))
        texts = [p.prompt for p in read_prompt_file(args.prompts)]
        llm = eecore.LLM(dtype=args.dtype, device=args.device, exit_adapter=True, quantization=args.quantization,
                         max_num_seqs=args.max_num_seqs, num_blocks=args.num_blocks, block_size=args.block_size,
                         speculative=spec)
        prompts = [prompt_input(llm, p, args.chat) for p in texts]
        result = calibrate_exit_threshold(llm, prompts, args.tolerance, args.epsilon, max_tokens=args.max_tokens,
                                          ignore_eos=args.ignore_eos, candidates=candidates, loss=args.text_loss,
                                          p_value=args.p_value)
    except ValueError as exc:
        print(f"eecore calibrate: {exc}", file=sys.stderr)
        return 2
    tested = result.data["candidates"]
    last = tested[-1] if tested else None
    if not result.passed:
        print(f"eecore calibrate: no exit threshold below 1 passed (first failure: {last}); {args.out} not "
              f"written", file=sys.stderr)
        return 1
    result.data["prompts_file"] = args.prompts
    with open(args.out, "w") as f:
        json.dump(result.data, f, indent=1)
    chosen = next(c for c in tested if c["threshold"] == result.threshold)
    measure = "" if args.exit_measure is None else f" --exit-measure {args.exit_measure}"
    print(f"eecore calibrate: exit threshold {result.threshold:g} (risk {chosen['risk']:.3f}, "
          f"{chosen['exit_share']:.0%} of tokens exit); wrote {args.out}. Use: eecore generate --exit-ready "
          f"layer{measure} --exit-threshold {result.threshold:g}")
    return 0
