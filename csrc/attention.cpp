// Fused row kernels of the CPU attention path. Python does the matmuls (S = Q K^T, O = P V and the
// backward products) per query chunk; these kernels do everything elementwise between them, one
// score row at a time, so no Sq x Sk tensor outlives a chunk.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "bindings.h"
#include "dtypes.h"
#include "philox.h"

namespace py = pybind11;

namespace sckpt {
namespace {

// exp for float, branch-free so loops over a row vectorise: 2^n * e^r with |r| <= ln2/2 and a
// degree-7 Taylor polynomial (truncation error below 0.1 ulp). Inputs below -87.3 give 0.
inline float fast_expf(float x) {
  const float xc = std::min(std::max(x, -87.3f), 88.7f);
  const float n = std::nearbyint(xc * 1.44269504088896341f);
  float r = std::fma(n, -0.693145751953125f, xc);  // ln2 split in two for an exact reduction
  r = std::fma(n, -1.428606765330187045e-06f, r);
  float p = 1.0f / 5040.0f;
  p = std::fma(p, r, 1.0f / 720.0f);
  p = std::fma(p, r, 1.0f / 120.0f);
  p = std::fma(p, r, 1.0f / 24.0f);
  p = std::fma(p, r, 1.0f / 6.0f);
  p = std::fma(p, r, 0.5f);
  p = std::fma(p, r, 1.0f);
  p = std::fma(p, r, 1.0f);
  const int32_t bits = (int32_t(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, 4);
  return x < -87.3f ? 0.0f : p * two_n;
}

inline double fast_exp(double x) { return std::exp(x); }
inline float fast_exp(float x) { return fast_expf(x); }

// Problem geometry shared by both kernels. The rows handled are nh heads x M query rows of one
// batch element; scores are [nh, M, kc] contiguous, query row i of the chunk is global row0 + i.
struct Rows {
  int64_t nh, M, kc, row0, head0;
  int64_t lse_hs;  // head stride of lse / delta (they point at [b, 0, row0])
  double scale;
  bool causal;
  const uint8_t* pad;  // key_padding_mask row of this batch element (1 = attend) or null
  uint64_t seed;
  uint32_t t16;
  double keep_scale;

  // Valid keys of query row qi lie in [0, limit(qi)), further filtered by pad.
  int64_t limit(int64_t qi) const { return causal ? std::min(kc, qi + 1) : kc; }
  bool valid(int64_t j, int64_t lim) const { return j < lim && (pad == nullptr || pad[j]); }
};

// keep[j] = 1 if P[., ., qi, j] survives dropout (the attention stream of DESIGN.md).
inline void keep_row(const Rows& g, const PhiloxKey& key, int64_t qi, int64_t head, uint8_t* keep) {
  const int64_t groups = (g.kc + 7) / 8;
  for (int64_t grp = 0; grp < groups; ++grp) {
    const uint32_t bits = attention_keep_bits8(key, uint64_t(grp), uint64_t(qi), uint64_t(head), g.t16);
    const int64_t end = std::min(g.kc, grp * 8 + 8);
    for (int64_t j = grp * 8; j < end; ++j) keep[j] = uint8_t((bits >> (j & 7)) & 1u);
  }
}

// s holds raw scores; on return it holds the dropped probabilities P * keep * keep_scale and lse
// the row logsumexp of the scaled, masked scores (+inf for a row with nothing to attend).
template <class T>
void softmax_fwd_rows(T* s, float* lse, const Rows& g) {
  using Acc = typename Elem<T>::Acc;
  const Acc neg_inf = -std::numeric_limits<Acc>::infinity();
  const PhiloxKey key(g.seed);
  const int64_t total = g.nh * g.M;
#pragma omp parallel if (total * g.kc > 32768)
  {
    std::vector<Acc> buf(g.kc);
    std::vector<uint8_t> keep(g.kc);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < total; ++r) {
      const int64_t h = r / g.M, i = r % g.M, qi = g.row0 + i;
      T* row = s + r * g.kc;
      const int64_t lim = g.limit(qi);
      const Acc scale = Acc(g.scale);
      Acc m = neg_inf;
      for (int64_t j = 0; j < g.kc; ++j) {
        const Acc x = g.valid(j, lim) ? Elem<T>::load(row + j) * scale : neg_inf;
        buf[j] = x;
        m = std::max(m, x);
      }
      float& out_lse = lse[h * g.lse_hs + i];
      if (m == neg_inf) {  // nothing to attend: o = 0, and backward rebuilds P = exp(s - inf) = 0
        for (int64_t j = 0; j < g.kc; ++j) Elem<T>::store(row + j, Acc(0));
        out_lse = std::numeric_limits<float>::infinity();
        continue;
      }
      Acc sum = 0;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < g.kc; ++j) {
        const Acc e = fast_exp(buf[j] - m);
        buf[j] = e;
        sum += e;
      }
      out_lse = float(m + std::log(sum));
      Acc factor = Acc(1) / sum;
      if (g.t16 == 0) {
        for (int64_t j = 0; j < g.kc; ++j) Elem<T>::store(row + j, buf[j] * factor);
      } else {
        keep_row(g, key, qi, g.head0 + h, keep.data());
        factor *= Acc(g.keep_scale);
        for (int64_t j = 0; j < g.kc; ++j) Elem<T>::store(row + j, keep[j] ? buf[j] * factor : Acc(0));
      }
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
  const PhiloxKey key(g.seed);
  const int64_t total = g.nh * g.M;
#pragma omp parallel if (total * g.kc > 32768)
  {
    std::vector<uint8_t> keep(g.kc, 1);
    std::vector<Acc> pbuf(g.kc), dbuf(g.kc);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < total; ++r) {
      const int64_t h = r / g.M, i = r % g.M, qi = g.row0 + i;
      T* srow = s + r * g.kc;
      T* drow = dp + r * g.kc;
      const int64_t lim = g.limit(qi);
      const Acc row_lse = Acc(lse[h * g.lse_hs + i]);
      const Acc scale = Acc(g.scale), ks = g.t16 ? Acc(g.keep_scale) : Acc(1);
      if (g.t16) keep_row(g, key, qi, g.head0 + h, keep.data());
      Acc delta = 0;
      for (int64_t j = 0; j < g.kc; ++j) {
        // A masked key, or any key of an empty row (lse = +inf), has P = 0 and gradient 0.
        pbuf[j] = g.valid(j, lim) ? Elem<T>::load(srow + j) * scale - row_lse : -INFINITY;
        dbuf[j] = keep[j] ? Elem<T>::load(drow + j) * ks : Acc(0);
      }
#pragma omp simd reduction(+ : delta)
      for (int64_t j = 0; j < g.kc; ++j) {
        const Acc p = fast_exp(pbuf[j]);
        pbuf[j] = p;
        delta += p * dbuf[j];
      }
      for (int64_t j = 0; j < g.kc; ++j) {
        Elem<T>::store(srow + j, keep[j] ? pbuf[j] * ks : Acc(0));
        Elem<T>::store(drow + j, pbuf[j] * (dbuf[j] - delta) * scale);
      }
    }
  }
}

Rows make_rows(int64_t nh, int64_t M, int64_t kc, int64_t row0, int64_t head0, int64_t lse_hs,
               double scale, bool causal, uintptr_t pad, uint64_t seed, uint32_t t16, double keep_scale) {
  return Rows{nh, M, kc, row0, head0, lse_hs, scale, causal, as_ptr<const uint8_t>(pad), seed, t16, keep_scale};
}

void attention_softmax_fwd(int dtype, uintptr_t s, uintptr_t lse, int64_t nh, int64_t M, int64_t kc,
                           int64_t row0, int64_t head0, int64_t lse_hs, double scale, bool causal,
                           uintptr_t pad, uint64_t seed, uint32_t t16, double keep_scale) {
  const Rows g = make_rows(nh, M, kc, row0, head0, lse_hs, scale, causal, pad, seed, t16, keep_scale);
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    softmax_fwd_rows<T>(as_ptr<T>(s), as_ptr<float>(lse), g);
  });
}

void attention_softmax_bwd(int dtype, uintptr_t s, uintptr_t dp, uintptr_t lse, int64_t nh,
                           int64_t M, int64_t kc, int64_t row0, int64_t head0, int64_t lse_hs, double scale,
                           bool causal, uintptr_t pad, uint64_t seed, uint32_t t16, double keep_scale) {
  const Rows g = make_rows(nh, M, kc, row0, head0, lse_hs, scale, causal, pad, seed, t16, keep_scale);
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    softmax_bwd_rows<T>(as_ptr<T>(s), as_ptr<T>(dp), as_ptr<const float>(lse), g);
  });
}

}  // namespace

void register_attention(py::module_& m) {
  m.def("attention_softmax_fwd", &attention_softmax_fwd, py::arg("dtype"), py::arg("s"), py::arg("lse"),
        py::arg("nh"), py::arg("M"), py::arg("kc"), py::arg("row0"), py::arg("head0"), py::arg("lse_hs"),
        py::arg("scale"), py::arg("causal"), py::arg("pad"), py::arg("seed"), py::arg("t16"),
        py::arg("keep_scale"), py::call_guard<py::gil_scoped_release>());
  m.def("attention_softmax_bwd", &attention_softmax_bwd, py::arg("dtype"), py::arg("s"), py::arg("dp"),
        py::arg("lse"), py::arg("nh"), py::arg("M"), py::arg("kc"), py::arg("row0"),
        py::arg("head0"), py::arg("lse_hs"), py::arg("scale"), py::arg("causal"), py::arg("pad"),
        py::arg("seed"), py::arg("t16"), py::arg("keep_scale"), py::call_guard<py::gil_scoped_release>());
}

}  // namespace sckpt
