"""What one engine step costs as the batch grows, and what that allows a server to promise.

Iteration-level batching pays only while a step with R decode rows costs much less than R steps
of one row. This measures, on SmolLM2-135M (fp32, CPU, full depth), in one process:

- the decode-only step time at R running sequences (R in --rows, default 1 to 32);
- the cost a prefill token adds to a step (a mixed step of R decode rows and a chunk of C prompt
  tokens, against the decode-only step at the same R);
- the compute roofline: the multiply-adds per token over the fastest GEMM this CPU runs (torch.mm
  at a large batch, measured now), which bounds any batch size's throughput.

From the curve it derives the serving trade-off `bench/serve_load.py` tests (issue 14's goals):
with R decode rows per step and prompts of P tokens per G generated tokens, a step of R decodes
also carries R * P / G prefill tokens on average (every generated token brings its share of a
prompt), so

    throughput(R) = R / (t_decode(R) + R * P / G * t_prefill_token)
    ITL(R)        = t_decode(R) + (prefill tokens riding in that step) * t_prefill_token,

and the ratios against R = 1 say whether any max-num-seqs / token budget can meet "throughput at
32 clients >= 4x one client" together with "p99 ITL <= 3x one client".

    python bench/cost_step.py [--threads 1 2] [--rows 1 2 4 8 12 16 24 32] [--rounds 3] [--prompt-tokens P]

writes bench/results/<machine>/step_cost-<date>.{json,md}.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import eecore
from common import bench_prompt_ids, cpu_model, save_results


def gemm_peak_gflops(repeats: int = 10) -> float:
    """The fastest fp32 GEMM this CPU runs at the current thread count (GFLOP/s): torch.mm at a
    batch large enough to be compute-bound, on SmolLM2's widest projection shape."""
    a, w = torch.randn(512, 576), torch.randn(3072, 576)
    for _ in range(3):
        torch.mm(a, w.t())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, w.t())
        times.append(time.perf_counter() - start)
    return 2 * 512 * 576 * 3072 / min(times) / 1e9


def linear_flops_per_token(model, with_head: bool) -> float:
    """2 x the weights a token multiplies: every layer's, plus the LM head where logits are needed
    (a prompt token needs none but the last)."""
    from eecore.speculative.guard import layer_weight_bytes

    size = model.lm_head.element_size()
    n = sum(layer_weight_bytes(model, i) for i in range(model.num_layers)) / size
    if with_head:
        n += model.lm_head.numel()
    return 2.0 * n


class StepTimer:
    """Drives an LLMEngine directly: admits R requests, prefills them, then times steps."""

    def __init__(self, llm: eecore.LLM, prompts: list[list[int]]):
        self.engine = llm.engine
        self.prompts = prompts

    def _admit(self, rows: int, max_tokens: int):
        params = eecore.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        seqs = [self.engine.add_request(self.prompts[i % len(self.prompts)], params) for i in range(rows)]
        while any(s.in_prefill for s in seqs):  # prefill (not timed)
            self.engine.step()
        return seqs

    def _drain(self):
        while self.engine.has_unfinished():
            self.engine.step()

    def decode_step_s(self, rows: int, steps: int) -> float:
        """Median seconds of a decode-only step with `rows` running sequences."""
        self._admit(rows, max_tokens=steps + 2)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            self.engine.step()
            times.append(time.perf_counter() - start)
        self._drain()
        return statistics.median(times)

    def mixed_step_s(self, rows: int, chunk: int, steps: int) -> float:
        """Median seconds of a step with `rows` decodes plus a `chunk`-token prompt chunk."""
        times = []
        long_prompt = [t for p in self.prompts for t in p][: chunk * steps]
        for _ in range(steps):
            self._admit(rows, max_tokens=3)
            # a request whose next chunk is exactly `chunk` tokens rides in the next step
            saved = self.engine.config.max_num_batched_tokens
            self.engine.scheduler.max_num_batched_tokens = rows + chunk
            self.engine.add_request(long_prompt[:chunk] + [long_prompt[0]], eecore.SamplingParams(max_tokens=1))
            start = time.perf_counter()
            self.engine.step()
            times.append(time.perf_counter() - start)
            self.engine.scheduler.max_num_batched_tokens = saved
            self._drain()
        return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16, 24, 32])
    ap.add_argument("--chunk", type=int, default=16, help="prompt tokens in the timed mixed step")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per point and round (median kept)")
    ap.add_argument("--rounds", type=int, default=3, help="passes over all batch sizes (median kept)")
    ap.add_argument("--gen-tokens", type=int, default=48, help="generated tokens per request (serve_load's 48)")
    ap.add_argument("--prompt-tokens", type=float, default=None,
                    help="prompt tokens per request (default: the mean of serve_load's chat prompts)")
    ap.add_argument("--itl-goal", type=float, default=3.0, help="ITL ratio bound for the best row (issue 14: 3x)")
    ap.add_argument("--out-name", default="step_cost")
    args = ap.parse_args()

    llm = eecore.LLM(dtype="float32", device="cpu", max_num_seqs=max(args.rows) + 1, max_num_batched_tokens=4096)
    prompts = bench_prompt_ids(llm.tokenizer, "chat", max(args.rows))
    P = args.prompt_tokens or statistics.mean(len(p) for p in prompts)
    G = args.gen_tokens
    timer = StepTimer(llm, prompts)
    flops_decode = linear_flops_per_token(llm.model, with_head=True)
    flops_prefill = linear_flops_per_token(llm.model, with_head=False)
    load = [round(os.getloadavg()[0], 2)]

    runs = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        timer.decode_step_s(1, 4)  # warm-up at this thread count
        peak = gemm_peak_gflops()
        # rounds over all batch sizes, medians kept: a burst of load on a shared machine then
        # hits one round of every row count rather than every measurement of one
        samples = {rows: ([], []) for rows in args.rows}
        for _ in range(args.rounds):
            for rows in args.rows:
                samples[rows][0].append(timer.decode_step_s(rows, args.steps))
                samples[rows][1].append(timer.mixed_step_s(rows, args.chunk, max(3, args.steps // 3)))
        points = []
        for rows in args.rows:
            t_dec, t_mix = (statistics.median(v) for v in samples[rows])
            t_tok = max(0.0, (t_mix - t_dec) / args.chunk)
            points.append(dict(rows=rows, decode_step_ms=1e3 * t_dec, mixed_step_ms=1e3 * t_mix,
                               prefill_token_ms=1e3 * t_tok,
                               decode_gflops=rows * flops_decode / t_dec / 1e9))
            print(f"threads {threads} rows {rows:3d}: decode step {1e3 * t_dec:7.1f} ms "
                  f"({points[-1]['decode_gflops']:5.1f} GFLOP/s), +{args.chunk} prompt tokens {1e3 * t_mix:7.1f} ms")
        # the serving model (see the docstring); the prefill token cost is the median over R
        t_tok = statistics.median(p["prefill_token_ms"] for p in points) / 1e3
        base = points[0]
        one_client_tps = 1.0 / (base["decode_step_ms"] / 1e3 + P / G * t_tok)
        for p in points:
            step = p["decode_step_ms"] / 1e3 + p["rows"] * P / G * t_tok
            p["serve_tok_s"] = p["rows"] / step
            p["throughput_ratio"] = p["serve_tok_s"] / one_client_tps
            p["itl_ratio"] = step / (base["decode_step_ms"] / 1e3)
        ceiling = peak * 1e9 / (flops_decode + P / G * flops_prefill)
        within = [p for p in points if p["itl_ratio"] <= args.itl_goal]
        best = max(within, key=lambda p: p["throughput_ratio"]) if within else None
        runs.append(dict(threads=threads, gemm_peak_gflops=peak, prefill_token_ms=1e3 * t_tok,
                         one_client_tok_s=one_client_tps, compute_ceiling_tok_s=ceiling,
                         compute_ceiling_ratio=ceiling / one_client_tps, points=points,
                         best_within_itl_goal=best))
    load.append(round(os.getloadavg()[0], 2))

    payload = dict(prompt_tokens=P, gen_tokens=G, chunk=args.chunk, load_average=load,
                   flops_per_decode_token=flops_decode, flops_per_prefill_token=flops_prefill, runs=runs)
    path = save_results(args.out_name, payload)
    md = path[:-5] + ".md"
    with open(md, "w") as f:
        f.write(_markdown(payload, args))
    print(f"wrote {path} and {md}")


def _markdown(payload: dict, args) -> str:
    lines = [f"# Engine step cost against batch size ({cpu_model()}, {os.cpu_count()} cores)", "",
             f"Reproduce: `python bench/cost_step.py --threads {' '.join(map(str, args.threads))} "
             f"--rows {' '.join(map(str, args.rows))} --rounds {args.rounds}`", "",
             f"SmolLM2-135M fp32, full depth. Load average before / after: {payload['load_average']}. "
             f"Serving model: {payload['prompt_tokens']:.0f} prompt tokens per {payload['gen_tokens']} generated "
             "(serve_load's chat prompts); each step of R decodes carries R x P / G prefill tokens.", ""]
    for run in payload["runs"]:
        lines += [f"## {run['threads']} thread(s)", "",
                  f"GEMM peak (torch.mm 512 x 576 x 3072): {run['gemm_peak_gflops']:.1f} GFLOP/s. "
                  f"A prefill token adds {run['prefill_token_ms']:.2f} ms to a step. "
                  f"One client: {run['one_client_tok_s']:.1f} tok/s (model). Compute ceiling at any batch: "
                  f"{run['compute_ceiling_tok_s']:.0f} tok/s = **{run['compute_ceiling_ratio']:.2f}x** one client.", "",
                  "| rows | decode step | GFLOP/s | + chunk | serve tok/s | throughput ratio | ITL ratio |",
                  "|---|---|---|---|---|---|---|"]
        for p in run["points"]:
            lines.append(f"| {p['rows']} | {p['decode_step_ms']:.1f} ms | {p['decode_gflops']:.1f} | "
                         f"{p['mixed_step_ms']:.1f} ms | {p['serve_tok_s']:.1f} | {p['throughput_ratio']:.2f}x | "
                         f"{p['itl_ratio']:.2f}x |")
        best = run["best_within_itl_goal"]
        lines += ["", f"Best row with an ITL ratio <= {args.itl_goal:g}x: "
                  + (f"{best['rows']} rows, throughput {best['throughput_ratio']:.2f}x one client."
                     if best else "none."), ""]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
