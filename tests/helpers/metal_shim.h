// A small stand-in for the Metal Shading Language, so that the kernel sources cartridge hands to
// mx.fast.metal_kernel can be compiled on Linux by the system C++ compiler (-fsyntax-only): it declares the MSL
// types and functions those sources use, and nothing else, so an undeclared name or a syntax error fails the
// compile (tests/attention/test_metal_source.py). It stands in for the text MLX prepends to every custom kernel
// (metal::utils(): <metal_stdlib>, MLX's bfloat16_t). Declarations only: nothing here is run.
#pragma once
#define kernel
#define device
#define constant
#define threadgroup
#define thread
#define INFINITY (__builtin_inff())

typedef unsigned int uint;
typedef unsigned char uchar;
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef int int32_t;
typedef long int64_t;
typedef unsigned long size_t;

struct half {
  half();
  half(float);
  operator float() const;
};
typedef half float16_t;  // MLX utils.h
struct bfloat16_t {
  bfloat16_t();
  bfloat16_t(float);
  operator float() const;
};
struct uint3 {
  uint x, y, z;
};

namespace metal {
enum class mem_flags { mem_none, mem_device, mem_threadgroup };
void threadgroup_barrier(mem_flags);
void simdgroup_barrier(mem_flags);
float simd_sum(float);
float simd_max(float);
float simd_shuffle_xor(float, unsigned short);

template <typename To, typename From>
To as_type(From);

float fma(float, float, float);
float rsqrt(float);
float max(float, float);
int max(int, int);
float min(float, float);
int min(int, int);
namespace fast {
float exp(float);
float exp2(float);
}  // namespace fast
}  // namespace metal
using namespace metal;  // as MLX's bf16.h does
