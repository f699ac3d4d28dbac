"""The CUDA code compiles, on any machine with nvcc, GPU or not. CI runs these on every submission.

1. test_kernels_compile: CMake's kernel-only build compiles every csrc/*/*_kernels.cu for sm_80
   and sm_90 with warnings (and register spills) as errors. No torch involved: seconds per file.
2. test_extension_builds_and_imports: the whole extension (CPU and CUDA kernels, glue, bindings)
   builds against a CUDA build of torch and imports, and every op has a CUDA kernel registered.
   It uses this interpreter's torch when that is a CUDA build; otherwise a virtual environment with
   torch==2.14.1 (a CUDA 13.0 build, like nvcc here), created once.

Both skip only where nvcc or cmake is missing. Their work lives outside the repository, in
$EECORE_CUDA_BUILD_CACHE (default ~/.cache/eecore-cuda-build): the build directories persist, so
a rerun recompiles only what changed, and the sources are copied so the repo's build/ is untouched.
"""
from __future__ import annotations

import filecmp
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CUDA_HOME = Path(os.environ.get("CUDA_HOME") or "/usr/local/cuda")
NVCC = CUDA_HOME / "bin" / "nvcc"
CMAKE = shutil.which("cmake")
CACHE = Path(os.environ.get("EECORE_CUDA_BUILD_CACHE") or Path.home() / ".cache" / "eecore-cuda-build")
CUDA_TORCH = "torch==2.14.1"  # the CUDA 13.0 wheel on these machines' disk
ARCHS = "80;90"
TIMEOUT_S = 3600

pytestmark = pytest.mark.skipif(not NVCC.exists() or CMAKE is None,
                                reason=f"needs nvcc ({NVCC}) and cmake to check that the CUDA code compiles")


def _workdir(kind: str) -> Path:
    """A per-checkout directory under the cache (two clones never share a build)."""
    tag = hashlib.sha1(str(ROOT).encode()).hexdigest()[:10]
    path = CACHE / f"{kind}-{tag}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _run(cmd: list[str], cwd: Path, env: dict | None = None, timeout: int = TIMEOUT_S) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"`{' '.join(cmd)}` failed with exit code {proc.returncode}:\n{proc.stdout[-20000:]}",
                    pytrace=False)
    return proc.stdout


def _kernel_build() -> Path:
    """CMake's kernel-only build, up to date; its directory."""
    build = _workdir("kernels")
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    _run([CMAKE, "-S", str(ROOT), "-B", str(build), *generator, f"-DCMAKE_CUDA_COMPILER={NVCC}",
          f"-DCMAKE_CUDA_ARCHITECTURES={ARCHS}"], cwd=ROOT)
    _run([CMAKE, "--build", str(build), "-j", str(_jobs())], cwd=ROOT)
    return build


def test_kernels_compile():
    build = _kernel_build()
    kernels = sorted(ROOT.glob("csrc/*/*_kernels.cu"))
    assert kernels, "no csrc/*/*_kernels.cu to compile"
    objects = list(build.rglob("*_kernels.cu.o"))
    assert len(objects) == len(kernels), f"compiled {len(objects)} objects for {len(kernels)} kernel files"


def _cuobjdump() -> Path | None:
    """cuobjdump from the CUDA toolkit, or the copy triton ships in the CUDA torch's venv."""
    candidates = [CUDA_HOME / "bin" / "cuobjdump",
                  *CACHE.glob("venv-*/lib/python*/site-packages/triton/backends/nvidia/bin/cuobjdump")]
    return next((c for c in candidates if c.exists()), None)


# (object, kernel, instances): every kernel built on eecore/cuda/gemv_mma.cuh's tile loop
FEW_ROW_MMA_KERNELS = [("linear_kernels.cu.o", "linear_gemv_mma_kernel", 2),
                       ("fused_projections_kernels.cu.o", "qkv_projection_kernel", 4),
                       ("fused_projections_kernels.cu.o", "gate_up_projection_kernel", 2),
                       ("fused_projections_kernels.cu.o", "linear_residual_kernel", 2)]


@pytest.mark.parametrize("object_name, kernel, instances", FEW_ROW_MMA_KERNELS)
def test_the_tensor_core_few_row_kernels_issue_their_loads_before_their_mmas(object_name, kernel, instances):
    """The few-row tensor-core kernels' speed rests on a round of loads in flight before the first
    mma: ptxas, left to its register budget, sank each chunk's loads down to its mma (3 in flight a
    lane, a DRAM round trip a chunk; an H200 read Llama-1B's QKV at a third of its bandwidth so).
    In the sm_90 SASS at least 16 of a round's 24 16-byte loads precede the first HMMA (after the
    last barrier: the fused kernels' norm reads its rows before one)."""
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump (CUDA toolkit or the CUDA torch venv's triton)")
    objects = list(_kernel_build().rglob(object_name))
    assert len(objects) == 1, objects
    listing = _run([str(tool), "-sass", "-arch", "sm_90", str(objects[0])], cwd=ROOT)
    kernels = [part for part in listing.split("Function : ")[1:] if kernel in part.split("\n")[0]]
    assert len(kernels) == instances, f"expected {instances} instances of {kernel}"
    for sass in kernels:
        opcodes = re.findall(r"^\s+/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9]*)", sass, re.MULTILINE)
        assert "HMMA" in opcodes, sass.split("\n")[0]
        before = opcodes[:opcodes.index("HMMA")]
        round_start = max((i + 1 for i, op in enumerate(before) if op == "BAR"), default=0)
        # the weights' and input rows' global loads, or the normed rows' shared-memory ones
        loads = sum(before[round_start:].count(op) for op in ("LDG", "LDS"))
        assert loads >= 16, f"{sass.split(chr(10))[0]}: {loads} loads before the first mma"


def test_the_default_decode_kernel_is_compiled_for_its_flags():
    """decode_mma v2 with the default flags runs an instantiation with the flags fixed at compile
    time: with them read at run time every flag's path stays in the code (12,448 SASS instructions
    for bf16 at D = 128 against 7,280), and at batch 1 an H200 found the kernel waiting 40% of its
    cycles for instruction fetches."""
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump (CUDA toolkit or the CUDA torch venv's triton)")
    objects = list(_kernel_build().rglob("paged_attention_kernels.cu.o"))
    assert len(objects) == 1, objects
    listing = _run([str(tool), "-sass", "-arch", "sm_90", str(objects[0])], cwd=ROOT)
    sizes = {}
    for part in listing.split("Function : ")[1:]:
        name = part.split("\n")[0]
        flags = re.search(r"decode_mma_kernelI13__nv_bfloat16Li128ELi1ELi3ELb1ELi(n?\d+)E", name)
        if flags:
            sizes[flags.group(1)] = len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/", part, re.MULTILINE))
    assert set(sizes) == {"n1", "15"}, f"expected the runtime-flags and the default-flags kernels, got {sizes}"
    assert sizes["15"] < 0.75 * sizes["n1"], sizes


def _jobs() -> int:
    return int(os.environ.get("MAX_JOBS") or max(1, min(os.cpu_count() or 1, 4)))


# ---- the full extension against a CUDA torch ------------------------------------------------

def _python_with_cuda_torch() -> Path:
    """This interpreter if its torch is a CUDA build, else a cached venv with the CUDA wheel."""
    try:
        import torch

        if torch.version.cuda is not None:
            return Path(sys.executable)
    except ImportError:
        pass
    venv = CACHE / f"venv-{CUDA_TORCH.replace('==', '-')}"
    python = venv / "bin" / "python"
    probe = [str(python), "-c", "import torch, ninja; assert torch.version.cuda"]
    if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    shutil.rmtree(venv, ignore_errors=True)
    _run([sys.executable, "-m", "venv", str(venv)], cwd=CACHE)
    _run([str(python), "-m", "pip", "install", "--quiet", CUDA_TORCH, "numpy", "ninja", "setuptools", "wheel"],
         cwd=CACHE)
    return python


def _sync_tree(src: Path, dst: Path) -> None:
    """Mirror src into dst, copying only files whose bytes changed (mtimes of the others survive,
    so ninja rebuilds only what changed) and deleting files that are gone from src."""
    dst.mkdir(parents=True, exist_ok=True)
    wanted = set()
    for path in src.rglob("*"):
        if "__pycache__" in path.parts or path.suffix in (".so", ".o", ".pyc"):
            continue
        rel = path.relative_to(src)
        wanted.add(rel)
        target = dst / rel
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        elif not target.exists() or not filecmp.cmp(path, target, shallow=False):
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
    for path in sorted(dst.rglob("*"), reverse=True):
        rel = path.relative_to(dst)
        if rel not in wanted and not (path.suffix in (".so", ".o") or "__pycache__" in path.parts):
            path.rmdir() if path.is_dir() else path.unlink()


def _op_names() -> list[str]:
    return re.findall(r'm\.def\(\s*"(\w+)\(', (ROOT / "csrc" / "bindings.cpp").read_text())


_IMPORT_CHECK = r"""
import glob, importlib.machinery, importlib.util, json, sys
import torch
path = glob.glob("python/eecore/_C*.so")[0]
# Load the library alone: the eecore package may import runtime dependencies this env lacks.
loader = importlib.machinery.ExtensionFileLoader("eecore._C", path)
module = importlib.util.module_from_spec(importlib.util.spec_from_loader("eecore._C", loader))
loader.exec_module(module)
ops = json.loads(sys.argv[1])
print(json.dumps({
    "build_info": {k: v for k, v in module.build_info().items()},
    "no_cuda_kernel": [op for op in ops if not torch._C._dispatch_has_kernel_for_dispatch_key(f"eecore::{op}", "CUDA")],
    "no_cpu_kernel": [op for op in ops if not torch._C._dispatch_has_kernel_for_dispatch_key(f"eecore::{op}", "CPU")],
    "has_paged_attention": hasattr(torch.ops.eecore, "paged_attention"),
}))
"""


def test_extension_builds_and_imports():
    python = _python_with_cuda_torch()
    work = _workdir("extension")
    for name in ("csrc", "include", "python"):
        _sync_tree(ROOT / name, work / name)
    for name in ("setup.py", "pyproject.toml", "README.md"):
        if (ROOT / name).exists() and (not (work / name).exists()
                                       or not filecmp.cmp(ROOT / name, work / name, shallow=False)):
            shutil.copy2(ROOT / name, work / name)
    for stale in (work / "python" / "eecore").glob("_C*.so"):
        stale.unlink()

    env = dict(os.environ)
    env.pop("EECORE_CPU_ONLY", None)
    env.update(CUDA_HOME=str(CUDA_HOME), TORCH_CUDA_ARCH_LIST="8.0;9.0", MAX_JOBS=str(_jobs()),
               PATH=f"{python.parent}{os.pathsep}{env.get('PATH', '')}")
    _run([str(python), "setup.py", "build_ext", "--inplace"], cwd=work, env=env)

    out = _run([str(python), "-c", _IMPORT_CHECK, json.dumps(_op_names())], cwd=work, env=env, timeout=600)
    report = json.loads(out.strip().splitlines()[-1])
    assert report["build_info"]["cuda"] is True, report
    assert report["has_paged_attention"], report
    assert report["no_cuda_kernel"] == [], f"ops without a CUDA kernel: {report['no_cuda_kernel']}"
    assert report["no_cpu_kernel"] == [], f"ops without a CPU kernel: {report['no_cpu_kernel']}"
