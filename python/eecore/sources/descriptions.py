"""Plain text about the installed packages: which distributions eecore's runtime pulls in, their
project descriptions (dist-info METADATA, read from disk), the plain-prose paragraphs of those
descriptions, and a balanced pick of items over groups (packages). Evaluation turns them into
prose prompts; the request makers in this package into chat requests."""
from __future__ import annotations

import re
from typing import Optional

# A paragraph is prose when none of its lines starts like markup (heading, list, quote, table, rst
# directive, indented code) and, once inline markup is unwrapped, nothing code- or link-like is left.
_MARKUP_LINE = re.compile(r"^\s*(?:[#*>|=+~`-]|\.\.|\d+[.)]\s|\t|    )")
_INLINE_MARKUP = [
    (re.compile(r"!?\[([^\]]*)\]\([^)]*\)"), r"\1"),       # [text](url)
    (re.compile(r":\w+:`([^`]*)`"), r"\1"),                  # :role:`text`
    (re.compile(r"`+([^`]*)`+_?"), r"\1"),                    # `code`, ``code``, `link`_
    (re.compile(r"\*\*([^*]+)\*\*"), r"\1"),                 # **bold**
    (re.compile(r"(?<!\w)\*([^*]+)\*(?!\w)"), r"\1"),          # *emphasis*
    (re.compile(r"(?<=\w)_(?=[\s.,;:!?)]|$)"), ""),            # rst link reference name_
]
_NOT_PROSE = re.compile(r"https?:|www\.|[<>|{}\[\]\\@#^~_=]|::|\.py\b|\w\(")
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")


def normalize_name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement(spec: str) -> Optional[str]:
    """The distribution a requirement names, or None when its marker leaves it out here (an extra's
    requirement, or one for another platform or Python)."""
    try:
        from packaging.requirements import Requirement
    except ImportError:  # no `packaging`: keep plain requirements, drop every marked one
        name, _, marker = spec.partition(";")
        match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", name)
        return match.group(1) if match and not marker.strip() else None
    req = Requirement(spec)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        return None
    return req.name


def runtime_dependencies(root: str = "eecore") -> list[str]:
    """The installed distributions that `root` needs at run time, directly or through others
    (extras left out), `root` itself excluded; normalized names, sorted."""
    from importlib import metadata

    seen: set[str] = set()
    todo = [root]
    while todo:
        name = normalize_name(todo.pop())
        if name in seen:
            continue
        try:
            requires = metadata.distribution(name).requires or []
        except metadata.PackageNotFoundError:  # a requirement that is not installed has no text
            continue
        seen.add(name)
        todo.extend(r for r in (_requirement(spec) for spec in requires) if r is not None)
    seen.discard(normalize_name(root))
    return sorted(seen)


def prose_paragraphs(description: str, *, min_words: int = 30) -> list[str]:
    """The plain-prose paragraphs of a Markdown or reStructuredText description, each on one line:
    at least `min_words` words and two sentences, ending with a period, mostly letters, not shouted
    (license disclaimers in capitals)."""
    out = []
    for block in re.split(r"\n\s*\n", description):
        lines = block.strip("\n").split("\n")
        if not block.strip() or any(_MARKUP_LINE.match(line) for line in lines):
            continue
        text = " ".join(block.split())
        for pattern, replacement in _INLINE_MARKUP:
            text = pattern.sub(replacement, text)
        words = text.split()
        if _NOT_PROSE.search(text) or not text.endswith(".") or len(words) < min_words:
            continue
        if sum(c.isalpha() or c.isspace() for c in text) < 0.9 * len(text):
            continue
        if sum(w.isupper() and len(w) > 1 for w in words) > 0.2 * len(words):
            continue
        if len(SENTENCE_END.split(text)) < 2:
            continue
        out.append(text)
    return out


def package_description(package: str) -> str:
    """The long description of an installed distribution: its dist-info METADATA, read from disk."""
    from importlib import metadata

    meta = metadata.distribution(package).metadata
    return meta.get_payload() or meta.get("Description") or ""


def balanced_picks(per_package: dict[str, list], n: int) -> list:
    """`n` items: each group's share as equal as the groups' sizes allow (a short group leaves its
    rest to the others), evenly spaced within a group, interleaved group by group."""
    shares = {p: 0 for p in per_package}
    left = n
    while left > 0:
        open_ = [p for p in per_package if shares[p] < len(per_package[p])]
        if not open_:
            break
        for p in open_:
            if left == 0:
                break
            shares[p] += 1
            left -= 1
    picked = [spread_evenly(per_package[p], shares[p]) for p in per_package]
    out = []
    for i in range(max((len(v) for v in picked), default=0)):
        out.extend(v[i] for v in picked if i < len(v))
    return out


def spread_evenly(items: list, k: int) -> list:
    """k items evenly spaced over `items` (all of them when there are no more than k)."""
    if k >= len(items):
        return list(items)
    return [items[(2 * i + 1) * len(items) // (2 * k)] for i in range(k)]
