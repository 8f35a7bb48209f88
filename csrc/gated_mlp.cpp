// Elementwise passes of the gated MLP (selective_ckpt/ops/gated_mlp.py), y = down(act(gate) * up):
//   forward (and backward's rebuild for down's weight gradient):  a = act(gate) * up
//   backward, one pass over (g, gate, up):  dgate = g * up * act'(gate),  dup = g * act(gate)
// act is SiLU (SwiGLU, code 0), tanh-GELU (GeGLU, code 1) or exact erf GELU (GeGLU, code 2). dgate may
// be g's own buffer (the grad of down's input, written in place), so backward allocates only dup.
//
// float, bfloat16 and float16 compute in float through the branch-free math of activations.h,
// staged in blocks of floats so the loops vectorise; float64 uses libm.
#include <cstdint>
#include <type_traits>

#include "registry.h"
#include "dtypes.h"
#include "activations.h"
#include "chunks.h"

namespace py = pybind11;

namespace sckpt {
namespace {

template <int kAct>
inline float act_f(float x) {
  return kAct == 0 ? silu_f(x) : (kAct == 1 ? gelu_tanh_f(x) : gelu_erf_f(x));
}

template <int kAct>
inline float act_grad_f(float x) {
  return kAct == 0 ? silu_grad_f(x) : (kAct == 1 ? gelu_tanh_grad_f(x) : gelu_erf_grad_f(x));
}

inline double act_d(double x, int act) { return act == 0 ? silu_d(x) : (act == 1 ? gelu_tanh_d(x) : gelu_erf_d(x)); }
inline double act_grad_d(double x, int act) {
  return act == 0 ? silu_grad_d(x) : (act == 1 ? gelu_tanh_grad_d(x) : gelu_erf_grad_d(x));
}

// The float loops for activation code act (0, 1, 2), each compiled per target.
template <class F>
void with_act(int act, F&& f) {
  if (act == 0) {
    f(std::integral_constant<int, 0>{});
  } else if (act == 1) {
    f(std::integral_constant<int, 1>{});
  } else {
    f(std::integral_constant<int, 2>{});
  }
}

template <int kAct>
SCKPT_CLONES void product_floats(const float* __restrict g, const float* __restrict u, float* __restrict a,
                                 int64_t n) {
  for (int64_t i = 0; i < n; ++i) a[i] = act_f<kAct>(g[i]) * u[i];
}

// dg may alias dy (in place); du is a separate buffer.
template <int kAct>
SCKPT_CLONES void backward_floats(const float* dy, const float* __restrict g, const float* __restrict u,
                                  float* dg, float* __restrict du, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float d = dy[i];
    du[i] = d * act_f<kAct>(g[i]);
    dg[i] = d * u[i] * act_grad_f<kAct>(g[i]);
  }
}

constexpr int64_t kBlock = 512;  // floats staged per step for 16-bit types (on the stack)

template <class T>
void load_block(const T* s, float* d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) d[i] = Elem<T>::load(s + i);
}

template <class T>
void store_block(const float* s, T* d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) Elem<T>::store(d + i, s[i]);
}

template <class T>
void product_span(const T* g, const T* u, T* a, int64_t n, int act) {
  if constexpr (std::is_same_v<T, double>) {
    for (int64_t i = 0; i < n; ++i) a[i] = act_d(g[i], act) * u[i];
  } else if constexpr (std::is_same_v<T, float>) {
    with_act(act, [&](auto k) { product_floats<decltype(k)::value>(g, u, a, n); });
  } else {
    float gb[kBlock], ub[kBlock], ab[kBlock];
    for (int64_t b = 0; b < n; b += kBlock) {
      const int64_t len = n - b < kBlock ? n - b : kBlock;
      load_block(g + b, gb, len);
      load_block(u + b, ub, len);
      with_act(act, [&](auto k) { product_floats<decltype(k)::value>(gb, ub, ab, len); });
      store_block(ab, a + b, len);
    }
  }
}

template <class T>
void backward_span(const T* dy, const T* g, const T* u, T* dg, T* du, int64_t n, int act) {
  if constexpr (std::is_same_v<T, double>) {
    for (int64_t i = 0; i < n; ++i) {
      const double d = dy[i];
      du[i] = d * act_d(g[i], act);
      dg[i] = d * u[i] * act_grad_d(g[i], act);
    }
  } else if constexpr (std::is_same_v<T, float>) {
    with_act(act, [&](auto k) { backward_floats<decltype(k)::value>(dy, g, u, dg, du, n); });
  } else {
    float yb[kBlock], gb[kBlock], ub[kBlock], dgb[kBlock], dub[kBlock];
    for (int64_t b = 0; b < n; b += kBlock) {
      const int64_t len = n - b < kBlock ? n - b : kBlock;
      load_block(dy + b, yb, len);
      load_block(g + b, gb, len);
      load_block(u + b, ub, len);
      with_act(act, [&](auto k) { backward_floats<decltype(k)::value>(yb, gb, ub, dgb, dub, len); });
      store_block(dgb, dg + b, len);
      store_block(dub, du + b, len);
    }
  }
}

// gate, up, a: contiguous buffers of n elements; act 0 = SiLU, 1 = tanh-GELU, 2 = erf GELU.
void gated_mlp_forward(int dtype, uintptr_t gate, uintptr_t up, uintptr_t a, int64_t n, int act) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* gp = as_ptr<const T>(gate);
    const T* up_ = as_ptr<const T>(up);
    T* ap = as_ptr<T>(a);
    for_chunks(n, [&](int64_t b, int64_t len) { product_span<T>(gp + b, up_ + b, ap + b, len, act); });
  });
}

// dgate may equal dy (written in place).
void gated_mlp_backward(int dtype, uintptr_t dy, uintptr_t gate, uintptr_t up, uintptr_t dgate, uintptr_t dup,
                        int64_t n, int act) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* yp = as_ptr<const T>(dy);
    const T* gp = as_ptr<const T>(gate);
    const T* up_ = as_ptr<const T>(up);
    T* dgp = as_ptr<T>(dgate);
    T* dup_ = as_ptr<T>(dup);
    for_chunks(n, [&](int64_t b, int64_t len) {
      backward_span<T>(yp + b, gp + b, up_ + b, dgp + b, dup_ + b, len, act);
    });
  });
}

void register_gated_mlp(py::module_& m) {
  m.def("gated_mlp_forward", &gated_mlp_forward, py::arg("dtype"), py::arg("gate"), py::arg("up"), py::arg("a"),
        py::arg("n"), py::arg("act"), py::call_guard<py::gil_scoped_release>());
  m.def("gated_mlp_backward", &gated_mlp_backward, py::arg("dtype"), py::arg("dy"), py::arg("gate"), py::arg("up"),
        py::arg("dgate"), py::arg("dup"), py::arg("n"), py::arg("act"), py::call_guard<py::gil_scoped_release>());
}

SCKPT_REGISTER(register_gated_mlp);

}  // namespace
}  // namespace sckpt
