// The single place where ridgefill op schemas are declared.
//
// Importing the compiled module `ridgefill_runtime._C` runs these static
// registrations; device kernels are attached elsewhere with
// TORCH_LIBRARY_IMPL (rms_norm.cu for CUDA) and the CPU kernel / fake (meta)
// implementation from Python (ridgefill_runtime/ops/rms_norm.py).
#include <Python.h>
#include <torch/library.h>

TORCH_LIBRARY(ridgefill, m) {
  // y = (x * rsqrt(mean(x^2, -1) + eps)).to(x.dtype) * weight, over the last
  // dim; fp32 accumulation; weight is 1-D of size x.size(-1), same dtype as x.
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
}

// A bare Python module: the ops live in torch.ops.ridgefill, so the module
// only has to exist for `import ridgefill_runtime._C` to load this library.
// Avoiding pybind11 (torch/extension.h) keeps the build noticeably faster.
extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT,
      "_C",
      "Compiled ridgefill kernels; ops are exposed as torch.ops.ridgefill.*",
      -1,
      nullptr,
  };
  return PyModule_Create(&module_def);
}
