// The backward passes of one ISA: delta, then either one pass per (batch, kv head) that forms each
// score tile once and adds it into dQ, dK and dV (dq_tile with dK/dV accumulators: 5 tile products),
// or two passes, dQ per query tile and dK/dV per key tile (7 tile products, more tasks). A part of
// attention_kernels.h, compiled inside the ISA's namespace: no #include here.

// delta[b, h, i] = sum_d dO * O in Acc (O as stored, so it includes the dropout).
//
// The sinks' gradient is d s_h = -sum_i P_sink_i D_i with P_sink_i = exp(s_h - lse_i) and D_i the exact
// sum_j P_ij keep_ij dP_ij (a unit of s_h moves O_i by -P_sink_i O_i). delta, from O rounded to the
// input dtype, is D only to that rounding, which a sum over every row of the batch would gather; so D_i
// is taken as rowsum_j dS_ij + delta_i (1 - P_sink_i) (dS_ij = P_ij (keep_ij dP_ij - delta_i) and
// sum_j P_ij = 1 - P_sink_i), with the row sums of dS from the dQ tiles, in fp32 from unrounded P and dP.
// Here sink[bh] gets the delta part, -sum_i P_sink_i (1 - P_sink_i) delta_i; dq_tile adds the rest.
// Empty rows (lse = +inf) add 0.
template <class T>
void delta_rows(const Problem& p, int64_t bh, float* delta, double* sink) {
  using Acc = typename Elem<T>::Acc;
  const int64_t b = bh / p.H, h = bh % p.H;
  const T* ob = static_cast<const T*>(p.o_in) + b * p.os[0] + h * p.os[1];
  const T* db = static_cast<const T*>(p.dout) + bh * p.Sq * p.Dv;
  for (int64_t i = 0; i < p.Sq; ++i) {
    const T *orow = ob + i * p.os[2], *drow = db + i * p.Dv;
    Acc s = 0;
    for (int64_t d = 0; d < p.Dv; ++d) s = madd(Acc(Elem<T>::load(orow + d)), Acc(Elem<T>::load(drow + d)), s);
    delta[bh * p.Sq + i] = float(s);
  }
  if (p.sinks == nullptr) return;
  const double sh = p.sinks[h];
  double g = 0;
  for (int64_t i = 0; i < p.Sq; ++i) {
    const double lse = p.lse_in[bh * p.Sq + i];
    if (lse == std::numeric_limits<double>::infinity()) continue;
    const double ps = std::exp(sh - lse);
    g -= ps * (1 - ps) * double(delta[bh * p.Sq + i]);
  }
  sink[bh] = g;
}

// dS^T = P^T * (dP^T * keep - delta) over key row r of a dQ tile (N query columns), P^T from the
// scores s: in a full tile every entry is attended; otherwise by the ranges and padding. With kP
// (the single pass) s becomes the dropped-out P~^T = P^T * keep, for dV. Specialised, so that the
// loops without dropout, masks or P carry none of them.
template <bool kFull, bool kDrop, bool kP, class Acc>
inline void dq_row(Acc* s, Acc* dp, int64_t N, int64_t j, bool pj, const int64_t* lo, const int64_t* hi,
                   const Acc* lse, const Acc* delta, Acc scale, const uint32_t* kb, int64_t t, Acc ks) {
  for (int64_t c = 0; c < N; ++c) {
    const Acc kf = kDrop ? keep_factor(kb[c], t, ks) : Acc(1);
    if (kFull) {
      const Acc pr = exp_nan(s[c] * scale - lse[c]);
      dp[c] = pr * (dp[c] * kf - delta[c]);
      if (kP) s[c] = pr * kf;
    } else {
      const bool on = pj & (j >= lo[c]) & (j < hi[c]);
      const Acc pr = exp_nan(or_neg_inf(on, s[c] * scale - lse[c]));
      dp[c] = or_zero(on, pr * (dp[c] * kf - delta[c]));
      if (kP) s[c] = or_zero(on, pr * kf);
    }
  }
}

template <class Acc>
using DqRow = void (*)(Acc*, Acc*, int64_t, int64_t, bool, const int64_t*, const int64_t*, const Acc*, const Acc*,
                       Acc, const uint32_t*, int64_t, Acc);

template <bool kP, class Acc>
DqRow<Acc> dq_row_for(bool full, bool drop) {
  return full ? (drop ? &dq_row<true, true, kP, Acc> : &dq_row<true, false, kP, Acc>)
              : (drop ? &dq_row<false, true, kP, Acc> : &dq_row<false, false, kP, Acc>);
}

// dQ of one query tile of one head: dQ = scale * sum over key tiles of dS K. Like the forward,
// S^T and dP^T are formed key-major from Q^T and dO^T, transposed once per tile. With dK and dV
// (the single pass: accumulators of this tile's kv head for keys jlo..jhi, row 0 = key jlo) it
// visits only the key tiles in [jlo, jhi) and also adds P~^T dO into dV and dS^T Q into dK from
// the same tiles; with `part` it leaves its unscaled partial dQ there (rows [bh, i0.., Dp]) for the
// caller to sum over key chunks, instead of storing dQ. With sinks it leaves its share of their
// gradient, -sum_i P_sink_i rowsum_j dS_ij over its rows and keys, in p.sink_part (see delta_rows).
template <class T>
void dq_tile(const Problem& p, int64_t b, int64_t h, int64_t t, Work<typename Elem<T>::Acc>& w,
             typename Elem<T>::Acc* dK, typename Elem<T>::Acc* dV, int64_t jlo, int64_t jhi,
             typename Elem<T>::Acc* part, int64_t chunk) {
  using Acc = typename Elem<T>::Acc;
  const int64_t D = p.D, Dp = p.Dp, Dv = p.Dv, Dvp = p.Dvp, BN = p.BN, kvh = h / p.G, bh = b * p.H + h;
  const int64_t i0 = t * p.BM, n = std::min(p.BM, p.Sq - i0), M = round_up(n, kMR), N = round_up(n, 16);
  const Acc scale = Acc(p.scale);
  const bool capped = p.softcap > 0;
  const Acc sscale = capped ? Acc(1) : scale;  // soft-capping folds the scale into the capped scores
  Acc *Qt = w.a.data(), *dOt = w.b.data(), *Kn = w.c.data(), *Vn = w.d.data();
  Acc *St = w.f.data(), *dPt = w.g.data(), *dQ = w.acc.data();
  uint32_t* kbits = w.keepbits.data();
  const Acc ks = Acc(p.keep_scale);
  Acc *lse = w.m.data(), *delta = w.l.data();
  int64_t *lo = w.lo.data(), *hi = w.hi.data();
  uint8_t* padv = w.padv.data();
  // the bf16 dot path's operands (attention_dot.h)
  const int64_t Dw = Dp / 2, Dvw = Dvp / 2;
  uint32_t *Qw = w.words[0].data(), *dOw = w.words[1].data(), *Kw = w.words[2].data(), *Vw = w.words[3].data();
  uint32_t *Kpw = w.words[4].data(), *dSw = w.words[5].data();
  // the single pass's operands: Q and dO as rows (float path) or paired along queries (dot path)
  const bool fused = dK != nullptr;
  const int64_t tile = int64_t(w.acc.size() / 3), Nw = N / 2;
  Acc *Qn = w.acc.data() + tile, *dOn = w.acc.data() + 2 * tile;
  uint32_t *Qpw = w.words[6].data(), *dOpw = w.words[7].data(), *Pw = w.words[8].data(), *dSw2 = w.words[9].data();

  std::memset(static_cast<void*>(dQ), 0, size_t(M * Dp) * sizeof(Acc));
  const bool any_row = query_cols(p, bh, i0, n, N, true, lo, hi, lse, delta);
  Acc* dsum = w.rowv.data();  // with sinks: rowsum_j dS per query column
  if (p.sinks != nullptr) std::fill(dsum, dsum + N, Acc(0));
  int64_t klo = p.Sk, khi = 0;
  for (int64_t c = 0; c < n; ++c)
    if (lo[c] < hi[c]) klo = std::min(klo, lo[c]), khi = std::max(khi, hi[c]);
  if (any_row) {
    const T* qrows = static_cast<const T*>(p.q) + b * p.qs[0] + h * p.qs[1] + i0 * p.qs[2];
    const T* dorows = static_cast<const T*>(p.dout) + (bh * p.Sq + i0) * Dv;
    if constexpr (kDot<T>) {
      dot_cols(qrows, p.qs[2], n, N, D, Dw, Qw);
      dot_cols(dorows, Dv, n, N, Dv, Dvw, dOw);
      if (fused) {
        dot_row_pairs(qrows, p.qs[2], n, D, Dp, Qpw);
        dot_row_pairs(dorows, Dv, n, Dv, Dvp, dOpw);
      }
    } else {
      load_rows_t(qrows, p.qs[2], n, N, D, Qt);
      load_rows_t(dorows, Dv, n, N, Dv, dOt);
      if (fused) {
        load_rows(qrows, p.qs[2], n, n, D, Dp, Qn);
        load_rows(dorows, Dv, n, n, Dv, Dvp, dOn);
      }
    }
  }
  const T* kb = static_cast<const T*>(p.k) + b * p.ks[0] + kvh * p.ks[1];
  const T* vb = static_cast<const T*>(p.v) + b * p.vs[0] + kvh * p.vs[1];
  khi = std::min(khi, jhi);
  for (int64_t j0 = any_row ? std::max(klo / BN * BN, jlo) : khi; j0 < khi; j0 += BN) {
    const int64_t nk = std::min(BN, p.Sk - j0), MK = round_up(nk, kMR);
    if (!tile_attended(lo, hi, n, j0, j0 + nk)) continue;
    if constexpr (kDot<T>) {
      dot_rows(kb + j0 * p.ks[2], p.ks[2], nk, MK, D, Dw, Kw);
      dot_rows(vb + j0 * p.vs[2], p.vs[2], nk, MK, Dv, Dvw, Vw);
      dot_row_pairs(kb + j0 * p.ks[2], p.ks[2], nk, D, Dp, Kpw);
      dot_gemm(Kw, Dw, Qw, N, MK, N, Dw, St, N, false);
      dot_gemm(Vw, Dvw, dOw, N, MK, N, Dvw, dPt, N, false);
    } else {
      load_rows(kb + j0 * p.ks[2], p.ks[2], nk, MK, D, Dp, Kn);
      load_rows(vb + j0 * p.vs[2], p.vs[2], nk, MK, Dv, Dvp, Vn);
      gemm(Kn, Dp, Qt, N, MK, N, D, St, N, false);   // S^T = K Q^T
      gemm(Vn, Dvp, dOt, N, MK, N, Dv, dPt, N, false);  // dP^T = V dO^T
    }
    if (capped) softcap_tile(St, nk * N, scale, Acc(p.softcap), w.capf.data());
    pad_row(p, b, j0, nk, nk, padv);
    if (p.t16) keep_tile_bits(p, bh, i0, n, j0, nk, N, kbits);
    const bool full = tile_full(p, lo, hi, n, j0, j0 + nk);
    const DqRow<Acc> row = fused ? dq_row_for<true, Acc>(full, p.t16) : dq_row_for<false, Acc>(full, p.t16);
    for (int64_t r = 0; r < nk; ++r)
      row(St + r * N, dPt + r * N, N, j0 + r, padv[r] != 0, lo, hi, lse, delta, sscale, kbits + (r >> 3) * N, r & 7, ks);
    if (p.sinks != nullptr)  // dS of the softmax's logits, before a soft cap's factor
      for (int64_t r = 0; r < nk; ++r)
        for (int64_t c = 0; c < N; ++c) dsum[c] += dPt[r * N + c];
    if (capped) scale_by(dPt, w.capf.data(), nk * N);  // dS by the scaled scores, for dQ and dK
    // the single pass: dV += P~^T dO and dK += dS^T Q over this tile's n queries. Rows nk..MK of
    // S^T and dP^T are products with the zero rows past nk: they add 0 into rows past the tile.
    if (fused) {
      if constexpr (kDot<T>) {
        dot_pack_rows(St, N, MK, n, Nw, Pw);
        dot_pack_rows(dPt, N, MK, n, Nw, dSw2);
        dot_gemm(Pw, Nw, dOpw, Dvp, MK, Dvp, (n + 1) / 2, dV + (j0 - jlo) * Dvp, Dvp, true);
        dot_gemm(dSw2, Nw, Qpw, Dp, MK, Dp, (n + 1) / 2, dK + (j0 - jlo) * Dp, Dp, true);
      } else {
        gemm(St, N, dOn, Dvp, MK, Dvp, n, dV + (j0 - jlo) * Dvp, Dvp, true);
        gemm(dPt, N, Qn, Dp, MK, Dp, n, dK + (j0 - jlo) * Dp, Dp, true);
      }
    }
    if constexpr (kDot<T>) {  // dQ += dS K, dS rounded to bf16 pairs along keys
      dot_pack_pairs(dPt, N, nk, N, dSw);
      dot_gemm<true>(dSw, N, Kpw, Dp, M, Dp, (nk + 1) / 2, dQ, Dp, true);
    } else {
      gemm<true>(dPt, N, Kn, Dp, M, Dp, nk, dQ, Dp, true);  // dQ += dS K, dS read from dS^T
    }
  }
  if (p.sinks != nullptr) {  // columns past n are never read: a full tile leaves garbage there
    const double sh = p.sinks[h];
    double g = 0;
    for (int64_t c = 0; c < n; ++c)
      if (lse[c] != std::numeric_limits<Acc>::infinity()) g -= std::exp(sh - double(lse[c])) * double(dsum[c]);
    p.sink_part[(chunk * p.B * p.H + bh) * ((p.Sq + p.BM - 1) / p.BM) + t] = g;
  }
  if (part != nullptr) {
    std::memcpy(static_cast<void*>(part + (bh * p.Sq + i0) * Dp), dQ, size_t(n * Dp) * sizeof(Acc));
    return;
  }
  T* out = static_cast<T*>(p.dq) + (bh * p.Sq + i0) * D;
  for (int64_t r = 0; r < n; ++r)
    for (int64_t d = 0; d < D; ++d) Elem<T>::store(out + r * D + d, dQ[r * Dp + d] * scale);
}

// Stores rows [j0, j0 + n) of one kv head's dK (scaled; rows Dp apart in Acc) and dV (rows Dvp apart).
template <class T>
void store_dkdv(const Problem& p, int64_t b, int64_t kvh, int64_t j0, int64_t n, const typename Elem<T>::Acc* dK,
                const typename Elem<T>::Acc* dV) {
  using Acc = typename Elem<T>::Acc;
  const Acc scale = Acc(p.scale);
  T* dkb = static_cast<T*>(p.dk) + ((b * p.Hkv + kvh) * p.Sk + j0) * p.D;
  T* dvb = static_cast<T*>(p.dv) + ((b * p.Hkv + kvh) * p.Sk + j0) * p.Dv;
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t d = 0; d < p.D; ++d) Elem<T>::store(dkb + r * p.D + d, dK[r * p.Dp + d] * scale);
    for (int64_t d = 0; d < p.Dv; ++d) Elem<T>::store(dvb + r * p.Dv + d, dV[r * p.Dvp + d]);
  }
}

// dK, dV of one key tile of one kv head, summed over the query heads of its group in order. K^T
// and V^T are transposed once per task; the query tiles are read as rows.
template <class T>
void dkv_tile(const Problem& p, int64_t b, int64_t kvh, int64_t t, Work<typename Elem<T>::Acc>& w) {
  using Acc = typename Elem<T>::Acc;
  const int64_t D = p.D, Dp = p.Dp, Dv = p.Dv, Dvp = p.Dvp, BM = p.BM;
  const int64_t j0 = t * p.BN, nk = std::min(p.BN, p.Sk - j0), j1 = j0 + nk;
  const int64_t MK = round_up(nk, kMR), NK = round_up(nk, 16);
  const Acc scale = Acc(p.scale), inf = std::numeric_limits<Acc>::infinity();
  const bool capped = p.softcap > 0;
  const Acc sscale = capped ? Acc(1) : scale;  // soft-capping folds the scale into the capped scores
  Acc *Kt = w.a.data(), *Vt = w.b.data(), *Qn = w.c.data(), *dOn = w.d.data();
  Acc *S = w.e.data(), *dP = w.f.data(), *keep = w.keep.data();
  uint32_t* kbits = w.keepbits.data();
  const Acc ks = Acc(p.keep_scale);
  const int64_t tile = int64_t(w.acc.size() / 3);
  Acc *dK = w.acc.data(), *dV = dK + tile;
  int64_t *lo = w.lo.data(), *hi = w.hi.data();
  uint8_t* padv = w.padv.data();
  // the bf16 dot path's operands (attention_dot.h)
  const int64_t Dw = Dp / 2, Dvw = Dvp / 2;
  uint32_t *Kw = w.words[0].data(), *Vw = w.words[1].data(), *Qw = w.words[2].data(), *dOw = w.words[3].data();
  uint32_t *Qpw = w.words[4].data(), *dOpw = w.words[5].data(), *Pw = w.words[6].data(), *dSw = w.words[7].data();

  const T* kb = static_cast<const T*>(p.k) + b * p.ks[0] + kvh * p.ks[1] + j0 * p.ks[2];
  const T* vb = static_cast<const T*>(p.v) + b * p.vs[0] + kvh * p.vs[1] + j0 * p.vs[2];
  if constexpr (kDot<T>) {
    dot_cols(kb, p.ks[2], nk, NK, D, Dw, Kw);
    dot_cols(vb, p.vs[2], nk, NK, Dv, Dvw, Vw);
  } else {
    load_rows_t(kb, p.ks[2], nk, NK, D, Kt);
    load_rows_t(vb, p.vs[2], nk, NK, Dv, Vt);
  }
  pad_row(p, b, j0, nk, NK, padv);
  std::memset(static_cast<void*>(dK), 0, size_t(MK * Dp) * sizeof(Acc));
  std::memset(static_cast<void*>(dV), 0, size_t(MK * Dvp) * sizeof(Acc));
  // Query rows attending a key in [j0, j1): hi(i) > j0 and lo(i) < j1, a contiguous range.
  const int64_t ia = p.first_row([&](int64_t i) { return p.row_hi(i) > j0; });
  const int64_t ib = p.first_row([&](int64_t i) { return p.row_lo(i) >= j1; });
  for (int64_t g = 0; g < p.G; ++g) {
    const int64_t h = kvh * p.G + g, bh = b * p.H + h;
    const T* qb = static_cast<const T*>(p.q) + b * p.qs[0] + h * p.qs[1];
    const T* db = static_cast<const T*>(p.dout) + bh * p.Sq * Dv;
    for (int64_t i0 = ia / BM * BM; i0 < ib; i0 += BM) {
      const int64_t n = std::min(BM, p.Sq - i0), M = round_up(n, kMR);
      bool any = false;
      for (int64_t r = 0; r < n; ++r) {
        p.row_range(i0 + r, lo[r], hi[r]);
        if (p.lse_in[bh * p.Sq + i0 + r] == std::numeric_limits<float>::infinity()) hi[r] = lo[r];
        any |= lo[r] < j1 && hi[r] > j0 && lo[r] < hi[r];
      }
      if (!any) continue;
      if constexpr (kDot<T>) {
        dot_rows(qb + i0 * p.qs[2], p.qs[2], n, M, D, Dw, Qw);
        dot_rows(db + i0 * Dv, Dv, n, M, Dv, Dvw, dOw);
        dot_row_pairs(qb + i0 * p.qs[2], p.qs[2], n, D, Dp, Qpw);
        dot_row_pairs(db + i0 * Dv, Dv, n, Dv, Dvp, dOpw);
        dot_gemm(Qw, Dw, Kw, NK, M, NK, Dw, S, NK, false);
        dot_gemm(dOw, Dvw, Vw, NK, M, NK, Dvw, dP, NK, false);
      } else {
        load_rows(qb + i0 * p.qs[2], p.qs[2], n, M, D, Dp, Qn);
        load_rows(db + i0 * Dv, Dv, n, M, Dv, Dvp, dOn);
        gemm(Qn, Dp, Kt, NK, M, NK, D, S, NK, false);     // S = Q K^T
        gemm(dOn, Dvp, Vt, NK, M, NK, Dv, dP, NK, false);  // dP = dO V^T
      }
      if (capped) softcap_tile(S, n * NK, scale, Acc(p.softcap), w.capf.data());
      if (p.t16) keep_tile_bits(p, bh, i0, n, j0, nk, BM, kbits);  // bit c & 7 of kbits[(c >> 3) * BM + r]
      for (int64_t r = 0; r < n; ++r) {
        Acc *s = S + r * NK, *dp = dP + r * NK;
        const int64_t a = std::clamp(lo[r] - j0, int64_t(0), nk), e = std::clamp(hi[r] - j0, int64_t(0), nk);
        const Acc lr = Acc(p.lse_in[bh * p.Sq + i0 + r]), dr = Acc(p.delta[bh * p.Sq + i0 + r]);
        if (a >= e || lr == inf) {
          std::memset(static_cast<void*>(s), 0, size_t(NK) * sizeof(Acc));
          std::memset(static_cast<void*>(dp), 0, size_t(NK) * sizeof(Acc));
          continue;
        }
        if (p.pad == nullptr && a == 0 && e == nk) {  // the row attends the whole tile
          if (p.t16) {
            keep_row_of(kbits, BM, r, nk, ks, keep);
            for (int64_t c = 0; c < nk; ++c) {
              const Acc pr = exp_nan(s[c] * sscale - lr);
              dp[c] = pr * (dp[c] * keep[c] - dr);
              s[c] = pr * keep[c];
            }
            for (int64_t c = nk; c < NK; ++c) dp[c] = s[c] = Acc(0);  // columns past nk: keys that do not exist
          } else {
            for (int64_t c = 0; c < NK; ++c) {
              const Acc pr = exp_nan(s[c] * sscale - lr);
              dp[c] = pr * (dp[c] - dr);
              s[c] = pr;
            }
          }
          continue;
        }
        if (p.t16) {
          keep_row_of(kbits, BM, r, nk, ks, keep);
          for (int64_t c = a; c < e; ++c) dp[c] *= keep[c];
        }
        for (int64_t c = 0; c < NK; ++c) {
          const bool on = (c >= a) & (c < e) & (padv[c] != 0);
          const Acc pr = exp_nan(or_neg_inf(on, s[c] * sscale - lr));
          dp[c] = or_zero(on, pr * (dp[c] - dr));
          s[c] = or_zero(on, pr);
        }
        if (p.t16)
          for (int64_t c = a; c < e; ++c) s[c] *= keep[c];
      }
      if (capped) scale_by(dP, w.capf.data(), n * NK);  // dS by the scaled scores, for dK
      if constexpr (kDot<T>) {  // P~ and dS rounded to bf16 pairs along queries
        dot_pack_pairs(S, NK, n, NK, Pw);
        dot_pack_pairs(dP, NK, n, NK, dSw);
        dot_gemm<true>(Pw, NK, dOpw, Dvp, MK, Dvp, (n + 1) / 2, dV, Dvp, true);
        dot_gemm<true>(dSw, NK, Qpw, Dp, MK, Dp, (n + 1) / 2, dK, Dp, true);
      } else {
        gemm<true>(S, NK, dOn, Dvp, MK, Dvp, n, dV, Dvp, true);  // dV += P~^T dO
        gemm<true>(dP, NK, Qn, Dp, MK, Dp, n, dK, Dp, true);  // dK += dS^T Q
      }
    }
  }
  store_dkdv<T>(p, b, kvh, j0, nk, dK, dV);
}

// The single pass for one kv head and one chunk c of its key tiles (p.chunks of them; 1 unless there
// are fewer kv heads than kSinglePassTasks): every query tile of every query head of its group, in
// order, against the chunk's key tiles it attends. Each task owns its chunk's dK/dV accumulators and
// either its heads' dQ rows (one chunk) or their partial dQ in chunk c's buffer, summed afterwards in
// chunk order (dq_chunks_sum): nothing is shared and every sum runs in a fixed order.
template <class T>
void dqkv_group(const Problem& p, int64_t b, int64_t kvh, int64_t c, Work<typename Elem<T>::Acc>& w) {
  using Acc = typename Elem<T>::Acc;
  const int64_t Dp = p.Dp, Dvp = p.Dvp, nkt = (p.Sk + p.BN - 1) / p.BN;
  const int64_t jlo = c * nkt / p.chunks * p.BN, jhi = std::min(p.Sk, (c + 1) * nkt / p.chunks * p.BN);
  Acc* dK = w.kv.data();
  Acc* dV = dK + nkt * p.BN * Dp;
  const int64_t used = round_up(jhi - jlo, p.BN);
  std::fill(dK, dK + used * Dp, Acc(0));
  std::fill(dV, dV + used * Dvp, Acc(0));
  Acc* part = p.chunks > 1 ? static_cast<Acc*>(p.dq_part) + c * p.B * p.H * p.Sq * Dp : nullptr;
  const int64_t nqt = (p.Sq + p.BM - 1) / p.BM;
  for (int64_t g = 0; g < p.G; ++g)
    for (int64_t t = 0; t < nqt; ++t) dq_tile<T>(p, b, kvh * p.G + g, t, w, dK, dV, jlo, jhi, part, c);
  store_dkdv<T>(p, b, kvh, jlo, jhi - jlo, dK, dV);
}

// dQ row `row` of [B * H * Sq] = scale * the sum of the key chunks' partial rows, in chunk order.
template <class T>
void dq_chunks_sum(const Problem& p, int64_t row) {
  using Acc = typename Elem<T>::Acc;
  const Acc* part = static_cast<const Acc*>(p.dq_part) + row * p.Dp;
  const int64_t stride = p.B * p.H * p.Sq * p.Dp;
  T* out = static_cast<T*>(p.dq) + row * p.D;
  for (int64_t d = 0; d < p.D; ++d) {
    Acc sum = part[d];
    for (int64_t c = 1; c < p.chunks; ++c) sum += part[c * stride + d];
    Elem<T>::store(out + d, sum * Acc(p.scale));
  }
}
