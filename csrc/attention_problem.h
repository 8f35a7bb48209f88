// The geometry of one attention call (sizes, strides, masks, dropout) and the per-thread tile
// scratch, shared by the entry points (attention.cpp) and every ISA's tile kernels.
#pragma once
#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

#include "philox.h"

namespace sckpt {
namespace {

using Strides = std::array<int64_t, 3>;  // element strides of the (batch, head, row) dims

struct Problem {
  int64_t B, H, Hkv, Sq, Sk, D, G, Dp;  // G = H / Hkv query heads per kv head; Dp = D rounded to 16
  int64_t Dv, Dvp;  // the value head dim (of v, o, dO, dV; MLA's differs from q and k's D), Dvp rounded to 16
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
  int64_t q_offset = 0;  // query row i stands at key position i + q_offset (a tile of a longer query)
  double scale;
  double softcap;  // 0 = none; else scores are softcap * tanh(scale * q.k / softcap)
  const float* sinks = nullptr;  // [H] or null: a per-head logit in each row's softmax denominator
  float* dsinks = nullptr;       // backward, with sinks: [H], summed over the batch
  double* sink_part = nullptr;   // backward, with sinks: the dQ tiles' shares, [chunks, B * H, query tiles]
  PhiloxKey key{0};
  uint32_t t16;
  double keep_scale;
  bool bf16_dot = false;  // bf16 tiles multiply in bf16 pairs (the AVX512_BF16 kernels)
  bool single_pass = false;  // backward: one pass per (batch, kv head), dK/dV accumulated per task
  int64_t chunks = 1;        // the single pass's key chunks per kv head (their partial dQ sum after)
  void* dq_part = nullptr;   // [chunks, B * H * Sq, Dp] partial dQ in Acc when chunks > 1

  // Keys query row i may attend before padding: [lo, hi). lo and hi never decrease with i, so a
  // tile of rows attends within [lo(first), hi(last)). Masks are measured at the row's key
  // position g = i + q_offset.
  void row_range(int64_t i, int64_t& lo, int64_t& hi) const {
    const int64_t g = i + q_offset;
    lo = 0;
    hi = Sk;
    if (cu != nullptr) {  // the document holding g: the last d < ndocs with cu[d] <= g
      int64_t a = 0, b = ndocs;
      while (b - a > 1) {
        const int64_t mid = (a + b) / 2;
        if (cu[mid] <= g) a = mid; else b = mid;
      }
      lo = cu[a];
      hi = cu[a + 1];
    }
    if (causal) hi = std::min(hi, g + 1);
    if (window > 0) lo = std::max(lo, g - window + 1);
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
  std::vector<uint32_t> keepbits;  // a tile's dropout bits: one word per 8 keys and query
  std::vector<uint32_t> words[10];  // bf16 operand tiles in pairs (attention_dot.h), when p.bf16_dot
  std::vector<Acc> capf;  // under soft-capping: 1 - tanh^2 of a score tile, for the backward
  std::vector<Acc> kv;  // the single pass's dK and dV of one kv head, [key tiles * BN, Dp] then [.., Dvp]
  explicit Work(const Problem& p) {
    const int64_t T = std::max(p.BM, p.BN);
    const int64_t tile = T * std::max(T, std::max(p.Dp, p.Dvp));  // a tile of scores or of rows
    for (auto* v : {&a, &b, &c, &d, &e, &f, &g}) v->assign(size_t(tile), Acc(0));
    acc.assign(size_t(3 * tile), Acc(0));  // dK/dV pass: dP^T, dK, dV
    for (auto* v : {&m, &l, &rowv, &rowv2}) v->assign(size_t(T), Acc(0));
    lo.assign(size_t(T), 0);
    hi.assign(size_t(T), 0);
    padv.assign(size_t(T), 1);
    seen.assign(size_t(T), 0);
    keepbits.assign(size_t((p.BN + 7) / 8 * T), 0u);
    keep.assign(size_t(T), Acc(0));  // one row's keep factors, unpacked from keepbits
    if (p.bf16_dot)
      for (auto& v : words) v.assign(size_t(tile), 0u);
    if (p.softcap > 0) capf.assign(size_t(tile), Acc(0));
    if (p.single_pass) kv.assign(size_t(((p.Sk + p.BN - 1) / p.BN) * p.BN * (p.Dp + p.Dvp)), Acc(0));
  }
};

}  // namespace
}  // namespace sckpt
