// Device helpers shared by the package's CUDA kernels (Gated DeltaNet and
// MoE): element types and conversions, 16-byte loads and stores, 4-bit
// dequantisation of a nibble pair, warp sums, activations (the inline PTX
// they use, and the cp.async copies: ptx.cuh).
//
// Self-contained on purpose: it needs no CUDA header, so NVRTC compiles the
// kernels with no include path (the mlx-cuda wheel ships no CUDA headers) and
// nvcc compiles the same text for the register/spill report.
//
// Element types: activations may be bf16_t, f16_t or float (chosen per build by
// a -D macro); every kernel computes in fp32 and rounds once on store.
#pragma once
#include "ptx.cuh"

typedef unsigned short gdn_u16;

struct bf16_t {
  gdn_u16 x;
};
struct f16_t {
  gdn_u16 x;
};

// ---- scalar conversions -----------------------------------------------------

__device__ __forceinline__ float to_f(float v) {
  return v;
}
__device__ __forceinline__ float to_f(bf16_t v) {
  return __uint_as_float(((unsigned)v.x) << 16);
}
__device__ __forceinline__ float to_f(f16_t v) {
  return cvt_f32_f16(v.x);
}

template <typename T>
struct Cvt;
template <>
struct Cvt<float> {
  static __device__ __forceinline__ float from(float v) {
    return v;
  }
};
template <>
struct Cvt<bf16_t> {
  static __device__ __forceinline__ bf16_t from(float v) {
    bf16_t r;
    r.x = cvt_rn_bf16_f32(v);
    return r;
  }
};
template <>
struct Cvt<f16_t> {
  static __device__ __forceinline__ f16_t from(float v) {
    f16_t r;
    r.x = cvt_rn_f16_f32(v);
    return r;
  }
};

// Round to T and convert back: the value a T-typed intermediate would hold.
template <typename T>
__device__ __forceinline__ float from_f_round(float v) {
  return to_f(Cvt<T>::from(v));
}

template <typename T>
__device__ __forceinline__ T from_f(float v) {
  return Cvt<T>::from(v);
}

// SameType<A, B>::value: whether A and B are one type (no <type_traits> under NVRTC).
template <typename A, typename B>
struct SameType {
  static constexpr bool value = false;
};
template <typename A>
struct SameType<A, A> {
  static constexpr bool value = true;
};

// ---- 16-byte vector loads/stores: 8 elements of a 2-byte type, 4 floats -----

template <typename T>
struct Vec16 {
  static constexpr int N = 16 / sizeof(T);
};

// MLX affine 4-bit dequantisation of one nibble pair into bf16x2: the nibbles
// at bits 0-3 and 16-19 of `w` -> (bf16(s * q + b)) for both halves, s2 / b2 =
// (s, s) / (b, b). The nibbles OR-ed into the mantissa of bf16 128.0 give
// 128 + q exactly (one lop3: ptxas emits two for the C form), minus 128
// (exact), one fma.rn.bf16x2 (one rounding, as MLX's dequantize).
__device__ __forceinline__ unsigned dequant_nibble_pair(unsigned w, unsigned s2, unsigned b2) {
  const unsigned magic = 0x43004300u;  // bf16x2 (128, 128)
  const unsigned m = lop3_and_or(w, 0x000F000Fu, magic);
  const unsigned q = sub_rn_bf16x2(m, magic);
  return fma_rn_bf16x2(q, s2, b2);
}

__device__ __forceinline__ void unpack_bf16x2(unsigned w, float& lo, float& hi) {
  lo = __uint_as_float(w << 16);
  hi = __uint_as_float(w & 0xffff0000u);
}
__device__ __forceinline__ void unpack_f16x2(unsigned w, float& lo, float& hi) {
  gdn_u16 a = (gdn_u16)(w & 0xffffu), b = (gdn_u16)(w >> 16);
  lo = cvt_f32_f16(a);
  hi = cvt_f32_f16(b);
}

__device__ __forceinline__ void load16(const float* p, float* o) {
  float4 u = *reinterpret_cast<const float4*>(p);
  o[0] = u.x;
  o[1] = u.y;
  o[2] = u.z;
  o[3] = u.w;
}
__device__ __forceinline__ void load16(const bf16_t* p, float* o) {
  uint4 u = *reinterpret_cast<const uint4*>(p);
  unpack_bf16x2(u.x, o[0], o[1]);
  unpack_bf16x2(u.y, o[2], o[3]);
  unpack_bf16x2(u.z, o[4], o[5]);
  unpack_bf16x2(u.w, o[6], o[7]);
}
__device__ __forceinline__ void load16(const f16_t* p, float* o) {
  uint4 u = *reinterpret_cast<const uint4*>(p);
  unpack_f16x2(u.x, o[0], o[1]);
  unpack_f16x2(u.y, o[2], o[3]);
  unpack_f16x2(u.z, o[4], o[5]);
  unpack_f16x2(u.w, o[6], o[7]);
}

// Four consecutive elements of T kept as loaded (one 8-byte load for a
// 2-byte type, 16 bytes for float) and unpacked to fp32 when used; a row
// held this way takes half the registers of 4 floats for a 2-byte type.
template <typename T>
struct Raw4 {
  uint2 u;
  __device__ __forceinline__ void load(const T* p) {
    u = *reinterpret_cast<const uint2*>(p);
  }
  __device__ __forceinline__ void get(float* o) const;
};
template <>
__device__ __forceinline__ void Raw4<bf16_t>::get(float* o) const {
  unpack_bf16x2(u.x, o[0], o[1]);
  unpack_bf16x2(u.y, o[2], o[3]);
}
template <>
__device__ __forceinline__ void Raw4<f16_t>::get(float* o) const {
  unpack_f16x2(u.x, o[0], o[1]);
  unpack_f16x2(u.y, o[2], o[3]);
}
template <>
struct Raw4<float> {
  float4 u;
  __device__ __forceinline__ void load(const float* p) {
    u = *reinterpret_cast<const float4*>(p);
  }
  __device__ __forceinline__ void get(float* o) const {
    o[0] = u.x;
    o[1] = u.y;
    o[2] = u.z;
    o[3] = u.w;
  }
};

// Four consecutive elements of any type, as floats (16 B for float, 8 B else).
template <typename T>
__device__ __forceinline__ void load4(const T* p, float* o) {
  Raw4<T> r;
  r.load(p);
  r.get(o);
}

__device__ __forceinline__ unsigned pack2(bf16_t a, bf16_t b) {
  return (unsigned)a.x | ((unsigned)b.x << 16);
}
__device__ __forceinline__ unsigned pack2(f16_t a, f16_t b) {
  return (unsigned)a.x | ((unsigned)b.x << 16);
}

// Store four consecutive elements (rounded to T from fp32).
__device__ __forceinline__ void store4(float* p, const float* v) {
  *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
}
template <typename T>
__device__ __forceinline__ void store4(T* p, const float* v) {
  uint2 u;
  u.x = pack2(Cvt<T>::from(v[0]), Cvt<T>::from(v[1]));
  u.y = pack2(Cvt<T>::from(v[2]), Cvt<T>::from(v[3]));
  *reinterpret_cast<uint2*>(p) = u;
}

// ---- warp reductions ------------------------------------------------------

template <int WIDTH = 32>
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = WIDTH / 2; o > 0; o >>= 1) {
    v += __shfl_xor_sync(0xffffffffu, v, o);
  }
  return v;
}

// (asynchronous copies, cp_async*: ptx.cuh)

// ---- activation helpers -----------------------------------------------------

__device__ __forceinline__ float silu_f(float x) {
  return x / (1.0f + expf(-x));
}
// SiLU with the hardware exp2 and reciprocal (__expf, __fdividef: their
// error bounds in the CUDA programming guide), where silu_f's IEEE division
// is a longer sequence with a slow-path branch.
__device__ __forceinline__ float silu_fast(float x) {
  return __fdividef(x, 1.0f + __expf(-x));
}
__device__ __forceinline__ float sigmoid_f(float x) {
  return 1.0f / (1.0f + expf(-x));
}
// log(1 + exp(x)) computed as MLX's logaddexp(x, 0) does.
__device__ __forceinline__ float softplus_f(float x) {
  return fmaxf(x, 0.0f) + log1pf(expf(-fabsf(x)));
}

// ---- compile-time type choice ------------------------------------------------

template <bool C, typename A, typename B>
struct Pick {
  typedef A type;
};
template <typename A, typename B>
struct Pick<false, A, B> {
  typedef B type;
};
