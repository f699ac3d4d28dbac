"""tools/sass_mix.py: opcode counts per kernel from a cuobjdump listing."""
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parent.parent / "tools" / "sass_mix.py"

LISTING = """
\tcode for sm_90
\t\tFunction : _ZN6eecore4cuda9attention10decode_mma33paged_attention_decode_mma_kernelI13__nv_bfloat16Li128ELi1ELi3ELb1EEEvNS0_20PagedAttentionParamsEiiPf
\t.headerflags\t@"EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                      /* 0x00000a00ff017b82 */
        /*0010*/                   LDSM.16.M88.4 R4, [R2] ;                    /* 0x000000000204783b */
        /*0020*/              @!P0 LDS.U16 R8, [R3] ;                          /* 0x0000000003088984 */
        /*0030*/                   HMMA.16816.F32.BF16 R12, R4, R8, R12 ;      /* 0x000000080c0c723c */
        /*0040*/               @P1 HMMA.16816.F32.BF16 R16, R4, R10, R16 ;     /* 0x0000000a1010723c */
\t\tFunction : _ZN6eecore4cuda9attention5other_kernelIfEEvNS0_20PagedAttentionParamsE
        /*0000*/                   LDS R1, [R2] ;                              /* 0x00000a00ff017b82 */
"""


def run(*args, stdin=LISTING):
    return subprocess.run([sys.executable, str(TOOL), *args], input=stdin, capture_output=True, text=True)


def test_counts_opcodes_of_the_matching_kernels_only():
    result = run("decode_mma", "--ops", "HMMA", "LDSM", "LDS", "LDC")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 2  # header + the one matching kernel
    assert lines[1] == "13__nv_bfloat16Li128ELi1ELi3ELb1 | 5 | 2 | 1 | 1 | 1"


def test_no_matching_kernel_is_an_error():
    result = run("no_such_kernel")
    assert result.returncode != 0
    assert "no kernel matching 'no_such_kernel'" in result.stderr
