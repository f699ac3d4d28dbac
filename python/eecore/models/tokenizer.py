"""`Tokenizer`: a `tokenizers.Tokenizer` plus what generation needs around it.

The fast `tokenizers` library does the encoding and decoding; this class adds the special-token
ids (BOS, the EOS set), and the model's chat template rendered with jinja2 the way HF transformers
renders it (sandboxed, `trim_blocks`/`lstrip_blocks`, `raise_exception`, `tojson`, `strftime_now`),
so a prompt built here is byte-identical to one built by `apply_chat_template(tokenize=False)`.

Two constructors: `Tokenizer.from_hf_dir` (tokenizer.json + tokenizer_config.json) and
`eecore.models.gguf_tokenizer.tokenizer_from_gguf` (a GGUF file's tokenizer metadata).
"""
from __future__ import annotations

import json
import os
import re
import secrets
from datetime import datetime
from functools import cached_property
from typing import Any, Iterable

import tokenizers
from tokenizers import processors

from eecore.models.errors import CorruptCheckpointError, ModelLoadError


_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class ChatTemplateError(ModelLoadError):
    """The model has no chat template, or its template failed to render."""


class Tokenizer:
    def __init__(self, backend: tokenizers.Tokenizer, *, bos_token: str | None = None,
                 eos_tokens: Iterable[str] = (), unk_token: str | None = None, pad_token: str | None = None,
                 chat_template: str | None = None):
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = next(iter(eos_tokens), None)
        self.unk_token = unk_token
        self.pad_token = pad_token
        self.chat_template = chat_template
        self.bos_token_id: int | None = self._id_of(bos_token)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(
            i for i in (self._id_of(t) for t in eos_tokens) if i is not None))

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    # ---- encoding -----------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Every id the tokenizer can produce, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` adds what the post-processor adds (e.g. BOS)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @cached_property
    def byte_token_ids(self) -> frozenset[int]:
        """Ids of byte-fallback tokens (`<0xE6>`, SentencePiece vocabularies): the decoder reads a run
        of them together, and turns all of it into U+FFFD while it is not valid UTF-8, so text
        decoded before the run ends can still change (engine.detokenizer)."""
        return frozenset(i for token, i in self.backend.get_vocab(with_added_tokens=False).items()
                         if _BYTE_TOKEN.fullmatch(token))

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    # ---- chat template ------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render `messages` ([{"role": ..., "content": ...}, ...]) into the model's prompt text.

        Extra keyword arguments (e.g. `tools=...`) reach the template as variables, as in HF.
        """
        if self.chat_template is None:
            raise ChatTemplateError(
                "this tokenizer has no chat template (no chat_template in tokenizer_config.json / "
                "chat_template.jinja, or tokenizer.chat_template in the GGUF); format the prompt yourself")
        variables = dict(bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                         unk_token=self.unk_token or "", pad_token=self.pad_token or "")
        variables.update(kwargs)
        try:
            return self._compiled_template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                  **variables)
        except ChatTemplateError:
            raise
        except Exception as e:  # a template bug or messages the template rejects
            raise ChatTemplateError(f"the chat template failed to render: {type(e).__name__}: {e}") from e

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> tuple[str, list[int]]:
        """`messages` through the chat template: the prompt text and its token ids, where only the
        template's own special tokens are special. What a user wrote (each message's content and
        name) is encoded as text, so content that spells a control token ("<|im_start|>system")
        cannot open a turn of its own: vLLM and llama.cpp's server treat content the same way.

        How: the template renders with a random placeholder for each user string, the rendered text
        is split at the placeholders, the template's pieces are encoded with special tokens and the
        user strings without (`encode_special_tokens`). A template that changes what it inserts
        (trims it, say) is caught by comparing with the plain rendering; then only content without
        a control token in it can be served (a ChatTemplateError otherwise). The plain rendering is
        skipped (one render, not two) for a template that a probe, once, showed to insert every
        role's text as it is (`_inserts_verbatim`)."""
        verbatim = self._inserts_verbatim(add_generation_prompt) and not any("name" in m for m in messages)
        text = None if verbatim else self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        nonce = secrets.token_hex(8)
        fields, masked = [], []
        for message in messages:
            message = dict(message)
            for key in ("content", "name"):
                if isinstance(message.get(key), str):
                    message[key] = f"\ue000{nonce}:{len(fields)}\ue001"
                    fields.append(messages[len(masked)][key])
            masked.append(message)
        rendered = self.apply_chat_template(masked, add_generation_prompt=add_generation_prompt)
        pieces = re.split(f"\ue000{nonce}:(\\d+)\ue001", rendered)
        # pieces: template text, field index, template text, field index, ..., template text
        joined = "".join(p if i % 2 == 0 else fields[int(p)] for i, p in enumerate(pieces))
        if verbatim:
            text = joined
        elif joined != text:
            if any(self._spells_special(f) for f in fields):
                raise ChatTemplateError("a message spells a control token, and this model's chat template changes "
                                        "message text as it inserts it, so it cannot be kept as plain text")
            return text, self.encode(text, add_special_tokens=False)
        ids: list[int] = []
        for i, piece in enumerate(pieces):
            if i % 2 == 0:
                ids += self.encode(piece, add_special_tokens=False) if piece else []
            elif fields[int(piece)]:
                ids += self._text_backend.encode(fields[int(piece)], add_special_tokens=False).ids
        return text, ids

    # What a probe conversation holds for each role: the text templates most often change (outer
    # whitespace, blank lines, tabs, reasoning a template drops from past replies, non-ASCII, nothing)
    _PROBE_TEXTS = ("  outer spaces  ", "line one\n\nline two\n", "\tafter a tab", "<think>why</think>answer",
                    "ÄÖü 漢字 🙂", "")

    def _inserts_verbatim(self, add_generation_prompt: bool) -> bool:
        """Whether the chat template inserts message text unchanged: rendered plainly and with
        placeholders, probe conversations (every role, the texts above, a reply in the past and one
        last) give the same prompt. Decided once per template and flag; a template that refuses the
        probe counts as not verbatim (both renderings are then compared every time)."""
        key = (self.chat_template, add_generation_prompt)
        cache = self.__dict__.setdefault("_verbatim_probes", {})
        if key not in cache:
            cache[key] = self._probe_verbatim(add_generation_prompt)
        return cache[key]

    def _probe_verbatim(self, add_generation_prompt: bool) -> bool:
        texts = self._PROBE_TEXTS
        conversations = [[{"role": "system", "content": a}, {"role": "user", "content": b},
                          {"role": "assistant", "content": c}, {"role": "user", "content": d}]
                         for a, b, c, d in zip(texts, texts[1:] + texts[:1], texts[2:] + texts[:2], texts[3:] + texts[:3])]
        conversations.append([{"role": "user", "content": "q"}, {"role": "assistant", "content": texts[3]}])
        nonce = secrets.token_hex(8)
        try:
            for conversation in conversations:
                masked = [dict(m, content=f"\ue000{nonce}:{i}\ue001") for i, m in enumerate(conversation)]
                plain = self.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
                rendered = self.apply_chat_template(masked, add_generation_prompt=add_generation_prompt)
                pieces = re.split(f"\ue000{nonce}:(\\d+)\ue001", rendered)
                joined = "".join(p if i % 2 == 0 else conversation[int(p)]["content"] for i, p in enumerate(pieces))
                if joined != plain:
                    return False
        except ChatTemplateError:
            return False
        return True

    @cached_property
    def _text_backend(self) -> tokenizers.Tokenizer:
        """A copy of the backend that encodes special-token strings as plain text (a copy, so that
        other threads encoding with the backend are never affected)."""
        backend = tokenizers.Tokenizer.from_str(self.backend.to_str())
        backend.encode_special_tokens = True
        return backend

    def _spells_special(self, text: str) -> bool:
        return any(t.special and t.content in text for t in self.backend.get_added_tokens_decoder().values())

    @cached_property
    def _compiled_template(self):
        return _compile_chat_template(self.chat_template)

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos_token_id={self.bos_token_id}, "
                f"eos_token_ids={self.eos_token_ids}, chat_template={'yes' if self.chat_template else 'no'})")

    # ---- construction from an HF model directory ------------------------------------------------

    @staticmethod
    def from_hf_dir(path: str) -> "Tokenizer | None":
        """The tokenizer of an HF model directory, or None when it has no tokenizer.json."""
        tokenizer_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tokenizer_file):
            return None
        try:
            backend = tokenizers.Tokenizer.from_file(tokenizer_file)
        except Exception as e:
            raise CorruptCheckpointError(f"{tokenizer_file}: not a valid tokenizers JSON file ({e})") from e
        config = _read_json(os.path.join(path, "tokenizer_config.json"))
        special_map = _read_json(os.path.join(path, "special_tokens_map.json"))

        def special(name: str) -> str | None:
            value = config.get(name, special_map.get(name))
            return value.get("content") if isinstance(value, dict) else value

        bos, eos = special("bos_token"), special("eos_token")
        if "add_bos_token" in config or "add_eos_token" in config:
            # As transformers does: an explicit flag in tokenizer_config.json wins over the
            # post-processor stored in tokenizer.json.
            set_special_token_post_processor(backend, bos if config.get("add_bos_token") else None,
                                        eos if config.get("add_eos_token") else None)
        return Tokenizer(backend, bos_token=bos, eos_tokens=[eos] if eos else [], unk_token=special("unk_token"),
                         pad_token=special("pad_token"), chat_template=_hf_chat_template(path, config))


def set_special_token_post_processor(backend: tokenizers.Tokenizer, bos: str | None, eos: str | None) -> None:
    """Make `encode(add_special_tokens=True)` add exactly `bos` before and `eos` after (None: nothing)."""
    specials = [(t, backend.token_to_id(t)) for t in (bos, eos) if t is not None]
    specials = [(t, i) for t, i in specials if i is not None]
    present = {t for t, _ in specials}

    def sequence(piece: str, type_id: int) -> str:
        parts = [f"{bos}:{type_id}" if bos in present else "", f"{piece}:{type_id}",
                 f"{eos}:{type_id}" if eos in present else ""]
        return " ".join(p for p in parts if p)

    backend.post_processor = processors.TemplateProcessing(
        single=sequence("$A", 0), pair=f"{sequence('$A', 0)} {sequence('$B', 1)}", special_tokens=specials)


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CorruptCheckpointError(f"{path}: not valid JSON ({e})") from e


def _hf_chat_template(path: str, config: dict) -> str | None:
    """The default chat template: chat_template.jinja (transformers 5), else tokenizer_config.json,
    else chat_template.json."""
    jinja_file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template")
    if template is None:
        template = _read_json(os.path.join(path, "chat_template.json")).get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template


def _compile_chat_template(source: str):
    # Imported here: only chat use pays for jinja2.
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for HF's training masks;
        for rendering it is a plain block."""
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body)

    def raise_exception(message):
        raise ChatTemplateError(f"the chat template rejected the messages: {message}")

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja2's own tojson escapes HTML characters; chat templates want plain JSON.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the chat template is not valid jinja: {e}") from e
