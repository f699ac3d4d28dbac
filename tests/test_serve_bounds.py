"""Bounded work before a request is admitted (eecore.serve.prompt_bounds): a conversation of many
empty messages is refused from its message count before the template renders; a long prompt of
many tokens a character is refused after tokenizing about one context's worth of it, not all of it;
and what fits goes on to be tokenized as before."""
from __future__ import annotations

import pytest

import eecore
from eecore.serve.prompt_bounds import PromptBounds
from eecore.serve.protocol import APIError
from model_factory import make_tiny_hf_model


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path, _ = make_tiny_hf_model(tmp_path_factory.mktemp("bounds"), num_layers=1, max_position_embeddings=256)
    return eecore.LLM(path, dtype="float32", device="cpu", num_blocks=64)


@pytest.fixture
def bounds(llm):
    return PromptBounds(llm, llm.engine.max_model_len)


def test_many_empty_messages_are_refused_before_the_template_renders(llm, bounds, monkeypatch):
    bounds.check_messages([{"role": "user", "content": "hi"}])  # measures the template's tokens a message
    rendered = []
    monkeypatch.setattr(llm, "chat_prompt", lambda conversation: rendered.append(conversation))
    conversation = [{"role": "user" if i % 2 == 0 else "assistant", "content": ""} for i in range(68_000)]
    with pytest.raises(APIError, match=r"messages: 0 characters and \d+ template tokens are at least"):
        bounds.check_messages(conversation)
    assert rendered == []


def test_a_long_prompt_is_refused_after_one_context_s_worth_of_tokenizing(llm, bounds, monkeypatch):
    tokenized = []
    encode = llm.tokenizer.encode
    monkeypatch.setattr(llm.tokenizer, "encode", lambda text, **kw: tokenized.append(len(text)) or encode(text, **kw))
    # several byte-level tokens a character, where the longest token has 13: the characters pass
    text = "漢字" * 1500
    bounds.check_text(text, "prompt 0", "prompt")
    with pytest.raises(APIError, match="prompt 0: its first 1028 of 3000 characters are already"):
        bounds.check_tokens(text, "prompt 0", "prompt")
    assert sum(tokenized) <= 4 * (llm.engine.max_model_len + 1)


def test_what_fits_is_not_refused(bounds):
    bounds.check_text("def f(x):\n    return x + 1\n", "prompt 0", "prompt")
    bounds.check_tokens("a short prompt " * 40, "prompt 0", "prompt")
    bounds.check_messages([{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi."}])


def test_a_conversation_of_more_messages_than_any_context_holds_is_refused():
    """The cap on messages is part of the schema, checked before the messages themselves are
    (bench/serve_fairness.py times what that saves the event loop)."""
    from pydantic import ValidationError

    from eecore.serve.protocol import MAX_MESSAGES, ChatCompletionRequest

    with pytest.raises(ValidationError, match=f"at most {MAX_MESSAGES} items"):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": ""}] * 68_000})
    ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": ""}] * MAX_MESSAGES})
