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
// LOG2: the scale's exponent (the backward's P <= 1 takes 2^BWD_P16_LOG2, its dS, already
// scaled by its own exponent, 2^0).
template <int NT, int LOG2 = P16_LOG2>
__device__ __forceinline__ void pack_p_f16split(const float (&s)[NT][4],
                                                unsigned int (&hi)[NT / 2][4],
                                                unsigned int (&lo)[NT / 2][4]) {
    static_assert(LOG2 >= 0 && LOG2 <= 15, "a scale 2^LOG2 that keeps hi in fp16 range");
    constexpr float C = static_cast<float>(1 << LOG2);
#pragma unroll
    for (int kk = 0; kk < NT / 2; ++kk) {
        split16_pair(s[2 * kk][0] * C, s[2 * kk][1] * C, hi[kk][0], lo[kk][0]);
        split16_pair(s[2 * kk][2] * C, s[2 * kk][3] * C, hi[kk][1], lo[kk][1]);
        split16_pair(s[2 * kk + 1][0] * C, s[2 * kk + 1][1] * C, hi[kk][2], lo[kk][2]);
        split16_pair(s[2 * kk + 1][2] * C, s[2 * kk + 1][3] * C, hi[kk][3], lo[kk][3]);
    }
}

// A float32 tile of ROWS rows (row stride STRIDE words, CHUNKS 16-byte chunks a row) that this
// block copied with load_tile, rewritten in place as fp16 hi and lo halves of x 2^e per row
// (attn_mma.cu: Mma16SplitOps; attn_bwd_mma.cu: BwdMmaSplitOps), e the tile's exponent
// (split16_exponent) returned in `e`.
// Each thread reads the chunks it copied itself (load_tile's chunk i = tid + n THREADS), which
// its cp_async_wait made visible to it: no barrier before the reads. The tile's max then takes a
// warp reduction, one word per warp at `red` and one block barrier, which also orders every
// thread's reads before any thread's in-place writes (a row's hi half covers other threads'
// float32 chunks). With `scan`, the barrier also returns whether rows [scan_from, ROWS) hold a
// NaN or an infinity (tile_has_nonfinite's answer, over the same chunks); such a tile is left as
// float32 for pv_visible_keys. The caller puts a barrier between the writes and the first reads
// of the hi and lo rows, and one between the reads of `red` and its next use.
template <int ROWS, int CHUNKS, int STRIDE, int THREADS>
__device__ __forceinline__ bool split16_block(float* tile, unsigned int* red, int tid, int& e,
                                              bool scan, int scan_from) {
    constexpr int N = (ROWS * CHUNKS + THREADS - 1) / THREADS;
    float4 x[N];
    unsigned int mx = FINITE_KEY0;
    bool bad = false;
#pragma unroll
    for (int n = 0; n < N; ++n) {
        const int i = tid + n * THREADS;
        if (ROWS * CHUNKS % THREADS == 0 || i < ROWS * CHUNKS) {
            x[n] = *reinterpret_cast<const float4*>(tile + (i / CHUNKS) * STRIDE +
                                                    (i % CHUNKS) * 4);
            mx = max(mx, max(max(finite_key(x[n].x), finite_key(x[n].y)),
                             max(finite_key(x[n].z), finite_key(x[n].w))));
            if (scan && i / CHUNKS >= scan_from)
                bad = bad || nonfinite_word<float>(__float_as_uint(x[n].x)) ||
                      nonfinite_word<float>(__float_as_uint(x[n].y)) ||
                      nonfinite_word<float>(__float_as_uint(x[n].z)) ||
                      nonfinite_word<float>(__float_as_uint(x[n].w));
        }
    }
    mx = __reduce_max_sync(0xffffffffu, mx);
    if (tid % 32 == 0) red[tid / 32] = mx;
    if (scan)
        bad = __syncthreads_or(bad) != 0;
    else
        __syncthreads();
#pragma unroll
    for (int w = 0; w < THREADS / 32; ++w) mx = max(mx, red[w]);
    e = split16_exponent(mx);
    if (bad) return true;
    const float sc = pow2f(e);
    unsigned char* base = reinterpret_cast<unsigned char*>(tile);
#pragma unroll
    for (int n = 0; n < N; ++n) {
        const int i = tid + n * THREADS;
        if (ROWS * CHUNKS % THREADS == 0 || i < ROWS * CHUNKS) {
            unsigned int h0, h1, l0, l1;
            split16_pair(x[n].x * sc, x[n].y * sc, h0, l0);
            split16_pair(x[n].z * sc, x[n].w * sc, h1, l1);
            unsigned char* row = base + (i / CHUNKS) * STRIDE * 4 + (i % CHUNKS) * 8;
            *reinterpret_cast<uint2*>(row) = make_uint2(h0, h1);
            *reinterpret_cast<uint2*>(row + CHUNKS * 8) = make_uint2(l0, l1);
        }
    }
    return false;
}

}  // namespace cuflash
