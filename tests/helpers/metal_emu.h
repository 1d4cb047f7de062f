// A CPU emulator of the few Metal Shading Language features cartridge's kernels use, so that the generated
// sources can be RUN on Linux (tests/helpers/metal_emulator.py): one std::thread per GPU thread of a threadgroup,
// threadgroups one after another (so the body's `threadgroup` arrays, turned into statics, are shared by the
// threads of one threadgroup), simd_sum and threadgroup_barrier by std::barrier. half and bfloat are 16-bit
// storage types converted exactly (round to nearest even). Semantics, not speed, and not Apple's compiler.
#pragma once
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>  // before the address-space macros below (`thread` is one)
using emu_thread = std::thread;
#define kernel
#define device
#define constant
#define threadgroup
#define thread

typedef unsigned int uint;
typedef unsigned char uchar;

inline float emu_bits_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t emu_float_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

struct half {
  uint16_t bits;
  half() : bits(0) {}
  half(float f) {  // float -> fp16, round to nearest even
    const uint32_t x = emu_float_bits(f), sign = (x >> 16) & 0x8000u;
    const float a = std::fabs(f);
    if (std::isnan(f)) { bits = uint16_t(sign | 0x7E00u); return; }
    if (a >= 65520.0f) { bits = uint16_t(sign | 0x7C00u); return; }
    if (a < 6.103515625e-05f) { bits = uint16_t(sign | uint32_t(std::nearbyint(a * 16777216.0f))); return; }
    const uint32_t ax = emu_float_bits(a);
    uint32_t m = ax & 0x7FFFFFu, e = (ax >> 23) - 112u;
    uint32_t h = (e << 10) | (m >> 13);
    const uint32_t rest = m & 0x1FFFu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
    bits = uint16_t(sign | h);
  }
  operator float() const {
    const uint32_t s = uint32_t(bits & 0x8000u) << 16, e = (bits >> 10) & 0x1Fu, m = bits & 0x3FFu;
    if (e == 0) return (s ? -1.0f : 1.0f) * float(m) * 5.9604644775390625e-08f;
    if (e == 31) return emu_bits_float(s | 0x7F800000u | (m << 13));
    return emu_bits_float(s | ((e + 112u) << 23) | (m << 13));
  }
};
typedef half float16_t;
struct bfloat16_t {
  uint16_t bits;
  bfloat16_t() : bits(0) {}
  bfloat16_t(float f) {
    const uint32_t x = emu_float_bits(f);
    bits = uint16_t((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
  }
  operator float() const { return emu_bits_float(uint32_t(bits) << 16); }
};
struct uint3 {
  uint x, y, z;
};

// the simdgroup and threadgroup of the calling emulated thread (set by the launcher)
struct EmuGroup {
  std::barrier<>* tg_barrier;
  std::barrier<>* simd_barrier[32];
  float simd_buf[32][32];
};
inline thread_local EmuGroup* emu_group = nullptr;
inline thread_local uint emu_tid = 0;

namespace metal {
enum class mem_flags { mem_none, mem_device, mem_threadgroup };
inline void threadgroup_barrier(mem_flags) { emu_group->tg_barrier->arrive_and_wait(); }
inline float simd_sum(float x) {
  const uint sg = emu_tid / 32, lane = emu_tid % 32;
  emu_group->simd_buf[sg][lane] = x;
  emu_group->simd_barrier[sg]->arrive_and_wait();
  float s = 0.0f;
  for (int i = 0; i < 32; ++i) s += emu_group->simd_buf[sg][i];
  emu_group->simd_barrier[sg]->arrive_and_wait();
  return s;
}
template <typename To, typename From>
inline To as_type(From f) {
  static_assert(sizeof(To) == sizeof(From), "as_type: sizes differ");
  To t;
  std::memcpy(&t, &f, sizeof(To));
  return t;
}
inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
inline float max(float a, float b) { return std::fmax(a, b); }
inline int max(int a, int b) { return a > b ? a : b; }
inline float min(float a, float b) { return std::fmin(a, b); }
inline int min(int a, int b) { return a < b ? a : b; }
namespace fast {
inline float exp(float x) { return std::exp(x); }
inline float exp2(float x) { return std::exp2(x); }
}  // namespace fast
}  // namespace metal
using namespace metal;
