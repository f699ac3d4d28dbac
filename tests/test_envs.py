"""The settings surface: every EECORE_* switch is read through eecore.envs (Python) or
include/eecore/switches.h (C++), documented in docs/configuration.md, and checked; LLM's options
win over the environment."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

import eecore
from eecore import envs

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "python" / "eecore"


def test_the_documented_table_is_the_code_s():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    assert envs.table_markdown() in doc, "docs/configuration.md's table differs from eecore.envs (regenerate it)"


def test_only_the_settings_module_reads_the_environment():
    readers = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "envs.py":
            continue
        text = path.read_text()
        if re.search(r"os\.environ|os\.getenv|getenv\(", text):
            readers.append(str(path.relative_to(ROOT)))
    assert readers == [], f"read the environment through eecore.envs instead: {readers}"


def test_only_the_switches_header_calls_getenv():
    callers = [str(p.relative_to(ROOT)) for folder in ("csrc", "include") for p in (ROOT / folder).rglob("*")
               if p.suffix in (".h", ".cuh", ".cpp", ".cu") and p.name != "switches.h"
               and "getenv" in p.read_text()]
    assert callers == [], f"read switches through include/eecore/switches.h: {callers}"


def test_the_cpp_switches_are_in_the_table():
    header = (ROOT / "include" / "eecore" / "switches.h").read_text()
    in_header = set(re.findall(r'"(EECORE_[A-Z0-9_]+)"', header))
    in_table = {name for name, s in envs.SWITCHES.items() if s.cpp}
    assert in_header == in_table


def test_every_python_switch_is_read_somewhere():
    code = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py") if p.name != "envs.py")
    unread = [name for name, s in envs.SWITCHES.items() if not s.cpp and f'"{name}"' not in code]
    assert unread == []


@pytest.mark.parametrize("name, value, message", [
    ("EECORE_DRAFT_AHEAD", "yes", "EECORE_DRAFT_AHEAD must be one of 0, 1, got 'yes'"),
    ("EECORE_PAGED_ATTENTION_KERNEL", "flash", "EECORE_PAGED_ATTENTION_KERNEL must be one of auto, rows"),
    ("EECORE_PREFETCH_MAX_ROWS", "many", "EECORE_PREFETCH_MAX_ROWS must be an integer, got 'many'"),
])
def test_a_bad_value_names_the_variable(monkeypatch, name, value, message):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=re.escape(message)):
        envs.check_all()
    with pytest.raises(ValueError, match=re.escape(message)):
        eecore.LLM(max_num_seqs=1, num_blocks=8)


def test_an_option_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv("EECORE_HUGE_PAGES", "1")
    assert envs.flag("EECORE_HUGE_PAGES")
    with envs.overridden({"EECORE_HUGE_PAGES": "0"}):
        assert not envs.flag("EECORE_HUGE_PAGES")
    assert envs.flag("EECORE_HUGE_PAGES")
    assert envs.flag("EECORE_HUGE_PAGES", option=False) is False


def test_llm_options_reach_the_model_and_the_engine(monkeypatch):
    monkeypatch.setenv("EECORE_GGUF_ACTIVATIONS", "exact")
    monkeypatch.setenv("EECORE_DECODE_AHEAD", "1")
    llm = eecore.LLM(max_num_seqs=1, num_blocks=8, gguf_activations="q8", decode_ahead=False)
    assert llm.weight_format.endswith("8-bit activations")
    assert llm.engine.runner.decode_ahead is False
    assert eecore.LLM(max_num_seqs=1, num_blocks=8).weight_format == "Q4_1"  # the option did not leak


@pytest.mark.parametrize("option, value, message", [
    ("gguf_activations", "int4", "LLM: 'gguf_activations' must be 'exact' or 'q8', got 'int4'"),
    ("amx", "yes", "LLM: 'amx' must be a bool or None, got 'yes'"),
])
def test_a_bad_option_is_refused(option, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        eecore.LLM(max_num_seqs=1, num_blocks=8, **{option: value})


def test_the_cli_flags_are_the_options():
    from eecore.cli import parse_args
    from eecore.cli.args import runtime_options

    args = parse_args(["generate", "Hi", "--no-decode-ahead", "--gguf-activations", "q8"])
    assert runtime_options(args) == {"decode_ahead": False, "gguf_activations": "q8"}
