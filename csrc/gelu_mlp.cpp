// Elementwise passes of the GELU-MLP (selective_ckpt/ops/gelu_mlp.py): the GELU of the fc1 output h in
// forward (and again in backward, where it is recomputed instead of stored) and the in-place
// product g *= gelu'(h). Both GELU forms (Hendrycks & Gimpel 2016): "none" is x * Phi(x) with
// the normal CDF Phi, "tanh" is GPT-2's gelu_new 0.5 x (1 + tanh(u)) = x * sigmoid(2u) with
// u = sqrt(2/pi) (x + 0.044715 x^3).
//
// float, bfloat16 and float16 compute in float with branch-free exp / erfc below, so the loops
// vectorise (libm's erff / tanhf are scalar calls); each loop is compiled for AVX-512, AVX2 and
// baseline x86-64 and picked at load time. float64 uses libm.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "registry.h"
#include "dtypes.h"
#include "fastmath.h"
#include "activations.h"
#include "chunks.h"

namespace py = pybind11;

namespace sckpt {
namespace {

template <bool kTanh>
inline float gelu_f(float x) {
  return kTanh ? gelu_tanh_f(x) : gelu_erf_f(x);
}

template <bool kTanh>
inline float gelu_grad_f(float x) {
  return kTanh ? gelu_tanh_grad_f(x) : gelu_erf_grad_f(x);
}

// float64 through libm.
inline double gelu_d(double x, bool tanh_form) { return tanh_form ? gelu_tanh_d(x) : gelu_erf_d(x); }

inline double gelu_grad_d(double x, bool tanh_form) { return tanh_form ? gelu_tanh_grad_d(x) : gelu_erf_grad_d(x); }

// The float loops, compiled per target; every dtype but float64 computes through them.
SCKPT_CLONES void gelu_floats(const float* __restrict h, float* __restrict a, int64_t n, bool tanh_form) {
  if (tanh_form) {
    for (int64_t i = 0; i < n; ++i) a[i] = gelu_f<true>(h[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) a[i] = gelu_f<false>(h[i]);
  }
}

SCKPT_CLONES void gelu_grad_floats(float* __restrict g, const float* __restrict h, int64_t n, bool tanh_form) {
  if (tanh_form) {
    for (int64_t i = 0; i < n; ++i) g[i] *= gelu_grad_f<true>(h[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) g[i] *= gelu_grad_f<false>(h[i]);
  }
}

// 16-bit <-> float for a block. float16 uses the F16C instructions where the CPU has them (the
// compiler emits scalar library calls for _Float16 otherwise); both round to nearest even.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target("avx2,f16c"))) void f16_to_float_f16c(const _Float16* s, float* d, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(d + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))));
  }
  for (; i < n; ++i) d[i] = float(s[i]);
}

__attribute__((target("avx2,f16c"))) void float_to_f16_f16c(const float* s, _Float16* d, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i v = _mm256_cvtps_ph(_mm256_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), v);
  }
  for (; i < n; ++i) d[i] = _Float16(s[i]);
}

bool cpu_has_f16c() {
  __builtin_cpu_init();  // this runs from a static initialiser, possibly before libgcc's own
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
}
const bool kHasF16C = cpu_has_f16c();
#else
const bool kHasF16C = false;
void f16_to_float_f16c(const _Float16*, float*, int64_t) {}
void float_to_f16_f16c(const float*, _Float16*, int64_t) {}
#endif

template <class T>
void to_floats(const T* s, float* d, int64_t n) {
  if constexpr (std::is_same_v<T, _Float16>) {
    if (kHasF16C) return f16_to_float_f16c(s, d, n);
  }
  for (int64_t i = 0; i < n; ++i) d[i] = Elem<T>::load(s + i);
}

template <class T>
void from_floats(const float* s, T* d, int64_t n) {
  if constexpr (std::is_same_v<T, _Float16>) {
    if (kHasF16C) return float_to_f16_f16c(s, d, n);
  }
  for (int64_t i = 0; i < n; ++i) Elem<T>::store(d + i, s[i]);
}

constexpr int64_t kBlock = 512;  // floats staged per step for 16-bit types (on the stack)

// a = gelu(h) over n elements of T; the forward and the backward's recompute both run this, so
// storing a and recomputing it give the same bits.
template <class T>
void gelu_span(const T* h, T* a, int64_t n, bool tanh_form) {
  if constexpr (std::is_same_v<T, double>) {
    for (int64_t i = 0; i < n; ++i) a[i] = gelu_d(h[i], tanh_form);
  } else if constexpr (std::is_same_v<T, float>) {
    gelu_floats(h, a, n, tanh_form);
  } else {
    float hb[kBlock], ab[kBlock];
    for (int64_t b = 0; b < n; b += kBlock) {
      const int64_t len = n - b < kBlock ? n - b : kBlock;
      to_floats(h + b, hb, len);
      gelu_floats(hb, ab, len, tanh_form);
      from_floats(ab, a + b, len);
    }
  }
}

// g *= gelu'(h) in place over n elements of T.
template <class T>
void gelu_backward_span(T* g, const T* h, int64_t n, bool tanh_form) {
  if constexpr (std::is_same_v<T, double>) {
    for (int64_t i = 0; i < n; ++i) g[i] *= gelu_grad_d(h[i], tanh_form);
  } else if constexpr (std::is_same_v<T, float>) {
    gelu_grad_floats(g, h, n, tanh_form);
  } else {
    float gb[kBlock], hb[kBlock];
    for (int64_t b = 0; b < n; b += kBlock) {
      const int64_t len = n - b < kBlock ? n - b : kBlock;
      to_floats(g + b, gb, len);
      to_floats(h + b, hb, len);
      gelu_grad_floats(gb, hb, len, tanh_form);
      from_floats(gb, g + b, len);
    }
  }
}

// approximate: 0 = erf ("none"), 1 = tanh. h and a are contiguous buffers of n elements.
void gelu_mlp_forward(int dtype, uintptr_t h, uintptr_t a, int64_t n, int approximate) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* hp = as_ptr<const T>(h);
    T* ap = as_ptr<T>(a);
    for_chunks(n, [&](int64_t begin, int64_t len) {
      gelu_span<T>(hp + begin, ap + begin, len, approximate == 1);
    });
  });
}

// grad *= gelu'(h) in place: grad is the buffer of dy @ w2, so dh needs no new memory.
void gelu_mlp_backward_(int dtype, uintptr_t grad, uintptr_t h, int64_t n, int approximate) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    T* gp = as_ptr<T>(grad);
    const T* hp = as_ptr<const T>(h);
    for_chunks(n, [&](int64_t begin, int64_t len) {
      gelu_backward_span<T>(gp + begin, hp + begin, len, approximate == 1);
    });
  });
}

void register_gelu_mlp(py::module_& m) {
  m.def("gelu_mlp_forward", &gelu_mlp_forward, py::arg("dtype"), py::arg("h"), py::arg("a"), py::arg("n"),
        py::arg("approximate"), py::call_guard<py::gil_scoped_release>());
  m.def("gelu_mlp_backward_", &gelu_mlp_backward_, py::arg("dtype"), py::arg("grad"), py::arg("h"),
        py::arg("n"), py::arg("approximate"), py::call_guard<py::gil_scoped_release>());
}

SCKPT_REGISTER(register_gelu_mlp);

}  // namespace
}  // namespace sckpt
