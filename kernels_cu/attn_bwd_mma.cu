// attn_bwd_mma.cu: the tensor-core backward kernel for float16 / bfloat16 (mma.sync m16n8k16,
// sm_80 and later; also the sm_90 backward until a Hopper one exists). notes/BACKWARD.md.
//
// One key-parallel kernel, cuflash_bwd_mma: a block owns BN = 16 * NWARPS keys of one k/v owner
// (dk, dv accumulate in registers, float32) and loops over the batch entries it sums (kv_red) and,
// for each, over the query tiles of BM rows that see its keys (causal: from the tile holding the
// first row that sees its first key). Per query tile (i = query, j = key; warp w owns keys
// 16 w .. 16 w + 15 of the block, so every product below is "keys x something" and needs no
// transposed accumulator):
//   S^T  = K_w Q^T                      A: K rows (ldmatrix), B: Q rows (ldmatrix)
//   P^T  = exp2(S^T scale_log2 - lse_i log2(e))   (0 where masked; lse = -inf rows: 0)
//   dV  += P^T dO                       A: P^T packed to 16 bits from the accumulators,
//                                       B: dO (ldmatrix.trans)
//   dP^T = V_w dO^T                     A: V rows, B: dO rows
//   dS^T = P^T (dP^T - delta_i)         (P as rounded to 16 bits for dV)
//   dK  += dS^T Q                       A: dS^T packed, B: Q (ldmatrix.trans)
//   dS^T -> shared memory; barrier;
//   dQ_tile = dS K  (BM x D over the block's BN keys), the warps splitting it into m16 tiles x
//   column groups, DQ_CHUNK columns at a time: A = dS from dS^T in shared memory (ldmatrix.trans),
//   B = K (ldmatrix.trans); added to the float32 dq accumulator (without the scale;
//   cuflash_bwd_convert_dq multiplies by it).
// At the end dk = scale * dK and dv = dV are written once (keys past Sk are not written; keys no
// row sees get zeros).
//
// dq accumulation. DET = false: float atomics (bwd_red_add2; order-dependent in the last bits).
// DET = true:
// the blocks that add into one dq tile (one q batch entry, one query tile of BM rows) take turns
// in descending key-block order: a turn counter per tile (an int in the padding column DPAD of the
// tile's first dq_accum row, zeroed by the preprocess) says how many key blocks have added; with
// n_last the last key block the tile sees (keys_needed), key block n waits until it reads
// n_last - n, adds, every thread fences, and after a barrier thread 0 stores n_last - n + 1.
// The key blocks that touch a query tile are 0 .. n_last (causal or not), so the turns are dense. Every element of dq is then
// ((0 + c_last) + c_last-1) + ... in a fixed order, whatever the grid and the scheduling: bitwise
// reproducible and independent of the batch size. Key blocks are numbered from the end of the grid
// (blockIdx 0 is the last key block of a batch entry), so a block only ever waits for blocks of
// lower index, dispatched before it: the wait cannot deadlock. Cost (notes/BACKWARD.md): under the
// causal mask the diagonal block reaches a tile first anyway; without it the blocks of a batch
// entry start staggered by one dQ phase each.
//
// Pipeline (STAGES = 2): Q, dO, lse and delta of the next query tile are requested (cp.async)
// right after the barrier that opens the current one, into the other buffer. STAGES = 1: after
// the barrier that publishes dS^T (Q and dO are no longer read), overlapping the dQ product.
//
// Shared memory (16-bit elements, rows padded by 16 bytes so that ldmatrix rows hit distinct
// banks): K, V (BN x (DPAD + 8) each), STAGES x (Q, dO) (BM x (DPAD + 8)), dS^T (BN x (BM + 8)),
// STAGES x (lse * log2(e), delta) (BM floats each). Rows past Sq / Sk and columns past D are
// zero-filled by the copies; padded query rows get lse2 = +inf (P = 0) and delta = 0.
//
// Requirements checked on the host (cuflash/_dispatch.py: bwd_tensorcore_reason): float16 or
// bfloat16, D == Dv, D % 8 == 0, D <= DPAD, rows of q, k, v, do (and dk, dv) 16-byte aligned,
// q not broadcast when DET (one q owner per dq tile).
#include "common.cuh"
#include "fp16split.cuh"
#include "variants.cuh"

namespace cuflash {

// F32: the float32 form (T = float, OP = fp16_t, "3xfp16"; see "float32" below): K, V, Q, dO
// land as float32 rows of DPAD + 4 words and are split in place into fp16 hi and lo halves
// (split16_block); dS^T is kept as two 16-bit tiles (hi, lo); a third row array (1 / l) and the
// split's reduction words and dS^T exponents follow the float sections.
template <int DPAD, int BM, int BN, int NWARPS, int STAGES, bool F32 = false>
struct BwdMmaConfig {
    static constexpr int THREADS = 32 * NWARPS;
    static constexpr int SD = F32 ? DPAD + 4 : DPAD + 8;  // row stride of K, V, Q, dO (elements)
    static constexpr int SDS = BM + 8;             // row stride of dS^T (16-bit elements)
    static constexpr int ESZ = F32 ? 4 : 2;        // bytes per element of K, V, Q, dO
    static constexpr int CHUNKS = DPAD * ESZ / 16;  // 16-byte chunks per row
    static constexpr int NT_Q = BM / 8;            // n8 tiles of S^T per warp (query columns)
    static constexpr int NT_D = DPAD / 8;          // n8 tiles of dK, dV per warp
    static constexpr int MT_Q = BM / 16;           // m16 tiles of the dQ product
    static constexpr int DQ_GROUPS = NWARPS / MT_Q;  // column groups of the dQ product
    static constexpr int DQ_COLS = DPAD / DQ_GROUPS;
    static constexpr int DQ_CHUNK = DQ_COLS >= 32 ? 32 : DQ_COLS;
    // Shared-memory layout, in elements of T from the start (float sections at the end); dS^T
    // takes BN * SDS elements: one 16-bit tile, or (F32) a hi and a lo 16-bit tile.
    static constexpr int K_OFF = 0;
    static constexpr int V_OFF = BN * SD;
    static constexpr int Q_OFF = 2 * BN * SD;
    static constexpr int DO_OFF = Q_OFF + STAGES * BM * SD;
    static constexpr int DS_OFF = DO_OFF + STAGES * BM * SD;
    static constexpr int HALF_ELEMS = DS_OFF + BN * SDS;
    static constexpr int ROW_ARRAYS = F32 ? 3 : 2;  // lse2 (F32: m), delta, (F32) 1 / l
    static constexpr int EXTRA_WORDS = F32 ? 6 * NWARPS : 0;  // split maxes, dS^T exponents
    static constexpr int SMEM_BYTES =
        HALF_ELEMS * ESZ + STAGES * ROW_ARRAYS * BM * 4 + EXTRA_WORDS * 4;
    static_assert(BN == 16 * NWARPS, "a warp owns 16 keys");
    static_assert(DPAD % 16 == 0 && BM % 16 == 0, "tile shapes are multiples of 16");
    static_assert(NWARPS % MT_Q == 0 && DPAD % DQ_GROUPS == 0, "the dQ split must be exact");
    static_assert(DQ_COLS % DQ_CHUNK == 0 && DQ_CHUNK % 16 == 0, "dQ chunks of 16 columns");
    static_assert(STAGES == 1 || STAGES == 2, "one or two Q/dO buffers");
    static_assert(BM % 32 == 0, "dP^T goes in two halves of whole k16 slices");
};

// Every accumulator fragment of a product to zero.
template <int N>
__device__ __forceinline__ void zero_frags(float (&acc)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][e] = 0.f;
}

template <typename T, int DPAD, int BM, int BN, int NWARPS, int STAGES>
struct BwdMmaOps {
    using Cfg = BwdMmaConfig<DPAD, BM, BN, NWARPS, STAGES>;
    // ldmatrix lane offsets (bytes): lr = lane % 8 is the row inside an 8x8 matrix, lm = lane / 8
    // the matrix.
    //   a_rows: A operand from a row-major tile (rows = m: 0-7 | 8-15 by lm % 2, k: 0-7 | 8-15 by
    //           lm / 2), the forward's Q.
    //   b_rows: B operand pair from rows = n (n 0-7 | 8-15 by lm / 2, k by lm % 2), the forward's K.
    //   b_trans: B operand pair from rows = k (k 0-7 | 8-15 by lm % 2, n by lm / 2), .trans, the
    //           forward's V.
    //   a_trans: A operand from a tile stored k-major (rows = k: 0-7 | 8-15 by lm / 2, columns
    //           = m: 0-7 | 8-15 by lm % 2), .trans: dS from dS^T.
    unsigned int a_rows, b_rows, b_trans, a_trans_ds;
    __device__ __forceinline__ BwdMmaOps(int lane) {
        const int lr = lane % 8, lm = lane / 8;
        a_rows = ((lr + 8 * (lm % 2)) * Cfg::SD + 8 * (lm / 2)) * 2;
        b_rows = ((lr + 8 * (lm / 2)) * Cfg::SD + 8 * (lm % 2)) * 2;
        b_trans = ((lr + 8 * (lm % 2)) * Cfg::SD + 8 * (lm / 2)) * 2;
        a_trans_ds = ((lr + 8 * (lm / 2)) * Cfg::SDS + 8 * (lm % 2)) * 2;
    }

    // acc (16 keys x NT * 8 rows) = A_w B^T: A = the warp's 16 rows of K or V at a_tile (shared
    // address of the warp's first row), B = NT * 8 rows of Q or dO from b_tile (shared address of
    // the first of them).
    template <int NT>
    __device__ __forceinline__ void keys_by_rows(float (&acc)[NT][4], unsigned int a_tile,
                                                 unsigned int b_tile) const {
        static_assert(NT % 2 == 0, "pairs of n8 tiles");
        zero_frags(acc);
#pragma unroll
        for (int kk = 0; kk < DPAD / 16; ++kk) {
            unsigned int a[4];
            ldmatrix_x4(a_tile + a_rows + kk * 16 * 2, a[0], a[1], a[2], a[3]);
            // All B fragments of the step first, then the products: the loads are in flight
            // together instead of each product waiting for its own.
            unsigned int b[NT / 2][4];
#pragma unroll
            for (int nn = 0; nn < NT / 2; ++nn)
                ldmatrix_x4(b_tile + b_rows + (nn * 16 * Cfg::SD + kk * 16) * 2, b[nn][0],
                            b[nn][1], b[nn][2], b[nn][3]);
#pragma unroll
            for (int nn = 0; nn < NT / 2; ++nn) {
                Mma<T>::run(acc[2 * nn], a, b[nn][0], b[nn][1]);
                Mma<T>::run(acc[2 * nn + 1], a, b[nn][2], b[nn][3]);
            }
        }
    }

    // acc (16 keys x DPAD) += X (16 keys x BM, packed A fragments) B, B = Q or dO (BM x DPAD) at
    // b_tile, read transposed.
    __device__ __forceinline__ void keys_by_cols(float (&acc)[Cfg::NT_D][4],
                                                 const unsigned int (&x)[BM / 16][4],
                                                 unsigned int b_tile) const {
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk) {
#pragma unroll
            for (int nn = 0; nn < DPAD / 16; ++nn) {
                unsigned int b0, b1, b2, b3;
                ldmatrix_x4_trans(b_tile + b_trans + (kk * 16 * Cfg::SD + nn * 16) * 2, b0, b1,
                                  b2, b3);
                Mma<T>::run(acc[2 * nn], x[kk], b0, b1);
                Mma<T>::run(acc[2 * nn + 1], x[kk], b2, b3);
            }
        }
    }

    // acc (16 query rows x DQ_CHUNK columns) = dS K over the block's BN keys: dS from dS^T at
    // ds_tile (shared address of query column mq * 16 of row 0), K from k_tile (shared address of
    // column col0 of key 0), read transposed.
    __device__ __forceinline__ void dq_chunk(float (&acc)[Cfg::DQ_CHUNK / 8][4],
                                             unsigned int ds_tile, unsigned int k_tile) const {
        zero_frags(acc);
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            unsigned int a[4];
            ldmatrix_x4_trans(ds_tile + a_trans_ds + kk * 16 * Cfg::SDS * 2, a[0], a[1], a[2],
                              a[3]);
#pragma unroll
            for (int nn = 0; nn < Cfg::DQ_CHUNK / 16; ++nn) {
                unsigned int b0, b1, b2, b3;
                ldmatrix_x4_trans(k_tile + b_trans + (kk * 16 * Cfg::SD + nn * 16) * 2, b0, b1,
                                  b2, b3);
                Mma<T>::run(acc[2 * nn], a, b0, b1);
                Mma<T>::run(acc[2 * nn + 1], a, b2, b3);
            }
        }
    }
};

// ---- float32 (F32: T = float, OP = fp16_t, "3xfp16"; notes/BACKWARD.md "float32 on the tensor
// cores"). Every float32 tile (K, V once per block, Q, dO per query tile) lands as float32 and is
// split in place (fp16split.cuh: split16_block): row r's first 2 DPAD bytes hold the fp16 hi parts
// of x 2^e, the next 2 DPAD bytes the lo parts, e one power of two per tile. P (<= 1) is split in
// registers as P 2^BWD_P16_LOG2, dS^T per warp and half tile with an exponent of its own (the
// warp's max, no barrier). Each multiply-add of the five products is three m16n8k16 fp16 products
// (hi hi, hi lo, lo hi; lo lo, 2^-22 of the product, is dropped), and every k16 step is
// promoted: its hi hi product from a zeroed fragment, its two small ones chained from another
// zeroed fragment, both added to the float32 accumulator in IEEE arithmetic (S^T, dP^T in scaled
// units, scaled once at the end; dV, dK, dQ through one FFMA each by the step's power of two,
// which is exact). No accumulator chain of the tensor cores (which truncate) spans more than one
// k16 step.
constexpr int BWD_P16_LOG2 = 13;  // P 2^13 <= 2^13 (P <= 1; a P up to 8 still fits fp16)

template <int DPAD, int BM, int BN, int NWARPS, int STAGES>
struct BwdMmaSplitOps {
    using Cfg = BwdMmaConfig<DPAD, BM, BN, NWARPS, STAGES, true>;
    static constexpr unsigned int RS = Cfg::SD * 4;  // bytes per split row
    static constexpr unsigned int LO = DPAD * 2;     // the lo half of a row, in bytes
    // ldmatrix lane offsets (bytes) as in BwdMmaOps, on split rows (a_trans_ds: dS^T tiles).
    unsigned int a_rows, b_rows, b_trans, a_trans_ds;
    __device__ __forceinline__ BwdMmaSplitOps(int lane) {
        const int lr = lane % 8, lm = lane / 8;
        a_rows = (lr + 8 * (lm % 2)) * RS + 16 * (lm / 2);
        b_rows = (lr + 8 * (lm / 2)) * RS + 16 * (lm % 2);
        b_trans = (lr + 8 * (lm % 2)) * RS + 16 * (lm / 2);
        a_trans_ds = ((lr + 8 * (lm / 2)) * Cfg::SDS + 8 * (lm % 2)) * 2;
    }
    // One k16 step of one n8 tile: t = a_hi b_hi and u = a_hi b_lo + a_lo b_hi, both from zero.
    static __device__ __forceinline__ void step(float (&t)[4], float (&u)[4],
                                                const unsigned int (&ah)[4],
                                                const unsigned int (&al)[4], unsigned int bh0,
                                                unsigned int bh1, unsigned int bl0,
                                                unsigned int bl1) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            t[e] = 0.f;
            u[e] = 0.f;
        }
        Mma<fp16_t>::run(t, ah, bh0, bh1);
        Mma<fp16_t>::run(u, ah, bl0, bl1);
        Mma<fp16_t>::run(u, al, bh0, bh1);
    }
    template <bool TRANS>
    static __device__ __forceinline__ void ld_split(unsigned int addr, unsigned int lo_off,
                                                    unsigned int (&hi)[4],
                                                    unsigned int (&lo)[4]) {
        if constexpr (TRANS) {
            ldmatrix_x4_trans(addr, hi[0], hi[1], hi[2], hi[3]);
            ldmatrix_x4_trans(addr + lo_off, lo[0], lo[1], lo[2], lo[3]);
        } else {
            ldmatrix_x4(addr, hi[0], hi[1], hi[2], hi[3]);
            ldmatrix_x4(addr + lo_off, lo[0], lo[1], lo[2], lo[3]);
        }
    }
    // acc[n0] and acc[n0 + 1] (the two n8 tiles of one x4 B pair) += f (A B) for one k16 step,
    // t and u each added through an IEEE FFMA (f = 1: an FADD).
    template <int N>
    static __device__ __forceinline__ void step_pair(float (&acc)[N][4], int n0,
                                                     const unsigned int (&ah)[4],
                                                     const unsigned int (&al)[4],
                                                     const unsigned int (&bh)[4],
                                                     const unsigned int (&bl)[4], float f) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float t[4], u[4];
            step(t, u, ah, al, bh[2 * h], bh[2 * h + 1], bl[2 * h], bl[2 * h + 1]);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                acc[n0 + h][e] = fmaf(t[e], f, acc[n0 + h][e]);
                acc[n0 + h][e] = fmaf(u[e], f, acc[n0 + h][e]);
            }
        }
    }

    // acc (16 rows x NT * 8 rows) = A_w B^T in scaled units (x 2^(ea + eb)): A = 16 split rows at
    // a_tile (shared address of the first), B = NT * 8 split rows at b_tile.
    template <int NT>
    __device__ __forceinline__ void keys_by_rows(float (&acc)[NT][4], unsigned int a_tile,
                                                 unsigned int b_tile) const {
        static_assert(NT % 2 == 0, "pairs of n8 tiles");
        zero_frags(acc);
        // Not unrolled (as the forward's split scores): each step's fragments stay in the step.
#pragma unroll 1
        for (int kk = 0; kk < DPAD / 16; ++kk) {
            unsigned int ah[4], al[4];
            ld_split<false>(a_tile + a_rows + kk * 32, LO, ah, al);
#pragma unroll
            for (int nn = 0; nn < NT / 2; ++nn) {
                unsigned int bh[4], bl[4];
                ld_split<false>(b_tile + b_rows + nn * 16 * RS + kk * 32, LO, bh, bl);
                step_pair(acc, 2 * nn, ah, al, bh, bl, 1.f);
            }
        }
    }

    // acc (16 keys x DPAD) += sum over the BM / 16 k16 steps kk of f[kk] (X_kk B_kk): X = hi / lo
    // A fragments (16 keys x BM, registers), B = Q or dO split rows (BM x DPAD) at b_tile, read
    // transposed; f[kk] the step's power of two.
    __device__ __forceinline__ void keys_by_cols(float (&acc)[Cfg::NT_D][4],
                                                 const unsigned int (&xh)[BM / 16][4],
                                                 const unsigned int (&xl)[BM / 16][4],
                                                 unsigned int b_tile,
                                                 const float (&f)[BM / 16]) const {
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk) {
#pragma unroll
            for (int nn = 0; nn < DPAD / 16; ++nn) {
                // A scheduling fence (f is a power of two, never 0; neither compiler knows it):
                // ptxas does not move the later steps' loads and products across the branch
                // (without it D = 128 took 255 registers and spilled, as in the forward's P V).
                if (f[kk] == 0.f) asm volatile("trap;");
                unsigned int bh[4], bl[4];
                ld_split<true>(b_tile + b_trans + kk * 16 * RS + nn * 32, LO, bh, bl);
                step_pair(acc, 2 * nn, xh[kk], xl[kk], bh, bl, f[kk]);
            }
        }
    }

    // acc (16 query rows x DQ_CHUNK columns) = sum over the block's key steps kk of
    // f[kk] (dS_kk K_kk): dS from the dS^T hi tile at ds_tile (shared address of query column
    // mq * 16 of row 0; the lo tile ds_lo bytes further), K split rows from k_tile (shared
    // address of the hi half's column col0 of key 0), read transposed.
    __device__ __forceinline__ void dq_chunk(float (&acc)[Cfg::DQ_CHUNK / 8][4],
                                             unsigned int ds_tile, unsigned int ds_lo,
                                             unsigned int k_tile, const float (&f)[BN / 16]) const {
        zero_frags(acc);
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            unsigned int ah[4], al[4];
            ld_split<true>(ds_tile + a_trans_ds + kk * 16 * Cfg::SDS * 2, ds_lo, ah, al);
#pragma unroll
            for (int nn = 0; nn < Cfg::DQ_CHUNK / 16; ++nn) {
                if (f[kk] == 0.f) asm volatile("trap;");  // a scheduling fence (keys_by_cols)
                unsigned int bh[4], bl[4];
                ld_split<true>(k_tile + b_trans + kk * 16 * RS + nn * 32, LO, bh, bl);
                step_pair(acc, 2 * nn, ah, al, bh, bl, f[kk]);
            }
        }
    }
};

// OPT: bits of the speed candidates (notes/BACKWARD.md "Speed candidates"; the dispatcher's
// config tables choose them, 0 is the form measured first):
//   BWD_OPT_LEAN (1): per-tile bookkeeping without integer divisions (the query tile and the
//     reduction step advance as counters; a batch entry's coordinates are recomputed only when
//     the reduction step changes), lse and delta of the next tile fetched into registers after
//     the opening barrier and stored to shared memory only before the dS^T barrier (STAGES = 2;
//     the store no longer waits for the global load at once), and the exp2 of tiles that need
//     no mask without the mask's compares and selects. Same arithmetic, bitwise the same result.
//   BWD_OPT_LATE (2, DET only): the turn of a tile is handed on after the block's next barrier,
//     by thread 0 alone (fence + release, cumulative through bar.sync), instead of every thread
//     fencing its additions and a barrier before the release.
constexpr int BWD_OPT_LEAN = 1;
constexpr int BWD_OPT_LATE = 2;

// ---- Variants (kernels_cu/variants.cuh, notes/VARIANTS.md): P^T of one warp's 16 keys x BM
// query columns from the raw scores S^T, for a policy V: the scaled score goes through
// score_grad_x, the forward's transform (variants.cuh: variant_scores_as calls score_x; unfused
// (FORM without bit 2) the same instructions, so the same logits and P that matches the forward's
// lse bit for bit; fused, the same form with ALiBi's distance whole, equal to rounding), and on
// partial tiles (PARTIAL: the key
// tail, the causal diagonal, a window edge, a mask) through the per-element visibility; the
// derivative d score / d t goes to dsc where the policy has one (V::DSCORE: softcap, a score_mod).
// Rows past Sq and keys past Sk are clamped for the policy's reads (their P is 0: lse2 = +inf,
// resp. masked). `dist` (ALiBi) is i + off - j as a float, exact below 2^24 as in the forward.
// (The scale is an unfused multiply, as in the forward's variant_scores_as: no contraction with
// the transform's additions may differ between the two kernels.)
template <int NT, bool CAUSAL, bool PARTIAL, typename V>
__device__ __forceinline__ void bwd_variant_probs(float (&s)[NT][4],
                                                  float (&dsc)[V::DSCORE ? NT : 1][4],
                                                  const V& var, const float* lse_t, int i0,
                                                  int key_w, int t4, int sq, int sk, int diag,
                                                  float scale) {
    constexpr float LOG2E = 1.4426950408889634f;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int qc = nt * 8 + 2 * t4 + (e % 2);  // query column in the tile
            const int row = i0 + qc;
            const int key = key_w + 8 * (e / 2);
            const int r = V::READS ? min(row, sq - 1) : row;
            const int kc = (V::READS && PARTIAL) ? min(key, sk - 1) : key;
            float ds;
            const float t = var.template score_grad_x<true, CAUSAL>(
                s[nt][e], scale, r, kc, static_cast<float>(row + diag - key), 0.f, ds);
            float x = fast_exp2(fmaf(t, LOG2E, -lse_t[qc]));
            if constexpr (PARTIAL) {   // `&` without reads: as variant_scores_as
                bool ok = key < sk;
                if (CAUSAL) ok = ok & (key <= row + diag);
                if (V::MASKS)
                    ok = V::READS ? (ok && var.visible_tc(r, kc)) : (ok & var.visible_tc(r, kc));
                x = ok ? x : 0.f;
            }
            s[nt][e] = x;
            if constexpr (V::DSCORE) dsc[nt][e] = ds;
        }
}

// P^T in place from S^T (one warp's 16 keys x NT * 8 query columns): prob(s, query column) where
// the key is real and (causal) seen by the row, else 0 (keys past Sk: zero-filled K gives s = 0,
// not -inf; rows past Sq and rows without keys have lse2 / m = +inf). Branch-free: key key_w + 8 h
// is seen by query column qc iff it is a real key and (causal) qc >= key_w + 8 h - i0 - diag;
// tiles that need no mask get bounds every element passes. (A function, not a generic lambda:
// NVRTC 13.0 takes a lambda with an `auto` parameter for a host function.)
template <int NT, int BM, bool CAUSAL, typename Prob>
__device__ __forceinline__ void bwd_masked_probs(float (&s)[NT][4], bool need_mask, int i0,
                                                 int key_w, int sk, int diag, int t4,
                                                 const Prob& prob) {
    const int lo = (CAUSAL && need_mask) ? key_w - i0 - diag : -BM;
    const bool real0 = key_w < sk, real1 = key_w + 8 < sk;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int qc = nt * 8 + 2 * t4 + (e % 2);  // query column in the tile
            const float x = prob(s[nt][e], qc);
            const bool ok = (e / 2 ? real1 : real0) && qc >= lo + 8 * (e / 2);
            s[nt][e] = ok ? x : 0.f;
        }
}

// OP: the operand type of the products, T for float16 / bfloat16; fp16_t for T = float, the
// float32 form (F16S, "3xfp16"; see "float32" above): m and l from lse_acc (the "rows" pass,
// cuflash_bwd_stats_mma) instead of lse, plain tiles only (V = PlainVariant), OPT without LEAN.
template <typename T, int DPAD, int BM, int BN, int NWARPS, int STAGES, int MINB, bool CAUSAL,
          bool DET, int OPT, typename V, typename OP = T>
__device__ __forceinline__ void bwd_mma_body(const BwdParams& p, const VariantParams* vpp) {
    constexpr bool F16S = sizeof(T) == 4;
    constexpr bool LEAN = (OPT & BWD_OPT_LEAN) != 0;
    constexpr bool LATE = DET && (OPT & BWD_OPT_LATE) != 0;
    static_assert((OPT & ~(BWD_OPT_LEAN | BWD_OPT_LATE)) == 0, "unknown OPT bits");
    static_assert(!LEAN || BM <= 32 * NWARPS, "LEAN: one thread per lse / delta row");
    static_assert(F16S ? (sizeof(OP) == 2 && !LEAN && V::PLAIN) : sizeof(OP) == sizeof(T),
                  "OP: T for 16-bit inputs; fp16_t for float32 (3xfp16), plain, without LEAN");
    using Cfg = BwdMmaConfig<DPAD, BM, BN, NWARPS, STAGES, F16S>;
    using Ops = typename Select<F16S, BwdMmaSplitOps<DPAD, BM, BN, NWARPS, STAGES>,
                                BwdMmaOps<T, DPAD, BM, BN, NWARPS, STAGES>>::type;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* smem = reinterpret_cast<T*>(smem_raw);
    T* k_s = smem + Cfg::K_OFF;
    T* v_s = smem + Cfg::V_OFF;
    T* ds_s = smem + Cfg::DS_OFF;  // (F16S: the hi tile, then the lo tile)
    float* lse_s = reinterpret_cast<float*>(smem + Cfg::HALF_ELEMS);  // STAGES x BM (F16S: m)
    float* delta_s = lse_s + STAGES * BM;                              // STAGES x BM
    // F16S: 1 / l per row (STAGES x BM), the split maxes (K, V, then Q, dO: NWARPS words each)
    // and the exponents of dS^T per warp and half tile (2 NWARPS).
    [[maybe_unused]] float* linv_s = delta_s + STAGES * BM;
    [[maybe_unused]] unsigned int* red_s =
        reinterpret_cast<unsigned int*>(linv_s + (F16S ? STAGES * BM : 0));
    [[maybe_unused]] int* dse_s = reinterpret_cast<int*>(red_s + 4 * NWARPS);
    [[maybe_unused]] constexpr unsigned int DS_LO = BN * Cfg::SDS * 2;  // hi tile to lo tile, bytes

    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const int lane = tid % 32;
    const int g = lane / 4, t4 = lane % 4;
    const unsigned int nn_blocks = static_cast<unsigned int>(p.n_nblocks);
    const unsigned int owner = blockIdx.x / nn_blocks;
    // Key blocks in reverse order: the turns (DET) go from the last key block that a query tile
    // sees down to key block 0, so a block only waits for blocks of higher key index, which are
    // dispatched before it.
    const int nblock = static_cast<int>(nn_blocks - 1 - blockIdx.x % nn_blocks);
    const int key0 = nblock * BN;
    const int sq = static_cast<int>(p.sq), sk = static_cast<int>(p.sk);
    const int d = static_cast<int>(p.d);
    const int diag = sk - sq;  // row i sees keys j <= i + diag
    const unsigned int n_red = bwd_reduce_count(p, p.kv_red);
    const int n_mtiles = (sq + BM - 1) / BM;
    // Query tiles that see any of the block's keys: all, or from the tile of the first row that
    // sees key0 (none when that row is past Sq).
    const int first_row = CAUSAL ? static_cast<int>(causal_first_row(key0, p.sq, p.sk)) : 0;
    int m_first = first_row >= sq ? n_mtiles : first_row / BM;
    // Variants: the policy bound to the first batch entry (rebound when the reduction step
    // changes); its window narrows the query tiles to those holding a row that sees one of the
    // block's keys by position (row_range), [m_first, m_end). A block whose range is empty visits
    // no tile (it writes zeros). The relation is the one key_range gives from the tile's side,
    // so the turns of DET stay dense (my_turn below).
    int m_end = n_mtiles;
    V var;
    if constexpr (!V::PLAIN) {
        const BwdIndex ix0 = bwd_index(p, p.kv_red, owner, 0);
        var.bind(*vpp, p.sq, p.sk, ix0.i0, ix0.i1, ix0.i2);
        long long r0, r1;
        var.row_range(key0, min(key0 + BN, sk), r0, r1, p.sq);
        if (r0 >= r1) {
            m_end = m_first;
        } else {
            m_first = max(m_first, static_cast<int>(r0 / BM));
            m_end = max(m_first, min(n_mtiles, static_cast<int>((r1 + BM - 1) / BM)));
        }
    }
    const int n_iter = static_cast<int>(n_red) * (m_end - m_first);
    const float scale_log2 = static_cast<float>(p.scale_log2);
    constexpr float LOG2E = 1.4426950408889634f;

    // K and V of the block (the same for every reduction step: stride 0 along kv_red).
    const BwdOffsets off0 = bwd_offsets(p, bwd_index(p, p.kv_red, owner, 0));
    load_tile<BN, Cfg::CHUNKS, Cfg::SD, Cfg::THREADS>(k_s, static_cast<const T*>(p.k) + off0.k,
                                                      p.k_sr, key0, sk, d, tid);
    load_tile<BN, Cfg::CHUNKS, Cfg::SD, Cfg::THREADS>(v_s, static_cast<const T*>(p.v) + off0.v,
                                                      p.v_sr, key0, sk, d, tid);

    // Request a query tile (Q, dO, lse * log2(e), delta) of batch coordinates ix, first row i0,
    // into buffer buf. `defer` (LEAN, STAGES = 2): lse * log2(e) and delta go to l2_r, dl_r
    // (thread tid < BM: row i0 + tid), stored to shared memory before the dS^T barrier;
    // otherwise straight to shared memory.
    // F16S: l2 = m (the row max of the scaled scores, +inf for a row without keys), li = 1 / l,
    // from the stats the "rows" pass left in lse_acc (m, then l nb0 nb1 nb2 Sq elements later).
    [[maybe_unused]] const long long n_rows = p.nb0 * p.nb1 * p.nb2 * p.sq;
    const auto fetch_ld = [&](const BwdOffsets& off, int i0, int r, float& l2, float& dl,
                              float& li) {
        const int row = i0 + r;
        l2 = __int_as_float(0x7f800000);  // +inf: P = exp2(x - inf) = 0
        dl = 0.f;
        li = 1.f;
        if (row < sq) {
            if constexpr (F16S) {
                const float* stats = static_cast<const float*>(p.lse_acc) + off.delta + row;
                const float m = stats[0];
                if (m != neg_inf<float>()) l2 = m;
                li = 1.f / stats[n_rows];
            } else {
                const float l = p.lse[off.lse + static_cast<long long>(row) * p.lse_sr];
                if (l != neg_inf<float>()) l2 = l * LOG2E;
            }
            dl = static_cast<const float*>(p.delta)[off.delta + row];
        }
    };
    const auto load_rows_at = [&](const BwdIndex& ix, int i0, int buf, bool defer, float& l2_r,
                                  float& dl_r) {
        const BwdOffsets off = bwd_offsets(p, ix);
        load_tile<BM, Cfg::CHUNKS, Cfg::SD, Cfg::THREADS>(
            smem + Cfg::Q_OFF + buf * BM * Cfg::SD, static_cast<const T*>(p.q) + off.q, p.q_sr,
            i0, sq, d, tid);
        load_tile<BM, Cfg::CHUNKS, Cfg::SD, Cfg::THREADS>(
            smem + Cfg::DO_OFF + buf * BM * Cfg::SD, static_cast<const T*>(p.dout) + off.dout,
            p.do_sr, i0, sq, d, tid);
        if (defer) {
            float unused;
            if (tid < BM) fetch_ld(off, i0, tid, l2_r, dl_r, unused);
            return;
        }
        for (int r = tid; r < BM; r += Cfg::THREADS) {
            float l2, dl, li;
            fetch_ld(off, i0, r, l2, dl, li);
            lse_s[buf * BM + r] = l2;
            delta_s[buf * BM + r] = dl;
            if constexpr (F16S) linv_s[buf * BM + r] = li;
        }
    };
    // Iteration `it`'s query tile (the form without LEAN: coordinates from divisions).
    const auto load_rows = [&](int it) {
        const int red = it / (m_end - m_first);
        const int i0 = (m_first + it % (m_end - m_first)) * BM;
        float unused0, unused1;
        load_rows_at(bwd_index(p, p.kv_red, owner, red), i0, STAGES == 2 ? it % 2 : 0, false,
                     unused0, unused1);
    };
    // LEAN: the iteration after (mt, red, ix): the next query tile, or the first tile of the next
    // reduction step (the only place that divides).
    const auto advance = [&](int& mt, int& red, BwdIndex& ix) {
        if (++mt == m_end) {
            mt = m_first;
            ++red;
            if (red < static_cast<int>(n_red)) ix = bwd_index(p, p.kv_red, owner, red);
        }
    };
    // LEAN: the current iteration's query tile and reduction step, and its batch coordinates.
    int cur_mt = m_first, cur_red = 0;
    BwdIndex cur_ix = bwd_index(p, p.kv_red, owner, 0);
    float l2_next = 0.f, dl_next = 0.f;  // LEAN, STAGES = 2: the next tile's lse2 / delta row
    if (n_iter > 0) {
        if (LEAN) load_rows_at(cur_ix, m_first * BM, 0, false, l2_next, dl_next);
        else load_rows(0);
    }
    cp_async_commit();
    // F16S: K and V split in place once (each thread's own chunks, visible after its wait; the
    // first tile's opening barriers publish the halves).
    [[maybe_unused]] int ek = 0, ev = 0;
    if constexpr (F16S) {
        cp_async_wait<0>();
        split16_block<BN, Cfg::CHUNKS, Cfg::SD, Cfg::THREADS>(k_s, red_s, tid, ek, false, 0);
        split16_block<BN, Cfg::CHUNKS, Cfg::SD, Cfg::THREADS>(v_s, red_s + NWARPS, tid, ev, false,
                                                              0);
    }

    float dk_acc[Cfg::NT_D][4], dv_acc[Cfg::NT_D][4];
#pragma unroll
    for (int i = 0; i < Cfg::NT_D; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            dk_acc[i][e] = 0.f;
            dv_acc[i][e] = 0.f;
        }

    const Ops ops(lane);
    const unsigned int k_w = smem_addr(k_s + warp * 16 * Cfg::SD);  // the warp's 16 keys
    const unsigned int v_w = smem_addr(v_s + warp * 16 * Cfg::SD);
    const int key_w = key0 + warp * 16 + g;  // this thread's keys: key_w, key_w + 8
    // dQ split: warp -> query m-tile mq, column group cg.
    const int mq = warp % Cfg::MT_Q, cg = warp / Cfg::MT_Q;
    // P^T in place from S^T: prob(s, query column) where the key is real and (causal) seen by the
    // row, else 0 (keys past Sk: zero-filled K gives s = 0, not -inf). Branch-free: key key_w + 8 h
    // is seen by query column qc iff it is a real key and (causal) qc >= key_w + 8 h - i0 - diag;
    // tiles that need no mask get bounds every element passes.
    // A 16-bit dS^T tile at `tile` (rows = the block's keys, BM + 8 elements a row) gets this
    // warp's 16 rows from their packed A fragments.
    const auto store_ds = [&](unsigned char* tile, const unsigned int (&x)[BM / 16][4]) {
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk)
#pragma unroll
            for (int w = 0; w < 4; ++w) {
                const int row = warp * 16 + g + 8 * (w % 2);
                const int col = (2 * kk + w / 2) * 8 + 2 * t4;
                *reinterpret_cast<unsigned int*>(tile + (row * Cfg::SDS + col) * 2) = x[kk][w];
            }
    };

    // LATE (DET): the turn this block hands on once a barrier has ordered all its additions
    // before the hand-over: thread 0 releases it after the next barrier, so that no warp waits
    // for the fence of the release (cumulative through bar.sync, as a grid-wide barrier releases).
    int* pending = nullptr;
    int pending_turn = 0;
    [[maybe_unused]] int bound_red = 0;  // variants: the reduction step var is bound to
    const auto hand_on = [&]() {
        if (LATE && tid == 0 && pending != nullptr) {
            __threadfence();
            bwd_turn_store(pending, pending_turn);
        }
        pending = nullptr;
    };

    for (int it = 0; it < n_iter; ++it) {
        const int buf = STAGES == 2 ? it % 2 : 0;
        const int red = LEAN ? cur_red : it / (m_end - m_first);
        const int mtile = LEAN ? cur_mt : m_first + it % (m_end - m_first);
        const int i0 = mtile * BM;
        cp_async_wait<0>();
        [[maybe_unused]] int eq = 0, edo = 0;  // F16S: the exponents of this tile's Q and dO
        if constexpr (F16S) {
            // The two splits' barriers: every thread is past the previous dQ (and its reads of
            // dS^T, the exponents, the reduction words); then the halves are published.
            float* q_f = smem + Cfg::Q_OFF + buf * BM * Cfg::SD;
            float* do_f = smem + Cfg::DO_OFF + buf * BM * Cfg::SD;
            split16_block<BM, Cfg::CHUNKS, Cfg::SD, Cfg::THREADS>(q_f, red_s + 2 * NWARPS, tid,
                                                                  eq, false, 0);
            split16_block<BM, Cfg::CHUNKS, Cfg::SD, Cfg::THREADS>(do_f, red_s + 3 * NWARPS, tid,
                                                                  edo, false, 0);
        }
        __syncthreads();  // this tile's Q/dO/lse/delta landed (K, V too); the previous dQ is done
        if (LATE) hand_on();
        if (STAGES == 2 && it + 1 < n_iter) {
            if (LEAN) {
                int mt_n = cur_mt, red_n = cur_red;
                BwdIndex ix_n = cur_ix;
                advance(mt_n, red_n, ix_n);
                load_rows_at(ix_n, mt_n * BM, 1 - buf, true, l2_next, dl_next);
            } else {
                load_rows(it + 1);
            }
        }
        cp_async_commit();
        const unsigned int q_t = smem_addr(smem + Cfg::Q_OFF + buf * BM * Cfg::SD);
        const unsigned int do_t = smem_addr(smem + Cfg::DO_OFF + buf * BM * Cfg::SD);
        const float* lse_t = lse_s + buf * BM;
        const float* delta_t = delta_s + buf * BM;
        if constexpr (!V::PLAIN) {
            if (red != bound_red) {  // a new batch entry: its bias / mask / slope / hook indices
                const BwdIndex ix = LEAN ? cur_ix : bwd_index(p, p.kv_red, owner, red);
                var.bind(*vpp, p.sq, p.sk, ix.i0, ix.i1, ix.i2);
                bound_red = red;
            }
        }

        if constexpr (F16S) {
            const float* m_t = lse_t;  // the row max m of the scaled scores (+inf: no keys)
            const float* li_t = linv_s + buf * BM;
            const float scale = static_cast<float>(p.scale);
            // S^T (scaled units) -> P^T = exp(s scale - m) / l, split as P 2^BWD_P16_LOG2.
            unsigned int ph[BM / 16][4], pl[BM / 16][4];
            {
                float s[Cfg::NT_Q][4];
                ops.template keys_by_rows<Cfg::NT_Q>(s, k_w, q_t);
                scale_pow2(reinterpret_cast<float(&)[Cfg::NT_Q * 4]>(s), -(ek + eq));
                const bool need_mask = key0 + BN > sk || (CAUSAL && key0 + BN - 1 > i0 + diag);
                const auto prob = [&](float x, int qc) {
                    return acc_exp(__fmul_rn(x, scale) - m_t[qc]) * li_t[qc];
                };
                bwd_masked_probs<Cfg::NT_Q, BM, CAUSAL>(s, need_mask, i0, key_w, sk, diag, t4,
                                                        prob);
                pack_p_f16split<Cfg::NT_Q, BWD_P16_LOG2>(s, ph, pl);
            }
            // dV += P^T dO: the factor 2^-(BWD_P16_LOG2 + edo) (2^-139 .. 2^101, exact).
            {
                float f[BM / 16];
                const float fv = pow2f(-(BWD_P16_LOG2 + edo));
#pragma unroll
                for (int kk = 0; kk < BM / 16; ++kk) f[kk] = fv;
                ops.keys_by_cols(dv_acc, ph, pl, do_t, f);
            }
            // dP^T -> dS^T = P^T (dP^T - delta) in float32 (P as split: hi + lo, 22 bits), in two
            // halves of BM / 2 query columns; each half split with the exponent of its own max
            // (warp reduction), clamped so that both consumers' factors 2^-(e + eq) (dK) and
            // 2^-(e + ek) (dQ) are floats (2^-149 .. 2^126; the clamp only bites where the
            // products are below float32's normal range or overflow it anyway).
            unsigned int dsh[BM / 16][4], dsl[BM / 16][4];
            float fk[BM / 16];
            const int e_lo = -126 - min(eq, ek), e_hi = 149 - max(eq, ek);
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                constexpr int NH = Cfg::NT_Q / 2;  // n8 tiles per half
                float dp[NH][4];
                ops.template keys_by_rows<NH>(dp, v_w, do_t + hf * (BM / 2) * Ops::RS);
                scale_pow2(reinterpret_cast<float(&)[NH * 4]>(dp), -(ev + edo));
                unsigned int mx = FINITE_KEY0;
#pragma unroll
                for (int i = 0; i < NH; ++i)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int nt = hf * NH + i;
                        const int qc = nt * 8 + 2 * t4 + (e % 2);
                        const int w = (nt % 2) * 2 + e / 2;  // pack_p's layout
                        const float pv =
                            (unpack_half<fp16_t>(ph[nt / 2][w], e % 2) +
                             unpack_half<fp16_t>(pl[nt / 2][w], e % 2)) *
                            (1.f / static_cast<float>(1 << BWD_P16_LOG2));
                        dp[i][e] = pv == 0.f ? 0.f : pv * (dp[i][e] - delta_t[qc]);
                        mx = max(mx, finite_key(dp[i][e]));
                    }
                mx = __reduce_max_sync(0xffffffffu, mx);
                const int eds = min(max(split16_exponent(mx), e_lo), e_hi);
                scale_pow2(reinterpret_cast<float(&)[NH * 4]>(dp), eds);
                unsigned int hh[NH / 2][4], ll[NH / 2][4];
                pack_p_f16split<NH, 0>(dp, hh, ll);
#pragma unroll
                for (int kk = 0; kk < NH / 2; ++kk) {
                    fk[hf * (NH / 2) + kk] = pow2f(-(eds + eq));
#pragma unroll
                    for (int w = 0; w < 4; ++w) {
                        dsh[hf * (NH / 2) + kk][w] = hh[kk][w];
                        dsl[hf * (NH / 2) + kk][w] = ll[kk][w];
                    }
                }
                if (lane == 0) dse_s[warp * 2 + hf] = eds;
            }
            // dS^T hi and lo to shared memory (rows = the warp's keys, columns = the queries).
            store_ds(reinterpret_cast<unsigned char*>(ds_s), dsh);
            store_ds(reinterpret_cast<unsigned char*>(ds_s) + DS_LO, dsl);
            ops.keys_by_cols(dk_acc, dsh, dsl, q_t, fk);  // dK += dS^T Q (scale at the end)
        } else {
            // S^T -> P^T (16-bit, A layout of the dV product).
            unsigned int pk[BM / 16][4];
            [[maybe_unused]] float dsc[V::DSCORE ? Cfg::NT_Q : 1][4];  // d score / d t (variants)
            if constexpr (!V::PLAIN) {
                float s[Cfg::NT_Q][4];
                ops.keys_by_rows<Cfg::NT_Q>(s, k_w, q_t);
                // The warp's 16 keys against the tile's rows: per-element visibility only where the
                // tile is partial by position (warp-uniform branch), or on the key tail / causal
                // diagonal as in the plain kernel.
                const int kw0 = key0 + warp * 16;
                const bool partial =
                    kw0 + 16 > sk || (CAUSAL && kw0 + 15 > i0 + diag) ||
                    var.tile_kind(i0, min(i0 + BM, sq), kw0, kw0 + 16) != TILE_FULL;
                if (partial)
                    bwd_variant_probs<Cfg::NT_Q, CAUSAL, true>(s, dsc, var, lse_t, i0, key_w, t4, sq,
                                                               sk, diag, static_cast<float>(p.scale));
                else
                    bwd_variant_probs<Cfg::NT_Q, CAUSAL, false>(s, dsc, var, lse_t, i0, key_w, t4, sq,
                                                                sk, diag, static_cast<float>(p.scale));
                pack_p<T, Cfg::NT_Q>(s, pk);
            } else {
                float s[Cfg::NT_Q][4];
                ops.keys_by_rows<Cfg::NT_Q>(s, k_w, q_t);
                // Masked: keys past Sk (zero-filled K gives s = 0, not -inf) and, under the causal
                // mask, keys the row does not see. Rows past Sq and rows without keys have lse2 = +inf.
                // Branch-free mask: key key_w + 8 h is seen by query column qc iff it is a real key
                // and (causal) qc >= key_w + 8 h - i0 - diag. Tiles that need no mask get bounds
                // that every element passes.
                const bool need_mask = key0 + BN > sk || (CAUSAL && key0 + BN - 1 > i0 + diag);
                if (LEAN && !need_mask) {  // (uniform branch) every key real and seen
#pragma unroll
                    for (int nt = 0; nt < Cfg::NT_Q; ++nt)
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const int qc = nt * 8 + 2 * t4 + (e % 2);
                            s[nt][e] = fast_exp2(fmaf(s[nt][e], scale_log2, -lse_t[qc]));
                        }
                } else {
                    const auto prob = [&](float x, int qc) {
                        return fast_exp2(fmaf(x, scale_log2, -lse_t[qc]));
                    };
                    bwd_masked_probs<Cfg::NT_Q, BM, CAUSAL>(s, need_mask, i0, key_w, sk, diag,
                                                            t4, prob);
                }
                pack_p<T, Cfg::NT_Q>(s, pk);
            }
            ops.keys_by_cols(dv_acc, pk, do_t);  // dV += P^T dO

            // dP^T -> dS^T = P^T (dP^T - delta), packed; in two halves of BM / 2 query columns, so
            // that only half of dP^T is live beside P^T and the accumulators (registers: D = 128
            // spilled with the whole of it under NVRTC 13.0).
            unsigned int dsk[BM / 16][4];
            // dbias (a bias with return_dbias): the final score's gradient, before d score / d t,
            // per (batch entry, row, key) to vp.dscores (the host sums it to bias's shape). Every
            // (row, key) a block visits is written by it alone; unvisited ones stay 0.
            [[maybe_unused]] float* dsc_out = nullptr;
            if constexpr (!V::PLAIN && V::HAS_BIAS) {
                if (vpp->dscores != nullptr) {
                    const BwdIndex ix = LEAN ? cur_ix : bwd_index(p, p.kv_red, owner, red);
                    dsc_out = static_cast<float*>(vpp->dscores) + bwd_flat(p, ix) * p.sq * p.sk;
                }
            }
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                constexpr int NH = Cfg::NT_Q / 2;  // n8 tiles per half
                float dp[NH][4];
                ops.keys_by_rows<NH>(dp, v_w, do_t + hf * (BM / 2) * Cfg::SD * 2);
#pragma unroll
                for (int i = 0; i < NH; ++i)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int nt = hf * NH + i;                 // n8 tile of the query tile
                        const int qc = nt * 8 + 2 * t4 + (e % 2);
                        // pack_p's layout: tile nt, element e sits in word (nt % 2) * 2 + e / 2 of
                        // pk[nt / 2], the high half for odd e.
                        const float pv = unpack_half<T>(pk[nt / 2][(nt % 2) * 2 + e / 2], e % 2);
                        dp[i][e] = pv == 0.f ? 0.f : pv * (dp[i][e] - delta_t[qc]);
                        if constexpr (!V::PLAIN && V::HAS_BIAS) {
                            const int row = i0 + qc, key = key_w + 8 * (e / 2);
                            if (dsc_out != nullptr && row < sq && key < sk)
                                dsc_out[static_cast<long long>(row) * sk + key] = dp[i][e];
                        }
                        // (a masked element's derivative is never read: a hook's may be NaN there)
                        if constexpr (!V::PLAIN && V::DSCORE)
                            dp[i][e] = pv == 0.f ? 0.f : dp[i][e] * dsc[nt][e];
                    }
                unsigned int half[NH / 2][4];
                pack_p<T, NH>(dp, half);
#pragma unroll
                for (int kk = 0; kk < NH / 2; ++kk)
#pragma unroll
                    for (int w = 0; w < 4; ++w) dsk[hf * (NH / 2) + kk][w] = half[kk][w];
            }
            // dS^T to shared memory (rows = the warp's keys, columns = the tile's queries).
            store_ds(reinterpret_cast<unsigned char*>(ds_s), dsk);
            ops.keys_by_cols(dk_acc, dsk, q_t);  // dK += dS^T Q (scaled at the end)
        }
        // LEAN, STAGES = 2: the next tile's lse2 / delta, fetched after the opening barrier, into
        // the other buffer (last read before the previous iteration's dS^T barrier; read next
        // after the next opening barrier).
        if (LEAN && STAGES == 2 && it + 1 < n_iter && tid < BM) {
            lse_s[(1 - buf) * BM + tid] = l2_next;
            delta_s[(1 - buf) * BM + tid] = dl_next;
        }

        // Turn (DET): wait until the key blocks before this one have added into this dq tile.
        float* dqa = p.dq_accum +
                     bwd_offsets(p, LEAN ? cur_ix : bwd_index(p, p.kv_red, owner, red)).dqa;
        int* turn = reinterpret_cast<int*>(dqa + static_cast<long long>(i0) * p.dqa_sr + DPAD);
        // Turns of a query tile: its last key block (the diagonal one under the causal mask)
        // first, key block 0 last. With every block starting together, that is the order in
        // which they reach the tile (block n - 1 starts BN / BM query tiles earlier), so in the
        // steady state nobody waits.
        int tile_keys = keys_needed<CAUSAL>(i0, BM, sq, sk);
        if constexpr (!V::PLAIN) {  // the window: keys [j0, j1) the tile's rows see by position
            long long j0, j1;
            var.key_range(i0, min(i0 + BM, sq), j0, j1, p.sk);
            tile_keys = min(tile_keys, static_cast<int>(j1));
        }
        const int my_turn = (tile_keys - 1) / BN - nblock;
        if (DET && tid == 0) {
            while (bwd_turn_load(turn) != my_turn) __nanosleep(32);
        }
        __syncthreads();  // dS^T complete; Q/dO of this tile no longer read; (DET) our turn
        if (STAGES == 1 && it + 1 < n_iter) {
            if (LEAN) {
                int mt_n = cur_mt, red_n = cur_red;
                BwdIndex ix_n = cur_ix;
                advance(mt_n, red_n, ix_n);
                load_rows_at(ix_n, mt_n * BM, 0, false, l2_next, dl_next);
            } else {
                load_rows(it + 1);
            }
            cp_async_commit();
        }

        // dQ += dS K, DQ_CHUNK columns at a time, into the float32 accumulator.
        const int row_a = i0 + mq * 16 + g;  // this thread's rows: row_a, row_a + 8
        // F16S: key step kk (warp kk's keys) of the m16 tile mq takes 2^-(e + ek), e the
        // exponent of warp kk's half tile that holds query columns mq * 16 ...
        [[maybe_unused]] float fq[BN / 16];
        if constexpr (F16S) {
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk)
                fq[kk] = pow2f(-(dse_s[kk * 2 + (mq * 16) / (BM / 2)] + ek));
        }
#pragma unroll
        for (int c = 0; c < Cfg::DQ_COLS / Cfg::DQ_CHUNK; ++c) {
            const int col0 = cg * Cfg::DQ_COLS + c * Cfg::DQ_CHUNK;
            float acc[Cfg::DQ_CHUNK / 8][4];
            if constexpr (F16S)  // dS^T hi tile (16-bit columns), K's hi half (column col0)
                ops.dq_chunk(acc, smem_addr(ds_s) + mq * 16 * 2, DS_LO, smem_addr(k_s) + col0 * 2,
                             fq);
            else
                ops.dq_chunk(acc, smem_addr(ds_s + mq * 16), smem_addr(k_s + col0));
#pragma unroll
            for (int nt = 0; nt < Cfg::DQ_CHUNK / 8; ++nt)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int row = row_a + 8 * h;
                    if (row < sq) {
                        float* dst = dqa + static_cast<long long>(row) * p.dqa_sr + col0 +
                                     nt * 8 + 2 * t4;
                        bwd_red_add2(dst, acc[nt][2 * h], acc[nt][2 * h + 1]);
                    }
                }
        }
        if (LATE) {
            pending = turn;
            pending_turn = my_turn + 1;
        } else if (DET) {
            __threadfence();
            __syncthreads();  // every thread's additions are visible before the next turn
            if (tid == 0) bwd_turn_store(turn, my_turn + 1);
        }
        if (LEAN) advance(cur_mt, cur_red, cur_ix);
    }
    if (LATE) {
        __syncthreads();  // every warp's additions to the last tile are ordered before the release
        hand_on();
    }
    cp_async_wait<0>();  // nothing in flight when the block exits

    // dk = scale * dK, dv = dV; stride 0 on the reduced axes: the owner's rows.
    const BwdOffsets off = bwd_offsets(p, bwd_index(p, p.kv_red, owner, 0));
    T* dk = static_cast<T*>(p.dk) + off.dk;
    T* dvp = static_cast<T*>(p.dv) + off.dv;
    const float scale = static_cast<float>(p.scale);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int key = key_w + 8 * h;
        if (key >= sk) continue;
#pragma unroll
        for (int nt = 0; nt < Cfg::NT_D; ++nt) {
            const int col = nt * 8 + 2 * t4;
            if (col < d) {
                store2<T>(dk + static_cast<long long>(key) * p.dk_sr + col,
                          scale * dk_acc[nt][2 * h], scale * dk_acc[nt][2 * h + 1]);
                store2<T>(dvp + static_cast<long long>(key) * p.dv_sr + col, dv_acc[nt][2 * h],
                          dv_acc[nt][2 * h + 1]);
            }
        }
    }
}

// OP = fp16_t with T = float: the float32 form ("3xfp16"); the default OP = T is every 16-bit
// instantiation.
template <typename T, int DPAD, int BM, int BN, int NWARPS, int STAGES, int MINB, bool CAUSAL,
          bool DET, int OPT, typename OP = T>
__global__ void __launch_bounds__(32 * NWARPS, MINB)
cuflash_bwd_mma(const BwdParams p) {
    bwd_mma_body<T, DPAD, BM, BN, NWARPS, STAGES, MINB, CAUSAL, DET, OPT, PlainVariant, OP>(
        p, nullptr);
}

// The float32 form's "rows" pass: each row's softmax max m (of the scaled scores), sum l and
// delta = sum_j p_ij dp_ij / l, recomputed from q, k, v, do on the tensor cores (the split
// products of the main kernel: S = Q K^T and dP = dO V^T, 3xfp16), into lse_acc (m, then l
// nb0 nb1 nb2 Sq elements later) and delta, in the layout of the generic backward's rows pass
// (attn_bwd_generic.cu), which the float32 key-parallel kernel reads: P = exp(s scale - m) / l
// with the accurate exp, not the forward's float32 lse (notes/BACKWARD.md, "Math").
// A block owns BMS = 16 NWARPS query rows of one q owner (warp w: rows 16 w ..), loops over the
// batch entries it reduces (q_red) and for each over key tiles of BNS keys: Q, dO split once per
// entry, each K, V tile split when it lands (one buffer: load, split, compute, barrier). Rows
// past Sq and rows that see no key get m = -inf, l = 1, delta = 0 (the generic pass's values).
// Grid "rows": ceil(Sq / BMS) x the q owners (BwdParams.n_mblocks), the query block fastest.
// Shared memory: (2 BMS + 2 BNS) (DPAD + 4) floats and 4 NWARPS words (BwdStatsConfig).
template <int DPAD, int NWARPS, int BNS>
struct BwdStatsConfig {
    static constexpr int THREADS = 32 * NWARPS;
    static constexpr int BMS = 16 * NWARPS;
    static constexpr int SD = DPAD + 4;
    static constexpr int CHUNKS = DPAD / 4;
    static constexpr int Q_OFF = 0, DO_OFF = BMS * SD, K_OFF = 2 * BMS * SD;
    static constexpr int V_OFF = K_OFF + BNS * SD, FLOATS = V_OFF + BNS * SD;
    static constexpr int SMEM_BYTES = FLOATS * 4 + 4 * NWARPS * 4;
    static_assert(BNS % 16 == 0 && DPAD % 16 == 0, "k16 steps, pairs of n8 tiles");
};

template <int DPAD, int NWARPS, int BNS, int MINB, bool CAUSAL>
__global__ void __launch_bounds__(32 * NWARPS, MINB)
cuflash_bwd_stats_mma(const BwdParams p) {
    using Cfg = BwdStatsConfig<DPAD, NWARPS, BNS>;
    // The split products on rows of DPAD + 4 words (any BwdMmaConfig of this DPAD has that row).
    using Ops = BwdMmaSplitOps<DPAD, 16 * NWARPS, 16 * NWARPS, NWARPS, 1>;
    static_assert(Ops::RS == Cfg::SD * 4, "one split row layout");
    constexpr int NT = BNS / 8;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    float* smem = reinterpret_cast<float*>(smem_raw);
    float* q_s = smem + Cfg::Q_OFF;
    float* do_s = smem + Cfg::DO_OFF;
    float* k_s = smem + Cfg::K_OFF;
    float* v_s = smem + Cfg::V_OFF;
    unsigned int* red = reinterpret_cast<unsigned int*>(smem + Cfg::FLOATS);  // Q, dO, K, V

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, t4 = lane % 4;
    const unsigned int nm = static_cast<unsigned int>(p.n_mblocks);
    const unsigned int owner = blockIdx.x / nm;
    // Reverse order, as the generic pass: under the causal mask the longest rows start first.
    const int row0 = static_cast<int>(nm - 1 - blockIdx.x % nm) * Cfg::BMS;
    const int sq = static_cast<int>(p.sq), sk = static_cast<int>(p.sk);
    const int d = static_cast<int>(p.d);
    const int diag = sk - sq;
    const unsigned int n_red = bwd_reduce_count(p, p.q_red);
    const float scale = static_cast<float>(p.scale);
    int n_keys = sk;
    if (CAUSAL) {
        const long long last_row = min(row0 + Cfg::BMS, sq) - 1;
        n_keys = static_cast<int>(max(causal_keys_visible(last_row, p.sq, p.sk), 0ll));
    }
    const int n_tiles = (n_keys + BNS - 1) / BNS;
    const long long n_rows = p.nb0 * p.nb1 * p.nb2 * p.sq;
    const Ops ops(lane);
    const unsigned int q_w = smem_addr(q_s + warp * 16 * Cfg::SD);
    const unsigned int do_w = smem_addr(do_s + warp * 16 * Cfg::SD);
    const unsigned int k_t = smem_addr(k_s), v_t = smem_addr(v_s);

    for (unsigned int r = 0; r < n_red; ++r) {
        const BwdOffsets off = bwd_offsets(p, bwd_index(p, p.q_red, owner, r));
        __syncthreads();  // the previous entry's tiles are no longer read
        load_tile<Cfg::BMS, Cfg::CHUNKS, Cfg::SD, Cfg::THREADS>(
            q_s, static_cast<const float*>(p.q) + off.q, p.q_sr, row0, sq, d, tid);
        load_tile<Cfg::BMS, Cfg::CHUNKS, Cfg::SD, Cfg::THREADS>(
            do_s, static_cast<const float*>(p.dout) + off.dout, p.do_sr, row0, sq, d, tid);
        cp_async_commit();
        cp_async_wait<0>();
        int eq, edo;
        split16_block<Cfg::BMS, Cfg::CHUNKS, Cfg::SD, Cfg::THREADS>(q_s, red, tid, eq, false, 0);
        split16_block<Cfg::BMS, Cfg::CHUNKS, Cfg::SD, Cfg::THREADS>(do_s, red + NWARPS, tid, edo,
                                                                    false, 0);
        float m[2], l[2], ds[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            m[h] = neg_inf<float>();
            l[h] = 0.f;
            ds[h] = 0.f;
        }
        for (int t = 0; t < n_tiles; ++t) {
            const int key0 = t * BNS;
            __syncthreads();  // the previous K, V no longer read (first tile: Q, dO halves written)
            load_tile<BNS, Cfg::CHUNKS, Cfg::SD, Cfg::THREADS>(
                k_s, static_cast<const float*>(p.k) + off.k, p.k_sr, key0, sk, d, tid);
            load_tile<BNS, Cfg::CHUNKS, Cfg::SD, Cfg::THREADS>(
                v_s, static_cast<const float*>(p.v) + off.v, p.v_sr, key0, sk, d, tid);
            cp_async_commit();
            cp_async_wait<0>();
            int ek, ev;
            split16_block<BNS, Cfg::CHUNKS, Cfg::SD, Cfg::THREADS>(k_s, red + 2 * NWARPS, tid, ek,
                                                                   false, 0);
            split16_block<BNS, Cfg::CHUNKS, Cfg::SD, Cfg::THREADS>(v_s, red + 3 * NWARPS, tid, ev,
                                                                   false, 0);
            __syncthreads();  // every half of Q, dO, K, V written
            float s[NT][4], dp[NT][4];
            ops.template keys_by_rows<NT>(s, q_w, k_t);
            scale_pow2(reinterpret_cast<float(&)[NT * 4]>(s), -(eq + ek));
            ops.template keys_by_rows<NT>(dp, do_w, v_t);
            scale_pow2(reinterpret_cast<float(&)[NT * 4]>(dp), -(edo + ev));
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = row0 + warp * 16 + g + 8 * h;
                float mx = neg_inf<float>();
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int c = 0; c < 2; ++c) {
                        const int key = key0 + nt * 8 + 2 * t4 + c;
                        bool valid = key < sk && row < sq;
                        if (CAUSAL) valid = valid && key <= row + diag;
                        const float x = valid ? __fmul_rn(s[nt][2 * h + c], scale) : neg_inf<float>();
                        s[nt][2 * h + c] = x;
                        mx = fmaxf(mx, x);
                    }
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                const float m_new = fmaxf(m[h], mx);
                const float alpha = rescale_factor(m[h], m_new);
                float ls = 0.f, dsum = 0.f;
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int c = 0; c < 2; ++c) {
                        const float x = s[nt][2 * h + c];
                        // (a NaN score stays NaN, as in the generic pass)
                        const float pj = m_new == neg_inf<float>() ? (x != x ? x : 0.f)
                                                                   : acc_exp(x - m_new);
                        ls += pj;
                        dsum += x == neg_inf<float>() ? 0.f : pj * dp[nt][2 * h + c];
                    }
                l[h] = l[h] * alpha + ls;
                ds[h] = ds[h] * alpha + dsum;
                m[h] = m_new;
            }
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = row0 + warp * 16 + g + 8 * h;
            float total = l[h], dtot = ds[h];
            total += __shfl_xor_sync(0xffffffffu, total, 1);
            total += __shfl_xor_sync(0xffffffffu, total, 2);
            dtot += __shfl_xor_sync(0xffffffffu, dtot, 1);
            dtot += __shfl_xor_sync(0xffffffffu, dtot, 2);
            const bool empty = total == 0.f || row >= sq;  // NaN sums stay NaN
            if (t4 == 0 && row < sq) {
                float* stats = static_cast<float*>(p.lse_acc) + off.delta + row;
                stats[0] = empty ? neg_inf<float>() : m[h];
                stats[n_rows] = empty ? 1.f : total;
                static_cast<float*>(p.delta)[off.delta + row] = empty ? 0.f : dtot / total;
            }
        }
    }
}

// A variant's policy V (variants.cuh), VariantParams the second argument (attention variants,
// notes/VARIANTS.md); the plain kernel above is V = PlainVariant. The body takes VariantParams by
// pointer, null for the plain kernels: a VariantParams{} temporary there (unused) still changed
// ptxas's integer scheduling of 11 of the 144 plain specialisations (same registers and counts
// of every other kind; benchmarks/sass_counts.py --backward), the pointer leaves them as they
// were. __grid_constant__: the parameter's address is taken without a local copy.
template <typename T, int DPAD, int BM, int BN, int NWARPS, int STAGES, int MINB, bool CAUSAL,
          bool DET, int OPT, typename V>
__global__ void __launch_bounds__(32 * NWARPS, MINB)
cuflash_bwd_mma_var(const BwdParams p, const __grid_constant__ VariantParams vp) {
    bwd_mma_body<T, DPAD, BM, BN, NWARPS, STAGES, MINB, CAUSAL, DET, OPT, V>(p, &vp);
}

// Packed variable-length batches (common.cuh: bwd_varlen_segment): the body on the segment view
// of the block's sequence, over the grid of max_seqlen_k; key blocks past the sequence's keys
// leave (key blocks run in reverse, as in the body, so the turns of DET keep their order).
template <typename T, int DPAD, int BM, int BN, int NWARPS, int STAGES, int MINB, bool CAUSAL,
          bool DET, int OPT>
__global__ void __launch_bounds__(32 * NWARPS, MINB)
cuflash_bwd_mma_varlen(const BwdParams p_in) {
    const unsigned int nn = static_cast<unsigned int>(p_in.n_nblocks);
    const BwdParams& p = bwd_varlen_segment_shared<T, float>(p_in, blockIdx.x / nn, p_in.kv_red);
    if (static_cast<long long>(nn - 1 - blockIdx.x % nn) * BN >= p.sk) return;  // block-uniform
    bwd_mma_body<T, DPAD, BM, BN, NWARPS, STAGES, MINB, CAUSAL, DET, OPT, PlainVariant>(p, nullptr);
}

}  // namespace cuflash
