// attn_wgmma.cu: Hopper forward kernel for float16 / bfloat16 and, as TF32 wgmma with TERMS = 1
// or 3 products per multiply-add, float32 (sm_90a only; float32: see WgmmaConfig below and
// notes/FLOAT32.md, "Hopper wgmma form").
//
// Versions (H200, float16, the standard grid; notes/PERF.md has the predictions and details):
//   1a  TMA loads, warpgroup MMA (wgmma) for both products, one producer warpgroup and two
//       consumer warpgroups. Against attn_mma.cu (mma.sync, ~360 TFLOP/s peak): wgmma keeps the
//       whole 64 x N product in the tensor cores without a per-fragment ldmatrix, operands come
//       straight from shared memory, and loads cost the consumers nothing.
//   1b  OVERLAP: the softmax of tile j runs while the tensor cores do P_{j-1} V_{j-1}. 1a + 1b:
//       1.40x FA2 geomean on a 12-point grid, 626 TFLOP/s at D = 128, S = 4096. Against 1a:
//       +2-11% at D = 128/256 and S >= 2048, up to -11% at D = 64 (enabled per head dim).
//   2   Persistent launches: a block loops over work items; the next item's first K tile and Q
//       are requested while the current one finishes. +1-29% at Sk <= 2048, but -2 to -15% there
//       under the causal mask at D >= 128 and up to -22% at Sk = 8192 (the dispatcher chooses
//       per call). With 1b: 1.61x FA2, 0.89x cuDNN, 740 TFLOP/s.
//   3   (benchmarks/tune.py, same-run TFLOP/s; cuflash/_dispatch.py: HOPPER_TABLE picks per call)
//       a. Causal work items are pairs of query blocks (WorkWalk): the round-robin of version 2
//          gave every block the same query block in each round. D = 128, S = 1024, causal:
//          404 TFLOP/s persistent with pairs (tune.py) where version 2 had 345 (bench.py, one
//          block per item; cuDNN 437 in both runs), and persistence now pays under the mask.
//       b. PINGPONG: the consumers take turns to issue their products (named barriers), so one's
//          softmax runs under the other's MMAs: +4-12% at D = 128 (S = 2048: 560 -> 615).
//       c. CONSUMERS = 3 (BM = 192, 160 registers each) at D = 64: +8-19% without the mask.
//       d. BN = 176 (D = 128, long keys) and BN = 80 (D = 256): 0 to +14% from S = 1024 on.
//       e. QSTAGES = 2 (the next item's Q loaded during this one): +0.3% to -4%, not dispatched.
//   4   (benchmarks/ab.py: the old and new sources timed interleaved in one process)
//       a. Per-warpgroup tile counts (tiles_needed): under the causal mask each consumer computes
//          only the key tiles its own 64 rows see, and rows past Sq compute none. D = 256,
//          S = 512, causal: +3-5% (tune.py, same run).
//       b. O leaves in 16-byte stores (common.cuh: quad_transpose). ncu's source counters at
//          D = 256, S = 512 put about a quarter of the warps' stall samples in the epilogue,
//          behind 4-byte stores throttled by the memory pipeline. With a and b: D = 256, S = 512
//          466 -> 553 TFLOP/s, causal 283 -> 360 (cuDNN 541, 356); D = 128, S = 512 +7-9%;
//          D = 64 within +-1.5%.
//       c. The consumer index is broadcast from lane 0 so that the compiler treats it as
//          warp-uniform (uniform registers); without that, a + b spilled 16-56 bytes at D = 256
//          and at BM = 192 and ran 4-15% slower (ab.py, D = 64, 128 and 256, S = 512-1024).
//   5   3xfp16 float32 (F16S): the producer requests tile j + STAGES - 1 once tile j is prepared,
//       so loads land during the splits before; each tile used to be requested and then waited
//       for in its own iteration, a serial load-split chain (notes/FLOAT32.md, "Hopper 3xfp16 at
//       D = 64": predicted 87 -> 105-120 TFLOP/s at D = 64; D = 128, two stages, is unchanged).
//   6   3xfp16 float32 at DPAD = 256 (WgmmaConfig::HSPLIT; _dispatch.HOPPER_F32_D256): the
//       two consumers share one block of 64 rows, each owning 128 head-dim columns of Q, K, V and
//       O; their partial scores are added through shared memory (add_partner_scores), so O takes
//       64 registers a thread (notes/FLOAT32.md, "Hopper 3xfp16 at D = 256": predicted 55-95
//       TFLOP/s against the mma.sync form's measured 54-70). Measured (H200, session g):
//       62.5-73.3 TFLOP/s at D = 256, +1 to +16% over the mma.sync form, 1.56-1.97x torch's
//       EFFICIENT backend.
//   7   K and V split once per call (OP = fp16pre_t, cuflash_split16_kv) and, at one stage (D =
//       256), the pre-split producer's item boundary: Q is split before the wait for V_0's stage
//       and the next K exponent is read right after K's load. H200 (session x, old/new twice in
//       one call): D = 256 S = 512 causal 72.3, 72.5 -> 75.8, 75.8 TFLOP/s (2.07x -> 2.17x torch
//       EFFICIENT), S = 512 +2%, S = 1024 +0.5 to +2.5%, S = 4096 within 1%. V_0 first whenever
//       its stage was free once Q had landed lost the gain (H100 A/B).
//
// Block = 1 + CONSUMERS warpgroups (384 or 512 threads), BM = 64 * CONSUMERS query rows:
//   - warpgroup 0, the producer, gives most of its registers away (setmaxnreg) and one thread
//     issues TMA copies: Q into one of QSTAGES buffers per work item, then K_j and V_j into a ring
//     of STAGES buffers, each with its own "full" mbarrier (TMA completes it by byte count) and
//     an "empty" mbarrier that the consumers' warps arrive on when they are done with the stage;
//   - warpgroups 1.., the consumers, own 64 query rows each (HSPLIT: the same 64 rows, half the
//     head dim each). Per K/V tile:
//     S = Q K_j^T with wgmma m64nBNk16 (A = Q and B = K_j, both K-major in shared memory),
//     the online softmax in registers (common.cuh: softmax_step, shared with attn_mma.cu),
//     P converted to 16 bits in registers, O += P V_j with wgmma m64nDk16 (A = P from
//     registers, B = V_j N-major in shared memory).
// Without PINGPONG the consumers run independently and the warp schedulers interleave them; with
// it they issue their products in turn. The producer keeps STAGES tiles in flight.
//
// Shared memory: Q, K and V tiles are stored as 64-column panels (128 bytes per row) with the
// 128-byte swizzle, which is what TMA writes with CU_TENSOR_MAP_SWIZZLE_128B and what the wgmma
// descriptors (common.cuh: wgmma_desc) read; every panel starts on a 1024-byte boundary.
// Head dims below DPAD, and rows past Sq or Sk, arrive as zeros from the tensor maps' bounds.
//
// FLOPs per tile and consumer: 2 * 64 * BN * DPAD for each product. Causal: tiles past the
// block's last visible key are never loaded; the mask is applied only from masked_from on.
//
// Requirements checked on the host (cuflash/_dispatch.py: hopper_reason): compute capability 9.0,
// D == Dv, D % 8 == 0, 64 <= D <= DPAD, pointers, rows and batch strides of q, k, v and out
// multiples of 16 bytes (TMA loads, 16-byte stores of O; float32: 8-byte stores).
#include "common.cuh"
#include "fp16split.cuh"
#include "wgmma_ops.cuh"
#include "variants.cuh"

namespace cuflash {

// The kernel parameter: the three tensor maps (made per call on the host: cuflash/_launch.py),
// then the parameters every forward kernel takes. coord_mask bit 3 * t + i is set when tensor t
// (0 = q, 1 = k, 2 = v) has batch axis i of the collapsed batch (nb0, nb1, nb2); where it is
// clear the tensor broadcasts over that axis and its tensor-map coordinate is 0.
struct HopperParams {
    TmaDesc tm_q, tm_k, tm_v;
    AttnParams a;
    long long coord_mask;
    // OP = fp16pre_t: the split K and V (cuflash_split16_kv's float16 arrays, which tm_k / tm_v
    // map; each key tile's exponent at column 2 DPAD of its first row), batch and row strides in
    // 16-bit elements. a.k and a.v stay the float32 inputs, which the exact row path reads.
    const void* kx;
    const void* vx;
    long long kx_s0, kx_s1, kx_s2, kx_sr, vx_s0, vx_s1, vx_s2, vx_sr;
};
// The host mirrors this layout byte for byte (cuflash/_launch.py: HOPPER_PARAMS_DTYPE): a at 384,
// coord_mask right after it, then kx.. vx_sr (ten 8-byte fields), padded to 64 bytes. (Checked
// through sizes: NVRTC 13.0 has no __builtin_offsetof.)
static_assert(sizeof(TmaDesc) == 128 && alignof(AttnParams) <= 64 && sizeof(AttnParams) % 8 == 0,
              "HopperParams layout");
static_assert(3 * sizeof(TmaDesc) + sizeof(AttnParams) + sizeof(long long) == 640,
              "HopperParams layout");
static_assert(sizeof(HopperParams) == 768, "HopperParams layout");

// T = float (TERMS = 1: one-pass TF32, 3: 3xTF32 split products; notes/FLOAT32.md, "Hopper wgmma
// form"): the producer warpgroup prepares every tile before the consumers see it. TMA lands Q, K
// and V on "landed" barriers; the producer's 128 threads round Q and K to TF32 in place (and
// write their lo parts, x - hi rounded, into tiles of their own for TERMS = 3), transpose V into
// V^T (keys contiguous: tf32 wgmma takes K-major B only) with its hi (and lo) parts, and then
// complete the "full" barriers the consumers wait on. 16-bit T: TERMS = 1 and none of this.
// OP: the operand type the tensor cores see, T for 16-bit T. For T = float, OP = float is the TF32
// form above, OP = fp16_t the fp16-split form (TERMS = 3, "3xfp16"; notes/FLOAT32.md, "fp16
// split"): TMA lands the float32 tiles, and the producer rewrites each one in place as fp16 hi and
// lo parts of x * 2^e (one power of two e per tile, published next to the barriers), panel by
// panel: the float32 panels 2 p and 2 p + 1 (columns 64 p ...) become the fp16 hi and lo panels of
// those 64 columns, in the 16-bit kernel's layout (so V stays N-major, no transpose).
// OP = fp16pre_t: the 3xfp16 form with K and V split once per call (cuflash_split16_kv below)
// instead of per tile by the producer; the tensor cores see fp16_t.
struct alignas(2) fp16pre_t { unsigned short bits; };
template <typename X> struct OperandOf { using type = X; static constexpr bool PRE = false; };
template <> struct OperandOf<fp16pre_t> { using type = fp16_t; static constexpr bool PRE = true; };

template <typename T, int TERMS, int DPAD, int BN, int STAGES, int QSTAGES, int CONSUMERS_,
          typename OP = T>
struct WgmmaConfig {
    using Op = typename OperandOf<OP>::type;
    static constexpr bool PRESPLIT = OperandOf<OP>::PRE;  // K, V split before the launch
    static constexpr bool F32 = sizeof(T) == 4;
    static constexpr bool F16S = F32 && sizeof(OP) == 2;  // the fp16-split form
    static constexpr bool TF32 = F32 && !F16S;
    // One-pass TF32 takes every rescale (common.cuh: softmax_step, RESCALE_LOG2).
    static constexpr bool LAZY = !(F32 && TERMS == 1);
    static constexpr int SPLIT = TF32 && TERMS == 3 ? 2 : 1;  // hi (and lo) copies of each tile
    static constexpr int PITCH = F16S ? 2 : 1;          // operand panels per 64 columns (hi, lo)
    static constexpr int CONSUMERS = CONSUMERS_;        // consumer warpgroups, 64 rows each
    // HSPLIT (3xfp16 at DPAD = 256; notes/FLOAT32.md, "Hopper 3xfp16 at D = 256"): the two
    // consumers share the same 64 rows, consumer c owning head-dim columns [128 c, 128 c + 128)
    // of S's operands and of O; their partial scores are added through shared memory (XCH).
    static constexpr bool HSPLIT = F16S && DPAD > 128;
    static constexpr int BM = HSPLIT ? 64 : 64 * CONSUMERS;  // query rows per block
    static constexpr int DCOLS = HSPLIT ? DPAD / 2 : DPAD;     // head-dim columns a consumer owns
    static constexpr int THREADS = 128 * (CONSUMERS + 1);
    static constexpr int EPP = 128 / static_cast<int>(sizeof(OP));  // operand elements per panel row
    static constexpr int KSTEP = 32 / static_cast<int>(sizeof(OP));  // k of one wgmma: 16 or 8
    static constexpr int PANELS = DPAD / EPP;           // 128-byte swizzled panels of columns
    static constexpr int RAW_EPP = 128 / static_cast<int>(sizeof(T));  // as TMA writes them
    static constexpr int RAW_PANELS = DPAD / RAW_EPP;
    static constexpr int Q_PANEL = BM * 128;            // bytes per panel
    static constexpr int KV_PANEL = BN * 128;
    static constexpr int Q_BYTES = PITCH * PANELS * Q_PANEL;     // one Q buffer (of QSTAGES)
    static constexpr int KV_BYTES = PITCH * PANELS * KV_PANEL;  // one K or one V tile
    // float: V^T tiles (DPAD rows of BN keys, panels of 32 keys) and one staging buffer for the
    // V tile as TMA writes it; three more barriers per stage and Q buffer ("landed").
    static constexpr int VT_PANEL = DPAD * 128;
    static constexpr int VRAW_BYTES = TF32 ? KV_BYTES : 0;
    static constexpr int BAR_BYTES = 8 * (2 * QSTAGES + 4 * STAGES + (F32 ? QSTAGES + 2 * STAGES : 0));
    // F16S: the tiles' exponents (Q buffers, K stages, V stages) and 4 words for the producer's
    // max reduction.
    static constexpr int EXP_BYTES = F16S ? (4 * (QSTAGES + 2 * STAGES + 4) + 7) / 8 * 8 : 0;
    // HSPLIT: one 64 x BN float32 buffer of partial scores per consumer (+ 8: 16-byte alignment).
    static constexpr int XCH_BYTES = HSPLIT ? 8 + 2 * 64 * BN * 4 : 0;
    // + 1024: the dynamic shared memory base is only 16-byte aligned; we round it up.
    static constexpr int SMEM = 1024 + SPLIT * (QSTAGES * Q_BYTES + 2 * STAGES * KV_BYTES) +
                                VRAW_BYTES + BAR_BYTES + EXP_BYTES + XCH_BYTES;
    static constexpr int NT_S = BN / 8;                 // n8 tiles of scores per 16-row slab
    static constexpr int NT_O = DCOLS / 8;              // n8 tiles of O per consumer
    // setmaxnreg: the producer keeps 24 registers (56 for float, whose producer threads prepare
    // tiles; 72 for the 3xfp16 form with three stages, whose producer keeps two tiles' loads in
    // flight: NVRTC 13.0 spilled 12-32 bytes there with 56 or 64), the consumers share the rest
    // of the pool (a multiple of 8, at most 240): 240 with two consumers, 160 with three (float:
    // 224 with two; 3xfp16 with three stages 216).
    static constexpr int PRODUCER_REGS = (F16S && (STAGES > 2 || PRESPLIT)) ? 72 : F32 ? 56 : 24;
    // The pool setmaxnreg moves registers within: what the block was launched with, ptxas's
    // count for 128 (CONSUMERS + 1) threads at one block per SM (168 a thread with two
    // consumers, 128 with three), not the SM's 65536. A consumer's setmaxnreg.inc waits until
    // the producer has given back enough, so a budget over the pool hangs every launch (it did:
    // 64 + 224 with two consumers, H200 2026-12-02).
    static constexpr int LAUNCH_REGS = 65536 / (128 * (CONSUMERS + 1)) / 8 * 8;
    static constexpr int POOL_REGS = LAUNCH_REGS * 128 * (CONSUMERS + 1);
    static constexpr int CONSUMER_REGS_RAW = (POOL_REGS - PRODUCER_REGS * 128) / (128 * CONSUMERS);
    static constexpr int CONSUMER_REGS =
        (CONSUMER_REGS_RAW > 240 ? 240 : CONSUMER_REGS_RAW) / 8 * 8;
    static_assert(CONSUMERS == 2 || CONSUMERS == 3, "two or three consumer warpgroups");
    static_assert(!HSPLIT || (CONSUMERS == 2 && DPAD == 256), "HSPLIT: two halves of 128");
    static_assert(QSTAGES == 1 || QSTAGES == 2, "one or two Q buffers");
    static_assert(DPAD % 64 == 0 && DPAD <= 256, "DPAD must be 64, 128, 192 or 256");
    static_assert(BN % 16 == 0 && BN >= 16 && BN <= 256, "BN must be a multiple of 16, <= 256");
    static_assert(PRODUCER_REGS * 128 + CONSUMER_REGS * 128 * CONSUMERS <= POOL_REGS,
                  "setmaxnreg budgets within the block's launch registers");
    static_assert(TERMS == 1 || (F32 && TERMS == 3), "TERMS: 1, or 3 for float");
    static_assert(sizeof(OP) == sizeof(T) || (F16S && TERMS == 3), "OP: T, or fp16_t for 3xfp16");
    static_assert(!PRESPLIT || F16S, "fp16pre_t: the 3xfp16 form only");
    static_assert(!TF32 || (BN % 32 == 0 && (DPAD / 4) * (BN / 4) % 128 == 0),
                  "float: V^T panels of 32 keys, whole transpose passes");
    static_assert(SMEM <= 232448, "shared memory of one block (227 KiB)");
};

// float32 tile preparation by the producer warpgroup (ptid = 0..127). Shared-memory accesses by
// address, 16 bytes a thread.
__device__ __forceinline__ float4 lds_v4(unsigned int a) {
    float4 r;
    asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                 : "=f"(r.x), "=f"(r.y), "=f"(r.z), "=f"(r.w) : "r"(a) : "memory");
    return r;
}
__device__ __forceinline__ void sts_v4(unsigned int a, float4 v) {
    asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n"
                 :: "r"(a), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w) : "memory");
}
__device__ __forceinline__ float tf32_round(float x) { return __uint_as_float(to_tf32(x)); }
// Generic-proxy writes to shared memory made visible to the async proxy (wgmma reads).
__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// ASYNC_O (the O epilogue through shared memory; see fwd_wgmma_body): one row of O leaves as a
// bulk copy shared -> global (cp.async.bulk, no tensor map: a row is contiguous in both), bytes a
// multiple of 16 and both addresses 16-byte aligned. The copies of a thread form one bulk group
// per commit; wait_read<0> returns once the thread's copies have read their shared memory (the
// buffer may be written again), wait_all<0> once their writes are done.
__device__ __forceinline__ void bulk_store_row(void* dst, unsigned int src, unsigned int bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n"
                 :: "l"(dst), "r"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_commit() {
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
__device__ __forceinline__ void bulk_wait_read0() {
    asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}
__device__ __forceinline__ void bulk_wait_all0() {
    asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}
// Four values as TF32: hi = tf32(x) at address hi, and for TERMS = 3 lo = tf32(x - hi) at lo.
template <int TERMS>
__device__ __forceinline__ void store_split(unsigned int hi, unsigned int lo, const float4& x) {
    const float4 h = make_float4(tf32_round(x.x), tf32_round(x.y), tf32_round(x.z),
                                 tf32_round(x.w));
    sts_v4(hi, h);
    if constexpr (TERMS == 3)
        sts_v4(lo, make_float4(tf32_round(x.x - h.x), tf32_round(x.y - h.y),
                               tf32_round(x.z - h.z), tf32_round(x.w - h.w)));
}
// Round a tile to TF32 in place, and for TERMS = 3 write its lo parts at the same offsets of the
// lo tile. Elementwise, so the swizzled layout does not matter.
template <int TERMS, int BYTES>
__device__ __forceinline__ void split_tile(unsigned int hi, unsigned int lo, int ptid) {
    static_assert(BYTES % (128 * 16) == 0, "whole passes");
#pragma unroll 4
    for (int off = ptid * 16; off < BYTES; off += 128 * 16)
        store_split<TERMS>(hi + off, lo + off, lds_v4(hi + off));
}
// Component c % 4 of v (selects, no local memory: c differs between threads).
__device__ __forceinline__ float comp4(const float4& v, int c) {
    c &= 3;
    return c == 0 ? v.x : c == 1 ? v.y : c == 2 ? v.z : v.w;
}
// V (BN keys x DPAD, as TMA wrote it: panels of 32 columns, 128-byte rows, 128-byte swizzle) ->
// V^T (DPAD rows x BN keys: panels of 32 keys, DPAD rows of 128 bytes each, the same swizzle),
// rounded to TF32 (TERMS = 3: lo parts into the lo tile). Within each group of 8 keys, key k
// goes to position k / 2 + 4 (k % 2): the consumers' P fragment holds keys 2 t and 2 t + 1 of
// a k8 step where the wgmma's A layout has columns t and t + 4 (attn_wgmma.cu: pack_p_tf32), so
// both operands see the same key order. A unit of work: keys kb + e + {0, 2, 4, 6} (their
// positions kb + 4 e + {0..3}: one 16-byte chunk of a V^T row) x 4 columns 4 d4 + {0..3}: four
// 16-byte reads and four 16-byte writes. Lanes of a unit pass take consecutive d4 (reads:
// one row, conflict-free), and write their four rows rotated by (d4 / 2) % 4 so that the 8
// lanes of a write phase hit 8 different swizzled chunks.
template <int TERMS, int DPAD, int BN>
__device__ __forceinline__ void transpose_v(unsigned int vraw, unsigned int vt, unsigned int vt_lo,
                                            int ptid) {
    constexpr int D4 = DPAD / 4, UNITS = D4 * (BN / 4);
#pragma unroll 1
    for (int u = ptid; u < UNITS; u += 128) {
        const int d4 = u % D4, ke = u / D4;
        const int e = ke % 2, kb = (ke / 2) * 8;
        float4 x[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int key = kb + e + 2 * i;
            x[i] = lds_v4(vraw + (d4 / 8) * (BN * 128) + key * 128 +
                          (((d4 % 8) ^ (key % 8)) << 4));
        }
        const int pos = kb + 4 * e;  // first of the unit's four V^T columns
        const int rot = (d4 / 2) % 4;
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int c = (r + rot) & 3;
            const int row = 4 * d4 + c;
            const unsigned int off = (pos / 32) * (DPAD * 128) + row * 128 +
                                     ((((pos % 32) / 4) ^ (row % 8)) << 4);
            store_split<TERMS>(vt + off, vt_lo + off,
                               make_float4(comp4(x[0], c), comp4(x[1], c), comp4(x[2], c),
                                           comp4(x[3], c)));
        }
    }
}

// After the wait that completes an accumulator: fence it (no copy of it is scheduled earlier)
// and, for TERMS = 3, add the part accumulated apart (IEEE float32 additions).
template <int TERMS, int N, int M>
__device__ __forceinline__ void products_in(float (&acc)[N], float (&part)[M]) {
    fence_regs(acc);
    if constexpr (TERMS == 3) {
        static_assert(M == N, "the part has the accumulator's shape");
        fence_regs(part);
#pragma unroll
        for (int i = 0; i < N; ++i) acc[i] += part[i];
    }
}

// Promoted products with two steps in flight (TERMS = 3): issue(kk, t) issues step kk's products
// (the large one from zero into t) as one commit group, take(kk, t) adds t where it belongs once
// the group is in, and last() runs when the last step is out (PINGPONG: the turn passes). t[0]
// and t[1] alternate.
template <int KS, int N, typename Issue, typename Take, typename Last>
__device__ __forceinline__ void steps_in_flight(float (&t)[2][N], const Issue& issue,
                                                const Take& take, const Last& last) {
    static_assert(KS >= 2, "two steps in flight");
    issue(0, t[0]);
    issue(1, t[1]);
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
        float(&tt)[N] = t[kk % 2];
        if (kk + 1 < KS) wgmma_wait<1>();
        else wgmma_wait<0>();
        fence_regs(tt);
        take(kk, tt);
        if (kk + 2 < KS) issue(kk + 2, tt);
        if (kk + 2 == KS) last();
    }
}

// A zero that ptxas cannot prove is zero, made from every x[i]: an instruction that takes it
// waits for all of x (ptxas orders plain arithmetic by its data only; an empty asm taking x
// binds NVVM alone). x's bits ANDed, exponent cleared, are a finite float: times 0 it is +0,
// whose integer is 0.
template <int N>
__device__ __forceinline__ unsigned int zero_after(const float* x) {
    unsigned int b = 0x007fffffu;
#pragma unroll
    for (int i = 0; i < N; ++i) b &= __float_as_uint(x[i]);
    unsigned int z;
    asm("{\n.reg .f32 t;\nmul.rn.f32 t, %1, 0f00000000;\ncvt.rzi.u32.f32 %0, t;\n}"
        : "=r"(z) : "f"(__uint_as_float(b)));
    return z;
}

// P (the scores' accumulator fragment after the softmax) as the A operand of the tf32 P V
// wgmmas: k8 step i is n8 tile i; the thread holds keys 8 i + 2 t4 (+1) of rows g and g + 8,
// which the A layout (columns t4 and t4 + 4 of rows g and g + 8) takes as columns t4 and t4 + 4:
// V^T's keys are stored in that order (transpose_v). TERMS = 3: lo = tf32(p - hi).
template <int TERMS, int NT, int NL>
__device__ __forceinline__ void pack_p_tf32(const float (&s)[NT][4], unsigned int (&hi)[NT][4],
                                            unsigned int (&lo)[NL][4]) {
    static_assert(NL == (TERMS == 3 ? NT : 1), "lo parts for TERMS = 3 only");
#pragma unroll
    for (int i = 0; i < NT; ++i) {
        const float v[4] = {s[i][0], s[i][2], s[i][1], s[i][3]};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            hi[i][e] = to_tf32(v[e]);
            if constexpr (TERMS == 3) lo[i][e] = to_tf32(v[e] - __uint_as_float(hi[i][e]));
        }
    }
}

// ---- fp16-split form (OP = fp16_t, TERMS = 3; notes/FLOAT32.md, "fp16 split"): the tile
// exponent, the split and P's split are in fp16split.cuh (shared with attn_mma.cu's 3xfp16 form).
__device__ __forceinline__ void sts_u4(unsigned int a, unsigned int x, unsigned int y,
                                       unsigned int z, unsigned int w) {
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n"
                 :: "r"(a), "r"(x), "r"(y), "r"(z), "r"(w) : "memory");
}
__device__ __forceinline__ void st_shared_s32(unsigned int a, int v) {
    asm volatile("st.shared.b32 [%0], %1;\n" :: "r"(a), "r"(v) : "memory");
}
__device__ __forceinline__ int ld_shared_s32(unsigned int a) {
    int v;
    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(a) : "memory");
    return v;
}
// One float32 tile of ROWS rows (TMA's layout: panels of 32 columns, 128-byte rows, 128-byte
// swizzle) rewritten in place as fp16 hi and lo panels of x * 2^e (the 16-bit layout: panels of 64
// columns, hi panel of columns 64 q at float32 panel 2 q, lo panel at 2 q + 1), e published at
// exp_slot. Pass 1: max |x| over the tile's finite values (finite_key; warp shuffles, 4 shared
// words at red, one named barrier among the producer's 128 threads). Pass 2: a unit is row r, fp16 chunk c (columns 8 c ... of
// the 64) of one panel pair: it reads two float32 chunks of row r of the pair and writes one hi
// and one lo chunk of the same row, so the 8 units of a pair row (8 lanes of one warp) read and
// write the same 256 bytes and nothing else: a __syncwarp between their reads and writes is
// enough. Lanes 4..7 of a pair row read their odd chunk first, so that the 8 lanes of each read
// hit 8 different chunks of the swizzle.
template <int ROWS, int DPAD>
__device__ __forceinline__ void split16_tile(unsigned int tile, unsigned int red,
                                             unsigned int exp_slot, int ptid, int bar) {
    constexpr int BYTES = ROWS * DPAD * 4;
    constexpr int PANEL = ROWS * 128;
    constexpr int UNITS = ROWS * (DPAD / 64) * 8;
    static_assert(BYTES % (128 * 16) == 0 && UNITS % 128 == 0 && ROWS % 4 == 0, "whole passes");
    unsigned int mx = FINITE_KEY0;
#pragma unroll 4
    for (int off = ptid * 16; off < BYTES; off += 128 * 16) {
        const float4 v = lds_v4(tile + off);
        mx = max(mx, max(max(finite_key(v.x), finite_key(v.y)),
                         max(finite_key(v.z), finite_key(v.w))));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = max(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    if (ptid % 32 == 0) st_shared_s32(red + 4 * (ptid / 32), static_cast<int>(mx));
    named_bar_sync(bar, 128);
#pragma unroll
    for (int w = 0; w < 4; ++w)
        mx = max(mx, static_cast<unsigned int>(ld_shared_s32(red + 4 * w)));
    const int e = split16_exponent(mx);
    if (ptid == 0) st_shared_s32(exp_slot, e);
    const float sc = pow2f(e);
#pragma unroll 2
    for (int u = ptid; u < UNITS; u += 128) {
        const int c = u % 8, r = (u / 8) % ROWS, q = u / 8 / ROWS;
        const unsigned int row = tile + 2 * q * PANEL + r * 128;  // row r of float32 panel 2 q
        const unsigned int src = row + (c / 4) * PANEL;  // the float32 panel of columns 8 c ...
        const int first = 2 * (c % 4) + c / 4;           // the chunk this lane reads first
        const float4 x0 = lds_v4(src + ((first ^ (r % 8)) << 4));
        const float4 x1 = lds_v4(src + (((first ^ 1) ^ (r % 8)) << 4));
        __syncwarp();
        const float4 a = (c / 4) ? x1 : x0, b = (c / 4) ? x0 : x1;  // columns 8 c + 0..3, 4..7
        unsigned int h[4], l[4];
        split16_pair(a.x * sc, a.y * sc, h[0], l[0]);
        split16_pair(a.z * sc, a.w * sc, h[1], l[1]);
        split16_pair(b.x * sc, b.y * sc, h[2], l[2]);
        split16_pair(b.z * sc, b.w * sc, h[3], l[3]);
        const unsigned int dst = row + ((c ^ (r % 8)) << 4);
        sts_u4(dst, h[0], h[1], h[2], h[3]);
        sts_u4(dst + PANEL, l[0], l[1], l[2], l[3]);
    }
}
// ---- The once-per-call split of K and V (OP = fp16pre_t; notes/FLOAT32.md, "Where the 3xfp16
// Hopper forward waits"). Block blk = b * n_tiles + t of a tensor's blocks splits key tile t (rows
// BN t ...) of batch entry b of x (float32, batch strides s0, s1, s2 over sizes (., n1, n2), row
// stride sr, Sk x D) into out ((entries, Sk, 2 DPAD + 64) fp16, contiguous): row r holds, for each
// 64 columns q, the fp16 hi then lo parts of x 2^e (columns 128 q ... and 128 q + 64 ...), i.e.
// what split16_tile leaves in a stage, panel for panel, once a 16-bit tensor map with 128-byte
// swizzle loads panels of 64 columns; the tile's e is the int32 at columns 2 DPAD, 2 DPAD + 1 of
// its first row. The same finite_key / split16_exponent / split16_pair over the same values (zeros
// past Sk and D, as TMA fills the tile) give bitwise the in-place split's operands. Version 2: the
// tile is read once, into registers (a unit is 8 columns of a row: two 16-byte loads, a 16-byte
// store of its hi and one of its lo parts; SPLIT16_THREADS threads, UNITS / SPLIT16_THREADS units
// each), where version 1 read it twice in 4-byte loads and stored 4 bytes at a time: at D = 256, S
// = 512 the pass took about 0.3 ms for K and V, half the bandwidth a copy reaches
// (notes/FLOAT32.md, "The split pass"). Version 3: K and V in one launch (blocks [0, first_v) split
// K, the rest V), where version 2 launched once for each and paid each launch's last, partly filled
// wave and the gap between them. Needs (checked on the host: _launch.presplit_kv) x, sr and the
// batch strides 16-byte aligned and D % 8 == 0, as the Hopper kernel's tensor maps do.
struct Split16Params {
    const float* x;
    unsigned short* out;
    long long s0, s1, s2, sr, n1, n2, sk, d, n_tiles;
};
struct Split16Pair {
    Split16Params k, v;
    long long first_v;  // blocks of K: key tiles x batch entries of k
};
static_assert(sizeof(Split16Pair) == 23 * 8, "_launch.SPLIT16_PAIR_DTYPE");
constexpr int SPLIT16_THREADS = 256;
// __grid_constant__: `a` refers to one of the two halves in the parameter space (no local copy).
template <int DPAD, int BN>
__global__ void __launch_bounds__(SPLIT16_THREADS)
cuflash_split16_kv(const __grid_constant__ Split16Pair p) {
    constexpr int W = 2 * DPAD + 64;
    constexpr int UNITS = BN * DPAD / 8, PER = UNITS / SPLIT16_THREADS;
    static_assert(UNITS % SPLIT16_THREADS == 0 && DPAD % 64 == 0, "whole units a thread");
    const bool is_v = blockIdx.x >= p.first_v;
    const Split16Params& a = is_v ? p.v : p.k;
    const long long blk = is_v ? blockIdx.x - p.first_v : blockIdx.x;
    const long long b = blk / a.n_tiles;
    const int r0 = static_cast<int>(blk % a.n_tiles) * BN;
    const long long i2 = b % a.n2, i1 = (b / a.n2) % a.n1, i0 = b / a.n2 / a.n1;
    const float* x = a.x + i0 * a.s0 + i1 * a.s1 + i2 * a.s2;
    unsigned short* out = a.out + b * a.sk * W;
    const int tid = threadIdx.x, rows = static_cast<int>(min(static_cast<long long>(BN), a.sk - r0));
    const int d = static_cast<int>(a.d);
    // unit u = tid + SPLIT16_THREADS i: row u / (DPAD / 8), columns 8 (u % (DPAD / 8)) ...
    float4 v[PER][2];
    unsigned int mx = FINITE_KEY0;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int u = tid + SPLIT16_THREADS * i, r = u / (DPAD / 8), c = 8 * (u % (DPAD / 8));
        const bool in = r < rows && c < d;  // d % 8 == 0: a unit is all in or all out
        const float4* src = reinterpret_cast<const float4*>(x + (r0 + r) * a.sr + c);
        v[i][0] = in ? __ldg(src) : make_float4(0.f, 0.f, 0.f, 0.f);
        v[i][1] = in ? __ldg(src + 1) : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int h = 0; h < 2; ++h)
            mx = max(mx, max(max(finite_key(v[i][h].x), finite_key(v[i][h].y)),
                             max(finite_key(v[i][h].z), finite_key(v[i][h].w))));
    }
    __shared__ unsigned int red[SPLIT16_THREADS / 32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = max(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    if (tid % 32 == 0) red[tid / 32] = mx;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < SPLIT16_THREADS / 32; ++w) mx = max(mx, red[w]);
    const int e = split16_exponent(mx);
    const float sc = pow2f(e);
    if (tid == 0) *reinterpret_cast<int*>(out + static_cast<long long>(r0) * W + 2 * DPAD) = e;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int u = tid + SPLIT16_THREADS * i, r = u / (DPAD / 8), c = 8 * (u % (DPAD / 8));
        if (r >= rows) continue;
        unsigned int h[4], l[4];
        split16_pair(v[i][0].x * sc, v[i][0].y * sc, h[0], l[0]);
        split16_pair(v[i][0].z * sc, v[i][0].w * sc, h[1], l[1]);
        split16_pair(v[i][1].x * sc, v[i][1].y * sc, h[2], l[2]);
        split16_pair(v[i][1].z * sc, v[i][1].w * sc, h[3], l[3]);
        unsigned short* o = out + static_cast<long long>(r0 + r) * W + (c / 64) * 128 + c % 64;
        *reinterpret_cast<uint4*>(o) = make_uint4(h[0], h[1], h[2], h[3]);
        *reinterpret_cast<uint4*>(o + 64) = make_uint4(l[0], l[1], l[2], l[3]);
    }
}

// The work items (batch entry, query block) of one block, in order. Items are grouped into slots;
// block b takes slots b, b + gridDim.x, ... (the grid may be smaller than the number of slots:
// persistent launch). Without PAIRS a slot is one query block, heaviest first within a batch
// entry. With PAIRS (the causal mask, where query block m needs m + 1 key tiles) a slot is the
// pair of query blocks nm - 1 - r and r, so every slot holds nm + 1 tiles of work (the middle
// block of an odd nm comes alone): a static round-robin over slots is then balanced, where one
// over single blocks gave each block of a persistent launch the same query block in every round
// when gridDim.x % nm == 0 (up to 22% slower on the H200 than one block per item).
// ONE (the varlen twin): the consecutive slots [first, end) of one batch entry (its grid is not a
// multiple of the view's slots; end - first = the launch's group, or fewer at the entry's end).
template <bool PAIRS, bool ONE = false>
struct WorkWalk {
    unsigned int nm, per_b, n_slots, slot, half;
    // first: the block's first slot (blockIdx.x; a varlen twin's view renumbers it); end: ONE's
    // bound (unused otherwise).
    __device__ __forceinline__ WorkWalk(const AttnParams& p, unsigned int first,
                                        unsigned int end = 0)
        : nm(static_cast<unsigned int>(p.n_mblocks)),
          per_b(PAIRS ? (nm + 1) / 2 : nm),
          n_slots(ONE ? end : per_b * static_cast<unsigned int>(p.nb0 * p.nb1 * p.nb2)),
          slot(first), half(0) {}
    __device__ __forceinline__ bool next(BlockCoord& c) {
        if (slot >= n_slots) return false;
        const unsigned int r = slot % per_b;
        c.b = slot / per_b;
        c.mblock = half ? r : nm - 1 - r;
        if (PAIRS && half == 0 && r != nm - 1 - r) {
            half = 1;
        } else {
            half = 0;
            if constexpr (ONE) slot += 1;
            else slot += gridDim.x;
        }
        return true;
    }
};

// Key tiles of BN keys that query rows [row0, row0 + rows) need: none past Sq, and under the causal
// mask only up to the last key the last of those rows sees. The producer loads a block's tiles
// (rows = BM); each consumer computes only its own 64 rows' tiles: under the mask the upper
// warpgroups of a block skip a diagonal tile wherever a tile boundary falls between their rows'
// last keys (D = 256, BN = 80, S = 512: 32 warpgroup-tiles instead of 36 per four query
// blocks), and rows past Sq in a block's tail compute nothing.
template <bool CAUSAL, int BN>
__device__ __forceinline__ int tiles_needed(int row0, int rows, int sq, int sk) {
    return row0 >= sq ? 0 : (keys_needed<CAUSAL>(row0, rows, sq, sk) + BN - 1) / BN;
}

// A variant's window (variants.cuh: key_range) narrows the key tiles of query rows [row0, row0 +
// BM) to [*jt0, *jt0 + *n) of the causal count n that tiles_needed gave (unchanged without a
// window: jt0 = 0). The producer (for the block's rows) and every consumer (for the block's rows
// too: the range is the block's, so that their counts match the tiles loaded) call it with the
// same bound policy. An empty range gives n = 0.
template <int BN, typename V>
__device__ __forceinline__ void window_tiles(const V& var, int row0, int bm, int sq, int sk,
                                             int& jt0, int& n) {
    if constexpr (V::HAS_WINDOW) {
        long long j0, j1;
        var.key_range(row0, min(row0 + bm, sq), j0, j1, sk);
        jt0 = static_cast<int>(j0 / BN);
        n = max(0, min(n, static_cast<int>((j1 + BN - 1) / BN)) - jt0);
    }
}

// Packed variable-length batches (cuflash_fwd_wgmma_varlen, attention_varlen): the segment view
// of the block's (sequence, head) (common.cuh: fwd_varlen_move; n_mblocks the sequence's own
// query blocks), the block's first work slot in the view's numbering, and the sequence's first
// query row and key as row offsets of the tensor-map coordinates. Built in shared memory by
// thread 0 of the twin before the body runs.
struct WgmmaVarlenView {
    AttnParams a;
    unsigned int slot, end;  // the block's slots [slot, end) in the view's numbering
    int live;
    int q_row0, k_row0;
};

template <typename T, int TERMS, int DPAD, int BN, int STAGES, int QSTAGES, int CONSUMERS,
          bool OVERLAP, bool PINGPONG, bool CAUSAL, typename OP, typename V, bool VARLEN = false,
          bool ASYNC_O = false>
__device__ __forceinline__ void fwd_wgmma_body(const HopperParams& hp, const VariantParams& vp,
                                               const WgmmaVarlenView* vv = nullptr) {
    using Cfg = WgmmaConfig<T, TERMS, DPAD, BN, STAGES, QSTAGES, CONSUMERS, OP>;
    using Op = typename Cfg::Op;
    constexpr bool F32 = Cfg::F32;
    constexpr bool F16S = Cfg::F16S, TF32 = Cfg::TF32;
    static_assert(!(OVERLAP && TERMS == 3), "TERMS = 3 computes S with waits inside (scores3)");
    static_assert(!Cfg::HSPLIT || !PINGPONG, "HSPLIT: the consumers meet at every tile");
    static_assert(!Cfg::HSPLIT || !VARLEN, "HSPLIT (float32 D = 256) has no varlen twin");
    // ASYNC_O (cuflash_fwd_wgmma_ao): each warp stages its 16 rows of O in shared memory of its
    // own and sends them out by bulk copies; the warp waits for those copies' reads only before
    // it stages the next item's O, so the consumer goes on to the next item's scores while O is
    // on its way. Where O's rows are dense (row stride D = DPAD) the 16 rows are staged at 2 DPAD
    // bytes a row and leave as one copy of 16 rows (unless some are past Sq or go to the exact
    // path); otherwise at OST_PITCH = 2 DPAD + 64 bytes a row (the two rows that a phase of 8
    // lanes of a 16-byte store writes then fall in different halves of the banks; the dense
    // layout has those 2-way conflicts), one copy per row, issued by lanes 0-15 (ptxas loops over
    // the lanes: the copy takes uniform registers).
    static_assert(!ASYNC_O || (!F32 && !Cfg::HSPLIT && !VARLEN && V::PLAIN),
                  "ASYNC_O: the plain 16-bit kernel only");
    constexpr unsigned int OST_PITCH = 2 * DPAD + 64;
    constexpr unsigned int OST_WARP = 16 * OST_PITCH;
    static_assert(!ASYNC_O || Cfg::SMEM + 128 + 4 * CONSUMERS * OST_WARP <= 232448,
                  "ASYNC_O: the staging rows do not fit beside the tiles");
    // VARLEN: the segment view (its pointers, lengths and query-block count) in place of the
    // launch's parameters, and its row offsets on the tensor maps' row coordinates.
    const AttnParams& p = *(VARLEN ? &vv->a : &hp.a);
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    // Q buffers, K stages, V stages (float: V^T), each followed by its lo copies for 3xTF32
    // (Q_LO, KV_LO bytes on; 3xfp16: each hi panel followed by its lo panel, Q_LO, KV_LO bytes
    // on), then (TF32) the V staging buffer, the barriers and (F16S) the tiles' exponents.
    constexpr unsigned int Q_LO = F16S ? Cfg::Q_PANEL : QSTAGES * Cfg::Q_BYTES;
    constexpr unsigned int KV_LO = F16S ? Cfg::KV_PANEL : STAGES * Cfg::KV_BYTES;
    // Bytes from one operand panel (64 16-bit or 32 float columns) to the next.
    constexpr unsigned int Q_PSTEP = Cfg::PITCH * Cfg::Q_PANEL;
    constexpr unsigned int KV_PSTEP = Cfg::PITCH * Cfg::KV_PANEL;
    const unsigned int q_s = (smem_addr(smem_raw) + 1023u) & ~1023u;
    const unsigned int k_s = q_s + Cfg::SPLIT * QSTAGES * Cfg::Q_BYTES;  // + stage * KV_BYTES
    const unsigned int v_s = k_s + Cfg::SPLIT * STAGES * Cfg::KV_BYTES;
    const unsigned int vraw_s = v_s + Cfg::SPLIT * STAGES * Cfg::KV_BYTES;
    const unsigned int bars = vraw_s + Cfg::VRAW_BYTES;
    // F16S: the exponent e of each prepared tile (its operands hold x * 2^e).
    const unsigned int exps = bars + Cfg::BAR_BYTES;
    const auto q_exp = [exps](unsigned int qb) { return exps + 4u * qb; };
    const auto k_exp = [exps](int st) { return exps + 4u * (QSTAGES + st); };
    const auto v_exp = [exps](int st) { return exps + 4u * (QSTAGES + STAGES + st); };
    const unsigned int red = exps + 4u * (QSTAGES + 2 * STAGES);  // the producer's max reduction
    // HSPLIT: the consumers' partial-score buffers (16-byte aligned; exps is 8-byte aligned).
    const unsigned int xch = (exps + Cfg::EXP_BYTES + 15u) & ~15u;
    // ASYNC_O: the consumers' O staging rows, warp by warp (128-byte aligned).
    [[maybe_unused]] const unsigned int ost = (xch + Cfg::XCH_BYTES + 127u) & ~127u;
    // Q buffer qb holds the Q of work items wi with wi % QSTAGES == qb.
    const auto q_full = [bars](unsigned int qb) { return bars + 8u * qb; };
    const auto q_empty = [bars](unsigned int qb) { return bars + 8u * (QSTAGES + qb); };
    constexpr int KV_BAR0 = 2 * QSTAGES;
    const auto k_full = [bars](int st) { return bars + 8u * (KV_BAR0 + st); };
    const auto v_full = [bars](int st) { return bars + 8u * (KV_BAR0 + STAGES + st); };
    const auto k_empty = [bars](int st) { return bars + 8u * (KV_BAR0 + 2 * STAGES + st); };
    const auto v_empty = [bars](int st) { return bars + 8u * (KV_BAR0 + 3 * STAGES + st); };
    // float: where TMA completes (the producer then prepares the tile and completes "full").
    constexpr int LAND0 = KV_BAR0 + 4 * STAGES;
    const auto q_land = [bars](unsigned int qb) { return bars + 8u * (LAND0 + qb); };
    const auto k_land = [bars](int st) { return bars + 8u * (LAND0 + QSTAGES + st); };
    const auto v_land = bars + 8u * (LAND0 + QSTAGES + STAGES);  // the one staging buffer
    // F16S: V lands in its stage (prepared in place), one barrier per stage.
    const auto v_land_st = [bars](int st) { return bars + 8u * (LAND0 + QSTAGES + STAGES + st); };

    const int tid = threadIdx.x;
    const int sq = static_cast<int>(p.sq), sk = static_cast<int>(p.sk);
    const int diag = sk - sq;  // row i sees keys j <= i + diag
    // Producer and consumers walk the same items (WorkWalk); in a persistent launch the producer
    // loads the next item's Q and first K/V tiles while the consumers finish the current one.

    if (tid == 0) {
        for (int qb = 0; qb < QSTAGES; ++qb) {
            mbar_init(q_full(qb), 1);
            mbar_init(q_empty(qb), 4 * Cfg::CONSUMERS);  // one arrival per consumer warp
        }
        for (int st = 0; st < STAGES; ++st) {
            mbar_init(k_full(st), 1);
            mbar_init(v_full(st), 1);
            mbar_init(k_empty(st), 4 * Cfg::CONSUMERS);
            mbar_init(v_empty(st), 4 * Cfg::CONSUMERS);
        }
        if constexpr (F32) {
            for (int qb = 0; qb < QSTAGES; ++qb) mbar_init(q_land(qb), 1);
            for (int st = 0; st < STAGES; ++st) mbar_init(k_land(st), 1);
            if constexpr (F16S) {
                for (int st = 0; st < STAGES; ++st) mbar_init(v_land_st(st), 1);
            } else {
                mbar_init(v_land, 1);
            }
        }
        mbar_fence_init();
    }
    __syncthreads();

    if (tid < 128) {
        // ---- producer warpgroup: one thread issues every copy (float: all 128 threads prepare
        // the tiles; named barrier PREP among them).
        regs_dealloc<Cfg::PRODUCER_REGS>();
        if (!F32 && tid != 0) return;
        const bool issuer = F32 ? tid == 0 : true;
        constexpr int PREP = CONSUMERS + 1;
        // The producer's writes are visible to the wgmmas (async proxy) and every thread is done
        // with its reads; then the issuer completes the consumers' barrier.
        const auto prepared = [&](unsigned int bar) {
            fence_proxy_async();
            named_bar_sync(PREP, 128);
            if (issuer) mbar_arrive(bar);
        };
        const unsigned int n2 = static_cast<unsigned int>(p.nb2);
        const unsigned int n1 = static_cast<unsigned int>(p.nb1);
        const unsigned int cm = static_cast<unsigned int>(hp.coord_mask);
        unsigned int it = 0;  // K/V tiles loaded so far: stage it % STAGES, its use it / STAGES
        unsigned int wi = 0;  // work items so far
        WorkWalk<CAUSAL, VARLEN> walk(p, VARLEN ? vv->slot : blockIdx.x, VARLEN ? vv->end : 0u);
        // Tensor-map row offsets: the sequence's first query row (t = 0) and key (t = 1, 2).
        const int q_row0 = VARLEN ? vv->q_row0 : 0, k_row0 = VARLEN ? vv->k_row0 : 0;
        for (BlockCoord bc; walk.next(bc); ++wi) {
            const int row0 = static_cast<int>(bc.mblock) * Cfg::BM;
            int n_tiles = tiles_needed<CAUSAL, BN>(row0, Cfg::BM, sq, sk);
            const unsigned int ub = static_cast<unsigned int>(bc.b);
            const int ix[3] = {static_cast<int>(ub / n2 / n1), static_cast<int>(ub / n2 % n1),
                               static_cast<int>(ub % n2)};
            // A window: the block's tiles jt0 ... jt0 + n_tiles - 1 (what the consumers compute).
            int jt0 = 0;
            if constexpr (V::HAS_WINDOW) {
                V var;
                var.bind(vp, p.sq, p.sk, ix[0], ix[1], ix[2]);
                window_tiles<BN>(var, row0, Cfg::BM, sq, sk, jt0, n_tiles);
            }
            // Tensor t's coordinates on batch axes 2, 1, 0 (innermost first): the batch index,
            // or 0 where t broadcasts over the axis.
            int c[3][3];
#pragma unroll
            for (int t = 0; t < 3; ++t)
#pragma unroll
                for (int ax = 0; ax < 3; ++ax) c[t][2 - ax] = (cm >> (3 * t + ax)) & 1u ? ix[ax] : 0;
            const auto load = [&](unsigned int dst, const TmaDesc* map, int t, int panel_bytes,
                                  int row, unsigned int bar, unsigned int bytes) {
                mbar_arrive_expect_tx(bar, bytes);
#pragma unroll
                for (int pn = 0; pn < Cfg::RAW_PANELS; ++pn)
                    tma_load_5d(dst + pn * panel_bytes, map, pn * Cfg::RAW_EPP,
                                row + (t == 0 ? q_row0 : k_row0), c[t][0],
                                c[t][1], c[t][2], bar);
            };
            // Q goes into its buffer once the consumers have computed the last scores of the item
            // that used it before (QSTAGES items back); the item's first K tile is requested
            // before that wait, so it is in flight meanwhile. With one buffer that wait holds up
            // every later load until the current item's last scores are in; with two, the
            // producer runs ahead by its K/V stages across item boundaries.
            const auto load_q = [&]() {
                const unsigned int qb = wi % QSTAGES;
                if (!issuer) return;
                if (wi >= QSTAGES) mbar_wait(q_empty(qb), (wi / QSTAGES - 1) & 1);
                load(q_s + qb * Cfg::Q_BYTES, &hp.tm_q, 0, Cfg::Q_PANEL, row0,
                     F32 ? q_land(qb) : q_full(qb), Cfg::Q_BYTES);
            };
            // float: Q rounded in place (and its lo parts) once it has landed.
            const auto prep_q = [&]() {
                if constexpr (F32) {
                    const unsigned int qb = wi % QSTAGES;
                    mbar_wait(q_land(qb), (wi / QSTAGES) & 1u);
                    if constexpr (F16S)
                        split16_tile<Cfg::BM, DPAD>(q_s + qb * Cfg::Q_BYTES, red, q_exp(qb), tid,
                                                    PREP);
                    else
                        split_tile<TERMS, Cfg::Q_BYTES>(q_s + qb * Cfg::Q_BYTES,
                                                        q_s + Q_LO + qb * Cfg::Q_BYTES, tid);
                    prepared(q_full(qb));
                }
            };
            if (n_tiles == 0) {
                load_q();
                prep_q();
            }
            if constexpr (Cfg::PRESPLIT) {
                // K and V come split (cuflash_split16_kv): the issuer loads their 16-bit panels
                // straight into the stages ("full" completes on the bytes, as for 16-bit inputs)
                // after writing the tile's exponent to its slot; the arrive.expect_tx (release)
                // orders that store before the consumers' wait (acquire). Q is split here, once
                // per item, as before.
                // The exponent of K (t = 1) or V (t = 2) tile row / BN: read where it is needed
                // (the producer's 56 registers spilled with both base pointers kept live).
                const auto tile_exp = [&](int t, int row) {
                    const unsigned short* base = static_cast<const unsigned short*>(
                        t == 1 ? hp.kx : hp.vx);
                    const long long off = t == 1
                        ? ix[0] * hp.kx_s0 + ix[1] * hp.kx_s1 + ix[2] * hp.kx_s2 + row * hp.kx_sr
                        : ix[0] * hp.vx_s0 + ix[1] * hp.vx_s1 + ix[2] * hp.vx_s2 + row * hp.vx_sr;
                    return *reinterpret_cast<const int*>(base + off + 2 * DPAD);
                };
                const auto load16 = [&](unsigned int dst, const TmaDesc* map, int t, int row,
                                        unsigned int bar) {
                    mbar_arrive_expect_tx(bar, Cfg::KV_BYTES);
#pragma unroll
                    for (int pn = 0; pn < Cfg::RAW_PANELS; ++pn)
                        tma_load_5d(dst + pn * Cfg::KV_PANEL, map, pn * 64, row + k_row0,
                                    c[t][0], c[t][1], c[t][2], bar);
                };
                // The exponents are read one tile ahead (the item's first ones before its first
                // wait): a read of global memory (L2 or DRAM, ~1 us) then runs under the waits for
                // the stages instead of between a stage coming free and its TMA (ncu, H100, D =
                // 256 S = 512: these 4-byte reads were the kernel's only global loads and
                // L1TEX its largest stall).
                int ke = 0, ve = 0;
                if (issuer && n_tiles > 0) {
                    ke = tile_exp(1, jt0 * BN);
                    ve = tile_exp(2, jt0 * BN);
                }
                for (int j = 0; j < n_tiles; ++j, ++it) {
                    const int st = it % STAGES;
                    const unsigned int use = it / STAGES;
                    const int row = (jt0 + j) * BN;
                    if (issuer) {
                        if (it >= STAGES) mbar_wait(k_empty(st), (use - 1) & 1);
                        st_shared_s32(k_exp(st), ke);
                        load16(k_s + st * Cfg::KV_BYTES, &hp.tm_k, 1, row, k_full(st));
                        // One stage: the next K exponent now, a whole tile before K_{j+1}'s load
                        // needs it; read after V_j, which now waits for Q's split at j = 0 (below),
                        // it was still in flight at K_1's load (H100: -1.5% at S = 4096 there)
                        if (STAGES == 1 && j + 1 < n_tiles) ke = tile_exp(1, row + BN);
                    }
                    if (j == 0) load_q();
                    // One stage (HSPLIT, D = 256): V_0 cannot be requested before the previous
                    // item's last P V frees the stage, and the consumers cannot start this item
                    // before Q is split; Q lands once that item's last scores are in, so it is
                    // split first, under the last P V and the O epilogue, instead of after the
                    // wait for V's stage (where it was on every item's critical path). With more
                    // stages V_0's stage is usually free already and V goes first.
                    if (STAGES == 1 && j == 0) prep_q();
                    if (issuer) {
                        if (it >= STAGES) mbar_wait(v_empty(st), (use - 1) & 1);
                        st_shared_s32(v_exp(st), ve);
                        load16(v_s + st * Cfg::KV_BYTES, &hp.tm_v, 2, row, v_full(st));
                        if (j + 1 < n_tiles) {
                            if (STAGES > 1) ke = tile_exp(1, row + BN);
                            ve = tile_exp(2, row + BN);
                        }
                    }
                    if (STAGES > 1 && j == 0) prep_q();
                }
                continue;
            }
            if constexpr (F16S && STAGES > 2) {
                // 3xfp16 with three or more stages (version 5): the loads run LOOK = STAGES - 1 tiles ahead of the splits.
                // Tile j + LOOK's K and V are requested once tile j is prepared, so their TMA
                // latency hides under the splits of the tiles before; before, each tile's loads
                // were issued at the top of its own iteration and then waited for, so the stages
                // never held a tile ahead (notes/FLOAT32.md, "Hopper 3xfp16 at D = 64"). Both
                // tiles land in their stages and are prepared there (split16_tile).
                constexpr int LOOK = STAGES - 1;
                // tile t of this item is tile gi of the block's walk: stage gi % STAGES
                const auto issue = [&](int t, unsigned int gi) {
                    if (!issuer) return;
                    const int st = gi % STAGES;
                    const unsigned int use = gi / STAGES;
                    if (gi >= STAGES) mbar_wait(k_empty(st), (use - 1) & 1);
                    load(k_s + st * Cfg::KV_BYTES, &hp.tm_k, 1, Cfg::KV_PANEL, (jt0 + t) * BN,
                         k_land(st), Cfg::KV_BYTES);
                    if (gi >= STAGES) mbar_wait(v_empty(st), (use - 1) & 1);
                    load(v_s + st * Cfg::KV_BYTES, &hp.tm_v, 2, Cfg::KV_PANEL, (jt0 + t) * BN,
                         v_land_st(st), Cfg::KV_BYTES);
                };
                if (n_tiles > 0) {
                    issue(0, it);
                    load_q();
                    for (int t = 1; t < LOOK && t < n_tiles; ++t) issue(t, it + t);
                    prep_q();
                }
                for (int j = 0; j < n_tiles; ++j, ++it) {
                    const int st = it % STAGES;
                    const unsigned int use = it / STAGES;
                    mbar_wait(k_land(st), use & 1u);
                    split16_tile<BN, DPAD>(k_s + st * Cfg::KV_BYTES, red, k_exp(st), tid, PREP);
                    prepared(k_full(st));
                    mbar_wait(v_land_st(st), use & 1u);
                    split16_tile<BN, DPAD>(v_s + st * Cfg::KV_BYTES, red, v_exp(st), tid, PREP);
                    prepared(v_full(st));
                    if (j + LOOK < n_tiles) issue(j + LOOK, it + LOOK);
                }
                continue;
            }
            for (int j = 0; j < n_tiles; ++j, ++it) {
                // Stage st held tile it - STAGES; K and V are released separately (K as soon as
                // its scores are computed), so K may come in while the old V is in use.
                const int st = it % STAGES;
                const unsigned int use = it / STAGES;
                if (issuer) {
                    if (it >= STAGES) mbar_wait(k_empty(st), (use - 1) & 1);
                    load(k_s + st * Cfg::KV_BYTES, &hp.tm_k, 1, Cfg::KV_PANEL, (jt0 + j) * BN,
                         F32 ? k_land(st) : k_full(st), Cfg::KV_BYTES);
                }
                if (j == 0) load_q();
                if constexpr (!F32) {
                    if (it >= STAGES) mbar_wait(v_empty(st), (use - 1) & 1);
                    load(v_s + st * Cfg::KV_BYTES, &hp.tm_v, 2, Cfg::KV_PANEL, (jt0 + j) * BN,
                         v_full(st), Cfg::KV_BYTES);
                } else if constexpr (F16S) {
                    // Two stages: tile j is requested at the top of its iteration, after tile
                    // j - 1 is prepared (what the lookahead above would do with STAGES - 1 = 1).
                    // One stage (HSPLIT): V_j can only be requested once P V_{j-1} is done, so it
                    // is requested after K_j is prepared: K_j's split runs under the softmax and
                    // P V of tile j - 1, V_j's under the scores of tile j.
                    const auto load_v = [&]() {
                        if (issuer) {
                            if (it >= STAGES) mbar_wait(v_empty(st), (use - 1) & 1);
                            load(v_s + st * Cfg::KV_BYTES, &hp.tm_v, 2, Cfg::KV_PANEL,
                                 (jt0 + j) * BN, v_land_st(st), Cfg::KV_BYTES);
                        }
                    };
                    if constexpr (STAGES > 1) load_v();
                    if (j == 0) prep_q();
                    mbar_wait(k_land(st), use & 1u);
                    split16_tile<BN, DPAD>(k_s + st * Cfg::KV_BYTES, red, k_exp(st), tid, PREP);
                    prepared(k_full(st));
                    if constexpr (STAGES == 1) load_v();
                    mbar_wait(v_land_st(st), use & 1u);
                    split16_tile<BN, DPAD>(v_s + st * Cfg::KV_BYTES, red, v_exp(st), tid, PREP);
                    prepared(v_full(st));
                } else {
                    // The staging buffer is free: the previous tile's transpose ended in a
                    // PREP barrier.
                    if (issuer)
                        load(vraw_s, &hp.tm_v, 2, Cfg::KV_PANEL, (jt0 + j) * BN, v_land,
                             Cfg::KV_BYTES);
                    if (j == 0) prep_q();
                    mbar_wait(k_land(st), use & 1u);
                    split_tile<TERMS, Cfg::KV_BYTES>(k_s + st * Cfg::KV_BYTES,
                                                     k_s + KV_LO + st * Cfg::KV_BYTES, tid);
                    prepared(k_full(st));
                    mbar_wait(v_land, it & 1u);
                    if (it >= STAGES) mbar_wait(v_empty(st), (use - 1) & 1);
                    transpose_v<TERMS, DPAD, BN>(vraw_s, v_s + st * Cfg::KV_BYTES,
                                                 v_s + KV_LO + st * Cfg::KV_BYTES, tid);
                    prepared(v_full(st));
                }
            }
        }
        return;
    }

    // ---- consumer warpgroups
    regs_alloc<Cfg::CONSUMER_REGS>();
    // Consumer index (rows row0 + 64 * cw ...) and warp within the warpgroup (16 rows each),
    // broadcast from lane 0 so that the compiler knows them to be warp-uniform and keeps them,
    // and the per-item values derived from them, in uniform registers.
    const int cw = __shfl_sync(0xffffffffu, tid / 128, 0) - 1;
    const int warp = __shfl_sync(0xffffffffu, (tid / 32) % 4, 0);
    const int lane = tid % 32;
    const int g = lane / 4, t4 = lane % 4;
    // Units of the scores the softmax sees: raw (the scale folded into exp2) for the plain policy,
    // scaled for a variant (variants.cuh: variant_scores scales, transforms and masks them).
    // AFF: ALiBi's affine form (variants.cuh: Variant::affine, affine_scores_as; 16-bit, causal):
    // the softmax in log2 units (softmax_step_affine), so the lse and the exact path take 1.
    constexpr bool AFF = V::AFFINE && CAUSAL && !F32;
    const float scale_log2 = AFF ? 1.f : softmax_units_log2<V>(p.scale_log2);
    // HSPLIT: both consumers take rows row0 ..., consumer cw the head-dim columns from
    // DCOLS cw (panel pairs DCOLS / 64 cw ...); else consumer cw rows row0 + 64 cw, all columns.
    constexpr bool HSPLIT = Cfg::HSPLIT;
    constexpr int DCOLS = Cfg::DCOLS;
    const int rw = HSPLIT ? 0 : 64 * cw;  // this consumer's first row within the block
    const int cc = HSPLIT ? cw : 0;       // this consumer's head-dim half
    const unsigned int q_col = static_cast<unsigned int>(cc * (DCOLS / 64)) * Q_PSTEP;
    const unsigned int kv_col = static_cast<unsigned int>(cc * (DCOLS / 64)) * KV_PSTEP;
    unsigned int q_wg = q_s + rw * 128 + q_col;  // this consumer's rows and columns in Q (per item)
    const int d = static_cast<int>(p.d);

    // PINGPONG: the consumers take turns to issue their matrix products, in the order 0, 1, ...,
    // so that while one warpgroup runs its softmax the tensor cores work for another, rather than
    // all consumers computing scores at once and then all running the softmax at once. Named
    // barrier 1 + c is "consumer c's turn": c waits on it (bar.sync) after the previous consumer
    // has arrived on it (bar.arrive) having issued its own products. The counts must match, so
    // turns are taken only for the first n_turns tiles of an item, the tiles every consumer
    // computes; a consumer's further tiles (its rows see more keys) go out without a turn. The
    // last consumer opens the first turn and consumer 0 absorbs the last arrival before it exits.
    const auto turn_take = [cw](bool turn) {
        if constexpr (PINGPONG) if (turn) named_bar_sync(1 + cw, 256);
    };
    const auto turn_pass = [cw](bool turn) {
        if constexpr (PINGPONG) if (turn) named_bar_arrive(1 + (cw + 1) % CONSUMERS, 256);
    };
    if (cw == CONSUMERS - 1) turn_pass(true);

    float acc_o[Cfg::NT_O][4];
    // wgmma's accumulator fragment of m64nN is the m16n8 layout of each warp's 16 rows, n8 tile
    // after n8 tile: the same registers viewed as [N / 8][4] or flat [N / 2].
    float(&o_flat)[DCOLS / 2] = reinterpret_cast<float(&)[DCOLS / 2]>(acc_o);
    float s[Cfg::NT_S][4];
    float(&s_flat)[BN / 2] = reinterpret_cast<float(&)[BN / 2]>(s);
    // TERMS = 3: the small products of S (hi lo + lo hi) and one tile's P V apart from the large
    // ones, added in IEEE float32 after the products (the tensor cores' accumulation truncates:
    // notes/FLOAT32.md); O's chain over all key tiles would otherwise lose 2^-23 a k8 step.
    constexpr int SM = TERMS == 3 ? 1 : 0;
    float s2[SM ? Cfg::NT_S : 1][4];
    float(&s2_flat)[SM ? BN / 2 : 4] = reinterpret_cast<float(&)[SM ? BN / 2 : 4]>(s2);
    float ot[SM ? Cfg::NT_O : 1][4];
    float(&ot_flat)[SM ? DCOLS / 2 : 4] = reinterpret_cast<float(&)[SM ? DCOLS / 2 : 4]>(ot);
    // P as the A operand of P V: 16-bit pairs (k16 steps; 3xfp16: hi and lo pairs), or TF32 hi
    // (and lo) values (k8 steps).
    constexpr int NPK = TF32 ? BN / 8 : BN / 16;
    // F16S: the exponents of this item's Q and of the tile being computed (Q hi + lo = Q * 2^eq).
    int eq = 0, ek = 0, ev = 0;
    unsigned int pk[NPK][4];
    unsigned int pl[SM ? NPK : 1][4];
    // S = Q K^T from stage st, DPAD / KSTEP wgmmas of k16 (k8 for float); the k offset inside a
    // 128-byte swizzled row is a plain start-address offset of 32 bytes per step. Issued, not
    // committed.
    const auto issue_s = [&](int st) {
#pragma unroll
        for (int kk = 0; kk < DPAD / Cfg::KSTEP; ++kk) {
            const unsigned int koff = (kk % 4) * 32;
            const unsigned int qa = q_wg + (kk / 4) * Q_PSTEP + koff;
            const unsigned int ka = k_s + st * Cfg::KV_BYTES + (kk / 4) * KV_PSTEP + koff;
            const unsigned long long da = wgmma_desc(qa, 16, 1024);
            const unsigned long long db = wgmma_desc(ka, 16, 1024);
            Wgmma<Op, BN>::ss(s_flat, da, db, kk > 0 ? 1 : 0);
        }
    };
    // TERMS = 3: S with promoted large products. Each k8 step's (3xfp16: k16 step's) hi hi
    // product is formed in a
    // fresh accumulator (scale_d = 0: truncated relative to its own 8 products only) and added
    // to S in IEEE float32, two steps in flight (t[0], t[1] alternate, one commit group per
    // step); the small products chain in s2 (2^-11 of the large ones) and join S at the end.
    // Chaining the large products through the accumulator cost the mma.sync kernel up to 5.8x
    // the naive error on short rows (notes/FLOAT32.md). The turn passes after the last issue.
    // HSPLIT: S' = S'_cw + S'_(1 - cw), this consumer's partial over its 128 columns (the
    // scaled operands' products, before scale_pow2) and the other's. Each thread writes its BN / 2
    // floats to its consumer's buffer in fragment order (float4 i at (128 i + thread) x 16 bytes:
    // conflict-free), both consumers meet (named barrier XB, 256 threads), and each adds the
    // same-thread values of the other's buffer: float addition commutes, so both hold the same S'
    // bit for bit and run the same softmax. The first meeting keeps a buffer from being rewritten
    // before the other consumer has read it at the previous tile; both consumers exchange at
    // every tile of an item (the same rows: the same tiles), so the counts match.
    constexpr int XB = CONSUMERS + 2;  // named barriers: 0 block, 1..CONSUMERS turns, PREP
    const auto add_partner_scores = [&](float (&sf)[BN / 2]) {
        if constexpr (HSPLIT) {
            const unsigned int me = static_cast<unsigned int>(tid % 128) * 16u;
            const unsigned int mine = xch + static_cast<unsigned int>(cw) * (64u * BN * 4u) + me;
            const unsigned int theirs =
                xch + static_cast<unsigned int>(1 - cw) * (64u * BN * 4u) + me;
            named_bar_sync(XB, 256);
#pragma unroll
            for (int i = 0; i < BN / 8; ++i)
                sts_v4(mine + i * 2048u,
                       make_float4(sf[4 * i], sf[4 * i + 1], sf[4 * i + 2], sf[4 * i + 3]));
            named_bar_sync(XB, 256);
#pragma unroll
            for (int i = 0; i < BN / 8; ++i) {
                const float4 x = lds_v4(theirs + i * 2048u);
                sf[4 * i] += x.x;
                sf[4 * i + 1] += x.y;
                sf[4 * i + 2] += x.z;
                sf[4 * i + 3] += x.w;
            }
        }
    };
    float t[TERMS == 3 ? 2 : 1][BN / 2];
    const auto scores3 = [&](int st, bool turn) {
        if constexpr (TERMS == 3) {
            constexpr int KS = DCOLS / Cfg::KSTEP;
            const auto step = [&](int kk, float (&tt)[BN / 2]) {
                const unsigned int koff = (kk % 4) * 32;
                const unsigned int qa = q_wg + (kk / 4) * Q_PSTEP + koff;
                const unsigned int ka =
                    k_s + st * Cfg::KV_BYTES + kv_col + (kk / 4) * KV_PSTEP + koff;
                const unsigned long long da = wgmma_desc(qa, 16, 1024);
                const unsigned long long db = wgmma_desc(ka, 16, 1024);
                wgmma_fence();
                Wgmma<Op, BN>::ss(tt, da, db, 0);
                Wgmma<Op, BN>::ss(s2_flat, da, wgmma_desc(ka + KV_LO, 16, 1024), kk > 0 ? 1 : 0);
                Wgmma<Op, BN>::ss(s2_flat, wgmma_desc(qa + Q_LO, 16, 1024), db, 1);
                wgmma_commit();
            };
            const auto take = [&](int kk, float (&tt)[BN / 2]) {
    #pragma unroll
                for (int i = 0; i < BN / 2; ++i) s_flat[i] = kk == 0 ? tt[i] : s_flat[i] + tt[i];
            };
            steps_in_flight<KS>(t, step, take, [&]() { turn_pass(turn); });
            products_in<TERMS>(s_flat, s2_flat);
            if constexpr (HSPLIT) add_partner_scores(s_flat);
            if constexpr (F16S) scale_pow2(s_flat, -(eq + ek));  // exact: S of x, not x * 2^e
        }
    };
    // O += P V from stage st: BN / 16 wgmmas of k16 (16 keys = 16 rows of 128 bytes per panel,
    // V N-major), or for float BN / 8 wgmmas of k8 on V^T (K-major, panels of 32 keys).
    const auto issue_pv = [&](int st) {
        if constexpr (!F32) {
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk) {
                const unsigned long long db =
                    wgmma_desc(v_s + st * Cfg::KV_BYTES + kk * 16 * 128, Cfg::KV_PANEL, 1024);
                Wgmma<T, DPAD>::rs(o_flat, pk[kk], db, 1);
            }
        } else {
#pragma unroll
            for (int kk = 0; kk < BN / 8; ++kk) {
                const unsigned int va =
                    v_s + st * Cfg::KV_BYTES + (kk / 4) * Cfg::VT_PANEL + (kk % 4) * 32;
                const unsigned long long db = wgmma_desc(va, 16, 1024);
                if constexpr (TERMS == 1) {  // (DCOLS: DPAD, the TF32 forms are never HSPLIT)
                    Wgmma<T, DCOLS>::rs(o_flat, pk[kk], db, 1);
                } else {  // one tile's products from zero in ot, added to O after the wait
                    Wgmma<T, DCOLS>::rs(ot_flat, pk[kk], db, kk > 0 ? 1 : 0);
                    Wgmma<T, DCOLS>::rs(ot_flat, pk[kk], wgmma_desc(va + KV_LO, 16, 1024), 1);
                    Wgmma<T, DCOLS>::rs(ot_flat, pl[kk], db, 1);
                }
            }
        }
    };
    // After the wait that completes S: (TERMS = 3) its small products join the large ones; after
    // the one that completes P V: (TERMS = 3) the tile's products join O.
    const auto scores_in = [&]() { products_in<TERMS>(s_flat, s2_flat); };
    const auto pv_in = [&]() { products_in<TERMS>(o_flat, ot_flat); };
    // F16S: O += P V from stage st, complete on return (the producer's V tile holds V 2^ev, P is
    // split as P 2^P16_LOG2: the tile's sum reaches O through one FFMA by 2^-(P16_LOG2 + ev), a
    // power of two from 2^-133 to 2^107: exact, subnormal included). Per 64 columns of O (one
    // hi/lo panel pair of V) and k16 step, the hi hi product is formed from zero and summed over
    // the tile in IEEE float32 (promoted, as S's large products are): steps 0 and 1 go out
    // together into pv_t[0] and pv_t[1], whose sum stays in pv_t[0], and each later step goes
    // into pv_t[1] and is added once it is in. The small products (hi lo, lo hi) chain over the
    // tile's steps in pv_s and join the sum after the tile; then O = fma(sum, f, O), one
    // rounding of O per tile. The tile's chain of large products through the tensor cores that
    // the 3xTF32 form keeps (attn_wgmma.cu above) is what the model puts at up to 7x the naive
    // error on short rows (tests/fp16split_model.py, notes/FLOAT32.md: "fp16 split"); each step
    // promoted straight into O (version 5, two steps always in flight) rounded O at its own
    // magnitude BN / 16 + 1 times a tile: about twice the error of one rounding a tile on long
    // rows (notes/FLOAT32.md, "O rounded once per tile"). A third buffer for the sum (two steps
    // always in flight) spilled at D = 128 and 256. 64 columns at a time: at D = 128 the
    // accumulators of O, a whole tile's small products and two steps would not fit beside P in
    // the consumers' 224 registers.
    // PV_PIN (the causal head-dim split forms, whose consumers' registers are at their limit):
    // ptxas issued each pass's first wgmmas before the FFMAs into O of the pass before, holding
    // that pass's 32 sums in fresh registers beside the new products, and spilled (NVRTC 13.0:
    // 12 bytes with the split per tile; 13.5: 4 bytes pre-split). There each later pass's first
    // descriptor takes a zero made from those FFMAs' results (zero_after), so its wgmmas wait
    // for them: about 20 instructions a tile, no value changes.
    constexpr int PVC = 64;  // columns per pass
    constexpr bool PV_PIN = Cfg::HSPLIT && CAUSAL;
    float pv_t[F16S ? 2 : 1][F16S ? PVC / 2 : 1];
    float pv_s[F16S ? PVC / 2 : 1];
    const auto pv16 = [&](int st) {
        if constexpr (F16S) {
            constexpr int KS = BN / 16;
            static_assert(DCOLS % PVC == 0 && KS >= 2, "whole passes, two steps at least");
            const float f = pow2f(-(P16_LOG2 + ev));
#pragma unroll
            for (int ch = 0; ch < DCOLS / PVC; ++ch) {
                // z: a zero (zero_after), added to the descriptor's low word alone (32 bits)
                const auto step = [&](int kk, float (&tt)[PVC / 2], unsigned int z) {
                    const unsigned int va =
                        v_s + st * Cfg::KV_BYTES + kv_col + ch * KV_PSTEP + kk * 16 * 128;
                    const unsigned long long db = wgmma_desc(va, KV_PSTEP, 1024);
                    wgmma_fence();
                    Wgmma<Op, PVC>::rs(tt, pk[kk],
                                       (db & ~0xffffffffull) | (static_cast<unsigned int>(db) + z),
                                       0);
                    // the lo panel's descriptor: its address field (bytes / 16, 14 bits; shared
                    // memory ends below 2^18 bytes) KV_LO / 16 on
                    Wgmma<Op, PVC>::rs(pv_s, pk[kk], db + (KV_LO >> 4), kk > 0 ? 1 : 0);
                    Wgmma<Op, PVC>::rs(pv_s, pl[kk], db, 1);
                    wgmma_commit();
                };
                float(&sum)[PVC / 2] = pv_t[0];
                float(&tmp)[PVC / 2] = pv_t[1];
                step(0, sum,
                     PV_PIN && ch > 0 ? zero_after<PVC / 2>(o_flat + (ch - 1) * PVC / 2) : 0u);
                step(1, tmp, 0u);  // steps 0 and 1 in flight together
#pragma unroll
                for (int kk = 1; kk < KS; ++kk) {
                    wgmma_wait<0>();
                    if (kk == 1) fence_regs(sum);
                    fence_regs(tmp);
#pragma unroll
                    for (int i = 0; i < PVC / 2; ++i) sum[i] += tmp[i];
                    if (kk + 1 < KS) step(kk + 1, tmp, 0u);
                }
                fence_regs(pv_s);
#pragma unroll
                for (int i = 0; i < PVC / 2; ++i) sum[i] += pv_s[i];
#pragma unroll
                for (int i = 0; i < PVC / 2; ++i)
                    o_flat[ch * PVC / 2 + i] = fmaf(sum[i], f, o_flat[ch * PVC / 2 + i]);
            }
        }
    };
    const auto pack = [&]() {
        if constexpr (F16S) pack_p_f16split(s, pk, pl);
        else if constexpr (F32) pack_p_tf32<TERMS>(s, pk, pl);
        else pack_p<T, Cfg::NT_S>(s, pk);
    };
    // Every warp of the consumer arrives once on a barrier it is done with.
    const auto release = [lane](unsigned int bar) {
        __syncwarp();
        if (lane == 0) mbar_arrive(bar);
    };
    unsigned int it = 0;  // K/V tiles consumed so far, over all work items (as the producer)
    unsigned int wi = 0;
    // S_j has landed in registers: K_j's stage is free, and after the item's last tile Q is too
    // (the producer loads the next item's Q while this one's last P V and epilogue run).
    const auto scores_done = [&](int st, bool last) {
        release(k_empty(st));
        if (last) release(q_empty(wi % QSTAGES));
    };

    WorkWalk<CAUSAL, VARLEN> walk(p, VARLEN ? vv->slot : blockIdx.x, VARLEN ? vv->end : 0u);
    for (BlockCoord bc; walk.next(bc); ++wi) {
        const int row0 = static_cast<int>(bc.mblock) * Cfg::BM;
        // This consumer's tiles and those every consumer computes (n_turns).
        int n_tiles = tiles_needed<CAUSAL, BN>(row0 + rw, 64, sq, sk);
        int n_turns = n_tiles;
#pragma unroll
        for (int c = 0; c < CONSUMERS; ++c)
            n_turns = min(n_turns, tiles_needed<CAUSAL, BN>(row0 + 64 * c, 64, sq, sk));
        const int row_lo = row0 + rw + 16 * warp + g;  // the thread's rows: +0 and +8
        const int masked_from = first_masked_tile<CAUSAL>(row0 + rw, BN, sq, sk);
        // A variant: its policy bound to the item's batch entry; a window's tiles are the
        // block's [jt0, ...) (window_tiles, as the producer loads them), local index j = tile
        // jt0 + j, the counts cut to the block's window.
        int jt0 = 0;
        [[maybe_unused]] V var;
        if constexpr (!V::PLAIN) {
            const unsigned int ub = static_cast<unsigned int>(bc.b);
            const unsigned int n2 = static_cast<unsigned int>(p.nb2);
            const unsigned int n1 = static_cast<unsigned int>(p.nb1);
            var.bind(vp, p.sq, p.sk, (ub / n2) / n1, (ub / n2) % n1, ub % n2);
            window_tiles<BN>(var, row0, Cfg::BM, sq, sk, jt0, n_tiles);
            window_tiles<BN>(var, row0, Cfg::BM, sq, sk, jt0, n_turns);
        }
        // A variant's scores of key tile jt, in place before its softmax step: scaled,
        // transformed, and masked per element on partial tiles (the causal diagonal or key tail
        // from masked_from on, a window edge, a mask; tile_kind over this consumer's rows).
        const auto variant_step = [&](int jt) {
            if constexpr (!V::PLAIN) {
                const int key0 = jt * BN, r0 = row0 + rw;
                const bool partial = jt >= masked_from ||
                                     var.tile_kind(r0, min(r0 + 64, sq), key0, key0 + BN) !=
                                         TILE_FULL;
                variant_scores<Cfg::NT_S, CAUSAL, TERMS == 1>(s, var, partial, key0, t4, sq, sk,
                                                              row_lo, diag,
                                                              static_cast<float>(p.scale));
            }
        };
        const auto stage = [it](int j) { return static_cast<int>((it + j) % STAGES); };
        const auto parity = [it](int j) { return ((it + j) / STAGES) & 1u; };

        float m_run[2] = {neg_inf<float>(), neg_inf<float>()};
        float l_run[2] = {0.f, 0.f};
        float alpha[2];
        // AFF: tile jt's scores and softmax step in the affine form where the item's slope allows
        // it (aff, uniform), else the policy's scores (variant_scores, scaled) with a = log2 e.
        // (The three call sites below stay explicit: one lambda for both forms flipped a branch
        // in the plain kernel's SASS.)
        [[maybe_unused]] bool aff = false;
        [[maybe_unused]] float aff_rho = 0.f, aff_a = 1.4426950408889634f;
        if constexpr (AFF) {
            aff = var.affine(static_cast<float>(p.scale), aff_rho, aff_a);
            if (!aff) aff_a = 1.4426950408889634f;
        }
        const auto aff_softmax = [&](int jt) {
            if constexpr (AFF) {
                const int key0 = jt * BN, r0 = row0 + rw;
                const bool partial = jt >= masked_from ||
                                     var.tile_kind(r0, min(r0 + 64, sq), key0, key0 + BN) !=
                                         TILE_FULL;
                float b[2] = {0.f, 0.f};
                if (aff) {
                    const int d0 = row_lo + diag - key0 - 2 * t4;   // dist0 of row +0
                    b[0] = -aff_a * static_cast<float>(d0);
                    b[1] = -aff_a * static_cast<float>(d0 + 8);
                    if (partial)
                        affine_scores_as<Cfg::NT_S, true>(s, var, key0, t4, sq, sk, row_lo, diag,
                                                          aff_rho);
                    else
                        affine_scores_as<Cfg::NT_S, false>(s, var, key0, t4, sq, sk, row_lo,
                                                           diag, aff_rho);
                } else {
                    variant_scores<Cfg::NT_S, CAUSAL, TERMS == 1>(
                        s, var, partial, key0, t4, sq, sk, row_lo, diag,
                        static_cast<float>(p.scale));
                }
                softmax_step_affine<Cfg::NT_S, Cfg::LAZY>(s, m_run, l_run, alpha, aff_a, b);
            }
        };
#pragma unroll
        for (int i = 0; i < Cfg::NT_O; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_o[i][e] = 0.f;

        q_wg = q_s + (wi % QSTAGES) * Cfg::Q_BYTES + rw * 128 + q_col;
        mbar_wait(q_full(wi % QSTAGES), (wi / QSTAGES) & 1u);
        if constexpr (F16S) eq = ld_shared_s32(q_exp(wi % QSTAGES));
        if constexpr (!OVERLAP) {
            // Version 1a: each tile's products and softmax in sequence; other consumer
            // warpgroups fill the tensor cores meanwhile.
            for (int j = 0; j < n_tiles; ++j) {
                mbar_wait(k_full(stage(j)), parity(j));
                if constexpr (F16S) ek = ld_shared_s32(k_exp(stage(j)));
                turn_take(j < n_turns);
                if constexpr (TERMS == 3) {
                    scores3(stage(j), j < n_turns);
                } else {
                    wgmma_fence();
                    issue_s(stage(j));
                    wgmma_commit();
                    turn_pass(j < n_turns);
                    wgmma_wait<0>();
                    scores_in();
                }
                scores_done(stage(j), j == n_tiles - 1);
                if constexpr (AFF) {
                    aff_softmax(jt0 + j);
                } else {
                    variant_step(jt0 + j);
                    softmax_step<Cfg::NT_S, CAUSAL, Cfg::LAZY>(
                        s, m_run, l_run, alpha, V::PLAIN && jt0 + j >= masked_from,
                        (jt0 + j) * BN, t4, sk, row_lo, diag, scale_log2);
                }
                rescale_rows<Cfg::NT_O>(acc_o, alpha);
                pack();
                mbar_wait(v_full(stage(j)), parity(j));
                if constexpr (F16S) {
                    ev = ld_shared_s32(v_exp(stage(j)));
                    pv16(stage(j));
                } else {
                    wgmma_fence();
                    issue_pv(stage(j));
                    wgmma_commit();
                    wgmma_wait<0>();
                    pv_in();
                }
                release(v_empty(stage(j)));
            }
        } else if (n_tiles > 0) {
            // Version 1b: the softmax of tile j runs while the tensor cores do P_{j-1} V_{j-1}.
            // S_j and P_{j-1} V_{j-1} go out as two commit groups; waiting for all but the newest
            // group returns S_j, then O is rescaled by alpha_j once P_{j-1} V_{j-1} is in it.
            mbar_wait(k_full(stage(0)), parity(0));
            turn_take(0 < n_turns);
            wgmma_fence();
            issue_s(stage(0));
            wgmma_commit();
            turn_pass(0 < n_turns);
            wgmma_wait<0>();
            scores_in();
            scores_done(stage(0), n_tiles == 1);
            if constexpr (AFF) {
                aff_softmax(jt0);
            } else {
                variant_step(jt0);
                softmax_step<Cfg::NT_S, CAUSAL, Cfg::LAZY>(
                    s, m_run, l_run, alpha, V::PLAIN && jt0 >= masked_from, jt0 * BN, t4, sk,
                    row_lo, diag, scale_log2);  // O is 0: no rescale
            }
            pack();
            for (int j = 1; j < n_tiles; ++j) {
                mbar_wait(k_full(stage(j)), parity(j));
                mbar_wait(v_full(stage(j - 1)), parity(j - 1));
                turn_take(j < n_turns);
                wgmma_fence();
                issue_s(stage(j));
                wgmma_commit();
                issue_pv(stage(j - 1));
                wgmma_commit();
                turn_pass(j < n_turns);
                wgmma_wait<1>();  // S_j is in
                scores_in();
                scores_done(stage(j), j == n_tiles - 1);
                if constexpr (AFF) {
                    aff_softmax(jt0 + j);
                } else {
                    variant_step(jt0 + j);
                    softmax_step<Cfg::NT_S, CAUSAL, Cfg::LAZY>(
                        s, m_run, l_run, alpha, V::PLAIN && jt0 + j >= masked_from,
                        (jt0 + j) * BN, t4, sk, row_lo, diag, scale_log2);
                }
                wgmma_wait<0>();  // P_{j-1} V_{j-1} is in O
                pv_in();
                release(v_empty(stage(j - 1)));
                rescale_rows<Cfg::NT_O>(acc_o, alpha);
                pack();
            }
            mbar_wait(v_full(stage(n_tiles - 1)), parity(n_tiles - 1));
            wgmma_fence();
            issue_pv(stage(n_tiles - 1));
            wgmma_commit();
            wgmma_wait<0>();
            pv_in();
            release(v_empty(stage(n_tiles - 1)));
        }
        if (n_tiles == 0) release(q_empty(wi % QSTAGES));  // (else released with the last S)
        // The block's tiles past this consumer's: release their stages without using them, once
        // loaded (waiting for "full" first keeps the arrivals in the stage's current phase).
        int n_block = tiles_needed<CAUSAL, BN>(row0, Cfg::BM, sq, sk);  // as loaded
        if constexpr (!V::PLAIN) window_tiles<BN>(var, row0, Cfg::BM, sq, sk, jt0, n_block);
        for (int j = n_tiles; j < n_block; ++j) {
            mbar_wait(k_full(stage(j)), parity(j));
            release(k_empty(stage(j)));
            mbar_wait(v_full(stage(j)), parity(j));
            release(v_empty(stage(j)));
        }
        it += n_block;

        // Epilogue: finish the row sums over the quad, divide once, write O and lse. It runs
        // while the producer already loads the next work item. O leaves in 16-byte stores (8
        // columns of a row per lane, after quad_transpose): with one 4-byte store per lane and
        // n8 tile the stores were throttled by the memory pipeline and took about a quarter of
        // the warps' time at D = 256, S = 512 (ncu source counters, notes/PERF.md).
        // Under a causal mask a row whose O is not finite is written by exact_row_pv instead
        // (common.cuh: a NaN or inf in V at a key the row cannot see must not reach it); with a
        // variant (whose window, mask or -inf bias hides keys), by exact_row_pv_var.
        // VARLEN: the last key tile's rows past the sequence's keys hold the next sequence's
        // keys and values (TMA loads rows up to the packed tensor's end), masked in the scores
        // but multiplied by P = 0 in P V, so a NaN or inf there must not reach O either.
        constexpr bool REDO = CAUSAL || !V::PLAIN || VARLEN;
        const BatchOffsets off = batch_offsets(p, bc.b);
        T* o = static_cast<T*>(p.o) + off.o;
        float inv_h[2];
        int redo = 0;  // bit h: this quad's row h goes to the exact path
        // ASYNC_O: this warp's staging rows, free again once its previous copies have read them.
        [[maybe_unused]] const unsigned int ost_w =
            ost + static_cast<unsigned int>(cw * 4 + warp) * OST_WARP;
        // (uniform: the layout of O; the pitch the warp stages its rows at)
        [[maybe_unused]] const bool o_dense = p.o_sr == DPAD && d == DPAD;
        [[maybe_unused]] const unsigned int pitch = o_dense ? 2 * DPAD : OST_PITCH;
        if constexpr (ASYNC_O) {
            if (lane < 16) bulk_wait_read0();
            __syncwarp();
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float l = l_run[h];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            const int row = row_lo + 8 * h;
            const float inv = (l == 0.f) ? 0.f : 1.f / l;
            inv_h[h] = inv;
            if constexpr (REDO) {
                float t = 0.f;  // NaN or inf anywhere in the row makes the sum non-finite
#pragma unroll
                for (int i = 0; i < Cfg::NT_O; ++i) t += acc_o[i][2 * h] + acc_o[i][2 * h + 1];
                int bad = !(fabsf(t) <= 3.0e38f);
                bad |= __shfl_xor_sync(0xffffffffu, bad, 1);
                bad |= __shfl_xor_sync(0xffffffffu, bad, 2);
                redo |= bad << h;
            }
            if (p.lse != nullptr && t4 == 0 && row < sq && cc == 0)
                p.lse[bc.b * p.sq + row] = row_lse(m_run[h], l, scale_log2);
            T* dst = o + static_cast<long long>(row) * p.o_sr;
            if constexpr (F32) {  // 8-byte stores: columns 8 i + 2 t4 (+1); D % 8 == 0
#pragma unroll
                for (int i = 0; i < Cfg::NT_O; ++i) {
                    const int col = DCOLS * cc + 8 * i + 2 * t4;
                    if (row < sq && col < d && !((redo >> h) & 1))
                        *reinterpret_cast<float2*>(dst + col) =
                            make_float2(acc_o[i][2 * h] * inv, acc_o[i][2 * h + 1] * inv);
                }
            } else {
#pragma unroll
                for (int c = 0; c < Cfg::NT_O / 4; ++c) {
                    unsigned int w[4];
#pragma unroll
                    for (int j = 0; j < 4; ++j)
                        w[j] = pack2<T>(acc_o[4 * c + j][2 * h] * inv,
                                        acc_o[4 * c + j][2 * h + 1] * inv);
                    quad_transpose(w, t4);  // (all lanes: the shuffles come before the row test)
                    const int col = (4 * c + t4) * 8;  // D % 8 == 0: all in or all out
                    if constexpr (ASYNC_O) {  // every row and column: the copies pick
                        sts_u4(ost_w + (g + 8 * h) * pitch + (4 * c + t4) * 16, w[0], w[1], w[2],
                               w[3]);
                    } else if (row < sq && col < d && !((redo >> h) & 1)) {
                        *reinterpret_cast<uint4*>(dst + col) = make_uint4(w[0], w[1], w[2], w[3]);
                    }
                }
            }
        }
        if constexpr (ASYNC_O) {
            // The staged values are made visible to the copies first. Dense O with all 16 rows
            // in and none for the exact path: lane 0 sends them in one copy. Otherwise lane
            // r < 16 sends row r of the warp's 16 (quad r % 8, half r / 8: its redo bit from the
            // quad's lane 0), the D real columns, unless it is past Sq or goes to the exact path.
            fence_proxy_async();
            __syncwarp();
            const int row_w = row0 + rw + 16 * warp;  // the warp's first row
            const int bits = __shfl_sync(0xffffffffu, redo, (lane % 8) * 4);
            if (o_dense && row_w + 16 <= sq && !__any_sync(0xffffffffu, redo != 0)) {
                if (lane == 0) {
                    bulk_store_row(o + static_cast<long long>(row_w) * p.o_sr, ost_w,
                                   16u * DPAD * static_cast<unsigned int>(sizeof(T)));
                    bulk_commit();
                }
            } else if (lane < 16) {
                const int row = row_w + lane;
                if (row < sq && !((bits >> (lane / 8)) & 1))
                    bulk_store_row(o + static_cast<long long>(row) * p.o_sr,
                                   ost_w + lane * pitch,
                                   static_cast<unsigned int>(d) * sizeof(T));
                bulk_commit();
            }
        }
        if constexpr (REDO) {
            if (__any_sync(0xffffffffu, redo != 0)) {  // non-finite inputs only
                const float m_c[2] = {m_run[0] == neg_inf<float>() ? 0.f : m_run[0] * scale_log2,
                                      m_run[1] == neg_inf<float>() ? 0.f : m_run[1] * scale_log2};
                for (int src = 0; src < 32; src += 4) {  // each quad's two rows, the whole warp
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int bits = __shfl_sync(0xffffffffu, redo, src);
                        const float mc = __shfl_sync(0xffffffffu, m_c[h], src);
                        const float inv = __shfl_sync(0xffffffffu, inv_h[h], src);
                        const int row = row0 + rw + 16 * warp + src / 4 + 8 * h;
                        if (!((bits >> h) & 1) || row >= sq) continue;
                        // HSPLIT: this consumer's columns only (c0 = its first; its redo bits
                        // come from its own columns of O)
                        const int c0 = DCOLS * cc;
                        const int dv_own = HSPLIT ? min(DCOLS, static_cast<int>(p.dv) - c0)
                                                  : static_cast<int>(p.dv);
                        if (HSPLIT && dv_own <= 0) continue;
                        if constexpr (!V::PLAIN) {  // the policy's keys and scores
                            exact_row_pv_var<T, CAUSAL, TERMS == 1>(
                                var, static_cast<const T*>(p.q) + off.q + row * p.q_sr,
                                static_cast<const T*>(p.k) + off.k, p.k_sr,
                                static_cast<const T*>(p.v) + off.v + c0, p.v_sr,
                                static_cast<int>(p.d), dv_own, row, sq, sk,
                                static_cast<float>(p.scale), mc, inv, o + row * p.o_sr + c0);
                            continue;
                        }
                        const int n_keys = CAUSAL ? max(0, min(sk, row + diag + 1)) : sk;
                        exact_row_pv<T>(static_cast<const T*>(p.q) + off.q + row * p.q_sr,
                                        static_cast<const T*>(p.k) + off.k, p.k_sr,
                                        static_cast<const T*>(p.v) + off.v + c0, p.v_sr,
                                        static_cast<int>(p.d), dv_own, n_keys,
                                        scale_log2, mc, inv, o + row * p.o_sr + c0);
                    }
                }
            }
        }
    }
    // ASYNC_O: the last copies are complete before the block's shared memory goes.
    if constexpr (ASYNC_O) if (lane < 16) bulk_wait_all0();
    if (cw == 0) turn_take(true);  // the last consumer's final pass (see turn_take above)
}

// cuflash_fwd_wgmma: the plain policy (one kernel argument, the code it always had);
// cuflash_fwd_wgmma_var<..., CAUSAL, V[, OP]>: a variant's policy V (variants.cuh), VariantParams
// the second argument (notes/VARIANTS.md, "The Hopper forward with a policy"). Both are named
// instantiations a profiler shows.
template <typename T, int TERMS, int DPAD, int BN, int STAGES, int QSTAGES, int CONSUMERS,
          bool OVERLAP, bool PINGPONG, bool CAUSAL, typename OP = T>
__global__ void __launch_bounds__(
    WgmmaConfig<T, TERMS, DPAD, BN, STAGES, QSTAGES, CONSUMERS, OP>::THREADS, 1)
cuflash_fwd_wgmma(const __grid_constant__ HopperParams hp) {
    fwd_wgmma_body<T, TERMS, DPAD, BN, STAGES, QSTAGES, CONSUMERS, OVERLAP, PINGPONG, CAUSAL, OP,
                   PlainVariant>(hp, VariantParams{});
}
template <typename T, int TERMS, int DPAD, int BN, int STAGES, int QSTAGES, int CONSUMERS,
          bool OVERLAP, bool PINGPONG, bool CAUSAL, typename V, typename OP = T>
__global__ void __launch_bounds__(
    WgmmaConfig<T, TERMS, DPAD, BN, STAGES, QSTAGES, CONSUMERS, OP>::THREADS, 1)
cuflash_fwd_wgmma_var(const __grid_constant__ HopperParams hp,
                      const __grid_constant__ VariantParams vp) {
    fwd_wgmma_body<T, TERMS, DPAD, BN, STAGES, QSTAGES, CONSUMERS, OVERLAP, PINGPONG, CAUSAL, OP,
                   V>(hp, vp);
}

// cuflash_fwd_wgmma_ao: the plain kernel with ASYNC_O (16-bit only): O staged in shared memory
// and sent out by bulk copies that the consumer does not wait for until it stages the next item's
// O (issue 13's small problems: the epilogue of short items off the consumers' path;
// notes/PERF.md, "h5"). A kernel of its own so that every cuflash_fwd_wgmma keeps its code.
template <typename T, int TERMS, int DPAD, int BN, int STAGES, int QSTAGES, int CONSUMERS,
          bool OVERLAP, bool PINGPONG, bool CAUSAL>
__global__ void __launch_bounds__(
    WgmmaConfig<T, TERMS, DPAD, BN, STAGES, QSTAGES, CONSUMERS, T>::THREADS, 1)
cuflash_fwd_wgmma_ao(const __grid_constant__ HopperParams hp) {
    fwd_wgmma_body<T, TERMS, DPAD, BN, STAGES, QSTAGES, CONSUMERS, OVERLAP, PINGPONG, CAUSAL, T,
                   PlainVariant, false, true>(hp, VariantParams{});
}

// cuflash_fwd_wgmma_varlen: the plain policy on a packed variable-length batch (attention_varlen;
// WgmmaVarlenView), same template arguments and launch configuration as cuflash_fwd_wgmma but a
// block walks vl.group consecutive work slots of one sequence and head (the view is the same for
// all of them, so the body's persistent loop overlaps the next slot's Q and first K/V loads with
// the current one's end; group = 1: one slot a block): the grid is H x vl.slots (common.cuh:
// varlen_slot, a compact numbering of each head's groups of slots over the sequences; a slot is a
// query block, or under the causal mask a pair of them), block h * slots + u is group r of its
// owner's batch entry b = s H + h, renumbered in the view as slots [b per_s + r group, b per_s +
// min(per_s, (r + 1) group)) of the sequence's own per_s slots, and it leaves at once when r
// group is past them.
template <typename T, int TERMS, int DPAD, int BN, int STAGES, int QSTAGES, int CONSUMERS,
          bool OVERLAP, bool PINGPONG, bool CAUSAL, typename OP = T>
__global__ void __launch_bounds__(
    WgmmaConfig<T, TERMS, DPAD, BN, STAGES, QSTAGES, CONSUMERS, OP>::THREADS, 1)
cuflash_fwd_wgmma_varlen(const __grid_constant__ HopperParams hp,
                         const __grid_constant__ VarlenParams vl) {
    constexpr int BM = WgmmaConfig<T, TERMS, DPAD, BN, STAGES, QSTAGES, CONSUMERS, OP>::BM;
    constexpr unsigned int ROWS = CAUSAL ? 2 * BM : BM;  // query rows of a slot
    __shared__ WgmmaVarlenView view;
    if (threadIdx.x < 32) {
        const unsigned int slots = static_cast<unsigned int>(vl.slots);
        const unsigned int h = blockIdx.x / slots, u = blockIdx.x % slots;
        unsigned int r;
        const unsigned int grp = static_cast<unsigned int>(vl.group);
        const unsigned int s = varlen_slot(vl.cu_q, static_cast<unsigned int>(hp.a.nb0), u,
                                           ROWS * grp, r);
        if (threadIdx.x == 0) {
            AttnParams a = hp.a;
            const unsigned int b = s * static_cast<unsigned int>(a.nb1 * a.nb2) + h;
            long long q0, k0;
            fwd_varlen_move<T>(a, vl, b, q0, k0);
            const unsigned int nm_s = static_cast<unsigned int>((a.sq + BM - 1) / BM);
            const unsigned int per_s = CAUSAL ? (nm_s + 1) / 2 : nm_s;
            a.n_mblocks = nm_s;
            view.a = a;
            view.slot = b * per_s + r * grp;
            view.end = b * per_s + min(per_s, (r + 1) * grp);
            view.live = r * grp < per_s ? 1 : 0;
            view.q_row0 = static_cast<int>(q0);
            view.k_row0 = static_cast<int>(k0);
        }
    }
    __syncthreads();
    if (!view.live) return;
    fwd_wgmma_body<T, TERMS, DPAD, BN, STAGES, QSTAGES, CONSUMERS, OVERLAP, PINGPONG, CAUSAL, OP,
                   PlainVariant, true>(hp, VariantParams{}, &view);
}

}  // namespace cuflash
