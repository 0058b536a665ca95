// A C++20 reading of the Metal Shading Language subset that MLX's generated
// kernel sources use, for running them on the CPU (tests/metal_check.py).
//
// Execution model: one cooperative fiber (ucontext) per GPU thread, one
// threadgroup at a time; threadgroup_barrier and the simd_* collectives
// suspend the calling fiber until every live thread of its group (barrier)
// or SIMD group of 32 lanes (collective) arrives. A barrier that some
// threads of the group exit without reaching, or lanes of one SIMD group
// waiting at different synchronisation points, abort the run with a
// message. Threadgroup arrays are shared by the group's fibers and filled
// with 0xFF bytes (NaN for floats) at the start of each threadgroup.
#pragma once
#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <ucontext.h>
#include <unistd.h>
#include <vector>
#include <fstream>
#include <limits>
#include <string>
#include <sys/mman.h>

namespace mqf {
[[noreturn]] inline void fail(const char* what);
}

// ---- types -----------------------------------------------------------------
typedef uint32_t uint;
typedef uint16_t ushort;
typedef uint8_t uchar;
typedef _Float16 half;

struct bfloat16_t {
  uint16_t bits;
  bfloat16_t() = default;
  static uint16_t round(float f) {  // round to nearest even; NaN stays NaN
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return uint16_t(u >> 16);
  }
  bfloat16_t(float f) : bits(round(f)) {}
  bfloat16_t(double f) : bits(round(float(f))) {}
  bfloat16_t(int f) : bits(round(float(f))) {}
  bfloat16_t(uint f) : bits(round(float(f))) {}
  bfloat16_t(half f) : bits(round(float(f))) {}
  operator float() const {
    uint32_t u = uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};
typedef bfloat16_t bfloat;
#define MQF_BF_OP(op)                                                                      \
  inline bfloat16_t operator op(bfloat16_t a, bfloat16_t b) { return float(a) op float(b); } \
  inline float operator op(bfloat16_t a, float b) { return float(a) op b; }                  \
  inline float operator op(float a, bfloat16_t b) { return a op float(b); }
MQF_BF_OP(+)
MQF_BF_OP(-)
MQF_BF_OP(*)
MQF_BF_OP(/)
#undef MQF_BF_OP
#define MQF_BF_ASSIGN(op)                                                   \
  inline bfloat16_t& operator op##=(bfloat16_t& a, float b) {              \
    a = bfloat16_t(float(a) op b);                                          \
    return a;                                                               \
  }
MQF_BF_ASSIGN(+)
MQF_BF_ASSIGN(-)
MQF_BF_ASSIGN(*)
MQF_BF_ASSIGN(/)
#undef MQF_BF_ASSIGN
inline bool operator<(bfloat16_t a, bfloat16_t b) { return float(a) < float(b); }
inline bool operator>(bfloat16_t a, bfloat16_t b) { return float(a) > float(b); }
inline bfloat16_t operator-(bfloat16_t a) { return -float(a); }

template <typename T, int N>
struct vec;
#define MQF_VEC_COMMON(N)                                                   \
  T& operator[](int i) { return v[i]; }                                     \
  const T& operator[](int i) const { return v[i]; }
template <typename T>
struct vec<T, 2> {
  union { struct { T x, y; }; T v[2]; };
  vec() = default;
  vec(T s) : x(s), y(s) {}
  vec(T a, T b) : x(a), y(b) {}
  MQF_VEC_COMMON(2)
};
template <typename T>
struct vec<T, 3> {
  union { struct { T x, y, z; }; T v[3]; };
  vec() = default;
  vec(T s) : x(s), y(s), z(s) {}
  vec(T a, T b, T c) : x(a), y(b), z(c) {}
  MQF_VEC_COMMON(3)
};
template <typename T>
struct vec<T, 4> {
  union { struct { T x, y, z, w; }; T v[4]; };
  vec() = default;
  vec(T s) : x(s), y(s), z(s), w(s) {}
  vec(T a, T b, T c, T d) : x(a), y(b), z(c), w(d) {}
  MQF_VEC_COMMON(4)
};
#undef MQF_VEC_COMMON
#define MQF_VEC_OP(op)                                                               \
  template <typename T, int N>                                                       \
  vec<T, N> operator op(vec<T, N> a, vec<T, N> b) {                                  \
    vec<T, N> r;                                                                     \
    for (int i = 0; i < N; i++) r.v[i] = a.v[i] op b.v[i];                           \
    return r;                                                                        \
  }                                                                                  \
  template <typename T, int N>                                                       \
  vec<T, N> operator op(vec<T, N> a, T b) { return a op vec<T, N>(b); }              \
  template <typename T, int N>                                                       \
  vec<T, N> operator op(T a, vec<T, N> b) { return vec<T, N>(a) op b; }              \
  template <typename T, int N>                                                       \
  vec<T, N>& operator op##=(vec<T, N>& a, vec<T, N> b) { return a = a op b; }
MQF_VEC_OP(+)
MQF_VEC_OP(-)
MQF_VEC_OP(*)
MQF_VEC_OP(/)
#undef MQF_VEC_OP
#define MQF_VEC_TYPES(T, name) \
  typedef vec<T, 2> name##2;   \
  typedef vec<T, 3> name##3;   \
  typedef vec<T, 4> name##4;
MQF_VEC_TYPES(float, float)
MQF_VEC_TYPES(half, half)
MQF_VEC_TYPES(int, int)
MQF_VEC_TYPES(uint, uint)
MQF_VEC_TYPES(short, short)
MQF_VEC_TYPES(ushort, ushort)
#undef MQF_VEC_TYPES

// ---- math (metal_stdlib names) -------------------------------------------
namespace metal {
template <typename T>
inline T mqf_f(T x) { return x; }
#define MQF_UNARY(name, expr)                                        \
  inline float name(float x) { return expr; }                        \
  inline half name(half x) { return half(name(float(x))); }          \
  inline bfloat16_t name(bfloat16_t x) { return name(float(x)); }
MQF_UNARY(exp, std::exp(x))
MQF_UNARY(exp2, std::exp2(x))
MQF_UNARY(log, std::log(x))
MQF_UNARY(log2, std::log2(x))
MQF_UNARY(sqrt, std::sqrt(x))
MQF_UNARY(rsqrt, 1.0f / std::sqrt(x))
MQF_UNARY(tanh, std::tanh(x))
MQF_UNARY(abs, std::fabs(x))
MQF_UNARY(fabs, std::fabs(x))
MQF_UNARY(floor, std::floor(x))
MQF_UNARY(ceil, std::ceil(x))
MQF_UNARY(sin, std::sin(x))
MQF_UNARY(cos, std::cos(x))
MQF_UNARY(log1p, std::log1p(x))
#undef MQF_UNARY
inline float pow(float a, float b) { return std::pow(a, b); }
inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
template <typename T> inline T max(T a, T b) { return a > b ? a : b; }
template <typename T> inline T min(T a, T b) { return a < b ? a : b; }
inline float max(float a, double b) { return a > float(b) ? a : float(b); }
inline float min(float a, double b) { return a < float(b) ? a : float(b); }
inline float fmax(float a, float b) { return std::fmax(a, b); }
inline float fmin(float a, float b) { return std::fmin(a, b); }
template <typename T> inline T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }
template <typename T> inline T select(T a, T b, bool c) { return c ? b : a; }
inline bool isnan(float x) { return std::isnan(x); }
inline bool isinf(float x) { return std::isinf(x); }
inline bool isfinite(float x) { return std::isfinite(x); }
namespace precise {
using metal::exp; using metal::log; using metal::sqrt; using metal::rsqrt; using metal::tanh;
using metal::exp2; using metal::log2; using metal::pow;
}
namespace fast {
using metal::exp; using metal::log; using metal::sqrt; using metal::rsqrt; using metal::tanh;
using metal::exp2; using metal::log2; using metal::pow;
}
template <typename T>
struct numeric_limits {
  static constexpr T infinity() { return std::numeric_limits<T>::infinity(); }
  static constexpr T max() { return std::numeric_limits<T>::max(); }
  static constexpr T lowest() { return std::numeric_limits<T>::lowest(); }
  static constexpr T min() { return std::numeric_limits<T>::min(); }
};
}  // namespace metal
using namespace metal;

// ---- the fiber scheduler ---------------------------------------------------
enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
inline mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(int(a) | int(b)); }

namespace mqf {
struct Attrs {
  vec<uint, 3> thread_position_in_grid, threads_per_grid, thread_position_in_threadgroup,
      threads_per_threadgroup, threadgroup_position_in_grid, threadgroups_per_grid;
  uint thread_index_in_threadgroup, thread_index_in_simdgroup, simdgroup_index_in_threadgroup,
      threads_per_simdgroup, simdgroups_per_threadgroup;
};
enum State { RUN, AT_BARRIER, AT_SIMD, DONE };
struct Fiber {
  ucontext_t ctx;
  State state = RUN;
  int simd_gen = 0;             // collectives this lane has entered
  unsigned char slot[2][64];    // its value for the collective of generation g (slot[g % 2])
  Attrs a;
};
inline std::vector<Fiber>* fibers;
inline Fiber* cur = nullptr;
inline ucontext_t sched_ctx;
inline long group_id = 0;  // increments per threadgroup: threadgroup arrays are poisoned once per group
inline char where[256];

[[noreturn]] inline void fail(const char* what) {
  if (cur)
    std::fprintf(stderr, "metal_check: %s (thread %u,%u,%u of the grid, threadgroup %u,%u,%u)\n", what,
                 cur->a.thread_position_in_grid.x, cur->a.thread_position_in_grid.y,
                 cur->a.thread_position_in_grid.z, cur->a.threadgroup_position_in_grid.x,
                 cur->a.threadgroup_position_in_grid.y, cur->a.threadgroup_position_in_grid.z);
  else
    std::fprintf(stderr, "metal_check: %s (%s)\n", what, where);
  std::fflush(stderr);
  std::_Exit(3);
}

inline void yield_as(State s) {
  cur->state = s;
  Fiber* me = cur;
  swapcontext(&me->ctx, &sched_ctx);
}

template <typename T>
struct tg_array_guard {
  long seen = -1;
};
inline void tg_poison(void* p, size_t n, long* seen) {
  if (*seen != group_id) {
    std::memset(p, 0xFF, n);
    *seen = group_id;
  }
}

// The collective: every lane stores its value, waits until all live lanes of
// its SIMD group stored theirs, then reads them all.
template <typename T>
struct Lanes {
  T v[32];
  bool live[32];
  int n = 0;
};
template <typename T>
inline Lanes<T> gather(T x) {
  static_assert(sizeof(T) <= 64, "simd collective of a value over 64 bytes");
  int g = cur->simd_gen++;
  std::memcpy(cur->slot[g % 2], &x, sizeof(T));
  yield_as(AT_SIMD);
  Lanes<T> out;
  uint base = cur->a.simdgroup_index_in_threadgroup * 32;
  for (int l = 0; l < 32; l++) {
    uint i = base + l;
    // a lane took part in this collective if it entered it (it may have returned since)
    out.live[l] = i < fibers->size() && (*fibers)[i].simd_gen > g;
    if (out.live[l]) {
      std::memcpy(&out.v[l], (*fibers)[i].slot[g % 2], sizeof(T));
      out.n++;
    }
  }
  return out;
}
}  // namespace mqf

inline void threadgroup_barrier(mem_flags = mem_flags::mem_none) { mqf::yield_as(mqf::AT_BARRIER); }
inline void simdgroup_barrier(mem_flags = mem_flags::mem_none) { (void)mqf::gather<int>(0); }

template <typename T>
T simd_sum(T x) {
  auto l = mqf::gather(x);
  T s = T(0);
  for (int i = 0; i < 32; i++) if (l.live[i]) s = s + l.v[i];
  return s;
}
template <typename T>
T simd_max(T x) {
  auto l = mqf::gather(x);
  T s = x;
  for (int i = 0; i < 32; i++) if (l.live[i] && l.v[i] > s) s = l.v[i];
  return s;
}
template <typename T>
T simd_min(T x) {
  auto l = mqf::gather(x);
  T s = x;
  for (int i = 0; i < 32; i++) if (l.live[i] && l.v[i] < s) s = l.v[i];
  return s;
}
template <typename T>
T simd_shuffle(T x, ushort lane) {
  auto l = mqf::gather(x);
  if (lane >= 32 || !l.live[lane]) mqf::fail("simd_shuffle from an inactive or out-of-range lane");
  return l.v[lane];
}
template <typename T>
T simd_broadcast(T x, ushort lane) { return simd_shuffle(x, lane); }
template <typename T>
T simd_shuffle_xor(T x, ushort mask) {
  auto l = mqf::gather(x);
  uint me = mqf::cur->a.thread_index_in_simdgroup, src = (me ^ mask) & 31;
  return l.live[src] ? l.v[src] : x;
}
template <typename T>
T simd_shuffle_down(T x, ushort d) {
  auto l = mqf::gather(x);
  uint me = mqf::cur->a.thread_index_in_simdgroup;
  return (me + d < 32 && l.live[me + d]) ? l.v[me + d] : x;
}
template <typename T>
T simd_shuffle_up(T x, ushort d) {
  auto l = mqf::gather(x);
  uint me = mqf::cur->a.thread_index_in_simdgroup;
  return (me >= d && l.live[me - d]) ? l.v[me - d] : x;
}
template <typename T>
T simd_prefix_exclusive_sum(T x) {
  auto l = mqf::gather(x);
  uint me = mqf::cur->a.thread_index_in_simdgroup;
  T s = T(0);
  for (uint i = 0; i < me; i++) if (l.live[i]) s = s + l.v[i];
  return s;
}
template <typename T>
T simd_prefix_inclusive_sum(T x) { return simd_prefix_exclusive_sum(x) + x; }
inline bool simd_any(bool x) {
  auto l = mqf::gather(x);
  for (int i = 0; i < 32; i++) if (l.live[i] && l.v[i]) return true;
  return false;
}
inline bool simd_all(bool x) {
  auto l = mqf::gather(x);
  for (int i = 0; i < 32; i++) if (l.live[i] && !l.v[i]) return false;
  return true;
}

// ---- atomics (one OS thread runs every fiber: plain operations) ------------
enum memory_order { memory_order_relaxed };
template <typename T>
struct atomic { T v; };
template <typename T, typename U>
T atomic_fetch_add_explicit(atomic<T>* a, U x, memory_order) { T o = a->v; a->v = T(a->v + x); return o; }
template <typename T, typename U>
T atomic_fetch_max_explicit(atomic<T>* a, U x, memory_order) { T o = a->v; if (T(x) > a->v) a->v = T(x); return o; }
template <typename T, typename U>
void atomic_store_explicit(atomic<T>* a, U x, memory_order) { a->v = T(x); }
template <typename T>
T atomic_load_explicit(atomic<T>* a, memory_order) { return a->v; }

// ---- address spaces and attributes: no meaning on the CPU ------------------
#define device
#define constant
#define thread
#define threadgroup
#define kernel
