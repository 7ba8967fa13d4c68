// attn_generic.cu: the generic forward kernel, the audit path of cuflash.
//
// Version 1 (foundation). Scalar arithmetic in the accumulator type (float32 for fp16/bf16/fp32
// inputs, float64 for fp64) with the accurate exp and log, for every head dim 1..256 and every dtype.
// It is the reference implementation on the GPU: the tensor-core kernels are audited against the
// same float64 truth, and `kernel="generic"` forces this one.
//
// Algorithm (one query row; the state is m, l, O, kept in registers):
//   for each key tile of BC keys:
//     s_j   = scale * q . k_j                     (masked keys: -inf)
//     m'    = max(m, max_j s_j)
//     alpha = exp(m - m')                         (0 when m' = -inf: the row saw nothing yet)
//     p_j   = exp(s_j - m')
//     l     = alpha * l + sum_j p_j
//     O     = alpha * O + sum_j p_j v_j
//   o = O / l, lse = m + log l                    (a row that saw no key: o = 0, lse = -inf)
// The dot products accumulate in four interleaved partial sums (shorter rounding chains).
// Under the causal mask a key a row cannot see contributes nothing to that row, not even
// 0 * v (NaN or inf in a masked key's value never reaches the rows that cannot see it).
//
// Work split: a block of NWARPS warps owns BLOCK_M = NWARPS * ROWS query rows; each warp owns ROWS
// rows. Within a warp, for the score step lane j owns key j of the tile (BC = 32); for the output
// step lane t owns output columns t, t + 32, ... (DVB / 32 of them per row). K and V tiles are
// staged in shared memory, converted to the accumulator type, K padded by one element per row so
// that the 32 lanes reading 32 different keys hit 32 different banks.
//
// Cost per tile and warp: ROWS*BC*D FMAs for scores (lane-parallel over keys), ROWS*BC*Dv FMAs for
// P.V (lane-parallel over columns), and ROWS*BC shuffles to broadcast p_j. Memory: Q read once,
// K and V read once per query block, O and lse written once; O(S) extra memory.
//
// Variants (kernels_cu/variants.cuh): the body takes the policy V as a template parameter.
// cuflash_fwd_generic is the plain policy (the code it always had; one kernel argument);
// cuflash_fwd_generic_var<..., V> takes VariantParams as a second argument. The window narrows the
// key tiles a block visits (tiles no row of the block reaches are never loaded); the score
// transform runs on the scaled score in registers; masked keys join the causal bit mask, so their
// values never reach the row.
#include "common.cuh"
#include "variants.cuh"

namespace cuflash {

template <typename T, typename Acc, int DB, int DVB, bool CAUSAL>
struct GenericConfig {
    static constexpr int NWARPS = 4;
    static constexpr int ROWS = 4;                    // query rows per warp
    static constexpr int BLOCK_M = NWARPS * ROWS;     // query rows per block
    static constexpr int BC = 32;                     // keys per tile = lanes per warp
    static constexpr int THREADS = NWARPS * 32;
    static constexpr int QK_STRIDE = DB + 1;          // +1: conflict-free reads of k_j by lane j
    static constexpr int V_STRIDE = DVB;              // lanes read consecutive columns: no pad
    static constexpr int DVC = DVB / 32;              // output columns per lane and row
    // Unroll of the P.V loop over the tile's keys: full where the accumulators are few, partial
    // where a full unroll would push the register count into spills (checked by the tests).
    static constexpr int PV_UNROLL = DVC <= 2 ? 32 : (sizeof(Acc) == 8 ? 2 : 4);
    static constexpr int SMEM_ELEMS = BLOCK_M * QK_STRIDE + BC * QK_STRIDE + BC * V_STRIDE;
    static_assert(DB % 32 == 0 && DVB % 32 == 0, "head-dim buckets are multiples of 32");
};

template <typename T, typename Acc, int DB, int DVB, bool CAUSAL, typename V>
__device__ __forceinline__ void fwd_generic_body(const AttnParams& p, const VariantParams& vp) {
    using Cfg = GenericConfig<T, Acc, DB, DVB, CAUSAL>;
    constexpr bool MASKED = CAUSAL || V::MASKS;   // per-key visibility bits needed
    extern __shared__ __align__(16) unsigned char smem_raw[];
    Acc* q_s = reinterpret_cast<Acc*>(smem_raw);
    Acc* k_s = q_s + Cfg::BLOCK_M * Cfg::QK_STRIDE;
    Acc* v_s = k_s + Cfg::BC * Cfg::QK_STRIDE;

    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const int lane = tid % 32;
    const BlockCoord bc = block_coord(p);
    const BatchOffsets off = batch_offsets(p, bc.b);
    const T* q = static_cast<const T*>(p.q) + off.q;
    const T* k = static_cast<const T*>(p.k) + off.k;
    const T* v = static_cast<const T*>(p.v) + off.v;
    T* o = static_cast<T*>(p.o) + off.o;
    const long long row0 = bc.mblock * Cfg::BLOCK_M;
    const int d = static_cast<int>(p.d);
    const int dv = static_cast<int>(p.dv);
    // Inner loops run to D rounded up to 4 over zero-padded shared memory: fewer branches.
    const int d4 = (d + 3) & ~3;

    // Q tile: BLOCK_M rows, zero beyond Sq and beyond D.
    for (int idx = tid; idx < Cfg::BLOCK_M * Cfg::QK_STRIDE; idx += Cfg::THREADS) {
        const int r = idx / Cfg::QK_STRIDE, c = idx % Cfg::QK_STRIDE;
        const long long row = row0 + r;
        q_s[idx] = (row < p.sq && c < d) ? load_acc<Acc>(q + row * p.q_sr + c) : Acc(0);
    }

    // Keys this block needs: all of them, or under the causal mask up to its last row's limit.
    long long n_keys = p.sk;
    if (CAUSAL) {
        const long long last_row = min(row0 + Cfg::BLOCK_M, p.sq) - 1;
        n_keys = causal_keys_visible(last_row, p.sq, p.sk);
        if (n_keys < 0) n_keys = 0;
    }
    long long first_tile = 0;
    V var;
    if (!V::PLAIN) {
        // The batch entry's coordinates (as batch_offsets splits them) bind the policy.
        const unsigned int ub = static_cast<unsigned int>(bc.b);
        const unsigned int n2 = static_cast<unsigned int>(p.nb2);
        const unsigned int n1 = static_cast<unsigned int>(p.nb1);
        var.bind(vp, p.sq, p.sk, (ub / n2) / n1, (ub / n2) % n1, ub % n2);
        long long j0, j1;
        var.key_range(row0, min(row0 + Cfg::BLOCK_M, p.sq), j0, j1, p.sk);
        n_keys = min(n_keys, j1);
        first_tile = j0 / Cfg::BC;
    }
    const long long n_tiles = (n_keys + Cfg::BC - 1) / Cfg::BC;

    Acc m[Cfg::ROWS], l[Cfg::ROWS], acc[Cfg::ROWS][Cfg::DVC];
#pragma unroll
    for (int r = 0; r < Cfg::ROWS; ++r) {
        m[r] = neg_inf<Acc>();
        l[r] = Acc(0);  // lane-partial sum: lane j adds its own p_j; reduced once at the end
#pragma unroll
        for (int c = 0; c < Cfg::DVC; ++c) acc[r][c] = Acc(0);
    }
    const Acc scale = static_cast<Acc>(p.scale);

    for (long long t = first_tile; t < n_tiles; ++t) {
        const long long key0 = t * Cfg::BC;
        __syncthreads();  // the previous tile's K/V are no longer read (and Q is written)
        for (int idx = tid; idx < Cfg::BC * Cfg::QK_STRIDE; idx += Cfg::THREADS) {
            const int r = idx / Cfg::QK_STRIDE, c = idx % Cfg::QK_STRIDE;
            const long long key = key0 + r;
            k_s[idx] = (key < p.sk && c < d) ? load_acc<Acc>(k + key * p.k_sr + c) : Acc(0);
        }
        for (int idx = tid; idx < Cfg::BC * Cfg::V_STRIDE; idx += Cfg::THREADS) {
            const int r = idx / Cfg::V_STRIDE, c = idx % Cfg::V_STRIDE;
            const long long key = key0 + r;
            v_s[idx] = (key < p.sk && c < dv) ? load_acc<Acc>(v + key * p.v_sr + c) : Acc(0);
        }
        __syncthreads();

        // Scores: lane owns key key0 + lane, for each of the warp's ROWS rows.
        Acc part[Cfg::ROWS][4];
#pragma unroll
        for (int r = 0; r < Cfg::ROWS; ++r)
#pragma unroll
            for (int u = 0; u < 4; ++u) part[r][u] = Acc(0);
        const Acc* krow = k_s + lane * Cfg::QK_STRIDE;
        const Acc* qrow = q_s + (warp * Cfg::ROWS) * Cfg::QK_STRIDE;
        for (int c = 0; c < d4; c += 4) {
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const Acc kv = krow[c + u];
#pragma unroll
                for (int r = 0; r < Cfg::ROWS; ++r) part[r][u] += qrow[r * Cfg::QK_STRIDE + c + u] * kv;
            }
        }
        Acc s[Cfg::ROWS];
#pragma unroll
        for (int r = 0; r < Cfg::ROWS; ++r) s[r] = (part[r][0] + part[r][1]) + (part[r][2] + part[r][3]);
        const long long key = key0 + lane;
        // Under the causal mask, bit j of vis[r] says whether row r sees key key0 + j: a masked
        // key's value must not reach the row (its weight is 0, but 0 * NaN would be NaN).
        unsigned vis[Cfg::ROWS];
#pragma unroll
        for (int r = 0; r < Cfg::ROWS; ++r) {
            const long long row = row0 + warp * Cfg::ROWS + r;
            bool valid = key < p.sk;
            if (CAUSAL) valid = valid && key < causal_keys_visible(row, p.sq, p.sk);
            if (V::READS) valid = valid && row < p.sq;   // no tensor reads past the last row
            if (V::MASKS) valid = valid && var.visible(row, key);
            if (V::PLAIN) {
                s[r] = valid ? s[r] * scale : neg_inf<Acc>();
            } else {
                s[r] = valid ? var.score(s[r] * scale, row, key) : neg_inf<Acc>();
            }
            vis[r] = MASKED ? __ballot_sync(0xffffffffu, valid) : 0xffffffffu;
        }

        // Online-softmax update and P.V, one row at a time.
#pragma unroll
        for (int r = 0; r < Cfg::ROWS; ++r) {
            const Acc m_new = fmax(m[r], warp_max(s[r]));
            const Acc alpha = rescale_factor(m[r], m_new);
            // m' = -inf: nothing visible yet, p = 0 (a NaN score still propagates as NaN).
            const Acc pj = (m_new == neg_inf<Acc>()) ? (s[r] != s[r] ? s[r] : Acc(0))
                                                     : acc_exp(s[r] - m_new);
            l[r] = l[r] * alpha + pj;
            m[r] = m_new;
            // The tile's P.V is summed on its own, then added to the rescaled accumulator: two
            // chains of at most 32 and Sk / 32 additions instead of one of Sk (float32 error
            // grows with the chain; this keeps long-key rows within the naive error).
            Acc tile[Cfg::DVC];
#pragma unroll
            for (int c = 0; c < Cfg::DVC; ++c) tile[c] = Acc(0);
#pragma unroll Cfg::PV_UNROLL
            for (int j = 0; j < Cfg::BC; ++j) {
                const Acc pb = __shfl_sync(0xffffffffu, pj, j);
                const bool seen = !MASKED || ((vis[r] >> j) & 1u);
#pragma unroll
                for (int c = 0; c < Cfg::DVC; ++c) {
                    const Acc vj = v_s[j * Cfg::V_STRIDE + c * 32 + lane];
                    tile[c] += pb * (seen ? vj : Acc(0));
                }
            }
#pragma unroll
            for (int c = 0; c < Cfg::DVC; ++c) acc[r][c] = acc[r][c] * alpha + tile[c];
        }
    }

    // Epilogue: divide once, write O in the storage type and lse in float32 (natural log).
#pragma unroll
    for (int r = 0; r < Cfg::ROWS; ++r) {
        const long long row = row0 + warp * Cfg::ROWS + r;
        const Acc lsum = warp_sum(l[r]);
        if (row >= p.sq) continue;
        const bool empty = (lsum == Acc(0));   // the row saw no key; NaN inputs stay NaN
        const Acc inv = empty ? Acc(0) : Acc(1) / lsum;
#pragma unroll
        for (int c = 0; c < Cfg::DVC; ++c) {
            const int col = c * 32 + lane;
            if (col < dv) o[row * p.o_sr + col] = from_acc<T>(acc[r][c] * inv);
        }
        if (p.lse != nullptr && lane == 0) {
            const Acc lse = empty ? neg_inf<Acc>() : m[r] + acc_log(lsum);
            p.lse[bc.b * p.sq + row] = static_cast<float>(lse);
        }
    }
}

// cuflash_fwd_generic (plain, one argument) and cuflash_fwd_generic_var<..., V> (variants.cuh).
CUFLASH_POLICY_KERNELS(cuflash_fwd_generic, fwd_generic_body, AttnParams)

}  // namespace cuflash
