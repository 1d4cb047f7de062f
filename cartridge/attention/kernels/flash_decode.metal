// Flash-decoding attention over cartridge pages, for MLX's Metal backend (mx.fast.metal_kernel; `metal.py`
// hands this text as the kernel header and a few lines of constants and one call as the body).
//
// The algorithm, page layout and tier decodes are those of flash_decode.cuh (the reference for both is
// kernels/portable.py; shared/reference/kv-quant-algorithms.md 5.1): pass 1 splits the stored tokens over
// threadgroups (one split of one KV head each). As in MLX's sdpa_vector, a simdgroup takes one token at a
// time (BN simdgroups, BN tokens in flight) and its 32 lanes split head_dim (EPL = D / 32 consecutive
// elements each), so every K/V byte of the KV head is read once for all ROWS query rows of its GQA group;
// the codes are dequantized in registers, the score is a simd_sum, each row keeps an online softmax. The
// simdgroups are merged through threadgroup memory and the split's partial (o, m, l) is written in natural-log
// units. The finish (one simdgroup per KV head and query row) merges the splits by log-sum-exp, rotates a
// TurboQuant / +rot V output back, attends over the protected tokens' copies and the dense tail (causal among
// the new tokens), adds the sink logit, and writes the row in the queries' dtype.
//
// Threadgroup arrays are declared by the kernel body (MSL allows them only at kernel scope) and passed in.

namespace cart {
enum Tier : int { FP16 = 0, BF16 = 1, F32 = 2, AFF8 = 3, AFF4 = 4, MXFP8 = 5, TURBO = 6, MXFP4 = 7, NVFP4 = 8,
                  AFF6 = 9, KIVI4 = 10 };

// prm (int32): the kernel parameters written by metal.py (_params); one buffer for both kernels.
enum Param : int { P_END = 0, P_ROWS = 1, P_PER = 2, P_SPLITS = 3, P_TAIL = 4, P_LQ = 5, P_START = 6, P_NKV = 7,
                   P_PAGE = 8, P_NP = 9, P_SINKS = 10, P_VROT = 11, P_CH = 12, N_PARAMS = 16 };

inline float safe_exp(float a, float m) { return a == -INFINITY ? 0.0f : metal::fast::exp(a - m); }

// `width` bits at bit offset `bit` of a little-endian stream of 32-bit words (LSB-first packing, MLX's).
inline uint bits_at(const device uint* row, int bit, int width) {
  const int wi = bit / 32, sh = bit % 32;
  uint w = row[wi] >> sh;
  if (sh + width > 32) w |= row[wi + 1] << (32 - sh);
  return w & ((1u << width) - 1u);
}

// E4M3 (OCP MX v1.0): bias 7, no infinities (MLX saturates encodes to 448).
inline float e4m3(uint b) {
  const uint e = (b >> 3) & 0xFu, m = b & 0x7u;
  const float v = e ? as_type<float>(((e + 120u) << 23) | (m << 20)) : float(m) * 0.001953125f;
  return (b & 0x80u) ? -v : v;
}

// E8M0 scale: 2^(s - 127); s = 0 is 2^-127.
inline float e8m0(uint s) { return s ? as_type<float>(s << 23) : as_type<float>(0x00400000u); }

// E2M1 (OCP MX v1.0 5.3.3): 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 the sign.
inline float e2m1(uint c) {
  const uint m = c & 7u;
  const float mag = m < 4u ? 0.5f * float(m) : float(1u << (m / 2u - 1u)) * ((m & 1u) ? 1.5f : 1.0f);
  return (c & 8u) ? -mag : mag;
}

// Element e of a stored token row, dequantized, except TurboQuant (its codebook value; the norm is the token
// factor) and nvfp4 (without its global factor, applied with the token factor). `tok` is the token's row in the
// component arrays ((page * NKV + h) * P + t % P); `grp` the first row of its 32-token group (kivi4).
template <int TIER, int BITS, int D>
inline float element(const device uchar* c0, const device uchar* c1, const device uchar* c2, uint tok, uint grp,
                     int e, const threadgroup float* cb) {
  if (TIER == FP16) {
    return float(((const device half*)c0)[tok * D + e]);
  } else if (TIER == BF16) {
    return float(((const device bfloat16_t*)c0)[tok * D + e]);
  } else if (TIER == F32) {
    return ((const device float*)c0)[tok * D + e];
  } else if (TIER == AFF8 || TIER == AFF6 || TIER == AFF4 || TIER == KIVI4) {
    constexpr int B = TIER == AFF8 ? 8 : TIER == AFF6 ? 6 : 4;
    const float c = float(bits_at((const device uint*)c0 + tok * (D * B / 32), e * B, B));
    // mlx4g32 / int6 / int8: one fp16 scale and bias per 32 elements of the token; kivi4: per channel, for the
    // group's 32 token rows together (D / 32 per row, in channel order: spec/FORMAT.md 6.5)
    const uint g = TIER == KIVI4 ? grp * (D / 32) + e : tok * (D / 32) + e / 32;
    return metal::fma(float(((const device half*)c1)[g]), c, float(((const device half*)c2)[g]));
  } else if (TIER == MXFP8) {
    return e4m3(c0[tok * D + e]) * e8m0(c1[tok * (D / 32) + e / 32]);
  } else if (TIER == MXFP4) {
    return e2m1(bits_at((const device uint*)c0 + tok * (D / 8), 4 * e, 4)) * e8m0(c1[tok * (D / 32) + e / 32]);
  } else if (TIER == NVFP4) {
    return e2m1(bits_at((const device uint*)c0 + tok * (D / 8), 4 * e, 4)) * e4m3(c1[tok * (D / 16) + e / 16]);
  } else {  // TURBO
    return cb[bits_at((const device uint*)c0 + tok * (D * BITS / 32), e * BITS, BITS)];
  }
}

// The factor of a token's score (K) or probability (V): TurboQuant's norm, nvfp4's global factor cb[0].
template <int TIER>
inline float token_factor(const device uchar* c1, uint tok, const threadgroup float* cb) {
  if (TIER == TURBO) return float(((const device half*)c1)[tok]);
  if (TIER == NVFP4) return cb[0];
  return 1.0f;
}

// In-place Walsh-Hadamard transform (Sylvester order, unnormalized) of `rows` rows of D in threadgroup memory,
// by `nthreads` threads (thread `tid`); every thread of the threadgroup must call it.
template <int D>
inline void fwht_rows(threadgroup float* x, int rows, uint tid, uint nthreads) {
  for (int len = 1; len < D; len <<= 1) {
    for (uint p = tid; p < uint(rows * D / 2); p += nthreads) {
      const int r = int(p) / (D / 2), k = int(p) % (D / 2);
      const int i = r * D + (k / len) * 2 * len + (k % len);
      const float a = x[i], b = x[i + len];
      x[i] = a + b;
      x[i + len] = a - b;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
}

// Pass 1 of one split (threadgroup tg.x) of KV head tg.y: partial (o, m, l) of the R = prm[P_ROWS] <= ROWS query
// rows over stored tokens start + split * per .. min(+ per, end) - 1. RK: q is rotated into the stored basis
// (q~ = H diag(s) q / sqrt(D), the signs sgk (NKV, D)), for TurboQuant K and a rotated (+rot) K.
// Threadgroup memory: tq [ROWS * D], tcb [32] (the two codebooks), to [BN * D], tm, tl [BN * ROWS].
template <typename T, int TK, int BK, int TV, int BV, int D, int ROWS, int BN, bool RK>
inline void pass1(const device T* q, float scale, const device float* sgk, const device uchar* k0,
                  const device uchar* k1, const device uchar* k2, const device uchar* v0, const device uchar* v1,
                  const device uchar* v2, const device float* cbk, const device float* cbv, const device int* prm,
                  device float* O, device float* M, device float* L, threadgroup float* tq, threadgroup float* tcb,
                  threadgroup float* to, threadgroup float* tm, threadgroup float* tl, uint3 tg, uint sg, uint lane) {
  constexpr int EPL = D / 32;
  const int R = prm[P_ROWS], per = prm[P_PER], NKV = prm[P_NKV], P = prm[P_PAGE];
  const int split = int(tg.x), h = int(tg.y), e0 = int(lane) * EPL;
  const uint tid = sg * 32 + lane, nthreads = BN * 32;
  if (tid < 16) {
    tcb[tid] = cbk[tid];
    tcb[16 + tid] = cbv[tid];
  }
  for (uint i = tid; i < uint(ROWS * D); i += nthreads) {
    const int r = int(i) / D, d = int(i) % D;
    const float x = r < R ? float(q[(uint(h) * uint(R) + uint(r)) * D + d]) * scale : 0.0f;
    tq[i] = RK ? x * sgk[h * D + d] : x;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (RK) {
    fwht_rows<D>(tq, ROWS, tid, nthreads);
    for (uint i = tid; i < uint(ROWS * D); i += nthreads) tq[i] *= metal::rsqrt(float(D));
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  float qr[ROWS][EPL], o[ROWS][EPL], m[ROWS], l[ROWS];
  for (int r = 0; r < ROWS; ++r) {
    for (int i = 0; i < EPL; ++i) {
      qr[r][i] = tq[r * D + e0 + i];
      o[r][i] = 0.0f;
    }
    m[r] = -INFINITY;
    l[r] = 0.0f;
  }
  const int t0 = prm[P_START] + split * per, t1 = metal::min(t0 + per, prm[P_END]);
  for (int t = t0 + int(sg); t < t1; t += BN) {
    const uint tok = (uint(t / P) * uint(NKV) + uint(h)) * uint(P) + uint(t % P);
    const uint grp = tok - uint(t % P) % 32u;
    float kx[EPL], vx[EPL];
    for (int i = 0; i < EPL; ++i) {
      kx[i] = element<TK, BK, D>(k0, k1, k2, tok, grp, e0 + i, tcb);
      vx[i] = element<TV, BV, D>(v0, v1, v2, tok, grp, e0 + i, tcb + 16);
    }
    const float kf = token_factor<TK>(k1, tok, tcb), vf = token_factor<TV>(v1, tok, tcb + 16);
    for (int r = 0; r < ROWS; ++r) {
      float s = 0.0f;
      for (int i = 0; i < EPL; ++i) s = metal::fma(qr[r][i], kx[i], s);
      s = simd_sum(s) * kf;
      const float mn = metal::max(m[r], s);
      const float a = safe_exp(m[r], mn), p = metal::fast::exp(s - mn);
      l[r] = metal::fma(l[r], a, p);
      for (int i = 0; i < EPL; ++i) o[r][i] = metal::fma(o[r][i], a, p * vf * vx[i]);
      m[r] = mn;
    }
  }
  // merge the simdgroups, one row at a time (threadgroup memory holds BN rows of D)
  for (int r = 0; r < ROWS; ++r) {
    if (lane == 0) {
      tm[sg * ROWS + r] = m[r];
      tl[sg * ROWS + r] = l[r];
    }
    for (int i = 0; i < EPL; ++i) to[sg * D + e0 + i] = o[r][i];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (r < R) {
      float mx = -INFINITY;
      for (int w = 0; w < BN; ++w) mx = metal::max(mx, tm[w * ROWS + r]);
      const uint base = (uint(split) * uint(NKV) + uint(h)) * uint(R) + uint(r);
      for (uint d = tid; d < uint(D); d += nthreads) {
        float acc = 0.0f;
        for (int w = 0; w < BN; ++w) acc = metal::fma(safe_exp(tm[w * ROWS + r], mx), to[w * D + d], acc);
        O[base * D + d] = acc;
      }
      if (tid == 0) {
        float ls = 0.0f;
        for (int w = 0; w < BN; ++w) ls = metal::fma(safe_exp(tm[w * ROWS + r], mx), tl[w * ROWS + r], ls);
        M[base] = mx;
        L[base] = ls;
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
}

// Tail chunk c (0 .. NCH - 1) of the keys or values, one of up to 8 chunk buffers.
template <typename T>
inline const device T* chunk(int c, const device T* c0, const device T* c1, const device T* c2, const device T* c3,
                             const device T* c4, const device T* c5, const device T* c6, const device T* c7) {
  return c == 0 ? c0 : c == 1 ? c1 : c == 2 ? c2 : c == 3 ? c3 : c == 4 ? c4 : c == 5 ? c5 : c == 6 ? c6 : c7;
}

// Online-softmax state of one query row in one simdgroup: lane owns elements lane + 32 i.
template <int D>
struct RowState {
  float o[D / 32];
  float m;
  float l;
};

// Add key/value row kp, vp (D elements each) to the state of query qv (pre-scaled).
template <typename T, int D>
inline void attend(thread RowState<D>& st, const thread float (&qv)[D / 32], const device T* kp, const device T* vp,
                   uint lane) {
  float s = 0.0f;
  for (int i = 0; i < D / 32; ++i) s = metal::fma(qv[i], float(kp[lane + 32 * i]), s);
  s = simd_sum(s);
  const float mn = metal::max(st.m, s);
  const float a = safe_exp(st.m, mn), p = metal::fast::exp(s - mn);
  st.l = metal::fma(st.l, a, p);
  for (int i = 0; i < D / 32; ++i) st.o[i] = metal::fma(st.o[i], a, p * float(vp[lane + 32 * i]));
  st.m = mn;
}

// The finish of query row tg.z of KV head tg.y (one simdgroup; threadgroup memory `so` [D]): the splits of the
// prefix merged, V rotated back (prm[P_VROT]: x = diag(s) H y / sqrt(D), the signs sgv (NKV, D)), then the
// protected tokens' copies pk, pv (NKV, NP, D; visible to every row) and the tail (chunks of CH tokens, the
// query's own position and those before it), the sink logit snk[q head] (prm[P_SINKS]), normalized.
template <typename T, int D>
inline void finish(const device float* O, const device float* M, const device float* L, const device T* q,
                   float scale, const device int* prm, const device float* sgv, const device float* snk,
                   const device T* pk, const device T* pv, const device T* tk0, const device T* tk1,
                   const device T* tk2, const device T* tk3, const device T* tk4, const device T* tk5,
                   const device T* tk6, const device T* tk7, const device T* tv0, const device T* tv1,
                   const device T* tv2, const device T* tv3, const device T* tv4, const device T* tv5,
                   const device T* tv6, const device T* tv7, device T* out, threadgroup float* so, uint3 tg,
                   uint lane) {
  constexpr int EPT = D / 32;
  const int R = prm[P_ROWS], S = prm[P_SPLITS], NKV = prm[P_NKV], NP = prm[P_NP], CH = prm[P_CH];
  const int h = int(tg.y), row = int(tg.z), Lq = prm[P_LQ];
  RowState<D> pre;
  pre.m = -INFINITY;
  for (int s = 0; s < S; ++s) pre.m = metal::max(pre.m, M[(uint(s) * uint(NKV) + uint(h)) * uint(R) + uint(row)]);
  pre.l = 0.0f;
  for (int i = 0; i < EPT; ++i) pre.o[i] = 0.0f;
  for (int s = 0; s < S; ++s) {
    const uint b = (uint(s) * uint(NKV) + uint(h)) * uint(R) + uint(row);
    const float w = safe_exp(M[b], pre.m);
    pre.l = metal::fma(w, L[b], pre.l);
    for (int i = 0; i < EPT; ++i) pre.o[i] = metal::fma(w, O[b * D + lane + 32 * i], pre.o[i]);
  }
  if (prm[P_VROT]) {
    for (int i = 0; i < EPT; ++i) so[lane + 32 * i] = pre.o[i];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    fwht_rows<D>(so, 1, lane, 32);
    for (int i = 0; i < EPT; ++i) {
      const int d = int(lane) + 32 * i;
      pre.o[i] = so[d] * sgv[h * D + d] * metal::rsqrt(float(D));
    }
  }
  float qv[EPT];
  for (int i = 0; i < EPT; ++i) qv[i] = float(q[(uint(h) * uint(R) + uint(row)) * D + lane + 32 * i]) * scale;
  RowState<D> st;
  st.m = -INFINITY;
  st.l = 0.0f;
  for (int i = 0; i < EPT; ++i) st.o[i] = 0.0f;
  for (int j = 0; j < NP; ++j) {
    const uint off = (uint(h) * uint(NP) + uint(j)) * D;
    attend<T, D>(st, qv, pk + off, pv + off, lane);
  }
  const int qpos = prm[P_TAIL] - Lq + row % Lq;
  for (int j = 0; j <= qpos; ++j) {
    const uint off = (uint(h) * uint(CH) + uint(j % CH)) * D;
    const int c = j / CH;
    attend<T, D>(st, qv, chunk<T>(c, tk0, tk1, tk2, tk3, tk4, tk5, tk6, tk7) + off,
                 chunk<T>(c, tv0, tv1, tv2, tv3, tv4, tv5, tv6, tv7) + off, lane);
  }
  // st holds the query's own token, so its m is finite; the sink is one more logit with no value
  float mx = metal::max(pre.m, st.m);
  const int head = h * (R / Lq) + row / Lq;
  const float sink = prm[P_SINKS] ? snk[head] : -INFINITY;
  mx = metal::max(mx, sink);
  const float a = safe_exp(pre.m, mx), b = metal::fast::exp(st.m - mx);
  const float den = pre.l * a + st.l * b + safe_exp(sink, mx);
  for (int i = 0; i < EPT; ++i) {
    out[(uint(h) * uint(R) + uint(row)) * D + lane + 32 * i] = T((pre.o[i] * a + st.o[i] * b) / den);
  }
}
}  // namespace cart
