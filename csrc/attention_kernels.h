// The tile kernels of one ISA: attention.cpp includes this file once per ISA, inside sckpt's
// anonymous namespace and under that ISA's `#pragma GCC target`, after defining
//
//   SCKPT_ATT_ISA  (namespace, scalar FMA 0/1, vector bytes, vector multiply-add, NR, MR, bf16 dot 0/1/2)
//
// e.g. (avx2, 1, 32, _mm256_fmadd_ps, 16, 4, 0). The kernels land in sckpt::<anon>::<namespace> with
// the ISA's constants; the macros are undefined again at the end, SCKPT_ATT_ISA included. No
// include guard, by design. The same source compiled per ISA (rather than templates on an ISA
// traits struct) because GCC's target options attach to where a function is defined, not where a
// template is instantiated: only a separate definition under each pragma gets that ISA's code.
#define SCKPT_ATT_APPLY(fn, args) fn args
#define SCKPT_ATT_NAME_OF(name, fma, vb, vfma, nr, mr, dot) name
#define SCKPT_ATT_TRAITS_OF(name, fma, vb, vfma, nr, mr, dot)                                   \
  constexpr bool kScalarFma = fma; /* scalar a * b + c fused */                                  \
  constexpr int kVecBytes = vb;    /* bytes of a float vector register */                        \
  constexpr int kNR = nr;          /* columns of a register block (one or two vectors) */        \
  constexpr int kMR = mr;          /* rows of a register block */                                \
  constexpr int kBf16DotMode = dot; /* 0: float tiles; 1: bf16 tiles in vdpbf16ps; 2: the same */  \
  constexpr bool kBf16Dot = dot != 0; /* pairs, each dot product emulated (attention_dot.h) */
#define SCKPT_ATT_VFMA_OF(name, fma, vb, vfma, nr, mr, dot) vfma
#define SCKPT_ATT_VFMA SCKPT_ATT_APPLY(SCKPT_ATT_VFMA_OF, SCKPT_ATT_ISA)  // VecF a * b + c

namespace SCKPT_ATT_APPLY(SCKPT_ATT_NAME_OF, SCKPT_ATT_ISA) {

SCKPT_ATT_APPLY(SCKPT_ATT_TRAITS_OF, SCKPT_ATT_ISA)

#include "attention_tiles.h"
#if defined(__x86_64__) && defined(__GNUC__)
#include "attention_dot.h"
#endif
// Do the tiles of element type T multiply in bf16 pairs (attention_dot.h) rather than in Acc?
template <class T>
constexpr bool kDot = kBf16Dot && std::is_same_v<T, bf16>;
#include "attention_masks.h"
#include "attention_forward.h"
#include "attention_backward.h"

}  // namespace

#undef SCKPT_ATT_VFMA
#undef SCKPT_ATT_VFMA_OF
#undef SCKPT_ATT_TRAITS_OF
#undef SCKPT_ATT_NAME_OF
#undef SCKPT_ATT_APPLY
#undef SCKPT_ATT_ISA
