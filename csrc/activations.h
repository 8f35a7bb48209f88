// Activation math shared by the GELU-MLP (gelu_mlp.cpp) and the gated MLP (gated_mlp.cpp) kernels:
// exact (erf) GELU, tanh-GELU and SiLU in float (branch-free, vectorisable through fast_expf) and in
// double (libm).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "fastmath.h"

// Loops that use these are compiled for AVX-512, AVX2 and baseline x86-64 and picked at load time.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SCKPT_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define SCKPT_CLONES
#endif

namespace sckpt {

constexpr double kSqrt2OverPi = 0.79788456080286535588;  // sqrt(2 / pi)
constexpr double kTanhCubic = 0.044715;

// The tanh form's gate s = sigmoid(v), v = 2u, and s (1 - s), both from e = exp(-|v|): neither
// cancels, and once the gate saturates (|v| > 87.3) fast_expf gives e = 0 exactly, so s is exactly
// 0 or 1 and s (1 - s) exactly 0. A clamped exp would leave s (1 - s) near 1e-38 for the derivative's
// cubic term to blow up (gelu'(-1e15) came out -1.3e6 instead of 0).
inline float tanh_v_f(float x) { return float(2 * kSqrt2OverPi) * (x + float(kTanhCubic) * x * x * x); }

inline float tanh_gate_f(float x, float* s_1ms) {
  const float v = tanh_v_f(x);
  const float e = fast_expf(v < 0.0f ? v : -v);
  const float r = 1.0f / (1.0f + e);
  *s_1ms = e * r * r;
  return v < 0.0f ? e * r : r;
}

// Past |x| = 20 the gate is saturated (|v| > 600), so u' is only needed inside; clamping x there
// keeps x^2 from overflowing to inf (inf * 0 = NaN) at huge finite inputs.
inline float tanh_du_f(float x) {
  const float xc = x < -20.0f ? -20.0f : (x > 20.0f ? 20.0f : x);
  return float(kSqrt2OverPi) * (1.0f + float(3 * kTanhCubic) * xc * xc);
}

// tanh-GELU x * s and its derivative s + x * 2 s (1 - s) u'. x multiplies last, so x = +-inf gives
// NaN as eager does, and any finite x in a saturated tail gives exactly s.
inline float gelu_tanh_f(float x) {
  float s_1ms;
  return x * tanh_gate_f(x, &s_1ms);
}

inline float gelu_tanh_grad_f(float x) {
  float s_1ms;
  const float s = tanh_gate_f(x, &s_1ms);
  return s + x * (2.0f * s_1ms * tanh_du_f(x));
}

inline double gelu_tanh_d(double x) {
  return 0.5 * x * (1.0 + std::tanh(kSqrt2OverPi * (x + kTanhCubic * x * x * x)));
}

inline double gelu_tanh_grad_d(double x) {
  const double t = std::tanh(kSqrt2OverPi * (x + kTanhCubic * x * x * x));
  const double du = kSqrt2OverPi * (1.0 + 3 * kTanhCubic * x * x);
  return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du;
}

constexpr double kInvSqrt2 = 0.70710678118654752440;     // 1 / sqrt(2)
constexpr double kInvSqrt2Pi = 0.39894228040143267794;   // 1 / sqrt(2 pi)

// erfc(z) for z >= 0 as t exp(-z^2 + P(t)), t = 1 / (1 + z/2), the form of Press et al.,
// Numerical Recipes 6.2 (Chebyshev fitting). P is our own degree-9 weighted least-squares fit of
// log(erfc(z) / t) + z^2 on z in [0, 10] (float64, 4000 Chebyshev nodes in t): fit error
// 4.5e-8 relative, below float's 6e-8 rounding. z is clamped to 10, where erfc is below 1e-44.
inline float erfc_nonneg_f(float z) {
  z = z > 10.0f ? 10.0f : z;
  const float t = 1.0f / (1.0f + 0.5f * z);
  float p = 0.14219455973057823f;
  p = p * t - 0.6660647390410154f;
  p = p * t + 1.1224047664077779f;
  p = p * t - 0.6512533726885484f;
  p = p * t - 0.11678360430364716f;
  p = p * t + 0.020193995444781145f;
  p = p * t + 0.0283577470652147f;
  p = p * t + 0.38789960096253795f;
  p = p * t + 0.9984925302961075f;
  p = p * t - 1.2654414386513118f;
  return t * fast_expf(p - z * z);
}

// Phi(x), the standard normal CDF: 1 - erfc/2 on the right, erfc/2 on the left, so the left
// tail keeps its relative accuracy.
inline float normal_cdf_f(float x) {
  const float half_erfc = 0.5f * erfc_nonneg_f((x < 0.0f ? -x : x) * float(kInvSqrt2));
  return x < 0.0f ? half_erfc : 1.0f - half_erfc;
}

// Exact GELU x * Phi(x) and its derivative Phi(x) + x phi(x).
inline float gelu_erf_f(float x) { return x * normal_cdf_f(x); }

inline float gelu_erf_grad_f(float x) {
  return normal_cdf_f(x) + x * float(kInvSqrt2Pi) * fast_expf(-0.5f * x * x);
}

inline double gelu_erf_d(double x) { return 0.5 * x * std::erfc(-x * kInvSqrt2); }

inline double gelu_erf_grad_d(double x) {
  return 0.5 * std::erfc(-x * kInvSqrt2) + x * kInvSqrt2Pi * std::exp(-0.5 * x * x);
}

// sigmoid(x) = 1 / (1 + exp(-x)). exp(-x) overflows float below x = -88.72 and eager's sigmoid is
// exactly 0 there (so SiLU and its gradient are exactly 0); fast_expf clamps instead, so those
// lanes are cleared on the bit patterns (no float compare: the loops stay vectorised).
inline float sigmoid_f(float x) {
  const float s = 1.0f / (1.0f + fast_expf(-x));
  int32_t xb, sb;
  std::memcpy(&xb, &x, 4);
  std::memcpy(&sb, &s, 4);
  const int32_t under = -int32_t((xb < 0) & ((xb & 0x7fffffff) > 0x42B17218));  // x < -88.7228
  sb &= ~under;
  float out;
  std::memcpy(&out, &sb, 4);
  return out;
}

// SiLU x * sigmoid(x) and its derivative s (1 + x (1 - s)), the form eager autograd uses.
inline float silu_f(float x) { return x * sigmoid_f(x); }

inline float silu_grad_f(float x) {
  const float s = sigmoid_f(x);
  return s * (1.0f + x * (1.0f - s));
}

inline double silu_d(double x) { return x / (1.0 + std::exp(-x)); }

inline double silu_grad_d(double x) {
  const double s = 1.0 / (1.0 + std::exp(-x));  // exp overflows to inf: s = 0 exactly
  return s * (1.0 + x * (1.0 - s));
}

}  // namespace sckpt
