// A C++20 reading of the Metal Shading Language subset that MLX's generated
// kernel sources use, for running them on the CPU (tests/metal_check.py).
//
// Execution model: one cooperative fiber (ucontext) per GPU thread, one
// threadgroup at a time; threadgroup_barrier and the simd_* collectives
// suspend the calling fiber until every live thread of its group (barrier)
// or SIMD group of 32 lanes (collective) arrives. A barrier that some
// threads of the group exit without reaching, or lanes of one SIMD group
// waiting at different synchronisation points, abort the run with a
// message. A synchronisation point of a SIMD group is the pair (how many
// collectives the lane has entered, the call site of this one): lanes of
// one group at the same count but different call sites are divergent
// (on Apple's GPUs each branch's collective would see only its own lanes).
// Threadgroup arrays are shared by the group's fibers and filled with 0xFF
// bytes (NaN for floats) at the start of each threadgroup.
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
#include <source_location>
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
typedef _Float16 float16_t;
typedef unsigned long ulong;  // MSL's ulong is 64 bits, as unsigned long is on LP64 Linux

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

// metal::vec<T, N> is MSL's generic vector; the floatN-style names below are
// its instances. Its operators live in namespace metal, found by ADL.
namespace metal {
template <typename T, int N>
struct vec;
// (explicit conversion from another element type, as MSL's ulong2(uint2(...)))
#define MQF_VEC_COMMON(N)                                                   \
  template <typename U>                                                     \
  explicit vec(const vec<U, N>& o) {                                        \
    for (int i = 0; i < N; i++) v[i] = T(o.v[i]);                           \
  }                                                                         \
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
}  // namespace metal
using metal::vec;
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
MQF_VEC_TYPES(long, long)
MQF_VEC_TYPES(ulong, ulong)
MQF_VEC_TYPES(bfloat16_t, bfloat)
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
  std::source_location site;    // the call site of the last one
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

// The memory a kernel may address: the buffers (metal_run.h maps them, each
// ending where an inaccessible page starts) and the threadgroup arrays
// (registered by tg_poison at their first use). The simdgroup_matrix loads
// and stores check every element against these; plain accesses rely on the
// guard pages.
struct Buffer {
  std::string name;
  size_t nbytes;
  char* base;      // mapping start
  size_t mapped;   // bytes mapped, guard pages included
  char* data;      // first byte of the buffer (its end is the guard page)
};
inline std::vector<Buffer> buffers;
struct TgArray {
  const char* name;
  const char* data;
  size_t nbytes;
};
inline std::vector<TgArray> tg_arrays;

inline void tg_poison(void* p, size_t n, long* seen, const char* name) {
  if (*seen == -1) tg_arrays.push_back({name, static_cast<const char*>(p), n});
  if (*seen != group_id) {
    std::memset(p, 0xFF, n);
    *seen = group_id;
  }
}

// Lanes waiting at one synchronisation point: the same count of collectives
// entered and the same call site.
inline bool same_site(const std::source_location& a, const std::source_location& b) {
  return a.line() == b.line() && a.column() == b.column() && std::strcmp(a.file_name(), b.file_name()) == 0;
}
inline bool same_point(const Fiber& a, const Fiber& b) { return a.simd_gen == b.simd_gen && same_site(a.site, b.site); }
[[noreturn]] inline void fail_diverged(const Fiber& a, const Fiber& b) {
  char msg[1024];
  std::snprintf(msg, sizeof msg,
                "SIMD group diverged: lanes wait at different simd_* collectives (lane %u at collective #%d, "
                "line %u:%u; lane %u at #%d, line %u:%u of %s)",
                a.a.thread_index_in_simdgroup, a.simd_gen, a.site.line(), a.site.column(),
                b.a.thread_index_in_simdgroup, b.simd_gen, b.site.line(), b.site.column(), b.site.file_name());
  fail(msg);
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
inline Lanes<T> gather(T x, const std::source_location& site) {
  static_assert(sizeof(T) <= 64, "simd collective of a value over 64 bytes");
  int g = cur->simd_gen++;
  cur->site = site;
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

// Every SIMD collective takes its call site as a defaulted last argument
// (the caller's location), the key of its synchronisation point.
#define MQF_SITE const std::source_location& site = std::source_location::current()
inline void threadgroup_barrier(mem_flags = mem_flags::mem_none) { mqf::yield_as(mqf::AT_BARRIER); }
inline void simdgroup_barrier(mem_flags = mem_flags::mem_none, MQF_SITE) { (void)mqf::gather<int>(0, site); }

template <typename T>
T simd_sum(T x, MQF_SITE) {
  auto l = mqf::gather(x, site);
  T s = T(0);
  for (int i = 0; i < 32; i++) if (l.live[i]) s = s + l.v[i];
  return s;
}
template <typename T>
T simd_max(T x, MQF_SITE) {
  auto l = mqf::gather(x, site);
  T s = x;
  for (int i = 0; i < 32; i++) if (l.live[i] && l.v[i] > s) s = l.v[i];
  return s;
}
template <typename T>
T simd_min(T x, MQF_SITE) {
  auto l = mqf::gather(x, site);
  T s = x;
  for (int i = 0; i < 32; i++) if (l.live[i] && l.v[i] < s) s = l.v[i];
  return s;
}
template <typename T>
T simd_shuffle(T x, ushort lane, MQF_SITE) {
  auto l = mqf::gather(x, site);
  if (lane >= 32 || !l.live[lane]) mqf::fail("simd_shuffle from an inactive or out-of-range lane");
  return l.v[lane];
}
template <typename T>
T simd_broadcast(T x, ushort lane, MQF_SITE) { return simd_shuffle(x, lane, site); }
template <typename T>
T simd_shuffle_xor(T x, ushort mask, MQF_SITE) {
  auto l = mqf::gather(x, site);
  uint me = mqf::cur->a.thread_index_in_simdgroup, src = (me ^ mask) & 31;
  return l.live[src] ? l.v[src] : x;
}
template <typename T>
T simd_shuffle_down(T x, ushort d, MQF_SITE) {
  auto l = mqf::gather(x, site);
  uint me = mqf::cur->a.thread_index_in_simdgroup;
  return (me + d < 32 && l.live[me + d]) ? l.v[me + d] : x;
}
template <typename T>
T simd_shuffle_up(T x, ushort d, MQF_SITE) {
  auto l = mqf::gather(x, site);
  uint me = mqf::cur->a.thread_index_in_simdgroup;
  return (me >= d && l.live[me - d]) ? l.v[me - d] : x;
}
template <typename T>
T simd_prefix_exclusive_sum(T x, MQF_SITE) {
  auto l = mqf::gather(x, site);
  uint me = mqf::cur->a.thread_index_in_simdgroup;
  T s = T(0);
  for (uint i = 0; i < me; i++) if (l.live[i]) s = s + l.v[i];
  return s;
}
template <typename T>
T simd_prefix_inclusive_sum(T x, MQF_SITE) { return simd_prefix_exclusive_sum(x, site) + x; }
inline bool simd_any(bool x, MQF_SITE) {
  auto l = mqf::gather(x, site);
  for (int i = 0; i < 32; i++) if (l.live[i] && l.v[i]) return true;
  return false;
}
inline bool simd_all(bool x, MQF_SITE) {
  auto l = mqf::gather(x, site);
  for (int i = 0; i < 32; i++) if (l.live[i] && !l.v[i]) return false;
  return true;
}

// ---- SIMD-group matrices (MSL, "SIMD-group matrix functions") -------------
// metal::simdgroup_matrix<T, 8, 8> (T float, half or bfloat) is one 8x8
// matrix spread over the 32 lanes of a SIMD group: each lane's object holds
// its two elements, thread_elements(), at row frag_row(lane) and columns
// frag_col(lane), frag_col(lane) + 1: the mapping of MLX's
// BaseMMAFrag<T, 8, 8>::get_coord (mlx/backend/metal/kernels/steel/gemm/
// mma.h), so kernels that read or write thread_elements() directly find the
// entries they expect. A matrix not yet assigned holds NaN.
//
// simdgroup_load, simdgroup_store and the multiplies are SIMD-group
// collectives like the simd_* functions (keyed by call site, divergence is an
// error); in addition all 32 lanes must take part (a partial SIMD group, or
// lanes that returned or branched around the call, is an error), and a load's
// or store's arguments must be the same in every lane. A load or store is
// two synchronisation points, one before and one after its memory accesses,
// so that, as in lockstep execution, it sees every earlier write of its SIMD
// group and no later one. Every element must lie in the buffer or
// threadgroup array that holds element (0, 0) (check_element).
// Matrix element (row, col) is src[(origin.y + row) * elements_per_row +
// origin.x + col] (matrix_origin is (column, row)), or with
// transpose_matrix src[col * elements_per_row + row].
// The multiplies form every product and sum in fp32 (the accumulator first,
// then the 8 products in k order) and round once to d's element type. Apple
// does not document the internal precision of its matrix units: a bound
// that holds here with one rounding per call is the simulation's, not
// necessarily the GPU's.
// Refused with an error (not simulated): a transposed load or store with a
// nonzero matrix_origin (MSL does not say whether that origin is in source
// or in matrix coordinates).
namespace mqf {
inline uint frag_row(uint lane) { return ((lane / 4) & 4) + (lane / 2) % 4; }
inline uint frag_col(uint lane) { return ((lane / 4) & 2) * 2 + (lane % 2) * 2; }

inline void require_all_lanes(const char* op, int n) {
  if (n == 32) return;
  char msg[256];
  std::snprintf(msg, sizeof msg,
                "%s executed by %d of the 32 lanes of a SIMD group: a simdgroup_matrix operation needs all 32 "
                "(a partial SIMD group, or lanes that returned or branched around it)", op, n);
  fail(msg);
}

// The elements of one simdgroup_load or simdgroup_store must all lie in the
// buffer or threadgroup array that holds its element (0, 0) (so a tile that
// runs off one threadgroup array into the next is caught too).
struct Region {
  const char* kind;
  const char* name;
  const char* data;
  size_t nbytes;
  bool holds(const char* p, size_t bytes) const { return p >= data && p + bytes <= data + nbytes; }
};
inline bool region_of(const char* p, size_t bytes, Region* out) {
  for (auto& b : buffers)
    if (Region r{"buffer", b.name.c_str(), b.data, b.nbytes}; r.holds(p, bytes)) return *out = r, true;
  for (auto& t : tg_arrays)
    if (Region r{"threadgroup array", t.name, t.data, t.nbytes}; r.holds(p, bytes)) return *out = r, true;
  return false;
}
inline void check_element(const char* op, const void* first, const void* vp, size_t bytes, uint row, uint col) {
  const char *f = static_cast<const char*>(first), *p = static_cast<const char*>(vp);
  Region r;
  char msg[512];
  if (!region_of(f, bytes, &r)) {
    std::snprintf(msg, sizeof msg, "%s: its element (row 0, column 0) at %p lies in no buffer or threadgroup array",
                  op, first);
    fail(msg);
  }
  if (r.holds(p, bytes)) return;
  std::snprintf(msg, sizeof msg,
                "%s: element (row %u, column %u) lies outside %s '%s' (size %zu bytes) that holds element (0, 0): "
                "at byte %ld of it", op, row, col, r.kind, r.name, r.nbytes, long(p - r.data));
  fail(msg);
}

struct MatrixAccess {
  const void* ptr;
  ulong epr, ox, oy;
  bool transpose;
  bool operator==(const MatrixAccess& o) const {
    return ptr == o.ptr && epr == o.epr && ox == o.ox && oy == o.oy && transpose == o.transpose;
  }
};
// The first synchronisation point of a load or store: every lane there, with
// the same arguments.
inline void matrix_access_begin(const char* op, const MatrixAccess& m, const std::source_location& site) {
  auto l = gather(m, site);
  require_all_lanes(op, l.n);
  for (int i = 0; i < 32; i++)
    if (!(l.v[i] == m)) {
      char msg[256];
      std::snprintf(msg, sizeof msg,
                    "%s: lanes pass different arguments (pointer, elements_per_row, matrix_origin or "
                    "transpose_matrix differ between lane %u and lane %d)", op, cur->a.thread_index_in_simdgroup, i);
      fail(msg);
    }
  if (m.transpose && (m.ox != 0 || m.oy != 0)) {
    char msg[256];
    std::snprintf(msg, sizeof msg,
                  "%s with transpose_matrix and a nonzero matrix_origin (%lu, %lu) is not simulated: offset the "
                  "pointer instead", op, m.ox, m.oy);
    fail(msg);
  }
}
template <typename P>
inline P* element_at(P* base, const MatrixAccess& m, uint row, uint col) {
  ulong r = m.transpose ? col : m.oy + row, c = m.transpose ? row : m.ox + col;
  return reinterpret_cast<P*>(reinterpret_cast<uintptr_t>(base) + (r * m.epr + c) * sizeof(P));
}
}  // namespace mqf

namespace metal {
template <typename T, int Cols, int Rows>
struct simdgroup_matrix {
  static_assert(Cols == 8 && Rows == 8, "metal_check: simdgroup_matrix is 8x8 (the size MSL defines)");
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, half> || std::is_same_v<T, bfloat16_t>,
                "metal_check: simdgroup_matrix of float, half or bfloat");
  vec<T, 2> e;  // this lane's elements: (frag_row, frag_col) and (frag_row, frag_col + 1)
  simdgroup_matrix() : e(T(std::numeric_limits<float>::quiet_NaN())) {}
  // MSL: the diagonal matrix with dval on its diagonal
  explicit simdgroup_matrix(T dval) {
    uint lane = mqf::cur->a.thread_index_in_simdgroup, r = mqf::frag_row(lane), c = mqf::frag_col(lane);
    e = vec<T, 2>(r == c ? dval : T(0), r == c + 1 ? dval : T(0));
  }
  vec<T, 2>& thread_elements() { return e; }
  const vec<T, 2>& thread_elements() const { return e; }
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat16_t, 8, 8> simdgroup_bfloat8x8;

template <typename T, int Cols, int Rows>
simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(T value) {
  simdgroup_matrix<T, Cols, Rows> m;
  m.e = vec<T, 2>(value);
  return m;
}

template <typename T, int Cols, int Rows>
void simdgroup_load(simdgroup_matrix<T, Cols, Rows>& d, const T* src, ulong elements_per_row = Cols,
                    ulong2 matrix_origin = ulong2(0ul), bool transpose_matrix = false, MQF_SITE) {
  mqf::MatrixAccess m{src, elements_per_row, matrix_origin.x, matrix_origin.y, transpose_matrix};
  mqf::matrix_access_begin("simdgroup_load", m, site);
  uint lane = mqf::cur->a.thread_index_in_simdgroup, r = mqf::frag_row(lane);
  for (int j = 0; j < 2; j++) {
    uint c = mqf::frag_col(lane) + j;
    const T* p = mqf::element_at(src, m, r, c);
    mqf::check_element("simdgroup_load", mqf::element_at(src, m, 0, 0), p, sizeof(T), r, c);
    d.e[j] = *p;
  }
  (void)mqf::gather<int>(0, site);  // the second point: every lane has read
}

template <typename T, int Cols, int Rows>
void simdgroup_store(const simdgroup_matrix<T, Cols, Rows>& a, T* dst, ulong elements_per_row = Cols,
                     ulong2 matrix_origin = ulong2(0ul), bool transpose_matrix = false, MQF_SITE) {
  mqf::MatrixAccess m{dst, elements_per_row, matrix_origin.x, matrix_origin.y, transpose_matrix};
  mqf::matrix_access_begin("simdgroup_store", m, site);
  uint lane = mqf::cur->a.thread_index_in_simdgroup, r = mqf::frag_row(lane);
  for (int j = 0; j < 2; j++) {
    uint c = mqf::frag_col(lane) + j;
    T* p = mqf::element_at(dst, m, r, c);
    mqf::check_element("simdgroup_store", mqf::element_at(dst, m, 0, 0), p, sizeof(T), r, c);
    *p = a.e[j];
  }
  (void)mqf::gather<int>(0, site);  // the second point: every lane has written
}
}  // namespace metal

namespace mqf {
// d = a * b (+ c): one collective carrying every lane's elements of a, b, c.
template <typename TD, typename TA, typename TB, typename TC>
void matrix_multiply(const char* op, metal::simdgroup_matrix<TD, 8, 8>& d, const metal::simdgroup_matrix<TA, 8, 8>& a,
                     const metal::simdgroup_matrix<TB, 8, 8>& b, const metal::simdgroup_matrix<TC, 8, 8>* c,
                     const std::source_location& site) {
  struct Frags {
    vec<TA, 2> a;
    vec<TB, 2> b;
    vec<TC, 2> c;
  };
  auto l = gather(Frags{a.e, b.e, c ? c->e : vec<TC, 2>(TC(0))}, site);
  require_all_lanes(op, l.n);
  float A[8][8], B[8][8], C[8][8];
  for (uint i = 0; i < 32; i++)
    for (int j = 0; j < 2; j++) {
      uint r = frag_row(i), col = frag_col(i) + j;
      A[r][col] = float(l.v[i].a[j]);
      B[r][col] = float(l.v[i].b[j]);
      C[r][col] = float(l.v[i].c[j]);
    }
  uint lane = cur->a.thread_index_in_simdgroup, r = frag_row(lane);
  for (int j = 0; j < 2; j++) {
    uint col = frag_col(lane) + j;
    float acc = C[r][col];
    for (int k = 0; k < 8; k++) acc += A[r][k] * B[k][col];
    d.e[j] = TD(acc);
  }
}
}  // namespace mqf

namespace metal {
// MSL: d = a * b + c. The element types may differ (e.g. half inputs, a float accumulator).
template <typename TD, typename TA, typename TB, typename TC>
void simdgroup_multiply_accumulate(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                                   const simdgroup_matrix<TB, 8, 8>& b, const simdgroup_matrix<TC, 8, 8>& c,
                                   MQF_SITE) {
  mqf::matrix_multiply("simdgroup_multiply_accumulate", d, a, b, &c, site);
}
// MSL: d = a * b.
template <typename TD, typename TA, typename TB>
void simdgroup_multiply(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                        const simdgroup_matrix<TB, 8, 8>& b, MQF_SITE) {
  mqf::matrix_multiply<TD, TA, TB, TD>("simdgroup_multiply", d, a, b, nullptr, site);
}
}  // namespace metal

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
