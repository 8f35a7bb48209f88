// bf16 tile products with native dot products (AVX512_BF16's vdpbf16ps): 32 multiply-adds per
// instruction where the float path does 16. A part of attention_kernels.h, compiled inside the ISA's
// namespace: no #include here. Only the ISA with kBf16Dot instantiates these templates (for T = bf16),
// so the intrinsics never reach a function compiled without the target. The ISA avx512bf16emu
// (kBf16DotMode 2) runs the same path with each dot product done in float instructions.
//
// vdpbf16ps adds a[2i] * b[2i] + a[2i+1] * b[2i+1] into float lane i, so both operands hold bf16 in
// pairs along the reduced dimension k, one 32-bit word per pair (element 2i in the low half):
//   A, rows:        a[r * lda + kp]  = (A[r, 2kp], A[r, 2kp+1])    (a bf16 row as it lies in memory)
//   A, transposed:  a[kp * lda + r]  = the same pair, stored k-pair-major (from a float tile)
//   B:              b[kp * ldb + n]  = (B[2kp, n], B[2kp+1, n])
// Products of two bf16 are exact in float and each lane sums in float, so the scores S = Q K^T and
// dP = dO V^T are what the float path computes (up to summation order). P and dS, which the float path
// keeps in float, are rounded to bf16 (nearest even) before their products, as SDPA's CPU kernel does.

// A float's bf16 bits in the high half of a word, rounded to nearest even; NaN stays a (quiet) NaN.
// Integer selects only, so the packing loops vectorise.
inline uint32_t bf16_high(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  const uint32_t quiet_nan = (u | 0x400000u) & 0xffff0000u;
  return (u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded;
}

inline uint32_t load_word(const bf16* x, int64_t d) {
  uint32_t w;
  std::memcpy(&w, x + d, 4);
  return w;
}

// A operand by rows: out[r * Dw + dp] = (x[r, 2dp], x[r, 2dp+1]) for r < n, Dw = Dp / 2 words a row;
// zero past D and for rows n..nr.
template <class T>
inline void dot_rows(const T* x, int64_t stride, int64_t n, int64_t nr, int64_t D, int64_t Dw, uint32_t* out) {
  for (int64_t r = 0; r < n; ++r) {
    const T* xr = x + r * stride;
    uint32_t* o = out + r * Dw;
    for (int64_t dp = 0; dp < D / 2; ++dp) o[dp] = load_word(xr, 2 * dp);
    if (D % 2) o[D / 2] = uint32_t(xr[D - 1].bits);
    for (int64_t dp = (D + 1) / 2; dp < Dw; ++dp) o[dp] = 0u;
  }
  std::memset(static_cast<void*>(out + n * Dw), 0, size_t((nr - n) * Dw) * sizeof(uint32_t));
}

// B operand paired along the columns of x (S = A X^T): out[dp * ld + r] = (x[r, 2dp], x[r, 2dp+1])
// for r < n, zero for r in n..ld; Dw = Dp / 2 pairs.
template <class T>
inline void dot_cols(const T* x, int64_t stride, int64_t n, int64_t ld, int64_t D, int64_t Dw, uint32_t* out) {
  for (int64_t dp = 0; dp < Dw; ++dp)
    for (int64_t r = n; r < ld; ++r) out[dp * ld + r] = 0u;
  for (int64_t r = 0; r < n; ++r) {
    const T* xr = x + r * stride;
    for (int64_t dp = 0; dp < D / 2; ++dp) out[dp * ld + r] = load_word(xr, 2 * dp);
    if (D % 2) out[(D / 2) * ld + r] = uint32_t(xr[D - 1].bits);
    for (int64_t dp = (D + 1) / 2; dp < Dw; ++dp) out[dp * ld + r] = 0u;
  }
}

// B operand paired along the rows of x (C += A X): out[(r / 2) * Dp + d] = (x[r, d], x[r + 1, d])
// for r < n (an odd last row pairs with 0), zero past D up to Dp.
template <class T>
inline void dot_row_pairs(const T* x, int64_t stride, int64_t n, int64_t D, int64_t Dp, uint32_t* out) {
  for (int64_t r = 0; r < n; r += 2) {
    const T* x0 = x + r * stride;
    const T* x1 = x0 + stride;
    uint32_t* o = out + (r / 2) * Dp;
    if (r + 1 < n)
      for (int64_t d = 0; d < D; ++d) o[d] = uint32_t(x0[d].bits) | (uint32_t(x1[d].bits) << 16);
    else
      for (int64_t d = 0; d < D; ++d) o[d] = uint32_t(x0[d].bits);
    for (int64_t d = D; d < Dp; ++d) o[d] = 0u;
  }
}

// A float tile s [K x M] (row k, ld lds) rounded to bf16 pairs along k: out[(k / 2) * M + c], for
// the transposed A operand (P or dS times a row-paired B). An odd last row pairs with 0.
inline void dot_pack_pairs(const float* s, int64_t lds, int64_t K, int64_t M, uint32_t* out) {
  for (int64_t k = 0; k < K; k += 2) {
    const float* s0 = s + k * lds;
    uint32_t* o = out + (k / 2) * M;
    if (k + 1 < K) {
      const float* s1 = s0 + lds;
      for (int64_t c = 0; c < M; ++c) o[c] = (bf16_high(s0[c]) >> 16) | bf16_high(s1[c]);
    } else {
      for (int64_t c = 0; c < M; ++c) o[c] = bf16_high(s0[c]) >> 16;
    }
  }
}

// A float tile s [R x K] (row r, ld lds) rounded to bf16 pairs along its rows: out[r * Kw + kp]
// = (s[r, 2kp], s[r, 2kp+1]), for the A operand by rows (P~^T or dS^T times a row-paired B). An odd
// K pairs its last column with 0.
inline void dot_pack_rows(const float* s, int64_t lds, int64_t R, int64_t K, int64_t Kw, uint32_t* out) {
  for (int64_t r = 0; r < R; ++r) {
    const float* sr = s + r * lds;
    uint32_t* o = out + r * Kw;
    for (int64_t kp = 0; kp < K / 2; ++kp) o[kp] = (bf16_high(sr[2 * kp]) >> 16) | bf16_high(sr[2 * kp + 1]);
    if (K % 2) o[K / 2] = bf16_high(sr[K - 1]) >> 16;
  }
}

// One register block: C[kMR x NV vectors] (+)= A[kMR x 2Kp] B[2Kp x NV vectors] in bf16 pairs.
// kBf16DotMode 2 computes what vdpbf16ps does with float instructions, in its order (the two exact
// products summed, then added to the lane), so the dot path runs and is tested on any AVX-512 CPU.
template <int NV, bool TA>
inline void dot_block(const uint32_t* __restrict a, int64_t lda, const uint32_t* __restrict b, int64_t ldb,
                      int64_t Kp, float* __restrict c, int64_t ldc, bool accumulate) {
  __m512 acc[kMR][NV];
  for (int r = 0; r < kMR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = accumulate ? _mm512_loadu_ps(c + r * ldc + 16 * v) : _mm512_setzero_ps();
  for (int64_t kp = 0; kp < Kp; ++kp) {
    __m512i bv[NV];
    for (int v = 0; v < NV; ++v) bv[v] = _mm512_loadu_si512(b + kp * ldb + 16 * v);
    if constexpr (kBf16DotMode == 1) {
      for (int r = 0; r < kMR; ++r) {
        const __m512bh av = (__m512bh)_mm512_set1_epi32(int(TA ? a[kp * lda + r] : a[r * lda + kp]));
        for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], av, (__m512bh)bv[v]);
      }
    } else {
      const __m512i high = _mm512_set1_epi32(int(0xffff0000u));
      __m512 b0[NV], b1[NV];
      for (int v = 0; v < NV; ++v) {
        b0[v] = _mm512_castsi512_ps(_mm512_slli_epi32(bv[v], 16));
        b1[v] = _mm512_castsi512_ps(_mm512_and_si512(bv[v], high));
      }
      for (int r = 0; r < kMR; ++r) {
        const __m512i aw = _mm512_set1_epi32(int(TA ? a[kp * lda + r] : a[r * lda + kp]));
        const __m512 a0 = _mm512_castsi512_ps(_mm512_slli_epi32(aw, 16));
        const __m512 a1 = _mm512_castsi512_ps(_mm512_and_si512(aw, high));
        for (int v = 0; v < NV; ++v)
          acc[r][v] = _mm512_add_ps(acc[r][v], _mm512_fmadd_ps(a0, b0[v], _mm512_mul_ps(a1, b1[v])));
      }
    }
  }
  for (int r = 0; r < kMR; ++r)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(c + r * ldc + 16 * v, acc[r][v]);
}

// C[M x N] (+)= A B over Kp pairs, M a multiple of kMR, N of 16; panels of B outer as in gemm.
template <bool TA = false, class Word>
void dot_gemm(const Word* a, int64_t lda, const Word* b, int64_t ldb, int64_t M, int64_t N, int64_t Kp, float* c,
              int64_t ldc, bool accumulate) {
  const auto arow = [&](int64_t i) { return TA ? a + i : a + i * lda; };
  int64_t n = 0;
  for (; n + 32 <= N; n += 32)
    for (int64_t i = 0; i < M; i += kMR) dot_block<2, TA>(arow(i), lda, b + n, ldb, Kp, c + i * ldc + n, ldc, accumulate);
  for (; n < N; n += 16)
    for (int64_t i = 0; i < M; i += kMR) dot_block<1, TA>(arow(i), lda, b + n, ldb, Kp, c + i * ldc + n, ldc, accumulate);
}
