// What each tile attends, for one ISA: masking by bit blending, the padding row, the dropout keep
// factors (one Philox call per 8 keys) and the block-skipping tests. A part of attention_kernels.h,
// compiled inside the ISA's namespace: no #include here.

// exp that keeps NaN (fast_expf clamps it like a large number): a NaN score must poison its row.
inline float exp_nan(float x) {
  const float e = fast_expf(x);
  uint32_t xb, eb;
  std::memcpy(&xb, &x, 4);
  std::memcpy(&eb, &e, 4);
  const uint32_t nan = 0u - uint32_t((xb & 0x7fffffffu) > 0x7f800000u);
  eb = (eb & ~nan) | (xb & nan);
  float r;
  std::memcpy(&r, &eb, 4);
  return r;
}
inline double exp_nan(double x) { return std::exp(x); }

// v if on, else -inf, by bit blending (vectorises without float compares).
inline float or_neg_inf(bool on, float v) {
  uint32_t b;
  std::memcpy(&b, &v, 4);
  const uint32_t mask = 0u - uint32_t(on);
  b = (b & mask) | (0xff800000u & ~mask);
  float r;
  std::memcpy(&r, &b, 4);
  return r;
}
inline double or_neg_inf(bool on, double v) { return on ? v : -std::numeric_limits<double>::infinity(); }

// v if on, else +0 (also when v is NaN: a masked entry contributes nothing).
inline float or_zero(bool on, float v) {
  uint32_t b;
  std::memcpy(&b, &v, 4);
  b &= 0u - uint32_t(on);
  float r;
  std::memcpy(&r, &b, 4);
  return r;
}
inline double or_zero(bool on, double v) { return on ? v : 0.0; }

// Attention-logit soft-capping (Gemma 2): each of `count` raw scores s = q . k becomes
// cap * tanh(scale * s / cap), the softmax scale folded in (the row loops then scale by 1). With
// dcap, 1 - tanh^2 = d(capped score) / d(scaled score) lands there for the backward (scale_by).
// A NaN score's factor is 0, so a masked entry's dS stays 0 (an attended NaN is in dS already).
inline float tanh_of(float x) { return fast_tanhf(x); }
inline double tanh_of(double x) { return std::tanh(x); }
inline bool is_nan_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return (u & 0x7fffffffu) > 0x7f800000u;
}
inline bool is_nan_bits(double x) { return std::isnan(x); }
template <class Acc>
inline void softcap_tile(Acc* s, int64_t count, Acc scale, Acc cap, Acc* dcap) {
  const Acc f = scale / cap;
  for (int64_t i = 0; i < count; ++i) {
    const Acc t = tanh_of(s[i] * f);
    s[i] = cap * t;
    if (dcap != nullptr) {
      const Acc d = Acc(1) - t * t;
      dcap[i] = or_zero(!is_nan_bits(d), d);
    }
  }
}

// x[i] *= f[i]: the gradient by the capped scores turned into the gradient by the scaled ones.
template <class Acc>
inline void scale_by(Acc* x, const Acc* f, int64_t count) {
  for (int64_t i = 0; i < count; ++i) x[i] *= f[i];
}

// padv[c] = key j0 + c may be attended under the padding mask (c < nk), 0 past nk up to ncols.
inline void pad_row(const Problem& p, int64_t b, int64_t j0, int64_t nk, int64_t ncols, uint8_t* padv) {
  for (int64_t c = 0; c < nk; ++c) padv[c] = p.pad ? uint8_t(p.pad[b * p.Sk + j0 + c] != 0) : uint8_t(1);
  for (int64_t c = nk; c < ncols; ++c) padv[c] = 0;
}

// kDrawLanes Philox calls side by side, lane l drawing group g0 + l * dg of row row0 + l * drow
// (philox.h): 16 with AVX-512, 8 with AVX2 (both written out), 8 vectorised by the compiler else.
constexpr int64_t kDrawLanes = kVecBytes == 64 ? 16 : 8;
inline void draw_keep_bits(const PhiloxKey& key, uint64_t g0, uint64_t dg, uint64_t row0, uint64_t drow, uint64_t bh,
                           uint32_t t16, uint32_t* bits) {
#if defined(__x86_64__) && defined(__GNUC__)
  if constexpr (kVecBytes == 64) {
    attention_keep_bits8_x16(key, g0, dg, row0, drow, bh, t16, bits);
    return;
  } else if constexpr (kVecBytes == 32) {
    attention_keep_bits8_x8(key, g0, dg, row0, drow, bh, t16, bits);
    return;
  }
#endif
  static_assert(kDrawLanes == kPhiloxLanes || kVecBytes > 16, "the portable draw has kPhiloxLanes lanes");
  attention_keep_bits8_lanes(key, g0, dg, row0, drow, bh, t16, bits);
}

// The dropout bits of a tile: bit t of bits[g * ld + c] says whether P[b, h, i0 + c, j0 + 8 g + t]
// survives (the Philox row is the key position i0 + c + q_offset, so a query tile draws its rows' bits), for every key below j0 + nk (j0 a multiple of 8) and query c < n, attended or not (the
// callers mask separately); 0 for the padding queries n <= c < ld. The draws run over queries,
// kDrawLanes at a time, which fills the vector whatever the tile's width in keys.
// Out of line: it runs once per tile and would only grow the callers' hot loops.
__attribute__((noinline)) inline void keep_tile_bits(const Problem& p, int64_t bh, int64_t i0, int64_t n,
                                                     int64_t j0, int64_t nk, int64_t ld, uint32_t* bits) {
  for (int64_t g = 0; g * 8 < nk; ++g) {
    uint32_t* row = bits + g * ld;
    for (int64_t c = 0; c < n; c += kDrawLanes) {
      uint32_t lanes[kDrawLanes];
      draw_keep_bits(p.key, uint64_t((j0 >> 3) + g), 0, uint64_t(i0 + c + p.q_offset), 1, uint64_t(bh), p.t16,
                     lanes);
      for (int64_t l = 0; l < kDrawLanes && c + l < n; ++l) row[c + l] = lanes[l];
    }
    for (int64_t c = n; c < ld; ++c) row[c] = 0u;
  }
}

// keep[c] = the keep factor of key j0 + c for query row r of a tile whose bits keep_tile_bits drew
// with leading dimension ld, for c < nk: one row unpacked for contiguous use.
template <class Acc>
inline void keep_row_of(const uint32_t* bits, int64_t ld, int64_t r, int64_t nk, Acc keep_scale, Acc* keep) {
  for (int64_t g = 0; g * 8 < nk; ++g) {
    const uint32_t word = bits[g * ld + r];
    for (int64_t t = 0; t < 8; ++t) keep[g * 8 + t] = ((word >> t) & 1u) ? keep_scale : Acc(0);
  }
}

// The keep factor of one entry from its dropout bit: keep_scale or 0 (a product, so NaN stays NaN).
template <class Acc>
inline Acc keep_factor(uint32_t bits, int64_t t, Acc keep_scale) {
  return ((bits >> t) & 1u) ? keep_scale : Acc(0);
}

// Query rows i0 .. i0 + n: ranges, lse, delta per column c (columns n..N attend nothing).
template <class Acc>
inline bool query_cols(const Problem& p, int64_t bh, int64_t i0, int64_t n, int64_t N, bool with_lse, int64_t* lo,
                       int64_t* hi, Acc* lse, Acc* delta) {
  bool any = false;
  for (int64_t c = 0; c < N; ++c) {
    if (c < n) {
      p.row_range(i0 + c, lo[c], hi[c]);
      if (with_lse) {
        lse[c] = Acc(p.lse_in[bh * p.Sq + i0 + c]);
        delta[c] = Acc(p.delta[bh * p.Sq + i0 + c]);
        if (lse[c] == std::numeric_limits<Acc>::infinity()) hi[c] = lo[c];  // an empty row: zero gradient
      }
    } else {
      lo[c] = hi[c] = 0;
      if (with_lse) lse[c] = delta[c] = Acc(0);
    }
    any |= lo[c] < hi[c];
  }
  return any;
}

// Does every query column c < n attend every key in [j0, j1) (no padding mask)? Then the tile
// needs no masking: columns past n hold garbage that is never stored.
inline bool tile_full(const Problem& p, const int64_t* lo, const int64_t* hi, int64_t n, int64_t j0, int64_t j1) {
  if (p.pad != nullptr) return false;
  bool full = true;
  for (int64_t c = 0; c < n; ++c) full &= lo[c] <= j0 && hi[c] >= j1;
  return full;
}

// Does any of the query columns attend a key in [j0, j1)?
inline bool tile_attended(const int64_t* lo, const int64_t* hi, int64_t n, int64_t j0, int64_t j1) {
  bool any = false;
  for (int64_t c = 0; c < n; ++c) any |= lo[c] < j1 && hi[c] > j0 && lo[c] < hi[c];
  return any;
}
