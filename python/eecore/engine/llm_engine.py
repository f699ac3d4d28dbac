"""The step loop: schedule, run prefill or a decode strategy, append tokens, stop, free.

`LLMEngine` is the request-level API (add_request / step) that `eecore.LLM` and the CLI drive;
it holds no tensor code of its own beyond handing rows to the runner.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional, Union

from eecore.device import apply_batch_invariance
from eecore.engine.block_manager import BlockManager
from eecore.engine.decoding import DecodeStrategy, FullDepthDecoder, Token
from eecore.engine.encoder_decoder import check_request_fits, encoder_decoder_sequence
from eecore.engine.inputs import Row
from eecore.engine.kv_cache import KVCache
from eecore.engine.piecewise import maybe_piecewise
from eecore.engine.runner import ModelRunner
from eecore.engine.sampler import Sampler
from eecore.engine.scheduler import Scheduler
from eecore.engine.sequence import Sequence
from eecore.engine.static_decode import maybe_static_decode, maybe_static_verify
from eecore.engine.stopping import StopChecker
from eecore.models.llama import LlamaModel
from eecore.outputs import RequestOutput
from eecore.sampling_params import SamplingParams


@dataclass
class EngineConfig:
    block_size: int = 16
    num_blocks: Optional[int] = None            # explicit KV size; else from the memory budget
    kv_cache_memory_fraction: float = 0.3       # of the memory free at start-up
    max_num_seqs: int = 32                      # running sequences per step
    # tokens per step, decodes first: prefill chunks get the rest (longer prompts are chunked)
    max_num_batched_tokens: int = 1024
    # let prefill chunks ride in the decode step when the strategy can (see Scheduler)
    mixed_steps: bool = True
    max_model_len: Optional[int] = None         # prompt + output; defaults to the model's context
    # share the K/V of full blocks of prompt tokens between requests (decoder-only models; see
    # BlockManager): a common system prompt is computed once
    enable_prefix_caching: bool = False
    seed: int = 0                               # for sampled requests without their own seed
    # run every step op by op: no CUDA graphs of the decode step (they are on by default on a GPU)
    enforce_eager: bool = False
    # a decode step launches the next before its tokens are read back; None: EECORE_DECODE_AHEAD,
    # else on a GPU only (eecore.engine.static_decode.decode_ahead_enabled)
    decode_ahead: Optional[bool] = None

    def __post_init__(self):
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"'{name}' must be a positive int, got {value!r}")
        for name in ("mixed_steps", "enable_prefix_caching", "enforce_eager"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"'{name}' must be a bool, got {getattr(self, name)!r}")
        if self.decode_ahead is not None and not isinstance(self.decode_ahead, bool):
            raise ValueError(f"'decode_ahead' must be a bool or None, got {self.decode_ahead!r}")


StrategyBuilder = Callable[[ModelRunner, Sampler], DecodeStrategy]


class LLMEngine:
    def __init__(self, model: LlamaModel, tokenizer, config: EngineConfig,
                 strategy: StrategyBuilder = FullDepthDecoder, lookahead: int = 1):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        apply_batch_invariance(model.device)
        mc = model.config
        max_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        num_blocks = KVCache.plan_num_blocks(
            num_layers=mc.num_layers, block_size=config.block_size, num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim, dtype=model.dtype, device=model.device,
            memory_fraction=config.kv_cache_memory_fraction,
            # an encoder-decoder request also holds up to max_len encoder tokens of cross-attention K/V
            max_useful_tokens=config.max_num_seqs * (max_len + lookahead) * (2 if model.is_encoder_decoder else 1),
            num_blocks=config.num_blocks)
        if model.tp is not None:  # each rank sized from its own free memory: every rank takes the smallest
            num_blocks = model.tp.agree_min(num_blocks)
        # A lone sequence must always fit, or preemption could not make progress.
        self.max_model_len = min(max_len, num_blocks * config.block_size - lookahead)
        if self.max_model_len < 2:
            raise ValueError(f"a KV cache of {num_blocks} blocks of {config.block_size} tokens is too small")
        self.kv_cache = KVCache(mc.num_layers, num_blocks, config.block_size, mc.num_kv_heads, mc.head_dim,
                                model.dtype, model.device)
        self.blocks = BlockManager(num_blocks, config.block_size,
                                   prefix_caching=config.enable_prefix_caching and not model.is_encoder_decoder)
        self.runner = ModelRunner(
            model, self.kv_cache,
            max_tokens=max(config.max_num_batched_tokens, config.max_num_seqs * lookahead),
            max_seqs=config.max_num_seqs, max_logit_rows=config.max_num_seqs * lookahead,
            max_blocks_per_seq=-(-(self.max_model_len + lookahead) // config.block_size),
            max_model_len=self.max_model_len)
        self.runner.decode_ahead = config.decode_ahead
        self.runner.static_decode = maybe_static_decode(self.runner, config.max_num_seqs, config.enforce_eager)
        self.runner.static_verify = maybe_static_verify(self.runner, config.max_num_seqs, lookahead,
                                                        config.enforce_eager)
        self.runner.piecewise = maybe_piecewise(self.runner, config.enforce_eager)
        self.sampler = Sampler(model.device, config.seed)
        self.strategy = strategy(self.runner, self.sampler)
        self.strategy.use_blocks(self.blocks)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens, lookahead,
                                   mixed=config.mixed_steps and self.strategy.supports_mixed_steps,
                                   plain_above=self.strategy.plain_above, plain_mixed=config.mixed_steps)
        eos = tuple(mc.eos_token_ids) or tuple(getattr(tokenizer, "eos_token_ids", ()) or ())
        self.stopper = StopChecker(tokenizer, eos, self.max_model_len)
        self.last_step = None  # the ScheduledStep `step` last ran (the server's metrics read it)

    # ---- requests --------------------------------------------------------------------------
    def encode_prompt(self, prompt: Union[str, list[int]], index: int = 0) -> list[int]:
        """Token ids of a prompt, validated: non-empty, in the vocabulary, shorter than the context."""
        where = f"prompt {index}"
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{where}: this model has no tokenizer; pass token ids instead of text")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
        else:
            raise TypeError(f"{where}: expected a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError(f"{where}: is empty")
        vocab = self.model.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{where}: token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"{where}: {len(ids)} tokens do not fit the context of {self.max_model_len} tokens "
                             f"(prompt + at least one generated token)")
        return ids

    def add_request(self, prompt: Union[str, list[int]], params: SamplingParams, index: int = 0) -> Sequence:
        """Validates and queues one request (a bad request raises here and leaves the engine as it was)."""
        return self.enqueue(prompt, self.validate(prompt, params, index), params, index)

    def validate(self, prompt: Union[str, list[int]], params: SamplingParams, index: int = 0) -> list[int]:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"prompt {index}: sampling params must be a SamplingParams, got {type(params).__name__}")
        ids = self.encode_prompt(prompt, index)
        if self.model.is_encoder_decoder:
            check_request_fits(self.model, self.blocks, ids, params, index, self.max_model_len,
                               self.strategy.lookahead)
        return ids

    def enqueue(self, prompt: Union[str, list[int]], token_ids: list[int], params: SamplingParams,
                index: int) -> Sequence:
        text = prompt if isinstance(prompt, str) else None
        seq = encoder_decoder_sequence(self.model, token_ids, params, index, text) if self.model.is_encoder_decoder \
            else Sequence(token_ids, params, request_index=index, prompt=text)
        self.scheduler.add(seq)
        return seq

    def abort_request(self, seq: Sequence) -> bool:
        """Ends an unfinished request between steps (finish reason "abort"): it leaves the waiting
        queue or the running batch and its KV blocks are free at once. False if it had finished."""
        if seq.is_finished:
            return False
        self._finish(seq, "abort")
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    def recover_from_failed_step(self) -> list[Sequence]:
        """After `step` raised: every running sequence goes back to wait for recomputation (the
        failed step may have written part of its KV or advanced counts it never finished), and the
        per-request code of every unfinished sequence (its sampling params, seed, logprobs, stop
        strings) is run again on dummy logits. Returns the sequences whose own code fails there:
        the caller ends them, and the others go on as if preempted."""
        self.scheduler.preempt_all()
        suspects = []
        for seq in list(self.scheduler.waiting):
            try:
                self._probe(seq)
            except Exception:  # noqa: BLE001: whatever a request's own code raises marks that request
                suspects.append(seq)
        return suspects

    def _probe(self, seq: Sequence) -> None:
        params = dataclasses.replace(seq.params)  # runs the validation again
        Sampler.probe(params, self.model.config.vocab_size)
        if seq.output_token_ids:
            self.stopper.detokenize(seq)

    # ---- one iteration ---------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Runs one iteration; returns the sequences that gained tokens or finished."""
        step = self.last_step = self.scheduler.schedule()
        if step is None or step.is_empty:
            return []
        if not step.decodes:
            return self._prefill(step.prefills, step.prefill_tokens)
        if step.prefills:
            return self._mixed(step.decodes, step.prefills, step.prefill_tokens)
        if step.decode_cost < self.strategy.lookahead:  # planned without lookahead (plain_above)
            results = self.strategy.decode_plain(step.decodes)
        else:
            results = self.strategy.decode(step.decodes)
        lookahead = self.strategy.lookahead
        for seq, tokens in zip(step.decodes, results):
            self.append_tokens(seq, tokens)
            if not seq.is_finished and lookahead > 1:
                # give back the blocks of rejected drafts past the slots the next round writes (the
                # scheduler would take those again at once: on a busy batch a third of the
                # sequences gave back a block and took a new one every round)
                self.blocks.shrink(seq, seq.num_tokens - 1 + lookahead)
        return step.decodes

    def _mixed(self, decodes: list[Sequence], prefills: list[Sequence], counts: list[int]) -> list[Sequence]:
        """Decodes and prefill chunks in one pass (a strategy with `supports_mixed_steps`)."""
        results, firsts = self.strategy.decode_mixed(decodes, self._chunk_rows(prefills, counts))
        for seq, tokens in zip(decodes, results):
            self.append_tokens(seq, tokens)
        started = [(s, t) for s, t in zip(prefills, firsts) if t is not None]
        for seq, token in started:
            self.append_tokens(seq, [token])
        return decodes + [s for s, _ in started]

    @staticmethod
    def _chunk_rows(seqs: list[Sequence], counts: list[int]) -> list[Row]:
        return [Row(s, s.num_computed_tokens, s.token_slice(s.num_computed_tokens, s.num_computed_tokens + n))
                for s, n in zip(seqs, counts)]

    def _prefill(self, seqs: list[Sequence], counts: list[int]) -> list[Sequence]:
        rows = self._chunk_rows(seqs, counts)
        tap = self.strategy.prefill_tap(sum(counts))
        inputs, hidden = self.runner.forward(rows, tap)
        done = [i for i, s in enumerate(seqs) if not s.in_prefill]
        if not done:
            return []
        last = inputs.last_rows if len(done) == len(seqs) else inputs.last_rows[done]
        finished = [seqs[i] for i in done]
        tokens, logprobs = self.sampler.sample(self.runner.logits(hidden.index_select(0, last)), finished)
        for seq, token, lp in zip(finished, tokens, logprobs):
            self.append_tokens(seq, [Token(token, self.model.num_layers, lp)])
        if tap is not None:
            self.strategy.prefilled(finished, last.tolist(), tap[1])
        return finished

    def append_tokens(self, seq: Sequence, tokens: list[Token]) -> None:
        """A step's last part: `tokens` join `seq`, which finishes where a stop rule says so."""
        reason = self.stopper.append(seq, tokens)
        if reason is not None:
            self._finish(seq, reason)

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        self.sampler.release(seq)
        self.strategy.release(seq)

    # ---- outputs ---------------------------------------------------------------------------
    def output(self, seq: Sequence) -> RequestOutput:
        return RequestOutput(
            prompt=seq.prompt, prompt_token_ids=list(seq.input_token_ids), text=self.stopper.final_text(seq),
            token_ids=list(seq.output_token_ids), exit_layers=list(seq.exit_layers),
            logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
            finish_reason=seq.finish_reason, metrics=self.metrics(seq))

    def metrics(self, seq: Sequence) -> dict[str, float]:
        t = seq.times
        n = seq.num_output_tokens
        m: dict[str, float] = {"num_prompt_tokens": len(seq.input_token_ids), "num_output_tokens": n,
                               "num_preemptions": seq.num_preemptions}
        if t.first_token is not None and t.first_scheduled is not None:
            m["ttft_s"] = t.first_token - t.arrival
            m["prefill_s"] = t.first_token - t.first_scheduled
        if t.finished is not None and t.first_token is not None:
            if n > 1:
                m["time_per_output_token_s"] = (t.finished - t.first_token) / (n - 1)
            m["tokens_per_s"] = n / max(t.finished - (t.first_scheduled or t.arrival), 1e-9)
        if seq.exit_layers:
            L = self.model.num_layers
            m["mean_layers_per_token"] = sum(seq.exit_layers) / len(seq.exit_layers)
            m["early_exit_rate"] = sum(1 for e in seq.exit_layers if e < L) / len(seq.exit_layers)
        m.update(self.strategy.metrics(seq))
        return m
