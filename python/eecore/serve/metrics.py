"""The server's Prometheus metrics (GET /metrics, text exposition format via prometheus_client).

The engine thread updates them after every step; a private registry per server keeps several
servers in one process (the tests) apart. Counts are in sequences: a request with n choices is n.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from eecore.outputs import RequestDelta

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    def __init__(self, num_blocks: int, num_layers: int):
        self.registry = r = CollectorRegistry()
        self.num_layers = num_layers
        self.running = Gauge("eecore_num_requests_running", "Sequences in the running batch", registry=r)
        self.waiting = Gauge("eecore_num_requests_waiting", "Sequences waiting for a place in the batch", registry=r)
        self.blocks_used = Gauge("eecore_kv_blocks_used", "KV cache blocks in use", registry=r)
        self.blocks_free = Gauge("eecore_kv_blocks_free", "KV cache blocks free", registry=r)
        Gauge("eecore_kv_blocks_total", "KV cache blocks", registry=r).set(num_blocks)
        Gauge("eecore_num_layers", "Layers of the model (full depth)", registry=r).set(num_layers)
        self.prompt_tokens = Counter("eecore_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("eecore_generation_tokens", "Generated tokens", registry=r)
        self.layers_run = Counter("eecore_layers_run", "Layers run for generated tokens (sum of exit layers)",
                                  registry=r)
        self.early_exits = Counter("eecore_early_exit_tokens", "Generated tokens that exited before the last "
                                   "layer", registry=r)
        self.mean_layers = Gauge("eecore_mean_layers_per_token", "Mean layers run per generated token",
                                 registry=r)
        # totals kept here too: the derived gauges read them (a Counter has no public getter)
        self._totals = {"tokens": 0, "layers": 0, "early": 0, "drafted": 0, "accepted": 0}
        t = self._totals
        self.mean_layers.set_function(lambda: t["layers"] / t["tokens"] if t["tokens"] else num_layers)
        self.early_exit_rate = Gauge("eecore_early_exit_rate", "Fraction of generated tokens that exited early",
                                     registry=r)
        self.early_exit_rate.set_function(lambda: t["early"] / t["tokens"] if t["tokens"] else 0.0)
        self.drafted = Counter("eecore_spec_draft_tokens", "Self-speculation: drafted tokens (finished requests)",
                               registry=r)
        self.accepted = Counter("eecore_spec_accepted_tokens", "Self-speculation: accepted drafts (finished "
                                "requests)", registry=r)
        self.acceptance = Gauge("eecore_spec_acceptance_rate", "Self-speculation: accepted / drafted tokens",
                                registry=r)
        self.acceptance.set_function(lambda: t["accepted"] / t["drafted"] if t["drafted"] else 0.0)
        self.finished = Counter("eecore_requests_finished", "Finished sequences by finish reason",
                                ["finish_reason"], registry=r)
        self.rejected_overload = Counter("eecore_requests_rejected_overload", "Requests refused because the "
                                         "waiting queue was full", registry=r)
        self.steps = Counter("eecore_engine_steps", "Engine steps that produced tokens", registry=r)
        self.step_seqs = Histogram("eecore_step_num_requests", "Sequences that gained tokens in one engine step",
                                   buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)
        self.mixed_steps = Counter("eecore_engine_mixed_steps", "Engine steps that ran prefill chunks beside "
                                   "decodes", registry=r)
        self.step_tokens = Histogram("eecore_step_num_tokens", "Tokens one engine step computed (decodes and "
                                     "prefill chunks; a speculation round counts d + 1)",
                                     buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048), registry=r)
        self.max_step_seqs = Gauge("eecore_step_num_requests_max", "Most sequences that gained tokens in one step",
                                   registry=r)
        self.ttft = Histogram("eecore_time_to_first_token_seconds", "Time to first token (finished requests)",
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60), registry=r)
        self._max_step = 0
        # prefix caching (gauges mirroring the block manager's running totals)
        self.prefix_query = Gauge("eecore_prefix_cache_query_tokens", "Prompt tokens looked up in the prefix "
                                  "cache at admission", registry=r)
        self.prefix_hits = Gauge("eecore_prefix_cache_hit_tokens", "Prompt tokens whose K/V the prefix cache "
                                 "held at admission", registry=r)
        self.cached_blocks = Gauge("eecore_kv_blocks_cached", "KV cache blocks named by the prefix cache "
                                   "(reusable; counted as free when no request holds them)", registry=r)

    # ---- engine thread ---------------------------------------------------------------------
    def update_engine(self, engine, num_waiting: int) -> None:
        self.running.set(len(engine.scheduler.running))
        self.waiting.set(num_waiting)
        free = engine.blocks.num_free_blocks
        self.blocks_free.set(free)
        self.blocks_used.set(engine.blocks.num_blocks - free)
        self.prefix_query.set(engine.blocks.prefix_query_tokens)
        self.prefix_hits.set(engine.blocks.prefix_hit_tokens)
        self.cached_blocks.set(engine.blocks.num_cached_blocks)

    def observe_step(self, num_seqs: int, step=None) -> None:
        """`step`: the engine's ScheduledStep, for the mixed-step and token counts."""
        if step is not None and not step.is_empty:
            self.step_tokens.observe(step.num_tokens)
            if step.decodes and step.prefills:
                self.mixed_steps.inc()
        if num_seqs == 0:
            return
        self.steps.inc()
        self.step_seqs.observe(num_seqs)
        if num_seqs > self._max_step:
            self._max_step = num_seqs
            self.max_step_seqs.set(num_seqs)

    def observe_delta(self, delta: RequestDelta) -> None:
        t = self._totals
        if delta.token_ids:
            n, layers = len(delta.token_ids), sum(delta.exit_layers)
            early = sum(1 for e in delta.exit_layers if e < self.num_layers)
            t["tokens"] += n
            t["layers"] += layers
            t["early"] += early
            self.generation_tokens.inc(n)
            self.layers_run.inc(layers)
            self.early_exits.inc(early)
        if delta.finished:
            self.finished.labels(delta.finish_reason or "unknown").inc()
            m = delta.metrics or {}
            drafted, accepted = m.get("num_drafted_tokens", 0), m.get("num_accepted_tokens", 0)
            t["drafted"] += drafted
            t["accepted"] += accepted
            self.prompt_tokens.inc(m.get("num_prompt_tokens", 0))
            self.drafted.inc(drafted)
            self.accepted.inc(accepted)
            if "ttft_s" in m:
                self.ttft.observe(m["ttft_s"])

    # ---- HTTP side -------------------------------------------------------------------------
    def render(self) -> bytes:
        return generate_latest(self.registry)



def parse_metrics(text: str) -> dict[str, float]:
    """The samples of a /metrics page as {'name{labels}': value} (for clients, tests and benches)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out
