"""eecore.sources.chat_prompts: chat instructions made from installed packages' code and descriptions."""
from __future__ import annotations

import pytest

from eecore.sources.chat_prompts import (ChatInstruction, chat_instruction_records, description_instructions,
                                       function_instructions)
from eecore.sources.corpus import CorpusFile

SOURCE = '''
def first_public(path, mode="r"):
    """Open the file at path and return its lines without their line endings."""
    with open(path, mode) as f:
        return f.read().splitlines()


def _private_helper(x):
    """Return twice the value given, for internal callers only."""
    return 2 * x


def undocumented(x):
    return x + 1


def code_in_docstring(x):
    """Return `x` squared, as in x ** 2 of the examples."""
    return x * x


class Registry:
    def register(self, name, value):
        """Store value under name so that later lookups by that name find it.

        More detail that is not part of the first sentence."""
        self.items[name] = value
'''


def test_documented_public_functions_alternate_write_and_explain():
    out = function_instructions(CorpusFile("pkg", "m.py", SOURCE, "0"))
    assert [i.kind for i in out] == ["write", "explain"]
    assert out[0] == ChatInstruction("pkg", "write", "Write a Python function `first_public`. Its docstring says: "
                                     "\"Open the file at path and return its lines without their line endings.\"")
    assert out[1].text.startswith("Explain what this Python function does:\n\n```python\n    def register(self, name")
    assert out[1].text.endswith("self.items[name] = value\n```")
    assert function_instructions(CorpusFile("pkg", "bad.py", "def broken(:\n", "1")) == []


def test_a_package_without_a_description_is_asked_about_by_name():
    assert description_instructions("no-such-package-xyz") == [
        ChatInstruction("no-such-package-xyz", "about", "What is the Python package no-such-package-xyz used for?")]


def test_records_are_balanced_deterministic_and_counted_once():
    files = [CorpusFile("pkg_b", "m.py", SOURCE, "0"), CorpusFile("pkg_a", "m.py", SOURCE, "1"),
             CorpusFile("pkg_a", "copy.py", SOURCE, "2")]
    everything = chat_instruction_records(100, files)
    # the same function texts count once, for the first file that has them (pkg_b's, listed
    # first); pkg_a's files ask nothing new, so only its "about" question is its own
    assert sorted((i.package, i.kind) for i in everything) == [
        ("pkg_a", "about"), ("pkg_b", "about"), ("pkg_b", "explain"), ("pkg_b", "write")]
    assert chat_instruction_records(100, files) == everything
    two = chat_instruction_records(2, files)
    assert len(two) == 2 and {i.package for i in two} == {"pkg_a", "pkg_b"}
    assert chat_instruction_records(0, files) == []
    with pytest.raises(ValueError, match="n must be an int >= 0"):
        chat_instruction_records(-1, files)
