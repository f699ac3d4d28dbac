// The Python module eecore._C. Ops register through TORCH_LIBRARY (csrc/bindings.cpp) when this
// library is loaded; the module itself only reports how the library was built.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/extension.h>

#include <string>

#ifdef EECORE_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

#include "eecore/switches.h"

#define EECORE_STRINGIFY_(...) #__VA_ARGS__
#define EECORE_STRINGIFY(...) EECORE_STRINGIFY_(__VA_ARGS__)

namespace {

// The eecore ops that have a kernel for `key` in this process (read from the dispatcher, so it
// reflects what was compiled and registered, not what was meant to be).
pybind11::list ops_with_kernel(c10::DispatchKey key) {
  pybind11::list names;
  auto& dispatcher = c10::Dispatcher::singleton();
  for (const c10::OperatorName& name : dispatcher.getAllOpNames()) {
    if (name.name.rfind("eecore::", 0) != 0) continue;
    const auto handle = dispatcher.findOp(name);
    if (handle.has_value() && handle->hasKernelForDispatchKey(key)) names.append(name.name.substr(8));
  }
  names.attr("sort")();
  return names;
}

pybind11::dict build_info() {
  pybind11::dict info;
#ifdef EECORE_WITH_CUDA
  info["cuda"] = true;
  info["cuda_runtime_version"] = CUDART_VERSION;  // the toolkit compiled against, e.g. 13000
#ifdef EECORE_CUDA_ARCHS
  info["cuda_archs"] = std::string(EECORE_STRINGIFY(EECORE_CUDA_ARCHS));
#endif
  info["cuda_ops"] = ops_with_kernel(c10::DispatchKey::CUDA);
#else
  info["cuda"] = false;
#endif
  info["cpu_ops"] = ops_with_kernel(c10::DispatchKey::CPU);
#if defined(TORCH_VERSION_MAJOR)
  info["torch_version"] = std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR);
#endif
  info["cpp_standard"] = static_cast<long>(__cplusplus);
  return info;
}

}  // namespace

namespace eecore {
bool amx_bf16_available();  // linear/linear_cpu.cpp
bool amx_int8_available();  // linear/linear_cpu.cpp
bool gguf_q8_vectorized();  // linear/linear_gguf_q8_cpu.cpp
int64_t gguf_stream_max_rows();  // linear/linear_gguf_cpu.cpp
}  // namespace eecore

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def(
      "set_batch_invariant", [](bool on) { eecore::switches::batch_invariant_override().store(on ? 1 : 0); },
      "Batch-invariant GPU kernels for the whole process (LLM(batch_invariant=True)), whatever "
      "EECORE_BATCH_INVARIANT says");
  m.def("batch_invariant", &eecore::switches::batch_invariant,
        "Whether the GPU kernels run batch-invariant (eecore/batch_invariant.h)");
  m.doc() = "eecore compiled ops; see torch.ops.eecore";
  m.def("amx_bf16_available", &eecore::amx_bf16_available,
        "Whether ops.linear runs bf16 weights tiled for AMX-BF16 here (CPU, build and OS all allow it)");
  m.def("amx_int8_available", &eecore::amx_int8_available,
        "Whether ops.linear runs weight-only int8 weights tiled for AMX-INT8 here (CPU, build and OS all allow it)");
  m.def("gguf_q8_vectorized", &eecore::gguf_q8_vectorized,
        "Whether linear_gguf_q8 runs its vector (AVX512-VNNI) kernel on the CPU, rather than scalar code");
  m.def("gguf_stream_max_rows", &eecore::gguf_stream_max_rows,
        "The most input rows linear_gguf streams through its register tiles on the CPU (more take a BLAS GEMM "
        "per decoded slice of the weight): 96 with AVX-512, 10 with AVX2, 48 without either");
  m.def("build_info", &build_info,
        "How this eecore._C was built: CUDA or not, toolkit, archs, and which ops have CPU / CUDA kernels");
}
