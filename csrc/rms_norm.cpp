// RMSNorm over the last dim of a contiguous [rows, n] tensor: forward (output + per-row rstd),
// rebuild of the output from saved (x, rstd), and backward.
//
// Two rounding orders (docs/DESIGN.md, "RMSNorm"):
//   offset == 0 (Llama):  y = w * T(x * rstd)        -- normalised in S, rounded to T, then scaled
//   offset != 0 (Gemma):  y = T(x * rstd * (offset + w)) -- scaled in S, rounded once
// rstd is kept in S (float, double for float64 inputs); forward and rebuild share apply_row and
// the stored rstd, so a stored and a rebuilt output agree bit for bit. Row sums accumulate in double.
#include <cmath>
#include <cstdint>
#include <vector>

#include "registry.h"
#include "dtypes.h"

namespace py = pybind11;

namespace sckpt {
namespace {

template <class T>
using Acc = typename Elem<T>::Acc;  // float for f32/f16/bf16, double for f64

// x * rstd rounded to T, as the Llama form's eager code casts the normalised row to the input dtype.
template <class T>
inline Acc<T> round_to(Acc<T> v) {
  T t;
  Elem<T>::store(&t, v);
  return Elem<T>::load(&t);
}

template <class T>
inline void apply_row(const T* x, const T* w, T* y, int64_t n, Acc<T> rstd, double offset) {
  if (offset == 0.0) {
    for (int64_t j = 0; j < n; ++j) {
      const Acc<T> xn = round_to<T>(Elem<T>::load(x + j) * rstd);
      Elem<T>::store(y + j, Elem<T>::load(w + j) * xn);
    }
  } else {
    const Acc<T> off = Acc<T>(offset);
    for (int64_t j = 0; j < n; ++j) {
      Elem<T>::store(y + j, Elem<T>::load(x + j) * rstd * (off + Elem<T>::load(w + j)));
    }
  }
}

template <class T>
void forward_rows(const T* x, const T* w, T* y, Acc<T>* rstd, int64_t rows, int64_t n, double eps,
                  double offset) {
#pragma omp parallel for schedule(static) if (rows * n > 16384)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * n;
    double sq = 0.0;
    for (int64_t j = 0; j < n; ++j) {
      const double v = double(Elem<T>::load(xr + j));
      sq += v * v;
    }
    const Acc<T> rs = Acc<T>(1.0 / std::sqrt(sq / double(n) + eps));
    rstd[r] = rs;
    if (y) apply_row<T>(xr, w, y + r * n, n, rs, offset);
  }
}

template <class T>
void apply_rows(const T* x, const T* w, T* y, const Acc<T>* rstd, int64_t rows, int64_t n, double offset) {
#pragma omp parallel for schedule(static) if (rows * n > 16384)
  for (int64_t r = 0; r < rows; ++r) apply_row<T>(x + r * n, w, y + r * n, n, rstd[r], offset);
}

// dw is reduced in fixed chunks of rows, then over the chunks in order: the result does not depend
// on the thread count, so repeated backward passes agree bit for bit.
constexpr int64_t kChunkRows = 32;

// With xhat = x * rstd and the scale s = offset + w:  dw = sum_rows dy * xhat,
// dx = rstd * (dy*s - xhat * mean(dy*s*xhat)). The rounding of xhat in the Llama form is taken as
// exact, as eager autograd does for its cast.
template <class T>
void backward_rows(const T* dy, const T* x, const Acc<T>* rstd, const T* w, T* dx, T* dw, int64_t rows,
                   int64_t n, double offset) {
  const int64_t chunks = (rows + kChunkRows - 1) / kChunkRows;
  std::vector<double> pw(dw ? size_t(chunks * n) : 0);
#pragma omp parallel for schedule(static) if (rows * n > 16384)
  for (int64_t c = 0; c < chunks; ++c) {
    double* cw = dw ? pw.data() + c * n : nullptr;
    if (cw)
      for (int64_t j = 0; j < n; ++j) cw[j] = 0.0;
    const int64_t end = (c + 1) * kChunkRows < rows ? (c + 1) * kChunkRows : rows;
    for (int64_t r = c * kChunkRows; r < end; ++r) {
      const T* xr = x + r * n;
      const T* gr = dy + r * n;
      const double rs = double(rstd[r]);
      double sum_gx = 0.0;  // sum of dy * s * xhat
      for (int64_t j = 0; j < n; ++j) {
        const double xhat = double(Elem<T>::load(xr + j)) * rs;
        const double g = double(Elem<T>::load(gr + j));
        sum_gx += g * (offset + double(Elem<T>::load(w + j))) * xhat;
        if (cw) cw[j] += g * xhat;
      }
      if (!dx) continue;
      const double c2 = sum_gx / double(n);
      T* dr = dx + r * n;
      for (int64_t j = 0; j < n; ++j) {
        const double xhat = double(Elem<T>::load(xr + j)) * rs;
        const double gs = double(Elem<T>::load(gr + j)) * (offset + double(Elem<T>::load(w + j)));
        Elem<T>::store(dr + j, Acc<T>(rs * (gs - xhat * c2)));
      }
    }
  }
  if (!dw) return;
#pragma omp parallel for schedule(static) if (chunks * n > 16384)
  for (int64_t j = 0; j < n; ++j) {
    double sw = 0.0;
    for (int64_t c = 0; c < chunks; ++c) sw += pw[size_t(c * n + j)];
    Elem<T>::store(dw + j, Acc<T>(sw));
  }
}

// y may be 0 (statistics only). rstd is S-typed [rows].
void rms_norm_forward(int dtype, uintptr_t x, uintptr_t w, uintptr_t y, uintptr_t rstd, int64_t rows, int64_t n,
                      double eps, double offset) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    forward_rows<T>(as_ptr<const T>(x), as_ptr<const T>(w), as_ptr<T>(y), as_ptr<Acc<T>>(rstd), rows, n, eps,
                    offset);
  });
}

void rms_norm_apply(int dtype, uintptr_t x, uintptr_t w, uintptr_t y, uintptr_t rstd, int64_t rows, int64_t n,
                    double offset) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    apply_rows<T>(as_ptr<const T>(x), as_ptr<const T>(w), as_ptr<T>(y), as_ptr<const Acc<T>>(rstd), rows, n,
                  offset);
  });
}

// dx and dw may each be 0 when that gradient is not needed.
void rms_norm_backward(int dtype, uintptr_t dy, uintptr_t x, uintptr_t rstd, uintptr_t w, uintptr_t dx,
                       uintptr_t dw, int64_t rows, int64_t n, double offset) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    backward_rows<T>(as_ptr<const T>(dy), as_ptr<const T>(x), as_ptr<const Acc<T>>(rstd), as_ptr<const T>(w),
                     as_ptr<T>(dx), as_ptr<T>(dw), rows, n, offset);
  });
}

void register_rms_norm(py::module_& m) {
  m.def("rms_norm_forward", &rms_norm_forward, py::arg("dtype"), py::arg("x"), py::arg("w"), py::arg("y"),
        py::arg("rstd"), py::arg("rows"), py::arg("n"), py::arg("eps"), py::arg("offset"),
        py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm_apply", &rms_norm_apply, py::arg("dtype"), py::arg("x"), py::arg("w"), py::arg("y"),
        py::arg("rstd"), py::arg("rows"), py::arg("n"), py::arg("offset"), py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm_backward", &rms_norm_backward, py::arg("dtype"), py::arg("dy"), py::arg("x"), py::arg("rstd"),
        py::arg("w"), py::arg("dx"), py::arg("dw"), py::arg("rows"), py::arg("n"), py::arg("offset"),
        py::call_guard<py::gil_scoped_release>());
}

SCKPT_REGISTER(register_rms_norm);

}  // namespace
}  // namespace sckpt
