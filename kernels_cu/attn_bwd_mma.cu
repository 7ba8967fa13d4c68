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
#include "variants.cuh"

namespace cuflash {

template <int DPAD, int BM, int BN, int NWARPS, int STAGES>
struct BwdMmaConfig {
    static constexpr int THREADS = 32 * NWARPS;
    static constexpr int SD = DPAD + 8;            // row stride of K, V, Q, dO (elements)
    static constexpr int SDS = BM + 8;             // row stride of dS^T
    static constexpr int CHUNKS = DPAD / 8;        // 16-byte chunks per row
    static constexpr int NT_Q = BM / 8;            // n8 tiles of S^T per warp (query columns)
    static constexpr int NT_D = DPAD / 8;          // n8 tiles of dK, dV per warp
    static constexpr int MT_Q = BM / 16;           // m16 tiles of the dQ product
    static constexpr int DQ_GROUPS = NWARPS / MT_Q;  // column groups of the dQ product
    static constexpr int DQ_COLS = DPAD / DQ_GROUPS;
    static constexpr int DQ_CHUNK = DQ_COLS >= 32 ? 32 : DQ_COLS;
    // Shared-memory layout, in 16-bit elements from the start (float sections at the end).
    static constexpr int K_OFF = 0;
    static constexpr int V_OFF = BN * SD;
    static constexpr int Q_OFF = 2 * BN * SD;
    static constexpr int DO_OFF = Q_OFF + STAGES * BM * SD;
    static constexpr int DS_OFF = DO_OFF + STAGES * BM * SD;
    static constexpr int HALF_ELEMS = DS_OFF + BN * SDS;
    static constexpr int SMEM_BYTES = HALF_ELEMS * 2 + STAGES * 2 * BM * 4;
    static_assert(BN == 16 * NWARPS, "a warp owns 16 keys");
    static_assert(DPAD % 16 == 0 && BM % 16 == 0, "tile shapes are multiples of 16");
    static_assert(NWARPS % MT_Q == 0 && DPAD % DQ_GROUPS == 0, "the dQ split must be exact");
    static_assert(DQ_COLS % DQ_CHUNK == 0 && DQ_CHUNK % 16 == 0, "dQ chunks of 16 columns");
    static_assert(STAGES == 1 || STAGES == 2, "one or two Q/dO buffers");
    static_assert(BM % 32 == 0, "dP^T goes in two halves of whole k16 slices");
};

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
#pragma unroll
        for (int i = 0; i < NT; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][e] = 0.f;
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
#pragma unroll
        for (int i = 0; i < Cfg::DQ_CHUNK / 8; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][e] = 0.f;
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
// score_grad_tc, the forward's transform (attn_mma.cu: variant_scores_as; the same instructions,
// so the same logits and P that matches the forward's lse), and on partial tiles (PARTIAL: the key
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
            const float t = var.template score_grad_tc<true>(
                __fmul_rn(s[nt][e], scale), r, kc, static_cast<float>(row + diag - key), ds);
            float x = fast_exp2(fmaf(t, LOG2E, -lse_t[qc]));
            if constexpr (PARTIAL) {
                bool ok = key < sk;
                if (CAUSAL) ok = ok && key <= row + diag;
                if (V::MASKS) ok = ok && var.visible_tc(r, kc);
                x = ok ? x : 0.f;
            }
            s[nt][e] = x;
            if constexpr (V::DSCORE) dsc[nt][e] = ds;
        }
}

template <typename T, int DPAD, int BM, int BN, int NWARPS, int STAGES, int MINB, bool CAUSAL,
          bool DET, int OPT, typename V>
__device__ __forceinline__ void bwd_mma_body(const BwdParams& p, const VariantParams* vpp) {
    constexpr bool LEAN = (OPT & BWD_OPT_LEAN) != 0;
    constexpr bool LATE = DET && (OPT & BWD_OPT_LATE) != 0;
    static_assert((OPT & ~(BWD_OPT_LEAN | BWD_OPT_LATE)) == 0, "unknown OPT bits");
    static_assert(!LEAN || BM <= 32 * NWARPS, "LEAN: one thread per lse / delta row");
    using Cfg = BwdMmaConfig<DPAD, BM, BN, NWARPS, STAGES>;
    using Ops = BwdMmaOps<T, DPAD, BM, BN, NWARPS, STAGES>;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* smem = reinterpret_cast<T*>(smem_raw);
    T* k_s = smem + Cfg::K_OFF;
    T* v_s = smem + Cfg::V_OFF;
    T* ds_s = smem + Cfg::DS_OFF;
    float* lse_s = reinterpret_cast<float*>(smem + Cfg::HALF_ELEMS);  // STAGES x BM
    float* delta_s = lse_s + STAGES * BM;                              // STAGES x BM

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
    const auto fetch_ld = [&](const BwdOffsets& off, int i0, int r, float& l2, float& dl) {
        const int row = i0 + r;
        l2 = __int_as_float(0x7f800000);  // +inf: P = exp2(x - inf) = 0
        dl = 0.f;
        if (row < sq) {
            const float l = p.lse[off.lse + static_cast<long long>(row) * p.lse_sr];
            if (l != neg_inf<float>()) l2 = l * LOG2E;
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
            if (tid < BM) fetch_ld(off, i0, tid, l2_r, dl_r);
            return;
        }
        for (int r = tid; r < BM; r += Cfg::THREADS) {
            float l2, dl;
            fetch_ld(off, i0, r, l2, dl);
            lse_s[buf * BM + r] = l2;
            delta_s[buf * BM + r] = dl;
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
                const int lo = (CAUSAL && need_mask) ? key_w - i0 - diag : -BM;
                const bool real0 = key_w < sk, real1 = key_w + 8 < sk;
#pragma unroll
                for (int nt = 0; nt < Cfg::NT_Q; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int qc = nt * 8 + 2 * t4 + (e % 2);  // query column in the tile
                        const float x = fast_exp2(fmaf(s[nt][e], scale_log2, -lse_t[qc]));
                        const bool ok = (e / 2 ? real1 : real0) && qc >= lo + 8 * (e / 2);
                        s[nt][e] = ok ? x : 0.f;
                    }
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
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk)
#pragma unroll
            for (int w = 0; w < 4; ++w) {
                const int row = warp * 16 + g + 8 * (w % 2);
                const int col = (2 * kk + w / 2) * 8 + 2 * t4;
                *reinterpret_cast<unsigned int*>(ds_s + row * Cfg::SDS + col) = dsk[kk][w];
            }
        ops.keys_by_cols(dk_acc, dsk, q_t);  // dK += dS^T Q (scaled at the end)
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
#pragma unroll
        for (int c = 0; c < Cfg::DQ_COLS / Cfg::DQ_CHUNK; ++c) {
            const int col0 = cg * Cfg::DQ_COLS + c * Cfg::DQ_CHUNK;
            float acc[Cfg::DQ_CHUNK / 8][4];
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

template <typename T, int DPAD, int BM, int BN, int NWARPS, int STAGES, int MINB, bool CAUSAL,
          bool DET, int OPT>
__global__ void __launch_bounds__(32 * NWARPS, MINB)
cuflash_bwd_mma(const BwdParams p) {
    bwd_mma_body<T, DPAD, BM, BN, NWARPS, STAGES, MINB, CAUSAL, DET, OPT, PlainVariant>(p, nullptr);
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
