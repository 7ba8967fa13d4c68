// common.cuh: device helpers shared by every cuflash kernel family.
//
// No CUDA headers are included on purpose: NVRTC finds none by default, and the few things we need
// (16-bit float storage types, conversions, exp2) are one PTX instruction each. That keeps the first
// compile fast and independent of where (or whether) a CUDA toolkit is installed.
#pragma once

namespace cuflash {

// ---------------------------------------------------------------------------------------------
// Storage types. Plain 16-bit containers: arithmetic always happens after conversion to float.
struct alignas(2) fp16_t { unsigned short bits; };
struct alignas(2) bf16_t { unsigned short bits; };

__device__ __forceinline__ float to_float(fp16_t x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
}
__device__ __forceinline__ float to_float(bf16_t x) {
    return __uint_as_float(static_cast<unsigned int>(x.bits) << 16);
}
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ double to_double(double x) { return x; }

// Convert an accumulator value to the storage type, rounding to nearest even.
template <typename T> __device__ __forceinline__ T from_acc(float x);
template <> __device__ __forceinline__ fp16_t from_acc<fp16_t>(float x) {
    fp16_t r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));
    return r;
}
template <> __device__ __forceinline__ bf16_t from_acc<bf16_t>(float x) {
    bf16_t r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));
    return r;
}
template <> __device__ __forceinline__ float from_acc<float>(float x) { return x; }
template <typename T> __device__ __forceinline__ T from_acc(double x);
template <> __device__ __forceinline__ double from_acc<double>(double x) { return x; }

// Load one element of storage type T as the accumulator type.
template <typename Acc, typename T> __device__ __forceinline__ Acc load_acc(const T* p) {
    return static_cast<Acc>(to_float(*p));
}
template <> __device__ __forceinline__ double load_acc<double, double>(const double* p) { return *p; }

// Pack two floats into one 32-bit register of two 16-bit values (low half = a), as mma.sync wants.
template <typename T> __device__ __forceinline__ unsigned int pack2(float a, float b);
template <> __device__ __forceinline__ unsigned int pack2<fp16_t>(float a, float b) {
    unsigned int r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(b), "f"(a));
    return r;
}
template <> __device__ __forceinline__ unsigned int pack2<bf16_t>(float a, float b) {
    unsigned int r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(b), "f"(a));
    return r;
}

// ---------------------------------------------------------------------------------------------
// Math. The generic (audit) kernel uses the accurate library exp2; the tensor-core kernel uses the
// hardware ex2.approx (2 ulp), which is far below the fp16/bf16 rounding of P that follows it.
__device__ __forceinline__ float acc_exp2(float x) { return exp2f(x); }
__device__ __forceinline__ double acc_exp2(double x) { return exp2(x); }
__device__ __forceinline__ float acc_log2(float x) { return log2f(x); }
__device__ __forceinline__ double acc_log2(double x) { return log2(x); }

__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

template <typename Acc> __device__ __forceinline__ Acc neg_inf();
template <> __device__ __forceinline__ float neg_inf<float>() { return __int_as_float(0xff800000); }
template <> __device__ __forceinline__ double neg_inf<double>() {
    return __longlong_as_double(0xfff0000000000000ULL);
}

// alpha = exp2(m_old - m_new) with the guard of the recurrence: a row that has seen only masked
// keys keeps m = -inf, and exp2(-inf - (-inf)) would be NaN. Such a row has l = 0 and O = 0, so any
// finite alpha is right; we use 0.
template <typename Acc> __device__ __forceinline__ Acc rescale_factor(Acc m_old, Acc m_new) {
    return (m_new == neg_inf<Acc>()) ? Acc(0) : acc_exp2(m_old - m_new);
}

// ---------------------------------------------------------------------------------------------
// Warp reductions over all 32 lanes.
template <typename Acc> __device__ __forceinline__ Acc warp_max(Acc x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x = fmax(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}
template <typename Acc> __device__ __forceinline__ Acc warp_sum(Acc x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

// ---------------------------------------------------------------------------------------------
// Launch parameters. Every field is 8 bytes wide so that the host can mirror the layout with a
// NumPy structured dtype without padding rules (cuflash/_launch.py: PARAMS_DTYPE).
// Batch axes are collapsed on the host to at most three (nb0, nb1, nb2); each tensor has an element
// stride per batch axis (0 where it broadcasts) and one per row. The last axis is contiguous.
struct AttnParams {
    const void* q;
    const void* k;
    const void* v;
    void* o;
    float* lse;            // (B, Sq) contiguous, or null when the caller does not want it
    long long sq, sk, d, dv;
    long long nb0, nb1, nb2;
    long long q_s0, q_s1, q_s2, q_sr;
    long long k_s0, k_s1, k_s2, k_sr;
    long long v_s0, v_s1, v_s2, v_sr;
    long long o_s0, o_s1, o_s2, o_sr;
    long long n_mblocks;   // ceil(Sq / BLOCK_M) for the kernel that is launched
    double scale_log2;     // softmax scale * log2(e): scores go straight to exp2
};

// Split a flat batch index into the three collapsed batch axes and return each tensor's offset.
struct BatchOffsets { long long q, k, v, o; };
// The batch count is below 2^31 (the host checks the grid size), so 32-bit division suffices; a
// 64-bit division is a subroutine call whose saved registers show up as spills.
__device__ __forceinline__ BatchOffsets batch_offsets(const AttnParams& p, long long b) {
    const unsigned int ub = static_cast<unsigned int>(b);
    const unsigned int n2 = static_cast<unsigned int>(p.nb2), n1 = static_cast<unsigned int>(p.nb1);
    const long long i2 = ub % n2;
    const unsigned int t = ub / n2;
    const long long i1 = t % n1;
    const long long i0 = t / n1;
    BatchOffsets r;
    r.q = i0 * p.q_s0 + i1 * p.q_s1 + i2 * p.q_s2;
    r.k = i0 * p.k_s0 + i1 * p.k_s1 + i2 * p.k_s2;
    r.v = i0 * p.v_s0 + i1 * p.v_s1 + i2 * p.v_s2;
    r.o = i0 * p.o_s0 + i1 * p.o_s1 + i2 * p.o_s2;
    return r;
}

// Block scheduling shared by the forward kernels: blockIdx.x enumerates (query block, batch) with
// the query blocks in reverse order, so that under a causal mask the blocks with the longest key
// ranges (the last query rows) start first and the short ones fill the tail of the wave.
struct BlockCoord { long long b; long long mblock; };
__device__ __forceinline__ BlockCoord block_coord(const AttnParams& p) {
    const unsigned int nbatch = static_cast<unsigned int>(p.nb0 * p.nb1 * p.nb2);
    const unsigned int flat = blockIdx.x;
    BlockCoord c;
    c.b = flat % nbatch;
    c.mblock = p.n_mblocks - 1 - static_cast<long long>(flat / nbatch);
    return c;
}

// Causal mask, bottom-right aligned (as FlashAttention >= 2.1 and cuDNN): query row i sees key j
// iff j <= i + (Sk - Sq). Returns the number of keys row i sees (<= 0: none).
__device__ __forceinline__ long long causal_keys_visible(long long i, long long sq, long long sk) {
    const long long lim = i + (sk - sq) + 1;
    return lim < sk ? lim : sk;
}

}  // namespace cuflash
