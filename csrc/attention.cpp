// Fused row kernels of the CPU attention path. Python does the matmuls (S = Q K^T, O = P V and the
// backward products) per query chunk; these kernels do everything elementwise between them, one
// score row at a time, so no Sq x Sk tensor outlives a chunk.
//
// The row kernels (the #else part at the end) are compiled twice, for baseline x86-64 and for
// AVX2 + FMA, by including this file into two namespaces; the entry points pick one at run time.
#ifndef SCKPT_ATTENTION_ROW_KERNELS
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "registry.h"
#include "dtypes.h"
#include "fastmath.h"
#include "philox.h"

namespace py = pybind11;

namespace sckpt {
namespace {

// Problem geometry shared by both kernels. The rows handled are nh heads x M query rows of one
// batch element; scores are [nh, M, kc] contiguous, query row i of the chunk is global row0 + i.
struct Rows {
  int64_t nh, M, kc, row0, head0;
  int64_t lse_hs;  // head stride of lse (it points at [b, 0, row0])
  double scale;
  bool causal;
  const uint8_t* pad;  // key_padding_mask row of this batch element (1 = attend) or null
  PhiloxKey key;
  uint32_t t16;
  double keep_scale;

  // Keys of query row qi that may attend lie in [0, limit(qi)); pad filters them further.
  int64_t limit(int64_t qi) const { return causal ? std::min(kc, qi + 1) : kc; }
};

// keep[j] = 1 if P[., ., qi, j] survives dropout (the attention stream of docs/DESIGN.md), j < lim.
inline void keep_row(const Rows& g, const PhiloxKey& key, int64_t qi, int64_t head, int64_t lim, uint8_t* keep) {
  const int64_t groups = (lim + 7) / 8;
  for (int64_t grp = 0; grp < groups; ++grp) {
    const uint32_t bits = attention_keep_bits8(key, uint64_t(grp), uint64_t(qi), uint64_t(head), g.t16);
    const int64_t end = std::min(lim, grp * 8 + 8);
    for (int64_t j = grp * 8; j < end; ++j) keep[j] = uint8_t((bits >> (j & 7)) & 1u);
  }
}

namespace generic {
#define SCKPT_ATTENTION_ROW_KERNELS
#include "attention.cpp"  // NOLINT: the row kernels below, baseline ISA
}  // namespace generic

#if defined(__x86_64__) && defined(__GNUC__)
#define SCKPT_HAVE_AVX2_ROWS 1
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
#include "attention.cpp"  // NOLINT: the same row kernels for AVX2 + FMA
}  // namespace avx2
#pragma GCC pop_options
#endif
#undef SCKPT_ATTENTION_ROW_KERNELS

bool use_avx2() {
#ifdef SCKPT_HAVE_AVX2_ROWS
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("f16c");
  return yes;
#else
  return false;
#endif
}

Rows make_rows(int64_t nh, int64_t M, int64_t kc, int64_t row0, int64_t head0, int64_t lse_hs, double scale,
               bool causal, uintptr_t pad, uintptr_t seed, uint32_t t16, double keep_scale) {
  return Rows{nh, M, kc, row0, head0, lse_hs, scale, causal, as_ptr<const uint8_t>(pad), PhiloxKey::from_tensor(seed),
              t16, keep_scale};
}

void attention_softmax_fwd(int dtype, uintptr_t s, uintptr_t lse, int64_t nh, int64_t M, int64_t kc,
                           int64_t row0, int64_t head0, int64_t lse_hs, double scale, bool causal,
                           uintptr_t pad, uintptr_t seed, uint32_t t16, double keep_scale) {
  const Rows g = make_rows(nh, M, kc, row0, head0, lse_hs, scale, causal, pad, seed, t16, keep_scale);
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
#ifdef SCKPT_HAVE_AVX2_ROWS
    if (use_avx2()) return avx2::softmax_fwd_rows<T>(as_ptr<T>(s), as_ptr<float>(lse), g);
#endif
    generic::softmax_fwd_rows<T>(as_ptr<T>(s), as_ptr<float>(lse), g);
  });
}

void attention_softmax_bwd(int dtype, uintptr_t s, uintptr_t dp, uintptr_t lse, int64_t nh, int64_t M,
                           int64_t kc, int64_t row0, int64_t head0, int64_t lse_hs, double scale, bool causal,
                           uintptr_t pad, uintptr_t seed, uint32_t t16, double keep_scale) {
  const Rows g = make_rows(nh, M, kc, row0, head0, lse_hs, scale, causal, pad, seed, t16, keep_scale);
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
#ifdef SCKPT_HAVE_AVX2_ROWS
    if (use_avx2()) return avx2::softmax_bwd_rows<T>(as_ptr<T>(s), as_ptr<T>(dp), as_ptr<const float>(lse), g);
#endif
    generic::softmax_bwd_rows<T>(as_ptr<T>(s), as_ptr<T>(dp), as_ptr<const float>(lse), g);
  });
}

void register_attention(py::module_& m) {
  m.def("attention_softmax_fwd", &attention_softmax_fwd, py::arg("dtype"), py::arg("s"), py::arg("lse"),
        py::arg("nh"), py::arg("M"), py::arg("kc"), py::arg("row0"), py::arg("head0"), py::arg("lse_hs"),
        py::arg("scale"), py::arg("causal"), py::arg("pad"), py::arg("seed"), py::arg("t16"),
        py::arg("keep_scale"), py::call_guard<py::gil_scoped_release>());
  m.def("attention_softmax_bwd", &attention_softmax_bwd, py::arg("dtype"), py::arg("s"), py::arg("dp"),
        py::arg("lse"), py::arg("nh"), py::arg("M"), py::arg("kc"), py::arg("row0"), py::arg("head0"),
        py::arg("lse_hs"), py::arg("scale"), py::arg("causal"), py::arg("pad"), py::arg("seed"), py::arg("t16"),
        py::arg("keep_scale"), py::call_guard<py::gil_scoped_release>());
}

SCKPT_REGISTER(register_attention);

}  // namespace
}  // namespace sckpt

#else  // SCKPT_ATTENTION_ROW_KERNELS: the row kernels, included twice above

inline double fast_exp(double x) { return std::exp(x); }
inline float fast_exp(float x) { return fast_expf(x); }

// Row reductions with eight independent partial results, which the compiler maps to one vector
// register (an omp simd reduction does not vectorise reliably here).
template <class Acc>
inline Acc row_max(const Acc* x, int64_t n) {
  Acc m[8];
  for (int t = 0; t < 8; ++t) m[t] = -std::numeric_limits<Acc>::infinity();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    for (int t = 0; t < 8; ++t) m[t] = __builtin_isgreater(x[j + t], m[t]) ? x[j + t] : m[t];
  for (; j < n; ++j) m[0] = __builtin_isgreater(x[j], m[0]) ? x[j] : m[0];
  Acc r = m[0];
  for (int t = 1; t < 8; ++t) r = __builtin_isgreater(m[t], r) ? m[t] : r;
  return r;
}

template <class Acc>
inline Acc row_dot(const Acc* x, const Acc* y, int64_t n) {
  Acc a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    for (int t = 0; t < 8; ++t) a[t] += x[j + t] * y[j + t];
  for (; j < n; ++j) a[0] += x[j] * y[j];
  return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

template <class Acc>
inline Acc row_sum(const Acc* x, int64_t n) {
  Acc a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    for (int t = 0; t < 8; ++t) a[t] += x[j + t];
  for (; j < n; ++j) a[0] += x[j];
  return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

// x[j] = exp(x[j] - shift): elementwise, so it vectorises.
template <class Acc>
inline void exp_row(Acc* x, int64_t n, Acc shift) {
  for (int64_t j = 0; j < n; ++j) x[j] = fast_exp(x[j] - shift);
}

// x[j] = s[j] * scale - shift for keys that may attend, -inf for padded ones; j < lim.
template <class T, class Acc>
inline void load_logits(const T* row, int64_t lim, const uint8_t* pad, Acc scale, Acc shift, Acc* x) {
  for (int64_t j = 0; j < lim; ++j) x[j] = Elem<T>::load(row + j) * scale - shift;
  if (pad != nullptr) {
    const Acc neg_inf = -std::numeric_limits<Acc>::infinity();
    for (int64_t j = 0; j < lim; ++j) x[j] = pad[j] ? x[j] : neg_inf;
  }
}

// s holds raw scores; on return it holds the dropped probabilities P * keep * keep_scale and lse
// the row logsumexp of the scaled, masked scores (+inf for a row with nothing to attend).
template <class T>
void softmax_fwd_rows(T* s, float* lse, const Rows& g) {
  using Acc = typename Elem<T>::Acc;
  const Acc neg_inf = -std::numeric_limits<Acc>::infinity();
  const PhiloxKey& key = g.key;
  const int64_t total = g.nh * g.M;
#pragma omp parallel if (total * g.kc > 32768)
  {
    std::vector<Acc> buf(g.kc), kbuf(g.kc);
    std::vector<uint8_t> keep(g.kc);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < total; ++r) {
      const int64_t h = r / g.M, i = r % g.M, qi = g.row0 + i;
      T* row = s + r * g.kc;
      const int64_t lim = g.limit(qi);
      Acc *x = buf.data(), *kf = kbuf.data();
      load_logits(row, lim, g.pad, Acc(g.scale), Acc(0), x);
      const Acc m = row_max(x, lim);
      float& out_lse = lse[h * g.lse_hs + i];
      if (m == neg_inf) {  // nothing to attend: o = 0, and backward sees lse = +inf, so P = 0
        for (int64_t j = 0; j < g.kc; ++j) Elem<T>::store(row + j, Acc(0));
        out_lse = std::numeric_limits<float>::infinity();
        continue;
      }
      exp_row(x, lim, m);
      const Acc sum = row_sum(x, lim);
      out_lse = float(m + std::log(sum));
      const Acc factor = Acc(1) / sum;
      if (g.t16 == 0) {
        for (int64_t j = 0; j < lim; ++j) Elem<T>::store(row + j, x[j] * factor);
      } else {
        keep_row(g, key, qi, g.head0 + h, lim, keep.data());
        const Acc kept = factor * Acc(g.keep_scale);
        for (int64_t j = 0; j < lim; ++j) kf[j] = keep[j] ? kept : Acc(0);
        for (int64_t j = 0; j < lim; ++j) Elem<T>::store(row + j, x[j] * kf[j]);
      }
      for (int64_t j = lim; j < g.kc; ++j) Elem<T>::store(row + j, Acc(0));
    }
  }
}

// s: raw scores (recomputed), overwritten with the dropped P (for dV = P^T dO).
// dp: dO V^T, overwritten with scale * P * (dp * keep * keep_scale - delta), the gradient of the
// raw scores (for dQ = dS K and dK = dS^T Q). delta = sum_j P_ij keep_ij keep_scale dp_ij is taken
// from the same rounded dp as the rest of the row, as eager softmax backward does, so a row whose
// P is one-hot gets exactly zero gradient.
template <class T>
void softmax_bwd_rows(T* s, T* dp, const float* lse, const Rows& g) {
  using Acc = typename Elem<T>::Acc;
  const PhiloxKey& key = g.key;
  const int64_t total = g.nh * g.M;
#pragma omp parallel if (total * g.kc > 32768)
  {
    std::vector<uint8_t> keep(g.kc);
    std::vector<Acc> pbuf(g.kc), dbuf(g.kc), kbuf(g.kc);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < total; ++r) {
      const int64_t h = r / g.M, i = r % g.M, qi = g.row0 + i;
      T* srow = s + r * g.kc;
      T* drow = dp + r * g.kc;
      const float row_lse = lse[h * g.lse_hs + i];
      int64_t lim = g.limit(qi);
      if (row_lse == std::numeric_limits<float>::infinity()) lim = 0;  // an empty row: P = 0
      Acc *x = pbuf.data(), *d = dbuf.data(), *kf = kbuf.data();
      load_logits(srow, lim, g.pad, Acc(g.scale), Acc(row_lse), x);
      if (g.t16) {
        keep_row(g, key, qi, g.head0 + h, lim, keep.data());
        const Acc ks = Acc(g.keep_scale);
        for (int64_t j = 0; j < lim; ++j) kf[j] = keep[j] ? ks : Acc(0);
        for (int64_t j = 0; j < lim; ++j) d[j] = Elem<T>::load(drow + j) * kf[j];
      } else {
        for (int64_t j = 0; j < lim; ++j) d[j] = Elem<T>::load(drow + j);
      }
      exp_row(x, lim, Acc(0));
      const Acc delta = row_dot(x, d, lim);
      if (g.t16) {
        for (int64_t j = 0; j < lim; ++j) Elem<T>::store(srow + j, x[j] * kf[j]);
      } else {
        for (int64_t j = 0; j < lim; ++j) Elem<T>::store(srow + j, x[j]);
      }
      const Acc scale = Acc(g.scale);
      for (int64_t j = 0; j < lim; ++j) Elem<T>::store(drow + j, x[j] * (d[j] - delta) * scale);
      for (int64_t j = lim; j < g.kc; ++j) {
        Elem<T>::store(srow + j, Acc(0));
        Elem<T>::store(drow + j, Acc(0));
      }
    }
  }
}

#endif  // SCKPT_ATTENTION_ROW_KERNELS
