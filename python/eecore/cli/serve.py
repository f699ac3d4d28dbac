"""`eecore serve`: the model and strategy flags of `eecore generate`, plus the server's own."""
from __future__ import annotations

import argparse
import gc
import logging
import signal
import sys

from eecore import envs
from eecore.cli.args import add_model_flags, build_llm

# Serving defaults: latency over throughput. Each running sequence makes a CPU decode step longer
# (bench/cost_step.py: on a 2-core Zen 3 a step of 12 rows costs 1.7-2.5x a step of 1, a step of
# 32 rows 5-9x), so a bounded running batch keeps the inter-token latency within a few
# single-stream steps while batching still pays; the token budget bounds the prefill work a step
# carries beside the decodes. With prefix caching (a chat template's system prompt computed once),
# 10 sequences and 12 tokens kept the p99 ITL at 32 clients within 2.0-2.9x one client's in 5 of 5
# full-depth runs on 2 cores, at 4.05-5.3x its throughput; 12 and 16 gave 4.55-5.2x throughput but
# 2.8-3.1x the ITL (bench/results/zen3/serve_load-10-12-*.md, zen3/serve_load-defaults-10-12-rep*.md,
# zen3/serve_load-unique-rep*.md). `eecore generate` / `bench` keep their larger batch.
SERVE_MAX_NUM_SEQS = 10
SERVE_MAX_NUM_BATCHED_TOKENS = 12


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", usage="eecore serve [options]",
                       help="OpenAI-compatible HTTP server (completions, chat, streaming, /metrics)")
    add_model_flags(p)
    # --max-num-seqs is the running batch, --max-num-batched-tokens the tokens of one step
    # and requests share the K/V of common prompt prefixes (a chat template's system prompt), as in vLLM
    p.set_defaults(max_num_seqs=SERVE_MAX_NUM_SEQS, max_num_batched_tokens=SERVE_MAX_NUM_BATCHED_TOKENS,
                   enable_prefix_caching=True)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every route but /health and /metrics, checked before "
                        "the body is read; repeat it for several clients, who then take turns in the queue "
                        "(default: $EECORE_API_KEY, else none)")
    g.add_argument("--max-waiting-requests", type=int, default=256,
                   help="sequences that may wait for a place in the batch; beyond it requests get 503")
    g.add_argument("--max-waiting-tokens", type=int, default=None, metavar="N",
                   help="prompt tokens that may wait; beyond them requests get 503 with Retry-After (default: 8 "
                        "contexts' worth)")
    g.add_argument("--max-prefill-tokens-per-request", type=int, default=None, metavar="N",
                   help="one request's prompt tokens waiting or in prefill at once (its other prompts wait their "
                        "turn, so a later short request is not held behind all of them; default: "
                        "--max-num-batched-tokens)")
    g.add_argument("--max-prefill-tokens-per-client", type=int, default=None, metavar="N",
                   help="with several --api-key, one client's prompt tokens waiting or in prefill at once, all its "
                        "requests together (default: twice --max-num-batched-tokens)")
    g.add_argument("--served-model-name", default=None,
                   help="the model id of the API (default: the model file or folder name)")
    g.add_argument("--max-request-bytes", type=int, default=None,
                   help="request bodies past this size get 413 (default: 2 MiB)")
    g.add_argument("--header-timeout", type=float, default=10.0, metavar="S",
                   help="a request's line and headers must arrive within S seconds, else the connection is closed "
                        "(408 if part of a request came; default 10)")
    g.add_argument("--body-timeout", type=float, default=30.0, metavar="S",
                   help="a request's body must arrive within S seconds of its headers, else 408 and the connection "
                        "is closed (default 30)")
    g.add_argument("--keep-alive-timeout", type=float, default=5.0, metavar="S",
                   help="an idle keep-alive connection is closed after S seconds (uvicorn's timeout_keep_alive; "
                        "default 5)")
    g.add_argument("--max-connections", type=int, default=512, metavar="N",
                   help="beyond N connections or requests at once, a new request gets 503 (uvicorn's "
                        "limit_concurrency; default 512)")
    g.add_argument("--shutdown-timeout", type=float, default=5.0, metavar="S",
                   help="after SIGINT / SIGTERM the process exits within S seconds, whatever clients do (default 5)")
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=cmd_serve)
    return p


def cmd_serve(args) -> int:
    from eecore.serve import AsyncEngine, build_app, default_model_name
    from eecore.serve.server import EngineServer, server_config

    for flag in ("max_waiting_requests", "max_waiting_tokens", "max_prefill_tokens_per_request",
                 "max_prefill_tokens_per_client"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise SystemExit(f"eecore: --{flag.replace('_', '-')} must be at least 1")
    if args.max_request_bytes is not None and args.max_request_bytes < 1024:
        raise SystemExit("eecore: --max-request-bytes must be at least 1024")
    for flag in ("header_timeout", "body_timeout", "keep_alive_timeout", "shutdown_timeout"):
        value = getattr(args, flag)
        if not 0 < value < float("inf"):
            raise SystemExit(f"eecore: --{flag.replace('_', '-')} must be a number of seconds > 0, got {value}")
    if args.max_connections < 1:
        raise SystemExit("eecore: --max-connections must be at least 1")
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    llm = build_llm(args)
    engine = AsyncEngine(llm, max_waiting=args.max_waiting_requests, max_waiting_tokens=args.max_waiting_tokens,
                         max_prefill_tokens_per_request=args.max_prefill_tokens_per_request,
                         max_prefill_tokens_per_client=args.max_prefill_tokens_per_client)
    # Everything alive now (torch, the model, the tokenizer: hundreds of thousands of objects) lives
    # as long as the server. A full collection walks every tracked object with the GIL held, and at
    # start-up on a 2-core machine these took 110-180 ms: frozen, a collection while serving walks
    # only the requests' objects (measured: 30 ms at most under 32 clients).
    gc.collect()
    gc.freeze()
    api_keys = args.api_key or ([envs.raw("EECORE_API_KEY")] if envs.raw("EECORE_API_KEY") else None)
    if args.api_key and not all(args.api_key):
        raise SystemExit("eecore: --api-key must not be empty")
    limit = {} if args.max_request_bytes is None else {"max_request_bytes": args.max_request_bytes}
    app = build_app(engine, args.served_model_name or default_model_name(args.model), api_key=api_keys,
                    body_timeout=args.body_timeout, **limit)
    config = server_config(app, host=args.host, port=args.port, log_level=args.log_level,
                           header_timeout=args.header_timeout, keep_alive_timeout=args.keep_alive_timeout,
                           max_connections=args.max_connections, shutdown_timeout=args.shutdown_timeout)
    # on SIGINT / SIGTERM the engine ends its requests at once (open streams get their last chunk), and
    # the process exits within --shutdown-timeout (eecore.serve.server)
    server = EngineServer(config, engine, shutdown_timeout=args.shutdown_timeout)
    # uvicorn re-raises the signal that stopped it once it has shut down gracefully; let it land on a
    # no-op so that a SIGINT / SIGTERM shutdown exits 0
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        server.run()
    finally:
        llm.shutdown()  # the tensor-parallel workers, if any
    if engine.failure is not None:
        print(f"eecore: the engine stopped: {engine.failure}", file=sys.stderr)
        return 1
    return 0
