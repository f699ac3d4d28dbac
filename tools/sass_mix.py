"""The instruction mix of CUDA kernels, from `cuobjdump -sass` on stdin.

    cuobjdump -sass python/eecore/_C*.so | python tools/sass_mix.py decode_mma [--ops HMMA LDSM ...]

Prints one line per kernel whose mangled name contains the pattern: its instruction count and the
count of each opcode asked for (the opcode without its modifiers: LDS.U16 counts as LDS). Without a
GPU it tells what a change did to a kernel's instruction stream: how many shared-memory
loads feed each tensor-core instruction, whether ldmatrix replaced scalar loads, whether anything
went to local memory (LDL/STL).
"""
from __future__ import annotations

import argparse
import re
import sys
from collections import Counter

DEFAULT_OPS = ["HMMA", "LDSM", "LDS", "STS", "LDG", "LDGSTS", "LDL", "STL", "SHFL", "VOTE", "MUFU", "FMUL",
               "FFMA", "BAR", "WARPSYNC"]
FUNCTION = re.compile(r"^\s*Function : (\S+)", re.M)
INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")


def kernels(sass: str):
    """(mangled name, Counter of opcodes) for every function in a cuobjdump listing."""
    starts = [(m.start(), m.group(1)) for m in FUNCTION.finditer(sass)]
    for (start, name), (end, _) in zip(starts, starts[1:] + [(len(sass), "")]):
        yield name, Counter(INSTRUCTION.findall(sass[start:end]))


def short_name(mangled: str) -> str:
    """The template arguments of a mangled kernel name, which tell its instantiations apart."""
    match = re.search(r"kernelI(.*)EEvN", mangled)
    return match.group(1).rstrip("E") if match else mangled


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pattern", help="a substring of the kernels' mangled names")
    ap.add_argument("--ops", nargs="+", default=DEFAULT_OPS)
    args = ap.parse_args()
    found = [(name, mix) for name, mix in kernels(sys.stdin.read()) if args.pattern in name]
    if not found:
        raise SystemExit(f"no kernel matching {args.pattern!r} in the listing")
    print("kernel (template arguments) | instructions | " + " | ".join(args.ops))
    for name, mix in sorted(found, key=lambda item: short_name(item[0])):
        print(f"{short_name(name)} | {sum(mix.values())} | " + " | ".join(str(mix[op]) for op in args.ops))


if __name__ == "__main__":
    main()
