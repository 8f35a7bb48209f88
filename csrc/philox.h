// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11) and the
// dropout-mask contract of docs/DESIGN.md. This header is the only C++ code that computes Philox.
#pragma once
#include <cstdint>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace sckpt {

constexpr uint32_t kPhiloxM0 = 0xD2511F53u;
constexpr uint32_t kPhiloxM1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxW0 = 0x9E3779B9u;
constexpr uint32_t kPhiloxW1 = 0xBB67AE85u;

// One round on counter words (c0, c1, c2, c3) with round key (k0, k1).
inline void philox_round(uint32_t& c0, uint32_t& c1, uint32_t& c2, uint32_t& c3, uint32_t k0, uint32_t k1) {
  const uint64_t p0 = uint64_t(kPhiloxM0) * c0;
  const uint64_t p1 = uint64_t(kPhiloxM1) * c2;
  c0 = uint32_t(p1 >> 32) ^ c1 ^ k0;
  c1 = uint32_t(p1);
  c2 = uint32_t(p0 >> 32) ^ c3 ^ k1;
  c3 = uint32_t(p0);
}

// Ten rounds on counter c with key (k0, k1); c is replaced by the four output words.
inline void philox4x32_10(uint32_t c[4], uint32_t k0, uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    philox_round(c[0], c[1], c[2], c[3], k0, k1);
    k0 += kPhiloxW0;
    k1 += kPhiloxW1;
  }
}

// u[t] >= t16 for the eight 16-bit values of one call's words, as bit t.
inline uint32_t keep_bits_of(uint32_t w0, uint32_t w1, uint32_t w2, uint32_t w3, uint32_t t16) {
  const uint32_t w[4] = {w0, w1, w2, w3};
  uint32_t bits = 0;
  for (unsigned t = 0; t < 8; ++t) bits |= uint32_t(((w[t & 3] >> (16 * (t >> 2))) & 0xffffu) >= t16) << t;
  return bits;
}

// The seed's key: (seed & 0xffffffff, seed >> 32).
struct PhiloxKey {
  uint32_t k0, k1;
  explicit PhiloxKey(uint64_t seed) : k0(uint32_t(seed)), k1(uint32_t(seed >> 32)) {}
  // From a seed tensor: int32 [2] holding the low and high words (selective_ckpt.rng.seed_arg).
  // A null pointer (dropout off) gives key 0 and is never read.
  static PhiloxKey from_tensor(uintptr_t seed) {
    const int32_t* words = reinterpret_cast<const int32_t*>(seed);
    return PhiloxKey(words ? (uint64_t(uint32_t(words[0])) | (uint64_t(uint32_t(words[1])) << 32)) : 0);
  }
};

// One Philox call covers 8 consecutive columns: u[t] = (w[t & 3] >> (16 * (t >> 2))) & 0xffff.
// Returns bit t set iff u[t] >= t16, i.e. column 8*group + t is kept.
inline uint32_t keep_bits8(const PhiloxKey& key, uint32_t c0, uint32_t c1, uint32_t c2,
                           uint32_t c3, uint32_t t16) {
  uint32_t w[4] = {c0, c1, c2, c3};
  philox4x32_10(w, key.k0, key.k1);
  return keep_bits_of(w[0], w[1], w[2], w[3], t16);
}

// Attention stream: P[b, h, i, j] uses counter (j >> 3, i, b*H + h, 0). This gives the keep bits of
// kPhiloxLanes calls side by side: lane l draws column group g0 + l * dg of row row0 + l * drow
// (bits[l]). The lanes run with fixed trip counts, so the compiler vectorises the rounds in each of
// the attention kernels' ISA variants (8 widening multiplies in two AVX2 instructions).
constexpr int kPhiloxLanes = 8;

// The keep bits of kPhiloxLanes Philox calls on counters (c0[l], c1[l], c2[l], c3[l]), side by side.
inline void keep_bits8_lanes(const PhiloxKey& key, uint32_t c0[kPhiloxLanes], uint32_t c1[kPhiloxLanes],
                             uint32_t c2[kPhiloxLanes], uint32_t c3[kPhiloxLanes], uint32_t t16,
                             uint32_t bits[kPhiloxLanes]) {
  uint32_t k0 = key.k0, k1 = key.k1;
  for (int round = 0; round < 10; ++round) {
#pragma omp simd
    for (int l = 0; l < kPhiloxLanes; ++l) philox_round(c0[l], c1[l], c2[l], c3[l], k0, k1);
    k0 += kPhiloxW0;
    k1 += kPhiloxW1;
  }
#pragma omp simd
  for (int l = 0; l < kPhiloxLanes; ++l) bits[l] = keep_bits_of(c0[l], c1[l], c2[l], c3[l], t16);
}

inline void attention_keep_bits8_lanes(const PhiloxKey& key, uint64_t g0, uint64_t dg, uint64_t row0,
                                       uint64_t drow, uint64_t batch_head, uint32_t t16,
                                       uint32_t bits[kPhiloxLanes]) {
  uint32_t c0[kPhiloxLanes], c1[kPhiloxLanes], c2[kPhiloxLanes], c3[kPhiloxLanes];
  for (int l = 0; l < kPhiloxLanes; ++l) {
    c0[l] = uint32_t(g0 + uint64_t(l) * dg);
    c1[l] = uint32_t(row0 + uint64_t(l) * drow);
    c2[l] = uint32_t(batch_head);
    c3[l] = 0u;
  }
  keep_bits8_lanes(key, c0, c1, c2, c3, t16, bits);
}

#if defined(__x86_64__) && defined(__GNUC__)
// GCC 12 flags the undefined pass-through operand inside its own AVX-512 intrinsics as maybe
// uninitialised once they are inlined; nothing here reads an uninitialised value.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// The same draws with the widening multiplies written out, 16 calls per AVX-512 and 8 per AVX2
// instruction stream (compilers do not find this form): vpmuludq multiplies the even 32-bit lanes,
// the odd lanes go through a 64-bit shift, and the high and low words are blended back. Bit for bit
// attention_keep_bits8_lanes (tests/ops/test_attention_kernel_cpp.py checks every ISA).
__attribute__((target("avx512f"))) inline void philox_mul_x16(__m512i x, uint32_t m, __m512i& hi, __m512i& lo) {
  const __m512i mv = _mm512_set1_epi64(int64_t(m));
  const __m512i even = _mm512_mul_epu32(x, mv), odd = _mm512_mul_epu32(_mm512_srli_epi64(x, 32), mv);
  hi = _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(even, 32), odd);
  lo = _mm512_mask_blend_epi32(0xAAAA, even, _mm512_slli_epi64(odd, 32));
}

__attribute__((target("avx512f"))) inline void attention_keep_bits8_x16(const PhiloxKey& key, uint64_t g0, uint64_t dg,
                                                                       uint64_t row0, uint64_t drow,
                                                                       uint64_t batch_head, uint32_t t16,
                                                                       uint32_t bits[16]) {
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512i c0 = _mm512_add_epi32(_mm512_set1_epi32(int32_t(g0)), _mm512_mullo_epi32(iota, _mm512_set1_epi32(int32_t(dg))));
  __m512i c1 = _mm512_add_epi32(_mm512_set1_epi32(int32_t(row0)), _mm512_mullo_epi32(iota, _mm512_set1_epi32(int32_t(drow))));
  __m512i c2 = _mm512_set1_epi32(int32_t(batch_head)), c3 = _mm512_setzero_si512();
  uint32_t k0 = key.k0, k1 = key.k1;
  for (int round = 0; round < 10; ++round) {
    __m512i h0, l0, h1, l1;
    philox_mul_x16(c0, kPhiloxM0, h0, l0);
    philox_mul_x16(c2, kPhiloxM1, h1, l1);
    c0 = _mm512_ternarylogic_epi32(h1, c1, _mm512_set1_epi32(int32_t(k0)), 0x96);  // three-way xor
    c2 = _mm512_ternarylogic_epi32(h0, c3, _mm512_set1_epi32(int32_t(k1)), 0x96);
    c1 = l1;
    c3 = l0;
    k0 += kPhiloxW0;
    k1 += kPhiloxW1;
  }
  const __m512i t = _mm512_set1_epi32(int32_t(t16)), low = _mm512_set1_epi32(0xffff);
  const __m512i w[4] = {c0, c1, c2, c3};
  __m512i b = _mm512_setzero_si512();
  for (int q = 0; q < 4; ++q) {  // u[q] is w[q]'s low half, u[q + 4] its high half
    b = _mm512_mask_or_epi32(b, _mm512_cmpge_epu32_mask(_mm512_and_si512(w[q], low), t), b, _mm512_set1_epi32(1 << q));
    b = _mm512_mask_or_epi32(b, _mm512_cmpge_epu32_mask(_mm512_srli_epi32(w[q], 16), t), b,
                             _mm512_set1_epi32(1 << (q + 4)));
  }
  _mm512_storeu_si512(bits, b);
}

__attribute__((target("avx2"))) inline void philox_mul_x8(__m256i x, uint32_t m, __m256i& hi, __m256i& lo) {
  const __m256i mv = _mm256_set1_epi64x(int64_t(m));
  const __m256i even = _mm256_mul_epu32(x, mv), odd = _mm256_mul_epu32(_mm256_srli_epi64(x, 32), mv);
  hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
  lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
}

__attribute__((target("avx2"))) inline void attention_keep_bits8_x8(const PhiloxKey& key, uint64_t g0, uint64_t dg,
                                                                   uint64_t row0, uint64_t drow, uint64_t batch_head,
                                                                   uint32_t t16, uint32_t bits[8]) {
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256i c0 = _mm256_add_epi32(_mm256_set1_epi32(int32_t(g0)), _mm256_mullo_epi32(iota, _mm256_set1_epi32(int32_t(dg))));
  __m256i c1 = _mm256_add_epi32(_mm256_set1_epi32(int32_t(row0)), _mm256_mullo_epi32(iota, _mm256_set1_epi32(int32_t(drow))));
  __m256i c2 = _mm256_set1_epi32(int32_t(batch_head)), c3 = _mm256_setzero_si256();
  uint32_t k0 = key.k0, k1 = key.k1;
  for (int round = 0; round < 10; ++round) {
    __m256i h0, l0, h1, l1;
    philox_mul_x8(c0, kPhiloxM0, h0, l0);
    philox_mul_x8(c2, kPhiloxM1, h1, l1);
    c0 = _mm256_xor_si256(_mm256_xor_si256(h1, c1), _mm256_set1_epi32(int32_t(k0)));
    c2 = _mm256_xor_si256(_mm256_xor_si256(h0, c3), _mm256_set1_epi32(int32_t(k1)));
    c1 = l1;
    c3 = l0;
    k0 += kPhiloxW0;
    k1 += kPhiloxW1;
  }
  const __m256i t = _mm256_set1_epi32(int32_t(t16)), low = _mm256_set1_epi32(0xffff);
  const __m256i w[4] = {c0, c1, c2, c3};
  __m256i b = _mm256_setzero_si256();
  for (int q = 0; q < 4; ++q) {  // x >= t as max(x, t) == x (AVX2 has no unsigned compare)
    const __m256i lo16 = _mm256_and_si256(w[q], low), hi16 = _mm256_srli_epi32(w[q], 16);
    const __m256i klo = _mm256_cmpeq_epi32(_mm256_max_epu32(lo16, t), lo16);
    const __m256i khi = _mm256_cmpeq_epi32(_mm256_max_epu32(hi16, t), hi16);
    b = _mm256_or_si256(b, _mm256_and_si256(klo, _mm256_set1_epi32(1 << q)));
    b = _mm256_or_si256(b, _mm256_and_si256(khi, _mm256_set1_epi32(1 << (q + 4))));
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(bits), b);
}
#pragma GCC diagnostic pop
#endif

// Elementwise stream over [rows, cols]: counter (j >> 3, row & 0xffffffff, row >> 32, 1). The keep bits of
// column groups g0 ... g0 + kPhiloxLanes - 1 of one row, side by side (bits[l]: group g0 + l).
inline void elementwise_keep_bits8_lanes(const PhiloxKey& key, uint64_t g0, uint64_t row, uint32_t t16,
                                         uint32_t bits[kPhiloxLanes]) {
  uint32_t c0[kPhiloxLanes], c1[kPhiloxLanes], c2[kPhiloxLanes], c3[kPhiloxLanes];
  for (int l = 0; l < kPhiloxLanes; ++l) {
    c0[l] = uint32_t(g0 + uint64_t(l));
    c1[l] = uint32_t(row);
    c2[l] = uint32_t(row >> 32);
    c3[l] = 1u;
  }
  keep_bits8_lanes(key, c0, c1, c2, c3, t16, bits);
}

}  // namespace sckpt
