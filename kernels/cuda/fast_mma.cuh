/*
 * fast_mma.cuh — small helpers of the fast attention and indexer kernels
 * (fast_attention.cu, fast_indexer.cu): bf16 packing and ldmatrix loads of
 * bf16 tiles in shared memory for mma.sync m16n8k16 (fk_mma_bf16, fast.cuh).
 */
#ifndef DSV4_KERNELS_CUDA_FAST_MMA_CUH
#define DSV4_KERNELS_CUDA_FAST_MMA_CUH

#include "kernels/cuda/fast.cuh"

/* bf16 pair (lo in the low half: the lower k index) from two floats, round
 * to nearest even. */
static __device__ __forceinline__ uint32_t
fa_pack(float lo, float hi)
{
    uint32_t r;

    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

/* Four 8x8 b16 matrices from shared memory: lanes 8i..8i+7 give the row
 * addresses of matrix i (16-byte aligned); thread (g, q) receives row g,
 * elements 2q, 2q+1 of each (the mma B fragment of a [n][k] tile). */
static __device__ __forceinline__ void
fa_ldsm_x4(uint32_t (&r)[4], const void *p)
{
    uint32_t a = (uint32_t)__cvta_generic_to_shared(p);

    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

/* The same, transposed: thread (g, q) receives rows 2q, 2q+1 of column g
 * (the mma B fragment of a [k][n] tile). */
static __device__ __forceinline__ void
fa_ldsm_x4_t(uint32_t (&r)[4], const void *p)
{
    uint32_t a = (uint32_t)__cvta_generic_to_shared(p);

    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

#endif
