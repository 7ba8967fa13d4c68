// variants.cuh: attention variants as one compile-time policy (issue 15).
//
// A kernel takes the variant as a template parameter `V` (a `Variant<...>`), built from parts
// that compose into one type: window, softcap, ALiBi, an additive bias tensor (of any float
// storage type) and a boolean mask tensor. Semantics (cuflash/variants.py, the one definition):
// for query row i, key j, off = Sk - Sq and t = scale * q_i . k_j,
//   score   = (softcap ? c tanh(t / c) : t) - slope * |i + off - j| + bias[i, j]
//   visible = window: i + off - left <= j <= i + off + right   (-1: unbounded)
//             and mask[i, j]                                   (causal stays the kernel's CAUSAL)
// The plain policy `PlainVariant` has every part off: every member is a constant the compiler
// folds away, so a kernel instantiated with it generates the code it had before policies existed.
//
// Interface (what a kernel calls; `b` = the bound batch entry, see bind()):
//   V::PLAIN, V::MASKS (some key may be invisible beyond causal), V::READS (reads tensors per
//   element: rows past Sq / keys past Sk must not call score()/visible())
//   bind(vp, i0, i1, i2)            the collapsed batch coordinates of the block's entry
//   visible(q_idx, kv_idx)          window and mask
//   score(t, q_idx, kv_idx)         the transform of the scaled score t
//   score_tc<FAST>(t, i, j, dist)   the same in float32 for the tensor-core kernels (dist =
//                                    i + off - j as a float; FAST: softcap through softcap_fast)
//   dscore(t)                       d score / d t (softcap: 1 - tanh^2(t / c); else 1)
//   key_range(r0, r1, sq, sk, &j0, &j1)   keys [j0, j1) rows [r0, r1) can see by position
//   row_range(j0, j1, sq, sk, &r0, &r1)   rows [r0, r1) that can see keys [j0, j1) by position
//   tile_kind(r0, r1, j0, j1)       TILE_EMPTY / TILE_FULL / TILE_PARTIAL (by position; with a
//                                    mask tensor FULL only where its block summary says every
//                                    entry of the tile's blocks is kept, else PARTIAL, never
//                                    EMPTY: mask_blocks.cu)
// Parameters live in `VariantParams`, a separate kernel argument after AttnParams / BwdParams
// (their layouts stay as they are), mirrored by VARIANT_PARAMS_DTYPE in cuflash/_launch.py.
#pragma once
#include "common.cuh"

namespace cuflash {

// Every field 8 bytes (as AttnParams): the host mirrors it with a NumPy structured dtype.
// Strides are in elements over the three collapsed batch axes, the row (Sq) and the column (Sk)
// axes; 0 where the tensor broadcasts.
struct VariantParams {
    const void* bias;              // storage type = the policy's BiasT
    const unsigned char* mask;     // bool, 1 byte
    const float* slopes;           // ALiBi slopes, float32
    long long left, right;         // window extents, -1 = unbounded (right already 0 under causal)
    double softcap, inv_softcap;
    long long bias_s0, bias_s1, bias_s2, bias_sr, bias_sc;
    long long mask_s0, mask_s1, mask_s2, mask_sr, mask_sc;
    long long sl_s0, sl_s1, sl_s2;
    void* dscores;                 // backward with dbias: the final scores' gradient ds, in the
                                   // accumulator type, (full batch, Sq, Sk) contiguous; or null
    // User hooks (UserVariant): their float32 args, the head count H (the last batch axis) and
    // the flat batch index's strides over the three collapsed axes (b = n / H, h = n % H).
    const float* mod_args;
    long long mod_h, mod_s0, mod_s1, mod_s2;
    // The mask's block summary (mask_blocks.cu): one byte per MASK_BLOCK x MASK_BLOCK block of
    // the mask's own rows and keys (MASK_BLOCK_KEPT: every entry kept), (mask batch..., RB, CB)
    // contiguous; batch strides over the collapsed axes, mb_sr = CB or 0 (rows broadcast),
    // mb_cmax = CB - 1 (0 when keys broadcast). Null: no summary (every masked tile is partial).
    const unsigned char* mask_blocks;
    long long mb_s0, mb_s1, mb_s2, mb_sr, mb_cmax;
    // A mask_mod's ranges (UserVariant with BLOCKS; mask_blocks.cu: cuflash_hook_ranges): per
    // summary entry, per 64-row block int32 (lo, hi, klo, khi) (the keys of the blocks the hook
    // does not hide entirely, (0x7fffffff, 0) where it hides every key; the run of blocks it
    // keeps entirely), then per 64-key block (rlo, rhi) (the rows of the blocks it does not hide);
    // the entry of (b, h) starts at b * mr_eb + h * mr_eh ints (0 where the hook's code does not
    // name b or h). Null: no ranges.
    const int* mod_ranges;
    long long mr_eb, mr_eh;
};
static_assert(sizeof(VariantParams) == 35 * 8, "VariantParams must match cuflash/_launch.py");

__device__ __forceinline__ float tanh_acc(float x) { return tanhf(x); }
__device__ __forceinline__ double tanh_acc(double x) { return tanh(x); }

// 1 / y on the FMA pipe for y in [1, 2^64] (and NaN: NaN): an integer first guess (relative
// error < 1/8 over every binade) and three Newton steps r += r (1 - y r), each two FFMA, which
// square the error (2^-3 -> 2^-6 -> 2^-12 -> 2^-24, then the steps' own roundings): max relative
// error 1.0007 2^-24 over the range (tests/test_softcap_rcp_cpu.py models it in float32 against
// float64 over every binade). 7 FMA-pipe instructions and no MUFU (rcp.approx: one MUFU).
__device__ __forceinline__ float rcp_fma(float y) {
    float r = __int_as_float(0x7ef311c3 - __float_as_int(y));
#pragma unroll
    for (int i = 0; i < 3; ++i) r = fmaf(r, fmaf(-y, r, 1.f), r);
    return r;
}

// c tanh(x / c) for the tensor-core kernels, with k = 2 log2(e) / c: c (1 - 2 / (1 + 2^(k x))),
// two MUFU operations (ex2, rcp) and three FMA-pipe ones instead of tanhf's branchy sequence.
// Its error is absolute, a few units of 2^-22 c (ex2.approx and rcp.approx), which is what a
// softmax needs (an absolute score error is a relative error of p); both ends saturate exactly
// (2^(kx) = inf gives c, 0 gives -c) and NaN stays NaN.
// softcap_fast_r gives r = 1 / (1 + 2^(k x)), shared by the forward (softcap_fast) and the
// tensor-core backward (score_grad_tc), which also forms the derivative from it:
// 1 - tanh^2(x / c) = (1 - tanh)(1 + tanh) = 4 r (1 - r), with no cancellation near saturation.
//
// FORM (Variant's SC_FORM; cuflash/_dispatch_variants.py: SOFTCAP_RCP_FMA): 0 = the reciprocal
// on the MUFU pipe (rcp.approx), 1 = on the FMA pipe (rcp_fma below). With FORM 0 a softcapped
// score costs three MUFU operations (this ex2 and rcp, and the softmax's ex2) against one for a
// plain score; the MUFU pipe does 16 per clock per SM on Hopper (8 clocks a warp instruction per
// SM sub-partition), so the softcap's part of the softmax runs back to back on that pipe (the SASS
// of the Hopper D = 128 forward: 128 MUFU in a row per thread and tile) with the FMA pipe idle.
// FORM 1 moves the reciprocal to the FMA pipe: two MUFU per score, 7 more FMA-pipe instructions
// (notes/VARIANTS.md, "softcap's MUFU budget").
template <int FORM = 0>
__device__ __forceinline__ float softcap_fast_r(float x, float k) {
    float e, r;
    if constexpr (FORM == 0) {
        asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(x * k));
        asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.f + e));
    } else {
        // The exponent clamped at 64 (NaN kept: min.NaN), so that 1 + e <= 2^64 stays finite for
        // rcp_fma; there r = 2^-64 and c (1 - 2 r) rounds to c, as the unclamped form gives.
        float z;
        asm("min.NaN.f32 %0, %1, 64.0;" : "=f"(z) : "f"(x * k));
        asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(z));
        r = rcp_fma(1.f + e);
    }
    return r;
}
template <int FORM = 0>
__device__ __forceinline__ float softcap_fast(float x, float c, float k) {
    return fmaf(-2.f * c, softcap_fast_r<FORM>(x, k), c);
}

// One element of a bias or mask tensor for the tensor-core kernels, as a float / a byte, through
// a volatile read-only load: ptxas keeps such loads where they stand instead of hoisting a tile's
// worth of them (and their addresses) ahead, which took every register and spilled (at D = 64 a
// float32 bias alone reached 255 registers with spills; NVRTC 13.5, sm_90).
__device__ __forceinline__ float ldg_tc(const float* p) {
    float x;
    asm volatile("ld.global.nc.f32 %0, [%1];" : "=f"(x) : "l"(p));
    return x;
}
__device__ __forceinline__ float ldg_tc(const double* p) {
    double x;
    asm volatile("ld.global.nc.f64 %0, [%1];" : "=d"(x) : "l"(p));
    return static_cast<float>(x);
}
template <typename H>
__device__ __forceinline__ float ldg_tc(const H* p) {   // fp16_t, bf16_t
    H x;
    asm volatile("ld.global.nc.b16 %0, [%1];" : "=h"(x.bits) : "l"(p));
    return to_float(x);
}
__device__ __forceinline__ bool ldg_tc_nonzero(const unsigned char* p) {
    unsigned int x;
    asm volatile("ld.global.nc.u8 %0, [%1];" : "=r"(x) : "l"(p));
    return x != 0;
}

enum TileKind { TILE_EMPTY = 0, TILE_FULL = 1, TILE_PARTIAL = 2 };

// The mask's block summary (mask_blocks.cu): the block edge and the byte values.
constexpr int MASK_BLOCK = 64;
constexpr int MASK_BLOCK_SHIFT = 6;
enum MaskBlockKind { MASK_BLOCK_MIXED = 0, MASK_BLOCK_KEPT = 1, MASK_BLOCK_HIDDEN = 2 };

struct NoBias {};   // BiasT of a policy without a bias tensor

template <typename B> struct IsNoBias { static constexpr bool value = false; };
template <> struct IsNoBias<NoBias> { static constexpr bool value = true; };

// FORM: bits of the tensor-core kernels' forms (cuflash/_dispatch_variants.py: policy_name; 0,
// the default, is omitted from the names): 1 = softcap's reciprocal on the FMA pipe (SC_FORM,
// softcap_fast_r; SOFTCAP_RCP_FMA), 2 = the softmax scale fused into the transform (FUSED,
// score_x) or, for a policy without one, not applied (RAW; both VARIANT_FUSED_SCALE).
template <bool WINDOW, bool SOFTCAP, bool ALIBI, typename BiasT, bool MASK, int FORM = 0>
struct Variant {
    static constexpr bool HAS_BIAS = !IsNoBias<BiasT>::value;
    static constexpr int SC_FORM = FORM & 1;
    static constexpr bool TRANSFORMS = SOFTCAP || ALIBI || HAS_BIAS;   // score_tc is not t
    // FUSED: score_x folds the scale into the transform's first operation. RAW: no transform, so
    // the scores stay raw and the softmax takes the plain kernel's scale_log2 (the kernels:
    // softmax_units_log2); variant_scores only masks, on partial tiles.
    static constexpr bool FUSED = (FORM & 2) != 0 && TRANSFORMS;
    static constexpr bool RAW = (FORM & 2) != 0 && !TRANSFORMS;
    // AFFINE (FORM bit 4, ALIBI_AFFINE; ALiBi without softcap, bias or window; the Hopper
    // forward under causal, 16-bit): affine_scores' one FFMA per score, the softmax in log2
    // units of slope y + row term (softmax_step_affine).
    // (Not with a window: ALiBi + window spilled 54 bytes at D128 with both forms in the loop,
    // NVRTC 13.5.)
    static constexpr bool AFFINE = (FORM & 4) != 0 && ALIBI && !SOFTCAP && !HAS_BIAS && !WINDOW;
    static constexpr bool PLAIN = !WINDOW && !SOFTCAP && !ALIBI && !HAS_BIAS && !MASK;
    static constexpr bool MASKS = WINDOW || MASK;          // invisible keys beyond causal
    static constexpr bool READS = ALIBI || HAS_BIAS || MASK;
    static constexpr bool DSCORE = SOFTCAP;                // d score / d t is not 1
    static constexpr bool HAS_WINDOW = WINDOW;             // key_range narrows the key tiles

    // Bound per batch entry (left unset for the parts that are off: never read then).
    const BiasT* bias;
    const unsigned char* mask;
    const unsigned char* mask_blocks;   // the bound entry's block summary, or null
    long long bias_sr, bias_sc, mask_sr, mask_sc, left, right, off;
    int mb_sr, mb_cmax;   // the summary's row stride (0: rows broadcast), its last column
    float slope;
    double cap, inv_cap;
    float cap_f, inv_f, k_f;   // the tensor-core form (score_tc): c, 1 / c, 2 log2(e) / c
    int bias_cm, mask_cm;      // score_tc / visible_tc: column stride 1 (-1) or 0 (0) as a mask

    __device__ __forceinline__ void bind(const VariantParams& vp, long long sq, long long sk,
                                         long long i0, long long i1, long long i2) {
        off = sk - sq;
        if constexpr (WINDOW) { left = vp.left; right = vp.right; }
        if constexpr (SOFTCAP) {
            cap = vp.softcap;
            inv_cap = vp.inv_softcap;
            cap_f = static_cast<float>(vp.softcap);
            inv_f = static_cast<float>(vp.inv_softcap);
            k_f = static_cast<float>(2.0 * 1.4426950408889634 * vp.inv_softcap);
        }
        if constexpr (ALIBI) slope = vp.slopes[i0 * vp.sl_s0 + i1 * vp.sl_s1 + i2 * vp.sl_s2];
        if constexpr (HAS_BIAS) {
            bias = static_cast<const BiasT*>(vp.bias) + i0 * vp.bias_s0 + i1 * vp.bias_s1 +
                   i2 * vp.bias_s2;
            bias_sr = vp.bias_sr;
            bias_sc = vp.bias_sc;
            bias_cm = vp.bias_sc != 0 ? -1 : 0;
        }
        if constexpr (MASK) {
            mask = vp.mask + i0 * vp.mask_s0 + i1 * vp.mask_s1 + i2 * vp.mask_s2;
            mask_sr = vp.mask_sr;
            mask_sc = vp.mask_sc;
            mask_cm = vp.mask_sc != 0 ? -1 : 0;
            mask_blocks = vp.mask_blocks == nullptr
                              ? nullptr
                              : vp.mask_blocks + i0 * vp.mb_s0 + i1 * vp.mb_s1 + i2 * vp.mb_s2;
            mb_sr = static_cast<int>(vp.mb_sr);
            mb_cmax = static_cast<int>(vp.mb_cmax);
        }
    }

    __device__ __forceinline__ bool visible(long long i, long long j) const {
        bool ok = true;
        if constexpr (WINDOW) {
            const long long c = i + off;
            if (left >= 0) ok = ok && j >= c - left;
            if (right >= 0) ok = ok && j <= c + right;
        }
        if constexpr (MASK) ok = ok && mask[i * mask_sr + j * mask_sc] != 0;
        return ok;
    }

    template <typename Acc>
    __device__ __forceinline__ Acc score(Acc t, long long i, long long j) const {
        if constexpr (SOFTCAP) t = static_cast<Acc>(cap) * tanh_acc(t * static_cast<Acc>(inv_cap));
        if constexpr (ALIBI) {
            const long long dist = i + off - j;
            t -= static_cast<Acc>(slope) * static_cast<Acc>(dist < 0 ? -dist : dist);
        }
        if constexpr (HAS_BIAS) t += load_acc<Acc>(bias + i * bias_sr + j * bias_sc);
        return t;
    }

    // score() and visible() in the form of the tensor-core kernels (attn_mma.cu), float32, for
    // bias and mask tensors whose column stride is 1 or 0 (checked on the host): the column
    // offset is j or 0 (a 32-bit AND), so no 64-bit product per key is formed or kept in
    // registers. `dist` is i + off - j as a float, which the kernel forms once per tile and row
    // and offsets by each element's constant key offset (an FADD), where score() converts each
    // element's distance; FAST takes softcap_fast for tanhf (16-bit and one-pass TF32 kernels).
    template <bool FAST>
    __device__ __forceinline__ float score_tc(float t, long long i, int j, float dist) const {
        if constexpr (SOFTCAP) {
            if constexpr (FAST) t = softcap_fast<SC_FORM>(t, cap_f, k_f);
            else t = cap_f * tanhf(t * inv_f);
        }
        if constexpr (ALIBI) t -= slope * fabsf(dist);
        if constexpr (HAS_BIAS) t += ldg_tc(bias + i * bias_sr + (j & bias_cm));
        return t;
    }
    // score_tc and its derivative d score / d t (in `ds`) at once, for the tensor-core backward
    // (attn_bwd_mma.cu): the same score, bit for bit, as score_tc (the same instructions on the
    // same operands), so that P matches the forward's lse.
    template <bool FAST>
    __device__ __forceinline__ float score_grad_tc(float t, long long i, int j, float dist,
                                                   float& ds) const {
        ds = 1.f;
        if constexpr (SOFTCAP) {
            if constexpr (FAST) {
                const float r = softcap_fast_r<SC_FORM>(t, k_f);
                t = fmaf(-2.f * cap_f, r, cap_f);
                ds = 4.f * r * (1.f - r);
            } else {
                const float th = tanhf(t * inv_f);
                t = cap_f * th;
                ds = 1.f - th * th;
            }
        }
        if constexpr (ALIBI) t -= slope * fabsf(dist);
        if constexpr (HAS_BIAS) t += ldg_tc(bias + i * bias_sr + (j & bias_cm));
        return t;
    }
    // The policy's score of the raw product x (t = x * scale) of row i, key j, with dist = dist0 -
    // ce (ALiBi's i + off - j; ce: the element's constant key offset, dist0: the rest, formed once
    // per row and tile by the forward): score_tc on the unfused product, or under FUSED with the
    // scale folded into the transform's first operation (softcap's exponent x (scale k); ALiBi's
    // and a bias's addition one FFMA with x), and ALiBi under CAUSAL as slope ce - slope dist0
    // (dist >= 0 at every key a causal row sees, so no |.|; the FADD forming dist folds into that
    // FFMA): per score, softcap one FMUL fewer, ALiBi two FMA-pipe instructions instead of three,
    // a bias one FFMA instead of FMUL + FADD. The roundings differ from score_tc's (fewer), so the
    // tensor-core backward (score_grad_x) recomputes the same form.
    template <bool FAST, bool CAUSAL>
    __device__ __forceinline__ float score_x(float x, float scale, long long i, int j,
                                             float dist0, float ce) const {
        if constexpr (!FUSED) {
            return score_tc<FAST>(__fmul_rn(x, scale), i, j, dist0 - ce);
        } else {
            float ds;
            return fused_score<FAST, CAUSAL, false>(x, scale, i, j, dist0, ce, ds);
        }
    }
    template <bool FAST, bool CAUSAL>
    __device__ __forceinline__ float score_grad_x(float x, float scale, long long i, int j,
                                                  float dist0, float ce, float& ds) const {
        if constexpr (!FUSED)
            return score_grad_tc<FAST>(__fmul_rn(x, scale), i, j, dist0 - ce, ds);
        else
            return fused_score<FAST, CAUSAL, true>(x, scale, i, j, dist0, ce, ds);
    }
    template <bool FAST, bool CAUSAL, bool GRAD>
    __device__ __forceinline__ float fused_score(float x, float scale, long long i, int j,
                                                 float dist0, float ce, float& ds) const {
        constexpr bool ADD = ALIBI || HAS_BIAS;
        ds = 1.f;
        float a = 0.f;   // the additive part
        if constexpr (ALIBI) {
            if constexpr (CAUSAL) a = fmaf(slope, ce, -slope * dist0);
            else a = -slope * fabsf(dist0 - ce);
        }
        if constexpr (HAS_BIAS) {
            const float b = ldg_tc(bias + i * bias_sr + (j & bias_cm));
            a = ALIBI ? a + b : b;
        }
        if constexpr (SOFTCAP) {
            if constexpr (FAST) {
                const float r = softcap_fast_r<SC_FORM>(x, scale * k_f);
                if constexpr (GRAD) ds = 4.f * r * (1.f - r);
                return fmaf(-2.f * cap_f, r, ADD ? cap_f + a : cap_f);
            } else {
                const float th = tanhf(x * (scale * inv_f));
                if constexpr (GRAD) ds = 1.f - th * th;
                return ADD ? fmaf(cap_f, th, a) : cap_f * th;
            }
        } else {
            return fmaf(x, scale, a);
        }
    }

    // ALiBi in the softmax's affine units (AFFINE): under causal every visible key has dist =
    // dist0 - ce >= 0, so score = t - slope dist = slope y + R with y = x (scale / slope) + ce (one
    // FFMA, ce the element's constant key offset, an immediate) and R = -slope dist0 a term of the
    // row and tile; in log2 units a y + b, a = slope log2 e, b = -a dist0. Taken where 2^-10 <=
    // slope <= 1 (`rho`, `a` returned; false: the caller's other form; the lower end keeps
    // y = x rho finite wherever x is below 2^118 / (scale 2^10): every float16 q.k, bfloat16 ones
    // up to ~5e36 at D = 256, where the other forms stay finite up to 3e38): y's
    // and b's roundings then cost at most a few 2^-24 (|t| + slope (BN + |dist|)) in the exponent,
    // for BN <= 128 under 2^-15 beyond what error_bound's 12 u max(|s| + 2|a|) holds, inside its
    // 16-bit u term (2^-11: float16 margin 16; notes/VARIANTS.md).
    __device__ __forceinline__ bool affine(float scale, float& rho, float& a) const {
        rho = scale / slope;
        a = slope * 1.4426950408889634f;
        return slope >= 0x1p-10f && slope <= 1.f && fabsf(rho) <= 3.0e38f;
    }

    // The window's bounds of row i as 32-bit keys, clamped to [-1, 2^31 - 1) (exact for keys
    // j in [0, Sk)): per row, so that each key's test is two 32-bit comparisons.
    __device__ __forceinline__ int window_lo(long long i) const {
        return left >= 0 ? static_cast<int>(max(-1ll, min(i + off - left, 0x7ffffffell))) : -1;
    }
    __device__ __forceinline__ int window_hi(long long i) const {
        return right >= 0 ? static_cast<int>(max(-1ll, min(i + off + right, 0x7ffffffell)))
                          : 0x7fffffff;
    }
    __device__ __forceinline__ bool visible_tc(long long i, int j) const {
        bool ok = true;
        if constexpr (WINDOW) ok = j >= window_lo(i) && j <= window_hi(i);
        if constexpr (MASK) ok = ok && ldg_tc_nonzero(mask + i * mask_sr + (j & mask_cm));
        return ok;
    }

    // d score / d t at the scaled score t (of row i, key j: the user hooks' derivative reads
    // them; the built-in parts do not).
    template <typename Acc>
    __device__ __forceinline__ Acc dscore(Acc t, long long, long long) const {
        if constexpr (!SOFTCAP) return Acc(1);
        const Acc th = tanh_acc(t * static_cast<Acc>(inv_cap));
        return Acc(1) - th * th;
    }

    // Keys [j0, j1) that rows [r0, r1) can see by position (window only; causal is the
    // kernel's own limit and is intersected by the caller).
    __device__ __forceinline__ void key_range(long long r0, long long r1, long long& j0,
                                              long long& j1, long long sk) const {
        j0 = 0;
        j1 = sk;
        if constexpr (WINDOW) {
            if (left >= 0) j0 = max(0ll, r0 + off - left);
            if (right >= 0) j1 = min(sk, r1 - 1 + off + right + 1);
        }
    }
    // Rows [r0, r1) that can see some key of [j0, j1) by position (window only).
    __device__ __forceinline__ void row_range(long long j0, long long j1, long long& r0,
                                              long long& r1, long long sq) const {
        r0 = 0;
        r1 = sq;
        if constexpr (WINDOW) {
            if (right >= 0) r0 = max(0ll, j0 - off - right);
            if (left >= 0) r1 = min(sq, j1 - 1 - off + left + 1);
        }
    }
    // Whether a (rows [r0, r1)) x (keys [j0, j1)) tile is empty, full or partial by position.
    // Whether every entry of the mask over rows [r0, r1) and keys [j0, j1) is kept, by the blocks
    // of the summary the tile overlaps (1-3 per axis: a tile need not be block-aligned). The
    // callers clamp r1 to Sq; the key blocks are clamped to the summary's last column (keys past
    // Sk are partial by the callers' own tail tests, whatever this says). False without a summary.
    // 32-bit indices and no copies of Sq / Sk: the fp32 mma.sync forward with every part at
    // D = 128 spilled 72 bytes under NVRTC 13.5 with 64-bit ones.
    __device__ __forceinline__ bool mask_all_kept(long long r0, long long r1, long long j0,
                                                  long long j1) const {
        if constexpr (!MASK) return true;
        if (mask_blocks == nullptr || r0 >= r1 || j0 >= j1) return false;
        const int b0 = static_cast<int>(r0 >> MASK_BLOCK_SHIFT);
        const int b1 = static_cast<int>((r1 - 1) >> MASK_BLOCK_SHIFT);
        const int c0 = min(static_cast<int>(j0 >> MASK_BLOCK_SHIFT), mb_cmax);
        const int c1 = min(static_cast<int>((j1 - 1) >> MASK_BLOCK_SHIFT), mb_cmax);
        bool kept = true;
#pragma unroll 1
        for (int b = b0; b <= b1; ++b)
#pragma unroll 1
            for (int c = c0; c <= c1; ++c)
                kept = kept && mask_blocks[b * mb_sr + c] == MASK_BLOCK_KEPT;
        return kept;
    }

    __device__ __forceinline__ int tile_kind(long long r0, long long r1, long long j0,
                                             long long j1) const {
        if constexpr (!WINDOW) {
            if constexpr (MASK) return mask_all_kept(r0, r1, j0, j1) ? TILE_FULL : TILE_PARTIAL;
            return TILE_FULL;
        }
        long long a0, a1;
        key_range(r0, r1, a0, a1, j1);
        if (a0 >= j1 || a1 <= j0) return TILE_EMPTY;
        // Full when the last row's first key and the first row's last key bracket the tile.
        long long f0, f1, g0, g1;
        key_range(r1 - 1, r1, f0, f1, j1);
        key_range(r0, r0 + 1, g0, g1, j1);
        const bool full = f0 <= j0 && g1 >= j1;
        return (full && mask_all_kept(r0, r1, j0, j1)) ? TILE_FULL : TILE_PARTIAL;
    }
};

using PlainVariant = Variant<false, false, false, NoBias, false>;

// A built-in policy `Base` with user hooks (cuflash/mods.py): `Hook` is the generated struct
// cuflash_user::Mod_<hash> (appended to the family's source) with static members
// score_mod<Acc>(score, b, h, q_idx, kv_idx, args), score_grad<Acc>(...) and
// mask_mod(b, h, q_idx, kv_idx, args). The score hook runs on the score Base produces (after
// softcap, alibi, bias); the mask hook is one more visibility condition. Same interface as
// Variant; every tile with a mask hook is partial (nothing about it is known by position).
// BLOCKS (cuflash/_dispatch_variants.py: HOOK_BLOCKS, and HOOK_BLOCKS_BWD for the backwards
// without deterministic turns, whose row_range it narrows the same way): the call's key ranges
// of the mask_mod per 64-row block (VariantParams::mod_ranges) narrow key_range, and with it the
// key tiles a forward's block visits, as a window's do (HAS_WINDOW); the keys left out are hidden
// from every row of the block, so each row's result is that of the full walk. The same ranges'
// runs of KEPT blocks make a tile inside them TILE_FULL (tile_kind), where the hook is not
// evaluated: the kept elements are those the hook would keep, so the results are bitwise those
// of the flag off.
template <typename Base, typename Hook, bool SCORE_MOD, bool MASK_MOD, bool BLOCKS = false>
struct UserVariant : Base {
    static_assert(MASK_MOD || !BLOCKS, "BLOCKS narrows by a mask_mod's ranges");
    static constexpr bool PLAIN = false;
    static constexpr bool HAS_WINDOW = Base::HAS_WINDOW || BLOCKS;
    static constexpr bool MASKS = Base::MASKS || MASK_MOD;
    static constexpr bool READS = true;   // args, and b / h exist only for real rows and keys
    static constexpr bool DSCORE = Base::DSCORE || SCORE_MOD;
    static constexpr bool TRANSFORMS = true;   // (a hook's score: always the unfused product)
    static constexpr bool FUSED = false, RAW = false, AFFINE = false;

    const float* mod_args;
    long long mod_b, mod_h;
    const int* ranges;    // BLOCKS: the bound entry's (lo, hi, klo, khi) per 64-row block, or null
    const int* cranges;   // BLOCKS: the bound entry's (rlo, rhi) per 64-key block (after ranges)

    __device__ __forceinline__ void bind(const VariantParams& vp, long long sq, long long sk,
                                         long long i0, long long i1, long long i2) {
        Base::bind(vp, sq, sk, i0, i1, i2);
        const long long n = i0 * vp.mod_s0 + i1 * vp.mod_s1 + i2 * vp.mod_s2;
        mod_h = n % vp.mod_h;
        mod_b = n / vp.mod_h;
        mod_args = vp.mod_args;
        if constexpr (BLOCKS) {
            ranges = vp.mod_ranges == nullptr
                         ? nullptr
                         : vp.mod_ranges + mod_b * vp.mr_eb + mod_h * vp.mr_eh;
            cranges = ranges == nullptr ? nullptr
                                        : ranges + 4 * ((sq + MASK_BLOCK - 1) >> MASK_BLOCK_SHIFT);
        }
    }

    // [x0, x1) intersected with the union of the (lo, hi) pairs at r[STEP i], r[STEP i + 1]
    // over the 64-blocks i of [a0, a1) (1-3 of them; the callers clamp a1): empty (x1 = x0)
    // where every pair is empty. Both sides of the summary's ranges go through here.
    template <int STEP>
    static __device__ __forceinline__ void narrow(const int* r, long long a0, long long a1,
                                                  long long& x0, long long& x1) {
        int lo = 0x7fffffff, hi = 0;
#pragma unroll 1
        for (int i = static_cast<int>(a0 >> MASK_BLOCK_SHIFT);
             i <= static_cast<int>((a1 - 1) >> MASK_BLOCK_SHIFT); ++i) {
            lo = min(lo, r[STEP * i]);
            hi = max(hi, r[STEP * i + 1]);
        }
        if (lo >= hi) {
            x1 = x0;
        } else {
            x0 = max(x0, static_cast<long long>(lo));
            x1 = min(x1, static_cast<long long>(hi));
        }
    }

    // Base's row range, narrowed (BLOCKS) to the union of the mask_mod's row ranges over the
    // key blocks of [j0, j1): the backwards' query tiles of a key block; empty where the hook
    // hides those keys from every row.
    __device__ __forceinline__ void row_range(long long j0, long long j1, long long& r0,
                                              long long& r1, long long sq) const {
        Base::row_range(j0, j1, r0, r1, sq);
        if constexpr (BLOCKS)
            if (cranges != nullptr && j0 < j1) narrow<2>(cranges, j0, j1, r0, r1);
    }

    // Base's key range, narrowed (BLOCKS) to the union of the mask_mod's key ranges over the row
    // blocks of [r0, r1); empty where the hook hides every key of those rows, which the forwards
    // take as no tile.
    __device__ __forceinline__ void key_range(long long r0, long long r1, long long& j0,
                                              long long& j1, long long sk) const {
        Base::key_range(r0, r1, j0, j1, sk);
        if constexpr (BLOCKS)
            if (ranges != nullptr && r0 < r1) narrow<4>(ranges, r0, r1, j0, j1);
    }

    __device__ __forceinline__ bool visible(long long i, long long j) const {
        bool ok = true;
        if constexpr (Base::MASKS) ok = Base::visible(i, j);
        if constexpr (MASK_MOD) ok = ok && Hook::mask_mod(mod_b, mod_h, i, j, mod_args);
        return ok;
    }

    template <typename Acc>
    __device__ __forceinline__ Acc score(Acc t, long long i, long long j) const {
        Acc s = t;
        if constexpr (!Base::PLAIN) s = Base::score(t, i, j);
        if constexpr (SCORE_MOD) s = Hook::template score_mod<Acc>(s, mod_b, mod_h, i, j, mod_args);
        return s;
    }

    template <bool FAST>
    __device__ __forceinline__ float score_tc(float t, long long i, int j, float dist) const {
        float s = t;
        if constexpr (!Base::PLAIN) s = Base::template score_tc<FAST>(t, i, j, dist);
        if constexpr (SCORE_MOD) s = Hook::template score_mod<float>(s, mod_b, mod_h, i, j, mod_args);
        return s;
    }

    // score_tc and d score / d t: the built-in parts' derivative times the hook's (grad_cuda at
    // the built-in parts' score), as dscore.
    template <bool FAST>
    __device__ __forceinline__ float score_grad_tc(float t, long long i, int j, float dist,
                                                   float& ds) const {
        float s = t;
        ds = 1.f;
        if constexpr (!Base::PLAIN) s = Base::template score_grad_tc<FAST>(t, i, j, dist, ds);
        if constexpr (SCORE_MOD) {
            ds *= Hook::template score_grad<float>(s, mod_b, mod_h, i, j, mod_args);
            s = Hook::template score_mod<float>(s, mod_b, mod_h, i, j, mod_args);
        }
        return s;
    }

    // score_x / score_grad_x (Variant's) on this policy's score_tc / score_grad_tc, unfused.
    template <bool FAST, bool CAUSAL>
    __device__ __forceinline__ float score_x(float x, float scale, long long i, int j,
                                             float dist0, float ce) const {
        return score_tc<FAST>(__fmul_rn(x, scale), i, j, dist0 - ce);
    }
    template <bool FAST, bool CAUSAL>
    __device__ __forceinline__ float score_grad_x(float x, float scale, long long i, int j,
                                                  float dist0, float ce, float& ds) const {
        return score_grad_tc<FAST>(__fmul_rn(x, scale), i, j, dist0 - ce, ds);
    }

    __device__ __forceinline__ bool visible_tc(long long i, int j) const {
        bool ok = true;
        if constexpr (Base::MASKS) ok = Base::visible_tc(i, j);
        if constexpr (MASK_MOD) ok = ok && Hook::mask_mod(mod_b, mod_h, i, j, mod_args);
        return ok;
    }

    template <typename Acc>
    __device__ __forceinline__ Acc dscore(Acc t, long long i, long long j) const {
        Acc d = Base::dscore(t, i, j);
        if constexpr (SCORE_MOD) {
            Acc s = t;
            if constexpr (!Base::PLAIN) s = Base::score(t, i, j);
            d *= Hook::template score_grad<Acc>(s, mod_b, mod_h, i, j, mod_args);
        }
        return d;
    }

    __device__ __forceinline__ int tile_kind(long long r0, long long r1, long long j0,
                                             long long j1) const {
        const int kind = Base::tile_kind(r0, r1, j0, j1);
        if (!MASK_MOD || kind != TILE_FULL) return kind;
        if constexpr (BLOCKS) {
            // Full where every row block of [r0, r1) keeps all of [j0, j1) (its run of KEPT
            // blocks, klo / khi, brackets the tile): the mask_mod is not evaluated there. A
            // tile reaching past Sk is never inside a run (khi <= Sk), as the callers' tail
            // tests want.
            if (ranges == nullptr || r0 >= r1) return TILE_PARTIAL;
            bool full = true;
#pragma unroll 1
            for (int b = static_cast<int>(r0 >> MASK_BLOCK_SHIFT);
                 b <= static_cast<int>((r1 - 1) >> MASK_BLOCK_SHIFT); ++b)
                full = full && ranges[4 * b + 2] <= j0 && j1 <= ranges[4 * b + 3];
            return full ? TILE_FULL : TILE_PARTIAL;
        }
        return TILE_PARTIAL;
    }
};

// ---- The tensor-core forwards' variant scores (attn_mma.cu, attn_wgmma.cu): the scores of one
// 16-row slab (the m16n8 layout of softmax_step, which wgmma's accumulator fragment shares) scaled, transformed by the policy and masked, in place. The plain kernel leaves
// its scores raw and folds the scale into exp2's FFMA; a score transform (softcap, ALiBi, a
// bias, a user score_mod) needs the scaled score, so the variant path scales first and then runs
// the softmax in scaled units (scale_log2 = log2 e). `partial`: the tile needs per-element
// visibility (the key tail, the causal diagonal, a window edge, a mask); on other tiles only the
// transform runs. Rows past Sq are clamped for the policy's reads (their results are never
// written), as are keys past Sk (masked anyway). The scale is an unfused multiply (__fmul_rn), so
// that no contraction with the transform's additions differs between this kernel and the
// tensor-core backward (attn_bwd_mma.cu: bwd_variant_probs), which recomputes the same logits.
template <int NT, bool CAUSAL, bool FAST, bool PARTIAL, typename V>
__device__ __forceinline__ void variant_scores_as(float (&s)[NT][4], const V& var, int key0,
                                                  int t4, int sq, int sk, int row_lo, int diag,
                                                  float scale) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = row_lo + 8 * h;
        const int r = V::READS ? min(row, sq - 1) : row;
        // i + off - j for this thread's first key of the tile, once per row and tile.
        const float dist0 = static_cast<float>(row + diag - key0 - 2 * t4);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                float& x = s[nt][2 * h + e];
                const int key = key0 + nt * 8 + 2 * t4 + e;
                const float ce = static_cast<float>(nt * 8 + e);
                if constexpr (PARTIAL) {
                    const int kc = V::READS ? min(key, sk - 1) : key;
                    // Without reads `&`, not `&&`: every term evaluated, so that the row's
                    // window bounds (visible_tc: window_lo / window_hi of r) are formed once per
                    // row, not under each element's predicate (with `&&` ptxas recomputed them
                    // per element, 64-bit compares included, and saved predicates with P2R: the
                    // Hopper D128 window forward 5360 -> 4720 instructions, P2R 111 -> 0). With
                    // reads (a mask) `&&`: the loads stay under the position's predicate (`&`
                    // spilled 76 bytes with every part at D128, NVRTC 13.5).
                    bool ok = key < sk;
                    if (CAUSAL) ok = ok & (key <= row + diag);
                    if (V::MASKS)
                        ok = V::READS ? (ok && var.visible_tc(r, kc))
                                      : (ok & var.visible_tc(r, kc));
                    const float t =
                        V::RAW ? x
                               : var.template score_x<FAST, CAUSAL>(x, scale, r, kc, dist0, ce);
                    x = ok ? t : neg_inf<float>();
                } else if constexpr (!V::RAW) {
                    x = var.template score_x<FAST, CAUSAL>(x, scale, r, key, dist0, ce);
                }
            }
    }
}
// AFFINE's scores (Variant::affine) of one 16-row slab in place, the m16n8 layout of
// variant_scores_as: y = x rho + ce, masked per element on partial tiles (the key tail, the
// causal diagonal, a window edge, a mask). Causal only (the form assumes dist >= 0 where visible).
template <int NT, bool PARTIAL, typename V>
__device__ __forceinline__ void affine_scores_as(float (&s)[NT][4], const V& var, int key0,
                                                 int t4, int sq, int sk, int row_lo, int diag,
                                                 float rho) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = row_lo + 8 * h;
        const int r = V::READS ? min(row, sq - 1) : row;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                float& x = s[nt][2 * h + e];
                const float y = fmaf(x, rho, static_cast<float>(nt * 8 + e));
                if constexpr (PARTIAL) {
                    const int key = key0 + nt * 8 + 2 * t4 + e;
                    const int kc = V::READS ? min(key, sk - 1) : key;
                    bool ok = (key < sk) & (key <= row + diag);
                    if (V::MASKS) ok = ok && var.visible_tc(r, kc);
                    x = ok ? y : neg_inf<float>();
                } else {
                    x = y;
                }
            }
    }
}

// The units of the scores the tensor-core forwards' softmax sees, as its scale_log2: raw (the
// scale folded into exp2's FFMA, `plain` = scale * log2 e) for the plain policy and a RAW one
// (no transform: variant_scores leaves the scores raw), scaled (log2 e) for every other policy.
template <typename V>
__device__ __forceinline__ float softmax_units_log2(double plain) {
    return (V::PLAIN || V::RAW) ? static_cast<float>(plain) : 1.4426950408889634f;
}

// The two forms as separate loops (one branch per tile): with the choice per element, ptxas
// if-converted both into one predicated sequence that kept both forms' addresses live (a float32
// bias at D = 64 went past 128 registers and spilled).
template <int NT, bool CAUSAL, bool FAST, typename V>
__device__ __forceinline__ void variant_scores(float (&s)[NT][4], const V& var, bool partial,
                                               int key0, int t4, int sq, int sk, int row_lo,
                                               int diag, float scale) {
    if (partial)
        variant_scores_as<NT, CAUSAL, FAST, true>(s, var, key0, t4, sq, sk, row_lo, diag, scale);
    else
        variant_scores_as<NT, CAUSAL, FAST, false>(s, var, key0, t4, sq, sk, row_lo, diag, scale);
}


// The Hopper forward's exact path for a row whose O is not finite (attn_wgmma.cu, the epilogue;
// common.cuh: exact_row_pv, the plain form): one warp recomputes the row in float32 from global
// memory over exactly the keys the policy lets it see (the window's reach, the causal limit,
// visible_tc, and a score of -inf, a bias entry that acts as a mask), with the main pass's m_c
// (= m log2 e, scaled units; 0 while m = -inf) and 1 / l, and the same transform (score_tc on
// the unfused product), so that a NaN or an infinity in V at a key the row does not see does not
// reach it. Rare (non-finite inputs only): written for few registers, not speed. All 32 lanes
// call it with the same row (< Sq); D, Dv <= 256.
template <typename T, bool CAUSAL, bool FAST, typename V>
__device__ __forceinline__ void exact_row_pv_var(const V& var, const T* q_row, const T* k,
                                                 long long k_sr, const T* v, long long v_sr,
                                                 int d, int dv, int row, int sq, int sk,
                                                 float scale, float m_c, float inv_l, T* o_row) {
    const int lane = static_cast<int>(threadIdx.x & 31u);
    long long j0, j1;
    var.key_range(row, row + 1, j0, j1, sk);
    if (CAUSAL) j1 = min(j1, static_cast<long long>(row) + (sk - sq) + 1);
    float acc[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = 0.f;
#pragma unroll 1
    for (int j = static_cast<int>(j0); j < j1; ++j) {
        if (V::MASKS && !var.visible_tc(row, j)) continue;
        const float s = exact_row_dot(q_row, k + j * k_sr, d, lane);  // the same in every lane
        const float t = var.template score_x<FAST, CAUSAL>(
            s, scale, row, j, static_cast<float>(row + (sk - sq) - j), 0.f);
        if (t == neg_inf<float>()) continue;
        exact_row_axpy(acc, fast_exp2(fmaf(t, 1.4426950408889634f, -m_c)), v + j * v_sr, dv,
                       lane);
    }
    exact_row_store(acc, inv_l, dv, lane, o_row);
}

// The two kernels of a family whose body is BODY<T, Acc, DB, DVB, CAUSAL, V>(params, vp): NAME,
// the plain policy with one argument (PARAMS p), and NAME##_var<..., V> with VariantParams as a
// second argument. Both are named instantiations a profiler shows (e.g.
// cuflash_fwd_generic_var<fp16_t, float, 64, 64, true, Variant<true, true, false, NoBias, false>>).
#define CUFLASH_POLICY_KERNELS(NAME, BODY, PARAMS)                                            \
    template <typename T, typename Acc, int DB, int DVB, bool CAUSAL>                         \
    __global__ void __launch_bounds__(128, 1) NAME(const PARAMS p) {                          \
        BODY<T, Acc, DB, DVB, CAUSAL, PlainVariant>(p, VariantParams{});                      \
    }                                                                                         \
    template <typename T, typename Acc, int DB, int DVB, bool CAUSAL, typename V>             \
    __global__ void __launch_bounds__(128, 1) NAME##_var(const PARAMS p,                      \
                                                         const VariantParams vp) {            \
        BODY<T, Acc, DB, DVB, CAUSAL, V>(p, vp);                                              \
    }

}  // namespace cuflash
