/*
 * cuda_gemm4.h — the opt-in FP8 wgmma prefill MoE of the CUDA backend
 * (kernels/cuda/fast_gemm4.cu): FP4 routed experts decoded to e4m3 in
 * registers (one k32 wgmma per E8M0 group, fp32 group sums scaled by s_w),
 * the FP8 shared expert as stored, activations and h as e4m3 codes with
 * per-128-column power-of-two scales.  Used by the prefill MoE
 * (cuda_fast_gemm_moe, fast_gemm.cu; T > 96 rows) in place of fw_kernel
 * when switched on.  C-callable; only in builds with CUDA.
 */
#ifndef DSV4_KERNELS_CUDA_GEMM4_H
#define DSV4_KERNELS_CUDA_GEMM4_H

#ifdef __cplusplus
extern "C" {
#endif

/*
 * on != 0: MoE calls that reach the prefill GEMM's Hopper path (sm_90, REF
 * numerics, T > 96 rows) take the FP8 wgmma kernels; 0: they keep
 * fw_kernel; -1: back to the environment's choice (DSV4_CUDA_GEMM4=1 or on: used;
 * default: not used).  Process-wide; takes effect for ops queued
 * afterwards.  The two paths round differently (a value may differ in the
 * last bits between them).
 */
void dsv4_cuda_set_gemm4(int on);

#ifdef __cplusplus
}
#endif

#endif
