"""The scripts a lent GPU runs (tools/gpu_check.sh and the bench scripts it calls), run here on the
CPU with a tiny model: a GPU session has minutes, and a script that fails there loses them. Each
must finish and write what it measured (to a temporary results folder)."""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

import eecore

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_bench(script: str, *args: str, results: str) -> subprocess.CompletedProcess:
    # the eecore these tests import (the source tree with its built library, or the installed package)
    package_root = os.path.dirname(os.path.dirname(eecore.__file__))
    env = dict(os.environ, PYTHONPATH=package_root, EECORE_RESULTS_DIR=results)
    return subprocess.run([sys.executable, script, *args], cwd=os.path.join(REPO, "bench"), env=env,
                          capture_output=True, text=True, timeout=600)


def written(results: str, pattern: str) -> dict:
    files = glob.glob(os.path.join(results, "*", pattern))
    assert len(files) == 1, files
    with open(files[0]) as f:
        return json.load(f)


def test_gpu_check_is_valid_bash():
    subprocess.run(["bash", "-n", os.path.join(REPO, "tools", "gpu_check.sh")], check=True)


def test_e2e_with_every_section(tmp_path):
    """Decode (sampled, seeded) against eager and against an engine under --ab-env, piecewise graphs, and the
    exit section (static exits, softmax checks, LayerSkip drafts, a draft copy with and without perfect drafts)
    on a 4-layer shape."""
    done = run_bench("cuda_e2e.py", "--device", "cpu", "--models", "tiny", "--exit-models", "tiny",
                     "--batch-sizes", "1", "2", "--max-tokens", "3", "--repeats", "1", "--piecewise", "--no-hf",
                     "--temperature", "1",
                     "--dtype", "float32", "--ab-env", "EECORE_LINEAR_KERNEL=gemv,EECORE_SILU_AND_MUL_KERNEL=fused",
                     "--ab-env", "EECORE_PDL=1", results=str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    out = written(str(tmp_path), "cpu-e2e-*.json")
    assert len(out["rows"]) == 2 and len(out["piecewise"]) == 2
    assert [len(row["variants"]) for row in out["rows"]] == [2, 2]
    assert all(v["identical"] == f"{row['batch']}/{row['batch']}" for row in out["rows"] for v in row["variants"])
    configs = {row["config"] for row in out["exits"]}
    assert {"static exit E=1", "softmax check at E=2, all exit", "draft copy E=1 d=3, perfect drafts",
            "draft copy E=1 d=3, perfect drafts, ahead", "draft copy E=1 d=3, perfect drafts, ahead, verify ahead",
            "draft copy E=1 d=3, perfect drafts, fused"} <= configs
    assert len(out["exits"]) == 2 * len(configs)


def test_step_profile(tmp_path):
    done = run_bench("cuda_step_profile.py", "--device", "cpu", "--models", "tiny", "--batch-sizes", "1", "2",
                     "--steps", "2", "--dtype", "float32", "--exit-configs", "static exit E=1", "copy",
                     "--ab-env", "EECORE_PREFETCH_WEIGHTS=1", results=str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = written(str(tmp_path), "cpu-step-profile-*.json")["rows"]
    configs = ["full depth", "full depth, EECORE_PREFETCH_WEIGHTS=1", "static exit E=1"] + [
        f"draft copy E={E} d=3{mode}" for E in (1, 2)
        for mode in ("", ", ahead", ", ahead, verify ahead", ", fused", ", adaptive")]
    assert [(r["config"], r["batch"]) for r in rows] == [(c, b) for c in configs for b in (1, 2)]
    assert all(r["kernels_per_step"] > 0 for r in rows)
    assert all(set(r["host_us_per_step"]) == {"schedule", "build", "sample", "append"} for r in rows)


def test_row_kernels(tmp_path):
    done = run_bench("cuda_row_kernels.py", "--device", "cpu", "--models", "tiny", "--rows", "1", "3",
                     results=str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = written(str(tmp_path), "cpu-row-kernels-*.json")["rows"]
    assert [r["rows"] for r in rows] == [1, 3]
    assert {"linear qkv", "linear lm_head", "silu_and_mul", "rotary_embedding_and_cache", "layer chain"} <= \
        set(rows[0]["timings"])


def test_host_overhead(tmp_path):
    done = run_bench("cost_host.py", "--batch-sizes", "1", "3", "--steps", "4", "--out-name", "smoke",
                     results=str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = written(str(tmp_path), "smoke-*.json")["rows"]
    assert [r["batch"] for r in rows] == [1, 3] and all(r["steps"] > 0 for r in rows)


def test_host_overhead_of_speculation_rounds(tmp_path):
    """The stubbed rounds accept every draft: each timed round adds d + 1 tokens a sequence."""
    done = run_bench("cost_host.py", "--batch-sizes", "1", "3", "--steps", "4", "--speculate", "3",
                     "--out-name", "smoke", results=str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = written(str(tmp_path), "smoke-*.json")["rows"]
    # 4 rounds of 4 tokens make the 16 tokens after the first: had a draft been rejected, more
    assert [r["batch"] for r in rows] == [1, 3] and all(r["steps"] == 4 for r in rows)
    assert {"copy pass", "pick drafts", "verify", "accept"} <= set(rows[0]["parts_us"])


def test_host_overhead_of_the_gpu_preset_with_failing_drafts(tmp_path):
    """Every draft rejected: each sequence gains one token a step, drafting or planned out."""
    done = run_bench("cost_host.py", "--batch-sizes", "2", "--steps", "6", "--speculate", "3", "--gpu-preset",
                     "--failing-drafts", "--out-name", "smoke", results=str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    result = written(str(tmp_path), "smoke-*.json")
    assert result["failing_drafts"] and result["gpu_preset"]
    # the requests ask for 6 rounds of d + 1 = 4 tokens, which come one a step
    assert result["rows"][0]["tokens_per_sequence_and_step"] == 1 and result["rows"][0]["steps"] == 6 * 4


def test_host_overhead_of_the_gpu_preset_with_some_drafts_rejected(tmp_path):
    """--acceptance below 1: some verify rows disagree, so rounds bring fewer than d + 1 tokens."""
    done = run_bench("cost_host.py", "--batch-sizes", "4", "--steps", "8", "--speculate", "3", "--gpu-preset",
                     "--acceptance", "0.5", "--out-name", "smoke", results=str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    result = written(str(tmp_path), "smoke-*.json")
    # the requests ask for 8 rounds of 4 tokens: with drafts rejected, more than 8 rounds bring them
    assert result["acceptance"] == 0.5 and result["rows"][0]["steps"] > 8


@pytest.mark.parametrize("cell, message", [("1,2", "--cell: expected B,CTX,HQ,HKV,D"),
                                           ("1,256,32,8,128", "needs a CUDA device")])
def test_decode_sweep_arguments(tmp_path, cell, message):
    done = run_bench("cuda_decode_sweep.py", "--cell", cell, results=str(tmp_path))
    assert done.returncode != 0 and message in done.stderr


def test_gpu_check_runs_its_steps_in_the_order_named(tmp_path):
    """A dry run: `echo` stands in for Python and for the profilers, so every step runs its
    commands' shape and nothing else."""
    fake = tmp_path / "bin"
    fake.mkdir()
    for tool in ("ncu", "compute-sanitizer"):
        (fake / tool).write_text("#!/bin/sh\necho \"$0 $*\"\n")
        (fake / tool).chmod(0o755)
    env = dict(os.environ, PATH=f"{fake}:{os.environ['PATH']}", PYTHON="echo", OUT=str(tmp_path / "out"),
               EECORE_GPU_STEPS="build profile engine ncu bogus sweep")
    done = subprocess.run(["bash", os.path.join(REPO, "tools", "gpu_check.sh")], env=env, capture_output=True,
                          text=True, timeout=120)
    summary = (tmp_path / "out" / "summary.txt").read_text()
    steps = [line for line in summary.splitlines() if line.startswith("== ")]
    order = [next(word for word in ("build", "kernels", "engine", "Nsight", "sweep") if word in line)
             for line in steps[1:]]
    assert order == ["build", "kernels", "engine", "Nsight", "sweep"], steps
    assert "unknown step: bogus" in summary and done.returncode == 1
    assert (tmp_path / "out" / "logs.tar.gz").exists()
