"""Builds eecore._C: the CPU kernels always, the CUDA kernels when this torch is a CUDA build and
nvcc is present. Whether a GPU is visible does not matter (we may be cross-building for one).

Environment knobs:
  EECORE_CPU_ONLY=1        skip the CUDA kernels even when they could be built
  EECORE_CPU_NATIVE=0      build the CPU kernels for a generic x86-64/aarch64 instead of -march=native
  TORCH_CUDA_ARCH_LIST     CUDA archs; defaults to "8.0;9.0" when no GPU is visible to pick from
  MAX_JOBS                 parallel compile jobs (ninja)
"""
import glob
import os
import sys

from setuptools import setup
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))


def _rel(paths):
    return sorted(os.path.relpath(p, ROOT) for p in paths)


def _want_cuda() -> bool:
    import torch

    if os.environ.get("EECORE_CPU_ONLY", "0") == "1":
        return False
    if torch.version.cuda is None or cpp_extension.CUDA_HOME is None:
        return False
    return os.path.exists(os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc"))


def _extension():
    with_cuda = _want_cuda()
    sources = [os.path.join("csrc", "bindings.cpp"), os.path.join("csrc", "module.cpp")]
    sources += _rel(glob.glob(os.path.join(ROOT, "csrc", "*", "*_cpu.cpp")))
    sources += _rel(glob.glob(os.path.join(ROOT, "csrc", "common", "*.cpp")))
    cxx = ["-O3", "-std=c++20", "-fopenmp", "-DNDEBUG", "-Wno-unknown-pragmas"]
    if os.environ.get("EECORE_CPU_NATIVE", "1") == "1":
        cxx.append("-march=native")
    nvcc = [
        "-O3", "-std=c++20", "-DNDEBUG", "--expt-relaxed-constexpr", "-lineinfo",
    ]
    kwargs = dict(
        name="eecore._C",
        include_dirs=[os.path.join(ROOT, "include"), os.path.join(ROOT, "csrc")],
        extra_link_args=["-fopenmp"],
    )
    if with_cuda:
        if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
            import torch

            if not torch.cuda.is_available():
                os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0"
        sources += _rel(glob.glob(os.path.join(ROOT, "csrc", "*", "*_cuda.cpp")))
        sources += _rel(glob.glob(os.path.join(ROOT, "csrc", "*", "*_kernels.cu")))
        cxx.append("-DEECORE_WITH_CUDA")
        nvcc.append("-DEECORE_WITH_CUDA")
        return cpp_extension.CUDAExtension(sources=sources, extra_compile_args={"cxx": cxx, "nvcc": nvcc}, **kwargs)
    return cpp_extension.CppExtension(sources=sources, extra_compile_args={"cxx": cxx}, **kwargs)


setup(
    ext_modules=[_extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
)
