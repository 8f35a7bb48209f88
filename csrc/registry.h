// Each kernel family registers its functions on the one extension module by itself: a family file
// ends with SCKPT_REGISTER(register_<family>), so adding a family touches no shared file.
// Functions take raw data pointers (uintptr_t), sizes and strides, never torch types, and
// release the GIL while they compute. Names are <family>_<function> (selective_ckpt/backend.py
// finds them by that name).
#pragma once
#include <pybind11/pybind11.h>

#include <vector>

namespace sckpt {

using Registrar = void (*)(pybind11::module_&);

// Function-local static, so registration from any file's static initialiser finds it built.
std::vector<Registrar>& registrars();

struct Register {
  explicit Register(Registrar r) { registrars().push_back(r); }
};

}  // namespace sckpt

#define SCKPT_REGISTER(fn) const ::sckpt::Register registered_##fn(&fn)
