"""`eecore eval`: a decoding strategy against full depth on a prompt set, on the same weights.

    eecore eval --prompts code --early-exit softmax --sweep-threshold 0.5 0.7 0.9 \\
                --out eval.json --plot eval.png

The strategy is set by the same flags as `eecore generate` (--early-exit with any measure,
threshold, thresholds file or batch rule; --speculate with --draft layer|lookup|hybrid;
--exit-adapter; --draft-layers separate loads the model once per row, see eecore.evaluation.strategies). With
none of them, full depth is compared with itself (a sanity check: agreement and ROUGE-L 1.0,
speed-up about 1). One result row per strategy; sweeps make several rows:
  --sweep-threshold T ...   one row per threshold (each replaces --threshold; --threshold keeps its
                            meaning everywhere: one value, one per layer, or a thresholds file)
  --sweep-exit-layer E ...  one row per static exit layer or draft depth (each replaces --exit-layer)

Prompts (--prompts): "code" (held-out code-completion prompts, eecore.evaluation.prompts), "prose" (English
paragraphs from the descriptions of installed dependencies, with their continuations as
references), "instructions" (chat requests made from the held-out packages: write, explain or
summarize; eecore.sources.chat_prompts), "everyday" (everyday chat requests on held-out topics: a
poem, tips, an explanation; eecore.sources.general_chat_prompts), or a file: one prompt per line,
or JSONL {"prompt": ..., "reference": ...} (eecore.evaluation.prompt_sets). --chat auto wraps file prompts
and the two chat sets in the model's chat template when it has one, never the built-in completion
sets.

Reported per row (eecore.evaluation.metrics): tokens/s of the strategy and of full depth and the
speed-up (alternating runs, --repeats times, median times), early-exit rate and mean layers per
decoded token, token agreement and exact-match rate with full depth, ROUGE-L F1 to full depth's
output and, when the prompts have references, to the references. Greedy unless --temperature.
"""
from __future__ import annotations

import argparse
import copy
import itertools
import os
import sys

from eecore.cli import args as cli_args


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("eval", usage="eecore eval [options]",
                       help="speed-up and agreement of a strategy against full depth on a prompt set",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("evaluation")
    g.add_argument("--prompts", default="code", metavar="code|prose|instructions|everyday|FILE",
                   help="built-in set (code, prose, instructions, everyday) or a prompt file: text or JSONL "
                        "(default: code)")
    g.add_argument("--num-prompts", type=int, default=None,
                   help="how many prompts (built-in sets: 16 by default; files: the first N, all by default)")
    g.add_argument("--chat", choices=["auto", "on", "off"], default="auto",
                   help="chat template around each prompt (auto: for prompt files, when the model has one)")
    g.add_argument("--repeats", type=int, default=3, help="alternating timed runs of each side; medians")
    g.add_argument("--sweep-threshold", type=float, nargs="+", default=None, metavar="T",
                   help="one row per threshold (early exit with a measure)")
    g.add_argument("--sweep-exit-layer", type=int, nargs="+", default=None, metavar="E",
                   help="one row per exit layer (static early exit) or draft depth (--speculate)")
    g.add_argument("--out", default=None, metavar="FILE.json", help="write the results as JSON")
    g.add_argument("--plot", default=None, metavar="FILE.png", help="plot speed-up against ROUGE-L to full depth")
    cli_args.add_sampling_flags(p, max_tokens=64)
    cli_args.add_model_flags(p)
    p.set_defaults(func=cmd_eval)
    return p


def _fail(message: str):
    raise SystemExit(f"eecore eval: {message}")


def _label(strategy_args, early_exit, speculative) -> str:
    adapter = " +adapter" if strategy_args.exit_adapter else ""
    if speculative is not None:
        layer = speculative.layer
        depth = "" if layer is None else f" E={layer.exit_layer}"
        # the settings that tell sweep rows apart, where they are not the defaults
        extra = "" if layer is None or layer.stop_below is None else f" t={layer.stop_below:g}"
        if speculative.trusts_drafts:
            extra += f" exit={layer.exit_threshold:g}"
        if speculative.separate_draft_layers:
            extra += " separate" + (f" {layer.copy.dtype}" if layer.copy.dtype else "")
        return f"speculate {speculative.draft}{depth} d={speculative.num_speculations}{extra}{adapter}"
    if early_exit is None:
        return "full depth" + adapter
    if early_exit.measure == "static":
        return f"static E={early_exit.exit_layer}{adapter}"
    file = getattr(early_exit, "threshold_file", None)
    t = os.path.basename(file) if file else (f"t={early_exit.threshold:g}" if isinstance(early_exit.threshold, float)
                                             else "t=per-layer")
    rule = " compact" if early_exit.batch_rule == "compact" else ""
    return f"{early_exit.measure} {t}{rule}{adapter}"


def _one_strategy(args):
    """The Strategy of one setting of the flags (as cli_args.build_llm reads them, without loading a model)."""
    from eecore.evaluation.strategies import Strategy

    try:
        early_exit = cli_args.early_exit_config(args)
    except ValueError as exc:  # a bad setting or thresholds file: a message, not a traceback
        _fail(str(exc))
    speculative = cli_args.speculative_config(args) if args.speculate else None
    return Strategy(_label(args, early_exit, speculative), early_exit, speculative)


def strategies_from_args(args) -> list:
    """One Strategy per row: the flags as given, or one per value of the sweep."""
    if args.sweep_threshold is not None and args.sweep_exit_layer is not None:
        # thresholds belong to a confidence measure, exit layers to static exits and speculation
        _fail("--sweep-threshold and --sweep-exit-layer do not combine; sweep one of them")
    if args.sweep_threshold is not None and (args.early_exit in (None, "static")):
        _fail("--sweep-threshold needs --early-exit softmax, cosine, classifier or agreement")
    if args.sweep_exit_layer is not None and args.early_exit != "static" and not (
            args.speculate and args.draft != "lookup"):
        _fail("--sweep-exit-layer needs --early-exit static, or --speculate with --draft layer or hybrid")
    thresholds = [[t] for t in args.sweep_threshold] if args.sweep_threshold else [args.threshold]
    exit_layers = args.sweep_exit_layer or [args.exit_layer]
    out = []
    for threshold, exit_layer in itertools.product(thresholds, exit_layers):  # one of them has one value
        setting = copy.copy(args)
        setting.threshold, setting.exit_layer = threshold, exit_layer
        out.append(_one_strategy(setting))
    return out


def _check_against_model(strategies, base) -> None:
    """Every row's configuration must fit the model before any row runs (not after an hour of sweep)."""
    from eecore.llm import _strategy

    for s in strategies:
        try:
            _strategy(s.early_exit, s.speculative, base.model.num_layers, base.exit_adapters, base.model)
        except ValueError as exc:
            _fail(f"{s.label}: {exc}")


def cmd_eval(args) -> int:
    import eecore
    from eecore.evaluation import report as eval_report
    from eecore.evaluation.prompt_sets import PromptFileError, chat_mode, load_prompt_set

    _check_flags(args)
    strategies = strategies_from_args(args)
    try:
        items, builtin = load_prompt_set(args.prompts, args.num_prompts)
    except PromptFileError as exc:
        _fail(f"--prompts: {exc}")

    def load(speculative=None):
        return eecore.LLM(args.model, dtype=args.dtype, device=args.device, exit_adapter=args.exit_adapter,
                          quantization=args.quantization, speculative=speculative, max_num_seqs=args.max_num_seqs,
                          num_blocks=args.num_blocks, block_size=args.block_size, enforce_eager=args.enforce_eager,
                          **cli_args.runtime_options(args))

    # Rows with separate draft layers load the model each (evaluate.evaluate_strategy). The flags
    # are the same for every row, so either all rows do or none; then the base is the first row's
    # load: its adapters are the ones the rows read (the separate layers' file, pairs unmerged).
    first = strategies[0]
    try:
        base = load(first.speculative if first.loads_its_own_model else None)
    except ValueError as exc:  # e.g. separate draft layers on an encoder-decoder: a message
        _fail(f"{first.label}: {exc}")
    _check_against_model(strategies, base)
    chat = chat_mode(args.prompts, builtin, args.chat)
    prompts = [cli_args.prompt_input(base, item.prompt, chat) for item in items]
    references = [item.reference for item in items]
    params = cli_args.sampling_params(args)
    for i, prompt in enumerate(prompts):  # too long for the context, say: a message before any run
        try:
            base.engine.validate(prompt, params, i)
        except ValueError as exc:
            _fail(f"--prompts {args.prompts}: {exc}")
    rows = _run_rows(args, strategies, base, first, load, prompts, params, references)
    print(eval_report.table(rows))
    payload = dict(
        eecore=eecore.__version__, model=args.model or "SmolLM2-135M-Instruct (embedded)",
        num_layers=base.model.num_layers, device=str(base.device), dtype=str(base.dtype).replace("torch.", ""),
        exit_adapter=args.exit_adapter,
        prompts=dict(source=args.prompts, count=len(items), chat=chat,
                     with_references=sum(r is not None for r in references)),
        sampling={name: getattr(params, name) for name in eecore.SamplingParams.option_names()},
        repeats=args.repeats, max_num_seqs=args.max_num_seqs, rows=rows)
    _write(args, payload, rows, len(items))
    return 0


def _check_flags(args) -> None:
    from eecore.extras import MissingExtraError, require

    if args.plot:  # before the run, not after it
        try:
            require("matplotlib", "--plot")
        except MissingExtraError as exc:
            _fail(str(exc))
    if args.repeats < 1:
        _fail(f"--repeats must be >= 1, got {args.repeats}")
    if args.num_prompts is not None and args.num_prompts < 1:
        _fail(f"--num-prompts must be >= 1, got {args.num_prompts}")


def _run_rows(args, strategies, base, first, load, prompts, params, references) -> list[dict]:
    from tqdm.auto import tqdm

    from eecore.evaluation.strategies import evaluate_strategy

    rows = []
    with tqdm(total=len(strategies) * args.repeats * 2, desc="eval", unit="run", file=sys.stderr) as bar:
        for strategy in strategies:
            bar.set_postfix_str(strategy.label)
            reuse = strategy is first and first.loads_its_own_model
            rows.append(evaluate_strategy(base, strategy, prompts, params, args.repeats, references,
                                          tick=lambda: bar.update(1),
                                          load=(lambda _: base) if reuse else load))
    return rows


def _write(args, payload: dict, rows: list[dict], num_prompts: int) -> None:
    from eecore.evaluation import report as eval_report

    if args.out:
        eval_report.write_json(args.out, payload)
        print(f"results: {args.out}", file=sys.stderr)
    if args.plot:
        eval_report.plot(rows, args.plot, title=f"{os.path.basename(payload['model'])}, {payload['device']}, "
                                                f"{num_prompts} prompts ({os.path.basename(args.prompts)})")
        print(f"plot: {args.plot}", file=sys.stderr)
