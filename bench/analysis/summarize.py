"""Side-by-side ratios from a pytest-benchmark JSON: for every group, each baseline's median time
divided by eecore's (above 1: eecore is faster).

    python -m pytest bench/ --benchmark-enable --benchmark-json=bench/results/zen4/cpu-ops-DATE.json
    python bench/analysis/summarize.py bench/results/zen4/cpu-ops-DATE.json [--markdown out.md] [--compact]

--compact rewrites the JSON without the raw per-round timings (tens of MB), keeping every
statistic, so the file is small enough to commit. The JSON goes in the folder of the machine it ran
on (bench/results/README.md).
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict


def ratios(path: str) -> list[tuple[str, str, float, float]]:
    with open(path) as f:
        data = json.load(f)
    groups = defaultdict(dict)
    for b in data["benchmarks"]:
        groups[b["group"]][b["params"].get("impl", b["name"])] = b["stats"]["median"]
    rows = []
    for group, impls in sorted(groups.items()):
        ours = impls.get("eecore")
        if ours is None:
            continue
        for impl, median in sorted(impls.items()):
            if impl != "eecore":
                rows.append((group, impl, ours * 1e6, median / ours))
    return rows


def compact(path: str) -> None:
    with open(path) as f:
        data = json.load(f)
    for b in data["benchmarks"]:
        b["stats"].pop("data", None)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("json")
    ap.add_argument("--markdown", default=None)
    ap.add_argument("--compact", action="store_true", help="drop the raw timings from the JSON, in place")
    args = ap.parse_args()
    if args.compact:
        compact(args.json)
    lines = ["| group | baseline | eecore median (µs) | baseline / eecore |", "|---|---|---:|---:|"]
    for group, impl, ours_us, ratio in ratios(args.json):
        lines.append(f"| {group} | {impl} | {ours_us:.1f} | {ratio:.2f}x |")
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
