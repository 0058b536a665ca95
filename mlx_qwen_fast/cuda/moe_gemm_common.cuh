// Shared by the two builds of the grouped expert GEMM (moe_grouped_gemm.cu,
// mma.sync; moe_grouped_gemm_wgmma.cu, wgmma): one kernel contract
// (moe_grouped_gemm.cu's header), so one parameter list, one launch-bounds
// macro and the bf16 pair packing (prmt lives in ptx.cuh). Include
// after MOE_KIND, NT and the `yt` typedef are defined.
#pragma once
#include "gdn_common.cuh"

__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
  return (unsigned)from_f<bf16_t>(lo).x | ((unsigned)from_f<bf16_t>(hi).x << 16);
}

#ifdef MOE_MINB  // optional register cap: at least MOE_MINB CTAs per SM (the mma build sets it)
#define MOE_LB __launch_bounds__(NT, MOE_MINB)
#else
#define MOE_LB __launch_bounds__(NT)
#endif

// Kernel parameters. MOE_KIND 0 (gate + up + SwiGLU): x, the gate weight
// (w0, s0, b0) and the up weight (w1, s1, b1), bf16 output h. MOE_KIND 1
// (down): h as x, the down weight, the routing scores and the output y (yt).
#if MOE_KIND == 0
#define MOE_SECOND_WEIGHT \
  const unsigned* __restrict__ w1, const bf16_t* __restrict__ s1, const bf16_t* __restrict__ b1,
#define MOE_OUTPUT bf16_t* __restrict__ y,
#else
#define MOE_SECOND_WEIGHT
#define MOE_OUTPUT const float* __restrict__ scores, yt* __restrict__ y,
#endif
// MOE_SHARED 1 (wgmma build only): the shared expert's weights as a second set
// (ws0, ss0, bs0 [, ws1, ss1, bs1]: [O, K/8] / [O, K/64], one expert) after
// the routed ones, and a last scalar `es`: work items of expert id >= es
// read that set (the routing's shared slot carries id es = the routed count).
#ifndef MOE_SHARED
#define MOE_SHARED 0
#endif
#if MOE_SHARED && MOE_KIND == 0
#define MOE_SHARED_WEIGHTS                                                                        \
  const unsigned* __restrict__ ws0, const bf16_t* __restrict__ ss0, const bf16_t* __restrict__ bs0, \
      const unsigned* __restrict__ ws1, const bf16_t* __restrict__ ss1, const bf16_t* __restrict__ bs1,
#elif MOE_SHARED
#define MOE_SHARED_WEIGHTS \
  const unsigned* __restrict__ ws0, const bf16_t* __restrict__ ss0, const bf16_t* __restrict__ bs0,
#else
#define MOE_SHARED_WEIGHTS
#endif
#if MOE_SHARED
#define MOE_SHARED_SCALAR , int es
#else
#define MOE_SHARED_SCALAR
#endif
#define MOE_GEMM_PARAMS                                                                        \
  const bf16_t* __restrict__ x, const unsigned* __restrict__ w0, const bf16_t* __restrict__ s0, \
      const bf16_t* __restrict__ b0, MOE_SECOND_WEIGHT MOE_SHARED_WEIGHTS const int* __restrict__ order, \
      const int* __restrict__ offsets, const int* __restrict__ bmap, MOE_OUTPUT int K, int O,   \
      int topk MOE_SHARED_SCALAR
