"""Early exit on SmolLM2-135M (fp32, CPU): every measure at several thresholds, both batch rules,
batch 1 and 8, each configuration alternating with full depth in the same run.

For each configuration it reports:
- tokens/s, and the speed-up over full depth (median times of the alternating runs);
- the early-exit rate and mean layers per decoded token (the first token comes from the prefill,
  which always runs every layer, and is left out of both);
- the ideal speed-up L / mean layers, and how much of it is realised;
- the bandwidth ideal: weight bytes at full depth over weight bytes at the mean exit depth. It
  counts the LM head and kv_fill's K/V projections, which an early-exited token still reads
  (roofline.py). Decode at batch 1 is bound by reading weights, so this is the reachable bound;
- wasted layers per token (rule "all"), and ROUGE-L against the full model's output ("To Full").
A threshold of 1.0 never exits: those rows measure the pure cost of the checks.

    python bench/e2e_early_exit.py [--max-tokens 64] [--batch-sizes 1 8] [--repeats 3] [--quick]
                                     [--prompts chat|code] [--exit-adapter [FILE]] [--out-name NAME]
writes bench/results/<machine>/cpu-early-exit-<date>.{json,png}. With `--exit-adapter` (the shipped adapters
without FILE) exiting tokens read through the exit adapters: the sweep is then static exits at the
adapter layers and the softmax gap (read through the adapters) at every adapter layer.
"""
from __future__ import annotations

import argparse
import statistics

import eecore
from eecore.text.rouge import rouge_l
from common import PROMPT_KINDS, bench_prompt_ids, cpu_model, ensure_classifier, save_results, timed
from roofline import weight_bytes_ideal_speedup

L = 30  # SmolLM2-135M


def adapter_configs(exit_layers: list[int], quick: bool):
    """With exit adapters: static exits at their layers, and the softmax gap checked at each."""
    out = [("static", f"E={E}", dict(measure="static", exit_layer=E)) for E in exit_layers]
    for rule in ("all", "compact"):
        for t in ([0.4, 1.0] if quick else [0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0]):
            out.append(("softmax", f"t={t} {rule}", dict(measure="softmax", threshold=t, min_exit_layer=exit_layers[0],
                                                         batch_rule=rule)))
    return out


def configs(classifier_path: str, quick: bool):
    """(measure, label, EarlyExitConfig kwargs) to sweep."""
    out = []
    for E in ([12, 20] if quick else [8, 12, 16, 20, 24]):
        out.append(("static", f"E={E}", dict(measure="static", exit_layer=E)))
    for rule in ("all", "compact"):
        # consecutive residual streams are nearly parallel: the useful thresholds sit close to 1
        for t in ([0.99, 1.0] if quick else [0.98, 0.99, 0.995, 0.998, 1.0]):
            out.append(("cosine", f"t={t} {rule}", dict(measure="cosine", threshold=t, min_exit_layer=8,
                                                        batch_rule=rule)))
        for t in ([0.5, 1.0] if quick else [0.3, 0.5, 0.7, 0.9, 1.0]):
            out.append(("softmax", f"t={t} {rule}", dict(measure="softmax", threshold=t, min_exit_layer=12,
                                                         check_every=3, batch_rule=rule)))
        for t in ([0.8] if quick else [0.6, 0.8, 0.9, 0.95]):
            out.append(("classifier", f"t={t} {rule}", dict(measure="classifier", threshold=t, min_exit_layer=8,
                                                            classifier_path=classifier_path, batch_rule=rule)))
    return out


def run(llm, prompts, params):
    outs, elapsed = timed(llm.generate, prompts, params)
    tokens = sum(len(o.token_ids) for o in outs)
    layers = [e for o in outs for e in o.exit_layers[1:]]  # the first token comes from the prefill
    wasted = [o.metrics.get("layers_wasted_per_token") for o in outs]
    return dict(outs=outs, seconds=elapsed, tokens=tokens, mean_layers=statistics.mean(layers),
                ee_rate=sum(e < L for e in layers) / len(layers),
                wasted=statistics.mean(wasted) if all(w is not None for w in wasted) else None)


def measure_pair(llm, base, groups, params, repeats):
    """The configuration and full depth, alternating group by group `repeats` times, so a burst
    of load on this shared machine hits both alike. Speed-up is the ratio of median times."""
    t_cfg, t_full, cfg_runs, full_runs = [], [], [], []
    for _ in range(repeats):
        cfg_runs = [run(llm, g, params) for g in groups]
        full_runs = [run(base, g, params) for g in groups]
        t_cfg.append(sum(r["seconds"] for r in cfg_runs))
        t_full.append(sum(r["seconds"] for r in full_runs))
    tokens = sum(r["tokens"] for r in cfg_runs)
    wasted = [r["wasted"] for r in cfg_runs]
    return dict(outs=[o for r in cfg_runs for o in r["outs"]], full_outs=[o for r in full_runs for o in r["outs"]],
                tok_s=tokens / statistics.median(t_cfg), full_tok_s=tokens / statistics.median(t_full),
                mean_layers=statistics.mean(r["mean_layers"] for r in cfg_runs),
                ee_rate=statistics.mean(r["ee_rate"] for r in cfg_runs),
                wasted=statistics.mean(wasted) if all(w is not None for w in wasted) else None)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeats", type=int, default=3, help="alternating runs per configuration; medians")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--prompts", choices=PROMPT_KINDS, default="chat",
                    help="the CLI's chat prompts, or held-out code-completion prompts")
    ap.add_argument("--exit-adapter", nargs="?", const=True, default=None, metavar="FILE",
                    help="exit adapters (the shipped ones without FILE): tokens read through them")
    ap.add_argument("--out-name", default=None, help="results file prefix (default: cpu-early-exit[-adapter][-code])")
    args = ap.parse_args()
    params = eecore.SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)

    # full depth runs the same weights as every configuration: an exit-ready file's LoRA pairs are
    # merged into both (a file without pairs leaves the base as it is)
    base = eecore.LLM(dtype="float32", device="cpu", max_num_seqs=8, exit_adapter=args.exit_adapter)
    if args.exit_adapter:
        sweep = adapter_configs(base.exit_adapters.exit_layers(), args.quick)
    else:
        sweep = configs(ensure_classifier(), args.quick)
    prompts_all = bench_prompt_ids(base.tokenizer, args.prompts, max(args.batch_sizes + [2]))
    print(f"CPU: {cpu_model()}; {len(prompts_all)} {args.prompts} prompts")
    rows = []
    for batch in args.batch_sizes:
        prompts = prompts_all[:batch] if batch > 1 else prompts_all[:2]
        groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
        base.generate(prompts[:1], eecore.SamplingParams(max_tokens=4))
        print(f"\nbatch {batch}")
        print(f"{'measure':<11}{'config':<16}{'tok/s':>8}{'full':>7}{'speedup':>8}{'ideal':>7}{'realised':>9}"
              f"{'EE rate':>8}{'layers':>7}{'wasted':>7}{'ROUGE-L':>8}{'bw ideal':>9}{'realised':>9}")
        for measure_name, label, kw in sweep:
            llm = eecore.LLM(dtype="float32", device="cpu", max_num_seqs=8, early_exit=eecore.EarlyExitConfig(**kw),
                             exit_adapter=args.exit_adapter)
            llm.generate(prompts[:1], eecore.SamplingParams(max_tokens=4))
            r = measure_pair(llm, base, groups, params, args.repeats)
            speedup = r["tok_s"] / r["full_tok_s"]
            ideal = L / r["mean_layers"]
            bw_ideal = weight_bytes_ideal_speedup(base.model, r["mean_layers"])
            rouge = statistics.mean(rouge_l(o.text, f.text) for o, f in zip(r["outs"], r["full_outs"]))
            row = dict(batch=batch, measure=measure_name, config=label, tok_s=r["tok_s"], full_tok_s=r["full_tok_s"],
                       speedup=speedup, ideal_speedup=ideal, realised=speedup / ideal,
                       bandwidth_ideal_speedup=bw_ideal, realised_of_bandwidth_ideal=speedup / bw_ideal,
                       ee_rate=r["ee_rate"], mean_layers=r["mean_layers"], wasted_layers=r["wasted"],
                       rouge_l_to_full=rouge)
            rows.append(row)
            wasted = f"{r['wasted']:.2f}" if r["wasted"] is not None else "-"
            print(f"{measure_name:<11}{label:<16}{r['tok_s']:8.1f}{r['full_tok_s']:7.1f}{speedup:8.2f}{ideal:7.2f}"
                  f"{speedup / ideal:9.2f}{r['ee_rate']:8.2f}{r['mean_layers']:7.1f}{wasted:>7}{rouge:8.3f}"
                  f"{bw_ideal:9.2f}{speedup / bw_ideal:9.2f}", flush=True)
    name = args.out_name or "-".join(["cpu-early-exit"] + (["adapter"] if args.exit_adapter else [])
                                     + (["code"] if args.prompts == "code" else []))
    path = save_results(name, dict(model="SmolLM2-135M-Instruct", max_tokens=args.max_tokens, prompts=args.prompts,
                                   exit_adapter=args.exit_adapter, repeats=args.repeats, full_depth_layers=L,
                                   rows=rows))
    plot(rows, path.replace(".json", ".png"))
    print(f"\nresults: {path}")


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 4.5), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        for measure in ("static", "cosine", "softmax", "classifier"):
            for rule, style in (("all", "-o"), ("compact", "--s")):
                pts = sorted((r["rouge_l_to_full"], r["speedup"]) for r in rows if r["batch"] == batch
                             and r["measure"] == measure and (measure == "static" or r["config"].endswith(rule)))
                if pts and (measure != "static" or rule == "all"):
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], style,
                            label=measure if measure == "static" else f"{measure} ({rule})")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xlabel("ROUGE-L to the full model's output")
        ax.set_ylabel("speed-up over full depth")
        ax.set_title(f"SmolLM2-135M, CPU, batch {batch}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
