"""Every `EECORE_*` environment variable eecore reads, in one table, and the only Python code that
reads them (the C++ ones are read by include/eecore/switches.h; docs/configuration.md prints this
table).

The environment is for experiments: timing one kernel or path against another in a benchmark,
forcing a path in a test. What a user tunes, or what changes outputs, is also a typed option of
`eecore.LLM` and a CLI flag (`Switch.option`); an option given there wins over the variable.

Values are read when they are used, not at import: tests and benchmarks switch them within one
process (`Switch.read` says when each is read). A value that is not one of a switch's choices
raises a ValueError naming the variable, wherever it is read.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator, Optional


@dataclass(frozen=True)
class Switch:
    name: str
    choices: tuple[str, ...]  # the accepted values; "<int>" accepts an integer
    default: str              # what unset means ("" where the default is chosen elsewhere, e.g. per device)
    read: str                 # when it is read
    effect: str               # what it does (one line)
    option: Optional[str] = None   # the LLM option (and CLI flag) that sets the same thing
    changes_outputs: bool = False  # whether tokens or log-probabilities can change with it
    cpp: bool = False              # read by the C++ extension (include/eecore/switches.h)


_SWITCHES = (
    # --- what the engine runs: each also an LLM option --------------------------------------------
    Switch("EECORE_GGUF_ACTIVATIONS", ("exact", "q8"), "exact", "model build",
           "GGUF projections on the CPU with 8-bit activations (llama.cpp's arithmetic: faster, not the "
           "dequantized model's values)", option="gguf_activations", changes_outputs=True),
    Switch("EECORE_BATCH_INVARIANT", ("0", "1"), "0", "engine build (Python), every kernel call (C++)",
           "on a GPU, kernels whose result for a row does not depend on the rows beside it (process-wide)",
           option="batch_invariant", changes_outputs=True, cpp=True),
    Switch("EECORE_DECODE_AHEAD", ("0", "1"), "", "every step",
           "a decode step launches the next before its tokens are read back",
           option="decode_ahead"),
    Switch("EECORE_DRAFT_AHEAD", ("0", "1"), "0", "engine build",
           "a draft copy's chain runs on the device and is read back once a round", option="draft_ahead"),
    Switch("EECORE_VERIFY_AHEAD", ("0", "1"), "0", "engine build",
           "with draft ahead, the verify pass is launched behind the chain before it is read back",
           option="verify_ahead"),
    Switch("EECORE_FUSED_ROUNDS", ("0", "1"), "0", "engine build",
           "a draft copy's greedy self-speculation rounds run their passes back to back from tokens on "
           "the device, accept on the device and read back once", option="fused_rounds"),
    Switch("EECORE_FUSED_PROJECTIONS", ("0", "1"), "0", "model build",
           "Llama layers run the fused projection ops (norm, RoPE and cache write, activation, residual "
           "folded into the projections)", option="fused_projections", changes_outputs=True),
    Switch("EECORE_HUGE_PAGES", ("0", "1"), "1", "model build",
           "CPU weights packed into 2 MiB huge pages where Linux offers them", option="huge_pages"),
    Switch("EECORE_AMX", ("0", "1"), "1", "model build",
           "CPU weights tiled for Intel AMX where the CPU, the build and Linux allow it", option="amx"),
    # --- experiments: paths timed against each other --------------------------------------------
    Switch("EECORE_EIGHT_BIT", ("q8_0", "int8"), "", "model build",
           "the 8-bit form of draft weights (unset: the process measures which is faster)"),
    Switch("EECORE_PIECEWISE_GRAPHS", ("0", "1"), "1", "engine build",
           "steps that carry prompt chunks run as piecewise CUDA graphs"),
    Switch("EECORE_LAYERSKIP_GRAPHS", ("0", "1"), "1", "engine build",
           "LayerSkip's draft and verify passes run as CUDA graphs"),
    Switch("EECORE_FEATURE_GRAPHS", ("0", "1"), "0", "engine build",
           "feature drafts on a GPU run as CUDA graphs: the head's steps, and the verify passes and "
           "plain steps that tap the target's states for it (op by op until a GPU has timed them)"),
    Switch("EECORE_TREE_GRAPHS", ("0", "1"), "0", "engine build",
           "token trees' verify passes on a GPU run as CUDA graphs (op by op until a GPU has timed them)"),
    Switch("EECORE_PREPARE_NEXT_STEP", ("0", "1"), "0", "every step",
           "the host fills the next decode step's inputs while the current step's graph runs"),
    Switch("EECORE_PREFETCH_WEIGHTS", ("0", "1"), "0", "model build",
           "on a GPU, a side stream asks L2 for the next projection's weights"),
    Switch("EECORE_PREFETCH_MAX_ROWS", ("<int>",), str(2 ** 31), "model build",
           "with EECORE_PREFETCH_WEIGHTS, prefetch only for steps of at most this many rows"),
    Switch("EECORE_ARGMAX_KERNEL", ("eecore", "aten"), "eecore", "every step",
           "greedy rows on a GPU take eecore's argmax op or ATen's"),
    # --- the C++ kernel selectors (read at every call) -------------------------------------------
    Switch("EECORE_PAGED_ATTENTION_KERNEL", ("auto", "rows", "mma", "decode", "decode_mma"), "auto", "every call",
           "forces a paged-attention kernel wherever it applies", cpp=True),
    Switch("EECORE_DECODE_MIN_SPLIT_TOKENS", ("<int>",), "256", "every call",
           "the shortest context split the decode kernels' planner makes (16-4096)", cpp=True),
    Switch("EECORE_DECODE_MMA_STAGES", ("2", "3", "4"), "3", "every call",
           "decode_mma's pipeline depth", cpp=True),
    Switch("EECORE_DECODE_MMA_LDMATRIX", ("0", "1"), "1", "every call",
           "decode_mma's second version (ldmatrix fragments) or its first", cpp=True),
    Switch("EECORE_DECODE_MMA_V2_FLAGS", ("<int>",), "15", "every call",
           "which of decode_mma v2's changes run, as a bit mask (to time each alone)", cpp=True),
    Switch("EECORE_LINEAR_KERNEL", ("cublas", "gemv", "gemv_mma", "auto"), "cublas", "every call",
           "few-row projections on a GPU: cuBLAS, the SIMT or tensor-core few-row kernel, or by weight size",
           changes_outputs=True, cpp=True),
    Switch("EECORE_SILU_AND_MUL_KERNEL", ("fused", "aten"), "fused", "every call",
           "the activation on a GPU: eecore's fused kernel or ATen's ops", cpp=True),
    Switch("EECORE_ROTARY_AND_CACHE_KERNEL", ("fused", "separate"), "fused", "every call",
           "RoPE and the cache write on a GPU in one launch or two", cpp=True),
    Switch("EECORE_PDL", ("0", "1"), "0", "every launch",
           "programmatic dependent launch on compute capability 9.0+", cpp=True),
    # --- the server --------------------------------------------------------------------------------
    Switch("EECORE_API_KEY", (), "", "server start",
           "the key `eecore serve` requires (the --api-key flag's default; any string)"),
)
SWITCHES: dict[str, Switch] = {s.name: s for s in _SWITCHES}
_BY_OPTION = {s.option: s for s in _SWITCHES if s.option}

# Values that win over the environment while a block runs: an LLM's options, while it builds its
# model and engine (the code that reads a switch then sees the option without being handed it).
_OVERRIDES: ContextVar[dict[str, str]] = ContextVar("eecore_switch_overrides", default={})


@contextmanager
def overridden(values: dict[str, str]) -> Iterator[None]:
    """Within the block, `values` (variable name -> value) replace the environment's."""
    for name, value in values.items():
        _check(SWITCHES[name], value)
    token = _OVERRIDES.set({**_OVERRIDES.get(), **values})
    try:
        yield
    finally:
        _OVERRIDES.reset(token)


def switch_for_option(option: str) -> Switch:
    return _BY_OPTION[option]


def check_all() -> None:
    """Checks every EECORE_* variable this table knows that is set, the C++ ones included (which,
    read inside the kernels' launch code, fall back to their default on a value they do not know):
    a typo in a value fails here, with the variable's name."""
    for name in SWITCHES:
        raw(name)


def _check(switch: Switch, value: str) -> None:
    name = switch.name
    if switch.choices == ("<int>",):
        try:
            int(value)
        except ValueError:
            raise ValueError(f"{name} must be an integer, got {value!r}") from None
    elif switch.choices and value not in switch.choices:
        raise ValueError(f"{name} must be one of {', '.join(switch.choices)}, got {value!r}")


def raw(name: str) -> Optional[str]:
    """The switch's value (an override, else the variable), None where unset or empty; checked
    against its choices."""
    switch = SWITCHES[name]
    value = _OVERRIDES.get().get(name, os.environ.get(name))
    if value is None or value == "":
        return None
    _check(switch, value)
    return value


def torchrun_world() -> Optional[tuple[int, int, int]]:
    """(rank, world size, local rank) from the variables torchrun sets for the processes it starts
    (not eecore's switches: read here because this module alone reads the environment), or None
    when torchrun did not start this process."""
    if "TORCHELASTIC_RUN_ID" not in os.environ and "GROUP_RANK" not in os.environ:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0"))


def value(name: str) -> str:
    """The variable's value, or its default where unset."""
    set_value = raw(name)
    return SWITCHES[name].default if set_value is None else set_value


def flag(name: str, option: Optional[bool] = None) -> bool:
    """A 0/1 switch: `option` where given (an LLM option wins over the environment), else the
    variable, else its default."""
    if option is not None:
        return option
    return value(name) == "1"


def integer(name: str) -> int:
    return int(value(name))


def table_markdown() -> str:
    """The table docs/configuration.md carries (tests/test_envs.py holds the two equal)."""
    rows = ["| variable | values | default | read | LLM option | changes outputs | what it does |",
            "|---|---|---|---|---|---|---|"]
    for s in _SWITCHES:
        values = "an integer" if s.choices == ("<int>",) else ", ".join(f"`{c}`" for c in s.choices) or "any"
        default = f"`{s.default}`" if s.default else "(see text)"
        read = s.read + (" (C++)" if s.cpp and "C++" not in s.read else "")
        option = f"`{s.option}`" if s.option else ""
        rows.append(f"| `{s.name}` | {values} | {default} | {read} | {option} | "
                    f"{'yes' if s.changes_outputs else ''} | {s.effect} |")
    return "\n".join(rows)
