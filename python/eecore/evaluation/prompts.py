"""Code-completion prompts from text that eecore's training never saw.

The exit adapters train on the Python source of installed packages (`eecore.sources.corpus`), with
whole packages held out (`DEFAULT_HELDOUT_PACKAGES`: jinja2, tqdm, gguf). The prompts here come
from those held-out files only, read through the corpus builder itself (`build_corpus`), so they
are exactly the files of its held-out split: no network, no data set, and the same prompts on every
machine with the same package versions.

A prompt is the start of a function: a few preceding lines of its file (cut at a statement start;
for a method, its class line when the context does not reach it), then the function's decorators,
its `def` line(s) and its docstring if it has one. The prompt ends right after the `:` of the
signature or the docstring's closing quotes, with no newline: SmolLM2's tokenizer merges a newline
with the next line's indentation, so the model writes that token itself.

    from eecore.evaluation.prompts import heldout_code_prompts
    prompts = heldout_code_prompts(16)       # 16 strings, spread over jinja2, tqdm and gguf

English prose prompts (`prose_prompts`, `prose_prompt_records`) come from the project descriptions
(dist-info METADATA) of eecore's installed runtime dependencies: a paragraph of plain prose is cut
after its first sentence(s), and the rest of the paragraph is kept as the reference continuation.
"""
from __future__ import annotations

import ast
import re
import textwrap
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from eecore.sources.corpus import DEFAULT_HELDOUT_PACKAGES, CorpusFile, build_corpus
from eecore.sources.descriptions import (SENTENCE_END, balanced_picks, normalize_name, package_description,
                                         prose_paragraphs, runtime_dependencies)

__all__ = ["CodePrompt", "heldout_code_prompt_records", "heldout_code_prompts", "function_prompts",
           "estimate_tokens", "ProsePrompt", "prose_paragraphs", "prose_prompt_records", "prose_prompts",
           "runtime_dependencies"]

# GPT-2-style pre-tokenization (SmolLM2's tokenizer: words with their leading space, single digits,
# punctuation runs, whitespace runs that end before a word's leading space)
_PIECES = re.compile(r"""'(?:[sdmt]|ll|ve|re)| ?[^\W\d]+| ?\d| ?[^\s\w]+|\s+(?!\S)|\s+""")


def estimate_tokens(text: str) -> int:
    """About the number of BPE tokens of `text`, without a tokenizer: one per pre-token, plus one
    per 4 characters of a long one. On the held-out code it is SmolLM2's count within 10% for most
    prompts (0.8x to 1.4x at the extremes), and the same on every machine."""
    return sum(1 + (len(p.strip()) - 1) // 4 if p.strip() else 1 for p in _PIECES.findall(text))


@dataclass(frozen=True)
class CodePrompt:
    package: str      # the distribution the file belongs to
    path: str         # the file, relative to site-packages
    function: str     # qualified name (Class.method)
    lineno: int       # line of the `def` in the file (1-based)
    header: str       # decorators, `def` line(s) and docstring: the end of `text`
    text: str         # the prompt: context lines, then `header`
    has_docstring: bool


def _trivial_body(body: list[ast.stmt]) -> bool:
    """True for a body with nothing to complete: `pass`, `...`, `raise NotImplementedError`."""
    if len(body) != 1:
        return False
    stmt = body[0]
    if isinstance(stmt, ast.Pass):
        return True
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and stmt.value.value is Ellipsis:
        return True
    if isinstance(stmt, ast.Raise) and stmt.exc is not None:
        exc = stmt.exc.func if isinstance(stmt.exc, ast.Call) else stmt.exc
        return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"
    return False


def _header_parses(header: str) -> bool:
    """The header is a complete function header: with a body added it parses as one function."""
    try:
        tree = ast.parse(textwrap.dedent(header) + "\n    pass\n")
    except SyntaxError:
        return False
    return len(tree.body) == 1 and isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef))


def function_prompts(text: str, *, max_tokens: int = 110, min_tokens: int = 50, min_body_lines: int = 2,
                     count: Callable[[str], int] = estimate_tokens) -> list[tuple[str, int, str, str, bool]]:
    """Every usable function prompt of one file's source, in line order:
    (qualified name, def line, header, prompt text, has docstring). A function is used when it
    has a body to complete (at least `min_body_lines` lines after its header, not just `pass`),
    its header ends with the signature's `:` or the docstring's quotes and fits in `max_tokens`;
    the prompt is the header plus as many whole preceding statements as fit in `max_tokens`, and
    at least `min_tokens` long. `count` counts tokens (`estimate_tokens`, or a tokenizer's)."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    source = _Source(text, tree)
    out = []
    for fn, qual, cls in _functions(tree):
        header = source.header(fn, min_body_lines)
        if header is None:
            continue
        first, end, doc = header
        text = source.span(first, end).rstrip()
        if not text.endswith((":", '"""', "'''")) or count(text) > max_tokens or not _header_parses(text):
            continue
        prompt = source.prompt(fn, cls, first, end, max_tokens, count)
        if count(prompt) >= min_tokens:
            out.append((qual + fn.name, fn.lineno, text, prompt, doc))
    return out


def _functions(node: ast.AST, qual: str = "", cls: Optional[ast.ClassDef] = None):
    """(function, qualified prefix, enclosing class or None) of every function, in source order,
    each before the functions nested in it."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.ClassDef):
            yield from _functions(child, f"{qual}{child.name}.", child)
        elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield child, qual, cls
            yield from _functions(child, f"{qual}{child.name}.", None)


class _Source:
    """One file's lines, and the lines where a statement (or its first decorator, or a comment)
    starts: where a prompt's context may begin."""

    def __init__(self, text: str, tree: ast.AST):
        self.lines = text.split("\n")
        self.starts: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.stmt):
                self.starts.add(node.lineno)
                for dec in getattr(node, "decorator_list", ()):
                    self.starts.add(dec.lineno)
        for i, line in enumerate(self.lines, 1):
            if line.lstrip().startswith("#"):
                self.starts.add(i)

    def span(self, first: int, last: int) -> str:  # lines first..last, 1-based, inclusive
        return "\n".join(self.lines[first - 1:last])

    def header(self, fn, min_body_lines: int) -> Optional[tuple[int, int, bool]]:
        """(first line with decorators, last line of the signature or docstring, has docstring), or
        None when the function has no body worth completing."""
        body, lines = fn.body, self.lines
        doc = ast.get_docstring(fn, clean=False) is not None
        first_body = body[1] if doc and len(body) > 1 else (None if doc else body[0])
        if first_body is None or _trivial_body(body[1:] if doc else body):
            return None
        if first_body.lineno == fn.lineno:  # `def f(): return x`
            return None
        if doc:
            end = body[0].end_lineno
        else:  # the signature's last line: drop blank and comment lines before the body
            end = first_body.lineno - 1
            while end > fn.lineno and (not lines[end - 1].strip() or lines[end - 1].lstrip().startswith("#")):
                end -= 1
        if fn.end_lineno - end < min_body_lines:
            return None
        return min([fn.lineno] + [d.lineno for d in fn.decorator_list]), end, doc

    def prompt(self, fn, cls: Optional[ast.ClassDef], first: int, end: int, max_tokens: int, count) -> str:
        """The header and the whole statements before it (within the class, for a method) that fit."""
        floor = cls.lineno if cls is not None else 1
        begin = first
        for s in range(first - 1, floor - 1, -1):
            if count(self.span(s, end)) > max_tokens:
                break
            if s in self.starts:
                begin = s
        prompt = self.span(begin, end).strip("\n").rstrip()
        if cls is not None and begin > cls.lineno:  # the class line did not fit: lead with it when
            class_line = self.lines[cls.lineno - 1]  # the context starts with one of its members
            indent = len(self.lines[fn.lineno - 1]) - len(self.lines[fn.lineno - 1].lstrip())
            if (class_line.rstrip().endswith(":") and len(prompt) - len(prompt.lstrip(" ")) == indent
                    and count(class_line + "\n" + prompt) <= max_tokens):
                prompt = class_line + "\n" + prompt
        return prompt


def heldout_code_prompt_records(n: int = 16, *, packages: Iterable[str] = DEFAULT_HELDOUT_PACKAGES,
                                max_tokens: int = 110, min_tokens: int = 50,
                                count: Callable[[str], int] = estimate_tokens,
                                files: Optional[list[CorpusFile]] = None) -> list[CodePrompt]:
    """`n` code-completion prompts (module doc) from the held-out packages, with where each comes
    from. Deterministic: every usable function in (package, file, line) order, evenly spaced picks
    in each package, the packages' shares as equal as their functions allow, interleaved package by
    package. Lengths are `min_tokens`..`max_tokens` as `count` counts them (`estimate_tokens` by
    default, so the prompts do not depend on a model: about 60 to 120 SmolLM2 tokens). `files`:
    the held-out files to use instead of `build_corpus((), packages).heldout`."""
    if n < 0:
        raise ValueError(f"heldout_code_prompts: n must be >= 0, got {n!r}")
    if not 0 < min_tokens <= max_tokens:
        raise ValueError(f"heldout_code_prompts: need 0 < min_tokens <= max_tokens, got {min_tokens}, {max_tokens}")
    packages = list(packages)
    if files is None:
        files = build_corpus((), packages).heldout
    per_package: dict[str, list[CodePrompt]] = {p: [] for p in packages}
    seen: set[str] = set()
    for f in files:
        for name, lineno, header, text, doc in function_prompts(f.text, max_tokens=max_tokens,
                                                                min_tokens=min_tokens, count=count):
            if text in seen:
                continue
            seen.add(text)
            per_package.setdefault(f.package, []).append(CodePrompt(f.package, f.path, name, lineno, header, text, doc))
    return balanced_picks(per_package, n)


def heldout_code_prompts(n: int = 16, **kwargs) -> list[str]:
    """The texts of `heldout_code_prompt_records(n, **kwargs)`."""
    return [r.text for r in heldout_code_prompt_records(n, **kwargs)]


# ---- English prose (the paragraphs come from eecore.sources.descriptions) ----------------------
@dataclass(frozen=True)
class ProsePrompt:
    package: str      # the distribution whose description the paragraph comes from
    text: str         # the prompt: the paragraph's first sentence(s)
    reference: str    # the rest of the paragraph (what its author wrote next), without the leading space


def _split_paragraph(text: str, min_prompt_words: int) -> Optional[tuple[str, str]]:
    """(the shortest run of leading sentences with `min_prompt_words` words, the rest), or None
    when nothing would be left for the reference."""
    sentences = SENTENCE_END.split(text)
    for k in range(1, len(sentences)):
        head = " ".join(sentences[:k])
        if len(head.split()) >= min_prompt_words:
            return head, " ".join(sentences[k:])
    return None


def prose_prompt_records(n: int = 16, *, packages: Optional[Iterable[str]] = None, min_words: int = 30,
                         min_prompt_words: int = 12) -> list[ProsePrompt]:
    """`n` English prose prompts with reference continuations, from the project descriptions of
    `packages` (default: `runtime_dependencies()`, what installing eecore installed). No network:
    the text is the dist-info METADATA already on disk, so the prompts are the same on every
    machine with the same package versions. A paragraph (`prose_paragraphs`) is cut after the
    first sentences that reach `min_prompt_words` words: they are the prompt, the rest of the
    paragraph the reference. Picks are spread evenly over each package's paragraphs, the packages'
    shares as equal as their paragraphs allow, interleaved package by package (in name order);
    fewer than `n` when there are not enough paragraphs."""
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"prose_prompts: n must be an int >= 0, got {n!r}")
    if min_prompt_words < 1 or min_words <= min_prompt_words:
        raise ValueError(f"prose_prompts: need 1 <= min_prompt_words < min_words, got {min_prompt_words}, "
                         f"{min_words}")
    names = runtime_dependencies() if packages is None else sorted({normalize_name(p) for p in packages})
    per_package: dict[str, list[ProsePrompt]] = {}
    seen: set[str] = set()   # the same boilerplate paragraph in several descriptions counts once
    for name in names:
        try:
            description = package_description(name)
        except Exception:  # not installed, or metadata without a description: no prose from it
            continue
        for paragraph in prose_paragraphs(description, min_words=min_words):
            split = _split_paragraph(paragraph, min_prompt_words)
            if split is None or paragraph in seen:
                continue
            seen.add(paragraph)
            per_package.setdefault(name, []).append(ProsePrompt(name, split[0], split[1]))
    return balanced_picks(per_package, n)


def prose_prompts(n: int = 16, **kwargs) -> list[str]:
    """The texts of `prose_prompt_records(n, **kwargs)`."""
    return [r.text for r in prose_prompt_records(n, **kwargs)]
