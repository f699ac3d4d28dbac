"""Prompt files for `eecore eval`: prompts, each with an optional reference output.

Two formats, told apart the way `eecore calibrate` tells them apart:
- JSONL (a `.jsonl` file, or any file whose first non-blank line starts with "{"): one JSON object
  per line, {"prompt": "...", "reference": "..."}; "reference" is optional. Blank lines are skipped.
- text: one prompt per line, no references. Blank lines are skipped, and a line is taken as it is
  (leading spaces and all); a prompt that spans lines, or one with a reference, needs JSONL.

Every error is a PromptFileError (a ValueError) that names the file, and the line where there is one.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

__all__ = ["EvalPrompt", "PromptFileError", "read_prompt_file", "load_prompt_set", "chat_mode", "BUILTIN_SETS",
           "CHAT_SETS"]


class PromptFileError(ValueError):
    """A prompt file that is missing, unreadable, malformed or empty."""


@dataclass(frozen=True)
class EvalPrompt:
    prompt: str
    reference: Optional[str] = None   # the output the prompt should get, when the set has one


def read_prompt_file(path: str) -> list[EvalPrompt]:
    if not os.path.isfile(path):
        raise PromptFileError(f"prompt file {path!r} does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise PromptFileError(f"prompt file {path!r} cannot be read: {exc}") from None
    numbered = [(i + 1, line) for i, line in enumerate(lines) if line.strip()]
    if not numbered:
        raise PromptFileError(f"prompt file {path!r} holds no prompts")
    if path.endswith(".jsonl") or numbered[0][1].lstrip().startswith("{"):
        return [_jsonl_prompt(path, number, line) for number, line in numbered]
    return [EvalPrompt(line) for _, line in numbered]


def _jsonl_prompt(path: str, number: int, line: str) -> EvalPrompt:
    where = f"prompt file {path!r} line {number}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise PromptFileError(f"{where} is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise PromptFileError(f"{where} must be a JSON object with a string \"prompt\", got {type(obj).__name__}")
    prompt, reference = obj.get("prompt"), obj.get("reference")
    if not isinstance(prompt, str) or not prompt:
        raise PromptFileError(f"{where} must have a non-empty string \"prompt\"")
    if reference is not None and not isinstance(reference, str):
        raise PromptFileError(f"{where}: \"reference\" must be a string, got {type(reference).__name__}")
    return EvalPrompt(prompt, reference)


BUILTIN_SETS = ("code", "prose", "instructions", "everyday")
CHAT_SETS = ("instructions", "everyday")  # built-in sets of chat messages (the others are text to continue)
DEFAULT_BUILTIN_COUNT = 16


def load_prompt_set(spec: str, num_prompts: Optional[int] = None) -> tuple[list[EvalPrompt], bool]:
    """(prompts, whether the set is built in). `spec`: "code" (eecore.evaluation.prompts.heldout_code_prompts,
    no references), "prose" (eecore.evaluation.prompts.prose_prompt_records: each paragraph's continuation is
    the reference), "instructions" (chat messages made from the held-out packages,
    eecore.sources.chat_prompts; no references), "everyday" (everyday chat requests on held-out
    topics, eecore.sources.general_chat_prompts.heldout_requests; no references), or a prompt file
    (module doc). `num_prompts`: how many (built-in sets: DEFAULT_BUILTIN_COUNT when None; files:
    the first N, all when None). A file named like a built-in set must be given with a path, e.g.
    ./code."""
    if num_prompts is not None and (not isinstance(num_prompts, int) or num_prompts < 1):
        raise PromptFileError(f"the number of prompts must be a positive int, got {num_prompts!r}")
    if spec in BUILTIN_SETS:
        from eecore.evaluation import prompts

        n = DEFAULT_BUILTIN_COUNT if num_prompts is None else num_prompts
        if spec == "code":
            items = [EvalPrompt(text) for text in prompts.heldout_code_prompts(n)]
        elif spec == "instructions":
            from eecore.sources.chat_prompts import chat_instruction_records
            from eecore.sources.corpus import DEFAULT_HELDOUT_PACKAGES, build_corpus

            files = build_corpus((), DEFAULT_HELDOUT_PACKAGES).heldout
            items = [EvalPrompt(r.text) for r in chat_instruction_records(n, files)]
        elif spec == "everyday":
            from eecore.sources.general_chat_prompts import heldout_requests

            items = [EvalPrompt(r.text) for r in heldout_requests(n)]
        else:
            items = [EvalPrompt(r.text, r.reference) for r in prompts.prose_prompt_records(n)]
        if not items:
            raise PromptFileError(f"the built-in prompt set {spec!r} is empty: its source packages are not installed")
        return items, True
    items = read_prompt_file(spec)
    return (items if num_prompts is None else items[:num_prompts]), False


def chat_mode(spec: str, builtin: bool, chat: str) -> str:
    """What --chat (on|off|auto) means for the set `spec`: auto leaves the built-in completion sets
    as they are and wraps the built-in chat messages (CHAT_SETS) and prompt files in the model's chat
    template when it has one (the caller's "auto")."""
    if builtin and chat == "auto":
        return "on" if spec in CHAT_SETS else "off"
    return chat
