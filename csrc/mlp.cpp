// Elementwise passes of the GELU-MLP (selective_ckpt/mlp.py): the GELU of the fc1 output h in
// forward (and again in backward, where it is recomputed instead of stored) and the in-place
// product g *= gelu'(h). Both GELU forms: "none" is x * Phi(x) with the erf, "tanh" is GPT-2's
// gelu_new, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (Hendrycks & Gimpel 2016).
#include <cmath>
#include <cstdint>

#include "bindings.h"
#include "dtypes.h"

namespace py = pybind11;

namespace sckpt {
namespace {

constexpr double kSqrt2OverPi = 0.79788456080286535588;  // sqrt(2 / pi)
constexpr double kInvSqrt2 = 0.70710678118654752440;     // 1 / sqrt(2)
constexpr double kInvSqrt2Pi = 0.39894228040143267794;   // 1 / sqrt(2 pi)
constexpr double kTanhCubic = 0.044715;

template <class A>
inline A gelu_value(A x, bool tanh_form) {
  if (tanh_form) {
    const A u = A(kSqrt2OverPi) * (x + A(kTanhCubic) * x * x * x);
    return A(0.5) * x * (A(1) + std::tanh(u));
  }
  return A(0.5) * x * (A(1) + std::erf(x * A(kInvSqrt2)));
}

template <class A>
inline A gelu_grad(A x, bool tanh_form) {
  if (tanh_form) {
    const A x2 = x * x;
    const A t = std::tanh(A(kSqrt2OverPi) * (x + A(kTanhCubic) * x2 * x));
    const A du = A(kSqrt2OverPi) * (A(1) + A(3 * kTanhCubic) * x2);
    return A(0.5) * (A(1) + t) + A(0.5) * x * (A(1) - t * t) * du;
  }
  const A cdf = A(0.5) * (A(1) + std::erf(x * A(kInvSqrt2)));
  const A pdf = A(kInvSqrt2Pi) * std::exp(A(-0.5) * x * x);
  return cdf + x * pdf;
}

// Forward and the backward's recompute both run this one function, so storing a and recomputing
// it give the same bits.
template <class T>
void gelu_elems(const T* h, T* a, int64_t n, bool tanh_form) {
  using Acc = typename Elem<T>::Acc;
#pragma omp parallel for schedule(static) if (n > 32768)
  for (int64_t i = 0; i < n; ++i) {
    Elem<T>::store(a + i, gelu_value<Acc>(Elem<T>::load(h + i), tanh_form));
  }
}

// g[i] = g[i] * gelu'(h[i]), in place: g is the buffer of dy @ w2, so dh needs no new memory.
template <class T>
void gelu_backward_elems(T* g, const T* h, int64_t n, bool tanh_form) {
  using Acc = typename Elem<T>::Acc;
#pragma omp parallel for schedule(static) if (n > 32768)
  for (int64_t i = 0; i < n; ++i) {
    Elem<T>::store(g + i, Elem<T>::load(g + i) * gelu_grad<Acc>(Elem<T>::load(h + i), tanh_form));
  }
}

// approximate: 0 = erf ("none"), 1 = tanh. h and a are contiguous buffers of n elements.
void mlp_gelu(int dtype, uintptr_t h, uintptr_t a, int64_t n, int approximate) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    gelu_elems<T>(as_ptr<const T>(h), as_ptr<T>(a), n, approximate == 1);
  });
}

void mlp_gelu_backward(int dtype, uintptr_t grad, uintptr_t h, int64_t n, int approximate) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    gelu_backward_elems<T>(as_ptr<T>(grad), as_ptr<const T>(h), n, approximate == 1);
  });
}

}  // namespace

void register_mlp(py::module_& m) {
  m.def("mlp_gelu", &mlp_gelu, py::arg("dtype"), py::arg("h"), py::arg("a"), py::arg("n"),
        py::arg("approximate"), py::call_guard<py::gil_scoped_release>());
  m.def("mlp_gelu_backward", &mlp_gelu_backward, py::arg("dtype"), py::arg("grad"), py::arg("h"),
        py::arg("n"), py::arg("approximate"), py::call_guard<py::gil_scoped_release>());
}

}  // namespace sckpt
