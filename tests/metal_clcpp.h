// The MSL subset of metal_shim.h, declared for clang's C++ for OpenCL mode
// (-x clcpp; tests/metal_check.py's address_space_problems): there device,
// constant, threadgroup and thread are address spaces, so a pointer or
// reference of one given where another is expected is an error, as in
// Apple's compiler (metal_shim.h, which runs the source, erases them).
// Declarations only: the source is parsed, never built. No OpenCL header is
// read (-cl-no-stdinc): every scalar, vector and function name here is
// Metal's. Pointers without an address space are generic (either space):
// the declarations that take any memory (simdgroup_load, the atomics) use
// them.
#pragma once
#pragma OPENCL EXTENSION cl_khr_fp16 : enable
#define device __global
#define constant __constant
#define threadgroup __local
#define thread __private

typedef __SIZE_TYPE__ size_t;
typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;
typedef char int8_t;
typedef unsigned char uint8_t;
typedef short int16_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long int64_t;
typedef unsigned long uint64_t;

typedef __bf16 bfloat;
typedef bfloat bfloat16_t;
typedef half float16_t;

namespace metal {
template <typename T, int N>
using vec = T __attribute__((ext_vector_type(N)));
}  // namespace metal
using metal::vec;
#define MQF_VECS(T) typedef vec<T, 2> T##2; typedef vec<T, 3> T##3; typedef vec<T, 4> T##4;
MQF_VECS(float)
MQF_VECS(half)
MQF_VECS(char)
MQF_VECS(uchar)
MQF_VECS(short)
MQF_VECS(ushort)
MQF_VECS(int)
MQF_VECS(uint)
MQF_VECS(long)
MQF_VECS(ulong)
#undef MQF_VECS
// Metal's vector constructors of one argument (a splat or a conversion between
// element types), as metal_check.clcpp_source rewrites them
template <typename V, typename U> V mqf_vcast(U);

enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
void threadgroup_barrier(mem_flags = mem_flags::mem_none);
void simdgroup_barrier(mem_flags = mem_flags::mem_none);

template <typename T> T simd_sum(T);
template <typename T> T simd_max(T);
template <typename T> T simd_min(T);
template <typename T> T simd_prefix_exclusive_sum(T);
template <typename T> T simd_prefix_inclusive_sum(T);
template <typename T> T simd_shuffle(T, ushort);
template <typename T> T simd_shuffle_xor(T, ushort);
template <typename T> T simd_shuffle_down(T, ushort);
template <typename T> T simd_shuffle_up(T, ushort);
template <typename T> T simd_broadcast(T, ushort);
bool simd_all(bool);
bool simd_any(bool);

template <typename T, int R, int C>
struct simdgroup_matrix {
  simdgroup_matrix() = default;
  explicit simdgroup_matrix(T);
  thread vec<T, 2>& thread_elements();
  thread const vec<T, 2>& thread_elements() const;
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;
template <typename T, int R, int C>
simdgroup_matrix<T, R, C> make_filled_simdgroup_matrix(T);
template <typename T, int R, int C, typename U, typename... Rest>
void simdgroup_load(simdgroup_matrix<T, R, C>&, const U*, Rest...);
template <typename T, int R, int C, typename U, typename... Rest>
void simdgroup_store(const simdgroup_matrix<T, R, C>&, U*, Rest...);
template <typename T, int R, int C, typename A, typename B>
void simdgroup_multiply(simdgroup_matrix<T, R, C>&, const simdgroup_matrix<A, R, C>&, const simdgroup_matrix<B, R, C>&);
template <typename T, int R, int C, typename A, typename B>
void simdgroup_multiply_accumulate(simdgroup_matrix<T, R, C>&, const simdgroup_matrix<A, R, C>&,
                                   const simdgroup_matrix<B, R, C>&, const simdgroup_matrix<T, R, C>&);

enum memory_order { memory_order_relaxed };
template <typename T> struct atomic { T v; };
template <typename T, typename U> T atomic_fetch_add_explicit(atomic<T>*, U, memory_order);
template <typename T, typename U> T atomic_fetch_max_explicit(atomic<T>*, U, memory_order);
template <typename T, typename U> void atomic_store_explicit(atomic<T>*, U, memory_order);
template <typename T> T atomic_load_explicit(atomic<T>*, memory_order);

namespace metal {
template <typename T> struct numeric_limits {
  static constexpr T infinity();
  static constexpr T max();
  static constexpr T min();
  static constexpr T lowest();
};
#define MQF_UNARY(name) template <typename T> T name(T);
MQF_UNARY(exp) MQF_UNARY(exp2) MQF_UNARY(log) MQF_UNARY(log2) MQF_UNARY(log1p) MQF_UNARY(sqrt) MQF_UNARY(rsqrt)
MQF_UNARY(tanh) MQF_UNARY(abs) MQF_UNARY(fabs) MQF_UNARY(floor) MQF_UNARY(ceil) MQF_UNARY(round) MQF_UNARY(sin)
MQF_UNARY(cos)
#undef MQF_UNARY
template <typename T, typename U> T pow(T, U);
template <typename T, typename U> T max(T, U);
template <typename T, typename U> T min(T, U);
template <typename T> T fmax(T, T);
template <typename T> T fmin(T, T);
template <typename T> T fma(T, T, T);
template <typename T, typename U, typename V> T clamp(T, U, V);
template <typename T> T select(T, T, bool);
template <typename T> bool isnan(T);
template <typename T> bool isinf(T);
template <typename T> bool isfinite(T);
template <typename T, typename U> T as_type(U);
namespace precise {
using metal::exp; using metal::log; using metal::sqrt; using metal::rsqrt; using metal::tanh;
using metal::exp2; using metal::log2; using metal::pow;
}  // namespace precise
namespace fast {
using metal::exp; using metal::log; using metal::sqrt; using metal::rsqrt; using metal::tanh;
using metal::exp2; using metal::log2; using metal::pow;
}  // namespace fast
}  // namespace metal
using namespace metal;
