// LayerNorm over the last dim of a contiguous [rows, n] tensor: forward (output + per-row mean and
// rstd), recompute of the output from saved (x, mean, rstd), and backward.
//
// Statistics are kept in S (float, or double for float64 inputs). Forward and recompute produce the
// output through the same apply_row from the same stored S values, so storing the LayerNorm output
// and recomputing it give bit-identical results. Row sums accumulate in double.
#include <cmath>
#include <cstdint>
#include <vector>

#include "registry.h"
#include "dtypes.h"

namespace py = pybind11;

namespace sckpt {
namespace {

template <class T>
using Stat = typename Elem<T>::Acc;  // float for f32/f16/bf16, double for f64

// y = (x - mean) * rstd * w (+ b), in Acc.
template <class T>
inline void apply_row(const T* x, const T* w, const T* b, T* y, int64_t n, Stat<T> mean,
                      Stat<T> rstd) {
  using Acc = typename Elem<T>::Acc;
  for (int64_t j = 0; j < n; ++j) {
    const Acc xhat = (Elem<T>::load(x + j) - mean) * rstd;
    Acc v = xhat * Elem<T>::load(w + j);
    if (b) v = v + Elem<T>::load(b + j);
    Elem<T>::store(y + j, v);
  }
}

template <class T>
void forward_rows(const T* x, const T* w, const T* b, T* y, Stat<T>* mean, Stat<T>* rstd,
                  int64_t rows, int64_t n, double eps) {
#pragma omp parallel for schedule(static) if (rows * n > 16384)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * n;
    double sum = 0.0;
    for (int64_t j = 0; j < n; ++j) sum += double(Elem<T>::load(xr + j));
    const double mu = sum / double(n);
    double sq = 0.0;  // two-pass variance: no cancellation for rows with a large mean
    for (int64_t j = 0; j < n; ++j) {
      const double d = double(Elem<T>::load(xr + j)) - mu;
      sq += d * d;
    }
    const Stat<T> m = Stat<T>(mu);
    const Stat<T> rs = Stat<T>(1.0 / std::sqrt(sq / double(n) + eps));
    mean[r] = m;
    rstd[r] = rs;
    if (y) apply_row<T>(xr, w, b, y + r * n, n, m, rs);
  }
}

template <class T>
void apply_rows(const T* x, const T* w, const T* b, T* y, const Stat<T>* mean,
                const Stat<T>* rstd, int64_t rows, int64_t n) {
#pragma omp parallel for schedule(static) if (rows * n > 16384)
  for (int64_t r = 0; r < rows; ++r) apply_row<T>(x + r * n, w, b, y + r * n, n, mean[r], rstd[r]);
}

// Rows are reduced for dw/db in fixed chunks, then the chunks in order: the result does not depend
// on the thread count, so repeated backward passes agree bit for bit.
constexpr int64_t kChunkRows = 32;

template <class T>
void backward_rows(const T* dy, const T* x, const Stat<T>* mean, const Stat<T>* rstd, const T* w,
                   T* dx, T* dw, T* db, int64_t rows, int64_t n) {
  const int64_t chunks = (rows + kChunkRows - 1) / kChunkRows;
  std::vector<double> pw(dw ? size_t(chunks * n) : 0), pb(db ? size_t(chunks * n) : 0);
#pragma omp parallel for schedule(static) if (rows * n > 16384)
  for (int64_t c = 0; c < chunks; ++c) {
    double* cw = dw ? pw.data() + c * n : nullptr;
    double* cb = db ? pb.data() + c * n : nullptr;
    if (cw)
      for (int64_t j = 0; j < n; ++j) cw[j] = 0.0;
    if (cb)
      for (int64_t j = 0; j < n; ++j) cb[j] = 0.0;
    const int64_t end = (c + 1) * kChunkRows < rows ? (c + 1) * kChunkRows : rows;
    for (int64_t r = c * kChunkRows; r < end; ++r) {
      const T* xr = x + r * n;
      const T* gr = dy + r * n;
      const double m = double(mean[r]), rs = double(rstd[r]);
      double sum_g = 0.0, sum_gx = 0.0;  // sums of dy*w and dy*w*xhat
      for (int64_t j = 0; j < n; ++j) {
        const double xhat = (double(Elem<T>::load(xr + j)) - m) * rs;
        const double g = double(Elem<T>::load(gr + j));
        const double gw = g * double(Elem<T>::load(w + j));
        sum_g += gw;
        sum_gx += gw * xhat;
        if (cw) cw[j] += g * xhat;
        if (cb) cb[j] += g;
      }
      if (!dx) continue;
      const double a = sum_g / double(n), bcoef = sum_gx / double(n);
      T* dr = dx + r * n;
      for (int64_t j = 0; j < n; ++j) {
        const double xhat = (double(Elem<T>::load(xr + j)) - m) * rs;
        const double gw = double(Elem<T>::load(gr + j)) * double(Elem<T>::load(w + j));
        Elem<T>::store(dr + j, typename Elem<T>::Acc(rs * (gw - a - xhat * bcoef)));
      }
    }
  }
  if (!dw && !db) return;
#pragma omp parallel for schedule(static) if (chunks * n > 16384)
  for (int64_t j = 0; j < n; ++j) {
    double sw = 0.0, sb = 0.0;
    for (int64_t c = 0; c < chunks; ++c) {
      if (dw) sw += pw[size_t(c * n + j)];
      if (db) sb += pb[size_t(c * n + j)];
    }
    if (dw) Elem<T>::store(dw + j, typename Elem<T>::Acc(sw));
    if (db) Elem<T>::store(db + j, typename Elem<T>::Acc(sb));
  }
}

// y may be 0 (statistics only); b may be 0 (no bias). mean/rstd are S-typed [rows].
void layer_norm_forward(int dtype, uintptr_t x, uintptr_t w, uintptr_t b, uintptr_t y,
                        uintptr_t mean, uintptr_t rstd, int64_t rows, int64_t n, double eps) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    forward_rows<T>(as_ptr<const T>(x), as_ptr<const T>(w), as_ptr<const T>(b), as_ptr<T>(y),
                    as_ptr<Stat<T>>(mean), as_ptr<Stat<T>>(rstd), rows, n, eps);
  });
}

void layer_norm_apply(int dtype, uintptr_t x, uintptr_t w, uintptr_t b, uintptr_t y,
                      uintptr_t mean, uintptr_t rstd, int64_t rows, int64_t n) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    apply_rows<T>(as_ptr<const T>(x), as_ptr<const T>(w), as_ptr<const T>(b), as_ptr<T>(y),
                  as_ptr<const Stat<T>>(mean), as_ptr<const Stat<T>>(rstd), rows, n);
  });
}

// dx, dw, db may each be 0 when that gradient is not needed.
void layer_norm_backward(int dtype, uintptr_t dy, uintptr_t x, uintptr_t mean, uintptr_t rstd,
                         uintptr_t w, uintptr_t dx, uintptr_t dw, uintptr_t db, int64_t rows,
                         int64_t n) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    backward_rows<T>(as_ptr<const T>(dy), as_ptr<const T>(x), as_ptr<const Stat<T>>(mean),
                     as_ptr<const Stat<T>>(rstd), as_ptr<const T>(w), as_ptr<T>(dx), as_ptr<T>(dw),
                     as_ptr<T>(db), rows, n);
  });
}

void register_layer_norm(py::module_& m) {
  m.def("layer_norm_forward", &layer_norm_forward, py::arg("dtype"), py::arg("x"), py::arg("w"),
        py::arg("b"), py::arg("y"), py::arg("mean"), py::arg("rstd"), py::arg("rows"), py::arg("n"),
        py::arg("eps"), py::call_guard<py::gil_scoped_release>());
  m.def("layer_norm_apply", &layer_norm_apply, py::arg("dtype"), py::arg("x"), py::arg("w"),
        py::arg("b"), py::arg("y"), py::arg("mean"), py::arg("rstd"), py::arg("rows"), py::arg("n"),
        py::call_guard<py::gil_scoped_release>());
  m.def("layer_norm_backward", &layer_norm_backward, py::arg("dtype"), py::arg("dy"), py::arg("x"),
        py::arg("mean"), py::arg("rstd"), py::arg("w"), py::arg("dx"), py::arg("dw"), py::arg("db"),
        py::arg("rows"), py::arg("n"), py::call_guard<py::gil_scoped_release>());
}

SCKPT_REGISTER(register_layer_norm);

}  // namespace
}  // namespace sckpt
