#include "bindings.h"

#ifndef SCKPT_SOURCE_HASH
#define SCKPT_SOURCE_HASH "unknown"
#endif

PYBIND11_MODULE(_C, m) {
  m.doc() = "selective_ckpt CPU kernels";
  // Checked at import against the sources of an editable checkout, to catch a stale build.
  m.attr("SOURCE_HASH") = SCKPT_SOURCE_HASH;
  sckpt::register_dropout(m);
  sckpt::register_mlp(m);
  sckpt::register_attention(m);
  sckpt::register_layernorm(m);
}
