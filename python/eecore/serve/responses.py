"""OpenAI response bodies from engine deltas: completions and chat completions, whole or as stream
chunks, with logprobs and usage. `usage` adds what only eecore knows: mean layers per generated
token, early-exit rate and (self-speculation) draft acceptance rate."""
from __future__ import annotations

import time
import uuid
from typing import Optional

from eecore.outputs import RequestDelta


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class Usage:
    """Token counts and eecore's decoding figures over all choices of one request."""

    def __init__(self, num_layers: int, prompt_tokens: int, speculative: bool):
        self.num_layers = num_layers
        self.prompt_tokens = prompt_tokens
        self.speculative = speculative
        self.completion_tokens = self.layers = self.early = self.drafted = self.accepted = 0

    def add(self, delta: RequestDelta) -> None:
        self.completion_tokens += len(delta.token_ids)
        self.layers += sum(delta.exit_layers)
        self.early += sum(1 for e in delta.exit_layers if e < self.num_layers)
        if delta.finished and delta.metrics:
            self.drafted += delta.metrics.get("num_drafted_tokens", 0)
            self.accepted += delta.metrics.get("num_accepted_tokens", 0)

    def body(self) -> dict:
        n = self.completion_tokens
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n,
                "total_tokens": self.prompt_tokens + n,
                "mean_layers_per_token": self.layers / n if n else None,
                "early_exit_rate": self.early / n if n else None,
                "acceptance_rate": (self.accepted / self.drafted if self.drafted else None) if self.speculative
                else None}


class Logprobs:
    """Token strings and OpenAI's two logprobs layouts (completions: parallel lists; chat: content
    entries with their top alternatives)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def token(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def completion(self, delta: RequestDelta, offset: int) -> tuple[dict, int]:
        """The completions layout for this delta's tokens, whose text starts at `offset`."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, lp in zip(delta.token_ids, delta.logprobs or []):
            text = self.token(token_id)
            out["tokens"].append(text)
            out["token_logprobs"].append(lp[token_id])
            out["top_logprobs"].append({self.token(t): v for t, v in _ranked(lp)})
            out["text_offset"].append(offset)
            offset += len(text)
        return out, offset

    def chat(self, delta: RequestDelta, top: int) -> dict:
        content = []
        for token_id, lp in zip(delta.token_ids, delta.logprobs or []):
            content.append(dict(self._entry(token_id, lp[token_id]),
                                top_logprobs=[self._entry(t, v) for t, v in _ranked(lp)[:top]]))
        return {"content": content}

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self.token(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def _ranked(lp: dict[int, float]) -> list[tuple[int, float]]:
    return sorted(lp.items(), key=lambda kv: -kv[1])


def completion_chunk(request_id: str, created: int, model: str, index: int, text: str,
                     logprobs: Optional[dict], finish_reason: Optional[str]) -> dict:
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}


def chat_chunk(request_id: str, created: int, model: str, index: int, delta: dict,
               logprobs: Optional[dict], finish_reason: Optional[str]) -> dict:
    return {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}


def usage_chunk(request_id: str, created: int, model: str, obj: str, usage: Usage) -> dict:
    return {"id": request_id, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage.body()}


def now() -> int:
    return int(time.time())
