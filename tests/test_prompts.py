"""Held-out code prompts (eecore.evaluation.prompts): deterministic, offline, spread over the held-out packages,
each ending inside a function's header or docstring, and none of them in the training corpus."""
from __future__ import annotations

import ast
import socket
import textwrap

import pytest

from eecore.evaluation.prompts import estimate_tokens, function_prompts, heldout_code_prompt_records, heldout_code_prompts
from eecore.sources.corpus import DEFAULT_HELDOUT_PACKAGES, build_corpus

# small training distributions, markupsafe being jinja2's own dependency
SMALL_TRAIN = ("markupsafe", "iniconfig", "pluggy", "packaging")


def _no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("prompt building opened a network connection")

    monkeypatch.setattr(socket, "socket", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


@pytest.fixture(scope="module")
def heldout():
    corpus = build_corpus((), DEFAULT_HELDOUT_PACKAGES)
    if corpus.missing:
        pytest.skip(f"held-out packages not installed: {corpus.missing}")
    return corpus


@pytest.fixture(scope="module")
def records(heldout):
    return heldout_code_prompt_records(16)


def test_deterministic_offline_and_counted(monkeypatch, heldout, records):
    _no_network(monkeypatch)
    with pytest.raises(AssertionError):  # the guard itself works
        socket.create_connection(("example.com", 80))
    again = heldout_code_prompt_records(16)
    assert again == records
    assert heldout_code_prompts(16) == [r.text for r in records]
    assert len(records) == 16
    assert len(heldout_code_prompts(5)) == 5 and heldout_code_prompts(0) == []
    with pytest.raises(ValueError):
        heldout_code_prompts(-1)


def test_spread_over_the_heldout_packages(records):
    texts = [r.text for r in records]
    assert all(t.strip() for t in texts) and len(set(texts)) == len(texts)
    per_package = {p: sum(r.package == p for r in records) for p in DEFAULT_HELDOUT_PACKAGES}
    assert min(per_package.values()) >= 5, per_package
    assert [r.package for r in records[:3]] == list(DEFAULT_HELDOUT_PACKAGES)  # interleaved
    assert len({r.path for r in records}) >= 8  # many files, not one
    for r in records:
        assert 40 <= estimate_tokens(r.text) <= 110


def test_every_prompt_ends_inside_a_function_header(heldout, records):
    files = {(f.package, f.path): f.text for f in heldout.heldout}
    for r in records:
        assert r.text.endswith(r.header) and r.text == r.text.rstrip()
        last = r.header.rstrip().split("\n")[-1]
        assert last.endswith(":") or last.endswith(('"""', "'''")), r
        tree = ast.parse(textwrap.dedent(r.header) + "\n    pass\n")
        (fn,) = tree.body
        assert isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and r.function.endswith(fn.name)
        assert (ast.get_docstring(fn) is not None) == r.has_docstring
        # the header is the file's own text at that line, and the function's body follows it
        lines = files[(r.package, r.path)].split("\n")
        header = r.header.split("\n")
        k = next(i for i, l in enumerate(header) if l.lstrip().startswith(("def ", "async def ")))
        first = r.lineno - 1 - k  # 0-based line of the header's first line
        assert lines[first:first + len(header)] == header
        body_line = next(l for l in lines[first + len(header):] if l.strip() and not l.lstrip().startswith("#"))
        indent = len(header[0]) - len(header[0].lstrip(" "))
        assert len(body_line) - len(body_line.lstrip(" ")) > indent


def test_no_prompt_is_in_the_training_corpus(monkeypatch, records):
    _no_network(monkeypatch)
    corpus = build_corpus(SMALL_TRAIN, DEFAULT_HELDOUT_PACKAGES)
    assert corpus.train and not set(corpus.missing) & set(DEFAULT_HELDOUT_PACKAGES)
    train_text = corpus.text("train")
    heldout_paths = {(f.package, f.path) for f in corpus.heldout}
    for r in records:
        assert (r.package, r.path) in heldout_paths
        assert r.text not in train_text and r.header not in train_text


SOURCE = '''\
import os


class Box:
    """A box."""

    size = 3

    def trivial(self):
        pass

    def one_liner(self): return 1

    def grow(self, by: int) -> int:
        """Grow the box by `by`."""
        self.size += by
        return self.size

    @property
    def area(
        self,
    ) -> int:
        # no docstring: the header is the signature
        return self.size * self.size * 1
'''


def test_function_prompts_on_a_small_file():
    found = {name: (lineno, header, text, doc) for name, lineno, header, text, doc
             in function_prompts(SOURCE, max_tokens=200, min_tokens=1)}
    assert set(found) == {"Box.grow", "Box.area"}  # nothing to complete in the others
    lineno, header, text, doc = found["Box.grow"]
    assert doc and lineno == 14
    assert header == '    def grow(self, by: int) -> int:\n        """Grow the box by `by`."""'
    assert text.startswith("class Box:\n") and text.endswith(header)  # a method: context within its class
    lineno, header, text, doc = found["Box.area"]
    assert not doc and header.startswith("    @property") and header.endswith(") -> int:")
    # tighter budgets: the context is whole statements from the file, and the class line leads
    # when the context starts with a member of the class but does not reach the class line
    for budget in range(24, 60):
        text = {n: t for n, _, _, t, _ in function_prompts(SOURCE, max_tokens=budget, min_tokens=1)}["Box.grow"]
        assert estimate_tokens(text) <= budget and text.endswith(found["Box.grow"][1])
        lead = "class Box:\n"
        body = text[len(lead):] if text.startswith(lead) and not text.startswith(lead + '    """') else text
        assert "\n" + body + "\n" in "\n" + SOURCE
    grow = {n: t for n, _, _, t, _ in function_prompts(SOURCE, max_tokens=30, min_tokens=1)}["Box.grow"]
    assert grow.startswith("class Box:\n    def grow(")
    grow = {n: t for n, _, _, t, _ in function_prompts(SOURCE, max_tokens=44, min_tokens=1)}["Box.grow"]
    assert grow.startswith("    def trivial(self):\n        pass\n")
    # a counter that is a tokenizer's stand-in changes the budget, not the rules
    assert function_prompts(SOURCE, max_tokens=5, min_tokens=1, count=len) == []


def test_estimate_tokens():
    assert estimate_tokens("") == 0
    assert estimate_tokens("def f(x):") == 5  # def, ' f', '(', 'x', '):'
    assert estimate_tokens("x = 1\n    y") < estimate_tokens("x = 1\n    y = 12345")
