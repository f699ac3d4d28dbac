"""The `eecore` command: `generate` streams a completion, `bench` measures throughput, `eval`
compares a strategy with full depth, `calibrate` writes early-exit thresholds, `serve` runs the
OpenAI-compatible server. One module per subcommand; the flags they share are in `args`."""
from __future__ import annotations

import argparse
import difflib
import os
import sys

from eecore.cli import bench, calibrate, evaluate, generate, serve
from eecore.cli.args import apply_exit_ready, build_llm, speculative_config
from eecore.cli.bench import BENCH_PROMPTS
from eecore.speculative.presets import PRESETS

__all__ = ["BENCH_PROMPTS", "build_llm", "main", "make_parser", "parse_args",
           "speculative_config"]


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eecore", description="Early-exit LLM inference")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (generate, evaluate, bench, calibrate, serve):
        command.add_parser(sub)
    return parser


def options_end(argv: list[str]) -> int:
    """Where the options end: at "--", after which every word is a prompt."""
    return argv.index("--") if "--" in argv else len(argv)


def words_after(argv: list[str], flag: str) -> list[tuple[int, str]]:
    """(i, word) for each `flag` at argv[i] among the options whose next word is no flag: the word
    argparse gives to a flag whose value is optional (nargs="?")."""
    end = options_end(argv)
    return [(i, argv[i + 1]) for i in range(end - 1) if argv[i] == flag and not argv[i + 1].startswith("-")]


def bare_exit_ready_last(argv: list[str]) -> list[str]:
    """`--exit-ready` takes an optional preset, so argparse reads the word after it as the preset even
    when that word is the prompt (`eecore generate --exit-ready "def f():"` would fail with "invalid
    choice"). Where the next word is not a preset, the flag moves to the end of the options, where
    it stands alone and means the default preset; the prompt stays where it was. A word close to a
    preset's name ("hybird") stays the flag's value, so that argparse refuses it rather than
    generating for it as a prompt."""
    end = options_end(argv)
    for i, word in words_after(argv, "--exit-ready"):
        if word not in PRESETS and not difflib.get_close_matches(word, PRESETS, n=1, cutoff=0.6):
            return argv[:i] + argv[i + 1:end] + ["--exit-ready"] + argv[end:]
    return argv


def refuse_prompt_as_adapter_file(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """`--exit-adapter [FILE]` has the same trap as --exit-ready, but a path has no closed set of
    values to tell a prompt from. A word after it that names no file and does not end in .safetensors
    is refused (as a file it would fail later anyway) with what to write instead, rather than read as
    something else; a missing .safetensors path keeps its "does not exist" from the loader."""
    for _, word in words_after(argv, "--exit-adapter"):
        if not word.endswith(".safetensors") and not os.path.exists(word):
            parser.error(f"--exit-adapter: {word!r} is no file. The FILE is optional: for the shipped adapters, "
                         f"put the prompt before --exit-adapter or give another flag after it")


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, parsed (`bare_exit_ready_last` first), with --exit-ready applied."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = make_parser()
    refuse_prompt_as_adapter_file(parser, argv)
    args = parser.parse_args(bare_exit_ready_last(argv))
    apply_exit_ready(args)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    return args.func(args)

