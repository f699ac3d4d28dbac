"""Where a decode step's time goes on a GPU: every kernel of the step, by name, from the profiler.

    PYTHONPATH=python python bench/cuda_step_profile.py [--models smollm2-135m llama-3.2-1b]
        [--batch-sizes 1 64] [--steps 32] [--top 12] [--enforce-eager] [--exit-configs TEXT ...]
        [--ab-env NAME=VALUE,... ...]

For each model shape (random weights, bf16) and batch size, a warm-up generate captures the CUDA
graphs, then `--steps` decode steps run under torch.profiler. Per step it prints the wall time,
the time the GPU was busy (the sum of kernel durations), how many kernels ran, and the kernels
that took the most time, with their count per step and mean duration. Wall time far above busy
time says the host is the limit (scheduling, input building, sampling, the sync that reads the
tokens); busy time spread over hundreds of few-microsecond kernels says the kernel count is.
With --exit-configs, the early-exit and self-speculation configurations of bench/cuda_e2e.py whose
names contain one of the words (e.g. `none static` for a softmax check that no row passes and a
static exit) are profiled the same way after full depth, each a row of its own (figures per
generated token: a step, except for self-speculation, whose round yields several). With --ab-env
full depth is profiled once more under each set of variables (built under them too).
Then the same steps run once more without the profiler, with the host's parts of a step timed
(schedule, input build, sample: the argmax, and the wait for the GPU when it is the slower, append
and stop checks): unprofiled wall time, and where the host's share of it goes.
Writes bench/results/<gpu>/<device>-step-profile-<date>.json. `--device cpu` checks the script.
"""
from __future__ import annotations

import argparse
import collections
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

import eecore
from common import device_folder, device_slug, save_results
from cuda_e2e import MODELS, SHAPES, exit_configs, pick_configs, random_checkpoint, with_env
from cost_host import PartTimer


def kernel_times(prof, device: str) -> dict[str, tuple[int, float]]:
    """{kernel name: (count, total microseconds)} of the profiled region's device kernels (CPU ops
    with --device cpu)."""
    totals: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if device == "cuda":
            if event.device_type != torch.autograd.DeviceType.CUDA:
                continue
            duration = event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
        else:
            if event.cpu_parent is not None:  # top-level ops only, or children count twice
                continue
            duration = event.cpu_time_total
        entry = totals[event.name]
        entry[0] += 1
        entry[1] += duration
    return {name: (count, us) for name, (count, us) in totals.items()}


def profile_steps(llm, prompts, steps: int, device: str) -> dict:
    params = eecore.SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    llm.generate(prompts, params)  # the same step sizes once unprofiled: captures, caches
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        llm.generate(prompts, params)
        if device == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    kernels = kernel_times(prof, device)
    per_step = steps + 1  # the prefill runs too; it is one step of the same count
    busy = sum(us for _, us in kernels.values()) / per_step
    launches = sum(count for count, _ in kernels.values()) / per_step
    top = sorted(kernels.items(), key=lambda item: -item[1][1])
    return dict(wall_us_per_step=wall / per_step * 1e6, busy_us_per_step=busy, kernels_per_step=launches,
                **host_parts(llm, prompts, params, per_step, device),
                kernels=[dict(name=name, per_step=count / per_step, us_per_step=us / per_step,
                              mean_us=us / max(count, 1)) for name, (count, us) in top])


def host_parts(llm, prompts, params, per_step: int, device: str) -> dict:
    """The same generate unprofiled, with the host's parts of each step timed (instance
    attributes wrap the engine's methods for this run only)."""
    engine = llm.engine
    timer = PartTimer()
    wrapped = [(engine.scheduler, "schedule", "schedule"), (engine.runner.builder, "build", "build"),
               (engine.runner.builder, "prepare_decode", "prepare_decode"), (engine.sampler, "sample", "sample"),
               (engine, "append_tokens", "append")]
    for owner, method, label in wrapped:
        timer.wrap(owner, method, label)
    try:
        start = time.perf_counter()
        llm.generate(prompts, params)
        if device == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    finally:
        for owner, method, _ in wrapped:
            delattr(owner, method)
    return dict(unprofiled_wall_us_per_step=wall / per_step * 1e6,
                host_us_per_step={label: seconds / per_step * 1e6 for label, seconds in timer.reset().items()})


def report(row: dict, top: int) -> None:
    host = ", ".join(f"{k} {v:.0f}" for k, v in row["host_us_per_step"].items())
    print(f"{row['model']} {row['config']} batch {row['batch']}: {row['wall_us_per_step']:.0f} us a step, GPU busy "
          f"{row['busy_us_per_step']:.0f} us in {row['kernels_per_step']:.0f} kernels; unprofiled "
          f"{row['unprofiled_wall_us_per_step']:.0f} us a step, host parts (us): {host}", flush=True)
    for k in row["kernels"][:top]:
        print(f"    {k['us_per_step']:8.1f} us  {k['per_step']:6.1f} x {k['mean_us']:7.2f} us  {k['name'][:110]}")


def save(args, rows: list[dict]) -> str:
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    return save_results(f"{device_slug(device_name)}-step-profile" + ("-eager" if args.enforce_eager else ""),
                        dict(device=device_name, dtype=args.dtype, steps=args.steps, prompt_len=args.prompt_len,
                             enforce_eager=args.enforce_eager, weights="random", rows=rows),
                        folder=device_folder(device_name) if args.device == "cuda" else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(SHAPES))
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--enforce-eager", action="store_true", help="launch op by op (no CUDA graphs)")
    ap.add_argument("--exit-configs", nargs="*", default=[], metavar="TEXT",
                    help="also profile bench/cuda_e2e.py's exit configurations whose names contain one of these")
    ap.add_argument("--ab-env", action="append", default=[], metavar="NAME=VALUE,...",
                    help="also profile full depth with these variables set (repeatable), e.g. "
                         "EECORE_PREFETCH_WEIGHTS=1 to see its side stream beside attention")
    ap.add_argument("--device", default="cuda", help="cpu only to check the script itself")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("cuda_step_profile.py needs a CUDA device")

    rows = []
    for name in args.models:
        with tempfile.TemporaryDirectory() as folder:
            random_checkpoint(name, folder, getattr(torch, args.dtype), "cpu")
            g = torch.Generator().manual_seed(1)
            prompts = [torch.randint(0, SHAPES[name]["vocab_size"], (args.prompt_len,), generator=g).tolist()
                       for _ in range(max(args.batch_sizes))]
            configs = {"full depth": ({}, {})}
            configs.update({f"full depth, {text}": ({}, dict(item.split("=", 1) for item in text.split(",") if item))
                            for text in args.ab_env})
            configs.update({label: ({k: v for k, v in kw.items() if k not in ("perfect", "env")}, kw.get("env", {}))
                            for label, kw in pick_configs(exit_configs(SHAPES[name]["num_hidden_layers"], 3),
                                                          args.exit_configs).items()
                            if not kw.get("perfect")})
            for label, (config, env) in configs.items():
                # built and run under the variables: some are read when the model is built
                llm = with_env(env, eecore.LLM, folder, dtype=args.dtype, device=args.device,
                               max_num_seqs=max(args.batch_sizes), enforce_eager=args.enforce_eager, **config)
                for batch in args.batch_sizes:
                    row = dict(model=name, config=label, batch=batch,
                               **with_env(env, profile_steps, llm, prompts[:batch], args.steps, args.device))
                    rows.append(row)
                    report(row, args.top)
                    path = save(args, rows)  # after every row: a run stopped by its time limit keeps them
                del llm
            if args.device == "cuda":
                torch.cuda.empty_cache()
    print(f"results: {path}")


if __name__ == "__main__":
    main()
