"""`eecore eval`'s outputs: the results table, the JSON file and the speed/quality plot."""
from __future__ import annotations

import json
import os
from typing import Optional


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(rows: list[dict]) -> str:
    """One line per strategy: throughput, speed-up, depth, agreement and ROUGE-L."""
    has_ref = any(r.get("rouge_l_to_reference") is not None for r in rows)
    width = max([len("strategy")] + [len(r["label"]) for r in rows]) + 2
    head = (f"{'strategy':<{width}}{'tok/s':>9}{'full':>9}{'speedup':>9}{'EE rate':>9}{'layers':>8}"
            f"{'agree':>8}{'exact':>7}{'R-L full':>10}" + (f"{'R-L ref':>9}{'(full)':>8}" if has_ref else ""))
    lines = [head]
    for r in rows:
        line = (f"{r['label']:<{width}}{r['tokens_per_s']:9.1f}{r['full_tokens_per_s']:9.1f}"
                f"{_fmt(r['speedup'], '9.2f')}{_fmt(r['early_exit_rate'], '9.2f')}"
                f"{_fmt(r['mean_layers_per_token'], '8.2f')}{r['token_agreement']:8.3f}{r['exact_match']:7.2f}"
                f"{r['rouge_l_to_full']:10.3f}")
        if has_ref:
            line += f"{_fmt(r['rouge_l_to_reference'], '9.3f')}{_fmt(r['full_rouge_l_to_reference'], '8.3f')}"
        lines.append(line)
    return "\n".join(lines)


def write_json(path: str, payload: dict) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=2, default=str)  # default=str: a thresholds file's PathLike


def plot(rows: list[dict], path: str, title: Optional[str] = None) -> None:
    """Speed-up over full depth against ROUGE-L to the full model's output, one labelled point per
    strategy: up and to the right is faster at no cost in agreement."""
    import matplotlib  # lazily: only `--plot` needs it

    matplotlib.use("Agg")  # no display on a server, and no window from a CLI run
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for r in rows:
        if r["speedup"] is None:
            continue
        ax.plot(r["rouge_l_to_full"], r["speedup"], "o")
        ax.annotate(r["label"], (r["rouge_l_to_full"], r["speedup"]), textcoords="offset points",
                    xytext=(4, 4), fontsize=7)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xlabel("ROUGE-L to the full model's output")
    ax.set_ylabel("speed-up over full depth")
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
