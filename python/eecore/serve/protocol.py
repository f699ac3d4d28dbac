"""Request schemas of the OpenAI API subset eecore serves (pydantic), and the error they map to.

Strict types: a string where a number belongs is a 400, not a silent conversion. Unknown fields
are refused with their name, so an unsupported OpenAI feature (tools, logit_bias, ...) never
passes unnoticed. `null` for an optional field means its default, as in OpenAI's API (client
libraries send nulls); a required field (`prompt`, `messages`, a message's `content`) cannot be
null. `top_k`, `ignore_eos` and `stop_token_ids` are extensions, as in vLLM.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from eecore.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_TEMPERATURE

MAX_N = 16
MAX_LOGPROBS = 20


class APIError(Exception):
    """An error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: Optional[str] = None, code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data):
        _check_no_surrogates(data, "")
        return _nulls_as_defaults(cls, data)


def _nulls_as_defaults(cls, data):
    """An optional field sent as null takes its default (`"n": null` is n = 1)."""
    if isinstance(data, dict) and None in data.values():
        return {k: v for k, v in data.items() if v is not None or k not in cls.model_fields
                or cls.model_fields[k].is_required()}
    return data


def _check_no_surrogates(value, path: str) -> None:
    """JSON can spell lone UTF-16 surrogates ("\\ud800") that are no Unicode text: no tokenizer takes
    them and no response can echo them, so they are refused where they stand."""
    if isinstance(value, str):
        if any("\ud800" <= ch <= "\udfff" for ch in value):
            raise ValueError(f"{path or 'the request'}: contains a lone surrogate (\\ud800-\\udfff), which is not "
                             "valid Unicode text")
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_no_surrogates(key, path)
            _check_no_surrogates(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_no_surrogates(item, f"{path}[{i}]")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data):
        return _nulls_as_defaults(cls, data)


class _SamplingFields(_Strict):
    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, gt=0)
    temperature: Optional[float] = Field(None, ge=0.0, le=MAX_TEMPERATURE, allow_inf_nan=False)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: Optional[int] = Field(None, ge=-1)       # extension: -1 or 0 disable it; past the vocabulary: all
    seed: Optional[int] = Field(None, ge=-(2 ** 63), le=2 ** 63 - 1)  # int64, as OpenAI documents it
    stop: Union[None, str, list[str]] = Field(None, max_length=MAX_STOP_STRINGS)
    stop_token_ids: Optional[list[int]] = Field(None, max_length=256)  # extension
    ignore_eos: bool = False                        # extension
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    # OpenAI parameters eecore does not implement: accepted at their neutral value only
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v):
        if isinstance(v, list) and not all(v):
            raise ValueError("stop strings must not be empty")
        if v == "":
            raise ValueError("a stop string must not be empty")
        total = len(v) if isinstance(v, str) else sum(len(s) for s in v or ())
        if total > MAX_STOP_CHARS:
            raise ValueError(f"stop strings may hold {MAX_STOP_CHARS} characters in all, got {total}")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v):
        if v not in (None, 0, 0.0):
            raise ValueError("penalties are not supported by eecore (only 0)")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, v):
        if v:
            raise ValueError("logit_bias is not supported by eecore")
        return v

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when 'stream' is true")
        return self


class CompletionRequest(_SamplingFields):
    prompt: Any                                     # str | list[str] | list[int] | list[list[int]]
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None

    @field_validator("prompt")
    @classmethod
    def _prompt_shape(cls, v):
        return normalize_prompt(v)

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v):
        if v:
            raise ValueError("echo is not supported by eecore")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v):
        if v:
            raise ValueError("suffix is not supported by eecore")
        return v

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, v):
        if v not in (None, 1):
            raise ValueError("best_of > 1 is not supported by eecore")
        return v


def normalize_prompt(v) -> list[Union[str, list[int]]]:
    """A completion request's prompt(s) as a non-empty list of strings and token-id lists."""
    def is_ids(x):
        return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and v:
        if is_ids(v):
            return [v]
        if all(isinstance(x, str) or (is_ids(x) and x) for x in v):
            return list(v)
    if isinstance(v, list) and not v:
        raise ValueError("prompt must not be empty")
    raise ValueError("prompt must be a string, a list of strings, a list of token ids or a list of lists of "
                     "token ids")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart]]  # required and not null: eecore has no tool calls to stand in
    name: Optional[str] = None

    def as_template_dict(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        message = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


# Messages a conversation may hold: every message costs the chat template a few tokens, so more than
# this fit no context eecore serves, and the cap is checked before the messages are validated (a 2 MB
# body of 68,000 empty messages took 0.5 s of the event loop to validate, 0.02 s to refuse so).
MAX_MESSAGES = 4096


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: Optional[int] = Field(None, gt=0)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: only allowed when 'logprobs' is true")
        return self
