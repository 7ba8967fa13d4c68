// fp16split.cuh: the fp16-split ("3xfp16") operand form of float32 "highest" (notes/FLOAT32.md,
// "fp16 split"), shared by the Hopper kernel (attn_wgmma.cu, OP = fp16_t) and the mma.sync
// kernel (attn_mma.cu, OP = fp16_t): each tile of float32 operands is scaled by a power of two of
// its own and split into fp16 hi + lo parts; three fp16 products with float32 accumulation, the
// factors taken out exactly afterwards.
#pragma once
#include "common.cuh"

namespace cuflash {

// The tile's exponent e from m = max |x| over the tile's finite values: x * 2^e puts m in
// [2^13, 2^14), so hi = fp16(x * 2^e) <= 2^14 and lo = fp16(x * 2^e - hi) stays normal down to
// |x| ~ m * 2^-16. Clamped to [-114, 126] so that 2^e is a normal float and the consumers'
// factors are floats (2^-(eq + ek) in two normal factors, 2^-(P16_LOG2 + ev) >= 2^-133, a
// subnormal power of two where ev > 119); with 2^126 every float32 subnormal is exact in hi + lo
// (a multiple of 2^-23 with at most 23 significant bits), so an all-zero or subnormal tile (126)
// loses nothing either. NaN and inf take no part in m (an inf
// would scale the tile's finite values down to nothing: silently wrong scores for the rows that
// cannot see it); they stay themselves (inf: hi = inf, lo = NaN), so the rows they reach become
// NaN, as in the 3xTF32 form.
// finite_key(x): |x| as an unsigned key that orders the finite values and puts NaN and inf below
// zero's key (2 |bits| + 2^24 wraps them around), FINITE_KEY0 the key of 0.
constexpr unsigned int FINITE_KEY0 = 0x01000000u;
__device__ __forceinline__ unsigned int finite_key(float x) {
    return __float_as_uint(x) * 2u + FINITE_KEY0;
}
__device__ __forceinline__ int split16_exponent(unsigned int key) {  // key: max of finite_key
    const int biased = static_cast<int>((key - FINITE_KEY0) >> 24);
    return min(max(140 - biased, -114), 126);
}
__device__ __forceinline__ float pow2f(int e) {  // 2^e for e in [-149, 127] (subnormal below -126)
    return e >= -126 ? __uint_as_float(static_cast<unsigned int>(e + 127) << 23)
                     : __uint_as_float(1u << (e + 149));
}
// Two fp16 halves of one word as floats (low half first).
__device__ __forceinline__ void unpack_f16x2(unsigned int w, float& a, float& b) {
    asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.f32.f16 %0, l;\ncvt.f32.f16 %1, h;\n}\n"
        : "=f"(a), "=f"(b) : "r"(w));
}
// (a, b) (already scaled) as an fp16 hi word and an fp16 lo word: hi = fp16(x), lo = fp16(x - hi)
// (x - hi is exact in float32).
__device__ __forceinline__ void split16_pair(float a, float b, unsigned int& hi, unsigned int& lo) {
    hi = pack2<fp16_t>(a, b);
    float ha, hb;
    unpack_f16x2(hi, ha, hb);
    lo = pack2<fp16_t>(a - ha, b - hb);
}
// x *= 2^e exactly for e in [-252, 252] (two normal factors when 2^e is not a normal float;
// rounded only where x 2^e is subnormal; e is warp-uniform: one tile's).
template <int N>
__device__ __forceinline__ void scale_pow2(float (&x)[N], int e) {
    if (e >= -126 && e <= 127) {
        const float f = pow2f(e);
#pragma unroll
        for (int i = 0; i < N; ++i) x[i] *= f;
    } else {
        const float f1 = pow2f(e / 2), f2 = pow2f(e - e / 2);
#pragma unroll
        for (int i = 0; i < N; ++i) x[i] = x[i] * f1 * f2;
    }
}
// P (<= 2^RESCALE_LOG2 = 2^8: softmax_step) as fp16 hi and lo A fragments of the k16 P V
// wgmmas, scaled by 2^P16_LOG2 = 2^7 (hi <= 2^15); the layout is pack_p's.
constexpr int P16_LOG2 = 7;
static_assert(P16_LOG2 + static_cast<int>(RESCALE_LOG2) <= 15, "P hi in fp16 range");
template <int NT>
__device__ __forceinline__ void pack_p_f16split(const float (&s)[NT][4],
                                                unsigned int (&hi)[NT / 2][4],
                                                unsigned int (&lo)[NT / 2][4]) {
    constexpr float C = static_cast<float>(1 << P16_LOG2);
#pragma unroll
    for (int kk = 0; kk < NT / 2; ++kk) {
        split16_pair(s[2 * kk][0] * C, s[2 * kk][1] * C, hi[kk][0], lo[kk][0]);
        split16_pair(s[2 * kk][2] * C, s[2 * kk][3] * C, hi[kk][1], lo[kk][1]);
        split16_pair(s[2 * kk + 1][0] * C, s[2 * kk + 1][1] * C, hi[kk][2], lo[kk][2]);
        split16_pair(s[2 * kk + 1][2] * C, s[2 * kk + 1][3] * C, hi[kk][3], lo[kk][3]);
    }
}

}  // namespace cuflash
