"""Calibrated exits of the exit-ready copy, and whether they hold on other prompts: the
tolerance-to-speed curve.

For each kind of prompt (held-out code continuations; held-out everyday requests in the chat
template), the first `--calibrate` prompts calibrate the layer preset's exit threshold by textual
consistency (eecore.speculative.exit_calibration: CALM's Learn-then-Test on 1 - ROUGE-L to full
depth's output, `--epsilon`), once per exit measure (the draft's top-1 probability, and the learned
exit decision: `--exit-measure agreement`). One calibration at the largest of `--tolerances` records
every candidate's risk down to its first failure; each smaller tolerance's threshold follows from
the same record (a smaller tolerance fails no later in the fixed sequence). The next `--evaluate`
prompts, never seen by the calibration, then run at each threshold found: their mean ROUGE-L loss,
the share of tokens that exit, and the speed against full depth (prompt by prompt, alternated).

    python bench/e2e_draft_exit_calibration.py [--kinds code everyday] [--calibrate 32] [--evaluate 16]
        [--tolerances 0.05 0.1 0.2 0.3] [--epsilon 0.1] [--max-tokens 64] [--step 0.05] [--out-name NAME]

writes bench/results/<machine>/<NAME, default calibrated-draft-exits>-<date>.json, and .png: speed
against ROUGE-L to full depth, a point per kind, measure and tolerance (`eecore eval`'s plot).
"""
from __future__ import annotations

import argparse
import statistics
import time

import eecore
from common import cpu_model, save_results
from eecore.evaluation import report as eval_report
from eecore.exits.calibration import pvalue
from eecore.exits.calibrator import text_loss
from eecore.speculative.exit_calibration import calibrate_exit_threshold

MEASURES = {"top-1 probability": None, "agreement": "agreement"}


def prompts_of(kind: str, n: int, tokenizer) -> list:
    if kind == "code":
        from eecore.evaluation.prompts import heldout_code_prompts

        return [tokenizer.encode(t) for t in heldout_code_prompts(n)]
    from common import chat_prompt_ids
    from eecore.sources.general_chat_prompts import heldout_requests

    return [chat_prompt_ids(tokenizer, r.text) for r in heldout_requests(n)]


def threshold_at(candidates: list[dict], n: int, tolerance: float, epsilon: float, method: str):
    """The fixed-sequence test replayed on recorded candidates (most conservative first) at another
    tolerance: the last that passes before the first failure; None unless it is below 1.0."""
    chosen = None
    for c in candidates:
        if pvalue(method, c["risk"], n, tolerance) > epsilon:
            break
        chosen = c
    return chosen if chosen is not None and chosen["threshold"] < 1.0 else None


def evaluate(llm, full, threshold: float, prompts, params) -> dict:
    """The held-out prompts at `threshold`: mean ROUGE-L loss, share of tokens exiting, speed."""
    llm.engine.strategy.picker.exit_threshold = threshold
    losses, exits, tokens, ratios = [], 0, 0, []
    for p in prompts:
        t = time.perf_counter()
        ref = full.generate([p], params)[0]
        t_full = time.perf_counter() - t
        t = time.perf_counter()
        out = llm.generate([p], params)[0]
        t_exit = time.perf_counter() - t
        losses.append(text_loss("rouge-l", out.token_ids, ref.token_ids))
        exits += sum(e < llm.model.num_layers for e in out.exit_layers)
        tokens += len(out.exit_layers)
        ratios.append((t_full / max(len(ref.token_ids), 1)) / (t_exit / max(len(out.token_ids), 1)))
    return dict(heldout_mean_loss=sum(losses) / len(losses), heldout_exit_share=exits / max(tokens, 1),
                heldout_speed_vs_full=statistics.median(ratios))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kinds", nargs="+", choices=["code", "everyday"], default=["code", "everyday"])
    ap.add_argument("--calibrate", type=int, default=32)
    ap.add_argument("--evaluate", type=int, default=16)
    ap.add_argument("--tolerances", type=float, nargs="+", default=[0.2])
    ap.add_argument("--epsilon", type=float, default=0.1)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--step", type=float, default=0.05, help="candidate thresholds from 1.0 down to 0.5 by this")
    ap.add_argument("--out-name", default="calibrated-draft-exits")
    args = ap.parse_args()
    candidates = [round(1.0 - i * args.step, 10) for i in range(int(round(0.5 / args.step)) + 1)]
    tolerances = sorted(args.tolerances)

    full = eecore.LLM()
    print(f"CPU: {cpu_model()}; tolerances {tolerances}, epsilon {args.epsilon}, {args.max_tokens} tokens")
    rows = []
    for kind in args.kinds:
        prompts = prompts_of(kind, args.calibrate + args.evaluate, full.tokenizer)
        calib, held = prompts[: args.calibrate], prompts[args.calibrate:]
        params = eecore.SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=kind == "code")
        for name, measure in MEASURES.items():
            llm = eecore.LLM(exit_adapter=True, speculative=eecore.SelfSpeculativeConfig.exit_ready(
                "layer", exit_threshold=1.0, exit_measure=measure))
            result = calibrate_exit_threshold(llm, calib, tolerances[-1], args.epsilon, max_tokens=args.max_tokens,
                                              ignore_eos=kind == "code", candidates=candidates)
            recorded = result.data["candidates"]
            evaluated: dict[float, dict] = {}
            for tolerance in tolerances:
                chosen = threshold_at(recorded, len(calib), tolerance, args.epsilon, result.data["p_value"])
                row = dict(kind=kind, measure=name, tolerance=tolerance, calibration_prompts=len(calib),
                           evaluation_prompts=len(held), passed=chosen is not None,
                           threshold=None if chosen is None else chosen["threshold"],
                           calibration_risk=None if chosen is None else chosen["risk"],
                           calibration_exit_share=None if chosen is None else chosen["exit_share"],
                           candidates=recorded)
                if chosen is not None:
                    if chosen["threshold"] not in evaluated:
                        evaluated[chosen["threshold"]] = evaluate(llm, full, chosen["threshold"], held, params)
                    row.update(evaluated[chosen["threshold"]])
                rows.append(row)
                print(f"{kind:9s} {name:18s} tolerance {tolerance:<5} threshold {row['threshold']}"
                      + ("" if chosen is None else
                         f"  calibration risk {row['calibration_risk']:.3f}, exits {row['calibration_exit_share']:.3f}"
                         f"  | held out: loss {row['heldout_mean_loss']:.3f}, exits {row['heldout_exit_share']:.3f}, "
                         f"{row['heldout_speed_vs_full']:.2f}x full depth"), flush=True)
    path = save_results(args.out_name, dict(
        model="SmolLM2-135M-Instruct", preset="exit-ready layer", tolerances=tolerances, epsilon=args.epsilon,
        max_tokens=args.max_tokens, rows=rows))
    points = [dict(label=f"{r['kind']}, {r['measure']}, tol {r['tolerance']}", speedup=r["heldout_speed_vs_full"],
                   rouge_l_to_full=1.0 - r["heldout_mean_loss"]) for r in rows if r["passed"]]
    if points:
        eval_report.plot(points, path[: -len(".json")] + ".png",
                         title=f"calibrated exits of the exit-ready copy (layer 8), epsilon={args.epsilon}, held out")
    print(f"results: {path}")


if __name__ == "__main__":
    main()
