// Cross-entropy over the rows of a chunk of logits [rows, V] (selective_ckpt/ops/cross_entropy.py):
// per row the logsumexp and the loss, and optionally the gradient of the loss with respect to the
// logits, written in place over them in the logits' dtype (the buffer the next two matmuls read).
//
// With c = softcap * tanh(z / softcap) (or c = z without a cap), eps the label smoothing, y the
// label and lse = log sum_j exp(c_j):
//   loss = lse - (1 - eps) c_y - (eps / V) sum_j c_j          (F.cross_entropy's smoothing)
//   dz_j = g * (softmax(c)_j - eps / V - (1 - eps) [j == y]) * (1 - (c_j / softcap)^2)
// g is the row's gradient scale (scale[row * scale_stride]). A row whose label is ignore_index has
// loss 0, lse 0 and a zero gradient row. Everything is computed in float (double for float64
// logits); sums over the vocabulary accumulate in double. Rows run in parallel; each row's result
// does not depend on the thread count.
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "registry.h"
#include "dtypes.h"
#include "fastmath.h"
#include "activations.h"

namespace py = pybind11;

namespace sckpt {
namespace {

template <class T>
using Acc = typename Elem<T>::Acc;

// --- float rows: compiled per ISA (AVX-512, AVX2, baseline), picked at load time.

SCKPT_CLONES float row_max(const float* __restrict c, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < n; ++j) m = c[j] > m ? c[j] : m;
  return m;
}

// sum_j exp(c_j - m) and sum_j c_j, both in double.
SCKPT_CLONES void row_sums(const float* __restrict c, int64_t n, float m, double* sum_exp, double* sum_c) {
  double se = 0.0, sc = 0.0;
#pragma omp simd reduction(+ : se, sc)
  for (int64_t j = 0; j < n; ++j) {
    se += double(fast_expf(c[j] - m));
    sc += double(c[j]);
  }
  *sum_exp = se;
  *sum_c = sc;
}

// c_j := g * (exp(c_j - lse) - floor) * (1 - (c_j / cap)^2) in place, for every j (the label's
// term is added by the caller); inv_cap 0 means no cap.
SCKPT_CLONES void row_grad(float* c, int64_t n, float lse, float g, float floor, float inv_cap) {
  if (inv_cap == 0.0f) {
    for (int64_t j = 0; j < n; ++j) c[j] = g * (fast_expf(c[j] - lse) - floor);
  } else {
    for (int64_t j = 0; j < n; ++j) {
      const float t = c[j] * inv_cap;
      c[j] = g * (fast_expf(c[j] - lse) - floor) * (1.0f - t * t);
    }
  }
}

struct RowOut {
  double lse, loss;
};

// One row in float: c holds the (capped) logits on entry; with write_grad it holds the gradient on
// return. Rows holding inf or NaN take libm's exp and IEEE max, so they give what eager gives.
RowOut float_row(float* c, int64_t n, int64_t y, double eps, float cap, float g, bool write_grad) {
  float m = row_max(c, n);
  double se, sc;
  row_sums(c, n, m, &se, &sc);
  const bool finite = std::isfinite(sc);
  if (!finite) {  // an inf or NaN logit: exact IEEE path (NaN propagates, +inf gives NaN)
    m = -std::numeric_limits<float>::infinity();
    bool nan = false;
    for (int64_t j = 0; j < n; ++j) {
      nan |= std::isnan(c[j]);
      m = c[j] > m ? c[j] : m;
    }
    se = 0.0;
    for (int64_t j = 0; j < n; ++j) se += std::exp(double(c[j]) - double(m));
    if (nan) se = std::numeric_limits<double>::quiet_NaN();
  }
  const double lse = double(m) + std::log(se);
  const float cy = c[y];
  // (the smoothing term only where it is on: 0 * -inf would turn a row with a masked class into NaN)
  const double loss = lse - (1.0 - eps) * double(cy) - (eps != 0.0 ? eps / double(n) * sc : 0.0);
  if (write_grad) {
    const float floor = float(eps / double(n));
    const float inv_cap = cap != 0.0f ? 1.0f / cap : 0.0f;
    if (finite) {
      row_grad(c, n, float(lse), g, floor, inv_cap);
    } else {
      for (int64_t j = 0; j < n; ++j) {
        const float t = c[j] * inv_cap;
        c[j] = g * (float(std::exp(double(c[j]) - lse)) - floor) * (1.0f - t * t);
      }
    }
    const float ty = cy * inv_cap;
    c[y] = g * (float(std::exp(double(cy) - lse)) - floor - float(1.0 - eps)) * (1.0f - ty * ty);
  }
  return {lse, loss};
}

RowOut double_row(const double* z, double* d, int64_t n, int64_t y, double eps, double cap, double g,
                  bool write_grad, std::vector<double>& buf) {
  const double* c = z;
  if (cap != 0.0) {
    buf.resize(size_t(n));
    for (int64_t j = 0; j < n; ++j) buf[size_t(j)] = cap * std::tanh(z[j] / cap);
    c = buf.data();
  }
  double m = -std::numeric_limits<double>::infinity();
  bool nan = false;
  for (int64_t j = 0; j < n; ++j) {
    nan |= std::isnan(c[j]);
    m = c[j] > m ? c[j] : m;
  }
  double se = 0.0, sc = 0.0;
  for (int64_t j = 0; j < n; ++j) {
    se += std::exp(c[j] - m);
    sc += c[j];
  }
  if (nan) se = std::numeric_limits<double>::quiet_NaN();
  const double lse = m + std::log(se);
  const double loss = lse - (1.0 - eps) * c[y] - (eps != 0.0 ? eps / double(n) * sc : 0.0);
  if (write_grad) {
    const double floor = eps / double(n);
    for (int64_t j = 0; j < n; ++j) {
      double v = g * (std::exp(c[j] - lse) - floor - (j == y ? 1.0 - eps : 0.0));
      if (cap != 0.0) {
        const double t = c[j] / cap;
        v *= 1.0 - t * t;
      }
      d[j] = v;
    }
  }
  return {lse, loss};
}

template <class T>
void cross_entropy_rows(T* logits, int64_t row_stride, const int64_t* labels, const Acc<T>* scale,
                        int64_t scale_stride, Acc<T>* lse, Acc<T>* loss, int64_t rows, int64_t n,
                        int64_t ignore_index, double eps, double cap, bool write_grad) {
#pragma omp parallel
  {
    std::vector<Acc<T>> buf;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      T* z = logits + r * row_stride;
      const int64_t y = labels[r];
      if (y == ignore_index) {
        lse[r] = 0;
        loss[r] = 0;
        if (write_grad)
          for (int64_t j = 0; j < n; ++j) Elem<T>::store(z + j, Acc<T>(0));
        continue;
      }
      const Acc<T> g = scale[r * scale_stride];
      RowOut out;
      if constexpr (std::is_same_v<T, double>) {
        out = double_row(z, z, n, y, eps, cap, g, write_grad, buf);
      } else {
        // float rows without a cap are read (and written) in place; others through a float copy.
        float* c = nullptr;
        if (std::is_same_v<T, float> && cap == 0.0) {
          c = reinterpret_cast<float*>(z);
        } else {
          buf.resize(size_t(n));
          c = buf.data();
          for (int64_t j = 0; j < n; ++j) c[j] = Elem<T>::load(z + j);
          if (cap != 0.0) {
            const float fc = float(cap);
            for (int64_t j = 0; j < n; ++j) c[j] = fc * std::tanh(c[j] / fc);
          }
        }
        out = float_row(c, n, y, eps, float(cap), g, write_grad);
        if (write_grad && static_cast<void*>(c) != static_cast<void*>(z))
          for (int64_t j = 0; j < n; ++j) Elem<T>::store(z + j, c[j]);
      }
      lse[r] = Acc<T>(out.lse);
      loss[r] = Acc<T>(out.loss);
    }
  }
}

// logits [rows, n] with row stride row_stride (elements); labels int64 [rows]; scale, lse, loss in
// float (double for float64 logits). Labels must be in [0, n) or equal ignore_index (checked by the
// caller). cap 0 means no soft-capping.
void cross_entropy_rows_entry(int dtype, uintptr_t logits, int64_t row_stride, uintptr_t labels, uintptr_t scale,
                              int64_t scale_stride, uintptr_t lse, uintptr_t loss, int64_t rows, int64_t n,
                              int64_t ignore_index, double eps, double cap, bool write_grad) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    cross_entropy_rows<T>(as_ptr<T>(logits), row_stride, as_ptr<const int64_t>(labels),
                          as_ptr<const Acc<T>>(scale), scale_stride, as_ptr<Acc<T>>(lse), as_ptr<Acc<T>>(loss), rows,
                          n, ignore_index, eps, cap, write_grad);
  });
}

// One pass over int64 labels [n] on the host: the number that count (are not ignore_index) when every label is in
// [0, vocab) or ignore_index, else -(1 + the position of the first that is neither). It stands in for the label check
// and the mean's count, which as tensor ops are several small ops and a read back per step.
int64_t cross_entropy_labels(uintptr_t labels, int64_t n, int64_t vocab, int64_t ignore_index) {
  const int64_t* y = as_ptr<const int64_t>(labels);
  int64_t count = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t v = y[i];
    if (v == ignore_index) continue;
    if (v < 0 || v >= vocab) return -1 - i;
    ++count;
  }
  return count;
}

void register_cross_entropy(py::module_& m) {
  m.def("cross_entropy_labels", &cross_entropy_labels, py::arg("labels"), py::arg("n"), py::arg("vocab"),
        py::arg("ignore_index"));
  m.def("cross_entropy_rows", &cross_entropy_rows_entry, py::arg("dtype"), py::arg("logits"), py::arg("row_stride"),
        py::arg("labels"), py::arg("scale"), py::arg("scale_stride"), py::arg("lse"), py::arg("loss"),
        py::arg("rows"), py::arg("n"), py::arg("ignore_index"), py::arg("label_smoothing"), py::arg("softcap"),
        py::arg("write_grad"), py::call_guard<py::gil_scoped_release>());
}

SCKPT_REGISTER(register_cross_entropy);

}  // namespace
}  // namespace sckpt
