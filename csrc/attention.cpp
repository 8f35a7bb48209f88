// Blocked CPU attention: tiles of queries against tiles of keys, scores and every accumulation in
// fp32 (fp64 for float64 inputs), online softmax, dropout from the attention Philox stream, no
// Sq x Sk buffer. Forward and the dQ pass run one task per (batch, query head, query tile); the
// dK/dV pass one task per (batch, kv head, key tile), looping over the query heads of its group, so
// GQA never expands k/v and the group sum is taken in a fixed order (deterministic, no atomics).
//
// This file holds the entry points, their Python registration and the choice of ISA. The tile
// kernels (attention_kernels.h: tiles, masks, forward, backward) are compiled four times, for
// baseline x86-64, for AVX2 + FMA, for AVX-512 and for AVX-512 with AVX512_BF16 (whose bf16 tiles
// multiply with native dot products), each in its own namespace; the entry points pick one at run
// time. The matrix products are register-blocked loops, no BLAS.
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
#include "attention_problem.h"
#include "dtypes.h"
#include "fastmath.h"
#include "philox.h"

namespace py = pybind11;

namespace sckpt {
namespace {

// Query and key tile sizes (rows), multiples of 16; attention_tiles changes them for tuning.
// 128 x 64 and 128 x 128 ran fastest in bench/attention.py --table (fp32 causal D=64, S 512-4096,
// 2 Zen 4 cores); 128 x 64 keeps the per-thread working set in L2 and wastes less on short documents.
// Atomic: calls release the GIL, so another thread may retune while one reads.
std::atomic<int64_t> g_block_q{128};
std::atomic<int64_t> g_block_k{64};

// The backward's passes: the single pass (dQ, dK, dV from each score tile formed once) runs one task
// per (batch, kv head) and key chunk, with enough chunks for kSinglePassTasks tasks (their partial
// dQ summed after, in order). The two passes, whose tasks are per tile, take shapes with too few key
// tiles to make that many tasks. By shape alone, never by thread count, so one shape always sums in one order;
// attention_backward_passes forces either way (tests and benchmarks); 0 = by shape.
constexpr int64_t kSinglePassTasks = 8;
std::atomic<int> g_passes{0};

// The tile kernels per ISA; SCKPT_ATT_ISA is (namespace, scalar FMA, vector bytes, vector
// multiply-add, NR, MR, bf16 dot), see attention_kernels.h. AVX-512 has 32 registers 16 floats wide:
// 8 x 32 register blocks.
#define SCKPT_ATT_MUL_ADD(a, b, c) ((a) * (b) + (c))
#define SCKPT_ATT_ISA (generic, 0, 16, SCKPT_ATT_MUL_ADD, 16, 4, 0)
#include "attention_kernels.h"
#undef SCKPT_ATT_MUL_ADD

#if defined(__x86_64__) && defined(__GNUC__)
#define SCKPT_HAVE_X86_TILES 1
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define SCKPT_ATT_ISA (avx2, 1, 32, _mm256_fmadd_ps, 16, 4, 0)
#include "attention_kernels.h"
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#define SCKPT_ATT_ISA (avx512, 1, 64, _mm512_fmadd_ps, 32, 8, 0)
#include "attention_kernels.h"
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")
#define SCKPT_ATT_ISA (avx512bf16, 1, 64, _mm512_fmadd_ps, 32, 8, 1)
#include "attention_kernels.h"
#pragma GCC pop_options
// avx512bf16's kernels with each dot product in float instructions: the bf16 dot path on any AVX-512 CPU.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#define SCKPT_ATT_ISA (avx512bf16emu, 1, 64, _mm512_fmadd_ps, 32, 8, 2)
#include "attention_kernels.h"
#pragma GCC pop_options
#endif

enum class Isa { generic, avx2, avx512, avx512bf16emu, avx512bf16 };

// The widest ISA this CPU runs.
Isa native_isa() {
#ifdef SCKPT_HAVE_X86_TILES
  static const Isa isa = [] {
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
      return __builtin_cpu_supports("avx512bf16") ? Isa::avx512bf16 : Isa::avx512;
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

// The tile function `fn` for T compiled for `isa`.
#ifdef SCKPT_HAVE_X86_TILES
#define SCKPT_PICK(isa, fn, T)                                                                 \
  ((isa) == Isa::avx512bf16    ? &avx512bf16::fn<T>                                          \
   : (isa) == Isa::avx512bf16emu ? &avx512bf16emu::fn<T>                                     \
   : (isa) == Isa::avx512      ? &avx512::fn<T>                                              \
   : (isa) == Isa::avx2        ? &avx2::fn<T>                                                \
                               : &generic::fn<T>)
#else
#define SCKPT_PICK(isa, fn, T) (&generic::fn<T>)
#endif

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

Problem make_problem(const std::array<int64_t, 7>& sizes, uintptr_t pad, uintptr_t cu, int64_t ndocs, bool causal,
                     int64_t window, double scale, double softcap, uintptr_t seed, int64_t t16, double keep_scale,
                     int64_t q_offset) {
  Problem p{};
  p.B = sizes[0];
  p.H = sizes[1];
  p.Hkv = sizes[2];
  p.Sq = sizes[3];
  p.Sk = sizes[4];
  p.D = sizes[5];
  p.Dv = sizes[6];
  if (p.B < 0 || p.H < 1 || p.Hkv < 1 || p.H % p.Hkv != 0 || p.Sq < 0 || p.Sk < 0 || p.D < 1 || p.Dv < 1)
    throw std::invalid_argument("attention: bad sizes (need H % Hkv == 0, D >= 1, Dv >= 1)");
  if (t16 < 0 || t16 > 65535) throw std::invalid_argument("attention: t16 must be in [0, 65535]");
  if (q_offset < 0 || (q_offset > 0 && q_offset + p.Sq > p.Sk))
    throw std::invalid_argument("attention: q_offset must be >= 0 with q_offset + Sq <= Sk");
  p.q_offset = q_offset;
  if (cu != 0 && (p.B != 1 || (q_offset == 0 && p.Sq != p.Sk) || ndocs < 1))
    throw std::invalid_argument("attention: cu_seqlens needs B == 1, Sq + q_offset <= Sk (Sq == Sk without an "
                                "offset) and at least one document");
  p.G = p.H / p.Hkv;
  p.Dp = ceil_div(p.D, 16) * 16;
  p.Dvp = ceil_div(p.Dv, 16) * 16;
  // A problem shorter than a tile gets a tile of its own length (rounded up to 16): each call zero-fills
  // scratch sized by the tiles (Work), which at the default tiles costs more than a short problem's
  // arithmetic. Every loop runs to the problem's rows and keys, so one tile either way gives the same bits.
  p.BM = std::min<int64_t>(g_block_q, std::max<int64_t>(16, ceil_div(p.Sq, 16) * 16));
  p.BN = std::min<int64_t>(g_block_k, std::max<int64_t>(16, ceil_div(p.Sk, 16) * 16));
  p.pad = as_ptr<const uint8_t>(pad);
  p.cu = as_ptr<const int32_t>(cu);
  p.ndocs = ndocs;
  p.causal = causal;
  p.window = std::max<int64_t>(window, 0);
  p.scale = scale;
  if (!(softcap >= 0) || std::isinf(softcap)) throw std::invalid_argument("attention: softcap must be finite and >= 0 (0 = none)");
  p.softcap = softcap;
  p.t16 = uint32_t(t16);
  p.keep_scale = keep_scale;
  if (t16 > 0) {  // the seed tensor is read only when dropout is on (it may be null otherwise)
    if (seed == 0) throw std::invalid_argument("attention: dropout needs a seed");
    p.key = PhiloxKey::from_tensor(seed);
  }
  return p;
}

// o, lse <- attention(q, k, v). sizes = (B, H, Hkv, Sq, Sk, D, Dv): q, k of head dim D, v and o of Dv;
// strides of (batch, head, row).
void attention_forward(int dtype, std::array<int64_t, 7> sizes, uintptr_t q, Strides qs, uintptr_t k, Strides ks,
                       uintptr_t v, Strides vs, uintptr_t o, Strides os, uintptr_t lse, uintptr_t pad, uintptr_t cu,
                       int64_t ndocs, bool causal, int64_t window, double scale, double softcap, uintptr_t seed,
                       int64_t t16, double keep_scale, int64_t q_offset, uintptr_t sinks) {
  Problem p = make_problem(sizes, pad, cu, ndocs, causal, window, scale, softcap, seed, t16, keep_scale, q_offset);
  p.sinks = as_ptr<const float>(sinks);
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
    const Isa isa = best_isa();
    p.bf16_dot = (isa == Isa::avx512bf16 || isa == Isa::avx512bf16emu) && std::is_same_v<T, bf16>;
    const auto tile_fn = SCKPT_PICK(isa, forward_tile, T);
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
void attention_backward(int dtype, std::array<int64_t, 7> sizes, uintptr_t dout, uintptr_t q, Strides qs, uintptr_t k,
                        Strides ks, uintptr_t v, Strides vs, uintptr_t o, Strides os, uintptr_t lse, uintptr_t pad,
                        uintptr_t cu, int64_t ndocs, bool causal, int64_t window, double scale, double softcap,
                        uintptr_t seed, int64_t t16, double keep_scale, uintptr_t dq, uintptr_t dk, uintptr_t dv,
                        int64_t q_offset, uintptr_t sinks, uintptr_t dsinks) {
  Problem p = make_problem(sizes, pad, cu, ndocs, causal, window, scale, softcap, seed, t16, keep_scale, q_offset);
  p.sinks = as_ptr<const float>(sinks);
  p.dsinks = as_ptr<float>(dsinks);
  if ((p.sinks == nullptr) != (p.dsinks == nullptr))
    throw std::invalid_argument("attention: sinks and dsinks go together");
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
  std::vector<double> sink(p.sinks != nullptr ? size_t(p.B * p.H) : 0), sink_part;
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    using Acc = typename Elem<T>::Acc;
    const Isa isa = best_isa();
    p.bf16_dot = (isa == Isa::avx512bf16 || isa == Isa::avx512bf16emu) && std::is_same_v<T, bf16>;
    const auto delta_fn = SCKPT_PICK(isa, delta_rows, T);
    const auto dq_fn = SCKPT_PICK(isa, dq_tile, T);
    const auto dkv_fn = SCKPT_PICK(isa, dkv_tile, T);
    const auto group_fn = SCKPT_PICK(isa, dqkv_group, T);
    const auto sum_fn = SCKPT_PICK(isa, dq_chunks_sum, T);
    const int64_t nqt = ceil_div(p.Sq, p.BM), nkt = ceil_div(p.Sk, p.BN);
    const int64_t qtasks = p.B * p.H * nqt, ktasks = p.B * p.Hkv * nkt, groups = p.B * p.Hkv;
    const int passes = g_passes.load();
    p.chunks = std::min(nkt, ceil_div(kSinglePassTasks, groups));
    p.single_pass = passes == 1 || (passes == 0 && groups * p.chunks >= kSinglePassTasks);
    std::vector<Acc> part;
    if (p.sinks != nullptr) {  // every dQ tile writes its slot (chunks of the single pass, else chunk 0)
      sink_part.assign(size_t(p.chunks * p.B * p.H * nqt), 0.0);
      p.sink_part = sink_part.data();
    }
    if (p.single_pass && p.chunks > 1) {
      part.assign(size_t(p.chunks * p.B * p.H * p.Sq * p.Dp), Acc(0));
      p.dq_part = part.data();
    }
    const int64_t chunked_tasks = groups * p.chunks;
#pragma omp parallel
    {
#pragma omp for schedule(static)
      for (int64_t bh = 0; bh < p.B * p.H; ++bh) delta_fn(p, bh, delta.data(), sink.data());
      Work<Acc> w(p);
      if (p.single_pass) {
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < chunked_tasks; ++task) {
          const int64_t g = task / p.chunks;
          group_fn(p, g / p.Hkv, g % p.Hkv, task % p.chunks, w);
        }
        if (p.chunks > 1) {
#pragma omp for schedule(static)
          for (int64_t row = 0; row < p.B * p.H * p.Sq; ++row) sum_fn(p, row);
        }
      } else {
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < qtasks; ++task) {
          const int64_t t = nqt - 1 - task / (p.B * p.H), bh = task % (p.B * p.H);
          dq_fn(p, bh / p.H, bh % p.H, t, w, nullptr, nullptr, 0, p.Sk, nullptr, 0);
        }
        // Under a causal mask the first key tiles are attended by the most queries: first out.
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < ktasks; ++task) {
          const int64_t t = task / (p.B * p.Hkv), bh = task % (p.B * p.Hkv);
          dkv_fn(p, bh / p.Hkv, bh % p.Hkv, t, w);
        }
      }
    }
  });
  // the sinks' gradient: the delta pass's and the dQ tiles' shares, summed in a fixed order
  const int64_t nqt = ceil_div(p.Sq, p.BM), slots = int64_t(sink_part.size()) / std::max<int64_t>(p.B * p.H, 1);
  for (int64_t h = 0; h < (p.sinks != nullptr ? p.H : 0); ++h) {
    double g = 0;
    for (int64_t b = 0; b < p.B; ++b) {
      g += sink[size_t(b * p.H + h)];
      for (int64_t s = 0; s < slots; ++s) {  // slot s = (chunk, query tile) of this (b, h)
        const int64_t chunk = s / nqt, t = s % nqt;
        g += sink_part[size_t((chunk * p.B * p.H + b * p.H + h) * nqt + t)];
      }
    }
    p.dsinks[h] = float(g);
  }
}

// Sets the backward's passes: 1 (single), 2 (dQ, then dK/dV) or 0 (by shape); returns the previous.
int attention_backward_passes(int passes) {
  if (passes < 0 || passes > 2) throw std::invalid_argument("attention backward passes must be 0 (by shape), 1 or 2");
  return g_passes.exchange(passes);
}

// Sets the query and key tile sizes (multiples of 16 in [16, 512]); returns the previous ones.
std::pair<int64_t, int64_t> attention_tiles(int64_t block_q, int64_t block_k) {
  for (int64_t b : {block_q, block_k})
    if (b < 16 || b > 512 || b % 16 != 0) throw std::invalid_argument("attention tiles must be multiples of 16 in [16, 512]");
  return {g_block_q.exchange(block_q), g_block_k.exchange(block_k)};
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::avx512bf16: return "avx512bf16";
    case Isa::avx512bf16emu: return "avx512bf16emu";
    case Isa::avx512: return "avx512";
    case Isa::avx2: return "avx2";
    default: return "generic";
  }
}

const char* attention_isa() { return isa_name(best_isa()); }

// Runs the kernels compiled for `name` ("generic", "avx2", "avx512", "avx512bf16emu", "avx512bf16", or "native"
// to undo), which this CPU must support (avx512bf16emu needs AVX-512 only); returns the previous choice.
std::string attention_use_isa(const std::string& name) {
  const std::string old = g_isa.load() < 0 ? "native" : isa_name(best_isa());
  int chosen;
  if (name == "native") chosen = -1;
  else if (name == "generic") chosen = int(Isa::generic);
  else if (name == "avx2") chosen = int(Isa::avx2);
  else if (name == "avx512") chosen = int(Isa::avx512);
  else if (name == "avx512bf16emu") chosen = int(Isa::avx512bf16emu);
  else if (name == "avx512bf16") chosen = int(Isa::avx512bf16);
  else throw std::invalid_argument("attention ISA must be native, generic, avx2, avx512, avx512bf16emu or avx512bf16");
  const int needs = chosen == int(Isa::avx512bf16emu) ? int(Isa::avx512) : chosen;
  if (needs > int(native_isa())) throw std::invalid_argument("this CPU does not run attention ISA " + name);
  g_isa.store(chosen);
  return old;
}

void register_attention(py::module_& m) {
  m.def("attention_forward", &attention_forward, py::arg("dtype"), py::arg("sizes"), py::arg("q"), py::arg("q_strides"),
        py::arg("k"), py::arg("k_strides"), py::arg("v"), py::arg("v_strides"), py::arg("o"), py::arg("o_strides"),
        py::arg("lse"), py::arg("key_padding_mask"), py::arg("cu_seqlens"), py::arg("n_docs"), py::arg("causal"),
        py::arg("window"), py::arg("scale"), py::arg("softcap"), py::arg("seed"), py::arg("t16"), py::arg("keep_scale"),
        py::arg("q_offset") = 0, py::arg("sinks") = 0, py::call_guard<py::gil_scoped_release>());
  m.def("attention_backward", &attention_backward, py::arg("dtype"), py::arg("sizes"), py::arg("do"), py::arg("q"),
        py::arg("q_strides"), py::arg("k"), py::arg("k_strides"), py::arg("v"), py::arg("v_strides"), py::arg("o"),
        py::arg("o_strides"), py::arg("lse"), py::arg("key_padding_mask"), py::arg("cu_seqlens"), py::arg("n_docs"),
        py::arg("causal"), py::arg("window"), py::arg("scale"), py::arg("softcap"), py::arg("seed"), py::arg("t16"),
        py::arg("keep_scale"), py::arg("dq"), py::arg("dk"), py::arg("dv"), py::arg("q_offset") = 0,
        py::arg("sinks") = 0, py::arg("dsinks") = 0, py::call_guard<py::gil_scoped_release>());
  m.def("attention_tiles", &attention_tiles, py::arg("block_q"), py::arg("block_k"));
  m.def("attention_isa", &attention_isa);
  m.def("attention_backward_passes", &attention_backward_passes, py::arg("passes"));
  m.def("attention_use_isa", &attention_use_isa, py::arg("name"));
}

SCKPT_REGISTER(register_attention);

}  // namespace
}  // namespace sckpt
