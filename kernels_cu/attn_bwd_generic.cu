// attn_bwd_generic.cu: the generic backward kernels, the audit path of cuflash's backward pass.
//
// Scalar arithmetic in the accumulator type (float32 for fp16/bf16/fp32 inputs, float64 for
// fp64) with the accurate exp, every head dim 1..256 and every dtype. P is recomputed tile by tile
// from q, k and the forward's lse (never an Sq x Sk matrix):
//   p_ij  = exp(scale * q_i . k_j - lse_i)            (0 where masked or the row saw no key)
//   dp_ij = do_i . v_j
//   ds_ij = p_ij (dp_ij - delta_i),  delta_i = do_i . o_i   (cuflash_bwd_preprocess)
//   dv_j  = sum_i p_ij do_i,  dk_j = scale sum_i ds_ij q_i,  dq_i = scale sum_j ds_ij k_j
// Two passes, neither with atomics, so every launch is bitwise reproducible and the results do
// not depend on how blocks are scheduled (`deterministic=True` costs nothing here):
//   cuflash_bwd_dq_generic   query-parallel: a block owns BLOCK query rows of one q owner (a batch
//                            entry over the axes q does not broadcast along), loops over the
//                            batch entries it sums (q_red) and over the key tiles it needs
//                            (causal: up to its last row's last visible key), writes dq once.
//   cuflash_bwd_dkdv_generic key-parallel: a block owns BLOCK keys of one k/v owner, loops over
//                            the batch entries it sums (kv_red, e.g. the query heads of an MQA
//                            key head) and over the query tiles that see its keys (causal: from
//                            the first row that sees its first key), writes dk and dv once.
// Each pass recomputes p and dp: twice the score work of a fused single pass, for an audit kernel
// that must be exact and reproducible rather than fast. When the plan gives an lse_acc workspace
// (float32 and float64 inputs), the dq pass first recomputes each row's max m, sum l and
// delta = sum_j p_j dp_j in the accumulator type (one more sweep of scores) and both passes form
// p = exp(s - m) / l, as a softmax does: exp(s - lse) with the forward's float32 lse carries an
// error of up to |lse| ulps relative in p (the absolute error of lse), above float32's own
// rounding when |lse| is large, and rowsum(do * o) carries o's rounding into every dS. The dk/dv
// pass reads m, l (lse_acc) and delta from the workspace. Otherwise m = lse, l = 1 and delta is
// the preprocess's rowsum(do * o).
//
// Work split, the same in both passes (the forward's, attn_generic.cu): a warp owns ROWS rows of
// the block's side (query rows in the dq pass, keys in the dk/dv pass); for the dot products lane
// l owns row l of the other side's tile of BC = 32 (keys, resp. query rows); for the
// accumulations lane t owns columns t, t + 32, ... and the tile's weights are broadcast by
// shuffles. Each tile's contribution is summed on its own and then added to the accumulator (two
// short rounding chains instead of one of length S). Shared-memory tiles are in the accumulator
// type, rows padded by one element so that 32 lanes reading 32 rows hit 32 banks.
//
// Variants (kernels_cu/variants.cuh): both bodies take the policy V as a template parameter; the
// plain kernels (one argument) are V = PlainVariant, the *_var kernels take VariantParams too.
// The score becomes V::score(scale * s) before exp, the window narrows the tiles each block
// visits, and under softcap the scaled score's gradient is ds * V::dscore(t). The dq pass writes
// ds (the final score's gradient) to vp.dscores when that is not null (dbias, reduced by the host).
#include "common.cuh"
#include "variants.cuh"

namespace cuflash {

template <typename T, typename Acc, int DB, int DVB, bool CAUSAL>
struct BwdGenericConfig {
    // float64 at head dims above 128: half the rows, so shared memory fits an A100's 163 KiB and
    // the accumulators fit the registers.
    static constexpr bool WIDE = sizeof(Acc) == 8 && (DB > 128 || DVB > 128);
    static constexpr int NWARPS = WIDE ? 2 : 4;
    static constexpr int ROWS = WIDE ? 2 : 4;        // rows of the block's side per warp
    static constexpr int BLOCK = NWARPS * ROWS;      // query rows (dq pass) / keys (dk/dv pass)
    static constexpr int BC = 32;                    // the other side's tile = lanes per warp
    static constexpr int THREADS = NWARPS * 32;
    static constexpr int QK_STRIDE = DB + 1;
    static constexpr int V_STRIDE = DVB + 1;
    static constexpr int DC = DB / 32;               // q/k columns per lane
    static constexpr int DVC = DVB / 32;             // v/do columns per lane
    static constexpr int UNROLL = (DC + DVC) <= 4 ? 32 : (sizeof(Acc) == 8 ? 2 : 4);
    // Block side tiles (BLOCK rows of q|k and do|v), other side tiles (BC rows), and the other
    // side's row statistics m, l and delta (dk/dv pass).
    static constexpr int SMEM_ELEMS = (BLOCK + BC) * (QK_STRIDE + V_STRIDE) + 3 * BC;
    static_assert(DB % 32 == 0 && DVB % 32 == 0, "head-dim buckets are multiples of 32");
};

// rows x cols (cols <= STRIDE - 1) of x, rows from `first` on, into s (zero beyond n_rows, cols).
template <typename T, typename Acc, int STRIDE, int THREADS>
__device__ __forceinline__ void bwd_load_tile(Acc* s, int rows, const T* x, long long first,
                                              long long n_rows, long long row_stride, int cols,
                                              int tid) {
    for (int idx = tid; idx < rows * STRIDE; idx += THREADS) {
        const int r = idx / STRIDE, c = idx % STRIDE;
        const long long row = first + r;
        s[idx] = (row < n_rows && c < cols) ? load_acc<Acc>(x + row * row_stride + c) : Acc(0);
    }
}

// a . b over n4 (a multiple of 4) elements, zero-padded to the head-dim bucket (a multiple of 32):
// CH interleaved FMA chains, combined as a pairwise tree of neighbours. float32 takes 16 chains:
// with 4, the scores at Sq = 1 carried more rounding than the rule's naive float32 counterpart
// (BLAS gemv) on about 1% of draws (notes/BACKWARD.md, "The float32 generic backward at Sq = 1";
// `python benchmarks/f32_bwd_score_emul.py 300`: 4 chains 2/300 over the rule, 16 chains 0/300,
// worst 0.86x). float64 keeps 4 (its error is far inside its rule).
template <typename Acc>
__device__ __forceinline__ Acc bwd_dot(const Acc* a, const Acc* b, int n4) {
    constexpr int CH = sizeof(Acc) == 4 ? 16 : 4;
    Acc part[CH];
#pragma unroll
    for (int u = 0; u < CH; ++u) part[u] = Acc(0);
    // Round up to CH: the tiles are zero beyond the head dim up to the bucket (bwd_load_tile),
    // and CH divides the bucket.
    const int n = (n4 + CH - 1) & ~(CH - 1);
    for (int c = 0; c < n; c += CH) {
#pragma unroll
        for (int u = 0; u < CH; ++u) part[u] += a[c + u] * b[c + u];
    }
#pragma unroll
    for (int w = 1; w < CH; w *= 2) {
#pragma unroll
        for (int u = 0; u < CH; u += 2 * w) part[u] += part[u + w];
    }
    return part[0];
}

template <typename T, typename Acc, int DB, int DVB, bool CAUSAL, typename V>
__device__ __forceinline__ void bwd_dq_generic_body(const BwdParams& p, const VariantParams& vp) {
    using Cfg = BwdGenericConfig<T, Acc, DB, DVB, CAUSAL>;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    Acc* q_s = reinterpret_cast<Acc*>(smem_raw);            // BLOCK x QK_STRIDE
    Acc* do_s = q_s + Cfg::BLOCK * Cfg::QK_STRIDE;          // BLOCK x V_STRIDE
    Acc* k_s = do_s + Cfg::BLOCK * Cfg::V_STRIDE;           // BC x QK_STRIDE
    Acc* v_s = k_s + Cfg::BC * Cfg::QK_STRIDE;              // BC x V_STRIDE

    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const int lane = tid % 32;
    const unsigned int nm = static_cast<unsigned int>(p.n_mblocks);
    const unsigned int owner = blockIdx.x / nm;
    // Reverse order, as the forward: under the causal mask the longest rows start first.
    const long long row0 = static_cast<long long>(nm - 1 - blockIdx.x % nm) * Cfg::BLOCK;
    const unsigned int n_red = bwd_reduce_count(p, p.q_red);
    const int d = static_cast<int>(p.d);
    const int dv = static_cast<int>(p.dv_dim);
    const int d4 = (d + 3) & ~3, dv4 = (dv + 3) & ~3;
    const Acc scale = static_cast<Acc>(p.scale);

    long long n_keys = p.sk;
    if (CAUSAL) {
        const long long last_row = min(row0 + Cfg::BLOCK, p.sq) - 1;
        n_keys = causal_keys_visible(last_row, p.sq, p.sk);
        if (n_keys < 0) n_keys = 0;
    }
    long long first_tile = 0;
    V var;
    if (!V::PLAIN) {   // the window's keys for this block's rows (the same for every entry)
        const BwdIndex ix0 = bwd_index(p, p.q_red, owner, 0);
        var.bind(vp, p.sq, p.sk, ix0.i0, ix0.i1, ix0.i2);
        long long j0, j1;
        var.key_range(row0, min(row0 + Cfg::BLOCK, p.sq), j0, j1, p.sk);
        n_keys = min(n_keys, j1);
        first_tile = j0 / Cfg::BC;
    }
    const long long n_tiles = (n_keys + Cfg::BC - 1) / Cfg::BC;

    Acc acc[Cfg::ROWS][Cfg::DC];
#pragma unroll
    for (int r = 0; r < Cfg::ROWS; ++r)
#pragma unroll
        for (int c = 0; c < Cfg::DC; ++c) acc[r][c] = Acc(0);

    BwdOffsets off = bwd_offsets(p, bwd_index(p, p.q_red, owner, 0));
    for (unsigned int red = 0; red < n_red; ++red) {
        const BwdIndex ix = bwd_index(p, p.q_red, owner, red);
        off = bwd_offsets(p, ix);
        if (!V::PLAIN) var.bind(vp, p.sq, p.sk, ix.i0, ix.i1, ix.i2);
        const T* q = static_cast<const T*>(p.q) + off.q;
        const T* k = static_cast<const T*>(p.k) + off.k;
        const T* v = static_cast<const T*>(p.v) + off.v;
        const T* dout = static_cast<const T*>(p.dout) + off.dout;
        __syncthreads();  // the previous batch entry's q/do tiles are no longer read
        bwd_load_tile<T, Acc, Cfg::QK_STRIDE, Cfg::THREADS>(q_s, Cfg::BLOCK, q, row0, p.sq, p.q_sr, d, tid);
        bwd_load_tile<T, Acc, Cfg::V_STRIDE, Cfg::THREADS>(do_s, Cfg::BLOCK, dout, row0, p.sq, p.do_sr, dv, tid);
        // This warp's rows: lse and delta (rows past Sq act as rows that saw no key).
        // m = lse and l = 1 unless recomputed below.
        Acc lse[Cfg::ROWS], lsum[Cfg::ROWS], delta[Cfg::ROWS];
#pragma unroll
        for (int r = 0; r < Cfg::ROWS; ++r) {
            const long long row = row0 + warp * Cfg::ROWS + r;
            const bool in = row < p.sq;
            lse[r] = in ? static_cast<Acc>(p.lse[off.lse + row * p.lse_sr]) : neg_inf<Acc>();
            lsum[r] = Acc(1);
            delta[r] = in ? static_cast<const Acc*>(p.delta)[off.delta + row] : Acc(0);
        }
        if (p.lse_acc != nullptr) {
            // Recompute m and l in the accumulator type (the forward's recurrence, without O)
            // and leave them for the key-parallel pass: m at off.delta + row, l nbatch * Sq
            // elements further. Rows past Sq (and rows that see no key) get m = -inf.
            // delta is recomputed as sum_j p_j dp_j (the online sum, with dp in place of v), so
            // that dS = P (dP - delta) cancels as the softmax's derivative does; rowsum(do * o)
            // would carry o's rounding into every dS.
            Acc m[Cfg::ROWS], l[Cfg::ROWS], dsum[Cfg::ROWS];
#pragma unroll
            for (int r = 0; r < Cfg::ROWS; ++r) {
                m[r] = neg_inf<Acc>();
                l[r] = Acc(0);
                dsum[r] = Acc(0);
            }
            for (long long t = first_tile; t < n_tiles; ++t) {
                const long long key0 = t * Cfg::BC;
                __syncthreads();  // the previous K/V tiles are no longer read (and q/do are written)
                bwd_load_tile<T, Acc, Cfg::QK_STRIDE, Cfg::THREADS>(k_s, Cfg::BC, k, key0, p.sk, p.k_sr, d, tid);
                bwd_load_tile<T, Acc, Cfg::V_STRIDE, Cfg::THREADS>(v_s, Cfg::BC, v, key0, p.sk, p.v_sr, dv, tid);
                __syncthreads();
                const long long key = key0 + lane;
#pragma unroll
                for (int r = 0; r < Cfg::ROWS; ++r) {
                    const int rr = warp * Cfg::ROWS + r;
                    const long long row = row0 + rr;
                    Acc s = bwd_dot(q_s + rr * Cfg::QK_STRIDE, k_s + lane * Cfg::QK_STRIDE, d4);
                    const Acc dp = bwd_dot(do_s + rr * Cfg::V_STRIDE, v_s + lane * Cfg::V_STRIDE, dv4);
                    bool valid = key < p.sk && row < p.sq;
                    if (CAUSAL) valid = valid && key < causal_keys_visible(row, p.sq, p.sk);
                    if (V::MASKS) valid = valid && var.visible(row, key);
                    if (V::PLAIN) {
                        s = valid ? s * scale : neg_inf<Acc>();
                    } else {
                        s = valid ? var.score(s * scale, row, key) : neg_inf<Acc>();
                    }
                    const Acc m_new = fmax(m[r], warp_max(s));
                    const Acc alpha = rescale_factor(m[r], m_new);
                    const Acc pj = (m_new == neg_inf<Acc>()) ? (s != s ? s : Acc(0)) : acc_exp(s - m_new);
                    l[r] = l[r] * alpha + pj;
                    dsum[r] = dsum[r] * alpha + (valid ? pj * dp : Acc(0));
                    m[r] = m_new;
                }
            }
            const long long n_rows = p.nb0 * p.nb1 * p.nb2 * p.sq;
#pragma unroll
            for (int r = 0; r < Cfg::ROWS; ++r) {
                const long long row = row0 + warp * Cfg::ROWS + r;
                const Acc total = warp_sum(l[r]);
                const Acc dtot = warp_sum(dsum[r]);
                const bool empty = total == Acc(0) || row >= p.sq;  // NaN sums stay NaN
                lse[r] = empty ? neg_inf<Acc>() : m[r];
                lsum[r] = empty ? Acc(1) : total;
                delta[r] = empty ? Acc(0) : dtot / total;
                if (lane == 0 && row < p.sq) {
                    Acc* stats = static_cast<Acc*>(p.lse_acc) + off.delta + row;
                    stats[0] = lse[r];
                    stats[n_rows] = lsum[r];
                    static_cast<Acc*>(p.delta)[off.delta + row] = delta[r];  // for the dk/dv pass
                }
            }
        }

        for (long long t = first_tile; t < n_tiles; ++t) {
            const long long key0 = t * Cfg::BC;
            __syncthreads();  // the previous tile's K/V are no longer read (and q/do are written)
            bwd_load_tile<T, Acc, Cfg::QK_STRIDE, Cfg::THREADS>(k_s, Cfg::BC, k, key0, p.sk, p.k_sr, d, tid);
            bwd_load_tile<T, Acc, Cfg::V_STRIDE, Cfg::THREADS>(v_s, Cfg::BC, v, key0, p.sk, p.v_sr, dv, tid);
            __syncthreads();

            const long long key = key0 + lane;  // lane owns this key for p and dp
#pragma unroll
            for (int r = 0; r < Cfg::ROWS; ++r) {
                const int rr = warp * Cfg::ROWS + r;
                const long long row = row0 + rr;
                const Acc s = bwd_dot(q_s + rr * Cfg::QK_STRIDE, k_s + lane * Cfg::QK_STRIDE, d4);
                const Acc dp = bwd_dot(do_s + rr * Cfg::V_STRIDE, v_s + lane * Cfg::V_STRIDE, dv4);
                bool valid = key < p.sk && lse[r] != neg_inf<Acc>();
                if (CAUSAL) valid = valid && key < causal_keys_visible(row, p.sq, p.sk);
                if (V::MASKS) valid = valid && var.visible(row, key);
                Acc pj, ds;
                if (V::PLAIN) {
                    pj = valid ? acc_exp(s * scale - lse[r]) / lsum[r] : Acc(0);
                    ds = valid ? pj * (dp - delta[r]) : Acc(0);
                } else {
                    const Acc st = s * scale;
                    pj = valid ? acc_exp(var.score(st, row, key) - lse[r]) / lsum[r] : Acc(0);
                    ds = valid ? pj * (dp - delta[r]) : Acc(0);
                    if (vp.dscores != nullptr && row < p.sq && key < p.sk)
                        static_cast<Acc*>(vp.dscores)[(off.delta + row) * p.sk + key] = ds;
                    if (valid) ds *= var.dscore(st, row, key);
                }
                Acc tile[Cfg::DC];
#pragma unroll
                for (int c = 0; c < Cfg::DC; ++c) tile[c] = Acc(0);
#pragma unroll Cfg::UNROLL
                for (int j = 0; j < Cfg::BC; ++j) {
                    const Acc db = __shfl_sync(0xffffffffu, ds, j);
#pragma unroll
                    for (int c = 0; c < Cfg::DC; ++c) tile[c] += db * k_s[j * Cfg::QK_STRIDE + c * 32 + lane];
                }
#pragma unroll
                for (int c = 0; c < Cfg::DC; ++c) acc[r][c] += tile[c];
            }
        }
    }

    // dq has stride 0 on the reduced axes: every step's offset is the owner's.
    T* dq = static_cast<T*>(p.dq) + off.dq;
#pragma unroll
    for (int r = 0; r < Cfg::ROWS; ++r) {
        const long long row = row0 + warp * Cfg::ROWS + r;
        if (row >= p.sq) continue;
#pragma unroll
        for (int c = 0; c < Cfg::DC; ++c) {
            const int col = c * 32 + lane;
            if (col < d) dq[row * p.dq_sr + col] = from_acc<T>(acc[r][c] * scale);
        }
    }
}

template <typename T, typename Acc, int DB, int DVB, bool CAUSAL, typename V>
__device__ __forceinline__ void bwd_dkdv_generic_body(const BwdParams& p, const VariantParams& vp) {
    using Cfg = BwdGenericConfig<T, Acc, DB, DVB, CAUSAL>;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    Acc* k_s = reinterpret_cast<Acc*>(smem_raw);            // BLOCK x QK_STRIDE
    Acc* v_s = k_s + Cfg::BLOCK * Cfg::QK_STRIDE;           // BLOCK x V_STRIDE
    Acc* q_s = v_s + Cfg::BLOCK * Cfg::V_STRIDE;            // BC x QK_STRIDE
    Acc* do_s = q_s + Cfg::BC * Cfg::QK_STRIDE;             // BC x V_STRIDE
    Acc* lse_s = do_s + Cfg::BC * Cfg::V_STRIDE;            // BC: m (lse when not recomputed)
    Acc* l_s = lse_s + Cfg::BC;                             // BC: l (1 when not recomputed)
    Acc* delta_s = l_s + Cfg::BC;                           // BC

    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const int lane = tid % 32;
    const unsigned int nn = static_cast<unsigned int>(p.n_nblocks);
    const unsigned int owner = blockIdx.x / nn;
    // Natural order: under the causal mask the first key blocks are seen by the most rows.
    const long long key0 = static_cast<long long>(blockIdx.x % nn) * Cfg::BLOCK;
    const unsigned int n_red = bwd_reduce_count(p, p.kv_red);
    const int d = static_cast<int>(p.d);
    const int dv = static_cast<int>(p.dv_dim);
    const int d4 = (d + 3) & ~3, dv4 = (dv + 3) & ~3;
    const Acc scale = static_cast<Acc>(p.scale);
    // Query rows that see any of this block's keys: all, or from the first row that sees key0.
    long long first_row = CAUSAL ? causal_first_row(key0, p.sq, p.sk) : 0;
    long long end_row = p.sq;
    V var;
    if (!V::PLAIN) {   // the rows the window lets see this block's keys
        const BwdIndex ix0 = bwd_index(p, p.kv_red, owner, 0);
        var.bind(vp, p.sq, p.sk, ix0.i0, ix0.i1, ix0.i2);
        long long r0, r1;
        var.row_range(key0, min(key0 + Cfg::BLOCK, p.sk), r0, r1, p.sq);
        first_row = max(first_row, r0);
        end_row = r1;
    }

    Acc dk_acc[Cfg::ROWS][Cfg::DC], dv_acc[Cfg::ROWS][Cfg::DVC];
#pragma unroll
    for (int r = 0; r < Cfg::ROWS; ++r) {
#pragma unroll
        for (int c = 0; c < Cfg::DC; ++c) dk_acc[r][c] = Acc(0);
#pragma unroll
        for (int c = 0; c < Cfg::DVC; ++c) dv_acc[r][c] = Acc(0);
    }

    BwdOffsets off = bwd_offsets(p, bwd_index(p, p.kv_red, owner, 0));
    for (unsigned int red = 0; red < n_red; ++red) {
        const BwdIndex ix = bwd_index(p, p.kv_red, owner, red);
        off = bwd_offsets(p, ix);
        if (!V::PLAIN) var.bind(vp, p.sq, p.sk, ix.i0, ix.i1, ix.i2);
        const T* q = static_cast<const T*>(p.q) + off.q;
        const T* k = static_cast<const T*>(p.k) + off.k;
        const T* v = static_cast<const T*>(p.v) + off.v;
        const T* dout = static_cast<const T*>(p.dout) + off.dout;
        const float* lse = p.lse + off.lse;
        const Acc* delta = static_cast<const Acc*>(p.delta) + off.delta;
        const Acc* lse_acc = p.lse_acc == nullptr ? nullptr
                                                  : static_cast<const Acc*>(p.lse_acc) + off.delta;
        const long long n_rows = p.nb0 * p.nb1 * p.nb2 * p.sq;  // l follows m in lse_acc
        __syncthreads();  // the previous batch entry's k/v tiles are no longer read
        // (k and v have stride 0 along the reduced axes: the same rows each step; reloading keeps
        // the loop simple and costs two tiles per batch entry.)
        bwd_load_tile<T, Acc, Cfg::QK_STRIDE, Cfg::THREADS>(k_s, Cfg::BLOCK, k, key0, p.sk, p.k_sr, d, tid);
        bwd_load_tile<T, Acc, Cfg::V_STRIDE, Cfg::THREADS>(v_s, Cfg::BLOCK, v, key0, p.sk, p.v_sr, dv, tid);

        for (long long i0 = first_row; i0 < end_row; i0 += Cfg::BC) {
            __syncthreads();  // the previous query tile is no longer read (and k/v are written)
            bwd_load_tile<T, Acc, Cfg::QK_STRIDE, Cfg::THREADS>(q_s, Cfg::BC, q, i0, p.sq, p.q_sr, d, tid);
            bwd_load_tile<T, Acc, Cfg::V_STRIDE, Cfg::THREADS>(do_s, Cfg::BC, dout, i0, p.sq, p.do_sr, dv, tid);
            for (int idx = tid; idx < Cfg::BC; idx += Cfg::THREADS) {
                const long long row = i0 + idx;
                const bool in = row < p.sq;
                lse_s[idx] = !in ? neg_inf<Acc>()
                                 : (lse_acc != nullptr ? lse_acc[row]
                                                       : static_cast<Acc>(lse[row * p.lse_sr]));
                l_s[idx] = (in && lse_acc != nullptr) ? lse_acc[n_rows + row] : Acc(1);
                delta_s[idx] = in ? delta[row] : Acc(0);
            }
            __syncthreads();

            const long long row = i0 + lane;  // lane owns this query row for p and dp
            const Acc lse_i = lse_s[lane], l_i = l_s[lane], delta_i = delta_s[lane];
#pragma unroll
            for (int r = 0; r < Cfg::ROWS; ++r) {
                const int kk = warp * Cfg::ROWS + r;
                const long long key = key0 + kk;
                const Acc s = bwd_dot(q_s + lane * Cfg::QK_STRIDE, k_s + kk * Cfg::QK_STRIDE, d4);
                const Acc dp = bwd_dot(do_s + lane * Cfg::V_STRIDE, v_s + kk * Cfg::V_STRIDE, dv4);
                bool valid = key < p.sk && row < p.sq && lse_i != neg_inf<Acc>();
                if (CAUSAL) valid = valid && key < causal_keys_visible(row, p.sq, p.sk);
                if (V::MASKS) valid = valid && var.visible(row, key);
                Acc pj, ds;
                if (V::PLAIN) {
                    pj = valid ? acc_exp(s * scale - lse_i) / l_i : Acc(0);
                    ds = valid ? pj * (dp - delta_i) : Acc(0);
                } else {
                    const Acc st = s * scale;
                    pj = valid ? acc_exp(var.score(st, row, key) - lse_i) / l_i : Acc(0);
                    ds = valid ? pj * (dp - delta_i) * var.dscore(st, row, key) : Acc(0);
                }
                Acc tk[Cfg::DC], tv[Cfg::DVC];
#pragma unroll
                for (int c = 0; c < Cfg::DC; ++c) tk[c] = Acc(0);
#pragma unroll
                for (int c = 0; c < Cfg::DVC; ++c) tv[c] = Acc(0);
#pragma unroll Cfg::UNROLL
                for (int i = 0; i < Cfg::BC; ++i) {
                    const Acc pb = __shfl_sync(0xffffffffu, pj, i);
                    const Acc db = __shfl_sync(0xffffffffu, ds, i);
#pragma unroll
                    for (int c = 0; c < Cfg::DVC; ++c) tv[c] += pb * do_s[i * Cfg::V_STRIDE + c * 32 + lane];
#pragma unroll
                    for (int c = 0; c < Cfg::DC; ++c) tk[c] += db * q_s[i * Cfg::QK_STRIDE + c * 32 + lane];
                }
#pragma unroll
                for (int c = 0; c < Cfg::DC; ++c) dk_acc[r][c] += tk[c];
#pragma unroll
                for (int c = 0; c < Cfg::DVC; ++c) dv_acc[r][c] += tv[c];
            }
        }
    }

    // dk and dv have stride 0 on the reduced axes: every step's offset is the owner's. Keys no
    // query row sees (causal, Sk > Sq) get zeros.
    T* dk = static_cast<T*>(p.dk) + off.dk;
    T* dvp = static_cast<T*>(p.dv) + off.dv;
#pragma unroll
    for (int r = 0; r < Cfg::ROWS; ++r) {
        const long long key = key0 + warp * Cfg::ROWS + r;
        if (key >= p.sk) continue;
#pragma unroll
        for (int c = 0; c < Cfg::DC; ++c) {
            const int col = c * 32 + lane;
            if (col < d) dk[key * p.dk_sr + col] = from_acc<T>(dk_acc[r][c] * scale);
        }
#pragma unroll
        for (int c = 0; c < Cfg::DVC; ++c) {
            const int col = c * 32 + lane;
            if (col < dv) dvp[key * p.dv_sr + col] = from_acc<T>(dv_acc[r][c]);
        }
    }
}

// The plain kernels (one argument, the code they always had) and the variant kernels.
CUFLASH_POLICY_KERNELS(cuflash_bwd_dq_generic, bwd_dq_generic_body, BwdParams)
CUFLASH_POLICY_KERNELS(cuflash_bwd_dkdv_generic, bwd_dkdv_generic_body, BwdParams)

// Packed variable-length batches (common.cuh: bwd_varlen_segment): the plain bodies on the
// segment view of the block's sequence, over the grids of max_seqlen_q/k; blocks whose rows
// (dq pass, reverse order as in the body) or keys (dk/dv pass) lie past the sequence leave.
template <typename T, typename Acc, int DB, int DVB, bool CAUSAL>
__global__ void __launch_bounds__(128, 1) cuflash_bwd_dq_generic_varlen(const BwdParams p_in) {
    using Cfg = BwdGenericConfig<T, Acc, DB, DVB, CAUSAL>;
    const unsigned int nm = static_cast<unsigned int>(p_in.n_mblocks);
    const BwdParams& p = bwd_varlen_segment_shared<T, Acc>(p_in, blockIdx.x / nm, p_in.q_red);
    if (static_cast<long long>(nm - 1 - blockIdx.x % nm) * Cfg::BLOCK >= p.sq) return;
    bwd_dq_generic_body<T, Acc, DB, DVB, CAUSAL, PlainVariant>(p, VariantParams{});
}
template <typename T, typename Acc, int DB, int DVB, bool CAUSAL>
__global__ void __launch_bounds__(128, 1) cuflash_bwd_dkdv_generic_varlen(const BwdParams p_in) {
    using Cfg = BwdGenericConfig<T, Acc, DB, DVB, CAUSAL>;
    const unsigned int nn = static_cast<unsigned int>(p_in.n_nblocks);
    const BwdParams& p = bwd_varlen_segment_shared<T, Acc>(p_in, blockIdx.x / nn, p_in.kv_red);
    if (static_cast<long long>(blockIdx.x % nn) * Cfg::BLOCK >= p.sk) return;
    bwd_dkdv_generic_body<T, Acc, DB, DVB, CAUSAL, PlainVariant>(p, VariantParams{});
}

}  // namespace cuflash
