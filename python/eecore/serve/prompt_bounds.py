"""How much work a request may cost the server before it is admitted or refused.

A prompt longer than the context is refused, but finding that out must not cost more than a
prompt that fits: a 2 MB body of 68,000 empty chat messages took 2.8 s of CPU before its 400 when
only the messages' characters were counted (the template renders a few tokens per message), and a
650,000-character CJK prompt, about two tokens a character, passed the character check (the
longest token has dozens of characters) and was tokenized whole, 1.3 M tokens, before its 400.

So, before anything is rendered or tokenized (on the event loop, O(characters)):
- text: its characters over the longest token's are a lower bound on its tokens;
- messages: that bound for their contents, plus the tokens the chat template adds per message
  (measured once at start-up, on two empty conversations).
Then, in a worker thread, text longer than a few tokens' worth of characters a context is tokenized
by growing prefixes (4x each time), refused as soon as one prefix holds more tokens than the
context (a prefix's tokens less one for the boundary bound the whole text's from below), so a
refusal costs at most about one context's worth of tokenizing.
"""
from __future__ import annotations

from typing import Optional

from eecore.serve.protocol import APIError

PREFIX_CHARS_PER_TOKEN = 4  # the first prefix tokenized: this many characters a token of the context


class PromptBounds:
    def __init__(self, llm, max_model_len: int):
        self.llm = llm
        self.tokenizer = llm.tokenizer
        self.limit = max_model_len
        self._max_chars_per_token: Optional[int] = None
        self._tokens_per_message: Optional[int] = None
        if self.tokenizer is not None:  # measured now, at start-up, not inside a request
            self._chars_per_token()
            self._template_tokens_per_message()

    # ---- before any tokenizing (the event loop) ------------------------------------------------
    def check_text(self, text, where: str, param: str, extra_tokens: int = 0) -> None:
        """Refuses `text` whose characters alone (plus `extra_tokens`) cannot fit the context."""
        if not isinstance(text, str) or self.tokenizer is None:
            return
        at_least = -(-len(text) // self._chars_per_token()) + extra_tokens
        if at_least >= self.limit:
            detail = f" and {extra_tokens} template tokens" if extra_tokens else ""
            raise APIError(400, f"{where}: {len(text)} characters{detail} are at least {at_least} tokens, more than "
                                f"the context of {self.limit} tokens holds", param=param)

    def check_messages(self, conversation: list[dict]) -> None:
        """`check_text` for a conversation's contents, with the template's tokens for each message."""
        if self.tokenizer is None:
            return
        extra = len(conversation) * self._template_tokens_per_message()
        self.check_text("".join(str(m.get("content") or "") for m in conversation), "messages", "messages", extra)

    # ---- tokenizing with a bound (a worker thread) -------------------------------------------
    def check_tokens(self, text, where: str, param: str, boundaries: int = 1) -> None:
        """Refuses `text` once a prefix of it holds more tokens than the context, tokenizing
        prefixes of growing length; text of a few tokens' worth of characters a context is left
        to the one tokenizing that follows. `boundaries`: the places where `text` joins pieces that
        are tokenized apart (a conversation's contents), each of which may merge one token less."""
        if not isinstance(text, str) or self.tokenizer is None:
            return
        length = PREFIX_CHARS_PER_TOKEN * (self.limit + 1)
        while length < len(text):
            count = len(self.tokenizer.encode(text[:length], add_special_tokens=False))
            if count - boundaries >= self.limit:
                raise APIError(400, f"{where}: its first {length} of {len(text)} characters are already {count} "
                                    f"tokens, more than the context of {self.limit} tokens holds", param=param)
            length *= 4

    # ---- measured once ---------------------------------------------------------------------
    def _chars_per_token(self) -> int:
        if self._max_chars_per_token is None:  # the longest token's string bounds its characters
            self._max_chars_per_token = max(map(len, self.tokenizer.backend.get_vocab()), default=1) or 1
        return self._max_chars_per_token

    def _template_tokens_per_message(self) -> int:
        """The tokens the chat template adds for each message (at least 1): an empty user message
        against it and an empty reply. 0 where the model has no usable template (then rendering
        refuses later)."""
        if self._tokens_per_message is None:
            user, reply = {"role": "user", "content": ""}, {"role": "assistant", "content": ""}
            try:
                one = len(self.llm.chat_prompt([user])[1])
                two = len(self.llm.chat_prompt([user, reply])[1])
                self._tokens_per_message = max(1, two - one)
            except Exception:  # no template, or one that refuses these: the render reports it
                self._tokens_per_message = 0
        return self._tokens_per_message
