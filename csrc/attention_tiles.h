// Register-blocked tile products and tile loads of one ISA. A part of attention_kernels.h, compiled
// inside the ISA's namespace: no #include here (kScalarFma, kVecBytes, kNR, kMR and SCKPT_ATT_VFMA
// come from there).

// a * b + c, fused where the ISA has FMA.
template <class Acc>
inline Acc madd(Acc a, Acc b, Acc c) {
  if constexpr (kScalarFma) return __builtin_fma(a, b, c);
  else return a * b + c;
}
template <>
inline float madd<float>(float a, float b, float c) {
  if constexpr (kScalarFma) return __builtin_fmaf(a, b, c);
  else return a * b + c;
}

// One register block: C[MR x NR] (+)= A[MR x K] B[K x NR]; B row-major (ldb). A is row-major
// (element (r, k) at a[r * lda + k]) or, with TA, stored transposed (at a[k * lda + r]): A is only
// ever read one broadcast scalar at a time, so a transposed score tile costs nothing extra.
template <class Acc, int NR, bool TA>
inline void gemm_block(const Acc* __restrict a, int64_t lda, const Acc* __restrict b, int64_t ldb, int64_t K,
                       Acc* __restrict c, int64_t ldc, bool accumulate) {
  Acc acc[kMR][NR];
  for (int r = 0; r < kMR; ++r)
    for (int n = 0; n < NR; ++n) acc[r][n] = accumulate ? c[r * ldc + n] : Acc(0);
  for (int64_t kk = 0; kk < K; ++kk) {
    const Acc* bk = b + kk * ldb;
    for (int r = 0; r < kMR; ++r) {
      const Acc ar = TA ? a[kk * lda + r] : a[r * lda + kk];
      for (int n = 0; n < NR; ++n) acc[r][n] = madd(ar, bk[n], acc[r][n]);
    }
  }
  for (int r = 0; r < kMR; ++r)
    for (int n = 0; n < NR; ++n) c[r * ldc + n] = acc[r][n];
}

// The float block with explicit vectors of this ISA's width: left to itself GCC vectorises the
// 16-column AVX2 block along K with shuffles and spills, ten times slower than this.
// Unaligned and may alias float rows; loads and stores through it are single vector moves.
typedef float VecF __attribute__((vector_size(kVecBytes), aligned(4), may_alias));
constexpr int kVecW = kVecBytes / 4;

inline VecF load_vec(const float* p) { return *reinterpret_cast<const VecF*>(p); }
inline void store_vec(float* p, VecF v) { *reinterpret_cast<VecF*>(p) = v; }
inline VecF splat(float x) { return x - VecF{}; }  // x - 0 is exactly x: a pure broadcast

template <int NR, bool TA>
inline void gemm_block_vec(const float* __restrict a, int64_t lda, const float* __restrict b, int64_t ldb, int64_t K,
                           float* __restrict c, int64_t ldc, bool accumulate) {
  constexpr int NV = NR / kVecW;
  VecF acc[kMR][NV];
  for (int r = 0; r < kMR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = accumulate ? load_vec(c + r * ldc + v * kVecW) : splat(0.0f);
  for (int64_t kk = 0; kk < K; ++kk) {
    VecF bv[NV];
    for (int v = 0; v < NV; ++v) bv[v] = load_vec(b + kk * ldb + v * kVecW);
    for (int r = 0; r < kMR; ++r) {
      const VecF av = splat(TA ? a[kk * lda + r] : a[r * lda + kk]);
      for (int v = 0; v < NV; ++v) acc[r][v] = SCKPT_ATT_VFMA(av, bv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < kMR; ++r)
    for (int v = 0; v < NV; ++v) store_vec(c + r * ldc + v * kVecW, acc[r][v]);
}

template <class Acc, int NR, bool TA>
inline void gemm_any(const Acc* a, int64_t lda, const Acc* b, int64_t ldb, int64_t K, Acc* c, int64_t ldc,
                     bool accumulate) {
  if constexpr (std::is_same_v<Acc, float> && NR % kVecW == 0)
    gemm_block_vec<NR, TA>(a, lda, b, ldb, K, c, ldc, accumulate);
  else
    gemm_block<Acc, NR, TA>(a, lda, b, ldb, K, c, ldc, accumulate);
}

// C[M x N] (+)= A[M x K] B[K x N], M a multiple of kMR, N of 16. Column panels of B outer, so a
// K x NR panel of B stays in L1 while the row blocks of A stream past it.
template <bool TA = false, class Acc>
void gemm(const Acc* a, int64_t lda, const Acc* b, int64_t ldb, int64_t M, int64_t N, int64_t K, Acc* c,
          int64_t ldc, bool accumulate) {
  const auto arow = [&](int64_t i) { return TA ? a + i : a + i * lda; };
  int64_t n = 0;
  for (; n + kNR <= N; n += kNR)
    for (int64_t i = 0; i < M; i += kMR)
      gemm_any<Acc, kNR, TA>(arow(i), lda, b + n, ldb, K, c + i * ldc + n, ldc, accumulate);
  for (; n < N; n += 16)
    for (int64_t i = 0; i < M; i += kMR)
      gemm_any<Acc, 16, TA>(arow(i), lda, b + n, ldb, K, c + i * ldc + n, ldc, accumulate);
}

// out[r, 0:Dp] = rows r < n of x (row stride `stride`), zero past D and for rows n..nr.
template <class T, class Acc>
inline void load_rows(const T* x, int64_t stride, int64_t n, int64_t nr, int64_t D, int64_t Dp, Acc* out) {
  for (int64_t r = 0; r < n; ++r) {
    const T* xr = x + r * stride;
    Acc* o = out + r * Dp;
    for (int64_t d = 0; d < D; ++d) o[d] = Acc(Elem<T>::load(xr + d));
    for (int64_t d = D; d < Dp; ++d) o[d] = Acc(0);
  }
  std::memset(static_cast<void*>(out + n * Dp), 0, size_t((nr - n) * Dp) * sizeof(Acc));
}

// out[d, r] = x[r, d] for r < n, zero for columns n..ld (the transposed tile, B operand of S = A X^T).
template <class T, class Acc>
inline void load_rows_t(const T* x, int64_t stride, int64_t n, int64_t ld, int64_t D, Acc* out) {
  for (int64_t d = 0; d < D; ++d)
    for (int64_t r = n; r < ld; ++r) out[d * ld + r] = Acc(0);
  for (int64_t r = 0; r < n; ++r) {
    const T* xr = x + r * stride;
    for (int64_t d = 0; d < D; ++d) out[d * ld + r] = Acc(Elem<T>::load(xr + d));
  }
}

inline int64_t round_up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }
