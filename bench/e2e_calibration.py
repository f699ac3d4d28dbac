"""Calibrated early exit on SmolLM2-135M (fp32, CPU): what `eecore calibrate` lets exit at each
tolerance, and what that buys.

For each measure (softmax gap, cosine, CALM classifier; with `--exit-adapter`, the softmax gap,
cosine and the learned agreement read at the adapter layers) it records the calibration prompts at full depth once
(eecore.exits.calibration_data.record), then runs Learn-then-Test on that record for every
tolerance delta and batch rule (the record depends on neither: token consistency is measured at
batch 1, where the rules coincide). Each threshold that passes is then evaluated like `eecore eval`
does (eecore.evaluation.strategies.evaluate_strategy): on held-out prompts disjoint from the calibration ones,
alternating with full depth on the same weights, at the given batch size, where the rule "all"
(the batch exits together) and "compact" (each row leaves on its own) differ.

    python bench/e2e_calibration.py [--exit-adapter [FILE]] [--tolerances 0.05 0.1 0.2]
        [--epsilon 0.1] [--measures softmax cosine classifier] [--num-calibration 100]
        [--num-eval 16] [--batch-size 8] [--max-tokens 64] [--repeats 3] [--out-name NAME]

writes bench/results/<machine>/<name>-<date>.{json,md,png}. Calibration prompts: held-out code prompts
(eecore.evaluation.prompts.heldout_code_prompts) after the first `--num-eval`, which are the evaluation set
(the built-in `eecore eval --prompts code` set), so the two never overlap.
"""
from __future__ import annotations

import argparse
import os
import tempfile

import eecore
from eecore.evaluation import report as eval_report
from eecore.evaluation.strategies import Strategy, evaluate_strategy
from eecore.exits import thresholds_file
from eecore.exits.calibrator import CalibrationSettings, calibrate
from eecore.exits.config import EarlyExitConfig
from eecore.evaluation.prompts import heldout_code_prompts
from common import cpu_model, ensure_classifier, save_results


# Where each measure is checked on the original model: the early-exit sweep's choices
# (bench/e2e_early_exit.py). A softmax check reads the whole LM head, 21% of the model's bytes,
# so it runs every third layer from the middle on; cosine and the classifier are cheap.
CHECKS = {"softmax": dict(min_exit_layer=12, check_every=3),
          "cosine": dict(min_exit_layer=8, check_every=1),
          "classifier": dict(min_exit_layer=8, check_every=1)}


def split_prompts(num_eval: int, num_calibration: int) -> tuple[list[str], list[str]]:
    texts = heldout_code_prompts(num_eval + num_calibration)
    evaluation = texts[:num_eval]
    seen = set(evaluation)
    calibration = [t for t in texts[num_eval:] if t not in seen]
    if len(calibration) < num_calibration:
        raise SystemExit(f"only {len(calibration)} held-out calibration prompts, asked for {num_calibration}")
    return evaluation, calibration


def checks_for(measure: str, adapters) -> dict:
    if adapters is not None:  # only the adapter layers are checked
        return dict(min_exit_layer=min(adapters.exit_layers()), check_every=1)
    if measure not in CHECKS:
        raise SystemExit(f"e2e_calibration.py: measure {measure!r} needs --exit-adapter (its shipped "
                         f"decision file is fit for the shipped exit adapters)")
    return CHECKS[measure]


def label(measure: str, delta: float, rule: str) -> str:
    return f"{measure} d={delta} {rule}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--exit-adapter", nargs="?", const=True, default=None, metavar="FILE")
    ap.add_argument("--tolerances", type=float, nargs="+", default=[0.05, 0.1, 0.2])
    ap.add_argument("--epsilon", type=float, default=0.1)
    ap.add_argument("--measures", nargs="+", default=["softmax", "cosine", "classifier"],
                    choices=["softmax", "cosine", "classifier", "agreement"],
                    help="agreement: the learned decision, whose shipped file is fit for the exit adapters")
    ap.add_argument("--batch-rules", nargs="+", default=["all", "compact"], choices=["all", "compact"])
    ap.add_argument("--classifier", default=None, help="exit classifier file (default: the cached one, trained on first use)")
    ap.add_argument("--num-calibration", type=int, default=100)
    ap.add_argument("--num-eval", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out-name", default=None)
    args = ap.parse_args()
    name = args.out_name or ("cpu-calibration-adapter" if args.exit_adapter else "cpu-calibration")

    evaluation, calibration = split_prompts(args.num_eval, args.num_calibration)
    # a KV cache for the batch, not one sized from free memory: every evaluated strategy gets its own
    base = eecore.LLM(dtype="float32", device="cpu", exit_adapter=args.exit_adapter, max_num_seqs=args.batch_size,
                      num_blocks=512)
    params = eecore.SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    folder = tempfile.mkdtemp(prefix="eecore-thresholds-")
    print(f"CPU: {cpu_model()}; {len(calibration)} calibration and {len(evaluation)} evaluation prompts "
          f"(held-out code), batch {args.batch_size}, epsilon {args.epsilon}; thresholds files in {folder}",
          flush=True)

    calibrations, rows = [], []
    for measure in args.measures:
        calibrate_measure(base, measure, args, calibration, evaluation, params, folder, calibrations, rows)

    if rows:
        print(eval_report.table(rows))
    payload = dict(exit_adapter=args.exit_adapter, epsilon=args.epsilon, tolerances=args.tolerances,
                   num_calibration=len(calibration), num_eval=len(evaluation), batch_size=args.batch_size,
                   max_tokens=args.max_tokens, repeats=args.repeats, calibrations=calibrations, rows=rows)
    path = save_results(name, payload)
    stem = path[: -len(".json")]
    with open(stem + ".md", "w") as f:
        f.write(markdown(payload, cpu_model()))
    if rows:
        eval_report.plot(rows, stem + ".png", title=f"calibrated early exit, SmolLM2-135M"
                                                   f"{' + exit adapters' if args.exit_adapter else ''}, "
                                                   f"epsilon={args.epsilon}, batch {args.batch_size}")
    print(f"results: {path} (+ .md, .png)")


def calibrate_measure(base, measure, args, calibration, evaluation, params, folder, calibrations, rows):
    """One full-depth record for `measure`, Learn-then-Test for every tolerance and rule on it, and
    an evaluation of each threshold that passes; appends to `calibrations` and `rows`."""
    classifier = (args.classifier or ensure_classifier()) if measure == "classifier" else None
    checks = checks_for(measure, base.exit_adapters)
    record = None
    for delta in args.tolerances:
        for rule in args.batch_rules:
            settings = CalibrationSettings(measure=measure, tolerance=delta, epsilon=args.epsilon, batch_rule=rule,
                                           classifier_path=classifier, max_tokens=args.max_tokens, **checks)
            try:
                result = calibrate(base, calibration, settings, reuse=record)
            except ValueError as exc:  # e.g. a measure the exit adapters do not support
                print(f"{measure}: skipped: {exc}")
                calibrations.append(dict(measure=measure, tolerance=delta, batch_rule=rule, skipped=str(exc)))
                return
            record = result.record
            print(f"{label(measure, delta, rule)}: {result.summary()}", flush=True)
            calibrations.append(dict(measure=measure, tolerance=delta, batch_rule=rule, passed=result.passed,
                                     threshold=result.data["threshold"], checks=checks, summary=result.summary(),
                                     candidates=result.data["candidates"]))
            if not result.passed:
                continue
            path = os.path.join(folder, f"{measure}-{delta}-{rule}.json")
            thresholds_file.save(result.data, path)
            config = EarlyExitConfig(threshold=path, classifier_path=classifier)
            row = evaluate_strategy(base, Strategy(label(measure, delta, rule), early_exit=config), evaluation,
                                    params, args.repeats)
            row["strategy"]["threshold"] = result.data["threshold"]  # the value, not the temporary path
            rows.append(row)
            print(f"  speed-up {row['speedup']:.2f}, early-exit rate {row['early_exit_rate']:.2f}, "
                  f"layers {row['mean_layers_per_token']:.1f}, ROUGE-L to full {row['rouge_l_to_full']:.3f}",
                  flush=True)


def markdown(p: dict, cpu: str) -> str:
    """The trade-off table: every (measure, delta, rule), calibrated and evaluated."""
    evaluated = {r["label"]: r for r in p["rows"]}
    lines = [f"Calibrated early exit ({'exit adapters' if p['exit_adapter'] else 'original SmolLM2-135M'}), "
             f"CPU {cpu}; epsilon={p['epsilon']}, {p['num_calibration']} calibration prompts, "
             f"{p['num_eval']} held-out evaluation prompts, batch {p['batch_size']}, {p['max_tokens']} tokens.", "",
             "| measure | delta | rule | threshold | est. layers | speed-up | EE rate | layers/token | "
             "agreement | ROUGE-L to full |", "|---|---|---|---|---|---|---|---|---|---|"]
    for c in p["calibrations"]:
        if "skipped" in c:
            lines.append(f"| {c['measure']} | {c['tolerance']} | {c['batch_rule']} | skipped: {c['skipped']} |"
                         " | | | | | |")
            continue
        passed = [x for x in c["candidates"] if x["passed"]]
        est = f"{passed[-1]['mean_exit_layer']:.2f}" if passed else "-"
        r = evaluated.get(label(c["measure"], c["tolerance"], c["batch_rule"]))
        threshold = c["threshold"] if c["passed"] else "none passes"
        if isinstance(threshold, float):
            threshold = f"{threshold:.6g}"
        cells = ["-"] * 5 if r is None else [f"{r['speedup']:.2f}", f"{r['early_exit_rate']:.2f}",
                                             f"{r['mean_layers_per_token']:.1f}", f"{r['token_agreement']:.3f}",
                                             f"{r['rouge_l_to_full']:.3f}"]
        lines.append(f"| {c['measure']} | {c['tolerance']} | {c['batch_rule']} | {threshold} | {est} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
