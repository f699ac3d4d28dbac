"""Rebuilding a `tokenizers` tokenizer from the tokenizer metadata of a GGUF file.

A GGUF carries no tokenizer.json, only llama.cpp's description of the vocabulary:

  tokenizer.ggml.model        "gpt2" (byte-level BPE: Llama 3, Qwen2, SmolLM2) or "llama" (SentencePiece
                              BPE with byte fallback: Llama 2, Mistral)
  tokenizer.ggml.pre          which regex splits text before BPE ("llama-bpe", "qwen2", "smollm", ...)
  tokenizer.ggml.tokens       the vocabulary, by id
  tokenizer.ggml.token_type   1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
  tokenizer.ggml.merges       BPE merges "a b" by rank (byte-level files; SentencePiece files may omit them)
  tokenizer.ggml.scores       SentencePiece piece scores (higher merges first)
  tokenizer.ggml.{bos,eos,unknown,padding}_token_id, add_bos_token, add_eos_token, add_space_prefix
  tokenizer.chat_template

From these we assemble the same pipeline the model's original tokenizer.json describes: the
pre-tokenizer regexes of llama.cpp's pre-type, the BPE model, the decoder, the special tokens.
"""
from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from eecore.models.errors import CorruptCheckpointError, UnsupportedModelError
from eecore.models.tokenizer import Tokenizer, set_special_token_post_processor

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Split regexes of the byte-level pre-types (as the original models' tokenizer.json files spell them).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# tokenizer.ggml.pre -> (regexes applied one after the other, whether whole-word vocabulary hits skip
# the merges). Llama 3's tokenizer sets `ignore_merges`, and llama.cpp follows it for that pre-type.
_BYTE_LEVEL_PRE_TYPES: dict[str, tuple[tuple[str, ...], bool]] = {
    "default": ((_GPT2_SPLIT,), False),
    "gpt-2": ((_GPT2_SPLIT,), False),
    "gpt2": ((_GPT2_SPLIT,), False),
    "smollm": ((r"\p{N}", _GPT2_SPLIT), False),  # every digit alone, then GPT-2's split
    "llama3": ((_LLAMA3_SPLIT,), True),
    "llama-v3": ((_LLAMA3_SPLIT,), True),
    "llama-bpe": ((_LLAMA3_SPLIT,), True),
    "smaug-bpe": ((_LLAMA3_SPLIT,), True),
    "qwen2": ((_QWEN2_SPLIT,), False),
    "deepseek-r1-qwen": ((_QWEN2_SPLIT,), False),
}


def tokenizer_from_gguf(metadata: dict[str, Any], source: str) -> Tokenizer | None:
    """The tokenizer a GGUF's metadata describes, or None if it has none. `source` names the file in errors."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind is None:
        return None
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not tokens:
        raise CorruptCheckpointError(f"{source}: tokenizer.ggml.model is {kind!r} but tokenizer.ggml.tokens is missing")
    types = metadata.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise CorruptCheckpointError(
            f"{source}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")

    if kind == "gpt2":
        backend = _byte_level_bpe(metadata, tokens, types, source)
        add_bos_default = False
    elif kind == "llama":
        backend = _sentencepiece_bpe(metadata, tokens, types, source)
        add_bos_default = True  # llama.cpp adds BOS to SentencePiece vocabularies unless told otherwise
    else:
        raise UnsupportedModelError(
            f"{source}: tokenizer.ggml.model {kind!r} is not supported; expected 'gpt2' (byte-level BPE) "
            "or 'llama' (SentencePiece BPE)")

    # Control tokens are special (matched whole, dropped by skip_special_tokens); user-defined ones
    # are matched whole but decoded like text. Both keep their ids from the vocabulary.
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, k in zip(tokens, types) if k == CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, k in zip(tokens, types) if k == USER_DEFINED])

    def token(key: str) -> str | None:
        index = metadata.get(f"tokenizer.ggml.{key}")
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    bos, eos = token("bos_token_id"), token("eos_token_id")
    add_bos = metadata.get("tokenizer.ggml.add_bos_token", add_bos_default)
    add_eos = metadata.get("tokenizer.ggml.add_eos_token", False)
    set_special_token_post_processor(backend, bos if add_bos else None, eos if add_eos else None)
    # End-of-turn / end-of-message tokens also end generation (llama.cpp's "end of generation" set).
    eos_tokens = [t for t in (eos, token("eot_token_id"), token("eom_token_id")) if t is not None]
    return Tokenizer(backend, bos_token=bos, eos_tokens=eos_tokens, unk_token=token("unknown_token_id"),
                     pad_token=token("padding_token_id"), chat_template=metadata.get("tokenizer.chat_template"))


def _byte_level_bpe(metadata: dict, tokens: list[str], types: list[int], source: str) -> BackendTokenizer:
    pre_type = metadata.get("tokenizer.ggml.pre", "default")
    if pre_type not in _BYTE_LEVEL_PRE_TYPES:
        raise UnsupportedModelError(
            f"{source}: tokenizer.ggml.pre {pre_type!r} is not supported; supported pre-tokenizers: "
            f"{', '.join(sorted(_BYTE_LEVEL_PRE_TYPES))}")
    splits, ignore_merges = _BYTE_LEVEL_PRE_TYPES[pre_type]
    raw_merges = metadata.get("tokenizer.ggml.merges")
    if raw_merges is None:
        raise CorruptCheckpointError(f"{source}: a byte-level BPE tokenizer needs tokenizer.ggml.merges")
    merges = []
    for merge in raw_merges:
        left, sep, right = merge.partition(" ")
        if not sep or not left or not right:
            raise CorruptCheckpointError(f"{source}: malformed merge {merge!r} in tokenizer.ggml.merges")
        merges.append((left, right))
    vocab: dict[str, int] = {}
    for index, text in enumerate(tokens):
        vocab.setdefault(text, index)
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
        # Map bytes to the printable alphabet the vocabulary is spelled in; the splitting is done.
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(metadata: dict, tokens: list[str], types: list[int], source: str) -> BackendTokenizer:
    vocab: dict[str, int] = {}
    for index, text in enumerate(tokens):
        vocab.setdefault(text, index)
    raw_merges = metadata.get("tokenizer.ggml.merges")
    if raw_merges is not None:
        merges = [tuple(m.split(" ", 1)) for m in raw_merges]
    else:
        scores = metadata.get("tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise CorruptCheckpointError(
                f"{source}: a SentencePiece tokenizer needs tokenizer.ggml.scores (one per token) or merges")
        merges = _merges_from_scores(tokens, types, scores)
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True,
                                          byte_fallback=True))
    add_space_prefix = metadata.get("tokenizer.ggml.add_space_prefix", True)
    # SentencePiece writes spaces as U+2581 and (add_dummy_prefix) starts the text with one more,
    # even when it already starts with a space. As in llama.cpp, every text run that follows a
    # special token gets that prefix too (the normalizer runs once per run between added tokens).
    space = normalizers.Replace(" ", "\u2581")
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), space]) if add_space_prefix else space
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _merges_from_scores(tokens: list[str], types: list[int], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's BPE, which repeatedly joins the adjacent pair whose
    union is the highest-scoring piece: every split of a normal piece into two normal pieces is a
    merge, ranked by the score of the piece it makes."""
    normal = {t: i for i, (t, k) in enumerate(zip(tokens, types)) if k == NORMAL}
    ranked = []
    for piece, index in normal.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                ranked.append((-scores[index], index, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]
