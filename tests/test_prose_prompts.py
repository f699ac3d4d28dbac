"""The built-in English prose prompts (eecore.evaluation.prompts.prose_prompt_records): plain paragraphs from
installed packages' descriptions, cut into a prompt and its reference continuation; deterministic."""
from __future__ import annotations

import pytest

from eecore.evaluation.prompt_sets import load_prompt_set
from eecore.evaluation.prompts import (ProsePrompt, prose_paragraphs, prose_prompt_records, prose_prompts,
                            runtime_dependencies)

DESCRIPTION = """# A project

[![badge](https://img.shields.io/x.svg)](https://example.org)

This library does one thing well. It reads a file, checks every record against a schema and writes
the records that pass to a new file, keeping their order. Errors are reported with the line number
of the record that caused them, so that a user can fix the input quickly.

- a list item that is long enough to count as prose if lists were allowed, which they are not here at all.

    indented_code = "is not prose either, however many words it has in it, and it has many"

Install it with `pip install thing` and read the **documentation**, which explains every option in
detail. The [guide](https://example.org/guide) walks through a complete example from start to end,
and the reference lists each function with its arguments and what it returns.

Visit https://example.org for more. This paragraph has a link in plain text and is dropped because
links are not the kind of prose a language model should continue in an evaluation of its outputs.

THE SOFTWARE IS PROVIDED AS IS, WITHOUT WARRANTY OF ANY KIND, EXPRESS OR IMPLIED. IN NO EVENT SHALL
THE AUTHORS BE LIABLE FOR ANY CLAIM, DAMAGES OR OTHER LIABILITY, WHETHER IN AN ACTION OF CONTRACT.

Too short. Two sentences.
"""


def test_prose_paragraphs_keep_plain_prose_only():
    paragraphs = prose_paragraphs(DESCRIPTION)
    assert len(paragraphs) == 2
    assert paragraphs[0].startswith("This library does one thing well. It reads a file,")
    assert "\n" not in paragraphs[0]
    # inline markup unwrapped: code spans, bold, links keep their text
    assert paragraphs[1].startswith("Install it with pip install thing and read the documentation, which")
    assert "The guide walks through" in paragraphs[1]


def test_records_are_deterministic_and_split_into_prompt_and_reference():
    records = prose_prompt_records(8)
    assert records == prose_prompt_records(8)
    assert 0 < len(records) <= 8
    for r in records:
        assert isinstance(r, ProsePrompt) and r.text and r.reference
        assert r.text.rstrip().endswith((".", "!", "?")) and r.reference[0].isupper()
        assert len(r.text.split()) >= 12  # min_prompt_words
    assert len({r.text for r in records}) == len(records)
    assert prose_prompts(8) == [r.text for r in records]


def test_records_spread_over_packages():
    records = prose_prompt_records(6)
    packages = [r.package for r in records]
    assert len(set(packages)) == len(packages)  # more packages with prose than prompts: one each
    assert set(packages) <= set(runtime_dependencies())


def test_packages_argument_and_limits():
    only = prose_prompt_records(50, packages=["torch"])
    assert only and {r.package for r in only} == {"torch"}
    assert prose_prompt_records(0) == []
    assert prose_prompt_records(3, packages=["no-such-package-here"]) == []
    with pytest.raises(ValueError, match="n must be"):
        prose_prompt_records(-1)
    with pytest.raises(ValueError, match="min_prompt_words"):
        prose_prompt_records(2, min_words=10, min_prompt_words=10)


def test_runtime_dependencies_are_eecores():
    deps = runtime_dependencies()
    assert {"torch", "numpy", "jinja2", "tqdm"} <= set(deps)
    assert "eecore" not in deps and deps == sorted(deps)
    assert "pytest" not in deps  # an extra's requirement, not a runtime one


def test_prose_prompt_set_for_eval_has_references():
    items, builtin = load_prompt_set("prose", 4)
    assert builtin and len(items) == 4
    assert [(i.prompt, i.reference) for i in items] == [(r.text, r.reference) for r in prose_prompt_records(4)]
