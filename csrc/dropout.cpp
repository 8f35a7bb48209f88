// Elementwise dropout by the contract's elementwise stream (selective_ckpt.ops.dropout).
#include <cstdint>

#include "registry.h"
#include "dtypes.h"
#include "philox.h"

namespace py = pybind11;

namespace sckpt {
namespace {

// y[r, j] = x[r, j] * (scale if kept else 0) over contiguous [rows, cols]; in-place is allowed. A product,
// not a select, as F.dropout: a NaN or inf input gives NaN where dropped (docs/DESIGN.md, dropout contract).
template <class T>
void dropout_rows(const T* x, T* y, int64_t rows, int64_t cols, const PhiloxKey& key, uint32_t t16,
                  double scale) {
  using Acc = typename Elem<T>::Acc;
  const Acc s = Acc(scale);
  const int64_t groups = (cols + 7) / 8;
#pragma omp parallel for schedule(static) if (rows * cols > 16384)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * cols;
    T* yr = y + r * cols;
    // kPhiloxLanes column groups' draws at a time (side by side, so the rounds vectorise); the last
    // batch may draw past the row, those bits unused.
    for (int64_t g0 = 0; g0 < groups; g0 += kPhiloxLanes) {
      uint32_t lanes[kPhiloxLanes];
      elementwise_keep_bits8_lanes(key, uint64_t(g0), uint64_t(r), t16, lanes);
      const int64_t stop = g0 + kPhiloxLanes < groups ? g0 + kPhiloxLanes : groups;
      for (int64_t g = g0; g < stop; ++g) {
        const uint32_t bits = lanes[g - g0];
        const int64_t end = g * 8 + 8 < cols ? g * 8 + 8 : cols;
        for (int64_t j = g * 8; j < end; ++j) {
          const bool keep = (bits >> (j & 7)) & 1u;
          Elem<T>::store(yr + j, Elem<T>::load(xr + j) * (keep ? s : Acc(0)));
        }
      }
    }
  }
}

// seed: the int32 [2] seed tensor's data.
void dropout_forward(int dtype, uintptr_t x, uintptr_t y, int64_t rows, int64_t cols, uintptr_t seed,
                     uint32_t t16, double scale) {
  const PhiloxKey key = PhiloxKey::from_tensor(seed);
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    dropout_rows<T>(as_ptr<const T>(x), as_ptr<T>(y), rows, cols, key, t16, scale);
  });
}

void register_dropout(py::module_& m) {
  m.def("dropout_forward", &dropout_forward, py::arg("dtype"), py::arg("x"), py::arg("y"), py::arg("rows"),
        py::arg("cols"), py::arg("seed"), py::arg("t16"), py::arg("scale"),
        py::call_guard<py::gil_scoped_release>());
}

SCKPT_REGISTER(register_dropout);

}  // namespace
}  // namespace sckpt
