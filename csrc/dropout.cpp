// Raw Philox words (the reference behind selective_ckpt.rng) and elementwise dropout.
#include <cstdint>

#include "bindings.h"
#include "dtypes.h"
#include "philox.h"

namespace py = pybind11;

namespace sckpt {
namespace {

// counters: int64 [n, 4] with values in [0, 2^32); out: int64 [n, 4].
void philox_words(uint64_t seed, uintptr_t counters, uintptr_t out, int64_t n) {
  const int64_t* in = as_ptr<const int64_t>(counters);
  int64_t* res = as_ptr<int64_t>(out);
  const PhiloxKey key(seed);
#pragma omp parallel for schedule(static) if (n > 4096)
  for (int64_t r = 0; r < n; ++r) {
    uint32_t c[4];
    for (int q = 0; q < 4; ++q) c[q] = uint32_t(in[4 * r + q]);
    philox4x32_10(c, key.k0, key.k1);
    for (int q = 0; q < 4; ++q) res[4 * r + q] = int64_t(c[q]);
  }
}

// y[r, j] = x[r, j] * scale if kept else 0, over contiguous [rows, cols]. In-place is allowed.
template <class T>
void dropout_rows(const T* x, T* y, int64_t rows, int64_t cols, uint64_t seed, uint32_t t16,
                  double scale) {
  using Acc = typename Elem<T>::Acc;
  const PhiloxKey key(seed);
  const Acc s = Acc(scale);
  const int64_t groups = (cols + 7) / 8;
#pragma omp parallel for schedule(static) if (rows * cols > 16384)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * cols;
    T* yr = y + r * cols;
    for (int64_t g = 0; g < groups; ++g) {
      const uint32_t bits = elementwise_keep_bits8(key, uint64_t(g), uint64_t(r), t16);
      const int64_t end = g * 8 + 8 < cols ? g * 8 + 8 : cols;
      for (int64_t j = g * 8; j < end; ++j) {
        const bool keep = (bits >> (j & 7)) & 1u;
        Elem<T>::store(yr + j, keep ? Elem<T>::load(xr + j) * s : Acc(0));
      }
    }
  }
}

void dropout(int dtype, uintptr_t x, uintptr_t y, int64_t rows, int64_t cols, uint64_t seed,
             uint32_t t16, double scale) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    dropout_rows<T>(as_ptr<const T>(x), as_ptr<T>(y), rows, cols, seed, t16, scale);
  });
}

}  // namespace

void register_dropout(py::module_& m) {
  m.def("philox_words", &philox_words, py::arg("seed"), py::arg("counters"), py::arg("out"),
        py::arg("n"), py::call_guard<py::gil_scoped_release>());
  m.def("dropout", &dropout, py::arg("dtype"), py::arg("x"), py::arg("y"), py::arg("rows"),
        py::arg("cols"), py::arg("seed"), py::arg("t16"), py::arg("scale"),
        py::call_guard<py::gil_scoped_release>());
}

}  // namespace sckpt
