// The forward pass of one ISA. A part of attention_kernels.h, compiled inside the ISA's namespace:
// no #include here.

// One query tile of one head: online softmax over the key tiles it may attend. Scores are held
// transposed, S^T[key, query] = K Q^T, so Q is transposed once per tile, K and V are read as rows,
// and the softmax statistics of all queries update as vectors across the tile.
template <class T>
void forward_tile(const Problem& p, int64_t b, int64_t h, int64_t t, Work<typename Elem<T>::Acc>& w) {
  using Acc = typename Elem<T>::Acc;
  const int64_t D = p.D, Dp = p.Dp, Dv = p.Dv, Dvp = p.Dvp, BN = p.BN, kvh = h / p.G, bh = b * p.H + h;
  const int64_t i0 = t * p.BM, n = std::min(p.BM, p.Sq - i0), M = round_up(n, kMR), N = round_up(n, 16);
  const Acc scale = Acc(p.scale), neg_inf = -std::numeric_limits<Acc>::infinity();
  const bool capped = p.softcap > 0;
  const Acc sscale = capped ? Acc(1) : scale;  // soft-capping folds the scale into the capped scores
  Acc *Qt = w.a.data(), *Kn = w.b.data(), *V = w.c.data(), *St = w.d.data(), *O = w.acc.data();
  Acc *m = w.m.data(), *l = w.l.data(), *tmax = w.rowv.data(), *shift = w.rowv2.data();
  uint32_t* kbits = w.keepbits.data();
  const Acc ks = Acc(p.keep_scale);
  Acc *alpha = w.e.data(), *lsum = w.f.data();
  int64_t *lo = w.lo.data(), *hi = w.hi.data();
  uint8_t *padv = w.padv.data(), *seen = w.seen.data();
  // the bf16 dot path's operands (attention_dot.h): Q^T and K paired along D, V and P along keys
  const int64_t Dw = Dp / 2;
  uint32_t *Qw = w.words[0].data(), *Kw = w.words[1].data(), *Vw = w.words[2].data(), *Pw = w.words[3].data();

  const T* qrows = static_cast<const T*>(p.q) + b * p.qs[0] + h * p.qs[1] + i0 * p.qs[2];
  if constexpr (kDot<T>) dot_cols(qrows, p.qs[2], n, N, D, Dw, Qw);
  else load_rows_t(qrows, p.qs[2], n, N, D, Qt);
  query_cols<Acc>(p, bh, i0, n, N, false, lo, hi, nullptr, nullptr);
  for (int64_t c = 0; c < N; ++c) {
    m[c] = neg_inf;
    l[c] = Acc(0);
    seen[c] = 0;
  }
  std::memset(static_cast<void*>(O), 0, size_t(M * Dvp) * sizeof(Acc));  // O is [M, Dvp]: v's head dim
  const T* kb = static_cast<const T*>(p.k) + b * p.ks[0] + kvh * p.ks[1];
  const T* vb = static_cast<const T*>(p.v) + b * p.vs[0] + kvh * p.vs[1];
  for (int64_t j0 = lo[0] / BN * BN; j0 < hi[n - 1]; j0 += BN) {
    const int64_t nk = std::min(BN, p.Sk - j0), MK = round_up(nk, kMR);
    if (!tile_attended(lo, hi, n, j0, j0 + nk)) continue;  // e.g. a tile of another document
    if constexpr (kDot<T>) {
      dot_rows(kb + j0 * p.ks[2], p.ks[2], nk, MK, D, Dw, Kw);
      dot_row_pairs(vb + j0 * p.vs[2], p.vs[2], nk, Dv, Dvp, Vw);
      dot_gemm(Kw, Dw, Qw, N, MK, N, Dw, St, N, false);
    } else {
      load_rows(kb + j0 * p.ks[2], p.ks[2], nk, MK, D, Dp, Kn);
      load_rows(vb + j0 * p.vs[2], p.vs[2], nk, nk, Dv, Dvp, V);
      gemm(Kn, Dp, Qt, N, MK, N, D, St, N, false);
    }
    if (capped) softcap_tile(St, nk * N, scale, Acc(p.softcap), static_cast<Acc*>(nullptr));
    pad_row(p, b, j0, nk, nk, padv);
    for (int64_t c = 0; c < N; ++c) {
      tmax[c] = neg_inf;
      lsum[c] = Acc(0);
    }
    if (tile_full(p, lo, hi, n, j0, j0 + nk)) {
      for (int64_t c = 0; c < n; ++c) seen[c] = 1;
      for (int64_t r = 0; r < nk; ++r) {
        Acc* s = St + r * N;
        for (int64_t c = 0; c < N; ++c) {
          s[c] *= sscale;
          tmax[c] = __builtin_isgreater(s[c], tmax[c]) ? s[c] : tmax[c];
        }
      }
    } else {
      for (int64_t r = 0; r < nk; ++r) {
        Acc* s = St + r * N;
        const int64_t j = j0 + r;
        const bool pj = padv[r] != 0;
        for (int64_t c = 0; c < N; ++c) {
          const bool on = pj & (j >= lo[c]) & (j < hi[c]);
          seen[c] |= uint8_t(on);
          s[c] = or_neg_inf(on, s[c] * sscale);
          tmax[c] = __builtin_isgreater(s[c], tmax[c]) ? s[c] : tmax[c];
        }
      }
    }
    for (int64_t c = 0; c < N; ++c) {
      const Acc mn = __builtin_isgreater(tmax[c], m[c]) ? tmax[c] : m[c];
      shift[c] = mn == neg_inf ? Acc(0) : mn;  // all -inf so far: keep the exps finite
      alpha[c] = exp_nan(m[c] - shift[c]);
      m[c] = mn;
    }
    if (p.t16) keep_tile_bits(p, bh, i0, n, j0, nk, N, kbits);
    for (int64_t r = 0; r < nk; ++r) {
      Acc* s = St + r * N;
      for (int64_t c = 0; c < N; ++c) {
        s[c] = exp_nan(s[c] - shift[c]);
        lsum[c] += s[c];
      }
      if (p.t16) {  // dropout after the row sums; unattended entries are 0 and stay 0
        const uint32_t* kb = kbits + (r >> 3) * N;
        for (int64_t c = 0; c < N; ++c) s[c] *= keep_factor(kb[c], r & 7, ks);
      }
    }
    for (int64_t c = 0; c < n; ++c) {
      l[c] = l[c] * alpha[c] + lsum[c];
      if (!(alpha[c] == Acc(1))) {  // also for NaN, which must reach O
        Acc* orow = O + c * Dvp;
        for (int64_t d = 0; d < Dvp; ++d) orow[d] *= alpha[c];
      }
    }
    if constexpr (kDot<T>) {  // O += P V, P rounded to bf16 pairs along keys
      dot_pack_pairs(St, N, nk, N, Pw);
      dot_gemm<true>(Pw, N, Vw, Dvp, M, Dvp, (nk + 1) / 2, O, Dvp, true);
    } else {
      gemm<true>(St, N, V, Dvp, M, Dvp, nk, O, Dvp, true);  // O += P V, P read from S^T
    }
  }
  T* ob = static_cast<T*>(p.o) + b * p.os[0] + h * p.os[1];
  float* lse = p.lse + bh * p.Sq;
  for (int64_t r = 0; r < n; ++r) {
    T* orow = ob + (i0 + r) * p.os[2];
    if (!seen[r]) {  // nothing to attend: o = 0; lse = +inf makes P = 0 in backward
      for (int64_t d = 0; d < Dv; ++d) Elem<T>::store(orow + d, Acc(0));
      lse[i0 + r] = std::numeric_limits<float>::infinity();
      continue;
    }
    const Acc base = m[r] == neg_inf ? Acc(0) : m[r];
    Acc inv = Acc(1) / l[r], top = base, sum = l[r];
    if (p.sinks != nullptr) {  // the sink's exp(s_h) joins the denominator; measured from max(m, s_h)
      const Acc s = Acc(p.sinks[h]);
      top = __builtin_isgreater(s, base) ? s : base;
      const Acc f = exp_nan(base - top);
      sum = l[r] * f + exp_nan(s - top);
      inv = f / sum;
    }
    const Acc* acc = O + r * Dvp;
    for (int64_t d = 0; d < Dv; ++d) Elem<T>::store(orow + d, acc[d] * inv);
    lse[i0 + r] = float(top + std::log(sum));
  }
}
