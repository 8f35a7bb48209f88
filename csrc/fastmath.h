// Vectorisable elementwise math shared by the CPU kernels (attention rows, GELU). Plain inline
// functions: callers compiled for a wider ISA (target pragmas, target_clones) inline them and
// vectorise them with that ISA.
#pragma once
#include <cstdint>
#include <cstring>

namespace sckpt {

// exp for float without libm calls or float compares, so row loops vectorise (GCC keeps float
// selects as branches under its default -ftrapping-math): 2^n * e^r with |r| <= ln2/2 and a
// degree-7 Taylor polynomial (truncation error below 0.1 ulp). The range is clamped on the bit
// patterns; x below -87.3 (and -inf) gives exactly 0, x above 88 is taken as 88.
inline float fast_expf(float x) {
  int32_t xb;
  std::memcpy(&xb, &x, 4);
  const int32_t mag = xb & 0x7fffffff;
  const int32_t low = -int32_t((xb < 0) & (mag > 0x42AE999A));    // all ones where x < -87.3
  const int32_t high = -int32_t((xb >= 0) & (mag > 0x42B00000));  // all ones where x > 88
  const int32_t xcb = (xb & ~(low | high)) | (int32_t(0xC2AE999Au) & low) | (0x42B00000 & high);
  float xc;
  std::memcpy(&xc, &xcb, 4);
  const float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer, n in the low bits
  const float t = xc * 1.44269504088896341f + shifter;
  const float n = t - shifter;
  // ln2 in two parts; n * hi is exact (hi has 12 significant bits, |n| < 2^8).
  const float r = (xc - n * 0.693145751953125f) - n * 1.428606765330187045e-06f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  int32_t tb;
  std::memcpy(&tb, &t, 4);
  const int32_t bits = ((tb - 0x4B400000 + 127) << 23) & ~low;  // 2^n, or +0 for the low range
  float two_n;
  std::memcpy(&two_n, &bits, 4);
  return p * two_n;
}

// tanh for float, vectorisable like fast_expf: for |x| < 0.625 the odd polynomial x P(x^2), its
// degree-10 P fitted to tanh(x) / x in relative error (under 1 ulp); above, 1 - 2 / (e^{2|x|} + 1),
// at least 0.55 there, so nothing cancels (1.4 ulp at most). The sign of x is put back on the bits;
// NaN stays NaN, +-inf gives +-1.
inline float fast_tanhf(float x) {
  uint32_t xb;
  std::memcpy(&xb, &x, 4);
  const uint32_t mag = xb & 0x7fffffffu;
  float ax;
  std::memcpy(&ax, &mag, 4);
  const float x2 = ax * ax;
  float p = -0.005709210581664607f;
  p = p * x2 + 0.0206414560233341f;
  p = p * x2 - 0.05373953800949115f;
  p = p * x2 + 0.13331413546093598f;
  p = p * x2 - 0.33333277349394497f;
  p = p * x2 + 0.9999999982827782f;
  const float small = ax * p;
  const float large = 1.0f - 2.0f / (fast_expf(2.0f * ax) + 1.0f);
  uint32_t sb, lb;
  std::memcpy(&sb, &small, 4);
  std::memcpy(&lb, &large, 4);
  uint32_t rb = (mag < 0x3F200000u ? sb : lb) | (xb & 0x80000000u);  // 0x3F200000 = 0.625f
  rb = mag > 0x7f800000u ? xb : rb;
  float r;
  std::memcpy(&r, &rb, 4);
  return r;
}

}  // namespace sckpt
