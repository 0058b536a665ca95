// Every inline-PTX instruction of the package's kernels, as a named helper
// with two bodies: the GPU's (the asm, what NVRTC and nvcc compile) and,
// under MQF_CPU_CHECK (tests/cuda_check.py, which runs the kernels on the
// CPU), a C++ body with the instruction's semantics from the PTX ISA
// (docs.nvidia.com/cuda/parallel-thread-execution). The CPU bodies use the
// checker's runtime (tests/cuda_shim.h: namespace mqf): warp_allgather for
// the warp-wide instructions, shared_pointer for shared-memory addresses,
// the cp.async group bookkeeping. Kernels use no asm of their own.
//
// Numerics of the CPU bodies: conversions and bf16x2 arithmetic round
// exactly as the ISA says (round to nearest even, NaN to the canonical NaN);
// mma accumulates exact products in double and rounds once to fp32 (the
// tensor cores' fp32 sum order is unspecified).
#pragma once

#ifdef MQF_CPU_CHECK
namespace mqf_ptx {
inline unsigned short bf16_rn(float f) {
  unsigned u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fff;
  return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline float bf16_f(unsigned short h) { return __uint_as_float(unsigned(h) << 16); }
inline unsigned short f16_rn(float f) {
  if (f != f) return 0x7fff;
  return std::bit_cast<unsigned short>(static_cast<_Float16>(f));
}
inline float f16_f(unsigned short h) { return float(std::bit_cast<_Float16>(h)); }
// x = hi + lo (exactly; |lo| at most half of hi's last place) rounded to
// float with round-to-odd: composes with a later round-to-nearest to a
// format of at most 22 bits (bf16) without double rounding.
inline float to_float_odd(double hi, double lo) {
  const float f = float(hi);
  if (std::isinf(f)) return f;
  const double rem = (hi - double(f)) + lo;  // sign and zero-ness exact
  if (rem == 0.0) return f;
  float t;  // x truncated toward zero
  if (f == 0.0f) t = std::copysign(0.0f, float(rem));
  else t = ((rem > 0) == (f > 0)) ? f : std::nextafter(f, 0.0f);
  return __uint_as_float(__float_as_uint(t) | 1u);
}
// a + b (doubles holding bf16 values or their exact products) rounded once to bf16.
inline unsigned short bf16_sum_rn(double a, double b) {
  const double s = a + b;
  const double bb = s - a;
  const double err = (a - (s - bb)) + (b - bb);  // TwoSum: a + b = s + err exactly
  if (s != s) return 0x7fff;
  if (std::isinf(s)) return bf16_rn(float(s));
  return bf16_rn(to_float_odd(s, err));
}
}  // namespace mqf_ptx
#endif

// ---- conversions ------------------------------------------------------------------------

// cvt.f32.f16: a half's bits to fp32 (exact).
__device__ __forceinline__ float cvt_f32_f16(unsigned short h) {
#ifndef MQF_CPU_CHECK
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#else
  return mqf_ptx::f16_f(h);
#endif
}
// cvt.rn.bf16.f32: to bf16 bits, round to nearest even.
__device__ __forceinline__ unsigned short cvt_rn_bf16_f32(float v) {
#ifndef MQF_CPU_CHECK
  unsigned short r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(v));
  return r;
#else
  return mqf_ptx::bf16_rn(v);
#endif
}
// cvt.rn.f16.f32: to half bits, round to nearest even.
__device__ __forceinline__ unsigned short cvt_rn_f16_f32(float v) {
#ifndef MQF_CPU_CHECK
  unsigned short r;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(v));
  return r;
#else
  return mqf_ptx::f16_rn(v);
#endif
}
// cvt.rn.bf16x2.f32 d, hi, lo: bf16(hi) in the upper half, bf16(lo) in the lower.
__device__ __forceinline__ unsigned cvt_rn_bf16x2_f32(float hi, float lo) {
#ifndef MQF_CPU_CHECK
  unsigned r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
#else
  return (unsigned(mqf_ptx::bf16_rn(hi)) << 16) | mqf_ptx::bf16_rn(lo);
#endif
}
// cvt.rn.f16x2.f32 d, hi, lo: as cvt_rn_bf16x2_f32, to halves.
__device__ __forceinline__ unsigned cvt_rn_f16x2_f32(float hi, float lo) {
#ifndef MQF_CPU_CHECK
  unsigned r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
#else
  return (unsigned(mqf_ptx::f16_rn(hi)) << 16) | mqf_ptx::f16_rn(lo);
#endif
}

// ---- integer and bf16x2 arithmetic ------------------------------------------------------------

// prmt.b32 (default mode): byte i of the result is byte (sel >> 4i) & 7 of
// {b, a} (a the low four), sign-replicated when bit 3 of that nibble is set.
__device__ __forceinline__ unsigned prmt(unsigned a, unsigned b, unsigned sel) {
#ifndef MQF_CPU_CHECK
  unsigned d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
#else
  const unsigned long long x = (unsigned long long)b << 32 | a;
  unsigned d = 0;
  for (int i = 0; i < 4; i++) {
    const unsigned s = (sel >> (4 * i)) & 0xfu;
    unsigned byte = unsigned(x >> (8 * (s & 7u))) & 0xffu;
    if (s & 8u) byte = (byte & 0x80u) ? 0xffu : 0u;
    d |= byte << (8 * i);
  }
  return d;
#endif
}
// lop3.b32 with lookup table 0xEA: (a & b) | c.
__device__ __forceinline__ unsigned lop3_and_or(unsigned a, unsigned b, unsigned c) {
#ifndef MQF_CPU_CHECK
  unsigned d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
#else
  return (a & b) | c;
#endif
}
// sub.rn.bf16x2: per half, a - b rounded once to bf16.
__device__ __forceinline__ unsigned sub_rn_bf16x2(unsigned a, unsigned b) {
#ifndef MQF_CPU_CHECK
  unsigned d;
  asm("sub.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
#else
  unsigned d = 0;
  for (int h = 0; h < 2; h++) {
    const double x = mqf_ptx::bf16_f((unsigned short)(a >> (16 * h))), y = mqf_ptx::bf16_f((unsigned short)(b >> (16 * h)));
    d |= unsigned(mqf_ptx::bf16_sum_rn(x, -y)) << (16 * h);
  }
  return d;
#endif
}
// fma.rn.bf16x2: per half, a * b + c rounded once to bf16.
__device__ __forceinline__ unsigned fma_rn_bf16x2(unsigned a, unsigned b, unsigned c) {
#ifndef MQF_CPU_CHECK
  unsigned d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
#else
  unsigned d = 0;
  for (int h = 0; h < 2; h++) {
    auto half = [&](unsigned w) { return double(mqf_ptx::bf16_f((unsigned short)(w >> (16 * h)))); };
    d |= unsigned(mqf_ptx::bf16_sum_rn(half(a) * half(b), half(c))) << (16 * h);  // the product is exact
  }
  return d;
#endif
}

// ---- global loads through the non-coherent path (ld.global.nc) ------------------------------

// ld.global.nc.L1::no_allocate.v4.u32: 16 bytes, not kept in L1 (streamed weights).
__device__ __forceinline__ uint4 ldg_stream16(const void* p) {
#ifndef MQF_CPU_CHECK
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p));
  return r;
#else
  return *static_cast<const uint4*>(p);
#endif
}
// ld.global.nc.u16.
__device__ __forceinline__ unsigned ldg_u16(const void* p) {
#ifndef MQF_CPU_CHECK
  unsigned short r;
  asm("ld.global.nc.u16 %0, [%1];" : "=h"(r) : "l"(p));
  return r;
#else
  return *static_cast<const unsigned short*>(p);
#endif
}
// ld.global.nc.v4.u32.
__device__ __forceinline__ uint4 ldg16(const void* p) {
#ifndef MQF_CPU_CHECK
  uint4 r;
  asm("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p));
  return r;
#else
  return *static_cast<const uint4*>(p);
#endif
}

// ---- asynchronous global -> shared copies (cp.async, sm_80+) ------------------------------

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return (unsigned)__cvta_generic_to_shared(p);
}
// cp.async.cg.shared.global, 16 bytes (L2 only).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
#ifndef MQF_CPU_CHECK
  asm volatile(
      "cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(smem)),
      "l"(gmem));
#else
  mqf::cp_async(smem_addr(smem), gmem, 16, 16, "cp.async (16 bytes)");
#endif
}
// cp.async.ca.shared.global, 8 bytes.
__device__ __forceinline__ void cp_async8(void* smem, const void* gmem) {
#ifndef MQF_CPU_CHECK
  asm volatile(
      "cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(smem_addr(smem)),
      "l"(gmem));
#else
  mqf::cp_async(smem_addr(smem), gmem, 8, 8, "cp.async (8 bytes)");
#endif
}
// cp.async.ca.shared.global, 4 bytes.
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
#ifndef MQF_CPU_CHECK
  asm volatile(
      "cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_addr(smem)),
      "l"(gmem));
#else
  mqf::cp_async(smem_addr(smem), gmem, 4, 4, "cp.async (4 bytes)");
#endif
}
// cp.async.commit_group: the thread's copies issued since the last commit form a group.
__device__ __forceinline__ void cp_async_commit() {
#ifndef MQF_CPU_CHECK
  asm volatile("cp.async.commit_group;\n" ::);
#else
  mqf::cp_async_commit();
#endif
}
// cp.async.wait_group 0: every committed group of the thread is complete.
__device__ __forceinline__ void cp_async_wait_all() {
#ifndef MQF_CPU_CHECK
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
#else
  mqf::cp_async_wait(0);
#endif
}
// 16-byte copy to a shared address with zero fill: src_bytes 16 copies, 0 writes zeros.
__device__ __forceinline__ void cp_async16_zfill(unsigned dst, const void* src, unsigned src_bytes) {
#ifndef MQF_CPU_CHECK
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
#else
  mqf::cp_async(dst, src, 16, src_bytes, "cp.async (16 bytes, zero fill)");
#endif
}
// cp.async.wait_group N: at most N of this thread's committed groups are in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#ifndef MQF_CPU_CHECK
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#else
  mqf::cp_async_wait(N);
#endif
}

// ---- tensor cores: mma.sync and ldmatrix (warp-wide: all 32 lanes) ------------------------

#ifdef MQF_CPU_CHECK
namespace mqf_ptx {
// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}: the fragment layouts of
// the ISA's "Matrix Fragments for mma.m16n8k16" (g = lane / 4, t = lane % 4):
// A 16x16: a0 (g, 2t..2t+1), a1 (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..);
// B 16x8:  b0 (2t..2t+1, g), b1 (2t+8..2t+9, g); C, D 16x8: c0 (g, 2t),
// c1 (g, 2t+1), c2 (g+8, 2t), c3 (g+8, 2t+1). Low half = lower index.
template <bool F16>
inline void mma_m16n8k16(float* c, const unsigned* a, unsigned b0, unsigned b1, const std::source_location& site) {
  struct Frag {
    unsigned a[4], b[2];
  } mine{{a[0], a[1], a[2], a[3]}, {b0, b1}};
  Frag all[32];
  mqf::warp_allgather(0xffffffffu, &mine, sizeof mine, all, "mma.sync.m16n8k16", site);
  auto val = [](unsigned w, int hi) {
    const unsigned short h = (unsigned short)(w >> (16 * hi));
    return F16 ? double(f16_f(h)) : double(bf16_f(h));
  };
  double A[16][16], B[16][8];
  for (int L = 0; L < 32; L++) {
    const int g = L >> 2, t = L & 3;
    for (int hi = 0; hi < 2; hi++) {
      A[g][2 * t + hi] = val(all[L].a[0], hi);
      A[g + 8][2 * t + hi] = val(all[L].a[1], hi);
      A[g][2 * t + 8 + hi] = val(all[L].a[2], hi);
      A[g + 8][2 * t + 8 + hi] = val(all[L].a[3], hi);
      B[2 * t + hi][g] = val(all[L].b[0], hi);
      B[2 * t + 8 + hi][g] = val(all[L].b[1], hi);
    }
  }
  const int L = int(mqf::cur->lane), g = L >> 2, t = L & 3;
  const int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
  for (int i = 0; i < 4; i++) {
    double s = c[i];
    for (int k = 0; k < 16; k++) s += A[rows[i]][k] * B[k][cols[i]];
    c[i] = float(s);
  }
}
// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: lanes 8i..8i+7 give the
// 16-byte row addresses of matrix i; lane L receives from each matrix i the
// pair (row L/4, cols 2(L%4), +1), or with .trans (rows 2(L%4), +1, col L/4).
template <bool TRANS>
inline void ldmatrix_x4(unsigned addr, unsigned* r, const std::source_location& site) {
  unsigned all[32];
  mqf::warp_allgather(0xffffffffu, &addr, sizeof addr, all, TRANS ? "ldmatrix.x4.trans" : "ldmatrix.x4", site);
  const int L = int(mqf::cur->lane);
  for (int i = 0; i < 4; i++) {
    auto row = [&](int j) {
      const unsigned a = all[8 * i + j];
      if (a % 16) mqf::fail("ldmatrix at " + mqf::site_str(site) + ": row address of lane " + std::to_string(8 * i + j) + " is not 16-byte aligned");
      return reinterpret_cast<const unsigned short*>(mqf::shared_pointer(a, 16, "ldmatrix"));
    };
    unsigned short lo, hi;
    if (!TRANS) {
      const unsigned short* p = row(L / 4);
      lo = p[2 * (L % 4)], hi = p[2 * (L % 4) + 1];
    } else {
      lo = row(2 * (L % 4))[L / 4], hi = row(2 * (L % 4) + 1)[L / 4];
    }
    r[i] = unsigned(lo) | unsigned(hi) << 16;
  }
}
}  // namespace mqf_ptx
#define MQF_PTX_SITE , std::source_location mqf_site = std::source_location::current()
#else
#define MQF_PTX_SITE
#endif

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32: c += a b (volatile asm).
__device__ __forceinline__ void mma_bf16_m16n8k16(float* c, const unsigned* a, unsigned b0, unsigned b1 MQF_PTX_SITE) {
#ifndef MQF_CPU_CHECK
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  mqf_ptx::mma_m16n8k16<false>(c, a, b0, b1, mqf_site);
#endif
}
// The same, not volatile: the compiler may move it past neighbouring volatile
// asm (an ldmatrix of the next slice), so shared-memory loads run ahead.
__device__ __forceinline__ void mma_bf16_m16n8k16_nv(float* c, const unsigned* a, unsigned b0, unsigned b1 MQF_PTX_SITE) {
#ifndef MQF_CPU_CHECK
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  mqf_ptx::mma_m16n8k16<false>(c, a, b0, b1, mqf_site);
#endif
}
// mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32, not volatile.
__device__ __forceinline__ void mma_f16_m16n8k16_nv(float* c, const unsigned* a, unsigned b0, unsigned b1 MQF_PTX_SITE) {
#ifndef MQF_CPU_CHECK
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  mqf_ptx::mma_m16n8k16<true>(c, a, b0, b1, mqf_site);
#endif
}
// ldmatrix.sync.aligned.m8n8.x4.shared.b16 at shared address addr (this lane's row).
__device__ __forceinline__ void ldmatrix_x4(unsigned addr, unsigned* r MQF_PTX_SITE) {
#ifndef MQF_CPU_CHECK
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
#else
  mqf_ptx::ldmatrix_x4<false>(addr, r, mqf_site);
#endif
}
// ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16: each matrix transposed on the way.
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned addr, unsigned* r MQF_PTX_SITE) {
#ifndef MQF_CPU_CHECK
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
#else
  mqf_ptx::ldmatrix_x4<true>(addr, r, mqf_site);
#endif
}


// ---- warpgroup tensor cores (wgmma, sm_90a) ----------------------------------------------

#ifdef MQF_CPU_CHECK
namespace mqf_ptx {
// wgmma.mma_async.sync.aligned.m64nNk16.f32.bf16.bf16 with A from registers
// and B from shared memory through a matrix descriptor, scale-a = scale-b =
// 1, B not transposed (K-major). A 64x16: warp w of the warpgroup holds rows
// 16w..16w+15 in mma.m16n8k16's A layout. D 64xN: warp w's rows, n8 block j
// in d[4j..4j+3] as mma.m16n8k16's C. B: the descriptor's start address
// (bits 0-13, >> 4), stride byte offset between 8-row groups (bits 32-45,
// >> 4) and layout type (bits 62-63; 1 = 128-byte swizzle, the only one
// simulated): element (k, n) at start + (n / 8) SBO + (n % 8) 128 + 2k, the
// address's bits 4-6 XORed with its bits 7-9. scale_d 0: D = A B.
// Each warp computes its own 16 rows (the warpgroup's four issue together on
// the GPU). The product joins the thread's open wgmma group
// (cuda_shim.h: async_issue), computed at once in schedule 0, at the wait
// in schedule 1: shared memory read between issue and wait is checked.
template <int N>
inline void wgmma_m64k16(float* d, const unsigned* a, unsigned long long desc, int scale_d,
                         const std::source_location& site) {
  struct Frag {
    unsigned a[4];
  } mine{{a[0], a[1], a[2], a[3]}}, all[32];
  mqf::warp_allgather(0xffffffffu, &mine, sizeof mine, all, "wgmma.mma_async", site);
  if ((desc >> 62) != 1) mqf::fail("wgmma at " + mqf::site_str(site) + ": only the 128-byte swizzle layout is simulated");
  if ((desc >> 49) & 7) mqf::fail("wgmma at " + mqf::site_str(site) + ": a descriptor base offset is not simulated");
  auto A = std::make_shared<std::array<double, 256>>();
  for (int L = 0; L < 32; L++) {
    const int g = L >> 2, t = L & 3;
    for (int hi = 0; hi < 2; hi++) {
      auto v = [&](int r) { return double(bf16_f((unsigned short)(all[L].a[r] >> (16 * hi)))); };
      (*A)[g * 16 + 2 * t + hi] = v(0);
      (*A)[(g + 8) * 16 + 2 * t + hi] = v(1);
      (*A)[g * 16 + 2 * t + 8 + hi] = v(2);
      (*A)[(g + 8) * 16 + 2 * t + 8 + hi] = v(3);
    }
  }
  const unsigned start = unsigned(desc & 0x3fffu) << 4, sbo = unsigned((desc >> 32) & 0x3fffu) << 4;
  const int lane = int(mqf::cur->lane);
  mqf::async_issue([=] {
    const int g = lane >> 2, t = lane & 3;
    for (int j = 0; j < N / 8; j++)
      for (int e = 0; e < 4; e++) {
        const int row = g + 8 * (e >> 1), n = 8 * j + 2 * t + (e & 1);
        double s = scale_d ? double(d[4 * j + e]) : 0.0;
        for (int k = 0; k < 16; k++) {
          const unsigned lin = start + unsigned(n / 8) * sbo + unsigned(n % 8) * 128u + 2u * unsigned(k);
          const unsigned phys = lin ^ (((lin >> 7) & 7u) << 4);
          const unsigned short b = *reinterpret_cast<const unsigned short*>(mqf::shared_pointer(phys, 2, "wgmma B operand"));
          s += (*A)[row * 16 + k] * double(bf16_f(b));
        }
        d[4 * j + e] = float(s);
      }
  });
}
}  // namespace mqf_ptx
#endif

// D[64 x N] = A[64 x 16] (registers) * B[16 x N] (shared memory, K-major,
// 128-byte swizzle) + (scale_d ? D : 0); N = 32, 64, 128. scale_d 0 starts
// an accumulation without writing the accumulator registers first (a write
// between wgmmas makes ptxas wait for every wgmma in flight).
__device__ __forceinline__ void wgmma_n32(float* d, const unsigned* a, unsigned long long desc_b, int scale_d MQF_PTX_SITE) {
#ifndef MQF_CPU_CHECK
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
      "{%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
#else
  mqf_ptx::wgmma_m64k16<32>(d, a, desc_b, scale_d, mqf_site);
#endif
}

__device__ __forceinline__ void wgmma_n64(float* d, const unsigned* a, unsigned long long desc_b, int scale_d MQF_PTX_SITE) {
#ifndef MQF_CPU_CHECK
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
#else
  mqf_ptx::wgmma_m64k16<64>(d, a, desc_b, scale_d, mqf_site);
#endif
}

__device__ __forceinline__ void wgmma_n128(float* d, const unsigned* a, unsigned long long desc_b, int scale_d MQF_PTX_SITE) {
#ifndef MQF_CPU_CHECK
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "{%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
#else
  mqf_ptx::wgmma_m64k16<128>(d, a, desc_b, scale_d, mqf_site);
#endif
}

// wgmma.fence: register and shared-memory writes before it are seen by the next wgmma.
__device__ __forceinline__ void wgmma_fence() {
#ifndef MQF_CPU_CHECK
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#else
#endif
}

// wgmma.commit_group: the wgmmas issued since the last commit form a group.
__device__ __forceinline__ void wgmma_commit() {
#ifndef MQF_CPU_CHECK
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#else
  mqf::async_commit();
#endif
}

// wgmma.wait_group N: at most N of this thread's committed groups are in flight.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#ifndef MQF_CPU_CHECK
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#else
  mqf::async_wait(N);
#endif
}

// Keeps the compiler from touching an accumulator across an asynchronous wgmma.
__device__ __forceinline__ void fence_acc(float& v) {
#ifndef MQF_CPU_CHECK
  asm volatile("" : "+f"(v)::"memory");
#else
  (void)v;
#endif
}

// Generic-proxy shared-memory writes (cp.async) made visible to wgmma reads.
__device__ __forceinline__ void fence_proxy_async() {
#ifndef MQF_CPU_CHECK
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#else
#endif
}

// ---- grid-wide exchange: release/acquire on a global counter (grid_sync.cuh) ---------------

// nanosleep.u32: suspend the thread for about ns nanoseconds (a poll's back-off).
__device__ __forceinline__ void sleep_ns(unsigned ns MQF_PTX_SITE) {
#ifndef MQF_CPU_CHECK
  asm volatile("nanosleep.u32 %0;\n" ::"r"(ns));
#else
  (void)ns;
  mqf::spin_yield(mqf_site);  // other threads run: the polled memory may change
#endif
}
// ld.acquire.gpu.global.u64.
__device__ __forceinline__ unsigned long long ld_acquire_u64(const unsigned long long* p) {
#ifndef MQF_CPU_CHECK
  unsigned long long v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];\n" : "=l"(v) : "l"(p) : "memory");
  return v;
#else
  return *p;
#endif
}
// ld.relaxed.gpu.global.u64.
__device__ __forceinline__ unsigned long long ld_relaxed_u64(const unsigned long long* p) {
#ifndef MQF_CPU_CHECK
  unsigned long long v;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];\n" : "=l"(v) : "l"(p) : "memory");
  return v;
#else
  return *p;
#endif
}
// red.release.gpu.global.add.u64: *p += v, ordered after this thread's earlier writes.
__device__ __forceinline__ void red_release_add_u64(unsigned long long* p, unsigned long long v) {
#ifndef MQF_CPU_CHECK
  asm volatile("red.release.gpu.global.add.u64 [%0], %1;\n" ::"l"(p), "l"(v) : "memory");
#else
  *p += v;
#endif
}
// atom.acquire.gpu.global.cas.b64: if *p == cmp then *p = v; returns the old value, ordering
// this thread's later accesses after the writes that the value it read releases.
__device__ __forceinline__ unsigned long long atom_cas_acquire_u64(unsigned long long* p, unsigned long long cmp,
                                                                   unsigned long long v) {
#ifndef MQF_CPU_CHECK
  unsigned long long o;
  asm volatile("atom.acquire.gpu.global.cas.b64 %0, [%1], %2, %3;\n" : "=l"(o) : "l"(p), "l"(cmp), "l"(v) : "memory");
  return o;
#else
  const unsigned long long o = *p;
  if (o == cmp) *p = v;
  return o;
#endif
}
// st.release.gpu.global.u64: *p = v, ordered after this thread's earlier accesses.
__device__ __forceinline__ void st_release_u64(unsigned long long* p, unsigned long long v) {
#ifndef MQF_CPU_CHECK
  asm volatile("st.release.gpu.global.u64 [%0], %1;\n" ::"l"(p), "l"(v) : "memory");
#else
  *p = v;
#endif
}
// The launch's tag: %gridid + 1 (PTX ISA: the grid's temporal identifier, distinct for every
// launch of the context), so never 0. CUDA check: 1 (it runs one launch per process).
__device__ __forceinline__ unsigned long long grid_tag() {
#ifndef MQF_CPU_CHECK
  unsigned long long v;
  asm volatile("mov.u64 %0, %%gridid;\n" : "=l"(v));
  return v + 1;
#else
  return 1;
#endif
}
// ld.global.cg.f32: through L2 only (data other CTAs wrote in this launch).
__device__ __forceinline__ float ldcg_f(const float* p) {
#ifndef MQF_CPU_CHECK
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
#else
  return *p;
#endif
}

// ld.global.cg.u16: through L2 only (data other CTAs wrote in this launch).
__device__ __forceinline__ unsigned ldcg_u16(const void* p) {
#ifndef MQF_CPU_CHECK
  unsigned short v;
  asm volatile("ld.global.cg.u16 %0, [%1];" : "=h"(v) : "l"(p));
  return v;
#else
  return *static_cast<const unsigned short*>(p);
#endif
}
// ld.global.cg.v4.u32: 16 bytes through L2 only (data other CTAs wrote in this launch).
__device__ __forceinline__ uint4 ldcg16(const void* p) {
#ifndef MQF_CPU_CHECK
  uint4 r;
  asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
#else
  return *static_cast<const uint4*>(p);
#endif
}

// ---- mbarriers and TMA bulk copies into shared memory (sm_90) ----------------------------
// CPU: an mbarrier's 8 bytes hold {pending arrivals (bits 0-15), expected
// arrivals (16-30), phase (31)} and the transaction bytes still expected;
// a bulk copy lands at once (in both schedules) and completes its bytes.

#ifdef MQF_CPU_CHECK
namespace mqf_ptx {
inline unsigned* mbar(unsigned bar) { return reinterpret_cast<unsigned*>(mqf::shared_pointer(bar, 8, "mbarrier")); }
inline void mbar_complete_if_done(unsigned* m) {
  if ((m[0] & 0xffffu) == 0 && m[1] == 0) m[0] = ((m[0] ^ 0x80000000u) & 0xffff0000u) | ((m[0] >> 16) & 0x7fffu);
}
}  // namespace mqf_ptx
#endif

// mbarrier.init.shared::cta.b64: count arrivals per phase, phase 0.
__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
#ifndef MQF_CPU_CHECK
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
#else
  if (count == 0 || count > 0x7fffu) mqf::fail("mbar_init: count " + std::to_string(count) + " out of range");
  unsigned* m = mqf_ptx::mbar(bar);
  m[0] = count | (count << 16);
  m[1] = 0;
#endif
}
// mbarrier.arrive.expect_tx: expect `bytes` more transaction bytes, then arrive.
__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
#ifndef MQF_CPU_CHECK
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
#else
  unsigned* m = mqf_ptx::mbar(bar);
  if ((m[0] & 0xffffu) == 0) mqf::fail("mbarrier arrive: more arrivals than its count in this phase");
  m[1] += bytes;
  m[0] -= 1;
  mqf_ptx::mbar_complete_if_done(m);
#endif
}
// mbarrier.try_wait.parity in a loop: until the phase of parity `parity` completed.
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity MQF_PTX_SITE) {
#ifndef MQF_CPU_CHECK
  asm volatile(
      "{\n .reg .pred p;\n WAIT_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      " @!p bra WAIT_%=;\n}\n" ::"r"(bar), "r"(parity) : "memory");
#else
  while ((mqf_ptx::mbar(bar)[0] >> 31) == (parity & 1u)) mqf::spin_yield(mqf_site);
#endif
}
// cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes: bytes (a
// multiple of 16; both addresses 16-byte aligned) completing on mbarrier bar.
__device__ __forceinline__ void bulk_g2s(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
#ifndef MQF_CPU_CHECK
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
#else
  if (bytes % 16 || dst % 16 || reinterpret_cast<uintptr_t>(src) % 16)
    mqf::fail("bulk_g2s: size and addresses must be multiples of 16 bytes");
  std::memcpy(mqf::shared_pointer(dst, bytes, "bulk_g2s"), src, bytes);
  unsigned* m = mqf_ptx::mbar(bar);
  m[1] -= bytes;
  mqf_ptx::mbar_complete_if_done(m);
#endif
}

// ---- special registers -------------------------------------------------------------------

// %dynamic_smem_size: the dynamic shared memory the launch gave the block, in bytes.
__device__ __forceinline__ unsigned dynamic_smem_size() {
#ifndef MQF_CPU_CHECK
  unsigned dyn;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
  return dyn;
#else
  return unsigned(mqf::dyn_smem_request);
#endif
}
