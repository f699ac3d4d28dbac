"""`eecore calibrate`: turn a tolerance on the inconsistency with full depth into early-exit
thresholds (CALM's Learn-then-Test; eecore.exits.calibrator), written to a thresholds file that
`eecore generate/bench --threshold FILE` and `EarlyExitConfig(threshold=FILE)` load.

Prompt files are `eecore eval`'s (eecore.evaluation.prompt_sets: one prompt per line, or JSONL objects with
a "prompt"). A "reference" is accepted and ignored: calibration compares with the model's own
full-depth output, not with a reference.
The prompts must be drawn like the ones the thresholds will serve (the guarantee assumes i.i.d.).
"""
from __future__ import annotations

import argparse
import sys


def add_parser(sub) -> argparse.ArgumentParser:
    from eecore.cli.args import add_precision_flags

    c = sub.add_parser("calibrate", help="calibrate early-exit thresholds (CALM's Learn-then-Test)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("--prompts", required=True, help="calibration prompts: text (one per line) or JSONL")
    c.add_argument("--out", required=True, help="the thresholds file to write (JSON)")
    c.add_argument("--tolerance", type=float, required=True,
                   help="delta: the tolerated expected inconsistency with full depth, per prompt")
    c.add_argument("--epsilon", type=float, required=True,
                   help="the allowed probability that the guarantee fails")
    c.add_argument("--measure", choices=["softmax", "cosine", "classifier"], required=True)
    c.add_argument("--batch-rule", choices=["all", "compact"], default="all")
    c.add_argument("--classifier", default=None, help="exit classifier file (measure 'classifier')")
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
            classifier_path=args.classifier, min_exit_layer=args.min_exit_layer, check_every=args.check_every,
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
