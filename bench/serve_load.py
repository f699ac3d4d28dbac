"""Serving under load: `eecore serve` (a separate process) driven by the openai client with open-loop
Poisson arrivals at several rates, capped at 1, 8 and 32 requests in flight, over the chat prompts
of the other benches (bench_prompt_ids), each request's message numbered so that requests share
the chat template's system prompt and nothing more (eecore serve caches prefixes; --repeat-prompts
sends the 8 prompts cycled as they are). Reports TTFT and inter-token latency (p50, p99),
time per output token and throughput, for full depth, early exit and self-speculation, and checks
the batching goals: at 32 clients throughput >= 4x and p99 inter-token latency <= 3x the
single-client figures (both with requests arriving back to back, rate inf).

If llama-cpp-python[server] is installed, its server runs the same full-depth scenarios on the
same GGUF file and the table gets the throughput ratio; otherwise that row is skipped.

    python bench/serve_load.py                          # the default grid, about 10 minutes on 2 cores
    python bench/serve_load.py --concurrency 1 32 --rates inf --max-tokens 32 --strategies full

The server runs with `eecore serve`'s own batch defaults (--max-num-seqs, --max-num-batched-tokens)
unless this script is given other values for them.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import math
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

from common import PROMPT_KINDS, PROMPTS, bench_prompt_ids, chat_prompt_ids, cpu_model, save_results

STRATEGIES = {
    "full": [],
    "early-exit": ["--early-exit", "static", "--exit-layer", "24"],
    # the embedded model's exit-ready presets (SelfSpeculativeConfig.exit_ready): the shipped draft
    # layers as an int8 copy, alone or after prompt lookup; each runs plain full-depth steps above
    # the batch where its drafts stop paying
    "exit-ready-layer": ["--exit-ready", "layer"],
    "exit-ready-hybrid": ["--exit-ready", "hybrid"],
    # the hybrid preset as it was before it kept lookup drafts above 4 sequences on AMX-BF16
    "exit-ready-hybrid-stop-at-4": ["--exit-ready", "hybrid", "--disable-by-batch-size", "4"],
}


# ---- servers ----------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process on 127.0.0.1 and a free port, up once /health (or /v1/models) answers."""

    def __init__(self, argv: list[str], health: str = "/health", timeout: float = 180.0):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # stderr goes to a file, not a pipe: nobody reads a pipe while the server runs, and a server
        # that logs more than the pipe holds (llama.cpp's start-up dump does) would block on it
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(argv + ["--port", str(self.port)], stdout=subprocess.DEVNULL,
                                     stderr=self.log, text=True)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(self.url + health, timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.log.seek(0)
                tail = self.log.read()[-2000:]
                self.stop()
                raise RuntimeError(f"server {argv} did not start: {tail}")
            time.sleep(0.3)

    def metrics(self) -> dict[str, float]:
        from eecore.serve.metrics import parse_metrics

        return parse_metrics(httpx.get(self.url + "/metrics", timeout=10).text)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def engine_flags(args) -> list[str]:
    """The model and batch flags given to this bench; none means `eecore serve`'s own defaults."""
    flags = [] if args.dtype is None else ["--dtype", args.dtype]
    if args.max_num_seqs is not None:
        flags += ["--max-num-seqs", str(args.max_num_seqs)]
    if args.max_num_batched_tokens is not None:
        flags += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if args.no_prefix_caching:
        flags += ["--no-enable-prefix-caching"]
    return flags


def eecore_server(strategy: str, args) -> Server:
    return Server([sys.executable, "-m", "eecore.cli", "serve", *engine_flags(args),
                   "--max-waiting-requests", "4096", "--log-level", "warning", *STRATEGIES[strategy]])


def llama_cpp_server(model_path: str, n_ctx: int) -> Server | None:
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("llama_cpp.server") is None:
        return None
    # --interrupt_requests False: by default a new request cancels the one being generated, which
    # would cut concurrent streams short; its server runs one request at a time either way
    return Server([sys.executable, "-m", "llama_cpp.server", "--model", model_path, "--host", "127.0.0.1",
                   "--n_ctx", str(n_ctx), "--n_threads", str(os.cpu_count()), "--model_alias", "model",
                   "--interrupt_requests", "False"],
                  health="/v1/models")


# ---- the load generator ------------------------------------------------------------------------

async def _one(client, model: str, prompt: list[int] | str, max_tokens: int, sampling: dict, extra: dict,
               t0: float) -> dict:
    sent = time.perf_counter()
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, **sampling,
                                             stream=True, stream_options={"include_usage": True}, extra_body=extra)
    arrivals, tokens = [], None
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].text:
            arrivals.append(now)
        if getattr(chunk, "usage", None) is not None:
            tokens = chunk.usage.completion_tokens
    done = time.perf_counter()
    return {"sent": sent - t0, "done": done - t0, "ttft": arrivals[0] - sent if arrivals else math.nan,
            "itl": [b - a for a, b in zip(arrivals, arrivals[1:])],
            "tokens": tokens if tokens is not None else len(arrivals)}


async def run_scenario(url: str, model: str, prompts: list[list[int]], max_tokens: int, concurrency: int,
                       rate: float, sampling: dict, extra: dict, seed: int) -> dict:
    """Open loop: request i is sent at its Poisson arrival time (all at once for rate inf), or as
    soon as fewer than `concurrency` requests are in flight."""
    import openai

    rng = random.Random(seed)
    gaps = [0.0 if math.isinf(rate) else rng.expovariate(rate) for _ in prompts]
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600,
                                http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=256), timeout=600))
    slots = asyncio.Semaphore(concurrency)
    t0 = time.perf_counter()

    async def launch(i: int, at: float):
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
        async with slots:
            return await _one(client, model, prompts[i], max_tokens, sampling, extra, t0)

    arrivals = [sum(gaps[: i + 1]) for i in range(len(prompts))]
    results = await asyncio.gather(*(launch(i, at) for i, at in enumerate(arrivals)))
    await client.close()
    return summarize(results)


def _pct(values: list[float], q: float) -> float:
    values = sorted(v for v in values if not math.isnan(v))
    if not values:
        return math.nan
    k = (len(values) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def summarize(results: list[dict]) -> dict:
    start = min(r["sent"] for r in results)
    end = max(r["done"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    itl = [g for r in results for g in r["itl"]]
    tpot = [(r["done"] - r["sent"] - r["ttft"]) / (r["tokens"] - 1) for r in results if r["tokens"] > 1]
    ttft = [r["ttft"] for r in results]
    return {"num_requests": len(results), "output_tokens": tokens, "duration_s": end - start,
            "throughput_tok_s": tokens / (end - start), "requests_per_s": len(results) / (end - start),
            "ttft_p50_s": _pct(ttft, 0.5), "ttft_p99_s": _pct(ttft, 0.99),
            "itl_p50_s": _pct(itl, 0.5), "itl_p99_s": _pct(itl, 0.99),
            "tpot_mean_s": statistics.fmean(tpot) if tpot else math.nan}


# ---- the grid ------------------------------------------------------------------------------------

def num_requests(concurrency: int, args) -> int:
    return args.num_requests or max(args.min_requests, 2 * concurrency)


def run_grid(url: str, model: str, prompt_pool: list[list[int]], args, extra: dict, server=None) -> list[dict]:
    rows = []
    for c in args.concurrency:
        for rate in args.rates:
            n = num_requests(c, args)
            prompts = [prompt_pool[i % len(prompt_pool)] for i in range(n)]
            before = server.metrics() if server is not None else {}
            # the client's own full collections (its imports are long-lived too) would show up as
            # inter-token gaps of 100+ ms that the server never caused
            gc.collect()
            gc.freeze()
            sampling = {"temperature": args.temperature, "top_p": args.top_p}
            row = asyncio.run(run_scenario(url, model, prompts, args.max_tokens, c, rate, sampling, extra, seed=c))
            row.update(concurrency=c, rate="inf" if math.isinf(rate) else rate)
            if server is not None:
                after = server.metrics()
                row.update(_engine_figures(before, after))
            rows.append(row)
            print(_line(row), flush=True)
    return rows


def _engine_figures(before: dict, after: dict) -> dict:
    def d(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    tokens = d("eecore_generation_tokens_total")
    steps = d("eecore_engine_steps_total")
    drafted = d("eecore_spec_draft_tokens_total")
    return {"mixed_step_fraction": d("eecore_engine_mixed_steps_total") / steps if steps else math.nan,
            "mean_layers_per_token": d("eecore_layers_run_total") / tokens if tokens else math.nan,
            "early_exit_rate": d("eecore_early_exit_tokens_total") / tokens if tokens else math.nan,
            "acceptance_rate": d("eecore_spec_accepted_tokens_total") / drafted if drafted else None,
            "mean_requests_per_step": d("eecore_step_num_requests_sum") / steps if steps else math.nan,
            # gauges of running totals, so the same difference applies
            "prefix_cache_hit_rate": (d("eecore_prefix_cache_hit_tokens") / d("eecore_prefix_cache_query_tokens")
                                      if d("eecore_prefix_cache_query_tokens") else None)}


def _line(row: dict) -> str:
    return (f"  c={row['concurrency']:>3} rate={row['rate']:>5}: {row['throughput_tok_s']:7.1f} tok/s, "
            f"TTFT p50/p99 {row['ttft_p50_s'] * 1e3:7.0f}/{row['ttft_p99_s'] * 1e3:7.0f} ms, "
            f"ITL p50/p99 {row['itl_p50_s'] * 1e3:6.1f}/{row['itl_p99_s'] * 1e3:6.1f} ms")


def goals(rows: list[dict]) -> dict:
    """The batching goals from the rate-inf rows at the lowest and highest concurrency."""
    inf = {r["concurrency"]: r for r in rows if r["rate"] == "inf"}
    if len(inf) < 2:
        return {}
    lo, hi = inf[min(inf)], inf[max(inf)]
    t = hi["throughput_tok_s"] / lo["throughput_tok_s"]
    i = hi["itl_p99_s"] / lo["itl_p99_s"]
    return {"from_concurrency": min(inf), "to_concurrency": max(inf), "throughput_ratio": t,
            "throughput_goal_met": t >= 4.0, "itl_p99_ratio": i, "itl_p99_goal_met": i <= 3.0}


def markdown(payload: dict) -> str:
    out = [f"# eecore serve under load ({payload['machine']}, {payload['cpu_count']} cores, {payload['date']})",
           "", f"Reproduce: `{payload['command']}`", "",
           f"Load average (1 min) before / after the run: {payload.get('load_average', '?')}. "
           f"Server flags: {' '.join(payload.get('engine_flags') or []) or 'the eecore serve defaults'}. "
           f"OMP_NUM_THREADS: {payload.get('omp_num_threads') or 'unset (torch uses every core)'}.", "",
           f"{payload['prompts']} prompts (bench_prompt_ids), {payload['max_tokens']} output tokens per request "
           f"(ignore_eos), greedy; requests per scenario: max({payload['min_requests']}, 2 x concurrency); "
           "ITL = gap between streamed chunks.", "",
           "| server | strategy | clients | rate (req/s) | tok/s | req/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 "
           "| TPOT | layers/token | early-exit | acceptance | seqs/step | mixed steps | prefix cache hits |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for server, strategies in payload["results"].items():
        for strategy, block in strategies.items():
            for r in block["rows"]:
                acc, hits = r.get("acceptance_rate"), r.get("prefix_cache_hit_rate")
                out.append(
                    f"| {server} | {strategy} | {r['concurrency']} | {r['rate']} | {r['throughput_tok_s']:.1f} | "
                    f"{r['requests_per_s']:.2f} | {r['ttft_p50_s'] * 1e3:.0f} ms | {r['ttft_p99_s'] * 1e3:.0f} ms | "
                    f"{r['itl_p50_s'] * 1e3:.1f} ms | {r['itl_p99_s'] * 1e3:.1f} ms | {r['tpot_mean_s'] * 1e3:.1f} ms | "
                    f"{r.get('mean_layers_per_token', math.nan):.1f} | {r.get('early_exit_rate', math.nan):.2f} | "
                    f"{'-' if acc is None else f'{acc:.2f}'} | {r.get('mean_requests_per_step', math.nan):.1f} | "
                    f"{r.get('mixed_step_fraction', math.nan):.0%} | {'-' if hits is None else f'{hits:.0%}'} |")
    out += ["", "Goals (rate inf, highest vs lowest concurrency): throughput >= 4x, p99 ITL <= 3x.", "",
            "| server | strategy | throughput ratio | met | p99 ITL ratio | met |", "|---|---|---|---|---|---|"]
    for server, strategies in payload["results"].items():
        for strategy, block in strategies.items():
            g = block.get("goals") or {}
            if g:
                out.append(f"| {server} | {strategy} | {g['throughput_ratio']:.2f}x | {g['throughput_goal_met']} | "
                           f"{g['itl_p99_ratio']:.2f}x | {g['itl_p99_goal_met']} |")
    if payload.get("llama_cpp"):
        out += ["", f"llama.cpp: {payload['llama_cpp']}"]
    return "\n".join(out) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategies", nargs="+", choices=list(STRATEGIES), default=list(STRATEGIES))
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--rates", nargs="+", type=float, default=[2.0, math.inf],
                   help="Poisson arrival rates in requests/s (inf: all at once)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="every request's temperature (the OpenAI API's default is 1)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-requests", type=int, default=4)
    p.add_argument("--num-requests", type=int, default=None, help="requests per scenario (default: see --min-requests)")
    p.add_argument("--prompts", choices=PROMPT_KINDS, default="chat")
    p.add_argument("--repeat-prompts", action="store_true",
                   help="send the 8 chat prompts as they are, cycled (before prefix caching the default); by "
                        "default each request's message starts with its own number, so requests share the chat "
                        "template's system prompt and nothing else, and the prefix cache cannot serve repeats")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="the eecore server's model dtype (default: eecore serve's)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="the server's running batch (default: eecore serve's default)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="the server's token budget per step (default: eecore serve's default)")
    p.add_argument("--no-llama-cpp", action="store_true")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="run eecore serve without prefix caching (its default is on)")
    p.add_argument("--out-name", default="serve_load")
    args = p.parse_args()

    from eecore.models.loader import default_model_path, load_model

    load_before = os.getloadavg()
    tokenizer = load_model(None).tokenizer
    if args.prompts == "chat" and not args.repeat_prompts:
        prompt_pool = [chat_prompt_ids(tokenizer, f"({i}) {PROMPTS[i % len(PROMPTS)]}") for i in range(64)]
    else:
        prompt_pool = bench_prompt_ids(tokenizer, args.prompts, 64)
    results: dict = {"eecore": {}}
    for strategy in args.strategies:
        print(f"eecore serve, {strategy}:", flush=True)
        server = eecore_server(strategy, args)
        try:
            asyncio.run(run_scenario(server.url, "SmolLM2-135M-Instruct", prompt_pool[:2], 8, 2, math.inf,
                                     {"temperature": args.temperature, "top_p": args.top_p}, {"ignore_eos": True},
                                     0))  # warm-up
            rows = run_grid(server.url, "SmolLM2-135M-Instruct", prompt_pool, args, {"ignore_eos": True}, server)
        finally:
            server.stop()
        results["eecore"][strategy] = {"flags": STRATEGIES[strategy], "rows": rows, "goals": goals(rows)}
        print(f"  goals: {results['eecore'][strategy]['goals']}", flush=True)

    llama_note = "skipped (--no-llama-cpp)" if args.no_llama_cpp else None
    if not args.no_llama_cpp:
        server = llama_cpp_server(default_model_path(), n_ctx=2048)
        if server is None:
            llama_note = "skipped: llama-cpp-python[server] is not installed"
        else:
            print("llama-cpp-python server, full depth:", flush=True)
            try:
                # llama-cpp-python's server takes text prompts only: the same chat-templated prompts
                # as text, special tokens included (its tokenizer parses them back); no ignore_eos
                # there, so a stream may end early and throughput counts the tokens it returned
                texts = [tokenizer.decode(p, skip_special_tokens=False) for p in prompt_pool]
                rows = run_grid(server.url, "model", texts, args, {})
            finally:
                server.stop()
            results["llama.cpp"] = {"full": {"rows": rows, "goals": goals(rows)}}
            ee = {(r["concurrency"], r["rate"]): r for r in results["eecore"].get("full", {}).get("rows", [])}
            ratios = {f"c={r['concurrency']} rate={r['rate']}": ee[(r["concurrency"], r["rate"])]["throughput_tok_s"]
                      / r["throughput_tok_s"] for r in rows if (r["concurrency"], r["rate"]) in ee}
            llama_note = f"eecore / llama.cpp throughput (full depth): {ratios}"
    print(llama_note)

    payload = {"benchmark": "serve_load", "command": "python bench/serve_load.py " + " ".join(sys.argv[1:]),
               "prompts": args.prompts + (" (repeated)" if args.repeat_prompts or args.prompts != "chat" else
                                          " (numbered: unique after the system prompt)"),
               "max_tokens": args.max_tokens, "min_requests": args.min_requests,
               "temperature": args.temperature, "top_p": args.top_p,
               "concurrency": args.concurrency, "rates": [str(r) for r in args.rates], "results": results,
               "llama_cpp": llama_note, "engine_flags": engine_flags(args),
               "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
               # other work on a shared machine moves every figure: the 1-minute load before and after
               "load_average": [round(load_before[0], 2), round(os.getloadavg()[0], 2)]}
    path = save_results(args.out_name, payload)
    import json

    with open(path) as f:
        payload = json.load(f)  # with the machine, date and core count save_results added
    md = path.removesuffix(".json") + ".md"
    with open(md, "w") as f:
        f.write(markdown(payload))
    print(f"wrote {path} and {md} ({cpu_model()})")


if __name__ == "__main__":
    main()
