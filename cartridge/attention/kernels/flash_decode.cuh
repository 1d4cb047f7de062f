// Flash-decoding attention over cartridge pages, for MLX's CUDA backend (compiled by NVRTC through
// mx.fast.cuda_kernel; `cuda_source.py` includes this file by path, so every call hashes a short source).
//
// Pass 1 splits the prefix tokens over thread blocks (grid: splits x n_kv_heads x row blocks). A block
// reads the pages of one KV head once for all query rows of its GQA group (row block), dequantizes each
// token's slice in registers, and keeps an online softmax per row (flash-decoding; Dao et al. 2023, and
// shared/reference/kv-quant-algorithms.md 5.1). A lane owns EPL consecutive elements of head_dim;
// D / EPL lanes share a token and reduce its scores with warp shuffles. The finish merges the splits by
// log-sum-exp, attends over the dense tail, and writes the normalized output: either a second kernel
// (`finish_row`, one block per KV head and query row), or, in a single launch, the block of each KV head
// that completes last (`last_block`, `finish_rows`), after the last split's block has added the tail as
// one more partial (`tail_rows`). For mlx4g32 K and V with at most 4 query rows per KV head,
// `flash_pass1_mma` replaces pass 1 with a tensor-core version (integer mma.m16n8k32 scores, mma.m16n8k16
// output; see the comment above it).
#pragma once

#define NEG_INF (__int_as_float(0xff800000))

namespace cart {
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

// Merge the WARPS per-warp partials of ROWS query rows by log-sum-exp (so: [WARPS][ROWS][D] outputs,
// sm, sl: [WARPS][ROWS] running max and sum) and write rows row0 .. row0 + ROWS - 1 (those < R) of
// this split's partial O (splits, NKV, R, D), M and L (splits, NKV, R) for KV head h.
template <int WARPS, int ROWS, int D, int NKV>
__device__ void write_split(const float* so, const float* sm, const float* sl, int row0, int R, int split,
                            int h, float* O, float* M, float* L) {
  for (int idx = threadIdx.x; idx < ROWS * D; idx += blockDim.x) {
    const int r = idx / D, d = idx % D, row = row0 + r;
    if (row >= R) continue;
    float mx = NEG_INF;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, sm[w * ROWS + r]);
    float acc = 0.f, ls = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      const float a = safe_exp(sm[w * ROWS + r], mx);
      acc += a * so[(w * ROWS + r) * D + d];
      ls += a * sl[w * ROWS + r];
    }
    const size_t base = ((size_t)split * NKV + h) * R + row;
    O[base * D + d] = acc;
    if (d == 0) {
      M[base] = mx;
      L[base] = ls;
    }
  }
}
}  // namespace cart

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


template <typename T, int TK, int TV, int BK, int BV, int D, int EPL, int ROWS, int NKV, int P, int WARPS,
          int UNR>
__device__ void flash_pass1(const T* q, float scale, const float* sgk,
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
    float v = row < R ? (float)q[((size_t)h * R + row) * D + d] * scale : 0.f;
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

  const int t0 = prm[6] + split * per_split, first = prm[7];  // stored tokens first .. n_tokens - 1 (protection)
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
      const bool valid = tb + u * SLOTS + slot < t1 && tb + u * SLOTS + slot >= first;
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
  write_split<WARPS, ROWS, D, NKV>(&sm_o[0][0][0], &sm_m[0][0], &sm_l[0][0], rb * ROWS, R, split, h, O, M, L);
}
}  // namespace cart

namespace cart {
// ---- Tensor-core pass 1 for mlx4g32 K and V pages (at most 4 query rows per KV head) ----
// A warp takes tiles of 16 prefix tokens. Scores use the integer mma.m16n8k32 (u8 x s8, exact int32)
// with tokens as M and one 32-element group as K: A is the 4-bit codes as bytes (two masks per code word;
// the k order this gives is matched in B), B's 8 columns are the 4 query rows as 16-bit integers split
// into high and low signed bytes (q quantized per row to 2^-15 of its largest element). Each group's
// exact dot product is scaled afterwards (k = s c + b: q.k = s (q.c) + b sum(q)). The output uses head_dim
// as M and tokens as K (mma.m16n8k16): A is V dequantized to fp16 in registers (s c + b by HFMA2 on the
// exact codes, one rounding, as fp16 attention reads V; this bounds the kernel's error near 5e-4 of the
// output), the 8 columns are the probabilities split into fp16 high and low parts (p = hi + lo to
// ~2^-22). Lane (g, tig) keeps the softmax state of query row tig. Tiles reach shared memory through
// cp.async (STAGES deep), padded so the fragment reads are free of bank conflicts. Fragment layouts: PTX
// ISA, "Matrix fragments for mma.m16n8k16 / mma.m16n8k32".

__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// d += a b over k = 32: a 16 x 32 unsigned bytes, b 32 x 8 signed bytes, exact int32 (PTX ISA, "Matrix
// fragments for mma.m16n8k32": registers hold the same rows / k words as m16n8k16's, 4 bytes each).
__device__ __forceinline__ void imma16832(int (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 16 bytes global -> shared (a 32-bit shared-memory address), zero-filled when !valid
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ uint32_t h2_bits(__half2 h) { return *reinterpret_cast<uint32_t*>(&h); }
__device__ __forceinline__ __half2 bits_h2(uint32_t u) { return *reinterpret_cast<__half2*>(&u); }

// Nibbles 0 and 4 of x as an exact half2: (x & 0x000F000F) | 0x64006400 is (1024 + c0, 1024 + c4).
__device__ __forceinline__ uint32_t nib_lo(uint32_t x) {
  return h2_bits(__hsub2(bits_h2((x & 0x000F000Fu) | 0x64006400u), bits_h2(0x64006400u)));
}
// Nibbles 1 and 5: (1024 + 16 c) / 16 - 64 = c, exact.
__device__ __forceinline__ uint32_t nib_hi(uint32_t x) {
  return h2_bits(__hfma2(bits_h2((x & 0x00F000F0u) | 0x64006400u), bits_h2(0x2C002C00u), bits_h2(0xD400D400u)));
}

// N consecutive 32-bit words (N = 1 or 2, 4N-byte aligned) from shared memory.
template <int N>
__device__ __forceinline__ void smem_words(const __half* p, uint32_t (&w)[N]) {
  if constexpr (N == 2) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    w[0] = u.x;
    w[1] = u.y;
  } else {
    w[0] = *reinterpret_cast<const uint32_t*>(p);
  }
}

// Codes c (exact halves) to s c + b, rounded once to fp16.
__device__ __forceinline__ uint32_t deq(uint32_t c, __half2 s, __half2 b) {
  return h2_bits(__hfma2(bits_h2(c), s, b));
}

// N consecutive halves (N = 2 or 4, 4N-byte aligned) from shared memory as floats.
template <int N>
__device__ __forceinline__ void load_halves(const __half* p, float (&f)[N]) {
  if constexpr (N == 4) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    const float2 a = __half22float2(bits_h2(u.x)), b = __half22float2(bits_h2(u.y));
    f[0] = a.x; f[1] = a.y; f[2] = b.x; f[3] = b.y;
  } else {
    const float2 a = __half22float2(bits_h2(*reinterpret_cast<const uint32_t*>(p)));
    f[0] = a.x; f[1] = a.y;
  }
}

// (x0, x1) as fp16: the high part, or (lo) the fp16 remainder x - float(hi).
__device__ __forceinline__ uint32_t split_h2(float x0, float x1, bool lo) {
  const __half2 h = __floats2half2_rn(x0, x1);
  const float2 f = __half22float2(h);
  const float m = lo ? 1.f : 0.f;
  return h2_bits(__floats2half2_rn(fmaf(-m, f.x, x0), fmaf(-m, f.y, x1)));
}

// 2^x, flushing subnormal results to zero (MUFU.EX2 without the subnormal fix-up of exp2f); -inf gives 0.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// RK: K (and V, which the finish rotates back) stored by mlx4g32+rot: q is rotated first, (R q).(R k) = q.k.
template <typename T, int D, int NKV, int P, int WARPS, int STAGES, bool RK>
__device__ void flash_pass1_mma(const T* q, float scale, const float* sgk, const uint32_t* kc, const __half* ks,
                                const __half* kb, const uint32_t* vc, const __half* vs, const __half* vb,
                                const int32_t* prm, float* O, float* M, float* L) {
  constexpr int NG = D / 32, WT = D / 8, WS = WT + 4;  // groups, code words per token, padded stride
  constexpr int CODE_WORDS = 16 * WS, SB_HALVES = 16 * NG;
  constexpr int STAGE_WORDS = 2 * CODE_WORDS + 4 * SB_HALVES / 2;
  constexpr int CPS = NG / 2;  // 16-byte code copies per lane and side per tile (16 tokens x NG words / 32)
  constexpr int TPC = 32 / NG;  // tokens between a lane's successive code copies
  constexpr float LOG2E = 1.4426950408889634f, LN2 = 0.6931471805599453f;
  const int n_tokens = prm[0], R = prm[1], per_split = prm[2];
  const int h = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane >> 2, tig = lane & 3;

  __shared__ __align__(16) uint32_t stage[WARPS][STAGES][STAGE_WORDS];
  __shared__ float sq[4][D], sqs[4][NG], sqm[4][NG];
  __shared__ float sp[WARPS][16][4];
  __shared__ float sm_m[WARPS][4], sm_l[WARPS][4];

  const int t0 = prm[6] + blockIdx.x * per_split, first = prm[7];  // prm[6]: `first` rounded down to 16
  const int t1 = min(t0 + per_split, n_tokens);
  const int n_tiles = (t1 - t0 + 15) / 16;

  // A tile's copies (a tile never crosses a page: P % 16 == 0): per side, lane copies the 16-byte word
  // lane % NG of tokens lane / NG + TPC i; lanes < 8 NG copy 16 bytes of the scales / biases (array
  // lane / 2NG, tokens 8 (lane % 2NG) / NG and the next). Sources are these bases + the tile's first token.
  const int tt = lane / NG, sb_which = lane / (2 * NG), sb_part = lane % (2 * NG);
  const char* kbase = reinterpret_cast<const char*>(kc) + tt * (D / 2) + 16 * (lane % NG);
  const char* vbase = reinterpret_cast<const char*>(vc) + tt * (D / 2) + 16 * (lane % NG);
  const __half* sb_arr = sb_which == 0 ? ks : sb_which == 1 ? kb : sb_which == 2 ? vs : vb;
  const char* sbase = reinterpret_cast<const char*>(sb_arr) + 16 * sb_part;
  const uint32_t dcode = 4 * (tt * WS + 4 * (lane % NG));
  const uint32_t dsb = 4 * (2 * CODE_WORDS + sb_which * (SB_HALVES / 2) + 4 * sb_part);
  const int sb_tok = sb_part * 8 / NG;
  const uint32_t stage0 = (uint32_t)__cvta_generic_to_shared(&stage[warp][0][0]);

  auto load_tile = [&](int tile, int buf) {
    const unsigned tb = t0 + 16 * tile, lim = t1 - tb;  // first token of the tile, tokens left
    const unsigned tok = ((tb / P) * NKV + h) * P + tb % P;  // its row in the pages
    const uint32_t st = stage0 + buf * (4 * STAGE_WORDS);
#pragma unroll
    for (int i = 0; i < CPS; ++i) {
      const bool valid = tt + TPC * i < lim;
      cp_async16(st + dcode + i * 4 * TPC * WS, kbase + (size_t)tok * (D / 2) + i * TPC * (D / 2), valid);
      cp_async16(st + 4 * CODE_WORDS + dcode + i * 4 * TPC * WS, vbase + (size_t)tok * (D / 2) + i * TPC * (D / 2),
                 valid);
    }
    if (lane < 8 * NG) cp_async16(st + dsb, sbase + (size_t)tok * (2 * NG), sb_tok < lim);
  };

  // the first tiles' copies go out before the queries are read
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (warp + s * WARPS < n_tiles) load_tile(warp + s * WARPS, s);
    cp_async_commit();
  }

  // queries scaled by scale log2(e) (scores in base-2 units: probabilities are one ex2 each), then as
  // 16-bit integers per row, qi = round(q QS) with QS = 32639 / max |q| (|qi| <= 32639, so the high byte
  // (qi + 128) >> 8 and the low byte qi - 256 hi both fit int8)
  for (int idx = threadIdx.x; idx < 4 * D; idx += blockDim.x) {
    const int r = idx / D, d = idx % D;
    sq[r][d] = r < R ? (float)q[((size_t)h * R + r) * D + d] * (scale * LOG2E) * (RK ? sgk[h * D + d] : 1.f) : 0.f;
  }
  __syncthreads();
  if constexpr (RK) {  // q~ = H diag(s) q / sqrt(D), as flash_pass1_tc
    fwht_rows<4, D>(&sq[0][0]);
    for (int idx = threadIdx.x; idx < 4 * D; idx += blockDim.x) sq[idx / D][idx % D] *= rsqrtf((float)D);
    __syncthreads();
  }
  if (threadIdx.x < 4 * NG) {
    const int r = threadIdx.x / NG, G = threadIdx.x % NG;
    float acc = 0.f, mx = 0.f;
    for (int d = 0; d < 32; ++d) {
      acc += sq[r][32 * G + d];
      mx = fmaxf(mx, fabsf(sq[r][32 * G + d]));
    }
    sqs[r][G] = acc;
    sqm[r][G] = mx;
  }
  __syncthreads();

  // lane (g, tig) computes query row tig: B column 2 j is row j's high byte, 2 j + 1 its low byte
  const int qr = g >> 1;
  float qmax = 0.f;
#pragma unroll
  for (int G = 0; G < NG; ++G) qmax = fmaxf(qmax, sqm[qr][G]);
  const float QS = qmax > 0.f ? 32639.f / qmax : 1.f;
  const float qinv = 1.f / __shfl_sync(0xffffffffu, QS, 8 * tig);  // row tig's 1 / QS (lane 8 tig: g = 2 tig)
  uint32_t qb[NG][2];  // bytes b: dims 32 G + 8 tig + 2 b (qb[G][0]) and + 1 (qb[G][1]), this column's byte
  float qs[NG];        // row tig's sum over each group (the bias term)
#pragma unroll
  for (int G = 0; G < NG; ++G) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      uint32_t word = 0;
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const int qi = __float2int_rn(sq[qr][32 * G + 8 * tig + 2 * b + j] * QS);
        const int hi = (qi + 128) >> 8;
        word |= (uint32_t)((g & 1 ? qi - 256 * hi : hi) & 0xFF) << (8 * b);
      }
      qb[G][j] = word;
    }
    qs[G] = sqs[tig][G];
  }

  float m = NEG_INF, l = 0.f;
  float o[NG][2][4];
#pragma unroll
  for (int G = 0; G < NG; ++G) {
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) o[G][j][c] = 0.f;
  }

  int rd = 0, wr = STAGES - 1;  // stage buffers read and written this iteration
  for (int tile = warp; tile < n_tiles; tile += WARPS) {
    const int nxt = tile + (STAGES - 1) * WARPS;
    if (nxt < n_tiles) load_tile(nxt, wr);
    cp_async_commit();
    cp_async_wait<STAGES - 1>();
    __syncwarp();
    const uint32_t* st = stage[warp][rd];
    rd = rd + 1 == STAGES ? 0 : rd + 1;
    wr = wr + 1 == STAGES ? 0 : wr + 1;
    const uint32_t* skc = st;
    const uint32_t* svc = st + CODE_WORDS;
    const __half* sks = reinterpret_cast<const __half*>(st + 2 * CODE_WORDS);
    const __half* skb = sks + SB_HALVES;
    const __half* svs = skb + SB_HALVES;
    const __half* svb = svs + SB_HALVES;
    const int tb = t0 + 16 * tile;

    // scores of tokens g and g + 8 for query row tig: per group, the exact integer dot product of the
    // codes with qi (u8 x s8 MMA, k = the group's 32 dims), scaled by s; plus b sum(q) (k = s c + b)
    float ksf[2][NG], kbf[2][NG];
    load_halves<NG>(sks + g * NG, ksf[0]);
    load_halves<NG>(sks + (g + 8) * NG, ksf[1]);
    load_halves<NG>(skb + g * NG, kbf[0]);
    load_halves<NG>(skb + (g + 8) * NG, kbf[1]);
    float x[2] = {0.f, 0.f}, xb[2] = {0.f, 0.f};
#pragma unroll
    for (int G = 0; G < NG; ++G) {
      const uint32_t w0 = skc[g * WS + 4 * G + tig], w1 = skc[(g + 8) * WS + 4 * G + tig];
      int c[4] = {0, 0, 0, 0};
      const uint32_t a[4] = {w0 & 0x0F0F0F0Fu, w1 & 0x0F0F0F0Fu, (w0 >> 4) & 0x0F0F0F0Fu, (w1 >> 4) & 0x0F0F0F0Fu};
      imma16832(c, a, qb[G][0], qb[G][1]);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        x[r] = fmaf(ksf[r][G], (float)(256 * c[2 * r] + c[2 * r + 1]), x[r]);  // exact below 2^24
        xb[r] = fmaf(kbf[r][G], qs[G], xb[r]);
      }
    }
    float mt = NEG_INF;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int t = tb + g + 8 * r;
      x[r] = t < t1 && t >= first ? fmaf(x[r], qinv, xb[r]) : NEG_INF;
      mt = fmaxf(mt, x[r]);
    }
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, off));
    const float mn = fmaxf(m, mt);  // finite: every tile holds a stored token (the first one holds `first`)
    const float alpha = exp2_ftz(m - mn);
    const float p0 = exp2_ftz(x[0] - mn), p1 = exp2_ftz(x[1] - mn);
    l = fmaf(l, alpha, p0 + p1);
    m = mn;
    sp[warp][g][tig] = p0;
    sp[warp][g + 8][tig] = p1;
    __syncwarp();
    if (__any_sync(0xffffffffu, alpha != 1.f)) {  // a running max grew
#pragma unroll
      for (int G = 0; G < NG; ++G)
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
          for (int c = 0; c < 4; ++c) o[G][j][c] *= alpha;
    }

    // output: B column 2 j is row j's probabilities (fp16 high part), 2 j + 1 the low part; K slots
    // 2 tig, 2 tig + 1, 2 tig + 8, 2 tig + 9. A is V dequantized in registers: s c + b in fp16 by HFMA2
    // on the exact codes (one rounding, as fp16 attention reads V), so one B serves every group.
    const int kt[4] = {2 * tig, 2 * tig + 1, 2 * tig + 8, 2 * tig + 9};
    const uint32_t b0 = split_h2(sp[warp][kt[0]][qr], sp[warp][kt[1]][qr], g & 1);
    const uint32_t b1 = split_h2(sp[warp][kt[2]][qr], sp[warp][kt[3]][qr], g & 1);
    uint32_t vsw[4][NG / 2], vbw[4][NG / 2];  // the NG scales / biases of token kt[k] as half pairs
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      smem_words<NG / 2>(svs + kt[k] * NG, vsw[k]);
      smem_words<NG / 2>(svb + kt[k] * NG, vbw[k]);
    }
    const uint32_t sel = (g & 1) ? 0x7632u : 0x5410u;
#pragma unroll
    for (int G = 0; G < NG; ++G) {
      const uint32_t pick = G % 2 ? 0x7632u : 0x5410u;  // group G of two tokens as one half2
      const __half2 s01 = bits_h2(__byte_perm(vsw[0][G / 2], vsw[1][G / 2], pick));
      const __half2 s23 = bits_h2(__byte_perm(vsw[2][G / 2], vsw[3][G / 2], pick));
      const __half2 c01 = bits_h2(__byte_perm(vbw[0][G / 2], vbw[1][G / 2], pick));
      const __half2 c23 = bits_h2(__byte_perm(vbw[2][G / 2], vbw[3][G / 2], pick));
      const int wi = 4 * G + (g >> 1);
      uint32_t xa = __byte_perm(svc[kt[0] * WS + wi], svc[kt[1] * WS + wi], sel);
      uint32_t xc = __byte_perm(svc[kt[2] * WS + wi], svc[kt[3] * WS + wi], sel);
      uint32_t a[4] = {deq(nib_lo(xa), s01, c01), deq(nib_hi(xa), s01, c01), deq(nib_lo(xc), s23, c23),
                       deq(nib_hi(xc), s23, c23)};
      mma16816(o[G][0], a, b0, b1);
      xa >>= 8;
      xc >>= 8;
      uint32_t a2[4] = {deq(nib_lo(xa), s01, c01), deq(nib_hi(xa), s01, c01), deq(nib_lo(xc), s23, c23),
                        deq(nib_hi(xc), s23, c23)};
      mma16816(o[G][1], a2, b0, b1);
    }
    __syncwarp();
  }
  cp_async_wait<0>();

  // this warp's totals: l over the token lanes; the output of row tig is its high + low columns
#pragma unroll
  for (int off = 4; off < 32; off <<= 1) l += __shfl_xor_sync(0xffffffffu, l, off);
  __syncthreads();  // every warp is done with its stage buffers: reuse them for the outputs
  float* sm_o = reinterpret_cast<float*>(&stage[0][0][0]);  // [WARPS][4][D]
#pragma unroll
  for (int G = 0; G < NG; ++G)
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int c = 0; c < 4; c += 2) {
        const int d = 32 * G + 4 * g + 2 * j + (c >> 1);
        sm_o[(warp * 4 + tig) * D + d] = o[G][j][c] + o[G][j][c + 1];
      }
  if (g == 0) {
    sm_m[warp][tig] = m * LN2;  // natural-log units, as every partial
    sm_l[warp][tig] = l;
  }
  __syncthreads();

  write_split<WARPS, 4, D, NKV>(sm_o, &sm_m[0][0], &sm_l[0][0], 0, R, blockIdx.x, h, O, M, L);
}
}  // namespace cart

namespace cart {
// The finish of one (KV head h, query row): merge the splits of the prefix, un-rotate a TurboQuant V
// output, attend over the dense tail chunks (causal among the new tokens), merge all by log-sum-exp,
// normalize, and write the row in the queries' dtype and layout (1, n_q, L, D). Needs 128 threads.
// O, M, L are read with ld.global.cg: in a single launch other blocks wrote them during this kernel.
// VROT: the prefix's V was stored rotated (TurboQuant, or a +rot tier): the merged prefix output is rotated
// back before the tail is added. SINKS: one more logit per query head with no value (gpt-oss `sinks`, natural
// log units like the scores), snk[q head], q head = h * group + row / Lq.
template <typename T, int D, int NKV, int NCH, int CH, bool VROT, bool SINKS, int NP>
__device__ void finish_row(const float* O, const float* M, const float* L, const T* q, float scale,
                           const int32_t* prm, const float* sgv, const float* snk, const T* pk, const T* pv,
                           const T* const* tks, const T* const* tvs, T* out, int h, int row) {
  constexpr int WARPS = 4, EPT = D / 32;
  const int R = prm[1], S = prm[3], tail_len = prm[4], Lq = prm[5];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __shared__ float so[WARPS + 1][D];
  __shared__ float sm[WARPS + 1], sl[WARPS + 1];

  float mp = NEG_INF;
#pragma unroll 8
  for (int s = 0; s < S; ++s) mp = fmaxf(mp, __ldcg(M + ((size_t)s * NKV + h) * R + row));
  {  // warp w merges the splits w, w + WARPS, ...; then the warps' sums are added
    float pacc[EPT], pls = 0.f;
#pragma unroll
    for (int i = 0; i < EPT; ++i) pacc[i] = 0.f;
#pragma unroll 4
    for (int s = warp; s < S; s += WARPS) {
      const size_t b = ((size_t)s * NKV + h) * R + row;
      const float w = safe_exp(__ldcg(M + b), mp);
      pls = fmaf(w, __ldcg(L + b), pls);
#pragma unroll
      for (int i = 0; i < EPT; ++i) pacc[i] = fmaf(w, __ldcg(O + b * D + lane + 32 * i), pacc[i]);
    }
#pragma unroll
    for (int i = 0; i < EPT; ++i) so[warp][lane + 32 * i] = pacc[i];
    if (lane == 0) sl[warp] = pls;
  }
  __syncthreads();
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float acc = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) acc += so[w][d];
    so[WARPS][d] = acc;
  }
  if (threadIdx.x == 0) {
    float ls = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) ls += sl[w];
    sm[WARPS] = mp;
    sl[WARPS] = ls;
  }
  __syncthreads();
  if constexpr (VROT) {  // x = diag(s) H y / sqrt(D)
    fwht_rows<1, D>(so[WARPS]);
    for (int d = threadIdx.x; d < D; d += blockDim.x) so[WARPS][d] *= sgv[h * D + d] * rsqrtf((float)D);
  }

  float qv[EPT], ow[EPT];
#pragma unroll
  for (int i = 0; i < EPT; ++i) {
    qv[i] = (float)q[((size_t)h * R + row) * D + lane + 32 * i] * scale;
    ow[i] = 0.f;
  }
  float mw = NEG_INF, lw = 0.f;
  const int qpos = tail_len - Lq + row % Lq;
  for (int j = warp - NP; j <= qpos; j += WARPS) {  // j < 0: protected token NP + j (visible to every row)
    const size_t off = j < 0 ? ((size_t)h * NP + NP + j) * D : ((size_t)h * CH + j % CH) * D;
    const T* kp = j < 0 ? pk + off : tks[j / CH] + off;
    const T* vp = j < 0 ? pv + off : tvs[j / CH] + off;
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

  float mt = NEG_INF, sink = NEG_INF;
#pragma unroll
  for (int w = 0; w <= WARPS; ++w) mt = fmaxf(mt, sm[w]);
  if constexpr (SINKS) {
    sink = snk[h * (R / Lq) + row / Lq];
    mt = fmaxf(mt, sink);
  }
  float den = 0.f;
#pragma unroll
  for (int w = 0; w <= WARPS; ++w) den += safe_exp(sm[w], mt) * sl[w];
  if constexpr (SINKS) den += safe_exp(sink, mt);
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float num = 0.f;
#pragma unroll
    for (int w = 0; w <= WARPS; ++w) num += safe_exp(sm[w], mt) * so[w][d];
    out[((size_t)h * R + row) * D + d] = (T)(num / den);
  }
  __syncthreads();  // the shared arrays are free for the next row
}

// N consecutive floats (N = 2, 4 or a multiple of 4; 4N-byte aligned) through L2 only (ld.global.cg:
// written by other blocks during this kernel).
template <int N>
__device__ __forceinline__ void ldcg_floats(const float* p, float (&x)[N]) {
  if constexpr (N == 2) {
    const float2 u = __ldcg(reinterpret_cast<const float2*>(p));
    x[0] = u.x; x[1] = u.y;
  } else {
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      const float4 u = __ldcg(reinterpret_cast<const float4*>(p) + i);
      x[4 * i] = u.x; x[4 * i + 1] = u.y; x[4 * i + 2] = u.z; x[4 * i + 3] = u.w;
    }
  }
}

// The dense tail's share of every query row (at most 8) of KV head h, for the single launch: attention over
// tail tokens 0 .. qpos (causal among the new tokens; one chunk) as one more partial, slot S = prm[3] of
// O, M, L, after the S prefix splits. The block of the last split computes it before it arrives at the
// counter (that split is the shortest when the tokens do not divide evenly), so the finish only merges.
// Warp w takes rows w and w + 4; a lane owns EPT consecutive head_dim elements.
template <typename T, int D, int NKV, int CH>
__device__ void tail_rows(const T* q, float scale, const int32_t* prm, const T* tk, const T* tv, float* O,
                          float* M, float* L, int h) {
  constexpr int EPT = D / 32;
  const int R = prm[1], S = prm[3], tail_len = prm[4], Lq = prm[5];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, e0 = EPT * lane;
  for (int row = warp; row < R; row += 4) {
    const size_t r0 = (size_t)h * R + row;
    float qv[EPT], ot[EPT], mt = NEG_INF, lt = 0.f;
#pragma unroll
    for (int i = 0; i < EPT; ++i) {
      qv[i] = (float)q[r0 * D + e0 + i] * scale;
      ot[i] = 0.f;
    }
    const int qpos = tail_len - Lq + row % Lq;
#pragma unroll 4
    for (int j = 0; j <= qpos; ++j) {
      const T* kp = tk + ((size_t)h * CH + j) * D + e0;
      const T* vp = tv + ((size_t)h * CH + j) * D + e0;
      float sc = 0.f, vj[EPT];
#pragma unroll
      for (int i = 0; i < EPT; ++i) {
        sc = fmaf(qv[i], (float)kp[i], sc);
        vj[i] = (float)vp[i];
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) sc += __shfl_xor_sync(0xffffffffu, sc, off);
      const float mn = fmaxf(mt, sc), c = safe_exp(mt, mn), p = __expf(sc - mn);
      lt = fmaf(lt, c, p);
#pragma unroll
      for (int i = 0; i < EPT; ++i) ot[i] = fmaf(ot[i], c, p * vj[i]);
      mt = mn;
    }
    const size_t b = (size_t)S * NKV * R + r0;
#pragma unroll
    for (int i = 0; i < EPT; ++i) O[b * D + e0 + i] = ot[i];
    if (lane == 0) {
      M[b] = mt;
      L[b] = lt;
    }
  }
}

// x <- diag(s) H x / sqrt(D) for one row of D held by a warp, lane l holding elements EPT * l .. EPT * l + EPT - 1
// (`finish_row`'s VROT step in registers): the Walsh-Hadamard butterflies over the element index's low bits run
// within a lane, over its high bits (the lane's bits) between lanes by shuffles; sg: the signs of this lane's
// elements (+1 / -1).
template <int D, int EPT>
__device__ __forceinline__ void rotate_back_lanes(float (&x)[EPT], const float* sg) {
#pragma unroll
  for (int len = 1; len < EPT; len <<= 1) {
#pragma unroll
    for (int i = 0; i < EPT; ++i) {
      if (i & len) continue;
      const float a = x[i], b = x[i + len];
      x[i] = a + b;
      x[i + len] = a - b;
    }
  }
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int bit = 1; bit < 32; bit <<= 1) {
#pragma unroll
    for (int i = 0; i < EPT; ++i) {
      const float other = __shfl_xor_sync(0xffffffffu, x[i], bit);
      x[i] = (lane & bit) ? other - x[i] : x[i] + other;
    }
  }
  const float norm = rsqrtf((float)D);
#pragma unroll
  for (int i = 0; i < EPT; ++i) x[i] *= sg[i] * norm;
}

// The finish of every query row (at most 8) of KV head h in one block of 4 warps, for the single launch:
// warp w takes rows w and w + 4. Per row: log-sum-exp merge of the S + 1 partials (prefix splits, then the
// tail, `tail_rows`), normalize, write in the queries' dtype. The partials come in batches of B with every
// load of a batch in flight at once (lane j holds split j's M and L, a lane the EPT consecutive head_dim
// elements from EPT lane of each O), merged online; this block runs after all others of its head, so each
// round trip to L2 adds to the step (at 128K tokens and head_dim 128: 34 partials, two batches).
// VROT (V stored rotated: TurboQuant or a +rot tier): the S prefix splits are merged first, that sum is rotated
// back (`rotate_back_lanes`: the rotation is linear, so rotating the unnormalized sum equals rotating each
// split), and the tail's partial (slot S, already in the model's basis) is merged after, as `finish_row` does.
template <typename T, int D, int NKV, bool VROT>
__device__ void finish_rows(const float* O, const float* M, const float* L, const int32_t* prm, const float* sgv,
                            T* out, int h) {
  constexpr int EPT = D / 32, B = 96 / EPT < 32 ? 96 / EPT : 32;
  const int R = prm[1], S = VROT ? prm[3] : prm[3] + 1;  // partials merged in the batches below
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, e0 = EPT * lane;
  const size_t stride = (size_t)NKV * R;  // between splits in the (S + 1, NKV, R) partials
  for (int row = warp; row < R; row += 4) {
    const size_t r0 = (size_t)h * R + row;
    float m = NEG_INF, lp = 0.f, acc[EPT];
#pragma unroll
    for (int i = 0; i < EPT; ++i) acc[i] = 0.f;
    for (int base = 0; base < S; base += B) {
      const bool mine = lane < B && base + lane < S;
      const float ms = mine ? __ldcg(M + (base + lane) * stride + r0) : NEG_INF;
      const float ls = mine ? __ldcg(L + (base + lane) * stride + r0) : 0.f;
      float x[B][EPT];
#pragma unroll
      for (int j = 0; j < B; ++j)  // past the last split: split S again, weighted 0 below
        ldcg_floats<EPT>(O + (min(base + j, S - 1) * stride + r0) * D + e0, x[j]);
      float mn = ms;
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) mn = fmaxf(mn, __shfl_xor_sync(0xffffffffu, mn, off));
      mn = fmaxf(mn, m);
      const float c = safe_exp(m, mn), w = safe_exp(ms, mn);
      lp = fmaf(lp, c, w * ls);
#pragma unroll
      for (int i = 0; i < EPT; ++i) acc[i] *= c;
#pragma unroll
      for (int j = 0; j < B; ++j) {
        const float wj = __shfl_sync(0xffffffffu, w, j);
#pragma unroll
        for (int i = 0; i < EPT; ++i) acc[i] = fmaf(wj, x[j][i], acc[i]);
      }
      m = mn;
    }
    if constexpr (VROT) {
      rotate_back_lanes<D, EPT>(acc, sgv + (size_t)h * D + e0);
      const size_t bt = (size_t)S * stride + r0;  // the tail's partial
      const float mt = __ldcg(M + bt), mn = fmaxf(m, mt), c = safe_exp(m, mn), w = safe_exp(mt, mn);
      float xt[EPT];
      ldcg_floats<EPT>(O + bt * D + e0, xt);
      lp = fmaf(lp, c, lane == 0 ? w * __ldcg(L + bt) : 0.f);  // lp is summed over the lanes below
#pragma unroll
      for (int i = 0; i < EPT; ++i) acc[i] = fmaf(w, xt[i], acc[i] * c);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) lp += __shfl_xor_sync(0xffffffffu, lp, off);
    const float inv = 1.f / lp;
#pragma unroll
    for (int i = 0; i < EPT; ++i) out[r0 * D + e0 + i] = (T)(acc[i] * inv);
  }
}

// True in the one block of KV head h (of n blocks) that finishes last; that block also resets the counter to
// zero for the next launch. Thread 0 arrives with an acq_rel atomic after a barrier: release for the partials
// every thread of the block wrote before the barrier, acquire of all earlier blocks' partials for the last
// one (the inter-block semaphore of CUTLASS, include/cutlass/barrier.h, arrive_inc: barrier, then one
// thread's release; PTX ISA memory model, release and acquire patterns).
__device__ bool last_block(const int32_t* counter, int h, int n) {
  __shared__ bool is_last;
  __syncthreads();
  if (threadIdx.x == 0) {
    int* c = const_cast<int*>(reinterpret_cast<const int*>(counter)) + h;
    int old;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(old) : "l"(c) : "memory");
    is_last = old == n - 1;
    if (is_last) *c = 0;
  }
  __syncthreads();
  return is_last;
}
}  // namespace cart

namespace cart {
// ---- Tensor-core pass 1 for every tier (`flash_pass1_tc`): the mlx4g32 kernel's pipeline, one tile decode per
// tier. A warp takes tiles of 16 prefix tokens, copied by cp.async (STAGES deep, in dynamic shared memory) as the
// pages store them. Scores: mma.m16n8k16, tokens as M, head_dim as K, the block's 8 query rows as N (fp16,
// each row scaled by a power of two into fp16's range, exact for fp16 and bf16 queries); a lane dequantizes 4
// consecutive head_dim elements of a token at a time to fp16 (`tile_deq4`). Output: mma.m16n8k16 with head_dim
// as M (lane g owns D/8 consecutive elements; row g of M block b is element g D/8 + 2b, row g + 8 the next),
// tokens as K, the rows' probabilities (fp16) as N; V is dequantized by the same function and token pairs are
// interleaved with PRMT. Per tier: fp16 as stored; bf16 converted to fp16; int8 / int6 / mlx4g32 s c + b (exact
// codes, one rounding); kivi4 the same with per-channel s, b of the tile's 32-token group; fp8 E4M3 by bit moves
// times its E8M0 scale; mxfp4 / nvfp4 and TurboQuant by a lookup of 4 codes at a time, either in an 8-entry table
// of fp16 magnitudes held in registers (`nib_lookup4`, PRMT; the sign from the code) or in a shared-memory table of
// code pairs (`smem_lookup4`; LREG, chosen per tier by measurement: CudaTuning.register_lookup), times the group scale
// (mxfp4, nvfp4; nvfp4's global factor and TurboQuant's norms are applied per score / folded into the
// probabilities). TurboQuant runs in the rotated basis: q is rotated once per block, the output is rotated
// back by the finish.
constexpr int MXFP4 = 7, NVFP4 = 8, AFF6 = 9, KIVI4 = 10;

template <int TIER, int BITS, int D>
struct TcSide {
  static_assert(TIER != F32, "flash_pass1_tc reads no float32 pages (cuda.uses_tensor_cores)");
  static constexpr bool DENSE = TIER == FP16 || TIER == BF16;
  static constexpr bool AFFINE = TIER == AFF8 || TIER == AFF6 || TIER == AFF4 || TIER == KIVI4;
  static constexpr int B0 = DENSE ? 2 * D : (TIER == AFF8 || TIER == MXFP8) ? D : TIER == AFF6 ? 3 * D / 4
                          : TIER == TURBO ? D * BITS / 8 : D / 2;
  static constexpr int B1 = AFFINE ? D / 16 : (TIER == MXFP8 || TIER == MXFP4) ? D / 32 : TIER == NVFP4 ? D / 16
                          : TIER == TURBO ? 2 : 0;
  static constexpr int B2 = AFFINE ? D / 16 : 0;
  static constexpr int SBR = TIER == KIVI4 ? 32 : 16;  // rows of arrays 1 and 2 in a tile (kivi4: its token group's)
  // row stride of array 0: an odd number of 16-byte units where the row is whole units, so that the 8 rows a
  // fragment read touches start in 8 different 4-bank groups (an even number, e.g. turbo3's 48 + 16 bytes at
  // head_dim 128, put rows 0, 2, 4, 6 on the same banks: 4-way conflicts, measured by Nsight Compute on an H200)
  static constexpr int RS = B0 % 16 != 0 ? B0 : (B0 / 16) % 2 ? B0 : B0 + 16;
  static constexpr int O1 = 16 * RS;
  static constexpr int O2 = O1 + (SBR * B1 + 15) / 16 * 16;
  static constexpr int BYTES = O2 + (SBR * B2 + 15) / 16 * 16;  // one 16-token tile
  // the shared-memory code-pair table (`LREG` false): pairs of codes -> half2, copies per lane class
  static constexpr bool LOOKUP = TIER == MXFP4 || TIER == NVFP4 || TIER == TURBO;
  static constexpr int LB = TIER == TURBO ? BITS : 4;  // bits per code
  static constexpr int ENTRIES = LOOKUP ? 1 << (2 * LB) : 0;  // code pairs
  static constexpr int COPIES = !LOOKUP ? 1 : ENTRIES * 128 <= 8192 ? 32 : 8192 / (4 * ENTRIES);
  static constexpr int LUT_BYTES = ENTRIES * COPIES * 4;
};

// 16-byte copies of a tile's rows of one array (B bytes per token, rows RS apart in shared memory), zero past
// `lim` tokens (cp.async with a short source size fills the rest of the 16 bytes with zeros).
template <int B, int RS>
__device__ __forceinline__ void tc_copy(uint32_t dst, const char* src, unsigned lim, int lane) {
#pragma unroll
  for (int p = lane; p < B; p += 32) {  // 16 tokens x B bytes = B pieces of 16 bytes
    const int byte = 16 * p;
    const uint32_t d = RS == B ? dst + byte : dst + (byte / B) * RS + byte % B;
    const int left = (int)(lim * B) - byte;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src + byte),
                 "r"(left <= 0 ? 0 : left >= 16 ? 16 : left));
  }
}

// One side's copies for the tile of tokens tb .. tb + 15 (page row `tok`): array 0 per token; arrays 1 and 2 per
// token, or for kivi4 the 32 rows of the tile's token group (its per-channel scales / biases, spec/FORMAT.md 6.5).
template <typename S>
__device__ __forceinline__ void tc_copy_side(uint32_t st, const char* const (&c)[3], size_t tok, unsigned tb,
                                             unsigned lim, int lane) {
  tc_copy<S::B0, S::RS>(st, c[0] + tok * S::B0, lim, lane);
  if constexpr (S::SBR == 32) {  // a page holds whole groups: all 32 rows are stored
    const size_t g0 = tok - tb % 32;
    tc_copy<2 * S::B1, 2 * S::B1>(st + S::O1, c[1] + g0 * S::B1, 16, lane);
    tc_copy<2 * S::B2, 2 * S::B2>(st + S::O2, c[2] + g0 * S::B2, 16, lane);
  } else {
    if constexpr (S::B1 > 0) tc_copy<S::B1, S::B1>(st + S::O1, c[1] + tok * S::B1, lim, lane);
    if constexpr (S::B2 > 0) tc_copy<S::B2, S::B2>(st + S::O2, c[2] + tok * S::B2, lim, lane);
  }
}

__device__ __forceinline__ __half2 h2_splat(float x) { return __float2half2_rn(x); }

// Four codes, one per nibble of bits 0-15 (`neg`: bit 3 of a nibble set for a negative value, other bits clear;
// `sel`: bits 0-2 of a nibble the index of its magnitude, bit 3 clear), looked up in 8 fp16 magnitudes held in
// registers (`tab`: low bytes in x (0-3), y (4-7), high bytes in z, w), as two half2: codes (0, 1) and (2, 3).
// PRMT picks 4 bytes by the 4 selector nibbles at once; each sign reaches bit 15 or 31 by one multiply (the
// other products land on bits that are masked off, carries included).
__device__ __forceinline__ void nib_lookup4(uint32_t sel, uint32_t neg, const uint4& tab, uint32_t& x01,
                                            uint32_t& x23) {
  const uint32_t hi = __byte_perm(tab.z, tab.w, sel), lo = __byte_perm(tab.x, tab.y, sel);
  x01 = __byte_perm(lo, hi, 0x5140u) | ((neg * 0x01001000u) & 0x80008000u);  // signs of nibbles 0, 1
  x23 = __byte_perm(lo, hi, 0x7362u) | ((neg * 0x00010010u) & 0x80008000u);  // nibbles 2, 3
}

// The 8 magnitudes `nib_lookup4` indexes: E2M1's 0, 0.5, 1, 1.5, 2, 3, 4, 6 (OCP MX v1.0 5.3.3; their fp16 low
// bytes are zero) for mxfp4 and nvfp4; for a b-bit TurboQuant codebook its upper half cb[2^(b-1) + i] (the host
// takes register lookups only for codebooks symmetric in fp16, cb[i] = -cb[2^b - 1 - i]: `cuda._table_ok`).
template <int TIER, int BITS>
__device__ __forceinline__ uint4 tc_table(const float* cb) {
  if constexpr (TIER == MXFP4 || TIER == NVFP4) {
    return uint4{0u, 0u, 0x3E3C3800u, 0x46444240u};
  } else if constexpr (TIER == TURBO) {
    constexpr int H = 1 << (BITS - 1);
    uint32_t lo[2] = {0u, 0u}, hi[2] = {0u, 0u};
#pragma unroll
    for (int i = 0; i < H; ++i) {
      const uint32_t h = __half_as_ushort(__float2half_rn(cb[H + i]));
      lo[i / 4] |= (h & 0xFFu) << (8 * (i % 4));
      hi[i / 4] |= (h >> 8) << (8 * (i % 4));
    }
    return uint4{lo[0], lo[1], hi[0], hi[1]};
  } else {
    return uint4{0u, 0u, 0u, 0u};
  }
}

// 4 consecutive b-bit TurboQuant codes (b = 2, 3: bits 0 .. 4b - 1 of `bits`; 4: bits 0-15) as nib_lookup4's
// selector and signs. Code c is offset to a nibble c' = c + 8 - 2^(b-1): c' >= 8 is the magnitude c' - 8, c' < 8
// minus the magnitude 7 - c' (= c' ^ 7).
template <int BITS>
__device__ __forceinline__ void turbo_nibbles(uint32_t bits, uint32_t& sel, uint32_t& neg) {
  uint32_t n = bits;
  if constexpr (BITS == 3) {
    n = ((bits & 0x7u) | ((bits << 1) & 0x70u) | ((bits << 2) & 0x700u) | ((bits << 3) & 0x7000u)) + 0x4444u;
  } else if constexpr (BITS == 2) {
    n = ((bits & 0x3u) | ((bits << 2) & 0x30u) | ((bits << 4) & 0x300u) | ((bits << 6) & 0x3000u)) + 0x6666u;
  }
  neg = ~n & 0x8888u;
  sel = (n ^ (neg - (neg >> 3))) & 0x7777u;  // 7 in each negative nibble: c' ^ 7
}

// Four codes (bits 0 .. 4 LB - 1) as two half2 from the shared-memory code-pair table: one load per pair.
template <typename S>
__device__ __forceinline__ void smem_lookup4(uint32_t bits, const uint32_t* lut, uint32_t& x01, uint32_t& x23) {
  constexpr int MASK = (1 << (2 * S::LB)) - 1;
  x01 = lut[(bits & MASK) * S::COPIES];
  x23 = lut[((bits >> (2 * S::LB)) & MASK) * S::COPIES];
}

// Fill this side's code-pair table: entry e = (code e & mask, code e >> LB) as half2, COPIES copies interleaved.
template <int TIER, int BITS, int D>
__device__ void tc_fill_lut(uint32_t* lut, const float* cb) {
  using S = TcSide<TIER, BITS, D>;
  if constexpr (S::LOOKUP) {
    constexpr int M = (1 << S::LB) - 1;
    for (int i = threadIdx.x; i < S::ENTRIES * S::COPIES; i += blockDim.x) {
      const int e = i / S::COPIES;
      float v[2];
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        const int c = (e >> (k * S::LB)) & M;
        if constexpr (TIER == TURBO) {
          v[k] = cb[c];
        } else {  // E2M1: 0, 0.5, 1, 1.5, 2, 3, 4, 6, sign in bit 3
          const int m = c & 7;
          const float mag = m < 4 ? 0.5f * m : (float)(1 << (m / 2 - 1)) * (m & 1 ? 1.5f : 1.f);
          v[k] = c & 8 ? -mag : mag;
        }
      }
      lut[i] = h2_bits(__floats2half2_rn(v[0], v[1]));
    }
  }
}

// The 32-bit little-endian word of a tile row starting at bit `bit` (4-byte aligned row; the bits read exist).
__device__ __forceinline__ uint32_t row_bits(const char* row, int bit, int width) {
  const uint32_t* w = reinterpret_cast<const uint32_t*>(row);
  const int wi = bit / 32, sh = bit % 32;
  return sh + width <= 32 ? w[wi] >> sh : __funnelshift_r(w[wi], w[wi + 1], sh);
}

// Elements d0 .. d0 + 3 (d0 % 4 == 0) of tile row r as two fp16 pairs (d0, d0 + 1) and (d0 + 2, d0 + 3):
// the decoded value, except TurboQuant (codebook value, the norm comes later) and nvfp4 (without the global
// factor). Codes of mxfp4, nvfp4 and TurboQuant are looked up in registers (LREG: `tab`, this side's magnitudes
// from `tc_table`) or in shared memory (`lut`: this lane's column of the code-pair table, `tc_fill_lut`).
template <int TIER, int BITS, int D, bool LREG>
__device__ __forceinline__ void tile_deq4(const char* tile, int r, int d0, const uint4& tab, const uint32_t* lut,
                                          uint32_t& x01, uint32_t& x23) {
  using S = TcSide<TIER, BITS, D>;
  const char* row = tile + r * S::RS;
  if constexpr (TIER == FP16) {
    const uint2 u = *reinterpret_cast<const uint2*>(row + 2 * d0);
    x01 = u.x;
    x23 = u.y;
  } else if constexpr (TIER == BF16) {
    const uint2 u = *reinterpret_cast<const uint2*>(row + 2 * d0);
    x01 = h2_bits(__float22half2_rn(__bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x))));
    x23 = h2_bits(__float22half2_rn(__bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y))));
  } else if constexpr (S::AFFINE) {
    __half2 s01, s23, b01, b23;
    if constexpr (TIER == KIVI4) {  // the group's scales / biases of channels d0 .. d0 + 3 (any row of the tile)
      const uint2 s = *reinterpret_cast<const uint2*>(tile + S::O1 + 2 * d0);
      const uint2 b = *reinterpret_cast<const uint2*>(tile + S::O2 + 2 * d0);
      s01 = bits_h2(s.x), s23 = bits_h2(s.y), b01 = bits_h2(b.x), b23 = bits_h2(b.y);
    } else {  // one scale and bias per 32 elements of the token
      const __half* sb = reinterpret_cast<const __half*>(tile + S::O1) + r * (D / 32) + d0 / 32;
      s01 = s23 = __half2half2(sb[0]);
      b01 = b23 = __half2half2(*reinterpret_cast<const __half*>(reinterpret_cast<const char*>(sb) + (S::O2 - S::O1)));
    }
    const __half2 k1024 = bits_h2(0x64006400u);
    uint32_t c01, c23;  // (1024 + c, 1024 + c'), exact
    if constexpr (TIER == AFF8) {
      const uint32_t w = *reinterpret_cast<const uint32_t*>(row + d0);
      c01 = __byte_perm(w, 0x64646464u, 0x4140);
      c23 = __byte_perm(w, 0x64646464u, 0x4342);
    } else if constexpr (TIER == AFF6) {  // 24 bits of the LSB-first stream (MLX's 6-bit packing)
      const uint32_t w = row_bits(row, 6 * d0, 24);
      c01 = (w & 0x3Fu) | ((w << 10) & 0x3F0000u) | 0x64006400u;
      c23 = ((w >> 12) & 0x3Fu) | ((w >> 2) & 0x3F0000u) | 0x64006400u;
    } else {
      const uint32_t w = *reinterpret_cast<const uint16_t*>(row + d0 / 2);
      c01 = (w & 0xFu) | ((w & 0xF0u) << 12) | 0x64006400u;
      c23 = ((w >> 8) & 0xFu) | ((w & 0xF000u) << 4) | 0x64006400u;
    }
    x01 = h2_bits(__hfma2(__hsub2(bits_h2(c01), k1024), s01, b01));
    x23 = h2_bits(__hfma2(__hsub2(bits_h2(c23), k1024), s23, b23));
  } else if constexpr (TIER == MXFP8) {
    const uint32_t w = *reinterpret_cast<const uint32_t*>(row + d0);
    const uint32_t e = reinterpret_cast<const uint8_t*>(tile + S::O1)[r * (D / 32) + d0 / 32];
    const __half2 s = h2_splat(__uint_as_float(min(e + 8u, 254u) << 23));  // 2^(e - 127) * 2^8
    const uint32_t t01 = __byte_perm(w, 0u, 0x1404), t23 = __byte_perm(w, 0u, 0x3424);  // bytes to the high halves
    const uint32_t h01 = ((t01 >> 1) & 0x3F803F80u) | (t01 & 0x80008000u);  // E4M3 value * 2^-8 as fp16
    const uint32_t h23 = ((t23 >> 1) & 0x3F803F80u) | (t23 & 0x80008000u);
    x01 = h2_bits(__hmul2(bits_h2(h01), s));
    x23 = h2_bits(__hmul2(bits_h2(h23), s));
  } else if constexpr (TIER == TURBO) {
    uint32_t bits, sel, neg;
    if constexpr (BITS == 3) {
      bits = row_bits(row, 3 * d0, 12);
    } else if constexpr (BITS == 4) {
      bits = *reinterpret_cast<const uint16_t*>(row + d0 / 2);
    } else {
      bits = *reinterpret_cast<const uint8_t*>(row + d0 / 4);
    }
    if constexpr (LREG) {
      turbo_nibbles<BITS>(bits, sel, neg);
      nib_lookup4(sel, neg, tab, x01, x23);
    } else {
      smem_lookup4<S>(bits, lut, x01, x23);
    }
  } else {  // mxfp4, nvfp4: E2M1 nibbles, bit 3 the sign
    const uint32_t w = *reinterpret_cast<const uint16_t*>(row + d0 / 2);
    if constexpr (LREG) {
      nib_lookup4(w & 0x7777u, w & 0x8888u, tab, x01, x23);
    } else {
      smem_lookup4<S>(w, lut, x01, x23);
    }
    __half2 s;
    if constexpr (TIER == MXFP4) {
      const uint32_t e = reinterpret_cast<const uint8_t*>(tile + S::O1)[r * (D / 32) + d0 / 32];
      s = h2_splat(__uint_as_float(max(e, 1u) << 23));
    } else {  // E4M3 moved into fp16's fields: exactly scale * 2^-8 (the 2^8 is in the global factor)
      const uint32_t e = reinterpret_cast<const uint8_t*>(tile + S::O1)[r * (D / 16) + d0 / 16];
      const uint32_t h = ((e << 7) & 0x3F80u) | ((e & 0x80u) << 8);
      s = bits_h2(h | (h << 16));
    }
    x01 = h2_bits(__hmul2(bits_h2(x01), s));
    x23 = h2_bits(__hmul2(bits_h2(x23), s));
  }
}

// Per-token factor of a score (TurboQuant K: the token's norm; nvfp4 K: the global factor cb[0]) or of a
// probability (TurboQuant V: the norm), 1 otherwise.
template <int TIER, int BITS, int D>
__device__ __forceinline__ float tc_token_factor(const char* tile, int r, const float* cb) {
  if constexpr (TIER == TURBO) {
    return __half2float(reinterpret_cast<const __half*>(tile + TcSide<TIER, BITS, D>::O1)[r]);
  } else {
    return 1.f;
  }
}

template <int TK, int BK, int TV, int BV, int D, int WARPS, int STAGES, bool LREG>
__host__ __device__ constexpr int tc_smem_bytes() {
  using SK = TcSide<TK, BK, D>;
  using SV = TcSide<TV, BV, D>;
  constexpr int stages = WARPS * STAGES * (SK::BYTES + SV::BYTES), outs = WARPS * 8 * D * 4;
  return (LREG ? 0 : SK::LUT_BYTES + SV::LUT_BYTES) + (stages > outs ? stages : outs);
}

// RK: K was stored rotated by a +rot tier (R = H diag(s) / sqrt(D), the signs in sgk): q is rotated as for
// TurboQuant K, so (R q).(R k) = q.k; the tile decode is the base tier's.
template <typename T, int TK, int BK, int TV, int BV, int D, int NKV, int P, int WARPS, int STAGES, bool RK,
          bool LREG>
__device__ void flash_pass1_tc(const T* q, float scale, const float* sgk, const void* k0, const void* k1,
                               const void* k2, const void* v0, const void* v1, const void* v2, const float* cbk,
                               const float* cbv, const int32_t* prm, float* O, float* M, float* L) {
  using SK = TcSide<TK, BK, D>;
  using SV = TcSide<TV, BV, D>;
  constexpr int DL = D / 8, NB = D / 16;  // head_dim elements per lane in the output; M blocks
  constexpr int STAGE = SK::BYTES + SV::BYTES;
  constexpr float LOG2E = 1.4426950408889634f, LN2 = 0.6931471805599453f;
  const int n_tokens = prm[0], R = prm[1], per_split = prm[2];
  const int h = blockIdx.y, rb = blockIdx.z, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane >> 2, tig = lane & 3;

  extern __shared__ __align__(16) unsigned char dsm[];
  {
    uint32_t have;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(have));
    if (have < (uint32_t)tc_smem_bytes<TK, BK, TV, BV, D, WARPS, STAGES, LREG>()) __trap();
  }
  constexpr int LK = LREG ? 0 : SK::LUT_BYTES, LV = LREG ? 0 : SV::LUT_BYTES;
  uint32_t* lut_k = reinterpret_cast<uint32_t*>(dsm);
  uint32_t* lut_v = reinterpret_cast<uint32_t*>(dsm + LK);
  unsigned char* stages = dsm + LK + LV;
  __shared__ float sq[8][D], sqs[8];
  __shared__ __align__(16) __half sp[WARPS][8][16];
  __shared__ float sm_m[WARPS][8], sm_l[WARPS][8];

  const int t0 = prm[6] + blockIdx.x * per_split, first = prm[7];  // prm[6]: `first` rounded down to 16
  const int t1 = min(t0 + per_split, n_tokens);
  const int n_tiles = (t1 - t0 + 15) / 16;
  const char* const kc[3] = {static_cast<const char*>(k0), static_cast<const char*>(k1), static_cast<const char*>(k2)};
  const char* const vc[3] = {static_cast<const char*>(v0), static_cast<const char*>(v1), static_cast<const char*>(v2)};
  const uint32_t stage0 = (uint32_t)__cvta_generic_to_shared(stages + warp * STAGES * STAGE);

  auto load_tile = [&](int tile, int buf) {
    const unsigned tb = t0 + 16 * tile, lim = t1 - tb;
    const size_t tok = ((size_t)(tb / P) * NKV + h) * P + tb % P;
    const uint32_t st = stage0 + buf * STAGE;
    tc_copy_side<SK>(st, kc, tok, tb, lim, lane);
    tc_copy_side<SV>(st + SK::BYTES, vc, tok, tb, lim, lane);
  };

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (warp + s * WARPS < n_tiles) load_tile(warp + s * WARPS, s);
    cp_async_commit();
  }

  if constexpr (!LREG) {
    tc_fill_lut<TK, BK, D>(lut_k, cbk);
    tc_fill_lut<TV, BV, D>(lut_v, cbv);
  }
  // the block's query rows rb * 8 + c (zero past R); TurboQuant K: rotated once, q~ = H diag(s) q / sqrt(D)
  for (int idx = threadIdx.x; idx < 8 * D; idx += blockDim.x) {
    const int c = idx / D, d = idx % D, row = rb * 8 + c;
    float v = row < R ? (float)q[((size_t)h * R + row) * D + d] : 0.f;
    if constexpr (TK == TURBO || RK) v *= sgk[h * D + d];
    sq[c][d] = v;
  }
  __syncthreads();
  if constexpr (TK == TURBO || RK) {
    fwht_rows<8, D>(&sq[0][0]);
    for (int idx = threadIdx.x; idx < 8 * D; idx += blockDim.x) sq[idx / D][idx % D] *= rsqrtf((float)D);
    __syncthreads();
  }
  for (int c = warp; c < 8; c += WARPS) {  // per row, a power of two that puts its largest element near 2^15
    float mx = 0.f;
    for (int d = lane; d < D; d += 32) mx = fmaxf(mx, fabsf(sq[c][d]));
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    if (lane == 0) sqs[c] = mx > 0.f ? exp2f(floorf(log2f(32768.f / mx))) : 1.f;
  }
  __syncthreads();
  uint32_t qb[NB][2];  // B of the scores: column g = row g, K slots (2 tig, 2 tig + 1) = elements 16 j + 4 tig + 0, 1
#pragma unroll
  for (int j = 0; j < NB; ++j) {
    const int d = 16 * j + 4 * tig;
    const float s = sqs[g];
    qb[j][0] = h2_bits(__floats2half2_rn(sq[g][d] * s, sq[g][d + 1] * s));
    qb[j][1] = h2_bits(__floats2half2_rn(sq[g][d + 2] * s, sq[g][d + 3] * s));
  }
  float qinv[2];  // score factor of this lane's columns 2 tig, 2 tig + 1
#pragma unroll
  for (int j = 0; j < 2; ++j) qinv[j] = scale * LOG2E / sqs[2 * tig + j];
  float kg = 1.f, vg = 1.f;  // nvfp4 global factors
  if constexpr (TK == NVFP4) kg = cbk[0];
  if constexpr (TV == NVFP4) vg = cbv[0];
  const uint4 tk = tc_table<TK, BK>(cbk), tv = tc_table<TV, BV>(cbv);  // (LREG)
  const uint32_t* lk = lut_k + lane % SK::COPIES;  // (!LREG)
  const uint32_t* lv = lut_v + lane % SV::COPIES;

  float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
  float o[NB][4];
#pragma unroll
  for (int b = 0; b < NB; ++b)
#pragma unroll
    for (int c = 0; c < 4; ++c) o[b][c] = 0.f;
  const int kt[4] = {2 * tig, 2 * tig + 1, 2 * tig + 8, 2 * tig + 9};

  int rd = 0, wr = STAGES - 1;
  for (int tile = warp; tile < n_tiles; tile += WARPS) {
    const int nxt = tile + (STAGES - 1) * WARPS;
    if (nxt < n_tiles) load_tile(nxt, wr);
    cp_async_commit();
    cp_async_wait<STAGES - 1>();
    __syncwarp();
    const char* ktile = reinterpret_cast<const char*>(stages + (warp * STAGES + rd) * STAGE);
    const char* vtile = ktile + SK::BYTES;
    rd = rd + 1 == STAGES ? 0 : rd + 1;
    wr = wr + 1 == STAGES ? 0 : wr + 1;
    const int tb = t0 + 16 * tile;

    float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int j = 0; j < NB; ++j) {
      uint32_t a[4];
      tile_deq4<TK, BK, D, LREG>(ktile, g, 16 * j + 4 * tig, tk, lk, a[0], a[2]);
      tile_deq4<TK, BK, D, LREG>(ktile, g + 8, 16 * j + 4 * tig, tk, lk, a[1], a[3]);
      mma16816(acc, a, qb[j][0], qb[j][1]);
    }
    float x[2][2];  // [token g, g + 8][column 2 tig + j], base-2 units
    float mt[2] = {NEG_INF, NEG_INF};
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = g + 8 * i;
      const float f = tc_token_factor<TK, BK, D>(ktile, r, cbk) * kg;
      const bool valid = tb + r < t1 && tb + r >= first;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        x[i][j] = valid ? acc[2 * i + j] * f * qinv[j] : NEG_INF;
        mt[j] = fmaxf(mt[j], x[i][j]);
      }
    }
    float alpha[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int off = 4; off < 32; off <<= 1) mt[j] = fmaxf(mt[j], __shfl_xor_sync(0xffffffffu, mt[j], off));
      const float mn = fmaxf(m[j], mt[j]);  // finite: every tile holds a stored token (the first one holds `first`)
      alpha[j] = exp2_ftz(m[j] - mn);
      m[j] = mn;
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = g + 8 * i;
      const float fv = tc_token_factor<TV, BV, D>(vtile, r, cbv);
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const float p = exp2_ftz(x[i][j] - m[j]);
        l[j] = i == 0 ? fmaf(l[j], alpha[j], p) : l[j] + p;
        sp[warp][2 * tig + j][r] = __float2half_rn(p * fv);
      }
    }
    __syncwarp();
    if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
      for (int b = 0; b < NB; ++b) {
        o[b][0] *= alpha[0];
        o[b][1] *= alpha[1];
        o[b][2] *= alpha[0];
        o[b][3] *= alpha[1];
      }
    }
    const uint32_t b0 = *reinterpret_cast<const uint32_t*>(&sp[warp][g][2 * tig]);
    const uint32_t b1 = *reinterpret_cast<const uint32_t*>(&sp[warp][g][2 * tig + 8]);
    uint32_t vh[4][NB];  // token kt[k], elements g DL + 2 b, + 1
#pragma unroll
    for (int k = 0; k < 4; ++k)
#pragma unroll
      for (int i = 0; i < DL / 4; ++i)
        tile_deq4<TV, BV, D, LREG>(vtile, kt[k], g * DL + 4 * i, tv, lv, vh[k][2 * i], vh[k][2 * i + 1]);
#pragma unroll
    for (int b = 0; b < NB; ++b) {
      const uint32_t a[4] = {__byte_perm(vh[0][b], vh[1][b], 0x5410), __byte_perm(vh[0][b], vh[1][b], 0x7632),
                             __byte_perm(vh[2][b], vh[3][b], 0x5410), __byte_perm(vh[2][b], vh[3][b], 0x7632)};
      mma16816(o[b], a, b0, b1);
    }
    __syncwarp();
  }
  cp_async_wait<0>();

#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) l[j] += __shfl_xor_sync(0xffffffffu, l[j], off);
  __syncthreads();  // the stage buffers are free: the warps' outputs go there
  float* sm_o = reinterpret_cast<float*>(stages);  // [WARPS][8][D]
#pragma unroll
  for (int b = 0; b < NB; ++b)
#pragma unroll
    for (int c = 0; c < 4; ++c) sm_o[(warp * 8 + 2 * tig + (c & 1)) * D + g * DL + 2 * b + (c >> 1)] = o[b][c] * vg;
  if (g == 0) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      sm_m[warp][2 * tig + j] = m[j] * LN2;
      sm_l[warp][2 * tig + j] = l[j];
    }
  }
  __syncthreads();
  write_split<WARPS, 8, D, NKV>(sm_o, &sm_m[0][0], &sm_l[0][0], rb * 8, R, blockIdx.x, h, O, M, L);
}
}  // namespace cart

namespace cart {
// ---- Stored pages decoded to the queries' dtype for a question's prefill (`kernels/cuda_decode.py`) ----
// A warp decodes one 16-token tile of one KV head: the tile reaches shared memory as flash_pass1_tc copies it
// (`tc_copy_side`), each lane decodes 4 consecutive head_dim elements at a time (`tile_deq4`, codes looked up in
// registers), times the token's factor (TurboQuant: its norm) and nvfp4's global factor, and writes them to
// out (NKV, n_out, D) in the basis the pages were stored in. prm: [stored tokens, n_out]. Tokens n_tokens ..
// n_out - 1 are left for the caller (the question's K/V).
__device__ __forceinline__ void store4(__half* o, float a, float b, float c, float d) {
  *reinterpret_cast<uint2*>(o) = uint2{h2_bits(__floats2half2_rn(a, b)), h2_bits(__floats2half2_rn(c, d))};
}
__device__ __forceinline__ void store4(__nv_bfloat16* o, float a, float b, float c, float d) {
  const __nv_bfloat162 x = __floats2bfloat162_rn(a, b), y = __floats2bfloat162_rn(c, d);
  *reinterpret_cast<uint2*>(o) = uint2{*reinterpret_cast<const uint32_t*>(&x), *reinterpret_cast<const uint32_t*>(&y)};
}
__device__ __forceinline__ void store4(float* o, float a, float b, float c, float d) {
  *reinterpret_cast<float4*>(o) = make_float4(a, b, c, d);
}

template <typename T, int TIER, int BITS, int D, int NKV, int P, int WARPS>
__device__ void decode_tiles(const void* c0, const void* c1, const void* c2, const float* cb, const int32_t* prm,
                             T* out) {
  using S = TcSide<TIER, BITS, D>;
  static_assert(!S::DENSE, "dense pages need no decode");
  __shared__ __align__(16) unsigned char st[WARPS][S::BYTES];
  const int n_tokens = prm[0], n_out = prm[1];
  const int h = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int tb = 16 * (blockIdx.x * WARPS + warp);
  if (tb >= n_tokens) return;  // (no block-wide barrier follows)
  const char* const c[3] = {static_cast<const char*>(c0), static_cast<const char*>(c1), static_cast<const char*>(c2)};
  const size_t tok = ((size_t)(tb / P) * NKV + h) * P + tb % P;
  tc_copy_side<S>((uint32_t)__cvta_generic_to_shared(&st[warp][0]), c, tok, tb, n_tokens - tb, lane);
  cp_async_commit();
  cp_async_wait<0>();
  __syncwarp();
  const char* tile = reinterpret_cast<const char*>(&st[warp][0]);
  const uint4 tab = tc_table<TIER, BITS>(cb);
  const float g = TIER == NVFP4 ? cb[0] : 1.f;
  for (int i = lane; i < 4 * D; i += 32) {  // 16 rows x D / 4 quads; rows ascend with i
    const int r = i / (D / 4), d0 = 4 * (i % (D / 4));
    if (tb + r >= n_tokens) break;
    uint32_t x01, x23;
    tile_deq4<TIER, BITS, D, true>(tile, r, d0, tab, nullptr, x01, x23);
    const float f = tc_token_factor<TIER, BITS, D>(tile, r, cb) * g;
    const float2 a = __half22float2(bits_h2(x01)), b = __half22float2(bits_h2(x23));
    store4(out + ((size_t)h * n_out + tb + r) * D + d0, a.x * f, a.y * f, b.x * f, b.y * f);
  }
}
}  // namespace cart

namespace cart {
// ---- A question's prefill on the stored pages (`kernels/cuda_prefill.py`, issue 34 item 3) ----
// FlashAttention-2 (Dao 2023, "FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning")
// over compressed tiles. A block holds BR = 16 WARPS query rows of one KV head (the GQA group's rows stacked:
// R = group x question tokens) and streams one split of the prefix in tiles of PF_TOK tokens: the block copies a
// tile as stored (four 16-token TcSide tiles per side, cp.async, two stages), decodes it once into fp16 K and V
// rows in shared memory (`tile_deq4`, the token factors folded in; fp16 pages are read in place: a TcSide tile of
// fp16 already is rows of D + 8 halves), and each warp computes its 16 rows' scores (mma.m16n8k16: rows as M,
// head_dim as K, tokens as N; K fragments by ldmatrix), an online softmax in registers, and O += P V (the score
// accumulators become P, the A operand; V fragments by ldmatrix.trans). Each warp writes its own rows' partials to
// O, M, L (splits, NKV, R[, D]) as flash_pass1_tc does (M in natural-log units), and `finish_row` merges the
// splits, the dense tail and protected tokens. Queries of a rotated K (+rot, TurboQuant) arrive rotated (the host
// rotates them); every query row sees every prefix token, so the only mask is the stored range first .. n - 1.
constexpr int PF_TOK = 64;  // tokens per tile

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

template <int TK, int BK, int TV, int BV, int D>
struct PfLayout {
  using SK = TcSide<TK, BK, D>;
  using SV = TcSide<TV, BV, D>;
  static constexpr bool KD = TK == FP16, VD = TV == FP16;  // read in place, not decoded
  static constexpr int ROW = (D + 8) * 2;  // bytes of a decoded row (conflict-free ldmatrix: 16 mod 128)
  static constexpr int STAGE = 4 * (SK::BYTES + SV::BYTES);
  static constexpr int DEC = PF_TOK * ROW;  // one decoded side
  static constexpr int BYTES = 2 * STAGE + (KD ? 0 : DEC) + (VD ? 0 : DEC);
  static_assert(!KD || SK::RS == ROW, "an fp16 TcSide row is a decoded row");
};

// One side's tile (stage `st`, four TcSide tiles) decoded into rows of D + 8 halves at `dec`, times each token's
// factor (TurboQuant: its norm) and `gf` (nvfp4's global factor).
template <int TIER, int BITS, int D>
__device__ __forceinline__ void pf_decode(const unsigned char* st, unsigned char* dec, const uint4& tab,
                                          const float* cb, float gf) {
  using S = TcSide<TIER, BITS, D>;
  constexpr int ROW = (D + 8) * 2;
  for (int i = threadIdx.x; i < PF_TOK * D / 4; i += blockDim.x) {
    const int r = i / (D / 4), d0 = 4 * (i % (D / 4));
    const char* tile = reinterpret_cast<const char*>(st) + (r / 16) * S::BYTES;
    uint32_t x01, x23;
    tile_deq4<TIER, BITS, D, true>(tile, r % 16, d0, tab, nullptr, x01, x23);
    if constexpr (TIER == TURBO || TIER == NVFP4) {
      const float f = tc_token_factor<TIER, BITS, D>(tile, r % 16, cb) * gf;
      const float2 a = __half22float2(bits_h2(x01)), b = __half22float2(bits_h2(x23));
      x01 = h2_bits(__floats2half2_rn(a.x * f, a.y * f));
      x23 = h2_bits(__floats2half2_rn(b.x * f, b.y * f));
    }
    *reinterpret_cast<uint2*>(dec + r * ROW + 2 * d0) = uint2{x01, x23};
  }
}

template <typename T, int TK, int BK, int TV, int BV, int D, int NKV, int P, int WARPS>
__device__ void prefill_tc(const T* q, float scale, const void* k0, const void* k1, const void* k2, const void* v0,
                           const void* v1, const void* v2, const float* cbk, const float* cbv, const int32_t* prm,
                           float* O, float* M, float* L) {
  using Lay = PfLayout<TK, BK, TV, BV, D>;
  using SK = typename Lay::SK;
  using SV = typename Lay::SV;
  constexpr int NK = D / 16, NO = D / 8, ROW = Lay::ROW;  // k-steps of the scores; n-blocks of the output
  constexpr float LOG2E = 1.4426950408889634f, LN2 = 0.6931471805599453f;
  const int n_tokens = prm[0], R = prm[1], per_split = prm[2], first = prm[7];
  const int h = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, tig = lane & 3;
  const int row0 = blockIdx.z * 16 * WARPS + warp * 16;  // this warp's rows row0 + g, row0 + g + 8

  extern __shared__ __align__(16) unsigned char dsm[];
  {
    uint32_t have;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(have));
    if (have < (uint32_t)Lay::BYTES) __trap();
  }
  unsigned char* kdec = dsm + 2 * Lay::STAGE;
  unsigned char* vdec = kdec + (Lay::KD ? 0 : Lay::DEC);
  const int t0 = prm[6] + blockIdx.x * per_split, t1 = min(t0 + per_split, n_tokens);
  const int n_tiles = (t1 - t0 + PF_TOK - 1) / PF_TOK;
  const char* const kc[3] = {static_cast<const char*>(k0), static_cast<const char*>(k1), static_cast<const char*>(k2)};
  const char* const vc[3] = {static_cast<const char*>(v0), static_cast<const char*>(v1), static_cast<const char*>(v2)};

  auto load_tile = [&](int tile, int buf) {  // 8 TcSide tiles (K 0-3, V 0-3), one warp each
    const uint32_t st = (uint32_t)__cvta_generic_to_shared(dsm + buf * Lay::STAGE);
    for (int s = warp; s < 8; s += WARPS) {
      const int tb = t0 + PF_TOK * tile + 16 * (s % 4);
      const bool in = tb < t1;  // past the split: zeros (a token at a valid address, none of its bytes copied)
      const size_t tok = in ? ((size_t)(tb / P) * NKV + h) * P + tb % P : (size_t)h * P;
      const unsigned lim = in ? t1 - tb : 0u;
      if (s < 4) tc_copy_side<SK>(st + (s % 4) * SK::BYTES, kc, tok, in ? tb : 0, lim, lane);
      else tc_copy_side<SV>(st + 4 * SK::BYTES + (s % 4) * SV::BYTES, vc, tok, in ? tb : 0, lim, lane);
    }
  };
  if (n_tiles > 0) load_tile(0, 0);
  cp_async_commit();

  // A of the scores: rows g, g + 8 of this warp, head_dim 16 j + 2 tig (+1) and + 8, each row times a power of two
  // that puts its largest element near 2^15 (exact for fp16 and bf16 queries)
  uint32_t qa[NK][4];
  float qinv[2];
  {
    float qf[2][NK][4];
    float mx[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int row = row0 + g + 8 * i;
      const T* qr = q + ((size_t)h * R + (row < R ? row : 0)) * D;
#pragma unroll
      for (int j = 0; j < NK; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const float v = row < R ? (float)qr[16 * j + 2 * tig + (c & 1) + 8 * (c >> 1)] : 0.f;
          qf[i][j][c] = v;
          mx[i] = fmaxf(mx[i], fabsf(v));
        }
#pragma unroll
      for (int off = 1; off < 4; off <<= 1) mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], off));
    }
    float s[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      s[i] = mx[i] > 0.f ? exp2f(floorf(log2f(32768.f / mx[i]))) : 1.f;
      qinv[i] = scale * LOG2E / s[i];
    }
#pragma unroll
    for (int j = 0; j < NK; ++j) {
      qa[j][0] = h2_bits(__floats2half2_rn(qf[0][j][0] * s[0], qf[0][j][1] * s[0]));
      qa[j][1] = h2_bits(__floats2half2_rn(qf[1][j][0] * s[1], qf[1][j][1] * s[1]));
      qa[j][2] = h2_bits(__floats2half2_rn(qf[0][j][2] * s[0], qf[0][j][3] * s[0]));
      qa[j][3] = h2_bits(__floats2half2_rn(qf[1][j][2] * s[1], qf[1][j][3] * s[1]));
    }
  }
  const float kg = TK == NVFP4 ? cbk[0] : 1.f, vg = TV == NVFP4 ? cbv[0] : 1.f;
  const uint4 tabk = tc_table<TK, BK>(cbk), tabv = tc_table<TV, BV>(cbv);

  float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
  float o[NO][4] = {};  // this warp's rows' output, unnormalized
  // ldmatrix rows of this lane: K (non-transposed) token l % 8 of an n-block, head_dim 8 (l / 8) of 32; V
  // (transposed) token l % 8 + 8 ((l / 8) % 2) of a 16-token k-step, head_dim 8 (l / 16) of 16
  const int k_off = (lane % 8) * ROW + 16 * (lane / 8);
  const int v_off = (lane % 8 + 8 * ((lane / 8) % 2)) * ROW + 16 * (lane / 16);

  for (int tile = 0; tile < n_tiles; ++tile) {
    const int buf = tile & 1;
    cp_async_wait<0>();
    __syncthreads();  // this tile is in shared memory for every warp; every warp is done with the last one
    if (tile + 1 < n_tiles) load_tile(tile + 1, buf ^ 1);
    cp_async_commit();
    const unsigned char* st = dsm + buf * Lay::STAGE;
    if constexpr (!Lay::KD) pf_decode<TK, BK, D>(st, kdec, tabk, cbk, kg);
    if constexpr (!Lay::VD) pf_decode<TV, BV, D>(st + 4 * SK::BYTES, vdec, tabv, cbv, vg);
    if constexpr (!Lay::KD || !Lay::VD) __syncthreads();
    const uint32_t kb = (uint32_t)__cvta_generic_to_shared(Lay::KD ? st : kdec) + k_off;
    const uint32_t vb = (uint32_t)__cvta_generic_to_shared(Lay::VD ? st + 4 * SK::BYTES : vdec) + v_off;
    const int tb = t0 + PF_TOK * tile;

    float s[PF_TOK / 8][4];
#pragma unroll
    for (int nb = 0; nb < PF_TOK / 8; ++nb) {
#pragma unroll
      for (int c = 0; c < 4; ++c) s[nb][c] = 0.f;
#pragma unroll
      for (int jj = 0; jj < NK / 2; ++jj) {
        uint32_t b[4];
        ldsm_x4(b, kb + nb * 8 * ROW + jj * 64);
        mma16816(s[nb], qa[2 * jj], b[0], b[1]);
        mma16816(s[nb], qa[2 * jj + 1], b[2], b[3]);
      }
    }
    float mt[2] = {NEG_INF, NEG_INF};
#pragma unroll
    for (int nb = 0; nb < PF_TOK / 8; ++nb)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int t = tb + 8 * nb + 2 * tig + (c & 1);
        s[nb][c] = t < t1 && t >= first ? s[nb][c] * qinv[c >> 1] : NEG_INF;
        mt[c >> 1] = fmaxf(mt[c >> 1], s[nb][c]);
      }
    float base[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
      for (int off = 1; off < 4; off <<= 1) mt[i] = fmaxf(mt[i], __shfl_xor_sync(0xffffffffu, mt[i], off));
      const float mn = fmaxf(m[i], mt[i]);
      base[i] = mn == NEG_INF ? 0.f : mn;  // a row with no token yet: every p is 0
      const float alpha = exp2_ftz(m[i] - base[i]);
      m[i] = mn;
      l[i] *= alpha;
#pragma unroll
      for (int b = 0; b < NO; ++b) {
        o[b][2 * i] *= alpha;
        o[b][2 * i + 1] *= alpha;
      }
    }
#pragma unroll
    for (int kk = 0; kk < PF_TOK / 16; ++kk) {
      float p[2][4];
#pragma unroll
      for (int u = 0; u < 2; ++u)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          p[u][c] = exp2_ftz(s[2 * kk + u][c] - base[c >> 1]);
          l[c >> 1] += p[u][c];
        }
      const uint32_t a[4] = {h2_bits(__floats2half2_rn(p[0][0], p[0][1])), h2_bits(__floats2half2_rn(p[0][2], p[0][3])),
                             h2_bits(__floats2half2_rn(p[1][0], p[1][1])), h2_bits(__floats2half2_rn(p[1][2], p[1][3]))};
#pragma unroll
      for (int nd = 0; nd < NO / 2; ++nd) {
        uint32_t b[4];
        ldsm_x4_trans(b, vb + kk * 16 * ROW + nd * 32);
        mma16816(o[2 * nd], a, b[0], b[1]);
        mma16816(o[2 * nd + 1], a, b[2], b[3]);
      }
    }
  }
  cp_async_wait<0>();

#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) l[i] += __shfl_xor_sync(0xffffffffu, l[i], off);
    const int row = row0 + g + 8 * i;
    if (row >= R) continue;
    const size_t base_row = ((size_t)blockIdx.x * NKV + h) * R + row;
#pragma unroll
    for (int b = 0; b < NO; ++b)
      *reinterpret_cast<float2*>(O + base_row * D + 8 * b + 2 * tig) = make_float2(o[b][2 * i], o[b][2 * i + 1]);
    if (tig == 0) {
      M[base_row] = m[i] * LN2;
      L[base_row] = l[i];
    }
  }
}
}  // namespace cart
