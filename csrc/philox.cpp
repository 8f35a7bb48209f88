// Raw Philox words: the reference behind selective_ckpt.rng's masks (the dropout contract).
#include <cstdint>

#include "philox.h"
#include "registry.h"

namespace py = pybind11;

namespace sckpt {
namespace {

// counters: int64 [n, 4] with values in [0, 2^32); out: int64 [n, 4].
void philox_words(uint64_t seed, uintptr_t counters, uintptr_t out, int64_t n) {
  const int64_t* in = reinterpret_cast<const int64_t*>(counters);
  int64_t* res = reinterpret_cast<int64_t*>(out);
  const PhiloxKey key(seed);
#pragma omp parallel for schedule(static) if (n > 4096)
  for (int64_t r = 0; r < n; ++r) {
    uint32_t c[4];
    for (int q = 0; q < 4; ++q) c[q] = uint32_t(in[4 * r + q]);
    philox4x32_10(c, key.k0, key.k1);
    for (int q = 0; q < 4; ++q) res[4 * r + q] = int64_t(c[q]);
  }
}

void register_philox(py::module_& m) {
  m.def("philox_words", &philox_words, py::arg("seed"), py::arg("counters"), py::arg("out"),
        py::arg("n"), py::call_guard<py::gil_scoped_release>());
}

SCKPT_REGISTER(register_philox);

}  // namespace
}  // namespace sckpt
