"""Builds eecore._C: the CPU kernels always, the CUDA kernels when this torch is a CUDA build and
nvcc is present. Whether a GPU is visible does not matter (we may be cross-building for one).

Environment knobs:
  EECORE_CPU_ONLY=1        skip the CUDA kernels even when they could be built
  EECORE_CPU_NATIVE=0      build the CPU kernels for a generic x86-64/aarch64 instead of -march=native
  TORCH_CUDA_ARCH_LIST     CUDA archs (8.0 or newer); defaults to the visible GPUs', else "8.0;9.0"
  MAX_JOBS                 parallel compile jobs (ninja)
"""
import glob
import os
import shutil
import subprocess
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


def _cuda_archs() -> list[str]:
    """The archs to compile for: TORCH_CUDA_ARCH_LIST, else the visible GPUs', else 8.0 and 9.0.
    The kernels need sm_80 or newer (cp.async, bf16 tensor-core mma), so older ones are refused
    here with a clear message rather than by ptxas halfway through the build."""
    import torch

    requested = os.environ.get("TORCH_CUDA_ARCH_LIST", "").replace(";", " ").split()
    if not requested:
        if torch.cuda.is_available():
            caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
            requested = [f"{major}.{minor}" for major, minor in sorted(caps)]
        else:
            requested = ["8.0", "9.0"]  # cross-building: A100 and H100/H200
    too_old = []
    for arch in requested:
        number = arch.split("+")[0]
        try:
            if float(number) < 8.0:
                too_old.append(arch)
        except ValueError:
            pass  # a named arch ("Hopper"): torch validates it
    if too_old:
        sys.exit(f"eecore's CUDA kernels need compute capability 8.0 or newer; got {too_old} "
                 f"(TORCH_CUDA_ARCH_LIST or the visible GPUs). Set TORCH_CUDA_ARCH_LIST, or EECORE_CPU_ONLY=1.")
    os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(requested)
    return requested


def _extension():
    with_cuda = _want_cuda()
    sources = [os.path.join("csrc", "bindings.cpp"), os.path.join("csrc", "module.cpp")]
    sources += _rel(glob.glob(os.path.join(ROOT, "csrc", "*", "*_cpu.cpp")))
    sources += _rel(glob.glob(os.path.join(ROOT, "csrc", "common", "*.cpp")))
    # -g0 overrides the -g of Python's CFLAGS: debug info for every torch header roughly doubles
    # the time and size of each translation unit.
    cxx = ["-O3", "-g0", "-std=c++20", "-fopenmp", "-DNDEBUG", "-Wno-unknown-pragmas"]
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
        archs = _cuda_archs()
        sources += _rel(glob.glob(os.path.join(ROOT, "csrc", "*", "*_cuda.cpp")))
        sources += _rel(glob.glob(os.path.join(ROOT, "csrc", "*", "*_kernels.cu")))
        cxx += ["-DEECORE_WITH_CUDA", "-DEECORE_CUDA_ARCHS=" + ",".join(archs)]
        nvcc.append("-DEECORE_WITH_CUDA")
        return cpp_extension.CUDAExtension(sources=sources, extra_compile_args={"cxx": cxx, "nvcc": nvcc}, **kwargs)
    return cpp_extension.CppExtension(sources=sources, extra_compile_args={"cxx": cxx}, **kwargs)


def _links_libstdcxx_statically(library: str) -> bool:
    """True when `library` carries its own copy of libstdc++ (no libstdc++.so in its NEEDED list).
    Such a copy has its own iostream and locale state, and the first error message the extension
    formats (std::ostringstream in TORCH_CHECK) crashes inside it. Some toolchains do this by
    default, e.g. a g++ wrapper that adds -static-libstdc++. Unknown (no readelf, or no dynamic
    section it could read): False."""
    readelf = shutil.which("readelf")
    if readelf is None:
        return False
    result = subprocess.run([readelf, "-d", library], capture_output=True, text=True)
    if result.returncode != 0 or "(NEEDED)" not in result.stdout:
        return False
    return "libstdc++" not in result.stdout


class BuildExtension(cpp_extension.BuildExtension):
    def build_extension(self, ext):
        super().build_extension(ext)
        built = self.get_ext_fullpath(ext.name)
        if sys.platform.startswith("linux") and _links_libstdcxx_statically(built):
            os.remove(built)
            sys.exit(f"{built} was linked with a static libstdc++ (the C++ compiler {self.compiler.compiler_so[0]!r} "
                     "adds it), so it would crash on its first error message next to torch's shared libstdc++. "
                     "Build with the system compiler instead, e.g. "
                     "CXX=/usr/bin/g++ LDSHARED='/usr/bin/g++ -shared' pip install .")


setup(
    ext_modules=[_extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
