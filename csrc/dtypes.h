// Element types the kernels read and write, without torch headers. Codes match
// selective_ckpt.backend.DTYPE_CODES. Arithmetic happens in Acc (float, or double for float64);
// conversions round to nearest even like torch's.
#pragma once
#include <cstdint>
#include <cstring>
#include <stdexcept>

namespace sckpt {

enum DTypeCode : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kFloat64 = 3 };

struct bf16 {
  uint16_t bits;
};

template <class T>
struct Elem;

template <>
struct Elem<float> {
  using Acc = float;
  static float load(const float* p) { return *p; }
  static void store(float* p, float v) { *p = v; }
};

template <>
struct Elem<double> {
  using Acc = double;
  static double load(const double* p) { return *p; }
  static void store(double* p, double v) { *p = v; }
};

template <>
struct Elem<_Float16> {
  using Acc = float;
  static float load(const _Float16* p) { return float(*p); }
  static void store(_Float16* p, float v) { *p = _Float16(v); }
};

template <>
struct Elem<bf16> {
  using Acc = float;
  static float load(const bf16* p) {
    const uint32_t u = uint32_t(p->bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  static void store(bf16* p, float v) {
    uint32_t u;
    std::memcpy(&u, &v, 4);
    // Integer selects rather than a branch, so loops that store bf16 still vectorise.
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uint32_t quiet_nan = (u >> 16) | 0x40u;  // NaN stays NaN, payload's low bits dropped
    p->bits = uint16_t((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
  }
};

// Calls f(T{}) with the element type named by code.
template <class F>
void dispatch_dtype(int code, F&& f) {
  switch (code) {
    case kFloat32: f(float{}); return;
    case kFloat16: f(_Float16{}); return;
    case kBFloat16: f(bf16{}); return;
    case kFloat64: f(double{}); return;
    default: throw std::invalid_argument("unsupported dtype code");
  }
}

template <class T>
T* as_ptr(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

}  // namespace sckpt
