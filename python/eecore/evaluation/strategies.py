"""`eecore eval`'s measurement: a decoding strategy against full depth on the same weights.

For each strategy, the prompt set runs through the strategy's engine and through a full-depth
engine, alternating, `repeats` times each: a burst of load on a shared machine then hits both
alike (bench/e2e_early_exit.py's `measure_pair`). Throughput is tokens over the median time of
the runs; the quality numbers compare the first run's outputs (eecore.evaluation.metrics).

Both engines sit on one set of weights: `share_weights` builds a second LLM around the first one's
model, tokenizer and exit adapters, with its own KV cache and decode strategy. So the comparison
is strategy against full depth, never two loads of a checkpoint against each other, and only one
copy of the weights is in memory. A row with separate draft layers is the exception that proves it:
its draft copy is built from the checkpoint (an exit-ready file's LoRA pairs merged into the copy
alone), which built weights cannot give back, so the row loads the model with its configuration,
and its full depth runs on that load's weights (the original model's).
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

from eecore.engine.llm_engine import LLMEngine
from eecore.evaluation.metrics import compare_outputs
from eecore.exits.config import EarlyExitConfig
from eecore.llm import LLM, _strategy
from eecore.outputs import RequestOutput
from eecore.sampling_params import SamplingParams
from eecore.speculative import SelfSpeculativeConfig

__all__ = ["Strategy", "share_weights", "measure_pair", "evaluate_strategy"]

Prompt = Union[str, list[int]]


@dataclass
class Strategy:
    """One configuration to evaluate: early exit, self-speculation, or neither (full depth)."""
    label: str
    early_exit: Optional[EarlyExitConfig] = None
    speculative: Optional[SelfSpeculativeConfig] = None

    def __post_init__(self):
        if self.early_exit is not None and self.speculative is not None:
            raise ValueError(f"Strategy {self.label!r}: early exit or self-speculation, not both")

    @property
    def loads_its_own_model(self) -> bool:
        """Separate draft layers: the row's LLM is loaded with its configuration (module doc)."""
        return self.speculative is not None and self.speculative.separate_draft_layers

    @property
    def kind(self) -> str:
        return "early_exit" if self.early_exit else "speculative" if self.speculative else "full_depth"

    def describe(self) -> dict:
        """The configuration as plain JSON values (a thresholds file's path stays a path)."""
        config = self.early_exit or self.speculative
        return {"kind": self.kind, **({} if config is None else _plain(config, skip=("calibration",)))}


def _plain(config, skip=()) -> dict:
    """A config dataclass as JSON values: its parts as dicts, tuples as lists."""
    def value(v):
        if dataclasses.is_dataclass(v):
            return _plain(v)
        return list(v) if isinstance(v, tuple) else v
    return {f.name: value(getattr(config, f.name)) for f in dataclasses.fields(config) if f.name not in skip}


def share_weights(base: LLM, strategy: Strategy) -> LLM:
    """An LLM that decodes with `strategy` on `base`'s weights (no second load), with its own KV
    cache sized like `base`'s. Builds what LLM.__init__ builds after loading the model."""
    llm = LLM.__new__(LLM)
    llm.device, llm.dtype, llm.config = base.device, base.dtype, base.config
    llm.tokenizer, llm.model, llm.exit_adapters = base.tokenizer, base.model, base.exit_adapters
    builder, lookahead = _strategy(strategy.early_exit, strategy.speculative, base.model.num_layers,
                                   base.exit_adapters, base.model)
    llm.engine = LLMEngine(base.model, base.tokenizer, base.engine.config, strategy=builder, lookahead=lookahead)
    return llm


def _timed(llm: LLM, prompts: Sequence[Prompt], params: SamplingParams) -> tuple[list[RequestOutput], float]:
    start = time.perf_counter()
    outs = llm.generate(list(prompts), params)
    return outs, time.perf_counter() - start


def measure_pair(llm: LLM, base: LLM, prompts: Sequence[Prompt], params: SamplingParams, repeats: int,
                 tick: Callable[[], None] = lambda: None) -> dict:
    """The strategy's engine and full depth, alternating `repeats` times over all prompts (one
    generate call each: the engine batches up to its max_num_seqs). Returns the first run's
    outputs of each and every run's seconds. `tick` is called after each run (progress)."""
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"measure_pair: 'repeats' must be a positive int, got {repeats!r}")
    warm = SamplingParams(max_tokens=4)
    llm.generate(list(prompts[:1]), warm)  # first-call costs (allocation, lazy init) stay out of the timing
    base.generate(list(prompts[:1]), warm)
    outs = full_outs = None
    seconds, full_seconds = [], []
    for _ in range(repeats):
        o, t = _timed(llm, prompts, params)
        tick()
        f, tf = _timed(base, prompts, params)
        tick()
        seconds.append(t)
        full_seconds.append(tf)
        if outs is None:
            outs, full_outs = o, f
    return dict(outs=outs, full_outs=full_outs, seconds=seconds, full_seconds=full_seconds)


def evaluate_strategy(base: LLM, strategy: Strategy, prompts: Sequence[Prompt], params: SamplingParams,
                      repeats: int, references: Optional[Sequence[Optional[str]]] = None,
                      tick: Callable[[], None] = lambda: None,
                      load: Optional[Callable[[SelfSpeculativeConfig], LLM]] = None) -> dict:
    """One result row: throughput of the strategy and of full depth, the speed-up, and how its
    outputs compare with full depth's (and with `references`, where given). `load(speculative)`
    gives the LLM of a row that loads its own model (Strategy.loads_its_own_model); its full depth
    then runs on that LLM's weights instead of `base`."""
    if strategy.loads_its_own_model:
        if load is None:
            raise ValueError(f"evaluate_strategy: {strategy.label!r} has separate draft layers, which are built "
                             "from the checkpoint: pass 'load'")
        llm = load(strategy.speculative)
        full = share_weights(llm, Strategy("full depth"))
    else:
        llm, full = share_weights(base, strategy), base
    try:
        r = measure_pair(llm, full, prompts, params, repeats, tick)
    finally:
        del llm, full  # their KV caches go before the next strategy's are allocated
    tokens = sum(len(o.token_ids) for o in r["outs"])
    full_tokens = sum(len(o.token_ids) for o in r["full_outs"])
    # each side's own token count: without ignore_eos the two may stop at different lengths
    tok_s = tokens / max(statistics.median(r["seconds"]), 1e-9)
    full_tok_s = full_tokens / max(statistics.median(r["full_seconds"]), 1e-9)
    row = dict(label=strategy.label, strategy=strategy.describe(),
               tokens_per_s=tok_s, full_tokens_per_s=full_tok_s, speedup=tok_s / full_tok_s if full_tok_s else None,
               num_tokens=tokens, full_num_tokens=full_tokens, seconds=r["seconds"], full_seconds=r["full_seconds"])
    row.update(compare_outputs(r["outs"], r["full_outs"], base.model.num_layers, references))
    return row
