// attn_bwd_prep.cu: the small kernels around every backward kernel family (notes/BACKWARD.md).
//
// cuflash_bwd_preprocess<T, Acc>: delta[b, i] = sum_c dout[b, i, c] * o[b, i, c] in the
//   accumulator type (float; double for float64), for every row of the full batch, into the
//   delta workspace; and, when the plan accumulates dq with atomics (p.dq_accum != null), zeroes
//   every dq_accum row (all dqa_sr columns: the padding holds turn counters, attn_bwd_mma.cu). One warp per row (lanes over the Dv columns, then a warp
//   sum), 8 rows per block; grid = ceil(Sq / 8) * nbatch, the row block varying fastest.
// cuflash_bwd_convert_dq<T>: dq = scale * dq_accum, rounded to T, for kernels that accumulate dq
//   in float32 with atomics. One warp per row, 8 rows per block; grid = ceil(Sq / 8) * (number of
//   q owners: the batch entries over the axes not in q_red).
#include "common.cuh"

namespace cuflash {

constexpr int BWD_PREP_ROWS = 8;  // rows (warps) per block; cuflash/_dispatch.py mirrors it

template <typename T, typename Acc>
__device__ __forceinline__ void bwd_preprocess_body(const BwdParams& p, unsigned int bid) {
    const unsigned int nblk = static_cast<unsigned int>((p.sq + BWD_PREP_ROWS - 1) / BWD_PREP_ROWS);
    const unsigned int b = bid / nblk;
    const long long row = static_cast<long long>(bid % nblk) * BWD_PREP_ROWS + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (row >= p.sq) return;  // whole warps leave: the warp sum below needs all 32 lanes
    const BwdIndex ix = bwd_index(p, 0, b, 0);  // red = 0: the owner index is the flat index
    const BwdOffsets off = bwd_offsets(p, ix);
    const T* o = static_cast<const T*>(p.o) + off.o + row * p.o_sr;
    const T* dout = static_cast<const T*>(p.dout) + off.dout + row * p.do_sr;
    Acc s = Acc(0);
    for (long long c = lane; c < p.dv_dim; c += 32) s += load_acc<Acc>(o + c) * load_acc<Acc>(dout + c);
    s = warp_sum(s);
    if (lane == 0) static_cast<Acc*>(p.delta)[off.delta + row] = s;
    if (p.dq_accum != nullptr) {
        // Rows of a broadcast q alias one accumulator row; the entry with coordinate 0 on every
        // reduced axis zeroes it (the others would write the same zeros).
        bool first = true;
        if ((p.q_red & 1) && ix.i0 != 0) first = false;
        if ((p.q_red & 2) && ix.i1 != 0) first = false;
        if ((p.q_red & 4) && ix.i2 != 0) first = false;
        if (first) {
            // The whole row: columns past D may hold the tensor-core backward's turn counters
            // (attn_bwd_mma.cu, deterministic mode), which must start at 0.
            float* acc = p.dq_accum + off.dqa + row * p.dqa_sr;
            for (long long c = lane; c < p.dqa_sr; c += 32) acc[c] = 0.0f;
        }
    }
}

template <typename T>
__device__ __forceinline__ void bwd_convert_dq_body(const BwdParams& p, unsigned int bid) {
    const unsigned int nblk = static_cast<unsigned int>((p.sq + BWD_PREP_ROWS - 1) / BWD_PREP_ROWS);
    const unsigned int owner = bid / nblk;
    const long long row = static_cast<long long>(bid % nblk) * BWD_PREP_ROWS + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (row >= p.sq) return;
    const BwdIndex ix = bwd_index(p, p.q_red, owner, 0);
    const BwdOffsets off = bwd_offsets(p, ix);
    const float* acc = p.dq_accum + off.dqa + row * p.dqa_sr;
    T* dq = static_cast<T*>(p.dq) + off.dq + row * p.dq_sr;
    const float scale = static_cast<float>(p.scale);
    for (long long c = lane; c < p.d; c += 32) dq[c] = from_acc<T>(scale * acc[c]);
}

template <typename T, typename Acc>
__global__ void __launch_bounds__(256) cuflash_bwd_preprocess(const BwdParams p) {
    bwd_preprocess_body<T, Acc>(p, blockIdx.x);
}

template <typename T>
__global__ void __launch_bounds__(256) cuflash_bwd_convert_dq(const BwdParams p) {
    bwd_convert_dq_body<T>(p, blockIdx.x);
}

// Packed variable-length batches (common.cuh: bwd_varlen_segment): the grid is
// ceil(max_seqlen_q / 8) row blocks x B x H; a block past its sequence's rows leaves, the others
// run the body on the segment view with their block renumbered for the sequence's row blocks.
template <typename T, typename Acc>
__device__ __forceinline__ bool bwd_prep_varlen_view(BwdParams& p, unsigned int& bid) {
    const unsigned int nblk = static_cast<unsigned int>((p.sq + BWD_PREP_ROWS - 1) / BWD_PREP_ROWS);
    const unsigned int owner = blockIdx.x / nblk, blk = blockIdx.x % nblk;
    bwd_varlen_segment<T, Acc>(p, owner, 0);
    const unsigned int nblk_s =
        static_cast<unsigned int>((p.sq + BWD_PREP_ROWS - 1) / BWD_PREP_ROWS);
    bid = owner * nblk_s + blk;
    return blk < nblk_s;
}

template <typename T, typename Acc>
__global__ void __launch_bounds__(256) cuflash_bwd_preprocess_varlen(const BwdParams p_in) {
    BwdParams p = p_in;
    unsigned int bid;
    if (bwd_prep_varlen_view<T, Acc>(p, bid)) bwd_preprocess_body<T, Acc>(p, bid);
}

template <typename T>
__global__ void __launch_bounds__(256) cuflash_bwd_convert_dq_varlen(const BwdParams p_in) {
    BwdParams p = p_in;
    unsigned int bid;
    if (bwd_prep_varlen_view<T, float>(p, bid)) bwd_convert_dq_body<T>(p, bid);
}

}  // namespace cuflash
