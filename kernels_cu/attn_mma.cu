// attn_mma.cu: tensor-core forward kernel for float16 / bfloat16 (sm_80 and later).
//
// Version 2: lazy rescaling of l and O (only when the max grows by more than 2^8) and the scale
// folded into one FFMA per score; 4-warp blocks, several per SM. Version 1 (8 warps, 1 block per
// SM, rescale every tile) ran at 0.6-0.8x PyTorch's FLASH backend on an H200.
//
// mma.sync m16n8k16 with fp32 accumulators for both products, ldmatrix for every
// operand from padded (bank-conflict-free) shared memory, cp.async loads that overlap the loads
// of V_j with S = Q K_j^T and the loads of K_{j+1} with O += P V_j, exp2-based softmax with the
// scale folded into one multiply, P converted to 16 bits in registers and fed straight back as the
// A operand of the P.V product (the m16n8 accumulator layout of two adjacent key tiles is exactly
// the m16n8k16 A-operand layout).
//
// Work split: a block of NWARPS warps owns BM = 16 * MT * NWARPS query rows; warp w owns MT
// m-tiles of 16 rows and, for each K/V tile of BN keys, computes their 16 x BN scores, the online
// softmax update of their rows, and their 16 x D slices of O. Q stays in shared memory and is re-read
// with ldmatrix per tile (registers are the scarce resource: O takes D/2 and S takes BN/2 per
// thread). Every thread keeps the state of two rows (g and g + 8 of its warp's 16, g = lane / 4),
// each spread over the 4 threads of a quad, so row reductions are two shuffles.
//
// Per tile and warp: 2 * 16 * MT * BN * D FLOPs for each product; shared-memory reads of K and V
// (BN * D * 2 bytes each) feed 16 * MT rows, i.e. 16 * MT FLOP per byte read from shared memory.
// Causal: tiles past the block's last visible key are never loaded; the mask is applied only on
// tiles that cross the diagonal or the end of the keys.
//
// Requirements checked on the host (cuflash/_dispatch.py): D == Dv, D % 8 == 0, D <= DPAD, every
// row of q, k, v, o 16-byte aligned. Head dims below DPAD are zero-padded in shared memory.
#include "common.cuh"

namespace cuflash {

template <typename T, int DPAD, int BN, int NWARPS, int MT>
struct MmaConfig {
    static constexpr int BM = 16 * MT * NWARPS;   // query rows per block
    static constexpr int THREADS = 32 * NWARPS;
    static constexpr int STRIDE = DPAD + 8;        // +16 bytes per row: ldmatrix rows hit all banks
    static constexpr int CHUNKS = DPAD / 8;        // 16-byte chunks per row
    static constexpr int NT_S = BN / 8;            // n8 tiles of scores per m-tile
    static constexpr int NT_O = DPAD / 8;          // n8 tiles of output per m-tile
    static constexpr int SMEM_ELEMS = (BM + 2 * BN) * STRIDE;
    static_assert(DPAD % 16 == 0 && BN % 16 == 0, "tile shapes must be multiples of 16");
};

// Copy rows [row0, row0 + ROWS) of a (rows x d) matrix with row stride `ld` into shared memory
// (row stride STRIDE), zero-filling rows >= n_rows and columns >= d.
// Row indices are 32-bit (the host checks Sq, Sk < 2^31); offsets into memory are 64-bit.
// When the threads divide evenly into rows of chunks, each thread copies the same column chunk of
// rows r0, r0 + RSTEP, ...: one 64-bit offset and one 64-bit step per tile instead of a 64-bit
// address per chunk held across the main loop (that cost ~30 registers).
template <int ROWS, int CHUNKS, int STRIDE, int THREADS, typename T>
__device__ __forceinline__ void load_tile(T* smem, const T* g, long long ld, int row0, int n_rows,
                                          int d, int tid) {
    if constexpr (THREADS % CHUNKS == 0) {
        constexpr int RSTEP = THREADS / CHUNKS;
        const int r0 = tid / CHUNKS, c = tid % CHUNKS;
        const bool col_ok = c * 8 < d;
        const T* src = g + static_cast<long long>(row0 + r0) * ld + c * 8;
        const long long step = RSTEP * ld;
        const unsigned int dst = smem_addr(smem + r0 * STRIDE + c * 8);
#pragma unroll
        for (int n = 0; n < (ROWS + RSTEP - 1) / RSTEP; ++n) {
            if (ROWS % RSTEP == 0 || r0 + n * RSTEP < ROWS) {
                const bool ok = col_ok && row0 + r0 + n * RSTEP < n_rows;
                cp_async16(dst + n * RSTEP * STRIDE * 2, ok ? src : g, ok ? 16 : 0);
            }
            src += step;
        }
    } else {
        const T* base = g + static_cast<long long>(row0) * ld;
#pragma unroll
        for (int i = tid; i < ROWS * CHUNKS; i += THREADS) {
            const int r = i / CHUNKS, c = i % CHUNKS;
            const bool ok = row0 + r < n_rows && c * 8 < d;
            const T* src = ok ? base + r * ld + c * 8 : g;  // a valid address when zero-filling
            cp_async16(smem_addr(smem + r * STRIDE + c * 8), src, ok ? 16 : 0);
        }
    }
}

template <typename T, int DPAD, int BN, int NWARPS, int MT, int MINB, bool STAGE_O, bool CAUSAL>
__global__ void __launch_bounds__(32 * NWARPS, MINB)
cuflash_fwd_mma(const AttnParams p) {
    using Cfg = MmaConfig<T, DPAD, BN, NWARPS, MT>;
    constexpr int STRIDE = Cfg::STRIDE;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* q_s = reinterpret_cast<T*>(smem_raw);
    T* k_s = q_s + Cfg::BM * STRIDE;
    T* v_s = k_s + BN * STRIDE;

    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const int lane = tid % 32;
    const int g = lane / 4;   // row within an 8-row group
    const int t4 = lane % 4;  // column pair within an n8 tile
    const BlockCoord bc = block_coord(p);
    const BatchOffsets off = batch_offsets(p, bc.b);
    const T* q = static_cast<const T*>(p.q) + off.q;
    const T* k = static_cast<const T*>(p.k) + off.k;
    const T* v = static_cast<const T*>(p.v) + off.v;
    const int sq = static_cast<int>(p.sq), sk = static_cast<int>(p.sk);
    const int row0 = static_cast<int>(bc.mblock) * Cfg::BM;
    const int d = static_cast<int>(p.d);
    const int diag = sk - sq;  // row i sees keys j <= i + diag

    const int n_tiles = (keys_needed<CAUSAL>(row0, Cfg::BM, sq, sk) + BN - 1) / BN;
    const int masked_from = first_masked_tile<CAUSAL>(row0, BN, sq, sk);

    load_tile<Cfg::BM, Cfg::CHUNKS, STRIDE, Cfg::THREADS>(q_s, q, p.q_sr, row0, sq, d, tid);
    if (n_tiles > 0)
        load_tile<BN, Cfg::CHUNKS, STRIDE, Cfg::THREADS>(k_s, k, p.k_sr, 0, sk, d, tid);
    cp_async_commit();

    // Warp w owns m-tiles mt = 0..MT-1 at rows row0 + (w * MT + mt) * 16; a thread holds rows
    // g and g + 8 of each.
    float acc_o[MT][Cfg::NT_O][4];
    float m_run[MT][2], l_run[MT][2];  // reference max (raw score units), partial row sums
    // Row of m-tile mt, half h for this thread (recomputed where needed: registers are scarce).
    const int row_base = row0 + warp * MT * 16 + g;
    const auto row_of = [row_base](int mt, int h) { return row_base + mt * 16 + 8 * h; };
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int i = 0; i < Cfg::NT_O; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_o[mt][i][e] = 0.f;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            m_run[mt][h] = neg_inf<float>();
            l_run[mt][h] = 0.f;
        }
    }
    const float scale_log2 = static_cast<float>(p.scale_log2);

    // Per-lane ldmatrix row addresses. A operand (Q rows): matrices (rows 0-7 | 8-15) x
    // (k 0-7 | 8-15). B from K (non-transposed): (keys 0-7 | 8-15 -> two n-tiles) x (k 0-7 | 8-15).
    // B from V (transposed): (keys 0-7 | 8-15) x (d 0-7 | 8-15 -> two n-tiles).
    const int lr = lane % 8, lm = lane / 8;
    const unsigned int q_base =
        smem_addr(q_s + (warp * MT * 16 + lr + 8 * (lm % 2)) * STRIDE + 8 * (lm / 2));
    const unsigned int k_base = smem_addr(k_s + (lr + 8 * (lm / 2)) * STRIDE + 8 * (lm % 2));
    const unsigned int v_base = smem_addr(v_s + (lr + 8 * (lm % 2)) * STRIDE + 8 * (lm / 2));

    for (int j = 0; j < n_tiles; ++j) {
        const int key0 = j * BN;
        cp_async_wait<0>();
        __syncthreads();  // K_j (and Q) landed; every warp is done with V_{j-1}
        load_tile<BN, Cfg::CHUNKS, STRIDE, Cfg::THREADS>(v_s, v, p.v_sr, key0, sk, d, tid);
        cp_async_commit();

        // S = Q K_j^T: MT x (16 x BN) per warp; each K fragment feeds MT products.
        float s[MT][Cfg::NT_S][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int i = 0; i < Cfg::NT_S; ++i)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[mt][i][e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < DPAD / 16; ++kk) {
            unsigned int a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                ldmatrix_x4(q_base + (mt * 16 * STRIDE + kk * 16) * 2, a[mt][0], a[mt][1],
                            a[mt][2], a[mt][3]);
#pragma unroll
            for (int nn = 0; nn < BN / 16; ++nn) {
                unsigned int b0, b1, b2, b3;
                ldmatrix_x4(k_base + (nn * 16 * STRIDE + kk * 16) * 2, b0, b1, b2, b3);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    Mma<T>::run(s[mt][2 * nn], a[mt], b0, b1);
                    Mma<T>::run(s[mt][2 * nn + 1], a[mt], b2, b3);
                }
            }
        }

        // Mask (on tiles from masked_from on), then the online softmax of the thread's rows and
        // the lazy rescale of O (common.cuh: softmax_step). P then goes to 16 bits right away, in
        // the A-operand layout of the P.V product: it halves the registers P occupies while V_j
        // is awaited.
        const bool need_mask = j >= masked_from;
        unsigned int pk[MT][BN / 16][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            float alpha[2];
            softmax_step<Cfg::NT_S, CAUSAL>(s[mt], m_run[mt], l_run[mt], alpha, need_mask, key0,
                                            t4, sk, row_of(mt, 0), diag, scale_log2);
            rescale_rows<Cfg::NT_O>(acc_o[mt], alpha);
            pack_p<T, Cfg::NT_S>(s[mt], pk[mt]);
        }

        cp_async_wait<0>();
        __syncthreads();  // V_j landed; every warp is done with K_j
        if (j + 1 < n_tiles) {
            load_tile<BN, Cfg::CHUNKS, STRIDE, Cfg::THREADS>(k_s, k, p.k_sr, key0 + BN, sk, d, tid);
            cp_async_commit();
        }

        // O += P V_j: P (16 x BN per m-tile) from registers as A operands, V_j from shared
        // memory; each V fragment feeds MT products.
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
#pragma unroll
            for (int nn = 0; nn < DPAD / 16; ++nn) {
                unsigned int b0, b1, b2, b3;
                ldmatrix_x4_trans(v_base + (kk * 16 * STRIDE + nn * 16) * 2, b0, b1, b2, b3);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    Mma<T>::run(acc_o[mt][2 * nn], pk[mt][kk], b0, b1);
                    Mma<T>::run(acc_o[mt][2 * nn + 1], pk[mt][kk], b2, b3);
                }
            }
        }
    }
    cp_async_wait<0>();  // nothing in flight when the block exits

    // Epilogue: finish the row sums over the quad, divide once, write O and lse (natural log;
    // -inf for a row that saw no key). O's base is formed only now, so it holds no registers
    // through the main loop.
    //
    // STAGE_O: each warp parks its 16-bit O tile in its own Q rows of shared memory (only this
    // warp ever reads them), then writes whole rows with 16-byte coalesced stores instead of
    // 4-byte stores scattered over 8 rows. The barrier first makes sure no thread's Q copy is
    // still in flight (a block with no key tile never waited for Q).
    T* o = static_cast<T*>(p.o) + batch_offsets(p, bc.b).o;
    T* o_s = q_s + warp * MT * 16 * STRIDE;
    if constexpr (STAGE_O) __syncthreads();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float l = l_run[mt][h];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            const int row = row_of(mt, h);
            const bool empty = (l == 0.f);
            const float inv = empty ? 0.f : 1.f / l;
            if (p.lse != nullptr && t4 == 0 && row < sq) {
                p.lse[bc.b * p.sq + row] = row_lse(m_run[mt][h], l, scale_log2);
            }
            if (!STAGE_O && row >= sq) continue;
            T* dst = STAGE_O ? o_s + (mt * 16 + g + 8 * h) * STRIDE
                             : o + static_cast<long long>(row) * p.o_sr;
#pragma unroll
            for (int nt = 0; nt < Cfg::NT_O; ++nt) {
                const int col = nt * 8 + 2 * t4;
                if (STAGE_O || col < d) {
                    *reinterpret_cast<unsigned int*>(dst + col) =
                        pack2<T>(acc_o[mt][nt][2 * h] * inv, acc_o[mt][nt][2 * h + 1] * inv);
                }
            }
        }
    if constexpr (STAGE_O) {
        __syncwarp();
        const int wrow0 = row0 + warp * MT * 16;
#pragma unroll
        for (int i = lane; i < MT * 16 * Cfg::CHUNKS; i += 32) {
            const int r = i / Cfg::CHUNKS, c = i % Cfg::CHUNKS;
            if (wrow0 + r < sq && c * 8 < d) {
                *reinterpret_cast<uint4*>(o + static_cast<long long>(wrow0 + r) * p.o_sr + c * 8) =
                    *reinterpret_cast<const uint4*>(o_s + r * STRIDE + c * 8);
            }
        }
    }
}

}  // namespace cuflash
