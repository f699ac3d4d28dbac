"""One request's state as it moves through the engine. No tensor code here."""
from __future__ import annotations

import collections
import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Optional

from eecore.engine.block_table import BlockTable
from eecore.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SequenceTimes:
    arrival: float = field(default_factory=time.perf_counter)
    first_scheduled: Optional[float] = None
    first_token: Optional[float] = None
    finished: Optional[float] = None


_ids = itertools.count()


class Sequence:
    """Token ids, block table and progress of one request.

    `num_computed_tokens` counts tokens whose K/V are in the cache. Right after admission the
    sequence is in its prefill phase until `prefill_target` tokens are computed (the prompt, plus
    any outputs generated before a preemption); after that, every step computes the one pending
    token (`num_tokens - num_computed_tokens == 1`) or, in self-speculation, a draft run.
    """

    def __init__(self, prompt_token_ids: list[int], params: SamplingParams, request_index: int = 0,
                 prompt: Optional[str] = None, encoder_token_ids: Optional[list[int]] = None):
        self.seq_id = next(_ids)
        self.request_index = request_index
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        # Encoder-decoder models (T5): the request's prompt feeds the encoder, and the decoder's
        # tokens (`prompt_token_ids`, then the outputs) start from the decoder start token. The
        # encoder output's cross-attention K/V live in blocks of their own, held from admission
        # (or readmission after a preemption) to the end of the request.
        self.encoder_token_ids = None if encoder_token_ids is None else list(encoder_token_ids)
        self.cross_block_table: list[int] = []
        self.output_token_ids: list[int] = []
        self.params = params
        self.status = SequenceStatus.WAITING
        self.block_table = BlockTable()
        # prefix-cache digests of the leading full blocks of block_table (see BlockManager)
        self.block_digests: list[bytes] = []
        self.num_computed_tokens = 0
        self.prefill_target = 0
        self.exit_layers: list[int] = []
        self.logprobs: list[dict[int, float]] = []
        self.finish_reason: Optional[str] = None
        self.stop_reason: Optional[int | str] = None  # the stop token id or stop string that ended it
        self.output_text = ""
        self.detokenizer = None  # engine.detokenizer.IncrementalDetokenizer, made by the StopChecker
        self.times = SequenceTimes()
        self.num_preemptions = 0
        # strategy counters (e.g. drafted / accepted tokens), 0 until counted
        self.stats: collections.defaultdict[str, float] = collections.defaultdict(int)

    # ---- sizes -----------------------------------------------------------------------------
    @property
    def block_table(self) -> BlockTable:
        """The physical blocks of the sequence's K/V, one per block_size positions."""
        return self._block_table

    @block_table.setter
    def block_table(self, blocks: list[int]) -> None:
        # a plain list (a test's table, `= []` on release) becomes a BlockTable: engine.inputs copies
        # tables from their arrays
        self._block_table = blocks if isinstance(blocks, BlockTable) else BlockTable(blocks)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def input_token_ids(self) -> list[int]:
        """The request's prompt as the user gave it: the encoder's input for an encoder-decoder
        model, else the decoder prompt."""
        return self.prompt_token_ids if self.encoder_token_ids is None else self.encoder_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_encoder_tokens(self) -> int:
        """Tokens the encoder runs on when the request is admitted (0 for a decoder-only model)."""
        return 0 if self.encoder_token_ids is None else len(self.encoder_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens start..end-1 of prompt and outputs (0 <= start <= end), without copying the rest:
        every decode step slices a few tokens near the end of a context that may be thousands long."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n: end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    # ---- phases ----------------------------------------------------------------------------
    @property
    def in_prefill(self) -> bool:
        return self.num_computed_tokens < self.prefill_target

    @property
    def num_pending_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def start_prefill(self, cached_tokens: int = 0) -> None:
        """(Re)admission: everything known so far is computed again, after the first
        `cached_tokens` whose K/V the prefix cache holds."""
        self.status = SequenceStatus.RUNNING
        self.num_computed_tokens = cached_tokens
        self.prefill_target = self.num_tokens
        if self.times.first_scheduled is None:
            self.times.first_scheduled = time.perf_counter()

    def reset_for_recompute(self) -> None:
        """Preemption by recomputation: the KV is dropped; outputs so far are kept."""
        self.status = SequenceStatus.WAITING
        self.block_table = BlockTable()
        self.block_digests = []
        self.cross_block_table = []
        self.num_computed_tokens = 0
        self.num_preemptions += 1

    def append_token(self, token_id: int, exit_layer: int, logprobs: Optional[dict[int, float]] = None) -> None:
        self.output_token_ids.append(int(token_id))
        self.exit_layers.append(int(exit_layer))
        if logprobs is not None:
            self.logprobs.append(logprobs)
        if self.times.first_token is None:
            self.times.first_token = time.perf_counter()

    def append_tokens(self, tokens) -> None:
        """append_token for each of `tokens` (engine.decoding.Token), at once (a loop: a step brings
        one to a few tokens a sequence, too few for list comprehensions to pay their setup), or for
        a TokenRun's ids."""
        ids, layers = self.output_token_ids, self.exit_layers
        exit_layer = getattr(tokens, "exit_layer", None)  # a TokenRun
        if exit_layer is not None:
            ids.extend(tokens)
            layers.extend([exit_layer] * len(tokens))
            if self.times.first_token is None and tokens:
                self.times.first_token = time.perf_counter()
            return
        for t in tokens:
            ids.append(int(t.token_id))
            layers.append(int(t.exit_layer))
            if t.logprobs is not None:
                self.logprobs.append(t.logprobs)
        if self.times.first_token is None and tokens:
            self.times.first_token = time.perf_counter()

    def finish(self, reason: str) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.times.finished = time.perf_counter()
