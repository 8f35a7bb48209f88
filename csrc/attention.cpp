// Blocked CPU attention: tiles of queries against tiles of keys, scores and every accumulation in
// fp32 (fp64 for float64 inputs), online softmax, dropout from the attention Philox stream, no
// Sq x Sk buffer. Forward and the dQ pass run one task per (batch, query head, query tile); the
// dK/dV pass one task per (batch, kv head, key tile), looping over the query heads of its group, so
// GQA never expands k/v and the group sum is taken in a fixed order (deterministic, no atomics).
//
// The tile kernels (the #else part at the end) are compiled three times, for baseline x86-64, for
// AVX2 + FMA and for AVX-512, by including this file into three namespaces; the entry points pick
// one at run time. The matrix products are register-blocked loops that GCC vectorises; no BLAS.
#ifndef SCKPT_ATTENTION_TILE_KERNELS
#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <pybind11/stl.h>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include "registry.h"
#include "dtypes.h"
#include "fastmath.h"
#include "philox.h"

namespace py = pybind11;

namespace sckpt {
namespace {

using Strides = std::array<int64_t, 3>;  // element strides of the (batch, head, row) dims

// Query and key tile sizes (rows), multiples of 16; attention_tiles changes them for tuning.
// 128 x 64 and 128 x 128 ran fastest in bench/attention.py --table (fp32 causal D=64, S 512-4096,
// 2 Zen 4 cores); 128 x 64 keeps the per-thread working set in L2 and wastes less on short documents.
// Atomic: calls release the GIL, so another thread may retune while one reads.
std::atomic<int64_t> g_block_q{128};
std::atomic<int64_t> g_block_k{64};

struct Problem {
  int64_t B, H, Hkv, Sq, Sk, D, G, Dp;  // G = H / Hkv query heads per kv head; Dp = D rounded to 16
  int64_t BM, BN;                       // tile sizes
  const void *q, *k, *v, *o_in, *dout;
  void *o, *dq, *dk, *dv;
  Strides qs, ks, vs, os;
  float* lse;             // [B, H, Sq]
  const float* lse_in;    // backward
  const float* delta;     // backward: rowsum(dO * O), [B, H, Sq]
  const uint8_t* pad;     // [B, Sk] (1 = attend) or null
  const int32_t* cu;      // [ndocs + 1] or null
  int64_t ndocs;
  bool causal;
  int64_t window;  // 0 = none
  double scale;
  PhiloxKey key{0};
  uint32_t t16;
  double keep_scale;

  // Keys query row i may attend before padding: [lo, hi). lo and hi never decrease with i, so a
  // tile of rows attends within [lo(first), hi(last)).
  void row_range(int64_t i, int64_t& lo, int64_t& hi) const {
    lo = 0;
    hi = Sk;
    if (cu != nullptr) {  // the document holding i: the last d < ndocs with cu[d] <= i
      int64_t a = 0, b = ndocs;
      while (b - a > 1) {
        const int64_t mid = (a + b) / 2;
        if (cu[mid] <= i) a = mid; else b = mid;
      }
      lo = cu[a];
      hi = cu[a + 1];
    }
    if (causal) hi = std::min(hi, i + 1);
    if (window > 0) lo = std::max(lo, i - window + 1);
    if (hi < lo) hi = lo;
  }
  int64_t row_lo(int64_t i) const { int64_t lo, hi; row_range(i, lo, hi); return lo; }
  int64_t row_hi(int64_t i) const { int64_t lo, hi; row_range(i, lo, hi); return hi; }

  // First query row in [0, Sq) for which pred holds (pred monotone: false ... false true ... true).
  template <class F>
  int64_t first_row(F pred) const {
    int64_t a = 0, b = Sq;
    while (a < b) {
      const int64_t mid = (a + b) / 2;
      if (pred(mid)) b = mid; else a = mid + 1;
    }
    return a;
  }
};

// Per-thread scratch, sized once per call.
template <class Acc>
struct Work {
  std::vector<Acc> a, b, c, d, e, f, g, acc, keep;
  std::vector<Acc> m, l, rowv, rowv2;
  std::vector<int64_t> lo, hi;
  std::vector<uint8_t> padv, seen;
  explicit Work(const Problem& p) {
    const int64_t T = std::max(p.BM, p.BN);
    const int64_t tile = T * std::max(T, p.Dp);  // a tile of scores or of rows
    for (auto* v : {&a, &b, &c, &d, &e, &f, &g}) v->assign(size_t(tile), Acc(0));
    acc.assign(size_t(3 * tile), Acc(0));  // dK/dV pass: dP^T, dK, dV
    keep.assign(size_t(p.BM * p.BN), Acc(1));
    for (auto* v : {&m, &l, &rowv, &rowv2}) v->assign(size_t(T), Acc(0));
    lo.assign(size_t(T), 0);
    hi.assign(size_t(T), 0);
    padv.assign(size_t(T), 1);
    seen.assign(size_t(T), 0);
  }
};

namespace generic {
#define SCKPT_ATT_FMA 0
#define SCKPT_ATT_VB 16
#define SCKPT_ATT_VFMA(a, b, c) ((a) * (b) + (c))
#define SCKPT_ATT_NR 16
#define SCKPT_ATT_MR 4
#define SCKPT_ATTENTION_TILE_KERNELS
#include "attention.cpp"  // NOLINT: the tile kernels below, baseline ISA
#undef SCKPT_ATTENTION_TILE_KERNELS
#undef SCKPT_ATT_FMA
#undef SCKPT_ATT_VB
#undef SCKPT_ATT_VFMA
#undef SCKPT_ATT_NR
#undef SCKPT_ATT_MR
}  // namespace generic

#if defined(__x86_64__) && defined(__GNUC__)
#define SCKPT_HAVE_X86_TILES 1
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
#define SCKPT_ATT_FMA 1
#define SCKPT_ATT_VB 32
#define SCKPT_ATT_VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define SCKPT_ATT_NR 16
#define SCKPT_ATT_MR 4
#define SCKPT_ATTENTION_TILE_KERNELS
#include "attention.cpp"  // NOLINT: the same kernels for AVX2 + FMA
#undef SCKPT_ATTENTION_TILE_KERNELS
#undef SCKPT_ATT_FMA
#undef SCKPT_ATT_VB
#undef SCKPT_ATT_VFMA
#undef SCKPT_ATT_NR
#undef SCKPT_ATT_MR
}  // namespace avx2
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
namespace avx512 {
#define SCKPT_ATT_FMA 1
#define SCKPT_ATT_VB 64
#define SCKPT_ATT_VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define SCKPT_ATT_NR 32
#define SCKPT_ATT_MR 8
#define SCKPT_ATTENTION_TILE_KERNELS
#include "attention.cpp"  // NOLINT: the same kernels for AVX-512 (32 registers, 16 floats wide)
#undef SCKPT_ATTENTION_TILE_KERNELS
#undef SCKPT_ATT_FMA
#undef SCKPT_ATT_VB
#undef SCKPT_ATT_VFMA
#undef SCKPT_ATT_NR
#undef SCKPT_ATT_MR
}  // namespace avx512
#pragma GCC pop_options
#endif

enum class Isa { generic, avx2, avx512 };

// The widest ISA this CPU runs.
Isa native_isa() {
#ifdef SCKPT_HAVE_X86_TILES
  static const Isa isa = [] {
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
      return Isa::avx512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
      return Isa::avx2;
    return Isa::generic;
  }();
  return isa;
#else
  return Isa::generic;
#endif
}

// The ISA the kernels run: the native one unless narrowed by attention_use_isa (so tests check
// every compiled variant on one machine).
std::atomic<int> g_isa{-1};
Isa best_isa() {
  const int chosen = g_isa.load();
  return chosen < 0 ? native_isa() : Isa(chosen);
}

#ifdef SCKPT_HAVE_X86_TILES
#define SCKPT_PICK(fn, T) \
  (best_isa() == Isa::avx512 ? &avx512::fn<T> : best_isa() == Isa::avx2 ? &avx2::fn<T> : &generic::fn<T>)
#else
#define SCKPT_PICK(fn, T) (&generic::fn<T>)
#endif

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

Problem make_problem(const std::array<int64_t, 6>& sizes, uintptr_t pad, uintptr_t cu, int64_t ndocs, bool causal,
                     int64_t window, double scale, uintptr_t seed, int64_t t16, double keep_scale) {
  Problem p{};
  p.B = sizes[0];
  p.H = sizes[1];
  p.Hkv = sizes[2];
  p.Sq = sizes[3];
  p.Sk = sizes[4];
  p.D = sizes[5];
  if (p.B < 0 || p.H < 1 || p.Hkv < 1 || p.H % p.Hkv != 0 || p.Sq < 0 || p.Sk < 0 || p.D < 1)
    throw std::invalid_argument("attention: bad sizes (need H % Hkv == 0, D >= 1)");
  if (t16 < 0 || t16 > 65535) throw std::invalid_argument("attention: t16 must be in [0, 65535]");
  if (cu != 0 && (p.B != 1 || p.Sq != p.Sk || ndocs < 1))
    throw std::invalid_argument("attention: cu_seqlens needs B == 1, Sq == Sk and at least one document");
  p.G = p.H / p.Hkv;
  p.Dp = ceil_div(p.D, 16) * 16;
  p.BM = g_block_q;
  p.BN = g_block_k;
  p.pad = as_ptr<const uint8_t>(pad);
  p.cu = as_ptr<const int32_t>(cu);
  p.ndocs = ndocs;
  p.causal = causal;
  p.window = std::max<int64_t>(window, 0);
  p.scale = scale;
  p.t16 = uint32_t(t16);
  p.keep_scale = keep_scale;
  if (t16 > 0) {  // the seed tensor is read only when dropout is on (it may be null otherwise)
    if (seed == 0) throw std::invalid_argument("attention: dropout needs a seed");
    p.key = PhiloxKey::from_tensor(seed);
  }
  return p;
}

// o, lse <- attention(q, k, v). sizes = (B, H, Hkv, Sq, Sk, D); strides of (batch, head, row).
void attention_forward(int dtype, std::array<int64_t, 6> sizes, uintptr_t q, Strides qs, uintptr_t k, Strides ks,
                       uintptr_t v, Strides vs, uintptr_t o, Strides os, uintptr_t lse, uintptr_t pad, uintptr_t cu,
                       int64_t ndocs, bool causal, int64_t window, double scale, uintptr_t seed, int64_t t16,
                       double keep_scale) {
  Problem p = make_problem(sizes, pad, cu, ndocs, causal, window, scale, seed, t16, keep_scale);
  p.q = as_ptr<const void>(q);
  p.k = as_ptr<const void>(k);
  p.v = as_ptr<const void>(v);
  p.o = as_ptr<void>(o);
  p.qs = qs;
  p.ks = ks;
  p.vs = vs;
  p.os = os;
  p.lse = as_ptr<float>(lse);
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    using Acc = typename Elem<T>::Acc;
    const auto tile_fn = SCKPT_PICK(forward_tile, T);
    const int64_t nqt = ceil_div(p.Sq, p.BM), tasks = p.B * p.H * nqt;
#pragma omp parallel if (tasks > 1)
    {
      Work<Acc> w(p);
      // Later query tiles attend more keys under a causal mask: hand them out first.
#pragma omp for schedule(dynamic, 1)
      for (int64_t task = 0; task < tasks; ++task) {
        const int64_t t = nqt - 1 - task / (p.B * p.H), bh = task % (p.B * p.H);
        tile_fn(p, bh / p.H, bh % p.H, t, w);
      }
    }
  });
}

// dq, dk, dv <- gradients of attention given do. do, dq, dk, dv are contiguous.
void attention_backward(int dtype, std::array<int64_t, 6> sizes, uintptr_t dout, uintptr_t q, Strides qs, uintptr_t k,
                        Strides ks, uintptr_t v, Strides vs, uintptr_t o, Strides os, uintptr_t lse, uintptr_t pad,
                        uintptr_t cu, int64_t ndocs, bool causal, int64_t window, double scale, uintptr_t seed,
                        int64_t t16, double keep_scale, uintptr_t dq, uintptr_t dk, uintptr_t dv) {
  Problem p = make_problem(sizes, pad, cu, ndocs, causal, window, scale, seed, t16, keep_scale);
  p.q = as_ptr<const void>(q);
  p.k = as_ptr<const void>(k);
  p.v = as_ptr<const void>(v);
  p.o_in = as_ptr<const void>(o);
  p.dout = as_ptr<const void>(dout);
  p.dq = as_ptr<void>(dq);
  p.dk = as_ptr<void>(dk);
  p.dv = as_ptr<void>(dv);
  p.qs = qs;
  p.ks = ks;
  p.vs = vs;
  p.os = os;
  p.lse_in = as_ptr<const float>(lse);
  std::vector<float> delta(size_t(p.B * p.H * p.Sq));
  p.delta = delta.data();
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    using Acc = typename Elem<T>::Acc;
    const auto delta_fn = SCKPT_PICK(delta_rows, T);
    const auto dq_fn = SCKPT_PICK(dq_tile, T);
    const auto dkv_fn = SCKPT_PICK(dkv_tile, T);
    const int64_t nqt = ceil_div(p.Sq, p.BM), nkt = ceil_div(p.Sk, p.BN);
    const int64_t qtasks = p.B * p.H * nqt, ktasks = p.B * p.Hkv * nkt;
#pragma omp parallel
    {
#pragma omp for schedule(static)
      for (int64_t bh = 0; bh < p.B * p.H; ++bh) delta_fn(p, bh, delta.data());
      Work<Acc> w(p);
#pragma omp for schedule(dynamic, 1)
      for (int64_t task = 0; task < qtasks; ++task) {
        const int64_t t = nqt - 1 - task / (p.B * p.H), bh = task % (p.B * p.H);
        dq_fn(p, bh / p.H, bh % p.H, t, w);
      }
      // Under a causal mask the first key tiles are attended by the most queries: first out.
#pragma omp for schedule(dynamic, 1)
      for (int64_t task = 0; task < ktasks; ++task) {
        const int64_t t = task / (p.B * p.Hkv), bh = task % (p.B * p.Hkv);
        dkv_fn(p, bh / p.Hkv, bh % p.Hkv, t, w);
      }
    }
  });
}

// Sets the query and key tile sizes (multiples of 16 in [16, 512]); returns the previous ones.
std::pair<int64_t, int64_t> attention_tiles(int64_t block_q, int64_t block_k) {
  for (int64_t b : {block_q, block_k})
    if (b < 16 || b > 512 || b % 16 != 0) throw std::invalid_argument("attention tiles must be multiples of 16 in [16, 512]");
  return {g_block_q.exchange(block_q), g_block_k.exchange(block_k)};
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::avx512: return "avx512";
    case Isa::avx2: return "avx2";
    default: return "generic";
  }
}

const char* attention_isa() { return isa_name(best_isa()); }

// Runs the kernels compiled for `name` ("generic", "avx2", "avx512", or "native" to undo), which
// this CPU must support; returns the previous choice.
std::string attention_use_isa(const std::string& name) {
  const std::string old = g_isa.load() < 0 ? "native" : isa_name(best_isa());
  int chosen;
  if (name == "native") chosen = -1;
  else if (name == "generic") chosen = int(Isa::generic);
  else if (name == "avx2") chosen = int(Isa::avx2);
  else if (name == "avx512") chosen = int(Isa::avx512);
  else throw std::invalid_argument("attention ISA must be native, generic, avx2 or avx512");
  if (chosen > int(native_isa())) throw std::invalid_argument("this CPU does not run attention ISA " + name);
  g_isa.store(chosen);
  return old;
}

void register_attention(py::module_& m) {
  m.def("attention_forward", &attention_forward, py::arg("dtype"), py::arg("sizes"), py::arg("q"), py::arg("q_strides"),
        py::arg("k"), py::arg("k_strides"), py::arg("v"), py::arg("v_strides"), py::arg("o"), py::arg("o_strides"),
        py::arg("lse"), py::arg("key_padding_mask"), py::arg("cu_seqlens"), py::arg("n_docs"), py::arg("causal"),
        py::arg("window"), py::arg("scale"), py::arg("seed"), py::arg("t16"), py::arg("keep_scale"),
        py::call_guard<py::gil_scoped_release>());
  m.def("attention_backward", &attention_backward, py::arg("dtype"), py::arg("sizes"), py::arg("do"), py::arg("q"),
        py::arg("q_strides"), py::arg("k"), py::arg("k_strides"), py::arg("v"), py::arg("v_strides"), py::arg("o"),
        py::arg("o_strides"), py::arg("lse"), py::arg("key_padding_mask"), py::arg("cu_seqlens"), py::arg("n_docs"),
        py::arg("causal"), py::arg("window"), py::arg("scale"), py::arg("seed"), py::arg("t16"),
        py::arg("keep_scale"), py::arg("dq"), py::arg("dk"), py::arg("dv"), py::call_guard<py::gil_scoped_release>());
  m.def("attention_tiles", &attention_tiles, py::arg("block_q"), py::arg("block_k"));
  m.def("attention_isa", &attention_isa);
  m.def("attention_use_isa", &attention_use_isa, py::arg("name"));
}

SCKPT_REGISTER(register_attention);

}  // namespace
}  // namespace sckpt

#else  // SCKPT_ATTENTION_TILE_KERNELS: the tile kernels, included once per ISA above

constexpr int kMR = SCKPT_ATT_MR;  // rows of a register block
constexpr int kNR = SCKPT_ATT_NR;  // columns of a register block (one or two vectors)

template <class Acc>
inline Acc madd(Acc a, Acc b, Acc c) {
#if SCKPT_ATT_FMA
  return __builtin_fma(a, b, c);
#else
  return a * b + c;
#endif
}
template <>
inline float madd<float>(float a, float b, float c) {
#if SCKPT_ATT_FMA
  return __builtin_fmaf(a, b, c);
#else
  return a * b + c;
#endif
}

// exp that keeps NaN (fast_expf clamps it like a large number): a NaN score must poison its row.
inline float exp_nan(float x) {
  const float e = fast_expf(x);
  uint32_t xb, eb;
  std::memcpy(&xb, &x, 4);
  std::memcpy(&eb, &e, 4);
  const uint32_t nan = 0u - uint32_t((xb & 0x7fffffffu) > 0x7f800000u);
  eb = (eb & ~nan) | (xb & nan);
  float r;
  std::memcpy(&r, &eb, 4);
  return r;
}
inline double exp_nan(double x) { return std::exp(x); }

// v if on, else -inf, by bit blending (vectorises without float compares).
inline float or_neg_inf(bool on, float v) {
  uint32_t b;
  std::memcpy(&b, &v, 4);
  const uint32_t mask = 0u - uint32_t(on);
  b = (b & mask) | (0xff800000u & ~mask);
  float r;
  std::memcpy(&r, &b, 4);
  return r;
}
inline double or_neg_inf(bool on, double v) { return on ? v : -std::numeric_limits<double>::infinity(); }

// v if on, else +0 (also when v is NaN: a masked entry contributes nothing).
inline float or_zero(bool on, float v) {
  uint32_t b;
  std::memcpy(&b, &v, 4);
  b &= 0u - uint32_t(on);
  float r;
  std::memcpy(&r, &b, 4);
  return r;
}
inline double or_zero(bool on, double v) { return on ? v : 0.0; }

// One register block: C[MR x NR] (+)= A[MR x K] B[K x NR]; B row-major (ldb). A is row-major
// (element (r, k) at a[r * lda + k]) or, with TA, stored transposed (at a[k * lda + r]): A is only
// ever read one broadcast scalar at a time, so a transposed score tile costs nothing extra.
template <class Acc, int NR, bool TA>
inline void gemm_block(const Acc* __restrict a, int64_t lda, const Acc* __restrict b, int64_t ldb, int64_t K,
                       Acc* __restrict c, int64_t ldc, bool accumulate) {
  Acc acc[kMR][NR];
  for (int r = 0; r < kMR; ++r)
    for (int n = 0; n < NR; ++n) acc[r][n] = accumulate ? c[r * ldc + n] : Acc(0);
  for (int64_t kk = 0; kk < K; ++kk) {
    const Acc* bk = b + kk * ldb;
    for (int r = 0; r < kMR; ++r) {
      const Acc ar = TA ? a[kk * lda + r] : a[r * lda + kk];
      for (int n = 0; n < NR; ++n) acc[r][n] = madd(ar, bk[n], acc[r][n]);
    }
  }
  for (int r = 0; r < kMR; ++r)
    for (int n = 0; n < NR; ++n) c[r * ldc + n] = acc[r][n];
}

// The float block with explicit vectors of this ISA's width: left to itself GCC vectorises the
// 16-column AVX2 block along K with shuffles and spills, ten times slower than this.
// Unaligned and may alias float rows; loads and stores through it are single vector moves.
typedef float VecF __attribute__((vector_size(SCKPT_ATT_VB), aligned(4), may_alias));
constexpr int kVecW = SCKPT_ATT_VB / 4;

inline VecF load_vec(const float* p) { return *reinterpret_cast<const VecF*>(p); }
inline void store_vec(float* p, VecF v) { *reinterpret_cast<VecF*>(p) = v; }
inline VecF splat(float x) { return x - VecF{}; }  // x - 0 is exactly x: a pure broadcast

template <int NR, bool TA>
inline void gemm_block_vec(const float* __restrict a, int64_t lda, const float* __restrict b, int64_t ldb, int64_t K,
                           float* __restrict c, int64_t ldc, bool accumulate) {
  constexpr int NV = NR / kVecW;
  VecF acc[kMR][NV];
  for (int r = 0; r < kMR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = accumulate ? load_vec(c + r * ldc + v * kVecW) : splat(0.0f);
  for (int64_t kk = 0; kk < K; ++kk) {
    VecF bv[NV];
    for (int v = 0; v < NV; ++v) bv[v] = load_vec(b + kk * ldb + v * kVecW);
    for (int r = 0; r < kMR; ++r) {
      const VecF av = splat(TA ? a[kk * lda + r] : a[r * lda + kk]);
      for (int v = 0; v < NV; ++v) acc[r][v] = SCKPT_ATT_VFMA(av, bv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < kMR; ++r)
    for (int v = 0; v < NV; ++v) store_vec(c + r * ldc + v * kVecW, acc[r][v]);
}

template <class Acc, int NR, bool TA>
inline void gemm_any(const Acc* a, int64_t lda, const Acc* b, int64_t ldb, int64_t K, Acc* c, int64_t ldc,
                     bool accumulate) {
  if constexpr (std::is_same_v<Acc, float> && NR % kVecW == 0)
    gemm_block_vec<NR, TA>(a, lda, b, ldb, K, c, ldc, accumulate);
  else
    gemm_block<Acc, NR, TA>(a, lda, b, ldb, K, c, ldc, accumulate);
}

// C[M x N] (+)= A[M x K] B[K x N], M a multiple of kMR, N of 16. Column panels of B outer, so a
// K x NR panel of B stays in L1 while the row blocks of A stream past it.
template <bool TA = false, class Acc>
void gemm(const Acc* a, int64_t lda, const Acc* b, int64_t ldb, int64_t M, int64_t N, int64_t K, Acc* c,
          int64_t ldc, bool accumulate) {
  const auto arow = [&](int64_t i) { return TA ? a + i : a + i * lda; };
  int64_t n = 0;
  for (; n + kNR <= N; n += kNR)
    for (int64_t i = 0; i < M; i += kMR)
      gemm_any<Acc, kNR, TA>(arow(i), lda, b + n, ldb, K, c + i * ldc + n, ldc, accumulate);
  for (; n < N; n += 16)
    for (int64_t i = 0; i < M; i += kMR)
      gemm_any<Acc, 16, TA>(arow(i), lda, b + n, ldb, K, c + i * ldc + n, ldc, accumulate);
}

// out[r, 0:Dp] = rows r < n of x (row stride `stride`), zero past D and for rows n..nr.
template <class T, class Acc>
inline void load_rows(const T* x, int64_t stride, int64_t n, int64_t nr, int64_t D, int64_t Dp, Acc* out) {
  for (int64_t r = 0; r < n; ++r) {
    const T* xr = x + r * stride;
    Acc* o = out + r * Dp;
    for (int64_t d = 0; d < D; ++d) o[d] = Acc(Elem<T>::load(xr + d));
    for (int64_t d = D; d < Dp; ++d) o[d] = Acc(0);
  }
  std::memset(static_cast<void*>(out + n * Dp), 0, size_t((nr - n) * Dp) * sizeof(Acc));
}

// out[d, r] = x[r, d] for r < n, zero for columns n..ld (the transposed tile, B operand of S = A X^T).
template <class T, class Acc>
inline void load_rows_t(const T* x, int64_t stride, int64_t n, int64_t ld, int64_t D, Acc* out) {
  for (int64_t d = 0; d < D; ++d)
    for (int64_t r = n; r < ld; ++r) out[d * ld + r] = Acc(0);
  for (int64_t r = 0; r < n; ++r) {
    const T* xr = x + r * stride;
    for (int64_t d = 0; d < D; ++d) out[d * ld + r] = Acc(Elem<T>::load(xr + d));
  }
}

template <class Acc>
inline Acc row_max(const Acc* x, int64_t n) {  // ignores NaN (the exp keeps it)
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
inline Acc row_sum(const Acc* x, int64_t n) {
  Acc a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    for (int t = 0; t < 8; ++t) a[t] += x[j + t];
  for (; j < n; ++j) a[0] += x[j];
  return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

inline int64_t round_up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

// padv[c] = key j0 + c may be attended under the padding mask (c < nk), 0 past nk up to ncols.
inline void pad_row(const Problem& p, int64_t b, int64_t j0, int64_t nk, int64_t ncols, uint8_t* padv) {
  for (int64_t c = 0; c < nk; ++c) padv[c] = p.pad ? uint8_t(p.pad[b * p.Sk + j0 + c] != 0) : uint8_t(1);
  for (int64_t c = nk; c < ncols; ++c) padv[c] = 0;
}

// keep[c] = keep_scale if P[b, h, i, j0 + c] survives dropout else 0, for c in [a, e).
template <class Acc>
inline void keep_row(const Problem& p, int64_t bh, int64_t i, int64_t j0, int64_t a, int64_t e, Acc* keep) {
  const Acc ks = Acc(p.keep_scale);
  for (int64_t g = (j0 + a) >> 3; g <= (j0 + e - 1) >> 3; ++g) {
    const uint32_t bits = attention_keep_bits8(p.key, uint64_t(g), uint64_t(i), uint64_t(bh), p.t16);
    for (int t = 0; t < 8; ++t) {
      const int64_t c = g * 8 + t - j0;
      if (c >= a && c < e) keep[c] = ((bits >> t) & 1u) ? ks : Acc(0);
    }
  }
}

// keep[r * ld + c] = keep_scale if P[b, h, i0 + c, j0 + r] survives dropout else 0, for the keys
// r in [a_c, e_c) each query column c < n attends (one Philox call per 8 keys).
template <class Acc>
inline void keep_cols(const Problem& p, int64_t bh, int64_t i0, int64_t n, int64_t j0, int64_t nk,
                      const int64_t* lo, const int64_t* hi, int64_t ld, Acc* keep) {
  const Acc ks = Acc(p.keep_scale);
  for (int64_t c = 0; c < n; ++c) {
    const int64_t a = std::clamp(lo[c] - j0, int64_t(0), nk), e = std::clamp(hi[c] - j0, int64_t(0), nk);
    for (int64_t grp = (j0 + a) >> 3; a < e && grp <= (j0 + e - 1) >> 3; ++grp) {
      const uint32_t bits = attention_keep_bits8(p.key, uint64_t(grp), uint64_t(i0 + c), uint64_t(bh), p.t16);
      for (int t = 0; t < 8; ++t) {
        const int64_t r = grp * 8 + t - j0;
        if (r >= a && r < e) keep[r * ld + c] = ((bits >> t) & 1u) ? ks : Acc(0);
      }
    }
  }
}

// Query rows i0 .. i0 + n: ranges, lse, delta per column c (columns n..N attend nothing).
template <class Acc>
inline bool query_cols(const Problem& p, int64_t bh, int64_t i0, int64_t n, int64_t N, bool with_lse, int64_t* lo,
                       int64_t* hi, Acc* lse, Acc* delta) {
  bool any = false;
  for (int64_t c = 0; c < N; ++c) {
    if (c < n) {
      p.row_range(i0 + c, lo[c], hi[c]);
      if (with_lse) {
        lse[c] = Acc(p.lse_in[bh * p.Sq + i0 + c]);
        delta[c] = Acc(p.delta[bh * p.Sq + i0 + c]);
        if (lse[c] == std::numeric_limits<Acc>::infinity()) hi[c] = lo[c];  // an empty row: zero gradient
      }
    } else {
      lo[c] = hi[c] = 0;
      if (with_lse) lse[c] = delta[c] = Acc(0);
    }
    any |= lo[c] < hi[c];
  }
  return any;
}

// Does every query column c < n attend every key in [j0, j1) (no padding mask)? Then the tile
// needs no masking: columns past n hold garbage that is never stored.
inline bool tile_full(const Problem& p, const int64_t* lo, const int64_t* hi, int64_t n, int64_t j0, int64_t j1) {
  if (p.pad != nullptr) return false;
  bool full = true;
  for (int64_t c = 0; c < n; ++c) full &= lo[c] <= j0 && hi[c] >= j1;
  return full;
}

// Does any of the query columns attend a key in [j0, j1)?
inline bool tile_attended(const int64_t* lo, const int64_t* hi, int64_t n, int64_t j0, int64_t j1) {
  bool any = false;
  for (int64_t c = 0; c < n; ++c) any |= lo[c] < j1 && hi[c] > j0 && lo[c] < hi[c];
  return any;
}

// One query tile of one head: online softmax over the key tiles it may attend. Scores are held
// transposed, S^T[key, query] = K Q^T, so Q is transposed once per tile, K and V are read as rows,
// and the softmax statistics of all queries update as vectors across the tile.
template <class T>
void forward_tile(const Problem& p, int64_t b, int64_t h, int64_t t, Work<typename Elem<T>::Acc>& w) {
  using Acc = typename Elem<T>::Acc;
  const int64_t D = p.D, Dp = p.Dp, BN = p.BN, kvh = h / p.G, bh = b * p.H + h;
  const int64_t i0 = t * p.BM, n = std::min(p.BM, p.Sq - i0), M = round_up(n, kMR), N = round_up(n, 16);
  const Acc scale = Acc(p.scale), neg_inf = -std::numeric_limits<Acc>::infinity();
  Acc *Qt = w.a.data(), *Kn = w.b.data(), *V = w.c.data(), *St = w.d.data(), *O = w.acc.data();
  Acc *m = w.m.data(), *l = w.l.data(), *tmax = w.rowv.data(), *shift = w.rowv2.data(), *keep = w.keep.data();
  Acc *alpha = w.e.data(), *lsum = w.f.data();
  int64_t *lo = w.lo.data(), *hi = w.hi.data();
  uint8_t *padv = w.padv.data(), *seen = w.seen.data();

  load_rows_t(static_cast<const T*>(p.q) + b * p.qs[0] + h * p.qs[1] + i0 * p.qs[2], p.qs[2], n, N, D, Qt);
  query_cols<Acc>(p, bh, i0, n, N, false, lo, hi, nullptr, nullptr);
  for (int64_t c = 0; c < N; ++c) {
    m[c] = neg_inf;
    l[c] = Acc(0);
    seen[c] = 0;
  }
  std::memset(static_cast<void*>(O), 0, size_t(M * Dp) * sizeof(Acc));
  const T* kb = static_cast<const T*>(p.k) + b * p.ks[0] + kvh * p.ks[1];
  const T* vb = static_cast<const T*>(p.v) + b * p.vs[0] + kvh * p.vs[1];
  for (int64_t j0 = lo[0] / BN * BN; j0 < hi[n - 1]; j0 += BN) {
    const int64_t nk = std::min(BN, p.Sk - j0), MK = round_up(nk, kMR);
    if (!tile_attended(lo, hi, n, j0, j0 + nk)) continue;  // e.g. a tile of another document
    load_rows(kb + j0 * p.ks[2], p.ks[2], nk, MK, D, Dp, Kn);
    load_rows(vb + j0 * p.vs[2], p.vs[2], nk, nk, D, Dp, V);
    pad_row(p, b, j0, nk, nk, padv);
    gemm(Kn, Dp, Qt, N, MK, N, D, St, N, false);
    for (int64_t c = 0; c < N; ++c) {
      tmax[c] = neg_inf;
      lsum[c] = Acc(0);
    }
    if (tile_full(p, lo, hi, n, j0, j0 + nk)) {
      for (int64_t c = 0; c < n; ++c) seen[c] = 1;
      for (int64_t r = 0; r < nk; ++r) {
        Acc* s = St + r * N;
        for (int64_t c = 0; c < N; ++c) {
          s[c] *= scale;
          tmax[c] = __builtin_isgreater(s[c], tmax[c]) ? s[c] : tmax[c];
        }
      }
    } else {
      for (int64_t r = 0; r < nk; ++r) {
        Acc* s = St + r * N;
        const int64_t j = j0 + r;
        const bool pj = padv[r] != 0;
        for (int64_t c = 0; c < N; ++c) {
          const bool on = pj & (j >= lo[c]) & (j < hi[c]);
          seen[c] |= uint8_t(on);
          s[c] = or_neg_inf(on, s[c] * scale);
          tmax[c] = __builtin_isgreater(s[c], tmax[c]) ? s[c] : tmax[c];
        }
      }
    }
    for (int64_t c = 0; c < N; ++c) {
      const Acc mn = __builtin_isgreater(tmax[c], m[c]) ? tmax[c] : m[c];
      shift[c] = mn == neg_inf ? Acc(0) : mn;  // all -inf so far: keep the exps finite
      alpha[c] = exp_nan(m[c] - shift[c]);
      m[c] = mn;
    }
    for (int64_t r = 0; r < nk; ++r) {
      Acc* s = St + r * N;
      for (int64_t c = 0; c < N; ++c) {
        s[c] = exp_nan(s[c] - shift[c]);
        lsum[c] += s[c];
      }
    }
    for (int64_t c = 0; c < n; ++c) {
      l[c] = l[c] * alpha[c] + lsum[c];
      if (!(alpha[c] == Acc(1))) {  // also for NaN, which must reach O
        Acc* orow = O + c * Dp;
        for (int64_t d = 0; d < Dp; ++d) orow[d] *= alpha[c];
      }
    }
    if (p.t16) {
      keep_cols(p, bh, i0, n, j0, nk, lo, hi, N, keep);
      for (int64_t c = 0; c < n; ++c) {
        const int64_t a = std::clamp(lo[c] - j0, int64_t(0), nk), e = std::clamp(hi[c] - j0, int64_t(0), nk);
        for (int64_t r = a; r < e; ++r) St[r * N + c] *= keep[r * N + c];
      }
    }
    gemm<true>(St, N, V, Dp, M, Dp, nk, O, Dp, true);  // O += P V, P read from S^T
  }
  T* ob = static_cast<T*>(p.o) + b * p.os[0] + h * p.os[1];
  float* lse = p.lse + bh * p.Sq;
  for (int64_t r = 0; r < n; ++r) {
    T* orow = ob + (i0 + r) * p.os[2];
    if (!seen[r]) {  // nothing to attend: o = 0; lse = +inf makes P = 0 in backward
      for (int64_t d = 0; d < D; ++d) Elem<T>::store(orow + d, Acc(0));
      lse[i0 + r] = std::numeric_limits<float>::infinity();
      continue;
    }
    const Acc inv = Acc(1) / l[r];
    const Acc* acc = O + r * Dp;
    for (int64_t d = 0; d < D; ++d) Elem<T>::store(orow + d, acc[d] * inv);
    lse[i0 + r] = float((m[r] == neg_inf ? Acc(0) : m[r]) + std::log(l[r]));
  }
}

// delta[b, h, i] = sum_d dO * O in Acc (O as stored, so it includes the dropout).
template <class T>
void delta_rows(const Problem& p, int64_t bh, float* delta) {
  using Acc = typename Elem<T>::Acc;
  const int64_t b = bh / p.H, h = bh % p.H;
  const T* ob = static_cast<const T*>(p.o_in) + b * p.os[0] + h * p.os[1];
  const T* db = static_cast<const T*>(p.dout) + bh * p.Sq * p.D;
  for (int64_t i = 0; i < p.Sq; ++i) {
    const T *orow = ob + i * p.os[2], *drow = db + i * p.D;
    Acc s = 0;
    for (int64_t d = 0; d < p.D; ++d) s = madd(Acc(Elem<T>::load(orow + d)), Acc(Elem<T>::load(drow + d)), s);
    delta[bh * p.Sq + i] = float(s);
  }
}

// dQ of one query tile of one head: dQ = scale * sum over key tiles of dS K. Like the forward,
// S^T and dP^T are formed key-major from Q^T and dO^T, transposed once per tile.
template <class T>
void dq_tile(const Problem& p, int64_t b, int64_t h, int64_t t, Work<typename Elem<T>::Acc>& w) {
  using Acc = typename Elem<T>::Acc;
  const int64_t D = p.D, Dp = p.Dp, BN = p.BN, kvh = h / p.G, bh = b * p.H + h;
  const int64_t i0 = t * p.BM, n = std::min(p.BM, p.Sq - i0), M = round_up(n, kMR), N = round_up(n, 16);
  const Acc scale = Acc(p.scale);
  Acc *Qt = w.a.data(), *dOt = w.b.data(), *Kn = w.c.data(), *Vn = w.d.data();
  Acc *St = w.f.data(), *dPt = w.g.data(), *dQ = w.acc.data(), *keep = w.keep.data();
  Acc *lse = w.m.data(), *delta = w.l.data();
  int64_t *lo = w.lo.data(), *hi = w.hi.data();
  uint8_t* padv = w.padv.data();

  std::memset(static_cast<void*>(dQ), 0, size_t(M * Dp) * sizeof(Acc));
  const bool any_row = query_cols(p, bh, i0, n, N, true, lo, hi, lse, delta);
  int64_t klo = p.Sk, khi = 0;
  for (int64_t c = 0; c < n; ++c)
    if (lo[c] < hi[c]) klo = std::min(klo, lo[c]), khi = std::max(khi, hi[c]);
  if (any_row) {
    load_rows_t(static_cast<const T*>(p.q) + b * p.qs[0] + h * p.qs[1] + i0 * p.qs[2], p.qs[2], n, N, D, Qt);
    load_rows_t(static_cast<const T*>(p.dout) + (bh * p.Sq + i0) * D, D, n, N, D, dOt);
  }
  const T* kb = static_cast<const T*>(p.k) + b * p.ks[0] + kvh * p.ks[1];
  const T* vb = static_cast<const T*>(p.v) + b * p.vs[0] + kvh * p.vs[1];
  for (int64_t j0 = any_row ? klo / BN * BN : khi; j0 < khi; j0 += BN) {
    const int64_t nk = std::min(BN, p.Sk - j0), MK = round_up(nk, kMR);
    if (!tile_attended(lo, hi, n, j0, j0 + nk)) continue;
    load_rows(kb + j0 * p.ks[2], p.ks[2], nk, MK, D, Dp, Kn);
    load_rows(vb + j0 * p.vs[2], p.vs[2], nk, MK, D, Dp, Vn);
    pad_row(p, b, j0, nk, nk, padv);
    gemm(Kn, Dp, Qt, N, MK, N, D, St, N, false);   // S^T = K Q^T
    gemm(Vn, Dp, dOt, N, MK, N, D, dPt, N, false);  // dP^T = V dO^T
    if (p.t16) keep_cols(p, bh, i0, n, j0, nk, lo, hi, N, keep);
    if (!p.t16 && tile_full(p, lo, hi, n, j0, j0 + nk)) {
      for (int64_t r = 0; r < nk; ++r) {
        Acc *s = St + r * N, *dp = dPt + r * N;
        for (int64_t c = 0; c < N; ++c) dp[c] = exp_nan(s[c] * scale - lse[c]) * (dp[c] - delta[c]);
      }
    } else {
      for (int64_t r = 0; r < nk; ++r) {
        Acc *s = St + r * N, *dp = dPt + r * N;
        const int64_t j = j0 + r;
        const bool pj = padv[r] != 0;
        const Acc* kr = keep + r * N;
        for (int64_t c = 0; c < N; ++c) {
          const bool on = pj & (j >= lo[c]) & (j < hi[c]);
          const Acc pr = exp_nan(or_neg_inf(on, s[c] * scale - lse[c]));
          const Acc kf = p.t16 ? kr[c] : Acc(1);
          dp[c] = or_zero(on, pr * (dp[c] * kf - delta[c]));
        }
      }
    }
    gemm<true>(dPt, N, Kn, Dp, M, Dp, nk, dQ, Dp, true);  // dQ += dS K, dS read from dS^T
  }
  T* out = static_cast<T*>(p.dq) + (bh * p.Sq + i0) * D;
  for (int64_t r = 0; r < n; ++r)
    for (int64_t d = 0; d < D; ++d) Elem<T>::store(out + r * D + d, dQ[r * Dp + d] * scale);
}

// dK, dV of one key tile of one kv head, summed over the query heads of its group in order. K^T
// and V^T are transposed once per task; the query tiles are read as rows.
template <class T>
void dkv_tile(const Problem& p, int64_t b, int64_t kvh, int64_t t, Work<typename Elem<T>::Acc>& w) {
  using Acc = typename Elem<T>::Acc;
  const int64_t D = p.D, Dp = p.Dp, BM = p.BM;
  const int64_t j0 = t * p.BN, nk = std::min(p.BN, p.Sk - j0), j1 = j0 + nk;
  const int64_t MK = round_up(nk, kMR), NK = round_up(nk, 16);
  const Acc scale = Acc(p.scale), inf = std::numeric_limits<Acc>::infinity();
  Acc *Kt = w.a.data(), *Vt = w.b.data(), *Qn = w.c.data(), *dOn = w.d.data();
  Acc *S = w.e.data(), *dP = w.f.data(), *keep = w.keep.data();
  const int64_t tile = int64_t(w.acc.size() / 3);
  Acc *dK = w.acc.data(), *dV = dK + tile;
  int64_t *lo = w.lo.data(), *hi = w.hi.data();
  uint8_t* padv = w.padv.data();

  const T* kb = static_cast<const T*>(p.k) + b * p.ks[0] + kvh * p.ks[1] + j0 * p.ks[2];
  const T* vb = static_cast<const T*>(p.v) + b * p.vs[0] + kvh * p.vs[1] + j0 * p.vs[2];
  load_rows_t(kb, p.ks[2], nk, NK, D, Kt);
  load_rows_t(vb, p.vs[2], nk, NK, D, Vt);
  pad_row(p, b, j0, nk, NK, padv);
  std::memset(static_cast<void*>(dK), 0, size_t(MK * Dp) * sizeof(Acc));
  std::memset(static_cast<void*>(dV), 0, size_t(MK * Dp) * sizeof(Acc));
  // Query rows attending a key in [j0, j1): hi(i) > j0 and lo(i) < j1, a contiguous range.
  const int64_t ia = p.first_row([&](int64_t i) { return p.row_hi(i) > j0; });
  const int64_t ib = p.first_row([&](int64_t i) { return p.row_lo(i) >= j1; });
  for (int64_t g = 0; g < p.G; ++g) {
    const int64_t h = kvh * p.G + g, bh = b * p.H + h;
    const T* qb = static_cast<const T*>(p.q) + b * p.qs[0] + h * p.qs[1];
    const T* db = static_cast<const T*>(p.dout) + bh * p.Sq * D;
    for (int64_t i0 = ia / BM * BM; i0 < ib; i0 += BM) {
      const int64_t n = std::min(BM, p.Sq - i0), M = round_up(n, kMR);
      bool any = false;
      for (int64_t r = 0; r < n; ++r) {
        p.row_range(i0 + r, lo[r], hi[r]);
        if (p.lse_in[bh * p.Sq + i0 + r] == std::numeric_limits<float>::infinity()) hi[r] = lo[r];
        any |= lo[r] < j1 && hi[r] > j0 && lo[r] < hi[r];
      }
      if (!any) continue;
      load_rows(qb + i0 * p.qs[2], p.qs[2], n, M, D, Dp, Qn);
      load_rows(db + i0 * D, D, n, M, D, Dp, dOn);
      gemm(Qn, Dp, Kt, NK, M, NK, D, S, NK, false);    // S = Q K^T
      gemm(dOn, Dp, Vt, NK, M, NK, D, dP, NK, false);  // dP = dO V^T
      for (int64_t r = 0; r < n; ++r) {
        Acc *s = S + r * NK, *dp = dP + r * NK;
        const int64_t a = std::clamp(lo[r] - j0, int64_t(0), nk), e = std::clamp(hi[r] - j0, int64_t(0), nk);
        const Acc lr = Acc(p.lse_in[bh * p.Sq + i0 + r]), dr = Acc(p.delta[bh * p.Sq + i0 + r]);
        if (a >= e || lr == inf) {
          std::memset(static_cast<void*>(s), 0, size_t(NK) * sizeof(Acc));
          std::memset(static_cast<void*>(dp), 0, size_t(NK) * sizeof(Acc));
          continue;
        }
        if (!p.t16 && p.pad == nullptr && a == 0 && e == nk) {  // the row attends the whole tile
          for (int64_t c = 0; c < NK; ++c) {  // columns past nk feed only rows never stored
            const Acc pr = exp_nan(s[c] * scale - lr);
            dp[c] = pr * (dp[c] - dr);
            s[c] = pr;
          }
          continue;
        }
        if (p.t16) {
          keep_row(p, bh, i0 + r, j0, a, e, keep);
          for (int64_t c = a; c < e; ++c) dp[c] *= keep[c];
        }
        for (int64_t c = 0; c < NK; ++c) {
          const bool on = (c >= a) & (c < e) & (padv[c] != 0);
          const Acc pr = exp_nan(or_neg_inf(on, s[c] * scale - lr));
          dp[c] = or_zero(on, pr * (dp[c] - dr));
          s[c] = or_zero(on, pr);
        }
        if (p.t16)
          for (int64_t c = a; c < e; ++c) s[c] *= keep[c];
      }
      gemm<true>(S, NK, dOn, Dp, MK, Dp, n, dV, Dp, true);  // dV += P~^T dO
      gemm<true>(dP, NK, Qn, Dp, MK, Dp, n, dK, Dp, true);  // dK += dS^T Q
    }
  }
  T* dkb = static_cast<T*>(p.dk) + ((b * p.Hkv + kvh) * p.Sk + j0) * D;
  T* dvb = static_cast<T*>(p.dv) + ((b * p.Hkv + kvh) * p.Sk + j0) * D;
  for (int64_t r = 0; r < nk; ++r)
    for (int64_t d = 0; d < D; ++d) {
      Elem<T>::store(dkb + r * D + d, dK[r * Dp + d] * scale);
      Elem<T>::store(dvb + r * D + d, dV[r * Dp + d]);
    }
}

#endif  // SCKPT_ATTENTION_TILE_KERNELS
