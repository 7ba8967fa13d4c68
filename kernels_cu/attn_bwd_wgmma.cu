// attn_bwd_wgmma.cu: the Hopper backward kernel for float16 / bfloat16 (warpgroup MMA, sm_90a
// only). notes/BACKWARD.md, "The Hopper backward".
//
// Versions (predictions against the mma.sync backward, attn_bwd_mma.cu, measured nowhere yet):
//   1   (this file) key-parallel, no warp specialisation: a block is CONSUMERS = BN / 64
//       warpgroups, each owning 64 keys; every thread also issues its share of the cp.async
//       loads of the next query tile (two Q/dO stages), so loads cost the consumers some issue
//       slots but never a wait in the steady state. All five products are wgmma (the tensor cores
//       take 64 x N x 16 per instruction from shared memory without any ldmatrix), so the
//       loop's issue count per FLOP drops by about 4x against mma.sync (whose loop notes/
//       BACKWARD.md found issue-bound). Prediction (notes/BACKWARD.md, "The Hopper
//       backward"): at long sequences D = 128 330 +- 60 TFLOP/s, D = 64 280 +- 60 (the exp2 /
//       dS work per FLOP doubles there): 1.5-2x the mma.sync backward, 1.1-1.4x torch's FLASH
//       backward (FA2), 0.6-0.9x cuDNN.
//   1.1 (this file, session y) the dq reductions as 16-byte red.v4 after a pair exchange
//       between lanes t4 and t4 ^ 1, on accumulator rows that are a multiple of 64 bytes
//       (_dispatch.TC_BWD_DQ_PAD 16, was 4): half the reduction instructions and L2 requests,
//       and no 32-byte piece straddling two sectors. Why: with the reductions disabled (an
//       ablation, wrong dq) the H100 ran D = 256 S = 4096 at 348 TFLOP/s against 208, and ncu
//       showed L2's input at 88% busy with 9 requests per red.v2 instruction (notes/
//       BACKWARD.md, "The dq reductions").
//   1.2 (this file, session z) the deterministic hand-over: thread 0's st.release without a
//       __threadfence before it (the release alone is cumulative through barrier 1), and at
//       D = 64 and 256 the next tile's copies issued after the hand-over (NEXT_LATE). An A/B
//       of five forms on an H100 (bwd_ablate.py): det / default 0.73-0.90 -> 0.80-0.96, bitwise
//       the same results; the non-deterministic kernels are unchanged.
//   2   (not written) a producer warpgroup that issues TMA loads (setmaxnreg: 24 registers for
//       it, 240 for the consumers) and an mbarrier ring instead of cp.async and __syncthreads:
//       frees the consumers of the load issue and of the block-wide barriers. Predicted +5-15%.
//
// One key-parallel kernel, cuflash_bwd_wgmma: a block owns BN keys of one k/v owner (dk, dv in
// registers, float32) and loops over the batch entries it sums (kv_red) and, for each, over the
// query tiles of BM rows that see its keys (causal: from the tile of the first row that sees its
// first key). Consumer warpgroup c owns keys 64 c .. 64 c + 63 of the block; warp w of it rows
// 16 w .. 16 w + 15 of every 64-row accumulator (the wgmma accumulator layout). Per query tile
// (i = query, j = key), the operand of each wgmma and why it is K-major or transposed:
//   S^T  = K_c Q^T   (64 x BM, SS)  A = K rows 64 c.. (M = keys, K = head dim: K rows are
//                                   head-dim contiguous: K-major); B = Q (N = queries, K = head
//                                   dim: Q rows are head-dim contiguous: K-major). No transpose.
//   dP^T = V_c dO^T  (64 x BM, SS)  the same with V and dO. No transpose.
//   P^T  = exp2(S^T scale_log2 - lse_i log2(e)) (lse per column, from shared memory), 0 where
//          masked; dS^T = P^T (dP^T - delta_i) (delta per column), with P as rounded to 16 bits.
//   dV  += P^T dO    (64 x DPAD, RS) A = P^T packed from the S^T accumulators (the m64nN
//                                   accumulator of each warp is the m16n8 layout of its 16 rows,
//                                   which pack_p turns into the A fragment of k16 steps, as the
//                                   forward's P V); B = dO with K = queries, N = head dim: dO rows
//                                   are head-dim contiguous, so B is N-major (transpose bit).
//   dK  += dS^T Q    (64 x DPAD, RS) A = dS^T packed; B = Q, N-major as dO.
//   dS -> shared memory (16-bit, 128-byte swizzle); fence.proxy.async; barrier;
//   dQ_tile = dS K   (BM x DPAD over the block's BN keys, SS) split into 64 x 64 pieces,
//                    PIECES / CONSUMERS per warpgroup: B = K with K = keys, N = head dim, from K
//                    rows (head dim contiguous: N-major, transpose bit of B, the forward's V).
//                    A = dS with M = queries, K = keys: DS_KMAJOR (the default), stored as dS
//                    [query][key] in 64-key panels (keys contiguous: K-major, the forward's Q;
//                    two 16-bit stores per pair of scores: sst), else stored as dS^T [key][query]
//                    in 64-query panels and read M-major (transpose bit of A: sstt; one 32-bit
//                    store per pair, but an operand form the forward never ran). The float32
//                    result is added to the dq accumulator (red.global.add.v2.f32; without the
//                    scale: cuflash_bwd_convert_dq multiplies by it).
// At the end dk = scale * dK and dv = dV are written once (keys past Sk are not written; keys no
// row sees get zeros).
//
// D = 256 (Cfg::SPLIT, DPAD > 128; notes/BACKWARD.md, "D = 256"): dK and dV of 64 keys would take
// 256 registers a thread, so the two warpgroups share the block's BN = 64 keys instead: warpgroup
// c computes S^T, dP^T for queries 32 c .. 32 c + 31 of the BM = 64 tile (m64n32) and holds dK,
// dV columns 128 c .. 128 c + 127 (m64n128). Its P^T and dS^T go to shared memory ([key][query],
// the dS^T layout below), and after barrier 2 dV += P^T dO and dK += dS^T Q read them as K-major
// A with B = dO, Q columns 128 c .. N-major (SS), in the dQ commit group; dQ's four 64 x 64
// pieces split by head-dim panel (two per warpgroup) as at D = 128.
//
// Shared-memory descriptors (common.cuh: wgmma_desc), every tile stored as 64-column panels of
// 128-byte rows with the 128-byte swizzle (16-byte chunk c of row r at c ^ (r % 8)), each panel on
// a 1024-byte boundary: K-major operands (S^T, dP^T) take sbo = 1024 (the next 8 rows) and move
// along the head dim by 32 bytes a k16 step inside a panel and by a panel every 4 steps; the
// transposed operands (dO, Q for dV, dK; K and (not DS_KMAJOR) dS^T for dQ) move along K by 16 rows
// (16 x 128 bytes) a step, sbo = 1024, lbo = the panel size (the next 64 elements of M or N).
//
// Pipeline (two stages, cp.async: the backward's launch path passes BwdParams by value and has no
// tensor maps; the copies land in the same swizzled layout TMA would write). Per query tile:
//   wait for the tile's copies; fence.proxy.async (cp.async writes are generic-proxy writes that
//   the wgmmas read through the async proxy); barrier 1 (every copy landed; the previous tile's
//   dQ products are complete, so dS^T and the other buffer are free); request the next tile into
//   the other buffer (and fetch its lse, delta into registers); S^T and dP^T (two commit groups);
//   (DET: thread 0 hands the previous tile's turn on; at D = 64 and 256 the next tile's request
//   comes after it, NEXT_LATE); P^T once S^T is in, dS^T once dP^T is;
//   dS^T to shared memory; dV, dK (one commit group, left in flight); store the next tile's lse,
//   delta; fence.proxy.async; barrier 2 (dS^T complete); dQ (one commit group); (DET: each
//   warp's lane 0 waits for the tile's turn while dQ runs); wait for all; the dq atomics.
//
// dq accumulation and determinism: as attn_bwd_mma.cu (notes/BACKWARD.md, "Deterministic dq"):
// float atomics (DET = false), or (DET = true) the key blocks adding into one query tile take
// turns in descending key-block order through a counter at column DPAD of the tile's first dq
// accumulator row (zeroed by the preprocess); a key block's rank r (the r-th from the end) is
// dispatched after rank r - 1 of its owner, so a block waits only for blocks dispatched before
// it. The tiles here are this kernel's BM rows. What the turns cost and how this kernel keeps it
// down (notes/BACKWARD.md, "Deterministic dq on Hopper"): the wait is polled per warp under the
// dQ products, the hand-over is thread 0's alone after the next barrier 1 (no per-thread fence,
// no third barrier), blocks run in groups rank-major (common.cuh bwd_key_block, DET_ORDER), and
// without the mask rank r starts once rank r - 1 has handed on its first tile (a tile of slack).
//
// Requirements checked on the host (cuflash/_dispatch.py: bwd_hopper_reason): compute capability
// 9.0, float16 or bfloat16, D == Dv, D % 8 == 0, D <= DPAD <= 256, rows of q, k, v, do (and dk, dv) on
// 16-byte boundaries, q not broadcast when DET.
//
// POLICY: the attention variant (kernels_cu/variants.cuh). cuflash_bwd_wgmma is the plain policy
// (PlainVariant); cuflash_bwd_wgmma_var<..., POLICY> takes VariantParams as a second argument
// and applies the policy (notes/VARIANTS.md, "The Hopper backward with a policy"): the
// recomputed scores go through score_grad_x, the transform of the tensor-core forwards and of
// the mma.sync backward (the same instructions on the same operands, so that P matches the
// forward's lse as in attn_bwd_mma.cu), the window, mask tensor and mask hook hide keys per
// element on partial tiles, the window narrows each key block's query tiles (row_range) and the
// deterministic turns (key_range), d score / d t multiplies dS (softcap, a score_mod), and with
// a bias the final score's gradient goes to vp.dscores for dbias. Policies without a transform
// (window, mask) keep the plain kernel's exp2 on raw scores. Every addition is under
// `if constexpr (!POLICY::PLAIN)`, so the plain specialisations' code is what it was.
#include "common.cuh"
#include "wgmma_ops.cuh"
#include "variants.cuh"

namespace cuflash {

template <int DPAD, int BM, int BN, bool DS_KMAJOR>
struct BwdWgmmaConfig {
    // SPLIT (DPAD = 256): dK and dV of 64 keys take 2 x 128 registers a thread, more than a
    // thread has, so two warpgroups share the block's BN = 64 keys: warpgroup c holds dK, dV
    // columns 128 c .. 128 c + 127 and computes S^T, dP^T for queries BM / 2 c .. of the tile;
    // P^T and dS^T go through shared memory, and dV, dK read them there (SS) instead of from
    // registers (RS). Otherwise warpgroup c owns keys 64 c .. 64 c + 63 and all DPAD columns.
    static constexpr bool SPLIT = DPAD > 128;
    static constexpr int CONSUMERS = SPLIT ? 2 : BN / 64;  // warpgroups
    static constexpr int THREADS = 128 * CONSUMERS;
    static constexpr int PANELS = DPAD / 64;       // 64-column panels of K, V, Q, dO
    static constexpr int SN = SPLIT ? BM / CONSUMERS : BM;      // S^T / dP^T columns (queries)
    static constexpr int DKV_N = SPLIT ? DPAD / CONSUMERS : DPAD;  // dK / dV columns
    static constexpr int KV_PANEL = BN * 128;      // bytes per panel of K or V
    static constexpr int Q_PANEL = BM * 128;       // bytes per panel of Q or dO
    static constexpr int KV_BYTES = PANELS * KV_PANEL;
    static constexpr int Q_BYTES = PANELS * Q_PANEL;  // one stage of Q (or dO)
    // dS for dQ: DS_KMAJOR, dS itself (BM query rows x 64 keys per panel, keys contiguous: the
    // K-major A that the forward's Q is); else dS^T (BN key rows x 64 queries per panel).
    static constexpr int DS_PANEL = DS_KMAJOR ? BM * 128 : BN * 128;
    static constexpr int DS_BYTES = BM * BN * 2;
    // SPLIT: P^T and dS^T [key][query] (BN key rows x 64 queries per panel: the K-major A of
    // dV += P^T dO and dK += dS^T Q); dS^T is the dS buffer itself when !DS_KMAJOR.
    static constexpr int PT_PANEL = BN * 128;
    // Byte offsets from the 1024-aligned base: K, V, 2 x Q, 2 x dO, dS (or dS^T), (SPLIT) P^T
    // and (SPLIT and DS_KMAJOR) dS^T, then floats: lse2 (2 x BM), delta (2 x BM).
    static constexpr int K_OFF = 0;
    static constexpr int V_OFF = KV_BYTES;
    static constexpr int Q_OFF = 2 * KV_BYTES;
    static constexpr int DO_OFF = Q_OFF + 2 * Q_BYTES;
    static constexpr int DS_OFF = DO_OFF + 2 * Q_BYTES;
    static constexpr int PT_OFF = DS_OFF + DS_BYTES;
    static constexpr int DST_OFF = DS_KMAJOR ? PT_OFF + (SPLIT ? DS_BYTES : 0) : DS_OFF;
    static constexpr int LD_OFF =
        DS_OFF + DS_BYTES + (SPLIT ? DS_BYTES : 0) + (SPLIT && DS_KMAJOR ? DS_BYTES : 0);
    // + 1024: the dynamic shared memory base is only 16-byte aligned; it is rounded up. + 16:
    // (DET) thread 0's pending hand-over (the turn counter's address, the turn it hands on).
    static constexpr int TURN_OFF = LD_OFF + 2 * 2 * BM * 4;
    static constexpr int SMEM = 1024 + TURN_OFF + 16;
    // dQ pieces of 64 x 64 (query panel mp, head-dim panel np), PIECES / CONSUMERS each.
    static constexpr int PIECES = (BM / 64) * PANELS;
    static constexpr int PIECES_WG = PIECES / CONSUMERS;
    // dP^T issued with S^T (both accumulators live at once, dP^T's product under P^T's exp2), or
    // after P^T is packed: BM = 128 holds 64 + 64 accumulator registers for them beside dK and dV
    // and the packed P^T, which spilled (bfloat16, D = 64, causal: 20 bytes, NVRTC 13.5).
    static constexpr bool DP_EARLY = BM == 64;
    static_assert(CONSUMERS == 1 || CONSUMERS == 2, "one or two consumer warpgroups");
    static_assert(SPLIT ? BN == 64 : BN == 64 * CONSUMERS, "a warpgroup owns 64 keys");
    static_assert(DPAD == 64 || DPAD == 128 || DPAD == 256, "DPAD must be 64, 128 or 256");
    static_assert(BM == 64 || BM == 128, "BM must be 64 or 128");
    static_assert(!SPLIT || BM == 64, "SPLIT: 32 queries per warpgroup (m64n32)");
    static_assert(PIECES % CONSUMERS == 0, "the dQ pieces split evenly over the warpgroups");
    static_assert(BM <= THREADS, "one thread per lse / delta row");
    static_assert(SMEM <= 232448, "shared memory of one block (227 KiB)");
};

// Copy rows [row0, row0 + ROWS) x DPAD columns of a matrix with row stride ld into shared memory
// at dst as 64-column panels of 128-byte rows with the 128-byte swizzle, zero-filling rows >=
// n_rows and columns >= d (d % 8 == 0: a 16-byte chunk is all in or all out). Each thread copies
// one column chunk c of rows r0, r0 + RSTEP, ... (RSTEP % 8 == 0: the same swizzle for all).
template <int ROWS, int DPAD, int THREADS, typename T>
__device__ __forceinline__ void load_swizzled(unsigned int dst, const T* g, long long ld, int row0,
                                              int n_rows, int d, int tid) {
    constexpr int CHUNKS = DPAD / 8;
    constexpr int RSTEP = THREADS / CHUNKS;
    static_assert(THREADS % CHUNKS == 0 && RSTEP % 8 == 0 && ROWS % RSTEP == 0,
                  "whole rows of chunks per pass");
    const int r0 = tid / CHUNKS, c = tid % CHUNKS;
    const bool col_ok = c * 8 < d;
    const T* src = g + static_cast<long long>(row0 + r0) * ld + c * 8;
    const unsigned int d0 =
        dst + (c / 8) * (ROWS * 128) + r0 * 128 + ((static_cast<unsigned int>((c % 8) ^ (r0 % 8))) << 4);
#pragma unroll
    for (int n = 0; n < ROWS / RSTEP; ++n) {
        const bool ok = col_ok && row0 + r0 + n * RSTEP < n_rows;
        cp_async16(d0 + n * RSTEP * 128, ok ? static_cast<const void*>(src) : g, ok ? 16 : 0);
        src += RSTEP * ld;
    }
}

__device__ __forceinline__ void sts_u32(unsigned int addr, unsigned int v) {
    asm volatile("st.shared.u32 [%0], %1;\n" :: "r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ void sts_u16(unsigned int addr, unsigned short v) {
    asm volatile("st.shared.u16 [%0], %1;\n" :: "r"(addr), "h"(v) : "memory");
}
__device__ __forceinline__ float2 lds_f2(unsigned int addr) {
    float2 r;
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(r.x), "=f"(r.y) : "r"(addr) : "memory");
    return r;
}
__device__ __forceinline__ void sts_u64(unsigned int addr, unsigned long long v) {
    asm volatile("st.shared.u64 [%0], %1;\n" :: "r"(addr), "l"(v) : "memory");
}
__device__ __forceinline__ unsigned long long lds_u64(unsigned int addr) {
    unsigned long long v;
    asm volatile("ld.shared.u64 %0, [%1];\n" : "=l"(v) : "r"(addr) : "memory");
    return v;
}
__device__ __forceinline__ void sts_f32(unsigned int addr, float v) {
    asm volatile("st.shared.f32 [%0], %1;\n" :: "r"(addr), "f"(v) : "memory");
}
// __shfl_xor_sync(full, x, 1) as a volatile asm: kept in program order between the dq
// reductions (also volatile asm), so that ptxas does not hoist every exchange of a tile ahead of
// the reductions and hold their results live (registers are at the cap: that spilled).
__device__ __forceinline__ float shfl_xor1_ordered(float x) {
    float r;
    asm volatile("shfl.sync.bfly.b32 %0, %1, 1, 31, -1;\n" : "=f"(r) : "f"(x));
    return r;
}

// dst[0..3] += v in global memory (dst 16-byte aligned): one vector reduction (sm_90; the dq
// pieces after the pair exchange below).
__device__ __forceinline__ void bwd_red_add4(float* dst, float a, float b, float c, float d) {
    asm volatile("red.relaxed.gpu.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n"
                 :: "l"(dst), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
}

// Element (row, col) of a 16-bit tile stored as 64-column panels of PANEL bytes (128-byte rows,
// the 128-byte swizzle), for a pair of columns col, col + 1 in one 32-bit store (col even).
template <int PANEL>
__device__ __forceinline__ void sts_panel_u32(unsigned int at, int row, int col, unsigned int v) {
    sts_u32(at + (col / 64) * PANEL + row * 128 +
                (static_cast<unsigned int>(((col % 64) / 8) ^ (row % 8)) << 4) + (col % 8) * 2,
            v);
}
// Generic-proxy writes to shared memory (st.shared, cp.async) made visible to the async proxy
// (the wgmmas' operand reads).
__device__ __forceinline__ void fence_async_smem() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// P^T of one warp's 16 keys x NT * 8 query columns for a policy V (the layout of the S^T
// accumulator: element e of n8 tile nt is key key_t + 8 (e / 2), query column nt * 8 + 2 t4 +
// (e % 2) from row r_lo), lse2 of the columns at lse_c (shared memory, 4 bytes a column):
// attn_bwd_mma.cu's bwd_variant_probs in this kernel's layout. With a transform the scaled score
// goes through score_grad_x (the forward's instructions; d score / d t to dsc where V::DSCORE),
// in scaled units; without one (window, mask) P is the plain kernel's exp2 of the raw score.
// PARTIAL (the key tail, the causal diagonal, a window edge, a mask): the per-element visibility.
// Rows past Sq and keys past Sk are clamped for the policy's reads (their P is 0). ALiBi's
// distance i + off - j is dist0 - ce, dist0 = r_lo + 2 t4 + off - key_t once per tile and ce the
// element's constant offset (exact integers in float below 2^24: the same value as the forward's).
// DSC (d score / d t of a DSCORE policy, SN / 2 floats a thread): in shared memory at dsc_s
// (DSC_SMEM: 16-byte vectors of 4 consecutive elements, element group n of thread tid at
// dsc_s + (n THREADS + tid) 16, conflict-free) where registers would spill, else in dsc.
template <int NT, bool CAUSAL, bool PARTIAL, int THREADS, bool DSC_SMEM, typename V>
__device__ __forceinline__ void bwd_wgmma_variant_probs(float (&s)[NT][4],
                                                        float (&dsc)[V::DSCORE ? NT : 1][4],
                                                        unsigned int dsc_s, const V& var,
                                                        unsigned int lse_c, int r_lo, int key_t,
                                                        int t4, int sq, int sk, int diag,
                                                        float scale, float scale_log2) {
    constexpr float LOG2E = 1.4426950408889634f;
    const float dist0 = static_cast<float>(r_lo + 2 * t4 + diag - key_t);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        const float2 l = lds_f2(lse_c + (nt * 8 + 2 * t4) * 4);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int row = r_lo + nt * 8 + 2 * t4 + (e % 2);
            const int key = key_t + 8 * (e / 2);
            const int r = V::READS ? min(row, sq - 1) : row;
            const int kc = (V::READS && PARTIAL) ? min(key, sk - 1) : key;
            const float lv = e % 2 ? l.y : l.x;
            float x;
            if constexpr (V::TRANSFORMS) {
                float ds;
                const float ce = static_cast<float>(8 * (e / 2) - nt * 8 - (e % 2));
                const float t = var.template score_grad_x<true, CAUSAL>(s[nt][e], scale, r, kc,
                                                                        dist0, ce, ds);
                x = fast_exp2(fmaf(t, LOG2E, -lv));
                if constexpr (V::DSCORE) dsc[nt][e] = ds;
            } else {
                x = fast_exp2(fmaf(s[nt][e], scale_log2, -lv));
            }
            if constexpr (PARTIAL) {   // `&` without reads: as variant_scores_as
                bool ok = key < sk;
                if (CAUSAL) ok = ok & (key <= row + diag);
                if (V::MASKS)
                    ok = V::READS ? (ok && var.visible_tc(r, kc)) : (ok & var.visible_tc(r, kc));
                x = ok ? x : 0.f;
            }
            s[nt][e] = x;
        }
        if constexpr (V::DSCORE && DSC_SMEM)
            asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n"
                         :: "r"(dsc_s + (nt * THREADS + threadIdx.x) * 16), "f"(dsc[nt][0]),
                            "f"(dsc[nt][1]), "f"(dsc[nt][2]), "f"(dsc[nt][3]) : "memory");
    }
}

// vpp: the variant's parameters (null for the plain policy, which reads none: a pointer, not a
// VariantParams, so that the plain kernel's parameters and code stay as they were).
template <typename T, int DPAD, int BM, int BN, bool CAUSAL, bool DET, bool DS_KMAJOR,
          typename POLICY, bool OV>
__device__ __forceinline__ void bwd_wgmma_body(const BwdParams& p, const VariantParams* vpp) {
    using Cfg = BwdWgmmaConfig<DPAD, BM, BN, DS_KMAJOR>;
    // OV (SPLIT only; notes/BACKWARD.md, "D = 256: the overlapped schedule"): the same products
    // on the same operands in another order, so that the tensor cores work under the phases
    // that left them idle: S^T and dP^T are issued before the next tile's loads; P^T is stored
    // and published by a barrier of its own (1b) so that dV += P^T dO runs under dS^T; after
    // barrier 2 dQ is a commit group of its own ahead of dK, and the dq atomics run under dK.
    static_assert(!OV || Cfg::SPLIT, "the overlapped schedule is the SPLIT form's (D > 128)");
    constexpr int THREADS = Cfg::THREADS;
    constexpr float LOG2E = 1.4426950408889634f;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const unsigned int base = (smem_addr(smem_raw) + 1023u) & ~1023u;
    const unsigned int k_s = base + Cfg::K_OFF, v_s = base + Cfg::V_OFF;
    const unsigned int ds_s = base + Cfg::DS_OFF;
    const unsigned int lse_s = base + Cfg::LD_OFF;         // 2 x BM floats (lse * log2(e))
    const unsigned int delta_s = lse_s + 2 * BM * 4;       // 2 x BM floats
    // Variants with d score / d t (softcap, a score_mod) outside the SPLIT form: its SN / 2 floats
    // a thread in shared memory past Cfg::SMEM (THREADS x SN x 2 bytes; _dispatch_variants.py:
    // hopper_bwd_variant_smem), written with P^T and read with dS^T: beside dK, dV, S^T and
    // dP^T they spilled at D = 128 (24 bytes, softcap, NVRTC 13.5).
    constexpr bool DSC_SMEM = !POLICY::PLAIN && POLICY::DSCORE && !Cfg::SPLIT;
    // The dq reductions as 16-byte red.v4 after a pair exchange (below) where the registers allow
    // it: the exchange needs an aligned quad of registers beside dK, dV and the dQ pieces, and
    // ptxas spilled 4-36 bytes (NVRTC 13.0 or 13.5) in the D = 256 and some D = 128 variant
    // kernels and in the D = 64 causal one. Those keep the 8-byte reductions (on the same 64-byte
    // aligned rows). (The deterministic D = 256 form spilled 8 bytes too while the start gate
    // below waited inside the tile loop.)
    constexpr bool RED4 = POLICY::PLAIN && !(DPAD == 64 && CAUSAL);
    [[maybe_unused]] const unsigned int dsc_s = base + Cfg::TURN_OFF + 16;

    const int tid = threadIdx.x;
    // Warpgroup (keys 64 cw ..) and warp within it, broadcast from lane 0 so that the compiler
    // keeps them (and what derives from them) in uniform registers.
    const int cw = __shfl_sync(0xffffffffu, tid / 128, 0);
    const int warp = __shfl_sync(0xffffffffu, (tid / 32) % 4, 0);
    const int lane = tid % 32;
    const int g = lane / 4, t4 = lane % 4;
    // Variants: the policy bound to the first batch entry (rebound when the reduction step
    // changes); its window narrows the block's query tiles to those holding a row that sees one
    // of its keys by position (row_range): [m_first, n_mtiles) of kb. A block whose range is
    // empty visits no tile (it writes zeros).
    [[maybe_unused]] POLICY var;
    const BwdKeyBlock kb = [&]() {
        BwdKeyBlock b = bwd_key_block<BM, BN, CAUSAL, DET>(p);
        if constexpr (!POLICY::PLAIN) {
            const BwdIndex ix0 = bwd_index(p, p.kv_red, b.owner, 0);
            var.bind(*vpp, p.sq, p.sk, ix0.i0, ix0.i1, ix0.i2);
            if constexpr (POLICY::HAS_WINDOW) {
                long long r0, r1;
                var.row_range(b.key0, min(b.key0 + BN, b.sk), r0, r1, p.sq);
                int m_end = b.m_first;
                if (r0 < r1) {
                    b.m_first = max(b.m_first, static_cast<int>(r0 / BM));
                    m_end = max(b.m_first, min(b.n_mtiles, static_cast<int>((r1 + BM - 1) / BM)));
                }
                b.n_mtiles = m_end;
                b.n_iter = static_cast<int>(b.n_red) * (m_end - b.m_first);
            }
        }
        return b;
    }();
    const unsigned int owner = kb.owner, n_red = kb.n_red;
    const int nblock = kb.nblock, key0 = kb.key0, sq = kb.sq, sk = kb.sk, d = kb.d;
    const int diag = kb.diag, m_first = kb.m_first, n_iter = kb.n_iter;
    // This warpgroup's keys (64 from kw0) and queries of each tile (SN from q0); SPLIT: its
    // dK, dV columns from c0.
    constexpr int SN = Cfg::SN, DKV_N = Cfg::DKV_N;
    const int kwo = Cfg::SPLIT ? 0 : 64 * cw;  // first key within the block
    const int kw0 = key0 + kwo;
    const int q0 = Cfg::SPLIT ? SN * cw : 0;
    const int c0 = Cfg::SPLIT ? DKV_N * cw : 0;
    const float scale_log2 = static_cast<float>(p.scale_log2);

    // K and V of the block (stride 0 along kv_red: the same for every reduction step).
    {
        const BwdOffsets off0 = bwd_offsets(p, bwd_index(p, p.kv_red, owner, 0));
        load_swizzled<BN, DPAD, THREADS>(k_s, static_cast<const T*>(p.k) + off0.k, p.k_sr, key0,
                                         sk, d, tid);
        load_swizzled<BN, DPAD, THREADS>(v_s, static_cast<const T*>(p.v) + off0.v, p.v_sr, key0,
                                         sk, d, tid);
    }
    // A query tile's Q and dO into stage buf; its lse * log2(e) (+inf past Sq and where lse =
    // -inf: P = exp2(x - inf) = 0) and delta (0 there) of row i0 + tid into registers.
    const auto load_rows = [&](const BwdIndex& ix, int i0, int buf, float& l2, float& dl) {
        const BwdOffsets off = bwd_offsets(p, ix);
        load_swizzled<BM, DPAD, THREADS>(base + Cfg::Q_OFF + buf * Cfg::Q_BYTES,
                                         static_cast<const T*>(p.q) + off.q, p.q_sr, i0, sq, d,
                                         tid);
        load_swizzled<BM, DPAD, THREADS>(base + Cfg::DO_OFF + buf * Cfg::Q_BYTES,
                                         static_cast<const T*>(p.dout) + off.dout, p.do_sr, i0,
                                         sq, d, tid);
        l2 = __int_as_float(0x7f800000);
        dl = 0.f;
        const int row = i0 + tid;
        if (tid < BM && row < sq) {
            const float l = p.lse[off.lse + static_cast<long long>(row) * p.lse_sr];
            if (l != neg_inf<float>()) l2 = l * LOG2E;
            dl = static_cast<const float*>(p.delta)[off.delta + row];
        }
    };
    int cur_mt = m_first, cur_red = 0;
    BwdIndex cur_ix = bwd_index(p, p.kv_red, owner, 0);
    float l2_next = 0.f, dl_next = 0.f;
    if (n_iter > 0) {
        load_rows(cur_ix, m_first * BM, 0, l2_next, dl_next);
        if (tid < BM) {
            sts_f32(lse_s + tid * 4, l2_next);
            sts_f32(delta_s + tid * 4, dl_next);
        }
    }
    cp_async_commit();

    float dk_acc[DKV_N / 2], dv_acc[DKV_N / 2];  // m64nDKV_N accumulators: [DKV_N / 8][4] flat
#pragma unroll
    for (int i = 0; i < DKV_N / 2; ++i) {
        dk_acc[i] = 0.f;
        dv_acc[i] = 0.f;
    }
    const int key_t = kw0 + 16 * warp + g;  // this thread's keys: key_t, key_t + 8

    // DET: the turn counter of query tile mt (reduction step ix) and this block's turn there:
    // the tile's last key block (the diagonal one under the causal mask) first, key block 0
    // last.
    const auto turn_at = [&](const BwdIndex& ix, int mt, int& mine) {
        int tile_keys = keys_needed<CAUSAL>(mt * BM, BM, sq, sk);
        if constexpr (!POLICY::PLAIN && POLICY::HAS_WINDOW) {  // keys [j0, j1) the rows see
            long long j0, j1;
            var.key_range(mt * BM, min(mt * BM + BM, sq), j0, j1, p.sk);
            tile_keys = min(tile_keys, static_cast<int>(j1));
        }
        mine = (tile_keys - 1) / BN - nblock;
        return reinterpret_cast<int*>(p.dq_accum + bwd_offsets(p, ix).dqa +
                                      static_cast<long long>(mt * BM) * p.dqa_sr + DPAD);
    };
    // DET: the turn this block hands on (thread 0, after the next barrier 1 has ordered every
    // thread's additions before it: the release is cumulative through bar.sync, as a grid-wide
    // barrier's), so that no warp waits for a fence at the end of a tile. Thread 0 keeps the
    // pending hand-over in shared memory (registers are at the cap): the counter's address (0:
    // none) and the turn it hands on. The st.release is the whole release (PTX: a fence.acq_rel
    // and the store; each thread's reductions precede barrier 1, which synchronizes with thread
    // 0's, in causality order): no __threadfence before it (a MEMBAR.SC.GPU on top of the
    // release's MEMBAR.ALL.GPU; without it the deterministic mode ran 3-11% faster, bitwise the
    // same, notes/BACKWARD.md "The deterministic hand-over (session z)").
    const unsigned int turn_s = base + Cfg::TURN_OFF;
    if (DET && tid == 0) sts_u64(turn_s, 0ull);
    const auto hand_on = [&]() {
        if (DET && tid == 0) {
            const unsigned long long at = lds_u64(turn_s);
            if (at != 0ull) {
                const int next = static_cast<int>(lds_u64(turn_s + 8));
                bwd_turn_store(reinterpret_cast<int*>(at), next);
                sts_u64(turn_s, 0ull);
            }
        }
    };
    // DET without the mask: every key block visits the query tiles in the same order, so rank r
    // (key block n_nblocks - 1 - r) starts only once rank r - 1 has handed on its first tile: a
    // tile apart, the chain has a tile of slack at every turn instead of none (notes/
    // BACKWARD.md, "Deterministic dq on Hopper"). Only for grids of 8 waves or more (the
    // first wave's start-up idles up to (N - 1) / 2 tiles a block, once per launch). Without
    // the mask the first tile is tile 0 (its counter at column DPAD of row 0) and rank r's turn
    // at every tile is r.
    // (A window changes each block's first tile: no gate there.) Before the tile loop, while
    // the first tile's copies are in flight (inside it, at the first tile, its predicate stayed
    // live through the loop: the deterministic D = 256 form spilled with the 16-byte reductions).
    if (DET && !CAUSAL && !POLICY::HAS_WINDOW && n_iter > 1 && gridDim.x >= 8u * sm_count()) {
        if (lane == 0) {  // each warp waits; no block barrier
            const int* at =
                reinterpret_cast<const int*>(p.dq_accum + bwd_offsets(p, cur_ix).dqa + DPAD);
            while (bwd_turn_load(at) != static_cast<int>(p.n_nblocks) - 1 - nblock)
                __nanosleep(64);
        }
        __syncwarp();
    }
    [[maybe_unused]] int bound_red = 0;  // variants (SPLIT): the reduction step var is bound to

    // The next tile's Q, dO into the other stage and its lse, delta into registers.
    const auto issue_next = [&](bool more, int buf) {
        if (more) {
            int mt_n = cur_mt, red_n = cur_red;
            BwdIndex ix_n = cur_ix;
            kb.step(p, mt_n, red_n, ix_n);
            load_rows(ix_n, mt_n * BM, 1 - buf, l2_next, dl_next);
        }
        cp_async_commit();
    };
    for (int it = 0; it < n_iter; ++it) {
        const int buf = it & 1;
        const int i0 = cur_mt * BM;
        cp_async_wait<0>();
        fence_async_smem();
        __syncthreads();  // (1) the tile landed; the previous tile's dQ reads are complete
        const bool more = it + 1 < n_iter;
        // The next tile's Q, dO into the other stage (free: its last readers, the previous
        // tile's wgmmas, completed before barrier 1) and its lse, delta into registers. OV:
        // after S^T and dP^T are issued, so that the tensor cores start without waiting for
        // the index arithmetic and the 32 cp.async of each thread. (Without OV the SASS is the
        // inline form's but for two registers swapped.) DET at D = 64 and 256 (NEXT_LATE): after
        // thread 0's hand-over too, whose fence then does not wait for this tile's 32 copies
        // (+1-4% there; -3-5% at D = 128, which keeps the early copies; notes/BACKWARD.md "The
        // deterministic hand-over (session z)").
        constexpr bool NEXT_LATE = OV || (DET && DPAD != 128);
        if constexpr (!NEXT_LATE) issue_next(more, buf);
        const unsigned int q_t = base + Cfg::Q_OFF + buf * Cfg::Q_BYTES;
        const unsigned int do_t = base + Cfg::DO_OFF + buf * Cfg::Q_BYTES;
        const unsigned int lse_t = lse_s + buf * BM * 4, delta_t = delta_s + buf * BM * 4;
        // Variants that read per batch entry (bias, mask, slopes, hooks; the others read none):
        // outside the SPLIT form bound again every tile (a few integer operations and ALiBi's
        // slope load, under the tile's first products), so that the bound state is not held in
        // registers across the loop (with it held, ALiBi took 250-255 registers at D = 128, now
        // 235-248); in the SPLIT form when the reduction step changes (every tile, a bias spilled
        // 16 bytes at D = 256 without causal, deterministic).
        if constexpr (!POLICY::PLAIN && POLICY::READS) {
            if (!Cfg::SPLIT || cur_red != bound_red) {
                var.bind(*vpp, p.sq, p.sk, cur_ix.i0, cur_ix.i1, cur_ix.i2);
                bound_red = cur_red;
            }
        }

        // S^T = K_c Q^T or dP^T = V_c dO^T into acc: DPAD / 16 k16 steps, K-major operands (32
        // bytes a step inside a panel, the next panel every 4 steps); one commit group.
        float s[SN / 2], dp[SN / 2];  // m64nSN accumulators: [SN / 8][4] flat
        const auto keys_by_queries = [&](float (&acc)[SN / 2], unsigned int kv, unsigned int rows) {
#pragma unroll
            for (int kk = 0; kk < DPAD / 16; ++kk) {
                const unsigned long long da = wgmma_desc(
                    kv + kwo * 128 + (kk / 4) * Cfg::KV_PANEL + (kk % 4) * 32, 16, 1024);
                const unsigned long long db = wgmma_desc(
                    rows + q0 * 128 + (kk / 4) * Cfg::Q_PANEL + (kk % 4) * 32, 16, 1024);
                if (kk == 0) Wgmma<T, SN>::ss0(acc, da, db);
                else Wgmma<T, SN>::ss(acc, da, db, 1);
            }
            wgmma_commit();
        };
        const auto issue_dp = [&]() { keys_by_queries(dp, v_s, do_t); };
        wgmma_fence();
        keys_by_queries(s, k_s, q_t);
        if constexpr (Cfg::DP_EARLY) issue_dp();
        if (DET) hand_on();  // the previous tile's turn, under this tile's first products
        if constexpr (NEXT_LATE) issue_next(more, buf);

        // P^T. Element e of n8 tile nt: key key_t + 8 (e / 2), query column nt * 8 + 2 t4 +
        // (e % 2). Masked: keys past Sk (zero-filled K gives s = 0, not -inf) and, under the
        // causal mask, keys the row does not see; rows past Sq and rows without keys have
        // lse2 = +inf. Warpgroup-uniform branch: tiles where every key is real and seen skip it.
        if constexpr (Cfg::DP_EARLY) wgmma_wait<1>();
        else wgmma_wait<0>();
        fence_regs(s);
        unsigned int pk[SN / 16][4];
        [[maybe_unused]] float dsc[POLICY::DSCORE ? SN / 8 : 1][4];  // d score / d t (variants)
        if constexpr (!POLICY::PLAIN) {
            // The warpgroup's 64 keys against its rows: per-element visibility only where they
            // are partial by position (tile_kind; warpgroup-uniform branch), or on the key tail /
            // causal diagonal as in the plain kernel. (Per warp's 16 keys, the test spilled
            // softcap at D = 128 under NVRTC 13.5.)
            float(&s2)[SN / 8][4] = reinterpret_cast<float(&)[SN / 8][4]>(s);
            const int r_lo = i0 + q0;
            const bool partial =
                kw0 + 64 > sk || (CAUSAL && kw0 + 63 > r_lo + diag) ||
                var.tile_kind(r_lo, min(r_lo + SN, sq), kw0, kw0 + 64) != TILE_FULL;
            const float scale = static_cast<float>(p.scale);
            if (partial)
                bwd_wgmma_variant_probs<SN / 8, CAUSAL, true, THREADS, DSC_SMEM>(
                    s2, dsc, dsc_s, var, lse_t + q0 * 4, r_lo, key_t, t4, sq, sk, diag, scale,
                    scale_log2);
            else
                bwd_wgmma_variant_probs<SN / 8, CAUSAL, false, THREADS, DSC_SMEM>(
                    s2, dsc, dsc_s, var, lse_t + q0 * 4, r_lo, key_t, t4, sq, sk, diag, scale,
                    scale_log2);
            pack_p<T, SN / 8>(s2, pk);
        } else {
            float(&s2)[SN / 8][4] = reinterpret_cast<float(&)[SN / 8][4]>(s);
            const bool need_mask = kw0 + 64 > sk || (CAUSAL && kw0 + 63 > i0 + q0 + diag);
            if (!need_mask) {
#pragma unroll
                for (int nt = 0; nt < SN / 8; ++nt) {
                    const float2 l = lds_f2(lse_t + (q0 + nt * 8 + 2 * t4) * 4);
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        s2[nt][e] = fast_exp2(fmaf(s2[nt][e], scale_log2, -(e % 2 ? l.y : l.x)));
                }
            } else {
                // key + 8 h is seen by column q0 + qc iff real and (causal) q0 + qc >= key + 8 h
                // - i0 - diag.
                const int lo = CAUSAL ? key_t - i0 - diag - q0 : -BM;
                const bool real0 = key_t < sk, real1 = key_t + 8 < sk;
#pragma unroll
                for (int nt = 0; nt < SN / 8; ++nt) {
                    const float2 l = lds_f2(lse_t + (q0 + nt * 8 + 2 * t4) * 4);
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int qc = nt * 8 + 2 * t4 + (e % 2);
                        const float x =
                            fast_exp2(fmaf(s2[nt][e], scale_log2, -(e % 2 ? l.y : l.x)));
                        const bool ok = (e / 2 ? real1 : real0) && qc >= lo + 8 * (e / 2);
                        s2[nt][e] = ok ? x : 0.f;
                    }
                }
            }
            pack_p<T, SN / 8>(s2, pk);
        }
        if constexpr (!Cfg::DP_EARLY) {  // S^T's registers are free now
            wgmma_fence();
            issue_dp();
        }
        // OV: P^T is stored now (word w of pk[kk]: key kwo + 16 warp + g + 8 (w % 2), queries
        // q0 + (2 kk + w / 2) * 8 + 2 t4 and the next, as in the store loop below) and
        // published by barrier 1b (dV sums over the queries of both warpgroups), and dV +=
        // P^T dO (the SS form issued after barrier 2 without OV) is issued at once and left in
        // flight under dS^T. Its commit group completes before the dQ group (wait<1> after
        // barrier 2), so P^T and this stage's dO are free again before the next barrier 1.
        if constexpr (OV) {
#pragma unroll
            for (int kk = 0; kk < SN / 16; ++kk)
#pragma unroll
                for (int w = 0; w < 4; ++w)
                    sts_panel_u32<Cfg::PT_PANEL>(base + Cfg::PT_OFF,
                                                 kwo + 16 * warp + g + 8 * (w % 2),
                                                 q0 + (2 * kk + w / 2) * 8 + 2 * t4, pk[kk][w]);
            fence_async_smem();
            __syncthreads();  // (1b) P^T complete (every thread, every iteration)
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BM / 16; ++kk)
                Wgmma<T, DKV_N>::sst(
                    dv_acc,
                    wgmma_desc(base + Cfg::PT_OFF + (kk / 4) * Cfg::PT_PANEL + (kk % 4) * 32, 16,
                               1024),
                    wgmma_desc(do_t + (c0 / 64) * Cfg::Q_PANEL + kk * 16 * 128, Cfg::Q_PANEL,
                               1024),
                    1);
            wgmma_commit();
        }
        // dS^T = P^T (dP^T - delta), P as rounded to 16 bits (0 where P is 0: never 0 * NaN).
        // (OV: dP^T's group completes, dV's stays in flight.)
        if constexpr (OV) wgmma_wait<1>();
        else wgmma_wait<0>();
        fence_regs(dp);
        unsigned int dsk[SN / 16][4];
        {
            float(&dp2)[SN / 8][4] = reinterpret_cast<float(&)[SN / 8][4]>(dp);
            // dbias (a bias with return_dbias): the final score's gradient, before d score / d t,
            // per (batch entry, row, key) to vp.dscores (the host sums it to bias's shape); every
            // (row, key) a block visits is written by it alone, unvisited ones stay 0.
            [[maybe_unused]] float* dsc_out = nullptr;
            if constexpr (!POLICY::PLAIN && POLICY::HAS_BIAS) {
                if (vpp->dscores != nullptr)
                    dsc_out = static_cast<float*>(vpp->dscores) + bwd_flat(p, cur_ix) * p.sq * p.sk;
            }
#pragma unroll
            for (int nt = 0; nt < SN / 8; ++nt) {
                const float2 dl = lds_f2(delta_t + (q0 + nt * 8 + 2 * t4) * 4);
                if constexpr (!POLICY::PLAIN && POLICY::DSCORE && DSC_SMEM)  // (st.shared above)
                    asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                                 : "=f"(dsc[nt][0]), "=f"(dsc[nt][1]), "=f"(dsc[nt][2]),
                                   "=f"(dsc[nt][3])
                                 : "r"(dsc_s + (nt * THREADS + tid) * 16) : "memory");
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    // pack_p: tile nt, element e is in word (nt % 2) * 2 + e / 2 of pk[nt / 2],
                    // the high half for odd e.
                    const float pv = unpack_half<T>(pk[nt / 2][(nt % 2) * 2 + e / 2], e % 2);
                    dp2[nt][e] = pv == 0.f ? 0.f : pv * (dp2[nt][e] - (e % 2 ? dl.y : dl.x));
                    if constexpr (!POLICY::PLAIN && POLICY::HAS_BIAS) {
                        const int row = i0 + q0 + nt * 8 + 2 * t4 + (e % 2);
                        const int key = key_t + 8 * (e / 2);
                        if (dsc_out != nullptr && row < sq && key < sk)
                            dsc_out[static_cast<long long>(row) * sk + key] = dp2[nt][e];
                    }
                    // (a masked element's derivative is never read: a hook's may be NaN there)
                    if constexpr (!POLICY::PLAIN && POLICY::DSCORE)
                        dp2[nt][e] = pv == 0.f ? 0.f : dp2[nt][e] * dsc[nt][e];
                }
            }
            pack_p<T, SN / 8>(dp2, dsk);
        }
        // dS to shared memory: word w of dsk[kk] holds tile 2 kk + w / 2, row (key) g + 8 (w % 2),
        // columns (queries) 2 t4, 2 t4 + 1 (pack_p). DS_KMAJOR: element (query c, key r) of dS
        // in panel r / 64, row c, chunk ((r % 64) / 8) ^ (c % 8), two 16-bit stores (a warp's
        // 8 keys of one chunk x 4 rows of distinct chunks: no bank conflict); else element
        // (key r, query c) of dS^T in panel c / 64, row r, one 32-bit store of both queries (8
        // rows x 4 words of a warp hit 32 different banks). SPLIT: also P^T and (DS_KMAJOR)
        // dS^T as dS^T is stored without DS_KMAJOR, for dV and dK (OV: P^T is stored already).
        const auto sts_keys_by_queries = [&](unsigned int at, int row, int col, unsigned int v) {
            sts_panel_u32<Cfg::PT_PANEL>(at, row, col, v);
        };
        // Variants (DS_KMAJOR, not SPLIT): the dS stores' addresses as four per-thread bases and
        // immediates, formed per tile (ds_st opaque to ptxas): with the row r = kwo + 16 warp +
        // g + 8 (w % 2) and the column c = q0 + (2 kk + w / 2) 8 + 2 t4 + h, r / 64 = kwo / 64,
        // r % 8 = g, (r % 64) / 8 = 2 warp + w % 2 and c % 8 = 2 t4 + h, so the swizzle depends
        // on (w % 2, h) only. The plain form's 32 addresses, hoisted out of the loop, took ~20
        // registers there, which beside a policy's state spilled (20-28 bytes at D = 128, NVRTC
        // 13.5).
        unsigned int ds_st = ds_s;
        if constexpr (!POLICY::PLAIN) asm volatile("" : "+r"(ds_st));
        [[maybe_unused]] unsigned int ds_at[2][2];
        if constexpr (!POLICY::PLAIN && DS_KMAJOR && !Cfg::SPLIT) {
            const unsigned int b0 = ds_st + (kwo / 64) * Cfg::DS_PANEL + (q0 + 2 * t4) * 128 + g * 2;
#pragma unroll
            for (int wm = 0; wm < 2; ++wm)
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    ds_at[wm][h] = b0 + h * 128 +
                                   (static_cast<unsigned int>((2 * warp + wm) ^ (2 * t4 + h)) << 4);
        }
#pragma unroll
        for (int kk = 0; kk < SN / 16; ++kk)
#pragma unroll
            for (int w = 0; w < 4; ++w) {
                const int row = kwo + 16 * warp + g + 8 * (w % 2);   // key in the block
                const int col = q0 + (2 * kk + w / 2) * 8 + 2 * t4;  // query in the tile
                if constexpr (Cfg::SPLIT) {
                    if constexpr (!OV) sts_keys_by_queries(base + Cfg::PT_OFF, row, col, pk[kk][w]);
                    if constexpr (DS_KMAJOR)
                        sts_keys_by_queries(base + Cfg::DST_OFF, row, col, dsk[kk][w]);
                }
                if constexpr (!POLICY::PLAIN && DS_KMAJOR && !Cfg::SPLIT) {
#pragma unroll
                    for (int h = 0; h < 2; ++h)
                        sts_u16(ds_at[w % 2][h] + (2 * kk + w / 2) * 1024,
                                static_cast<unsigned short>(h ? dsk[kk][w] >> 16 : dsk[kk][w]));
                } else if constexpr (DS_KMAJOR) {
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int c = col + h;
                        sts_u16(ds_st + (row / 64) * Cfg::DS_PANEL + c * 128 +
                                    (static_cast<unsigned int>(((row % 64) / 8) ^ (c % 8)) << 4) +
                                    (row % 8) * 2,
                                static_cast<unsigned short>(h ? dsk[kk][w] >> 16 : dsk[kk][w]));
                    }
                } else {
                    sts_keys_by_queries(ds_st, row, col, dsk[kk][w]);
                }
            }
        // dV += P^T dO, dK += dS^T Q: BM / 16 k16 steps (16 query rows = 16 x 128 bytes a step),
        // B N-major (lbo: the next 64 head-dim columns, one panel on). Left in flight. (SPLIT:
        // after barrier 2, from shared memory.)
        if constexpr (!Cfg::SPLIT) {
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BM / 16; ++kk)
                Wgmma<T, DPAD>::rs(dv_acc, pk[kk],
                                   wgmma_desc(do_t + kk * 16 * 128, Cfg::Q_PANEL, 1024), 1);
#pragma unroll
            for (int kk = 0; kk < BM / 16; ++kk)
                Wgmma<T, DPAD>::rs(dk_acc, dsk[kk],
                                   wgmma_desc(q_t + kk * 16 * 128, Cfg::Q_PANEL, 1024), 1);
            wgmma_commit();
        }
        // The next tile's lse2 / delta into the other buffer (last read before the previous
        // tile's barrier 2; read next after the next barrier 1).
        if (more && tid < BM) {
            sts_f32(lse_s + ((1 - buf) * BM + tid) * 4, l2_next);
            sts_f32(delta_s + ((1 - buf) * BM + tid) * 4, dl_next);
        }
        float* dqa = p.dq_accum + bwd_offsets(p, cur_ix).dqa;
        fence_async_smem();
        __syncthreads();  // (2) dS^T complete

        // dQ pieces: 64 queries (query panel mp) x 64 head-dim columns (panel np of K) over the
        // block's BN keys, BN / 16 k16 steps of 16 keys; B = K N-major (16 key rows a step).
        wgmma_fence();
        if constexpr (Cfg::SPLIT && !OV) {
            // dV += P^T dO, dK += dS^T Q for columns c0 ..: A = P^T, dS^T (keys x queries,
            // K-major: 32 bytes a k16 step inside a 64-query panel); B = dO, Q columns c0 ..
            // N-major (c0 / 64 panels on). (OV: dV is in flight since barrier 1b, and dK
            // follows dQ in a commit group of its own.)
#pragma unroll
            for (int kk = 0; kk < BM / 16; ++kk) {
                const unsigned int a = (kk / 4) * Cfg::PT_PANEL + (kk % 4) * 32;
                const unsigned int b = (c0 / 64) * Cfg::Q_PANEL + kk * 16 * 128;
                Wgmma<T, DKV_N>::sst(dv_acc, wgmma_desc(base + Cfg::PT_OFF + a, 16, 1024),
                                     wgmma_desc(do_t + b, Cfg::Q_PANEL, 1024), 1);
                Wgmma<T, DKV_N>::sst(dk_acc, wgmma_desc(base + Cfg::DST_OFF + a, 16, 1024),
                                     wgmma_desc(q_t + b, Cfg::Q_PANEL, 1024), 1);
            }
        }
        float dq[Cfg::PIECES_WG][32];
#pragma unroll
        for (int pc = 0; pc < Cfg::PIECES_WG; ++pc) {
            const int piece = cw * Cfg::PIECES_WG + pc;
            const int mp = piece / Cfg::PANELS, np = piece % Cfg::PANELS;
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk) {
                const unsigned long long db =
                    wgmma_desc(k_s + np * Cfg::KV_PANEL + kk * 16 * 128, Cfg::KV_PANEL, 1024);
                if constexpr (DS_KMAJOR) {  // A = dS rows 64 mp.., K-major (32 bytes a step)
                    const unsigned long long da = wgmma_desc(
                        ds_s + (kk / 4) * Cfg::DS_PANEL + 64 * mp * 128 + (kk % 4) * 32, 16, 1024);
                    if (kk == 0) Wgmma<T, 64>::sst0(dq[pc], da, db);
                    else Wgmma<T, 64>::sst(dq[pc], da, db, 1);
                } else {  // A = dS from dS^T panel mp, M-major (16 key rows a step)
                    const unsigned long long da = wgmma_desc(
                        ds_s + mp * Cfg::DS_PANEL + kk * 16 * 128, Cfg::DS_PANEL, 1024);
                    if (kk == 0) Wgmma<T, 64>::sstt0(dq[pc], da, db);
                    else Wgmma<T, 64>::sstt(dq[pc], da, db, 1);
                }
            }
        }
        wgmma_commit();
        if constexpr (OV) {  // dK += dS^T Q, the operands of the form above
#pragma unroll
            for (int kk = 0; kk < BM / 16; ++kk)
                Wgmma<T, DKV_N>::sst(
                    dk_acc,
                    wgmma_desc(base + Cfg::DST_OFF + (kk / 4) * Cfg::PT_PANEL + (kk % 4) * 32,
                               16, 1024),
                    wgmma_desc(q_t + (c0 / 64) * Cfg::Q_PANEL + kk * 16 * 128, Cfg::Q_PANEL,
                               1024),
                    1);
            wgmma_commit();
        }
        // DET: our turn at the tile, polled by each warp's lane 0 while the dQ products run
        // (the warp would wait for them anyway); bar.warp.sync orders the warp's additions
        // after the acquire. Thread 0 records the hand-over.
        if (DET) {
            if (lane == 0) {
                int mine;
                int* const turn = turn_at(cur_ix, cur_mt, mine);
                while (bwd_turn_load(turn) != mine) __nanosleep(32);
                if (tid == 0) {
                    sts_u64(turn_s, reinterpret_cast<unsigned long long>(turn));
                    sts_u64(turn_s + 8, static_cast<unsigned long long>(mine + 1));
                }
            }
            __syncwarp();
        }
        // OV: dV's and dQ's groups complete, dK's stays in flight under the atomics.
        if constexpr (OV) {
            wgmma_wait<1>();
        } else {
            wgmma_wait<0>();
            fence_regs(dk_acc);
        }
        fence_regs(dv_acc);
#pragma unroll
        for (int pc = 0; pc < Cfg::PIECES_WG; ++pc) {
            fence_regs(dq[pc]);
            const int piece = cw * Cfg::PIECES_WG + pc;
            const int mp = piece / Cfg::PANELS, np = piece % Cfg::PANELS;
            // RED4: 16-byte reductions. For each pair of 8-column blocks (2 j, 2 j + 1) lanes t4
            // and t4 ^ 1 swap a pair of values, so that the even lane holds columns 16 j + 2 t4
            // .. + 3 (its own block 2 j pair and its partner's) and the odd lane columns 16 j + 8
            // + 2 t4 - 2 .. + 1 (its partner's block 2 j + 1 pair and its own). A quad then
            // covers 64 contiguous bytes of its row per instruction (64-byte aligned: the
            // accumulator's rows are a multiple of 64 bytes, _dispatch.TC_BWD_DQ_PAD), against
            // 32 bytes for the pairs as they are: half the reduction requests reach L2.
            // Otherwise one 8-byte reduction per pair (32 bytes a quad, still whole sectors).
            if constexpr (RED4) {
                const bool odd = t4 & 1;
                const int col4 = 64 * np + (odd ? 8 : 0) + 4 * (t4 >> 1);
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int row = i0 + 64 * mp + 16 * warp + g + 8 * h;
                    float* dst = dqa + static_cast<long long>(row) * p.dqa_sr + col4;
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        const float a0 = dq[pc][8 * j + 2 * h], a1 = dq[pc][8 * j + 2 * h + 1];
                        const float b0 = dq[pc][8 * j + 4 + 2 * h], b1 = dq[pc][8 * j + 5 + 2 * h];
                        const float r0 = shfl_xor1_ordered(odd ? a0 : b0);
                        const float r1 = shfl_xor1_ordered(odd ? a1 : b1);
                        if (row < sq)
                            bwd_red_add4(dst + 16 * j, odd ? r0 : a0, odd ? r1 : a1,
                                         odd ? b0 : r0, odd ? b1 : r1);
                    }
                }
            } else {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int row = i0 + 64 * mp + 16 * warp + g + 8 * h;
                    if (row < sq) {
                        float* dst =
                            dqa + static_cast<long long>(row) * p.dqa_sr + 64 * np + 2 * t4;
#pragma unroll
                        for (int nt = 0; nt < 8; ++nt)
                            bwd_red_add2(dst + nt * 8, dq[pc][nt * 4 + 2 * h],
                                         dq[pc][nt * 4 + 2 * h + 1]);
                    }
                }
            }
        }
        if constexpr (OV) {  // dK complete: dS^T and this stage's Q are free for the next tile
            wgmma_wait<0>();
            fence_regs(dk_acc);
        }
        kb.step(p, cur_mt, cur_red, cur_ix);
    }
    if (DET) {
        __syncthreads();  // every warp's additions to the last tile before its release
        hand_on();
    }
    cp_async_wait<0>();  // nothing in flight when the block exits

    // dk = scale * dK, dv = dV, in 16-byte stores: after quad_transpose a lane holds 8
    // consecutive columns of one key (accumulator element (nt, e): key key_t + 8 (e / 2),
    // column nt * 8 + 2 t4 + (e % 2)). Stride 0 on the reduced axes: the owner's rows.
    const BwdOffsets off = bwd_offsets(p, bwd_index(p, p.kv_red, owner, 0));
    const auto write_keys = [&](T* out, long long row_stride, const float (&acc)[DKV_N / 2],
                                float mul) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#pragma unroll
            for (int c = 0; c < DKV_N / 32; ++c) {
                unsigned int w[4];
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    w[j] = pack2<T>(mul * acc[(4 * c + j) * 4 + 2 * h],
                                    mul * acc[(4 * c + j) * 4 + 2 * h + 1]);
                quad_transpose(w, t4);  // (every lane: the shuffles come before the tests)
                const int key = key_t + 8 * h, col = c0 + (4 * c + t4) * 8;  // D % 8 == 0
                if (key < sk && col < d)
                    *reinterpret_cast<uint4*>(out + static_cast<long long>(key) * row_stride +
                                              col) = make_uint4(w[0], w[1], w[2], w[3]);
            }
        }
    };
    write_keys(static_cast<T*>(p.dk) + off.dk, p.dk_sr, dk_acc, static_cast<float>(p.scale));
    write_keys(static_cast<T*>(p.dv) + off.dv, p.dv_sr, dv_acc, 1.f);
}

// OV (default false, so the other instantiations keep their names and code): the overlapped
// schedule of the SPLIT form (D > 128), _dispatch.HOPPER_BWD_OVERLAP.
template <typename T, int DPAD, int BM, int BN, bool CAUSAL, bool DET, bool DS_KMAJOR,
          typename POLICY, bool OV = false>
__global__ void __launch_bounds__(BwdWgmmaConfig<DPAD, BM, BN, DS_KMAJOR>::THREADS, 1)
cuflash_bwd_wgmma(const BwdParams p) {
    static_assert(POLICY::PLAIN, "a variant's policy: cuflash_bwd_wgmma_var");
    bwd_wgmma_body<T, DPAD, BM, BN, CAUSAL, DET, DS_KMAJOR, POLICY, OV>(p, nullptr);
}

// A variant's policy (variants.cuh), VariantParams the second argument (__grid_constant__: its
// address is taken without a local copy); cuflash/_dispatch_variants.py: hopper_bwd_variant_plan.
template <typename T, int DPAD, int BM, int BN, bool CAUSAL, bool DET, bool DS_KMAJOR,
          typename POLICY, bool OV = false>
__global__ void __launch_bounds__(BwdWgmmaConfig<DPAD, BM, BN, DS_KMAJOR>::THREADS, 1)
cuflash_bwd_wgmma_var(const BwdParams p, const __grid_constant__ VariantParams vp) {
    static_assert(!POLICY::PLAIN, "the plain policy: cuflash_bwd_wgmma");
    bwd_wgmma_body<T, DPAD, BM, BN, CAUSAL, DET, DS_KMAJOR, POLICY, OV>(p, &vp);
}

}  // namespace cuflash
