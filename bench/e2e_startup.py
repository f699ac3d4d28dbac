"""Start-up and memory of one short generation, from process start to exit, side by side:
`eecore generate "Hello" --max-tokens 8` (as `python -m eecore.cli`; by default over the file's own
blocks) and with `--quantization none` (the model dequantized to fp32), against llama-cpp-python
loading the same GGUF file and generating 8 tokens.

Each command runs `--repeats` times in a fresh process, alternated; the table gives the median wall
time and the median peak RSS (the child's ru_maxrss), and the file's size for scale.

    python bench/e2e_startup.py [--repeats 3]
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import time

from common import cpu_model, save_results
from eecore.models.loader import default_model_path

LLAMA_CPP = """
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_threads=2, n_ctx=512, verbose=False)
print(llm("Hello", max_tokens=8, temperature=0.0)["choices"][0]["text"])
"""


def measure(command: list[str]) -> tuple[float, float]:
    """(wall seconds, peak RSS in MB) of one fresh process (wait4's ru_maxrss of that child alone)."""
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    err = proc.stderr.read().decode()
    proc.stderr.close()
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{command[:4]} failed: {err[-2000:]}")
    return wall, usage.ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    path = default_model_path()
    eecore_cmd = [sys.executable, "-m", "eecore.cli", "generate", "Hello", "--max-tokens", "8", "--temperature", "0"]
    commands = {"eecore (Q4_1 blocks)": eecore_cmd,
                "eecore --quantization none (fp32)": eecore_cmd + ["--quantization", "none"]}
    if importlib.util.find_spec("llama_cpp") is not None:
        commands["llama-cpp-python"] = [sys.executable, "-c", LLAMA_CPP, path]
    results = {name: [] for name in commands}
    for _ in range(args.repeats):
        for name, command in commands.items():
            results[name].append(measure(command))
    size_mb = os.path.getsize(path) / 1e6
    print(f"CPU: {cpu_model()}; the model file: {size_mb:.0f} MB")
    rows = []
    for name, runs in results.items():
        wall = statistics.median(r[0] for r in runs)
        rss = statistics.median(r[1] for r in runs)
        rows.append(dict(command=name, wall_s=wall, peak_rss_mb=rss, runs=runs))
        print(f"{name:<36} {wall:5.2f} s  peak RSS {rss:6.0f} MB ({rss / size_mb:.1f}x the file)")
    print(f"results: {save_results('startup', dict(file_mb=size_mb, rows=rows))}")


if __name__ == "__main__":
    main()
