// The Python module eecore._C. Ops register through TORCH_LIBRARY (csrc/bindings.cpp) when this
// library is loaded; the module itself only reports how the library was built.
#include <torch/extension.h>

namespace {

pybind11::dict build_info() {
  pybind11::dict info;
#ifdef EECORE_WITH_CUDA
  info["cuda"] = true;
#ifdef CUDA_VERSION
  info["cuda_version"] = CUDA_VERSION;
#endif
#else
  info["cuda"] = false;
#endif
#if defined(TORCH_VERSION_MAJOR)
  info["torch_version"] = std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR);
#endif
  info["cpp_standard"] = static_cast<long>(__cplusplus);
  return info;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "eecore compiled ops; see torch.ops.eecore";
  m.def("build_info", &build_info, "How this eecore._C was built: CUDA or not, versions");
}
