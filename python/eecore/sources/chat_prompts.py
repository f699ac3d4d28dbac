"""Chat instructions made from local text, for on-policy data of an instruction-tuned model.

The draft layers learned from code-completion prompts (`eecore.train.generated_corpus`), so on the
default model's main use, answering chat requests, their drafts were rarely right (acceptance 0.27
at d = 1 on the CLI's bench prompts, where code prompts give 0.75). There is no chat dataset on
this machine and the tests never download one, so the instructions are built from what is
installed, in four kinds, all deterministic:

- "write":     a function's docstring, asked for as code ("Write a Python function `name` ...");
- "explain":   a function's source, to be explained in words;
- "summarize": a paragraph of a package's description (its dist-info METADATA), to be summarized;
- "about":     what a package is for, asked by name.

What matters for drafting is the answers, which the original model writes itself (greedy); the
instructions only have to lead it into its usual chat register: English explanations, lists and
code blocks. Held-out packages give held-out instructions, as for the code prompts.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from typing import Iterable, Optional

from eecore.sources.corpus import CorpusFile
from eecore.sources.descriptions import balanced_picks, package_description, prose_paragraphs

_FIRST_SENTENCE = re.compile(r"^(.+?[.!?])(?:\s|$)", re.S)
_MAX_SOURCE_LINES = 30


@dataclass(frozen=True)
class ChatInstruction:
    package: str
    kind: str       # write | explain | summarize | about
    text: str       # the user's message (not yet in the chat template)


def _docstring_sentence(fn: ast.AST) -> Optional[str]:
    """The docstring's first sentence when it is plain prose of 5-40 words, else None."""
    doc = ast.get_docstring(fn)
    if not doc:
        return None
    match = _FIRST_SENTENCE.match(" ".join(doc.split()))
    if match is None:
        return None
    sentence = match.group(1)
    words = sentence.split()
    if not 5 <= len(words) <= 40 or any(c in sentence for c in "`:>|{}[]\\") or not sentence[0].isalpha():
        return None
    return sentence


def function_instructions(file: CorpusFile) -> list[ChatInstruction]:
    """One instruction per documented public function of a file, in `ast.walk`'s order (module-level
    functions before the methods and nested functions below them): "write" and "explain" alternate,
    so each function is asked about one way."""
    try:
        tree = ast.parse(file.text)
    except SyntaxError:
        return []
    lines = file.text.split("\n")
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
            continue
        sentence = _docstring_sentence(node)
        if sentence is None:
            continue
        if len(out) % 2 == 0:
            text = f"Write a Python function `{node.name}`. Its docstring says: \"{sentence}\""
            out.append(ChatInstruction(file.package, "write", text))
        else:
            source = "\n".join(lines[node.lineno - 1: min(node.end_lineno, node.lineno - 1 + _MAX_SOURCE_LINES)])
            text = f"Explain what this Python function does:\n\n```python\n{source}\n```"
            out.append(ChatInstruction(file.package, "explain", text))
    return out


def description_instructions(package: str) -> list[ChatInstruction]:
    """"about" the package, then a "summarize" instruction per prose paragraph of its description
    (`eecore.evaluation.prompts.prose_paragraphs`, 30-200 words)."""
    out = [ChatInstruction(package, "about", f"What is the Python package {package} used for?")]
    try:
        description = package_description(package)
    except Exception:  # not installed, or metadata without a description
        return out
    for paragraph in prose_paragraphs(description):
        if len(paragraph.split()) <= 200:
            out.append(ChatInstruction(package, "summarize", f"Summarize this in one or two sentences:\n\n{paragraph}"))
    return out


def chat_instruction_records(n: int, files: Iterable[CorpusFile]) -> list[ChatInstruction]:
    """`n` instructions from the packages of `files` (fewer when they hold fewer), each package's
    share as equal as its instructions allow, evenly spaced within it, interleaved package by
    package (`eecore.evaluation.prompts`' picking); repeated texts count once."""
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"chat_instruction_records: n must be an int >= 0, got {n!r}")
    per_package: dict[str, list[ChatInstruction]] = {}
    seen: set[str] = set()
    files = list(files)
    for package in sorted({f.package for f in files}):
        per_package[package] = [i for i in description_instructions(package) if i.text not in seen]
        seen.update(i.text for i in per_package[package])
    for f in files:
        for instruction in function_instructions(f):
            if instruction.text not in seen:
                seen.add(instruction.text)
                per_package[f.package].append(instruction)
    return balanced_picks({p: v for p, v in per_package.items() if v}, n)
