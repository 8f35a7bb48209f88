#include "registry.h"

#ifndef SCKPT_SOURCE_HASH
#define SCKPT_SOURCE_HASH "unknown"
#endif

namespace sckpt {
std::vector<Registrar>& registrars() {
  static std::vector<Registrar> all;
  return all;
}
}  // namespace sckpt

PYBIND11_MODULE(_C, m) {
  m.doc() = "selective_ckpt CPU kernels";
  // Checked at import against the sources of an editable checkout, to catch a stale build.
  m.attr("SOURCE_HASH") = SCKPT_SOURCE_HASH;
  for (auto reg : sckpt::registrars()) reg(m);
}
