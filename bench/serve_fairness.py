"""`eecore serve` under unfair load: a short request beside a long prefill, and the event loop beside
a huge body. One server process (the embedded model, `eecore serve`'s defaults), loopback only.

1. TTFT of a short streamed chat request alone, then sent 2 s after a streamed completion of a
   4,096-token (and an 8,191-token, the context minus one) prompt started; the issue's goal: within
   2x (alone + one step of the long prefill's chunk), and under 5 s on a 2-core CPU.
2. /health latency (median and max of 20 pings) alone, while a 5 MB body is sent (a 413 before it
   is parsed) and while a prompt just under the body limit is handled (refused by its length
   before it is tokenized).
3. TTFT of a short request sent 2 s after a request of 16 prompts of ~1,180 tokens each (one
   token each) started, and beside 6 concurrent 2 MB bodies of 68,000 empty chat messages (each
   refused by its length; the issue's goal for both: under 1 s on a 2-core CPU).

    python bench/serve_fairness.py [--long-tokens 4096 8191] [--max-tokens 16] [--multi-prompts 16]

Writes bench/results/<machine>/serve-fairness-<date>.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

import httpx

from common import cpu_model, save_results
from serve_load import Server


def _text_of(chunk: dict) -> str:
    choice = (chunk.get("choices") or [{}])[0]
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def _first_token_s(client: httpx.AsyncClient, body: dict, route: str) -> float:
    sent = time.perf_counter()
    async with client.stream("POST", route, json={**body, "stream": True}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            data = line.removeprefix("data:").strip()
            if line.startswith("data:") and data != "[DONE]" and _text_of(json.loads(data)):
                return time.perf_counter() - sent
    raise RuntimeError("the stream ended without a token")


async def _long_stream(client: httpx.AsyncClient, prompt: list[int], max_tokens: int, started: asyncio.Event):
    async with client.stream("POST", "/v1/completions", json={
            "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}) as r:
        started.set()
        async for _ in r.aiter_lines():
            pass


async def ttft_beside(url: str, long_tokens: int, max_tokens: int) -> dict:
    short = {"messages": [{"role": "user", "content": "Name three primary colors."}], "max_tokens": max_tokens,
             "temperature": 0}
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        alone = [await _first_token_s(client, short, "/v1/chat/completions") for _ in range(3)]
        prompt = [(i * 7919) % 40000 + 100 for i in range(long_tokens)]
        started = asyncio.Event()
        long_task = asyncio.ensure_future(_long_stream(client, prompt, 1, started))
        await started.wait()
        await asyncio.sleep(2.0)
        beside = await _first_token_s(client, short, "/v1/chat/completions")
        long_task.cancel()
        try:
            await long_task
        except (asyncio.CancelledError, httpx.HTTPError):
            pass
    return {"long_prompt_tokens": long_tokens, "ttft_alone_s": statistics.median(alone), "ttft_beside_s": beside}


_SHORT = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 1, "temperature": 0}


async def ttft_beside_multi_prompt(url: str, prompts: int, tokens: int) -> dict:
    """A short request's TTFT sent 2 s after one request of `prompts` prompts of `tokens` tokens."""
    async with httpx.AsyncClient(base_url=url, timeout=900) as client:
        alone = statistics.median([await _first_token_s(client, _SHORT, "/v1/chat/completions") for _ in range(3)])
        body = {"prompt": [[(i * 7919 + 31 * j) % 40000 + 100 for i in range(tokens)] for j in range(prompts)],
                "max_tokens": 1, "temperature": 0}
        long_task = asyncio.ensure_future(client.post("/v1/completions", json=body))
        await asyncio.sleep(2.0)
        beside = await _first_token_s(client, _SHORT, "/v1/chat/completions")
        t = time.perf_counter()
        await long_task
        rest = time.perf_counter() - t
    return {"prompts": prompts, "prompt_tokens": tokens, "ttft_alone_s": alone, "ttft_beside_s": beside,
            "multi_prompt_request_finished_s_later": rest}


async def ttft_beside_many_messages(url: str, bodies: int = 6, messages: int = 68_000) -> dict:
    """A short request's TTFT while `bodies` requests of `messages` empty chat messages each arrive."""
    body = json.dumps({"messages": [{"role": "user", "content": ""}] * messages, "max_tokens": 1},
                      separators=(",", ":")).encode()
    async with httpx.AsyncClient(base_url=url, timeout=900) as client:
        async def send():
            r = await client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
            return r.status_code
        senders = [asyncio.ensure_future(send()) for _ in range(bodies)]
        await asyncio.sleep(0.05)
        beside = await _first_token_s(client, _SHORT, "/v1/chat/completions")
        statuses = await asyncio.gather(*senders)
    return {"bodies": bodies, "body_bytes": len(body), "statuses": sorted(set(statuses)), "ttft_beside_s": beside}


async def _pings(url: str, n: int = 20) -> list[float]:
    out = []
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        for _ in range(n):
            t = time.perf_counter()
            (await client.get("/health")).raise_for_status()
            out.append(time.perf_counter() - t)
            await asyncio.sleep(0.02)
    return out


async def health_beside(url: str, body: bytes) -> dict:
    async def send():
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            try:
                r = await client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
                return r.status_code, time.perf_counter()
            except httpx.HTTPError:  # a 413 answered (and the connection closed) before the upload ended
                return "closed mid-upload", time.perf_counter()

    t0 = time.perf_counter()
    sender = asyncio.ensure_future(send())
    pings = await _pings(url)
    status, done = await sender
    return {"body_bytes": len(body), "status": status, "answered_s": done - t0,
            "health_median_ms": 1e3 * statistics.median(pings), "health_max_ms": 1e3 * max(pings)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--long-tokens", type=int, nargs="+", default=[4096, 8191])
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--multi-prompts", type=int, default=16, help="prompts of the multi-prompt request (3.)")
    ap.add_argument("--multi-prompt-tokens", type=int, default=1180)
    args = ap.parse_args()
    server = Server([sys.executable, "-m", "eecore.cli", "serve", "--log-level", "warning"])
    try:
        # on an idle server first: what the other phases leave running (a cancelled stream's request)
        # must not count here
        multi = asyncio.run(ttft_beside_multi_prompt(server.url, args.multi_prompts, args.multi_prompt_tokens))
        print(f"short TTFT 2 s after a request of {multi['prompts']} prompts of {multi['prompt_tokens']} tokens: "
              f"{multi['ttft_beside_s']:.2f} s (alone {multi['ttft_alone_s']:.2f} s; that request finished "
              f"{multi['multi_prompt_request_finished_s_later']:.1f} s later)", flush=True)
        messages = asyncio.run(ttft_beside_many_messages(server.url))
        print(f"short TTFT beside {messages['bodies']} bodies of {messages['body_bytes'] / 1e6:.1f} MB of empty "
              f"messages: {messages['ttft_beside_s']:.2f} s (they got {messages['statuses']})", flush=True)
        rows = [asyncio.run(ttft_beside(server.url, n, args.max_tokens)) for n in args.long_tokens]
        for row in rows:
            print(f"short TTFT beside a {row['long_prompt_tokens']}-token prefill: {row['ttft_beside_s']:.2f} s "
                  f"(alone {row['ttft_alone_s']:.2f} s)", flush=True)
        idle = asyncio.run(_pings(server.url))
        huge = asyncio.run(health_beside(server.url, b'{"prompt": "' + b"a" * 5_000_000 + b'"}'))
        near = asyncio.run(health_beside(server.url, b'{"prompt": "' + b"ab " * 690_000 + b'"}'))
        health = {"idle_median_ms": 1e3 * statistics.median(idle), "idle_max_ms": 1e3 * max(idle),
                  "5MB_body": huge, "2MB_prompt": near}
        print(f"/health: idle {health['idle_median_ms']:.1f} ms median; beside a 5 MB body "
              f"{huge['health_median_ms']:.1f} / {huge['health_max_ms']:.1f} ms (median / max, answered "
              f"{huge['status']} in {huge['answered_s']:.2f} s); beside a 2 MB prompt "
              f"{near['health_median_ms']:.1f} / {near['health_max_ms']:.1f} ms ({near['status']} in "
              f"{near['answered_s']:.2f} s)")
    finally:
        server.stop()
    path = save_results("serve-fairness",
                        dict(cpu=cpu_model(), ttft=rows, health=health, max_tokens=args.max_tokens,
                             multi_prompt=multi, many_messages=messages))
    print(f"results: {path}")


if __name__ == "__main__":
    main()
