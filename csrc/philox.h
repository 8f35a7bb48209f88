// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11) and the
// dropout-mask contract of docs/DESIGN.md. This header is the only C++ code that computes Philox.
#pragma once
#include <cstdint>

namespace sckpt {

constexpr uint32_t kPhiloxM0 = 0xD2511F53u;
constexpr uint32_t kPhiloxM1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxW0 = 0x9E3779B9u;
constexpr uint32_t kPhiloxW1 = 0xBB67AE85u;

// Ten rounds on counter c with key (k0, k1); c is replaced by the four output words.
inline void philox4x32_10(uint32_t c[4], uint32_t k0, uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = uint64_t(kPhiloxM0) * c[0];
    const uint64_t p1 = uint64_t(kPhiloxM1) * c[2];
    const uint32_t n0 = uint32_t(p1 >> 32) ^ c[1] ^ k0;
    const uint32_t n2 = uint32_t(p0 >> 32) ^ c[3] ^ k1;
    c[0] = n0;
    c[1] = uint32_t(p1);
    c[2] = n2;
    c[3] = uint32_t(p0);
    k0 += kPhiloxW0;
    k1 += kPhiloxW1;
  }
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
  uint32_t bits = 0;
  for (unsigned t = 0; t < 8; ++t) {
    const uint32_t u = (w[t & 3] >> (16 * (t >> 2))) & 0xffffu;
    bits |= uint32_t(u >= t16) << t;
  }
  return bits;
}

// Attention stream: P[b, h, i, j] uses counter (j >> 3, i, b*H + h, 0).
inline uint32_t attention_keep_bits8(const PhiloxKey& key, uint64_t col_group, uint64_t row,
                                     uint64_t batch_head, uint32_t t16) {
  return keep_bits8(key, uint32_t(col_group), uint32_t(row), uint32_t(batch_head), 0u, t16);
}

// Elementwise stream over [rows, cols]: counter (j >> 3, row & 0xffffffff, row >> 32, 1).
inline uint32_t elementwise_keep_bits8(const PhiloxKey& key, uint64_t col_group, uint64_t row,
                                       uint32_t t16) {
  return keep_bits8(key, uint32_t(col_group), uint32_t(row), uint32_t(row >> 32), 1u, t16);
}

}  // namespace sckpt
