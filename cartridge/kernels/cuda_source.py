"""CUDA source of the flash-decoding kernels (compiled by MLX with NVRTC via `mx.fast.cuda_kernel`).

Pass 1 splits the prefix tokens over thread blocks (grid: splits x n_kv_heads x row blocks). A block
reads the pages of one KV head once for all query rows of its GQA group (row block), dequantizes each
token's slice in registers, and keeps an online softmax per row (flash-decoding; Dao et al. 2023, and
shared/reference/kv-quant-algorithms.md 5.1). A lane owns EPL consecutive elements of head_dim;
D / EPL lanes share a token and reduce its scores with warp shuffles. Pass 2 merges the splits by
log-sum-exp, attends over the dense tail, and writes the normalized output (see `finish`).
"""

HEADER = r"""
#define NEG_INF (__int_as_float(0xff800000))

namespace cart {

constexpr int FP16 = 0, BF16 = 1, F32 = 2, AFF8 = 3, AFF4 = 4, MXFP8 = 5, TURBO = 6;

// E4M3 (OCP MX v1.0): bias 7, no infinities; MLX saturates encodes to 448, so 0x7F/0xFF never occur.
__device__ __forceinline__ float e4m3_to_float(uint32_t b) {
  uint32_t e = (b >> 3) & 0xFu, m = b & 0x7u;
  float v = e ? __uint_as_float(((e + 120u) << 23) | (m << 20)) : (float)m * 0.001953125f;
  return __uint_as_float(__float_as_uint(v) | ((b & 0x80u) << 24));
}

// E8M0 scale: 2^(s - 127); s = 0 is 2^-127 (subnormal in float32).
__device__ __forceinline__ float e8m0_to_float(uint32_t s) {
  return s ? __uint_as_float(s << 23) : __uint_as_float(0x00400000u);
}

template <int N>
__device__ __forceinline__ void load_words(const uint32_t* p, uint32_t (&w)[N]) {
  if constexpr (N == 4) {
    uint4 u = *reinterpret_cast<const uint4*>(p);
    w[0] = u.x; w[1] = u.y; w[2] = u.z; w[3] = u.w;
  } else if constexpr (N == 2) {
    uint2 u = *reinterpret_cast<const uint2*>(p);
    w[0] = u.x; w[1] = u.y;
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) w[i] = p[i];
  }
}

// Raw bytes of one token's slice [e0, e0 + EPL), fetched ahead of use so loads overlap compute.
template <int TIER, int EPL, int BITS>
struct Raw {
  static constexpr int NW = TIER == FP16 || TIER == BF16 ? EPL / 2
                          : TIER == F32 ? EPL
                          : TIER == AFF4 ? EPL / 8
                          : TIER == AFF8 || TIER == MXFP8 ? EPL / 4
                          : 2;  // TURBO: 64 bits of the stream starting at the slice's first code
  uint32_t w[NW];
  float a, b;  // affine: scale, bias; MXFP8: 2^(e - 127) * 2^120; TURBO: norm
};

template <int TIER, int EPL, int D, int BITS>
__device__ __forceinline__ void fetch(Raw<TIER, EPL, BITS>& r, const void* c0, const void* c1,
                                      const void* c2, size_t tok, int e0) {
  const uint32_t* w32 = reinterpret_cast<const uint32_t*>(c0);
  if constexpr (TIER == FP16 || TIER == BF16) {
#pragma unroll
    for (int i = 0; i < EPL / 8; ++i) {
      uint32_t u[4];
      load_words<4>(w32 + (tok * D + e0) / 2 + 4 * i, u);
#pragma unroll
      for (int j = 0; j < 4; ++j) r.w[4 * i + j] = u[j];
    }
  } else if constexpr (TIER == F32) {
#pragma unroll
    for (int i = 0; i < EPL / 4; ++i) {
      uint32_t u[4];
      load_words<4>(w32 + tok * D + e0 + 4 * i, u);
#pragma unroll
      for (int j = 0; j < 4; ++j) r.w[4 * i + j] = u[j];
    }
  } else if constexpr (TIER == AFF4 || TIER == AFF8) {
    constexpr int PER = TIER == AFF4 ? 8 : 4;
    load_words<EPL / PER>(w32 + tok * (D / PER) + e0 / PER, r.w);
    const size_t g = tok * (D / 32) + e0 / 32;
    r.a = __half2float(reinterpret_cast<const __half*>(c1)[g]);
    r.b = __half2float(reinterpret_cast<const __half*>(c2)[g]);
  } else if constexpr (TIER == MXFP8) {
    load_words<EPL / 4>(w32 + tok * (D / 4) + e0 / 4, r.w);
    const uint32_t e = reinterpret_cast<const uint8_t*>(c1)[tok * (D / 32) + e0 / 32];
    r.a = __uint_as_float(min(e + 120u, 254u) << 23);
  } else {  // TURBO
    const uint32_t* p = w32 + tok * (D * BITS / 32);
    const int bit = e0 * BITS, shift = bit % 32;
    unsigned long long win = p[bit / 32];
    if (shift + EPL * BITS > 32) win |= (unsigned long long)p[bit / 32 + 1] << 32;
    win >>= shift;
    r.w[0] = (uint32_t)win;
    r.w[1] = (uint32_t)(win >> 32);
    r.a = __half2float(reinterpret_cast<const __half*>(c1)[tok]);
  }
}

// Affine code c (B bits) as the float 1 + c / 2^B, built from bits (no int-to-float conversion,
// which runs at a quarter of the FMA rate).
template <int B>
__device__ __forceinline__ float affine_one_plus(uint32_t w, int j) {
  // move code j to mantissa bits [23 - B, 23) with one shift, then mask and set the exponent (LOP3)
  const int sh = (23 - B) - B * j;
  const uint32_t x = sh >= 0 ? (w << sh) : (w >> -sh);
  return __uint_as_float((x & (((1u << B) - 1u) << (23 - B))) | 0x3F800000u);
}

// E4M3 byte as float32 bits with an unbiased exponent field: exactly value * 2^-120 (may be subnormal).
__device__ __forceinline__ float fp8_raw(uint32_t byte) {
  return __uint_as_float(((byte & 0x7Fu) << 20) | ((byte & 0x80u) << 24));
}

// Element i of the slice in the tier's "unit" form: the value for fp16/bf16/f32; 1 + c/2^B for
// affine; value * 2^-120 / scale for MXFP8; the codebook value C[idx] for TURBO.
template <int TIER, int EPL, int BITS>
__device__ __forceinline__ float unit(const Raw<TIER, EPL, BITS>& r, int i, const float* cb) {
  if constexpr (TIER == FP16) {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&r.w[i / 2]));
    return i % 2 ? f.y : f.x;
  } else if constexpr (TIER == BF16) {
    const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&r.w[i / 2]));
    return i % 2 ? f.y : f.x;
  } else if constexpr (TIER == F32) {
    return __uint_as_float(r.w[i]);
  } else if constexpr (TIER == AFF4) {
    return affine_one_plus<4>(r.w[i / 8], i % 8);
  } else if constexpr (TIER == AFF8) {
    return affine_one_plus<8>(r.w[i / 4], i % 4);
  } else if constexpr (TIER == MXFP8) {
    return fp8_raw((r.w[i / 4] >> (8 * (i % 4))) & 0xFFu);
  } else {
    const unsigned long long win = ((unsigned long long)r.w[1] << 32) | r.w[0];
    return cb[(win >> (i * BITS)) & ((1u << BITS) - 1u)];
  }
}

// Score partials s[r] = q_r . k over the slice, from units: the affine form folds the scale and bias
// (s c + b = S u + (b - S) with S = s 2^B, u = 1 + c/2^B), MXFP8 multiplies back 2^120 * scale.
template <int TIER, int EPL, int BITS, int ROWS>
__device__ __forceinline__ void k_scores(const Raw<TIER, EPL, BITS>& r, const float (&qr)[ROWS][EPL],
                                         const float (&qs)[ROWS], const float* cb, float (&s)[ROWS]) {
  float acc[ROWS];
#pragma unroll
  for (int j = 0; j < ROWS; ++j) acc[j] = 0.f;
#pragma unroll
  for (int i = 0; i < EPL; ++i) {
    const float u = unit<TIER, EPL, BITS>(r, i, cb);
#pragma unroll
    for (int j = 0; j < ROWS; ++j) acc[j] = fmaf(qr[j][i], u, acc[j]);
  }
#pragma unroll
  for (int j = 0; j < ROWS; ++j) {
    if constexpr (TIER == AFF4 || TIER == AFF8) {
      const float S = r.a * (TIER == AFF4 ? 16.f : 256.f);
      s[j] = fmaf(S, acc[j], (r.b - S) * qs[j]);
    } else if constexpr (TIER == MXFP8 || TIER == TURBO) {
      s[j] = acc[j] * r.a;
    } else {
      s[j] = acc[j];
    }
  }
}

// o[j][:] += p[j] * v over the slice; the affine bias part goes to ob[j] (added to o at the end).
template <int TIER, int EPL, int BITS, int ROWS>
__device__ __forceinline__ void v_accumulate(const Raw<TIER, EPL, BITS>& r, const float (&p)[ROWS],
                                             const float* cb, float (&o)[ROWS][EPL], float (&ob)[ROWS]) {
  float coef[ROWS];
#pragma unroll
  for (int j = 0; j < ROWS; ++j) {
    if constexpr (TIER == AFF4 || TIER == AFF8) {
      const float S = r.a * (TIER == AFF4 ? 16.f : 256.f);
      coef[j] = p[j] * S;
      ob[j] = fmaf(p[j], r.b - S, ob[j]);
    } else if constexpr (TIER == MXFP8 || TIER == TURBO) {
      coef[j] = p[j] * r.a;
    } else {
      coef[j] = p[j];
    }
  }
#pragma unroll
  for (int i = 0; i < EPL; ++i) {
    const float u = unit<TIER, EPL, BITS>(r, i, cb);
#pragma unroll
    for (int j = 0; j < ROWS; ++j) o[j][i] = fmaf(coef[j], u, o[j][i]);
  }
}

__device__ __forceinline__ float safe_exp(float a, float m) {
  return a == NEG_INF ? 0.f : __expf(a - m);
}

// In-place Walsh-Hadamard transform (Sylvester order, unnormalized) of ROWS rows of D in shared memory.
template <int ROWS, int D>
__device__ void fwht_rows(float* x) {
  for (int len = 1; len < D; len <<= 1) {
    for (int p = threadIdx.x; p < ROWS * D / 2; p += blockDim.x) {
      const int r = p / (D / 2), k = p % (D / 2);
      const int i = r * D + (k / len) * 2 * len + (k % len);
      const float a = x[i], b = x[i + len];
      x[i] = a + b;
      x[i + len] = a - b;
    }
    __syncthreads();
  }
}

template <typename T, int TK, int TV, int BK, int BV, int D, int EPL, int ROWS, int NKV, int P, int WARPS,
          int UNR>
__device__ void flash_pass1(const T* q, const float* fprm, const float* sgk,
                            const void* k0, const void* k1, const void* k2,
                            const void* v0, const void* v1, const void* v2,
                            const float* cbk, const float* cbv, const int32_t* prm,
                            float* O, float* M, float* L) {
  constexpr int LPT = D / EPL, SPW = 32 / LPT, SLOTS = SPW * WARPS;
  const int n_tokens = prm[0], R = prm[1], per_split = prm[2];
  const int split = blockIdx.x, h = blockIdx.y, rb = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int slot = warp * SPW + lane / LPT;
  const int e0 = (lane % LPT) * EPL;

  __shared__ float cb_k[16], cb_v[16];
  __shared__ float sq[ROWS * D];
  __shared__ float sm_o[WARPS][ROWS][D];
  __shared__ float sm_m[WARPS][ROWS], sm_l[WARPS][ROWS];
  if (threadIdx.x < 16) {
    cb_k[threadIdx.x] = cbk[threadIdx.x];
    cb_v[threadIdx.x] = cbv[threadIdx.x];
  }
  // q rows of this block, scaled; for TurboQuant K rotated once: q~ = H diag(s) q / sqrt(D)
  for (int idx = threadIdx.x; idx < ROWS * D; idx += blockDim.x) {
    const int r = idx / D, d = idx % D, row = rb * ROWS + r;
    float v = row < R ? (float)q[((size_t)h * R + row) * D + d] * fprm[0] : 0.f;
    if constexpr (TK == TURBO) v *= sgk[h * D + d];
    sq[idx] = v;
  }
  __syncthreads();
  if constexpr (TK == TURBO) {
    fwht_rows<ROWS, D>(sq);
    for (int idx = threadIdx.x; idx < ROWS * D; idx += blockDim.x) sq[idx] *= rsqrtf((float)D);
    __syncthreads();
  }

  float qr[ROWS][EPL], qs[ROWS], m[ROWS], l[ROWS], o[ROWS][EPL], ob[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    qs[r] = 0.f;
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      qr[r][i] = sq[r * D + e0 + i];
      qs[r] += qr[r][i];
      o[r][i] = 0.f;
    }
    m[r] = NEG_INF;
    l[r] = 0.f;
    ob[r] = 0.f;
  }

  const int t0 = split * per_split;
  const int t1 = min(t0 + per_split, n_tokens);
  auto token_index = [&](int t) { return ((size_t)(t / P) * NKV + h) * P + (t % P); };
  for (int tb = t0; tb < t1; tb += SLOTS * UNR) {
    // fetch UNR tokens of this slot at once, so their loads are in flight together
    Raw<TK, EPL, BK> kr[UNR];
    Raw<TV, EPL, BV> vr[UNR];
#pragma unroll
    for (int u = 0; u < UNR; ++u) {
      const int t = tb + u * SLOTS + slot;
      if (t < t1) {
        fetch<TK, EPL, D, BK>(kr[u], k0, k1, k2, token_index(t), e0);
        fetch<TV, EPL, D, BV>(vr[u], v0, v1, v2, token_index(t), e0);
      }
    }
#pragma unroll
    for (int u = 0; u < UNR; ++u) {
      const bool valid = tb + u * SLOTS + slot < t1;
      float s[ROWS];
      k_scores<TK, EPL, BK, ROWS>(kr[u], qr, qs, cb_k, s);
#pragma unroll
      for (int off = LPT / 2; off > 0; off >>= 1)
#pragma unroll
        for (int r = 0; r < ROWS; ++r) s[r] += __shfl_xor_sync(0xffffffffu, s[r], off);
      if (valid) {
        float p[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
          if (s[r] > m[r]) {  // rescale only when the running max grows
            const float c = safe_exp(m[r], s[r]);
            l[r] *= c;
            ob[r] *= c;
#pragma unroll
            for (int i = 0; i < EPL; ++i) o[r][i] *= c;
            m[r] = s[r];
          }
          p[r] = __expf(s[r] - m[r]);
          l[r] += p[r];
        }
        v_accumulate<TV, EPL, BV, ROWS>(vr[u], p, cb_v, o, ob);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < ROWS; ++r)
#pragma unroll
    for (int i = 0; i < EPL; ++i) o[r][i] += ob[r];

  // merge the token slots of this warp (lanes that own the same elements)
#pragma unroll
  for (int off = LPT; off < 32; off <<= 1) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const float mo = __shfl_xor_sync(0xffffffffu, m[r], off);
      const float lo = __shfl_xor_sync(0xffffffffu, l[r], off);
      const float mn = fmaxf(m[r], mo);
      const float a = safe_exp(m[r], mn), b = safe_exp(mo, mn);
      l[r] = l[r] * a + lo * b;
#pragma unroll
      for (int i = 0; i < EPL; ++i) {
        const float oo = __shfl_xor_sync(0xffffffffu, o[r][i], off);
        o[r][i] = o[r][i] * a + oo * b;
      }
      m[r] = mn;
    }
  }
  if (lane < LPT) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
#pragma unroll
      for (int i = 0; i < EPL; ++i) sm_o[warp][r][e0 + i] = o[r][i];
      if (lane == 0) {
        sm_m[warp][r] = m[r];
        sm_l[warp][r] = l[r];
      }
    }
  }
  __syncthreads();

  // merge the warps and write this split's partial
  for (int idx = threadIdx.x; idx < ROWS * D; idx += blockDim.x) {
    const int r = idx / D, d = idx % D, row = rb * ROWS + r;
    if (row >= R) continue;
    float mx = NEG_INF;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, sm_m[w][r]);
    float acc = 0.f, ls = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      const float a = safe_exp(sm_m[w][r], mx);
      acc += a * sm_o[w][r][d];
      ls += a * sm_l[w][r];
    }
    const size_t base = ((size_t)split * NKV + h) * R + row;
    O[base * D + d] = acc;
    if (d == 0) {
      M[base] = mx;
      L[base] = ls;
    }
  }
}

// Pass 2 for one (KV head, query row) per block: merge the splits of the prefix, un-rotate a
// TurboQuant V output, attend over the dense tail chunks (causal among the new tokens), merge all
// by log-sum-exp, normalize, and write the row in the queries' dtype and layout (1, n_q, L, D).
template <typename T, int D, int NKV, int NCH, int CH, bool VTURBO>
__device__ void finish(const float* O, const float* M, const float* L, const T* q, const float* fprm,
                       const int32_t* prm, const float* sgv, const T* const* tks, const T* const* tvs,
                       T* out) {
  constexpr int WARPS = 4, EPT = D / 32;
  const int R = prm[1], S = prm[3], tail_len = prm[4], Lq = prm[5];
  const int h = blockIdx.y, row = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __shared__ float so[WARPS + 1][D];
  __shared__ float sm[WARPS + 1], sl[WARPS + 1];

  float mp = NEG_INF;
#pragma unroll 8
  for (int s = 0; s < S; ++s) mp = fmaxf(mp, M[((size_t)s * NKV + h) * R + row]);
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float acc = 0.f;
#pragma unroll 8
    for (int s = 0; s < S; ++s) {
      const size_t b = ((size_t)s * NKV + h) * R + row;
      acc += safe_exp(M[b], mp) * O[b * D + d];
    }
    so[WARPS][d] = acc;
  }
  if (threadIdx.x == 0) {
    float ls = 0.f;
    for (int s = 0; s < S; ++s) {
      const size_t b = ((size_t)s * NKV + h) * R + row;
      ls += safe_exp(M[b], mp) * L[b];
    }
    sm[WARPS] = mp;
    sl[WARPS] = ls;
  }
  __syncthreads();
  if constexpr (VTURBO) {  // x = diag(s) H y / sqrt(D)
    fwht_rows<1, D>(so[WARPS]);
    for (int d = threadIdx.x; d < D; d += blockDim.x) so[WARPS][d] *= sgv[h * D + d] * rsqrtf((float)D);
  }

  float qv[EPT], ow[EPT];
#pragma unroll
  for (int i = 0; i < EPT; ++i) {
    qv[i] = (float)q[((size_t)h * R + row) * D + lane + 32 * i] * fprm[0];
    ow[i] = 0.f;
  }
  float mw = NEG_INF, lw = 0.f;
  const int qpos = tail_len - Lq + row % Lq;
  for (int j = warp; j <= qpos; j += WARPS) {
    const size_t off = ((size_t)h * CH + j % CH) * D;
    const T* kp = tks[j / CH] + off;
    const T* vp = tvs[j / CH] + off;
    float sc = 0.f;
#pragma unroll
    for (int i = 0; i < EPT; ++i) sc = fmaf(qv[i], (float)kp[lane + 32 * i], sc);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sc += __shfl_xor_sync(0xffffffffu, sc, o);
    if (sc > mw) {
      const float c = safe_exp(mw, sc);
      lw *= c;
#pragma unroll
      for (int i = 0; i < EPT; ++i) ow[i] *= c;
      mw = sc;
    }
    const float p = __expf(sc - mw);
    lw += p;
#pragma unroll
    for (int i = 0; i < EPT; ++i) ow[i] = fmaf(p, (float)vp[lane + 32 * i], ow[i]);
  }
#pragma unroll
  for (int i = 0; i < EPT; ++i) so[warp][lane + 32 * i] = ow[i];
  if (lane == 0) {
    sm[warp] = mw;
    sl[warp] = lw;
  }
  __syncthreads();

  float mt = NEG_INF;
#pragma unroll
  for (int w = 0; w <= WARPS; ++w) mt = fmaxf(mt, sm[w]);
  float den = 0.f;
#pragma unroll
  for (int w = 0; w <= WARPS; ++w) den += safe_exp(sm[w], mt) * sl[w];
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float num = 0.f;
#pragma unroll
    for (int w = 0; w <= WARPS; ++w) num += safe_exp(sm[w], mt) * so[w][d];
    out[((size_t)h * R + row) * D + d] = (T)(num / den);
  }
}

}  // namespace cart
"""

PASS1 = r"""
cart::flash_pass1<T, TK, TV, BK, BV, HD, EPL, ROWS, NKV, PAGE, WARPS, UNR>(
    q, fprm, sgk, (const void*)k0, (const void*)k1, (const void*)k2, (const void*)v0,
    (const void*)v1, (const void*)v2, cbk, cbv, prm, O, M, L);
"""


def finish_source(n_chunks):
    """Body of the pass-2 kernel for `n_chunks` tail chunk inputs tk0, tv0, ..., tk{n-1}, tv{n-1}."""
    tks = ", ".join(f"tk{i}" for i in range(n_chunks))
    tvs = ", ".join(f"tv{i}" for i in range(n_chunks))
    return (
        f"const T* tks[{n_chunks}] = {{{tks}}};\n"
        f"const T* tvs[{n_chunks}] = {{{tvs}}};\n"
        "cart::finish<T, HD, NKV, NCH, CH, VTURBO>(O, M, L, q, fprm, prm, sgv, tks, tvs, out);\n"
    )
