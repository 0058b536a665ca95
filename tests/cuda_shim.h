// The CUDA C++ subset of the package's kernels, read as C++20 on the CPU:
// the runtime of tests/cuda_check.py (its module docstring says what a pass
// proves). Included before the kernel's source (g++ -include); the driver,
// cuda_run.h, after it.
//
// * Every GPU thread is a fiber; a block's fibers run cooperatively on one
//   OS thread (no preemption: an atomic is a plain read-modify-write).
//   Blocks run one after another, or all at once where the launch asks for
//   co-resident blocks (grid-wide barriers).
// * __syncthreads (and its _or/_and/_count forms) waits for every thread of
//   the block at the same call site; a thread that returns while others wait,
//   or threads waiting at two different call sites, fail the run.
// * Warp collectives (shuffles, votes, __reduce_*_sync, __match_*_sync,
//   __syncwarp and the PTX helpers' warp operations in ptx.cuh) gather the
//   lanes named in the mask at one call site, checked: a lane calling with a
//   mask that leaves it out, a mask naming lanes the block does not have, a
//   shuffle reading a lane outside the mask, lanes of one mask at two call
//   sites, or a lane in the mask that never arrives (it returned or waits
//   elsewhere) fail the run, naming the call site.
// * Shared memory: every __shared__ array (the checker rewrites each
//   declaration into a call of shared_static / shared_dynamic) lives in
//   its own pages of the block's arena, ending where an inaccessible page
//   starts; it starts poisoned (0xFF bytes), and the bytes before its start
//   on its first page are a canary checked when the block ends. Shared
//   addresses (__cvta_generic_to_shared) are offsets into the arena.
// * cp.async copies (cp_async_* in ptx.cuh) join the thread's open group;
//   commit closes it; wait_group<N> completes all but the newest N groups
//   (a wait with copies not yet committed fails: no wait covers them).
//   Schedule 0 copies at issue, schedule 1 at completion, so a read of the
//   destination before the wait (or before the barrier after it) gives
//   different outputs in the two runs.
// * Schedules: 0 runs threads in ascending order, each until it blocks;
//   1 always runs the highest-numbered runnable thread (and blocks in
//   descending order). A read of memory that another thread writes with no
//   barrier between sees different values in the two.
#pragma once

#include <signal.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <memory>
#include <functional>
#include <source_location>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#define MQF_CPU_CHECK 1

// ---- qualifiers ---------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __restrict__ __restrict
#define __align__(n) alignas(n)
#define __launch_bounds__(...)
#define __constant__ static
// __shared__ declarations are rewritten by cuda_check.py; one left over is an error
#define __shared__ MQF_SHARED_DECLARATION_NOT_REWRITTEN

typedef unsigned int uint;
typedef unsigned short ushort;

// ---- vector types (CUDA's sizes and alignments) -----------------------------------------
#define MQF_VEC2(T, name, al) \
  struct alignas(al) name {   \
    T x, y;                   \
  };
#define MQF_VEC4(T, name, al) \
  struct alignas(al) name {   \
    T x, y, z, w;             \
  };
MQF_VEC2(float, float2, 8)
MQF_VEC4(float, float4, 16)
MQF_VEC2(int, int2, 8)
MQF_VEC4(int, int4, 16)
MQF_VEC2(unsigned, uint2, 8)
MQF_VEC4(unsigned, uint4, 16)
MQF_VEC2(unsigned short, ushort2, 4)
MQF_VEC4(unsigned short, ushort4, 8)
MQF_VEC2(unsigned long long, ulonglong2, 16)
struct uint3 {
  unsigned x, y, z;
};
typedef uint3 dim3;
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline int2 make_int2(int x, int y) { return {x, y}; }
inline int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }

namespace mqf {

// ---- failure reports ----------------------------------------------------------------------
inline const char* kernel_name = "kernel";
inline char where_buf[160] = "";
[[noreturn]] void fail(const std::string& what);  // cuda_run.h: names the kernel, block and thread

inline std::string site_str(const std::source_location& s) {
  const char* f = s.file_name();
  const char* slash = std::strrchr(f, '/');
  return std::string(slash ? slash + 1 : f) + ":" + std::to_string(s.line());
}
inline std::string hex(unsigned v) {
  char b[16];
  std::snprintf(b, sizeof b, "0x%08x", v);
  return b;
}

// ---- fibers, blocks, warps -------------------------------------------------------------------
enum State { READY, AT_BARRIER, AT_WARP, SPINNING, DONE };

struct Coll;  // a warp collective in progress

struct PendingCopy {
  void* dst;
  const void* src;
  unsigned bytes, src_bytes;
};

struct Block;
struct Fiber {
  void* sp = nullptr;  // saved stack pointer (x86-64 switch) or
  ucontext_t uctx;     // context (elsewhere)
  char* stack = nullptr;
  bool stack_canary = false;  // its stack has a canary page, not a guard page (cuda_run.h's stack_for)
  uint3 tid{};
  unsigned linear = 0, lane = 0, warp = 0;
  Block* blk = nullptr;
  State state = READY;
  std::source_location site;  // where it waits
  Coll* coll = nullptr;
  long seen_epoch = -1;  // the progress count when it last spun
  std::source_location spin_site;
  std::vector<PendingCopy> open_group;
  std::vector<std::vector<PendingCopy>> groups;  // committed, oldest first
  std::vector<std::function<void()>> async_open;  // wgmma: issued, not committed
  std::vector<std::vector<std::function<void()>>> async_groups;  // committed, oldest first
  long long clock = 0;  // clock64(): this thread's reads so far (deterministic, the same in every schedule)
};

struct Alloc {
  std::string name;
  char* data;
  size_t bytes;
  char* page;  // first page of its own (canary before data)
};

struct Block {
  uint3 idx{};
  std::vector<Fiber*> fibers;
  char* arena = nullptr;
  size_t arena_used = 0;  // bytes of the arena handed out (page multiples)
  std::vector<std::pair<const void*, Alloc>> statics;  // by declaration site
  char* dyn = nullptr;
  size_t dyn_bytes = 0;
  size_t smem_bytes = 0;  // static + dynamic, against the per-block limit
  int at_barrier = 0, done = 0;
  std::source_location barrier_site;
  int bar_or = 0, bar_and = 1, bar_count = 0;
  int bar_result_or = 0, bar_result_and = 0, bar_result_count = 0;
  std::vector<Coll*> warp_colls;
};

inline uint3 block_dim{}, grid_dim{};
inline Fiber* cur = nullptr;
inline int schedule = 0;
inline size_t dyn_smem_request = 0;
inline long page_size = 4096;
inline constexpr size_t ARENA_RESERVE = size_t(64) << 20;
inline constexpr size_t SMEM_LIMIT = 232448;  // sm_90: 227 KB per block
inline constexpr size_t CANARY = 0xA5;
inline std::vector<Block*> live_blocks;

void yield(State s);  // cuda_run.h: back to the scheduler

inline void describe_thread(char* out, size_t n, const Fiber* f) {
  if (!f) {
    std::snprintf(out, n, "(no thread)");
    return;
  }
  std::snprintf(out, n, "block (%u,%u,%u) thread (%u,%u,%u)", f->blk->idx.x, f->blk->idx.y, f->blk->idx.z, f->tid.x,
                f->tid.y, f->tid.z);
}

// ---- shared memory ---------------------------------------------------------------------------
inline size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

// mprotect, or fail naming what could not be mapped: past vm.max_map_count mappings (about two per
// simulated thread's stack, two per array) the kernel would otherwise fault on a page left inaccessible
// and be reported as an out-of-bounds access it never made.
inline void protect_or_fail(void* p, size_t n, int prot, const char* what) {
  if (mprotect(p, n, prot) != 0)
    fail(std::string("the CUDA check could not map ") + what + " (" + std::strerror(errno) +
         "): the launch needs more memory mappings than this machine allows (vm.max_map_count); "
         "a simulator limit, not a kernel error: run fewer blocks x threads");
}

inline void arena_map(Block* b) {
  b->arena = (char*)mmap(nullptr, ARENA_RESERVE, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (b->arena == MAP_FAILED) fail("cannot reserve the shared-memory arena");
  b->arena_used = size_t(page_size);  // offset 0 is never a valid shared address
}

// A new allocation in b's arena: its own pages, ending at an inaccessible page.
inline char* arena_alloc(Block* b, const char* name, size_t bytes, size_t align) {
  size_t body = round_up(std::max<size_t>(round_up(bytes, align), 1), size_t(page_size));
  if (b->arena_used + body + page_size > ARENA_RESERVE) fail("shared-memory arena exhausted");
  char* page = b->arena + b->arena_used;
  protect_or_fail(page, body, PROT_READ | PROT_WRITE, "a block's shared memory");
  b->arena_used += body + page_size;  // the page after stays PROT_NONE
  char* data = page + body - round_up(bytes, align);
  std::memset(page, int(CANARY), size_t(data - page));
  std::memset(data, 0xFF, page + body - data);
  b->smem_bytes += bytes;
  if (b->smem_bytes > SMEM_LIMIT)
    fail("shared memory of the block (" + std::to_string(b->smem_bytes) + " bytes with '" + name +
         "') exceeds the 227 KB an sm_90 block may use");
  return data;
}

template <typename T>
T* shared_static(const void* site, const char* name, size_t align) {
  Block* b = cur->blk;
  for (auto& [s, a] : b->statics)
    if (s == site) return reinterpret_cast<T*>(a.data);
  char* d = arena_alloc(b, name, sizeof(T), std::max(align, alignof(T)));
  char* page = d - (reinterpret_cast<uintptr_t>(d) % page_size);
  b->statics.push_back({site, Alloc{name, d, sizeof(T), page}});
  return reinterpret_cast<T*>(d);
}

inline void* shared_dynamic(size_t align) {
  Block* b = cur->blk;
  if (!b->dyn) {
    if (dyn_smem_request == 0) fail("the kernel declares extern __shared__ memory but the launch gives 0 bytes");
    b->dyn = arena_alloc(b, "dynamic shared memory", dyn_smem_request, std::max<size_t>(align, 16));
    b->dyn_bytes = dyn_smem_request;
  }
  return b->dyn;
}

// Which shared allocation holds [p, p + n), or fail.
inline void check_shared_range(const char* what, const void* p, size_t n) {
  Block* b = cur->blk;
  const char* c = static_cast<const char*>(p);
  auto inside = [&](const char* d, size_t bytes) { return c >= d && c + n <= d + bytes; };
  if (b->dyn && inside(b->dyn, b->dyn_bytes)) return;
  for (auto& [s, a] : b->statics)
    if (inside(a.data, a.bytes)) return;
  fail(std::string(what) + ": " + std::to_string(n) + " bytes at shared address " +
       std::to_string(long(c - b->arena)) + " are not inside one shared array");
}

inline void check_canaries(Block* b) {
  auto check = [&](const char* name, const char* page, const char* data) {
    for (const char* p = page; p < data; p++)
      if ((unsigned char)*p != CANARY)
        fail(std::string("a write before the start of shared array '") + name + "' (" +
             std::to_string(long(data - p)) + " bytes before it)");
  };
  for (auto& [s, a] : b->statics) check(a.name.c_str(), a.page, a.data);
  if (b->dyn) check("dynamic shared memory", b->dyn - (reinterpret_cast<uintptr_t>(b->dyn) % page_size), b->dyn);
}

inline unsigned shared_offset(const void* p) {
  Block* b = cur->blk;
  const char* c = static_cast<const char*>(p);
  if (c < b->arena || c >= b->arena + b->arena_used) fail("__cvta_generic_to_shared of an address outside shared memory");
  return unsigned(c - b->arena);
}
inline char* shared_pointer(unsigned addr, size_t n, const char* what) {
  char* p = cur->blk->arena + addr;
  check_shared_range(what, p, n);
  return p;
}

// ---- warp collectives ---------------------------------------------------------------------
constexpr unsigned COLL_BYTES = 64;
struct Coll {
  std::source_location site;
  const char* what;
  unsigned warp, mask, arrived = 0, readers = 0;
  alignas(16) unsigned char data[32][COLL_BYTES];
};

inline unsigned lanes_of_warp(const Block* b, unsigned warp) {
  size_t n = b->fibers.size(), first = size_t(warp) * 32;
  size_t have = std::min<size_t>(32, n - first);
  return have == 32 ? 0xffffffffu : ((1u << have) - 1);
}

inline bool same_site(const std::source_location& a, const std::source_location& b) {
  return a.line() == b.line() && a.column() == b.column() && std::strcmp(a.file_name(), b.file_name()) == 0;
}

// All-gather: the calling lane contributes `bytes` bytes; returns when every
// lane of `mask` has arrived at this call site with the same mask, with
// every lane's contribution in all[32][bytes] (lanes outside the mask: zeros).
inline void warp_allgather(unsigned mask, const void* mine, unsigned bytes, void* all, const char* what,
                           const std::source_location& site) {
  Fiber* f = cur;
  Block* b = f->blk;
  const unsigned bit = 1u << f->lane;
  if (bytes > COLL_BYTES) fail("warp collective payload too large");
  if (!(mask & bit))
    fail(std::string(what) + " at " + site_str(site) + ": lane " + std::to_string(f->lane) +
         " calls it with mask " + hex(mask) + ", which leaves it out");
  const unsigned have = lanes_of_warp(b, f->warp);
  if (mask & ~have)
    fail(std::string(what) + " at " + site_str(site) + ": mask " + hex(mask) + " names lanes warp " +
         std::to_string(f->warp) + " does not have (its lanes: " + hex(have) + ")");
  Coll* c = nullptr;
  for (Coll* x : b->warp_colls) {
    if (x->warp != f->warp || x->arrived == x->mask) continue;  // another warp's, or complete and being read
    if (!(x->mask & bit)) {
      if (x->mask & mask)
        fail(std::string(what) + " at " + site_str(site) + " (mask " + hex(mask) + ") overlaps " + x->what +
             " at " + site_str(x->site) + " (mask " + hex(x->mask) + ") in warp " + std::to_string(f->warp));
      continue;
    }
    if (x->arrived & bit) continue;
    if (!same_site(x->site, site) || x->mask != mask)
      fail("lanes of warp " + std::to_string(f->warp) + " meet at different collectives: " + x->what + " at " +
           site_str(x->site) + " (mask " + hex(x->mask) + ") and " + what + " at " + site_str(site) + " (mask " +
           hex(mask) + ")");
    c = x;
    break;
  }
  if (!c) {
    c = new Coll{site, what, f->warp, mask};
    std::memset(c->data, 0, sizeof c->data);
    b->warp_colls.push_back(c);
  }
  std::memcpy(c->data[f->lane], mine, bytes);
  c->arrived |= bit;
  f->coll = c;
  f->site = site;
  if (c->arrived == c->mask) {  // the last lane: release the others
    const size_t first = size_t(f->warp) * 32, end = std::min(b->fibers.size(), first + 32);
    for (size_t i = first; i < end; i++)
      if (b->fibers[i]->coll == c && b->fibers[i] != f) b->fibers[i]->state = READY;
  } else {
    yield(AT_WARP);
  }
  for (unsigned l = 0; l < 32; l++) std::memcpy(static_cast<char*>(all) + size_t(l) * bytes, c->data[l], bytes);
  f->coll = nullptr;
  if (++c->readers == unsigned(std::popcount(c->mask))) {
    b->warp_colls.erase(std::find(b->warp_colls.begin(), b->warp_colls.end(), c));
    delete c;
  }
}

template <typename T>
struct Gathered {
  T v[32];
};
template <typename T>
inline Gathered<T> gather(unsigned mask, T x, const char* what, const std::source_location& site) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= COLL_BYTES);
  Gathered<T> g;
  warp_allgather(mask, &x, sizeof(T), g.v, what, site);
  return g;
}

inline void check_width(int width, const char* what, const std::source_location& site) {
  if (width < 1 || width > 32 || (width & (width - 1)))
    fail(std::string(what) + " at " + site_str(site) + ": width " + std::to_string(width) +
         " is not a power of two in [1, 32]");
}
template <typename T>
inline T shfl_from(unsigned mask, const Gathered<T>& g, int src, const char* what, const std::source_location& site) {
  if (!(mask & (1u << src)))
    fail(std::string(what) + " at " + site_str(site) + ": lane " + std::to_string(cur->lane) + " reads lane " +
         std::to_string(src) + ", outside the mask " + hex(mask));
  return g.v[src];
}

// ---- spin waits (grid barriers) ---------------------------------------------------------
// A thread polling memory that other blocks write: it runs again only after
// another thread made progress (cuda_run.h's scheduler).
inline void spin_yield(const std::source_location& site) {
  cur->spin_site = site;
  yield(SPINNING);
}

// ---- barrier ------------------------------------------------------------------------------
inline int block_barrier(int pred, const std::source_location& site) {
  Fiber* f = cur;
  Block* b = f->blk;
  if (b->at_barrier > 0 && !same_site(b->barrier_site, site))
    fail("threads of the block wait at two different __syncthreads: " + site_str(b->barrier_site) + " and " +
         site_str(site));
  if (b->at_barrier == 0) {
    b->barrier_site = site;
    b->bar_or = 0, b->bar_and = 1, b->bar_count = 0;
  }
  b->bar_or |= pred != 0;
  b->bar_and &= pred != 0;
  b->bar_count += pred != 0;
  f->site = site;
  if (b->done > 0)
    fail("__syncthreads at " + site_str(site) + " after " + std::to_string(b->done) +
         " threads of the block returned (a __syncthreads that not every thread reaches is undefined)");
  if (++b->at_barrier == int(b->fibers.size())) {
    b->bar_result_or = b->bar_or, b->bar_result_and = b->bar_and, b->bar_result_count = b->bar_count;
    b->at_barrier = 0;
    for (Fiber* g : b->fibers)
      if (g->state == AT_BARRIER) g->state = READY;
  } else {
    yield(AT_BARRIER);
  }
  return 0;
}

// ---- cp.async ---------------------------------------------------------------------------
inline void copy_now(const PendingCopy& c) {
  std::memcpy(c.dst, c.src, c.src_bytes);
  std::memset(static_cast<char*>(c.dst) + c.src_bytes, 0, c.bytes - c.src_bytes);
}
inline void cp_async(unsigned dst_shared, const void* src, unsigned bytes, unsigned src_bytes, const char* what) {
  if (src_bytes > bytes) fail(std::string(what) + ": source size " + std::to_string(src_bytes) + " exceeds the copy's " +
                              std::to_string(bytes) + " bytes");
  if (dst_shared % bytes) fail(std::string(what) + ": shared address not aligned to the copy size");
  if (reinterpret_cast<uintptr_t>(src) % bytes && src_bytes) fail(std::string(what) + ": global address not aligned to the copy size");
  PendingCopy c{shared_pointer(dst_shared, bytes, what), src, bytes, src_bytes};
  if (schedule == 0) {
    copy_now(c);
    c.bytes = c.src_bytes = 0;  // done; kept for the group bookkeeping
  } else if (src_bytes) {
    volatile char probe = *static_cast<const volatile char*>(src);  // fault now, at the issuing thread
    (void)probe;
  }
  cur->open_group.push_back(c);
}
inline void cp_async_commit() {
  cur->groups.push_back(std::move(cur->open_group));
  cur->open_group.clear();
}
inline void cp_async_wait(int keep) {
  for (const PendingCopy& c : cur->open_group)
    if (c.bytes || schedule == 0)  // any copy issued since the last commit
      fail("cp.async.wait_group with copies issued since the last commit_group: they belong to no group, so "
           "the wait does not cover them");
  auto& g = cur->groups;
  while (int(g.size()) > keep) {
    for (auto& c : g.front())
      if (c.bytes) copy_now(c);
    g.erase(g.begin());
  }
}

// ---- asynchronous tensor-core groups (wgmma) ------------------------------------------------
// A product joins the thread's open group; commit closes it; wait(N)
// completes all but the newest N groups. Schedule 0 computes at issue,
// schedule 1 at completion (operands in shared memory read then).
inline void async_issue(std::function<void()> work) {
  if (schedule == 0) work();
  else cur->async_open.push_back(std::move(work));
}
inline void async_commit() {
  cur->async_groups.push_back(std::move(cur->async_open));
  cur->async_open.clear();
}
inline void async_wait(int keep) {
  auto& g = cur->async_groups;
  while (int(g.size()) > keep) {
    for (auto& w : g.front()) w();
    g.erase(g.begin());
  }
}

}  // namespace mqf

// ---- thread indices -----------------------------------------------------------------------
#define threadIdx (mqf::cur->tid)
#define blockIdx (mqf::cur->blk->idx)
#define blockDim (mqf::block_dim)
#define gridDim (mqf::grid_dim)
constexpr int warpSize = 32;

// ---- clocks -------------------------------------------------------------------------------------
// clock64: increasing per thread, one tick per read, so that a kernel that stores differences of
// its reads gives the same output under every schedule (cycle counts mean nothing here).
inline long long clock64() { return ++mqf::cur->clock; }

// ---- synchronisation ----------------------------------------------------------------------
#define MQF_SITE std::source_location site = std::source_location::current()
inline void __syncthreads(MQF_SITE) { mqf::block_barrier(0, site); }
inline int __syncthreads_or(int p, MQF_SITE) {
  mqf::block_barrier(p, site);
  return mqf::cur->blk->bar_result_or;
}
inline int __syncthreads_and(int p, MQF_SITE) {
  mqf::block_barrier(p, site);
  return mqf::cur->blk->bar_result_and;
}
inline int __syncthreads_count(int p, MQF_SITE) {
  mqf::block_barrier(p, site);
  return mqf::cur->blk->bar_result_count;
}
inline void __syncwarp(unsigned mask = 0xffffffffu, MQF_SITE) { (void)mqf::gather<int>(mask, 0, "__syncwarp", site); }
inline void __threadfence() {}
inline void __threadfence_block() {}
inline void __nanosleep(unsigned, MQF_SITE) { mqf::spin_yield(site); }
[[noreturn]] inline void __trap(MQF_SITE) { mqf::fail("__trap() at " + mqf::site_str(site)); }

// ---- warp shuffles and votes ----------------------------------------------------------------
template <typename T>
inline T __shfl_sync(unsigned mask, T v, int src, int width = 32, MQF_SITE) {
  mqf::check_width(width, "__shfl_sync", site);
  auto g = mqf::gather(mask, v, "__shfl_sync", site);
  const int lane = int(mqf::cur->lane);
  return mqf::shfl_from(mask, g, (lane & ~(width - 1)) + (src & (width - 1)), "__shfl_sync", site);
}
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32, MQF_SITE) {
  mqf::check_width(width, "__shfl_xor_sync", site);
  auto g = mqf::gather(mask, v, "__shfl_xor_sync", site);
  const int lane = int(mqf::cur->lane), src = lane ^ lane_mask;
  if ((src & ~(width - 1)) > (lane & ~(width - 1)) || src > 31) return v;  // a later group: own value
  return mqf::shfl_from(mask, g, src, "__shfl_xor_sync", site);
}
template <typename T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32, MQF_SITE) {
  mqf::check_width(width, "__shfl_up_sync", site);
  auto g = mqf::gather(mask, v, "__shfl_up_sync", site);
  const int lane = int(mqf::cur->lane), src = lane - int(delta);
  if (src < (lane & ~(width - 1))) return v;
  return mqf::shfl_from(mask, g, src, "__shfl_up_sync", site);
}
template <typename T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32, MQF_SITE) {
  mqf::check_width(width, "__shfl_down_sync", site);
  auto g = mqf::gather(mask, v, "__shfl_down_sync", site);
  const int lane = int(mqf::cur->lane), src = lane + int(delta);
  if (src >= (lane & ~(width - 1)) + width) return v;
  return mqf::shfl_from(mask, g, src, "__shfl_down_sync", site);
}
inline unsigned __ballot_sync(unsigned mask, int pred, MQF_SITE) {
  auto g = mqf::gather<int>(mask, pred != 0, "__ballot_sync", site);
  unsigned r = 0;
  for (int l = 0; l < 32; l++)
    if ((mask >> l & 1) && g.v[l]) r |= 1u << l;
  return r;
}
inline int __any_sync(unsigned mask, int pred, MQF_SITE) {
  auto g = mqf::gather<int>(mask, pred != 0, "__any_sync", site);
  for (int l = 0; l < 32; l++)
    if ((mask >> l & 1) && g.v[l]) return 1;
  return 0;
}
inline int __all_sync(unsigned mask, int pred, MQF_SITE) {
  auto g = mqf::gather<int>(mask, pred != 0, "__all_sync", site);
  for (int l = 0; l < 32; l++)
    if ((mask >> l & 1) && !g.v[l]) return 0;
  return 1;
}
// Lanes that have not returned (the fibers of a warp do not diverge in time
// the way a GPU's do; kernels here use full masks).
inline unsigned __activemask() {
  unsigned m = 0;
  for (mqf::Fiber* g : mqf::cur->blk->fibers)
    if (g->warp == mqf::cur->warp && g->state != mqf::DONE) m |= 1u << g->lane;
  return m;
}
#define MQF_REDUCE(name, T, init, op)                                 \
  inline T name(unsigned mask, T v, MQF_SITE) {                       \
    auto g = mqf::gather<T>(mask, v, #name, site);                    \
    T r = init;                                                       \
    for (int l = 0; l < 32; l++)                                      \
      if (mask >> l & 1) r = op;                                      \
    return r;                                                         \
  }
MQF_REDUCE(__reduce_add_sync, unsigned, 0u, r + g.v[l])
MQF_REDUCE(__reduce_add_sync, int, 0, int(unsigned(r) + unsigned(g.v[l])))
MQF_REDUCE(__reduce_min_sync, unsigned, 0xffffffffu, std::min(r, g.v[l]))
MQF_REDUCE(__reduce_min_sync, int, 0x7fffffff, std::min(r, g.v[l]))
MQF_REDUCE(__reduce_max_sync, unsigned, 0u, std::max(r, g.v[l]))
MQF_REDUCE(__reduce_max_sync, int, int(0x80000000), std::max(r, g.v[l]))
MQF_REDUCE(__reduce_and_sync, unsigned, 0xffffffffu, r & g.v[l])
MQF_REDUCE(__reduce_or_sync, unsigned, 0u, r | g.v[l])
MQF_REDUCE(__reduce_xor_sync, unsigned, 0u, r ^ g.v[l])
#undef MQF_REDUCE
template <typename T>
inline unsigned __match_any_sync(unsigned mask, T v, MQF_SITE) {
  auto g = mqf::gather(mask, v, "__match_any_sync", site);
  unsigned r = 0;
  for (int l = 0; l < 32; l++)
    if ((mask >> l & 1) && std::memcmp(&g.v[l], &v, sizeof(T)) == 0) r |= 1u << l;
  return r;
}
template <typename T>
inline unsigned __match_all_sync(unsigned mask, T v, int* pred, MQF_SITE) {
  auto g = mqf::gather(mask, v, "__match_all_sync", site);
  for (int l = 0; l < 32; l++)
    if ((mask >> l & 1) && std::memcmp(&g.v[l], &v, sizeof(T)) != 0) {
      *pred = 0;
      return 0;
    }
  *pred = 1;
  return mask;
}

// ---- atomics (fibers never preempt each other: plain read-modify-writes) -------------------
#define MQF_ATOMIC(name, expr)   \
  template <typename T>          \
  inline T name(T* p, T v) {     \
    T o = *p;                    \
    *p = (expr);                 \
    return o;                    \
  }
MQF_ATOMIC(atomicAdd, o + v)
MQF_ATOMIC(atomicSub, o - v)
MQF_ATOMIC(atomicMax, std::max(o, v))
MQF_ATOMIC(atomicMin, std::min(o, v))
MQF_ATOMIC(atomicExch, v)
MQF_ATOMIC(atomicOr, o | v)
MQF_ATOMIC(atomicAnd, o & v)
#undef MQF_ATOMIC
template <typename T>
inline T atomicCAS(T* p, T cmp, T v) {
  T o = *p;
  if (o == cmp) *p = v;
  return o;
}
inline unsigned atomicInc(unsigned* p, unsigned lim) {
  unsigned o = *p;
  *p = o >= lim ? 0 : o + 1;
  return o;
}

// ---- bits and math --------------------------------------------------------------------------
inline float __uint_as_float(unsigned v) { return std::bit_cast<float>(v); }
inline unsigned __float_as_uint(float v) { return std::bit_cast<unsigned>(v); }
inline float __int_as_float(int v) { return std::bit_cast<float>(v); }
inline int __float_as_int(float v) { return std::bit_cast<int>(v); }
inline int __popc(unsigned v) { return std::popcount(v); }
inline int __popcll(unsigned long long v) { return std::popcount(v); }
inline int __ffs(int v) { return __builtin_ffs(v); }
inline int __ffsll(long long v) { return __builtin_ffsll(v); }
inline int __clz(int v) { return v == 0 ? 32 : __builtin_clz(unsigned(v)); }
inline unsigned __brev(unsigned v) {
  unsigned r = 0;
  for (int i = 0; i < 32; i++) r |= ((v >> i) & 1u) << (31 - i);
  return r;
}
inline unsigned __umulhi(unsigned a, unsigned b) { return unsigned((unsigned long long)a * b >> 32); }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned long long min(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
inline unsigned long long max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }
inline float min(float a, float b) { return std::fmin(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }
// The fast-math intrinsics: exact values (within every documented error bound).
inline float __expf(float x) { return std::exp(x); }
inline float __exp10f(float x) { return std::pow(10.0f, x); }
inline float __logf(float x) { return std::log(x); }
inline float __log2f(float x) { return std::log2(x); }
inline float __powf(float a, float b) { return std::pow(a, b); }
inline float __sinf(float x) { return std::sin(x); }
inline float __cosf(float x) { return std::cos(x); }
inline float __tanhf(float x) { return std::tanh(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return std::sqrt(x); }
inline float __saturatef(float x) { return std::isnan(x) ? 0.0f : std::fmin(std::fmax(x, 0.0f), 1.0f); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline void sincosf(float x, float* s, float* c) {
  *s = std::sin(x);
  *c = std::cos(x);
}
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
template <typename T>
inline T __ldg(const T* p) { return *p; }
template <typename T>
inline T __ldcg(const T* p) { return *p; }

inline unsigned __cvta_generic_to_shared(const void* p) { return mqf::shared_offset(p); }
