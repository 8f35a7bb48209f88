// Each kernel family registers its functions on the one extension module.
// Functions take raw data pointers (uintptr_t), sizes and strides, never torch types, and
// release the GIL while they compute.
#pragma once
#include <pybind11/pybind11.h>

namespace sckpt {
void register_dropout(pybind11::module_& m);
void register_mlp(pybind11::module_& m);
void register_attention(pybind11::module_& m);
void register_layernorm(pybind11::module_& m);
}  // namespace sckpt
