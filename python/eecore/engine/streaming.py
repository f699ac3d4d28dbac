"""Streaming: what each sequence has been sent so far, and the delta a step adds to it.

Shared by `LLM.generate_stream` and the server's async engine, so both send the same text: text
that later tokens cannot change (no half-decoded character, no possible start of a stop string),
and, once a sequence finishes, the rest of its final text.
"""
from __future__ import annotations

from typing import Optional

from typing import TYPE_CHECKING

from eecore.engine.sequence import Sequence
from eecore.engine.stopping import StopChecker
from eecore.outputs import RequestDelta

if TYPE_CHECKING:
    from eecore.engine.llm_engine import LLMEngine


def stable_text(stopper: StopChecker, seq: Sequence) -> str:
    """Text that later tokens cannot change: no half-decoded character, no possible stop-string start."""
    text = stopper.current_text(seq).rstrip("\ufffd")
    hold = max((len(s) for s in seq.params.stop), default=1) - 1
    return text[: len(text) - hold] if hold > 0 else text


class DeltaTracker:
    """Per sequence: the tokens and text sent so far. `delta(seq)` after a step returns what is new
    (None when nothing is), with the request's metrics once it finished, and then forgets it."""

    def __init__(self, engine: "LLMEngine"):
        self.engine = engine
        self.stopper = engine.stopper
        self._sent: dict[int, tuple[int, str]] = {}

    def delta(self, seq: Sequence) -> Optional[RequestDelta]:
        sent_tokens, sent_text = self._sent.get(seq.seq_id, (0, ""))
        text = self.stopper.final_text(seq) if seq.is_finished else stable_text(self.stopper, seq)
        if not text.startswith(sent_text):  # a stop string took back text: send none of it again
            text = sent_text
        new_ids = seq.output_token_ids[sent_tokens:]
        if not new_ids and not seq.is_finished:
            return None
        if seq.is_finished:
            self._sent.pop(seq.seq_id, None)
        else:
            self._sent[seq.seq_id] = (seq.num_output_tokens, text)
        logprobs = seq.logprobs[sent_tokens:] if seq.params.logprobs is not None else None
        return RequestDelta(index=seq.request_index, token_ids=new_ids, text=text[len(sent_text):],
                            exit_layers=seq.exit_layers[sent_tokens:], finished=seq.is_finished,
                            finish_reason=seq.finish_reason, logprobs=logprobs,
                            metrics=self.engine.metrics(seq) if seq.is_finished else None)

    def forget(self, seq: Sequence) -> None:
        self._sent.pop(seq.seq_id, None)
