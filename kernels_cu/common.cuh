// common.cuh: device helpers shared by every cuflash kernel family.
//
// No CUDA headers are included on purpose: NVRTC finds none by default, and the few things we need
// (16-bit float storage types, conversions, exp2) are one PTX instruction each. That keeps the first
// compile fast and independent of where (or whether) a CUDA toolkit is installed.
#pragma once

namespace cuflash {

// ---------------------------------------------------------------------------------------------
// Select<B, X, Y>::type is X when B, else Y (std::conditional; NVRTC has no standard headers).
template <bool B, typename X, typename Y> struct Select { using type = X; };
template <typename X, typename Y> struct Select<false, X, Y> { using type = Y; };

// ---------------------------------------------------------------------------------------------
// Storage types. Plain 16-bit containers: arithmetic always happens after conversion to float.
struct alignas(2) fp16_t { unsigned short bits; };
struct alignas(2) bf16_t { unsigned short bits; };

__device__ __forceinline__ float to_float(fp16_t x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
}
__device__ __forceinline__ float to_float(bf16_t x) {
    return __uint_as_float(static_cast<unsigned int>(x.bits) << 16);
}
__device__ __forceinline__ float to_float(float x) { return x; }

// Convert an accumulator value to the storage type, rounding to nearest even.
template <typename T> __device__ __forceinline__ T from_acc(float x);
template <> __device__ __forceinline__ fp16_t from_acc<fp16_t>(float x) {
    fp16_t r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));
    return r;
}
template <> __device__ __forceinline__ bf16_t from_acc<bf16_t>(float x) {
    bf16_t r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));
    return r;
}
template <> __device__ __forceinline__ float from_acc<float>(float x) { return x; }
template <typename T> __device__ __forceinline__ T from_acc(double x);
template <> __device__ __forceinline__ double from_acc<double>(double x) { return x; }

// Load one element of storage type T as the accumulator type.
template <typename Acc, typename T> __device__ __forceinline__ Acc load_acc(const T* p) {
    return static_cast<Acc>(to_float(*p));
}
template <> __device__ __forceinline__ double load_acc<double, double>(const double* p) { return *p; }

// Pack two floats into one 32-bit register of two 16-bit values (low half = a), as mma.sync wants.
template <typename T> __device__ __forceinline__ unsigned int pack2(float a, float b);
template <> __device__ __forceinline__ unsigned int pack2<fp16_t>(float a, float b) {
    unsigned int r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(b), "f"(a));
    return r;
}
template <> __device__ __forceinline__ unsigned int pack2<bf16_t>(float a, float b) {
    unsigned int r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(b), "f"(a));
    return r;
}

// Store two accumulator values as two consecutive elements of the storage type (one 4-byte store
// for 16-bit types, one 8-byte store for float32).
template <typename T> __device__ __forceinline__ void store2(T* dst, float a, float b) {
    *reinterpret_cast<unsigned int*>(dst) = pack2<T>(a, b);
}
template <> __device__ __forceinline__ void store2<float>(float* dst, float a, float b) {
    *reinterpret_cast<float2*>(dst) = make_float2(a, b);
}

// True when a 32-bit word of storage-type values holds a NaN or an infinity (exponent all ones).
template <typename T> __device__ __forceinline__ bool nonfinite_word(unsigned int w);
template <> __device__ __forceinline__ bool nonfinite_word<float>(unsigned int w) {
    return (w & 0x7f800000u) == 0x7f800000u;
}
template <> __device__ __forceinline__ bool nonfinite_word<fp16_t>(unsigned int w) {
    return (w & 0x7c00u) == 0x7c00u || (w & 0x7c000000u) == 0x7c000000u;
}
template <> __device__ __forceinline__ bool nonfinite_word<bf16_t>(unsigned int w) {
    return (w & 0x7f80u) == 0x7f80u || (w & 0x7f800000u) == 0x7f800000u;
}
template <typename T> __device__ __forceinline__ bool nonfinite16(const uint4& x) {
    return nonfinite_word<T>(x.x) || nonfinite_word<T>(x.y) || nonfinite_word<T>(x.z) ||
           nonfinite_word<T>(x.w);
}
// One element of a packed pair of 16-bit values (hi = false: the low half, the first element).
template <typename T> __device__ __forceinline__ float unpack_half(unsigned int w, bool hi) {
    T x;
    x.bits = static_cast<unsigned short>(hi ? (w >> 16) : (w & 0xffffu));
    return to_float(x);
}

// ---------------------------------------------------------------------------------------------
// Math. The generic (audit) kernel uses the accurate library exp and log on natural-log scores, so
// that the exponent s - m is formed before any irrational factor and is exact when s is near m; the
// tensor-core kernel uses the hardware ex2.approx (2 ulp) on scores pre-multiplied by
// scale * log2(e), far below the fp16/bf16 rounding of P that follows it.
__device__ __forceinline__ float acc_exp(float x) { return expf(x); }
__device__ __forceinline__ double acc_exp(double x) { return exp(x); }
// lse = m + log(l) with l in [1, Sk]: the intrinsic's error there (2^-21.4 absolute on [0.5, 2],
// 2 ulp elsewhere) is below the float32 rounding of lse, and unlike logf it has no slow-path call
// (whose saved registers would show up as a stack frame).
__device__ __forceinline__ float acc_log(float x) { return __logf(x); }
__device__ __forceinline__ double acc_log(double x) { return log(x); }

__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

template <typename Acc> __device__ __forceinline__ Acc neg_inf();
template <> __device__ __forceinline__ float neg_inf<float>() { return __int_as_float(0xff800000); }
template <> __device__ __forceinline__ double neg_inf<double>() {
    return __longlong_as_double(0xfff0000000000000ULL);
}

// alpha = exp(m_old - m_new) with the guard of the recurrence: a row that has seen only masked
// keys keeps m = -inf, and exp(-inf - (-inf)) would be NaN. Such a row has l = 0 and O = 0, so any
// finite alpha is right; we use 0.
template <typename Acc> __device__ __forceinline__ Acc rescale_factor(Acc m_old, Acc m_new) {
    return (m_new == neg_inf<Acc>()) ? Acc(0) : acc_exp(m_old - m_new);
}

// ---------------------------------------------------------------------------------------------
// Warp reductions over all 32 lanes.
template <typename Acc> __device__ __forceinline__ Acc warp_max(Acc x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x = fmax(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}
template <typename Acc> __device__ __forceinline__ Acc warp_sum(Acc x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

// 4 x 4 transpose of 32-bit words across the four lanes of a quad (t4 = lane % 4): lane t4 holds
// w[j] = a[t4][j] on entry and w[r] = a[r][t4] on exit. In an m16n8 accumulator fragment lane t4
// holds columns 2 * t4, 2 * t4 + 1 of each n8 tile, so after packing four tiles to 16 bits and
// transposing, a lane holds 8 consecutive columns of one tile: one 16-byte store instead of four
// 4-byte ones. Two exchange rounds (lanes t4 ^ 2, then t4 ^ 1) of two shuffles each; every lane
// of the warp must take part.
__device__ __forceinline__ void quad_transpose(unsigned int (&w)[4], int t4) {
    const bool hi = (t4 & 2) != 0, odd = (t4 & 1) != 0;
#pragma unroll
    for (int k = 0; k < 2; ++k) {  // with lane t4 ^ 2: words k (upper lanes) / k + 2 (lower)
        const unsigned int got = __shfl_xor_sync(0xffffffffu, hi ? w[k] : w[k + 2], 2);
        if (hi) w[k] = got; else w[k + 2] = got;
    }
#pragma unroll
    for (int k = 0; k < 4; k += 2) {  // with lane t4 ^ 1: words k (odd lanes) / k + 1 (even)
        const unsigned int got = __shfl_xor_sync(0xffffffffu, odd ? w[k] : w[k + 1], 1);
        if (odd) w[k] = got; else w[k + 1] = got;
    }
}

// ---------------------------------------------------------------------------------------------
// Launch parameters. Every field is 8 bytes wide so that the host can mirror the layout with a
// NumPy structured dtype without padding rules (cuflash/_launch.py: PARAMS_DTYPE).
// Batch axes are collapsed on the host to at most three (nb0, nb1, nb2); each tensor has an element
// stride per batch axis (0 where it broadcasts) and one per row. The last axis is contiguous.
struct AttnParams {
    const void* q;
    const void* k;
    const void* v;
    void* o;
    float* lse;            // (B, Sq) contiguous, or null when the caller does not want it
    long long sq, sk, d, dv;
    long long nb0, nb1, nb2;
    long long q_s0, q_s1, q_s2, q_sr;
    long long k_s0, k_s1, k_s2, k_sr;
    long long v_s0, v_s1, v_s2, v_sr;
    long long o_s0, o_s1, o_s2, o_sr;
    long long n_mblocks;   // ceil(Sq / BLOCK_M) for the kernel that is launched
    double scale_log2;     // softmax scale * log2(e): scores go straight to exp2 (fast kernels)
    double scale;          // the softmax scale itself (the generic kernel uses natural exp)
};
static_assert(sizeof(AttnParams) == 31 * 8, "AttnParams must match cuflash/_launch.py");

// Split a flat batch index into the three collapsed batch axes and return each tensor's offset.
struct BatchOffsets { long long q, k, v, o; };
// The batch count is below 2^31 (the host checks the grid size), so 32-bit division suffices; a
// 64-bit division is a subroutine call whose saved registers show up as spills.
__device__ __forceinline__ BatchOffsets batch_offsets(const AttnParams& p, long long b) {
    const unsigned int ub = static_cast<unsigned int>(b);
    const unsigned int n2 = static_cast<unsigned int>(p.nb2), n1 = static_cast<unsigned int>(p.nb1);
    const long long i2 = ub % n2;
    const unsigned int t = ub / n2;
    const long long i1 = t % n1;
    const long long i0 = t / n1;
    BatchOffsets r;
    r.q = i0 * p.q_s0 + i1 * p.q_s1 + i2 * p.q_s2;
    r.k = i0 * p.k_s0 + i1 * p.k_s1 + i2 * p.k_s2;
    r.v = i0 * p.v_s0 + i1 * p.v_s1 + i2 * p.v_s2;
    r.o = i0 * p.o_s0 + i1 * p.o_s1 + i2 * p.o_s2;
    return r;
}

// Block scheduling shared by the forward kernels: blockIdx.x enumerates (batch, query block) with
// the query block varying fastest, so that the blocks resident at one time share a head's K and V
// in L2 (with the batch fastest, an H200 profile showed a 76% L2 hit rate and 4x the DRAM
// traffic). Query blocks go in reverse order, so under a causal mask each head's blocks with the
// longest key ranges (the last query rows) start first.
struct BlockCoord { long long b; long long mblock; };
__device__ __forceinline__ BlockCoord block_coord(const AttnParams& p, unsigned int flat) {
    const unsigned int nm = static_cast<unsigned int>(p.n_mblocks);
    BlockCoord c;
    c.b = flat / nm;
    c.mblock = static_cast<long long>(nm - 1 - flat % nm);
    return c;
}
__device__ __forceinline__ BlockCoord block_coord(const AttnParams& p) {
    return block_coord(p, blockIdx.x);
}
// The same, from a fresh read of the block index that the compiler cannot merge with the first:
// for epilogues, so that the 64-bit batch index is recomputed after the main loop instead of
// being held (or spilled) across it.
__device__ __forceinline__ BlockCoord block_coord_again(const AttnParams& p) {
    unsigned int flat;
    asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(flat));
    return block_coord(p, flat);
}

// Packed variable-length batches on the dense forward kernels (attention_varlen: the *_varlen
// twins of cuflash_fwd_mma and cuflash_fwd_wgmma). The host launches the plain grid over a batch
// (nb0, nb1, nb2) = (B sequences, Hkv, H / Hkv) with sq, sk = max_seqlen_q/k, n_mblocks =
// ceil(max_seqlen_q / BM), batch stride 0 on axis 0 for every tensor and q, k, v, o, lse at the
// packed tensors' row 0. fwd_varlen_segment turns the parameter block into the *segment view* of
// the block's sequence s (batch index b = s * H + h, h the query head): sq, sk its lengths, q and
// o moved to row cu_q[s], k and v to row cu_k[s], and lse (H, total_q), rows contiguous, head
// stride lse_hs, moved so that the bodies' lse[b * sq + row] lands on lse[h * lse_hs + cu_q[s] +
// row]. The body then runs unchanged: its loads zero-fill rows past sq and keys past sk, its
// stores skip rows past sq, its causal mask is the sequence's bottom-right one. A query block
// past the sequence's rows leaves at once (false).
struct VarlenParams {
    const int* cu_q;   // (B + 1,) int32 row offsets of the sequences into q, o and lse's rows
    const int* cu_k;   // (B + 1,) into k and v
    long long lse_hs;  // lse's head stride in elements
    long long slots;   // the Hopper twin's work slots per head (varlen_slot); 0 for mma.sync
    long long group;   // the Hopper twin's slots a block walks (persistent within a sequence); 1
};
static_assert(sizeof(VarlenParams) == 5 * 8, "VarlenParams must match cuflash/_launch.py");

// The Hopper twin's compact grid (cuflash_fwd_wgmma_varlen): per head, `slots` =
// floor(total_q / U) + B work slots of U query rows each (U = BM, or 2 BM where a slot is a pair
// of query blocks), sequence s owning the slots from start(s) = floor(cu_q[s] / U) + s on, of
// which the first ceil(Sq_s / U) are live (ceil((b - a) / U) <= floor(b / U) - floor(a / U) + 1,
// so sequences' slots never overlap), so at most B slots per head are dead, however the lengths
// are spread (a grid sized from max_seqlen_q left half of it dead for lengths uniform in
// 1..max). Warp 0 finds the owner of slot u: start(s) increases with s, so the owner is the
// number of sequences with start(s) <= u, minus one, counted 32 at a time (one load per lane).
// Returns the owner s and the slot's rank r within it (r may be past its live slots).
__device__ __forceinline__ unsigned int varlen_slot(const int* cu_q, unsigned int nseq,
                                                    unsigned int u, unsigned int rows,
                                                    unsigned int& r) {
    const unsigned int lane = threadIdx.x & 31u;
    unsigned int count = 0;
    for (unsigned int base = 0; base < nseq; base += 32) {
        const unsigned int s = base + lane;
        const bool in = s < nseq && static_cast<unsigned int>(cu_q[s]) / rows + s <= u;
        const unsigned int bits = __ballot_sync(0xffffffffu, in);
        count += __popc(bits);
        if (bits != 0xffffffffu) break;
    }
    const unsigned int s = count - 1;  // count >= 1: start(0) = 0 <= u
    r = u - (static_cast<unsigned int>(cu_q[s]) / rows + s);
    return s;
}

// The segment view's moves for batch entry b (sequence b / H, head b % H): lengths, pointers, lse.
// Returns the sequence's first query row and first key (cu_q[s], cu_k[s]).
template <typename T>
__device__ __forceinline__ void fwd_varlen_move(AttnParams& p, const VarlenParams& vl,
                                                unsigned int ub, long long& q0, long long& k0) {
    const unsigned int heads = static_cast<unsigned int>(p.nb1 * p.nb2);
    const unsigned int s = ub / heads, h = ub % heads;
    q0 = vl.cu_q[s];
    k0 = vl.cu_k[s];
    const long long sq = vl.cu_q[s + 1] - q0;
    p.sq = sq;
    p.sk = vl.cu_k[s + 1] - k0;
    p.q = static_cast<const T*>(p.q) + q0 * p.q_sr;
    p.o = static_cast<T*>(p.o) + q0 * p.o_sr;
    p.k = static_cast<const T*>(p.k) + k0 * p.k_sr;
    p.v = static_cast<const T*>(p.v) + k0 * p.v_sr;
    if (p.lse != nullptr)
        p.lse = p.lse + (static_cast<long long>(h) * vl.lse_hs + q0 -
                         static_cast<long long>(ub) * sq);
}

// The view of the block's (sequence, head, query block) for a kernel with one query block per
// block (block_coord); false when the query block lies past the sequence's rows.
template <typename T>
__device__ __forceinline__ bool fwd_varlen_segment(AttnParams& p, const VarlenParams& vl,
                                                   int bm) {
    const BlockCoord bc = block_coord(p);
    long long q0, k0;
    fwd_varlen_move<T>(p, vl, static_cast<unsigned int>(bc.b), q0, k0);
    return bc.mblock * bm < p.sq;
}

// The segment view in shared memory, built by thread 0 (a barrier follows), so that a body reads
// its fields as it reads kernel parameters instead of holding the moved pointers and lengths in
// registers through its loops (as the backward's bwd_varlen_segment_shared). Null: the block's
// query rows lie past its sequence's (every thread of the block gets the same answer).
template <typename T>
__device__ __forceinline__ const AttnParams* fwd_varlen_segment_shared(const AttnParams& p_in,
                                                                       const VarlenParams& vl,
                                                                       int bm) {
    __shared__ AttnParams view;
    __shared__ int live;
    if (threadIdx.x == 0) {
        AttnParams p = p_in;
        live = fwd_varlen_segment<T>(p, vl, bm) ? 1 : 0;
        view = p;
    }
    __syncthreads();
    return live ? &view : nullptr;
}

// Keys a block of query rows [row0, row0 + rows) needs: all of them, or under the causal mask up
// to the last row's last visible key. Tiles past it are never loaded.
template <bool CAUSAL>
__device__ __forceinline__ int keys_needed(int row0, int rows, int sq, int sk) {
    if (!CAUSAL) return sk;
    const int last_row = min(row0 + rows, sq) - 1;
    return max(0, min(sk, last_row + (sk - sq) + 1));
}
// The first key tile (of BN keys) that needs the mask for rows from first_row on: the partial tail
// tile (if Sk % BN != 0) and, under the causal mask, every tile holding a key that first_row cannot
// see. Tiles before it skip the mask.
template <bool CAUSAL>
__device__ __forceinline__ int first_masked_tile(int first_row, int bn, int sq, int sk) {
    int mask_key = (sk % bn) ? (sk / bn) * bn : sk;
    if (CAUSAL) mask_key = min(mask_key, first_row + (sk - sq) + 1);
    return mask_key < 0 ? 0 : mask_key / bn;
}

// Causal mask, bottom-right aligned (as FlashAttention >= 2.1 and cuDNN): query row i sees key j
// iff j <= i + (Sk - Sq). Returns the number of keys row i sees (<= 0: none).
__device__ __forceinline__ long long causal_keys_visible(long long i, long long sq, long long sk) {
    const long long lim = i + (sk - sq) + 1;
    return lim < sk ? lim : sk;
}

}  // namespace cuflash

// ---------------------------------------------------------------------------------------------
// Tensor-core building blocks (sm_80+): asynchronous copies, ldmatrix, mma.sync m16n8k16.
namespace cuflash {

__device__ __forceinline__ unsigned int smem_addr(const void* p) {
    return static_cast<unsigned int>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy that bypasses L1; src_bytes = 0 writes zeros (tails, padding).
__device__ __forceinline__ void cp_async16(unsigned int dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(dst), "l"(src), "r"(src_bytes));
}
// As cp_async16, with the L2 told to fetch the whole 256-byte block around the address (the
// decode kernel's version 3 streams K/V rows with it).
__device__ __forceinline__ void cp_async16_l2pf256(unsigned int dst, const void* src,
                                                   int src_bytes) {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n"
                 :: "r"(dst), "l"(src), "r"(src_bytes));
}
// As cp_async16, under an L2 cache policy `pol` (createpolicy): the decode kernel's version 5
// streams K/V rows with an evict-first policy, so data read once does not displace what stays.
__device__ __forceinline__ void cp_async16_policy(unsigned int dst, const void* src, int src_bytes,
                                                  unsigned long long pol) {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n"
                 :: "r"(dst), "l"(src), "r"(src_bytes), "l"(pol));
}
// The L2 policy that marks every line it touches evict-first.
__device__ __forceinline__ unsigned long long l2_evict_first_policy() {
    unsigned long long pol;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(pol));
    return pol;
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N));
}

// Four 8x8 matrices of 16-bit elements; lane l supplies the address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void ldmatrix_x4(unsigned int addr, unsigned int& r0, unsigned int& r1,
                                            unsigned int& r2, unsigned int& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned int addr, unsigned int& r0,
                                                  unsigned int& r1, unsigned int& r2,
                                                  unsigned int& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

// Copy rows [row0, row0 + ROWS) of a (rows x d) matrix with row stride `ld` into shared memory
// (row stride STRIDE elements), zero-filling rows >= n_rows and columns >= d, in 16-byte chunks of
// EPC elements (d is a multiple of EPC: a chunk is all in or all out).
// Row indices are 32-bit (the host checks Sq, Sk < 2^31); offsets into memory are 64-bit.
// When the threads divide evenly into rows of chunks, each thread copies the same column chunk of
// rows r0, r0 + RSTEP, ...: one 64-bit offset and one 64-bit step per tile instead of a 64-bit
// address per chunk held across the main loop (that cost ~30 registers).
template <int ROWS, int CHUNKS, int STRIDE, int THREADS, typename T>
__device__ __forceinline__ void load_tile(T* smem, const T* g, long long ld, int row0, int n_rows,
                                          int d, int tid) {
    constexpr int EPC = 16 / static_cast<int>(sizeof(T));
    constexpr int ROW_BYTES = STRIDE * static_cast<int>(sizeof(T));
    if constexpr (THREADS % CHUNKS == 0) {
        constexpr int RSTEP = THREADS / CHUNKS;
        const int r0 = tid / CHUNKS, c = tid % CHUNKS;
        const bool col_ok = c * EPC < d;
        const T* src = g + static_cast<long long>(row0 + r0) * ld + c * EPC;
        const long long step = RSTEP * ld;
        const unsigned int dst = smem_addr(smem + r0 * STRIDE + c * EPC);
#pragma unroll
        for (int n = 0; n < (ROWS + RSTEP - 1) / RSTEP; ++n) {
            if (ROWS % RSTEP == 0 || r0 + n * RSTEP < ROWS) {
                const bool ok = col_ok && row0 + r0 + n * RSTEP < n_rows;
                cp_async16(dst + n * RSTEP * ROW_BYTES, ok ? src : g, ok ? 16 : 0);
            }
            src += step;
        }
    } else {
        const T* base = g + static_cast<long long>(row0) * ld;
#pragma unroll
        for (int i = tid; i < ROWS * CHUNKS; i += THREADS) {
            const int r = i / CHUNKS, c = i % CHUNKS;
            const bool ok = row0 + r < n_rows && c * EPC < d;
            const T* src = ok ? base + r * ld + c * EPC : g;  // a valid address when zero-filling
            cp_async16(smem_addr(smem + r * STRIDE + c * EPC), src, ok ? 16 : 0);
        }
    }
}

// D = A * B + D for a 16x16 (row) by 16x8 (col) product, fp32 accumulators.
template <typename T> struct Mma;
template <> struct Mma<fp16_t> {
    static __device__ __forceinline__ void run(float (&d)[4], const unsigned int (&a)[4],
                                               unsigned int b0, unsigned int b1) {
        asm volatile(  // volatile: keeps each mma next to its ldmatrix (bounded live fragments)
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
            "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};
template <> struct Mma<bf16_t> {
    static __device__ __forceinline__ void run(float (&d)[4], const unsigned int (&a)[4],
                                               unsigned int b0, unsigned int b1) {
        asm volatile(  // volatile: keeps each mma next to its ldmatrix (bounded live fragments)
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
            "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};


// ---------------------------------------------------------------------------------------------
// float32 operands on the tensor cores: TF32 (10 explicit mantissa bits, float32's exponent range)
// with mma.sync m16n8k8 and float32 accumulators. One pass rounds each operand to TF32 (relative
// error 2^-11 per operand). The split-precision form writes x = hi + lo with hi = tf32(x) and
// lo = tf32(x - hi) (x - hi is exact in float32; |x - (hi + lo)| <= 2^-22 |x|) and sums the three
// significant cross products a_lo b_hi + a_hi b_lo + a_hi b_hi, dropping a_lo b_lo (<= 2^-22 |ab|):
// products good to about 3 * 2^-22 relative, against float32's 2^-24, at three times the MMAs.
__device__ __forceinline__ unsigned int to_tf32(float x) {
    unsigned int r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}
// One operand value in the form the products need: hi always, lo only for TERMS == 3.
// (An infinite x gives lo = inf - inf = NaN, so infinities in K or V come out as NaN where the
// float32 reference has inf: a known defect, tests/test_nonfinite.py marks it. Handling it in
// the small products cost D = 128 its last registers: 8-56 bytes of spills.)
template <int TERMS> struct Tf32Split {
    unsigned int hi = 0u, lo = 0u;
    Tf32Split() = default;
    __device__ __forceinline__ explicit Tf32Split(float x) : hi(to_tf32(x)) {
        if constexpr (TERMS == 3) lo = to_tf32(x - __uint_as_float(hi));
    }
};

// Shared-memory loads of the float32 kernel's fragment values. volatile, like the MMAs: each load
// stays next to the products that use it, which bounds how many fragments are live at once (with
// ordinary loads ptxas hoisted whole tiles of them and spilled at D >= 128).
__device__ __forceinline__ float4 lds128(const float* p) {
    float4 r;
    asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                 : "=f"(r.x), "=f"(r.y), "=f"(r.z), "=f"(r.w) : "r"(smem_addr(p)));
    return r;
}
__device__ __forceinline__ float lds32(const float* p) {
    float r;
    asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(r) : "r"(smem_addr(p)));
    return r;
}

// D = A * B + D for a 16x8 (row) by 8x8 (col) product of TF32 operands, fp32 accumulators.
// Fragments: a0 = A[g][t4], a1 = A[g + 8][t4], a2 = A[g][t4 + 4], a3 = A[g + 8][t4 + 4];
// b0 = B[t4][g], b1 = B[t4 + 4][g]; d in the m16n8 accumulator layout (g = lane / 4, t4 = lane % 4).
__device__ __forceinline__ void mma_tf32(float (&d)[4], unsigned int a0, unsigned int a1,
                                         unsigned int a2, unsigned int a3, unsigned int b0,
                                         unsigned int b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The products of one k8 step in the split form: the two small cross products go to `small`, the
// large one to `big`. Kept apart, the large chain is not lengthened by the small products'
// accumulation steps (the tensor cores' fp32 accumulation does not round to nearest), and the two
// are added once, in IEEE float32, after the last step. TERMS == 1: the one-pass TF32 product.
// PROMOTE: the large product goes to a zeroed fragment and then into `big` with IEEE float32
// additions (4 FADD a thread), so `big` is never a tensor-core accumulator: the tensor cores align
// their addends to the largest one, truncate, and truncate the sum toward zero, which along a
// chain of k-steps shrinks |big| by up to 2^-23 per step (notes/FLOAT32.md). The small products,
// 2^-11 of the large ones, keep their chain.
template <int TERMS, bool PROMOTE = false>
__device__ __forceinline__ void mma_f32(float (&big)[4], float (&small)[4],
                                        const Tf32Split<TERMS> (&a)[4],
                                        const Tf32Split<TERMS>& b0, const Tf32Split<TERMS>& b1) {
    if constexpr (TERMS == 3) {
        mma_tf32(small, a[0].lo, a[1].lo, a[2].lo, a[3].lo, b0.hi, b1.hi);
        mma_tf32(small, a[0].hi, a[1].hi, a[2].hi, a[3].hi, b0.lo, b1.lo);
    }
    if constexpr (PROMOTE) {
        float t[4] = {0.f, 0.f, 0.f, 0.f};
        mma_tf32(t, a[0].hi, a[1].hi, a[2].hi, a[3].hi, b0.hi, b1.hi);
#pragma unroll
        for (int e = 0; e < 4; ++e) big[e] += t[e];
    } else {
        mma_tf32(big, a[0].hi, a[1].hi, a[2].hi, a[3].hi, b0.hi, b1.hi);
    }
}


}  // namespace cuflash

namespace cuflash {

// ---------------------------------------------------------------------------------------------
// The online-softmax step of the tensor-core kernels (attn_mma.cu, attn_wgmma.cu), on one 16-row
// slab of scores in the m16n8 accumulator layout that mma.sync and wgmma share: s[nt][e] is row
// row_lo + 8 * (e / 2), key key0 + nt * 8 + 2 * t4 + e % 2, and each row is spread over the 4
// threads of a quad. Scores are raw (unscaled): the scale (> 0, checked on the host) is folded
// into one FFMA per score, p = exp2(s * c - m * c) with c = scale * log2(e).
//
// Lazy rescaling: the reference max m only moves when the tile's max exceeds it by more than
// 2^RESCALE_LOG2 in exp2 units. Otherwise p <= 2^RESCALE_LOG2 (256: exact in fp32, and in range for
// fp16/bf16 P) and l, O need no rescale, which saves D/2 multiplies per row and tile after the
// first few tiles. The state stays consistent (l and O are sums relative to the same m), so the
// result is exact up to rounding, as in the plain form.
// LAZY = false moves m whenever the tile's max exceeds it (every rescale taken): the one-pass TF32
// mode needs it, because there P is rounded to TF32 (2^-11) for the P.V product, and relative to a
// stale m the row's dominant weight is a rounded p > 1 instead of an exact 1. That made the mode's
// error a heavy-tailed copy of its naive counterpart's (err/naive over 800 draws of Sq = 113,
// Sk = 200, D = 64-128 in a NumPy transcription: max 2.63, 3 draws over the 2x-naive bar, one of
// them test_head_dims on the H200); with every rescale taken: max 1.61, median 0.90
// (notes/FLOAT32.md). 16-bit P and the split float32 P lose far less to the stale max than the
// naive implementation of their dtype does, so they stay lazy.
constexpr float RESCALE_LOG2 = 8.f;

// Tree reduction of the first W values of part into part[0]: short dependency chains (a serial
// chain of dependent FMNMX/FADD showed up as fixed-latency stalls in the profile). Recursion on
// the width keeps every loop's trip count a constant, so the values stay in registers (a loop on
// the width itself did not unroll for 16 values and put them in local memory).
template <int W, int N, typename Op>
__device__ __forceinline__ void tree_reduce(float (&part)[N], Op op) {
    if constexpr (W > 1) {
#pragma unroll
        for (int i = 0; i < W / 2; ++i) part[i] = op(part[i], part[i + (W + 1) / 2]);
        tree_reduce<(W + 1) / 2>(part, op);
    }
}

// Row h of the thread's scores to p = exp2(a s + c) in place; returns their sum (a tree).
template <int NT>
__device__ __forceinline__ float exp2_row_sum(float (&s)[NT][4], int h, float a, float c) {
    float part[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        s[nt][2 * h] = fast_exp2(fmaf(s[nt][2 * h], a, c));
        s[nt][2 * h + 1] = fast_exp2(fmaf(s[nt][2 * h + 1], a, c));
        part[nt] = s[nt][2 * h] + s[nt][2 * h + 1];
    }
    tree_reduce<NT>(part, [](float x, float y) { return x + y; });
    return part[0];
}

// Masks (when need_mask), turns s into p in place, updates m_run and l_run (the thread's partial
// row sums), and returns the factors O must be multiplied by (1 when m did not move).
template <int NT, bool CAUSAL, bool LAZY = true>
__device__ __forceinline__ void softmax_step(float (&s)[NT][4], float (&m_run)[2],
                                             float (&l_run)[2], float (&alpha)[2], bool need_mask,
                                             int key0, int t4, int sk, int row_lo, int diag,
                                             float scale_log2) {
    if (need_mask) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = key0 + nt * 8 + 2 * t4 + (e % 2);
                bool ok = key < sk;
                if (CAUSAL) ok = ok && key <= row_lo + 8 * (e / 2) + diag;
                s[nt][e] = ok ? s[nt][e] : neg_inf<float>();
            }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float part[NT];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) part[nt] = fmaxf(s[nt][2 * h], s[nt][2 * h + 1]);
        tree_reduce<NT>(part, [](float x, float y) { return fmaxf(x, y); });
        float mx = fmaxf(m_run[h], part[0]);
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        // grow is true on the first visible key (m = -inf, mx finite) and false while nothing is
        // visible (-inf - -inf is NaN): then m stays -inf and every p is 0.
        const bool grow = (mx - m_run[h]) * scale_log2 > (LAZY ? RESCALE_LOG2 : 0.f);
        alpha[h] = grow ? fast_exp2((m_run[h] - mx) * scale_log2) : 1.f;
        if (grow) m_run[h] = mx;
        const float m_c = (m_run[h] == neg_inf<float>()) ? 0.f : m_run[h] * scale_log2;
        l_run[h] = l_run[h] * alpha[h] + exp2_row_sum(s, h, scale_log2, -m_c);
    }
}

// softmax_step for scores whose value in log2 units is a s + b[h] (a > 0, the same for every
// element; b per thread and row, e.g. ALiBi's row term of the tile: variants.cuh,
// affine_scores): m_run in log2 units (0 while -inf for the exponent; row_lse and the exact path
// take scale_log2 = 1). Masked elements hold s = -inf. The thread's own maximum goes to log2
// units with its own b before the quad's reduction (b differs across the quad); then as
// softmax_step: lazy rescales, p = exp2(a s + b - m) in one FFMA per element.
template <int NT, bool LAZY = true>
__device__ __forceinline__ void softmax_step_affine(float (&s)[NT][4], float (&m_run)[2],
                                                    float (&l_run)[2], float (&alpha)[2],
                                                    float a, const float (&b)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float part[NT];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) part[nt] = fmaxf(s[nt][2 * h], s[nt][2 * h + 1]);
        tree_reduce<NT>(part, [](float x, float y) { return fmaxf(x, y); });
        float mx = fmaxf(m_run[h], fmaf(part[0], a, b[h]));   // -inf stays -inf (a > 0)
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const bool grow = (mx - m_run[h]) > (LAZY ? RESCALE_LOG2 : 0.f);
        alpha[h] = grow ? fast_exp2(m_run[h] - mx) : 1.f;
        if (grow) m_run[h] = mx;
        const float c = b[h] - ((m_run[h] == neg_inf<float>()) ? 0.f : m_run[h]);
        l_run[h] = l_run[h] * alpha[h] + exp2_row_sum(s, h, a, c);
    }
}

// O *= alpha per row, skipped when no row of the warp moved its max (the common case).
template <int NT>
__device__ __forceinline__ void rescale_rows(float (&o)[NT][4], const float (&alpha)[2]) {
    if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
        for (int i = 0; i < NT; ++i) {
            o[i][0] *= alpha[0];
            o[i][1] *= alpha[0];
            o[i][2] *= alpha[1];
            o[i][3] *= alpha[1];
        }
    }
}

// P to 16 bits in the A-operand layout of the P.V product: two adjacent n8 score tiles form one
// k16 slice (for mma.sync m16n8k16 and for wgmma with A from registers alike).
template <typename T, int NT>
__device__ __forceinline__ void pack_p(const float (&s)[NT][4], unsigned int (&pk)[NT / 2][4]) {
#pragma unroll
    for (int kk = 0; kk < NT / 2; ++kk) {
        pk[kk][0] = pack2<T>(s[2 * kk][0], s[2 * kk][1]);
        pk[kk][1] = pack2<T>(s[2 * kk][2], s[2 * kk][3]);
        pk[kk][2] = pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
        pk[kk][3] = pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
    }
}

// The row's lse (natural log) from its final (quad-reduced) sum l and reference max m in raw
// score units; -inf for a row that saw no key.
__device__ __forceinline__ float row_lse(float m, float l, float scale_log2) {
    return l == 0.f ? neg_inf<float>() : (m * scale_log2 + __log2f(l)) * 0.6931471805599453f;
}

// A masked key must not touch a row (CONTRACTS.md), yet a tensor-core P.V over a causal diagonal
// tile adds P * V for every key of the tile, and P = 0 at a masked key does not hide a NaN or an
// infinity in its V (0 * inf = NaN). A kernel that finds a row's accumulated O non-finite (a test
// on the accumulators in the epilogue, nothing in the main loop) recomputes that row here: one
// warp, fp32, from global memory, over exactly the keys the row sees. The scores and the row
// sum do not depend on V, so the row's final m_c (= m * scale_log2, 0 while m = -inf) and 1 / l
// from the main loop still hold. This path runs only for non-finite inputs; its speed does not
// matter. All 32 lanes call it with the same row; D, Dv <= 256 (8 columns per lane).
// The exact paths' pieces (exact_row_pv; variants.cuh: exact_row_pv_var), one warp per row:
// q_row . kj over D (the warp's sum, the same value in every lane), acc += pj vj over the lane's
// columns lane + 32 i, and o_row = acc / l.
template <typename T>
__device__ __forceinline__ float exact_row_dot(const T* q_row, const T* kj, int d, int lane) {
    float s = 0.f;
    for (int c = lane; c < d; c += 32) s = fmaf(to_float(q_row[c]), to_float(kj[c]), s);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    return s;
}
template <typename T>
__device__ __forceinline__ void exact_row_axpy(float (&acc)[8], float pj, const T* vj, int dv,
                                               int lane) {
#pragma unroll
    for (int i = 0; i < 8; ++i)
        if (lane + 32 * i < dv) acc[i] = fmaf(pj, to_float(vj[lane + 32 * i]), acc[i]);
}
template <typename T>
__device__ __forceinline__ void exact_row_store(const float (&acc)[8], float inv_l, int dv,
                                                int lane, T* o_row) {
#pragma unroll
    for (int i = 0; i < 8; ++i)
        if (lane + 32 * i < dv) o_row[lane + 32 * i] = from_acc<T>(acc[i] * inv_l);
}

template <typename T>
__device__ __noinline__ void exact_row_pv(const T* q_row, const T* k, long long k_sr, const T* v,
                                          long long v_sr, int d, int dv, int n_keys,
                                          float scale_log2, float m_c, float inv_l, T* o_row) {
    const int lane = static_cast<int>(threadIdx.x & 31u);
    float acc[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = 0.f;
    for (int j = 0; j < n_keys; ++j) {
        const float s = exact_row_dot(q_row, k + j * k_sr, d, lane);
        const float pj = fast_exp2(fmaf(s, scale_log2, -m_c));
        exact_row_axpy(acc, pj, v + j * v_sr, dv, lane);
    }
    exact_row_store(acc, inv_l, dv, lane, o_row);
}

}  // namespace cuflash

// ---------------------------------------------------------------------------------------------
// Hopper building blocks (sm_90a only; nothing here is emitted unless a kernel calls it): mbarrier,
// the tensor memory accelerator (TMA), warpgroup MMA fences and shared-memory descriptors, and
// register reallocation between warpgroups.
namespace cuflash {

// A CUtensorMap: 128 opaque bytes made by cuTensorMapEncodeTiled on the host, passed by value
// inside a __grid_constant__ parameter (TMA reads it through its generic address).
struct alignas(64) TmaDesc { unsigned long long bits[16]; };

__device__ __forceinline__ void mbar_init(unsigned int bar, unsigned int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(count) : "memory");
}
// Make the initialised barriers visible to the async proxy (TMA) before any thread uses them.
__device__ __forceinline__ void mbar_fence_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// One arrival that also announces `bytes` of TMA traffic the phase must wait for.
__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned int bar, unsigned int bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n"
                 :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned int bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(bar) : "memory");
}
// Wait until the barrier's phase with this parity (0 for the first completion, then 1, 0, ...)
// has completed.
__device__ __forceinline__ void mbar_wait(unsigned int bar, unsigned int parity) {
    unsigned int done;
    do {
        asm volatile("{\n.reg .pred p;\n"
                     "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     "selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    } while (!done);
}

// TMA: one box of a 5-D tensor map (coordinates innermost first) into shared memory; completion
// is counted in bytes on the mbarrier. Out-of-range elements of the box arrive as zeros.
__device__ __forceinline__ void tma_load_5d(unsigned int dst, const TmaDesc* map, int c0, int c1,
                                            int c2, int c3, int c4, unsigned int bar) {
    asm volatile("cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4, %5, %6}], [%7];\n"
                 :: "r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1),
                    "r"(c2), "r"(c3), "r"(c4), "r"(bar)
                 : "memory");
}

// Shared-memory matrix descriptor of wgmma for a tile stored with the 128-byte swizzle (what TMA
// writes with CU_TENSOR_MAP_SWIZZLE_128B): start address, leading and stride byte offsets (all
// in 16-byte units), swizzle mode 1 in bits 62-63. The 8-row x 128-byte swizzle atoms must start
// on 1024-byte boundaries. K-major operands: sbo = 1024 (the next 8 rows), lbo unused; moving
// along K inside the 128-byte row is a plain start-address offset. N-major operands: sbo = 1024
// (the next 8 rows of K), lbo = the distance to the next 64-element block of N.
__device__ __forceinline__ unsigned long long wgmma_desc(unsigned int addr, unsigned int lbo,
                                                         unsigned int sbo) {
    return static_cast<unsigned long long>((addr & 0x3FFFF) >> 4) |
           (static_cast<unsigned long long>(lbo >> 4) << 16) |
           (static_cast<unsigned long long>(sbo >> 4) << 32) | (1ull << 62);
}
__device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory");
}
// Tell the compiler that an accumulator array is read and written here, so that no copy of it is
// scheduled between an asynchronous wgmma and the wait that completes it.
template <int N> __device__ __forceinline__ void fence_regs(float (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i]) :: "memory");
}

// Named barriers (ids 1..15; 0 is __syncthreads) between groups of warps: bar.sync waits until
// `threads` threads have arrived, counting those that only announce themselves with bar.arrive.
__device__ __forceinline__ void named_bar_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" :: "r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" :: "r"(id), "r"(threads) : "memory");
}

template <int N> __device__ __forceinline__ void regs_dealloc() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(N));
}
template <int N> __device__ __forceinline__ void regs_alloc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(N));
}

}  // namespace cuflash

// =============================================================================================
// Backward pass (notes/BACKWARD.md): the parameter block every backward kernel family takes, and
// the batch-index helpers that turn a block index into an "owner" batch entry plus a loop over
// the batch entries whose gradients it sums (broadcast batch axes).
namespace cuflash {

// Every field is 8 bytes wide (cuflash/_launch.py: BWD_PARAMS_DTYPE mirrors it). Element strides,
// the last axis contiguous. Batch axes are collapsed on the host to three, (nb0, nb1, nb2), the
// full (broadcast) batch; a tensor's batch stride is 0 on an axis it does not have (size 1).
//   q (.., Sq, D), k (.., Sk, D), v (.., Sk, Dv), o and dout (.., Sq, Dv), lse (.., Sq) float32:
//     the inputs (o and lse as the forward returned them).
//   dq, dk, dv: the outputs, with q's, k's and v's shapes: on an axis where q (k, v) broadcasts
//     dq (dk, dv) has batch stride 0 and holds the sum over that axis.
//   delta: workspace of the accumulator type (float; double for float64 inputs), (nbatch, Sq)
//     contiguous over the full batch, flat index b = (i0 * nb1 + i1) * nb2 + i2:
//     delta = rowsum(dout * o), written by cuflash_bwd_preprocess (plans with lse_acc overwrite
//     it in their "rows" pass with sum_j p_ij dp_ij from the recomputed P).
//   lse_acc: null, or workspace of the accumulator type: each row's softmax max m (delta's
//     layout) followed, nbatch * Sq elements later, by its sum l, recomputed by the "rows" pass and
//     read by the "keys" pass, which then form p = exp(s - m) / l instead of exp(s - lse) (the
//     generic float32 and float64 plans: the forward's float32 lse has an absolute error of about
//     |lse| float32 ulps, which becomes a relative error of p).
//   dq_accum: float32 workspace for kernels that accumulate dq with atomics (null otherwise), laid
//     out by dqa_* strides (0 on the axes in q_red, so atomics from every batch entry of a
//     broadcast q land in one row); holds sum_j dS_ij k_j WITHOUT the softmax scale. The
//     preprocess kernel zeroes its rows (all dqa_sr columns), cuflash_bwd_convert_dq writes dq = scale * it.
//   q_red: bit a set when dq sums over collapsed batch axis a (q broadcasts there);
//   kv_red: bit a set when dk and dv both sum over axis a. (The host never launches with k and v
//     broadcasting differently; it falls back to full-batch temporaries for that rare case.)
//   n_mblocks: ceil(Sq / BLOCK_M) of the query-parallel pass; n_nblocks: ceil(Sk / BLOCK_N) of the
//     key-parallel pass (each kernel derives its grid from them, see bwd_owner_count).
//   deterministic: 1 when the caller asked for bitwise-reproducible results (kernels that use
//     float atomics must not be launched then; the flag is for kernels that adapt).
//   cu_q, cu_k: null, or (packed variable-length batches, the *_varlen kernels only) the
//     sequences' int32 row offsets (B + 1,) into q/o/dout/dq/lse/dq_accum and into k/v/dk/dv:
//     see bwd_varlen_segment.
struct BwdParams {
    const void* q;
    const void* k;
    const void* v;
    const void* o;
    const void* dout;
    const float* lse;
    void* delta;
    void* lse_acc;
    float* dq_accum;
    void* dq;
    void* dk;
    void* dv;
    long long sq, sk, d, dv_dim;
    long long nb0, nb1, nb2;
    long long q_s0, q_s1, q_s2, q_sr;
    long long k_s0, k_s1, k_s2, k_sr;
    long long v_s0, v_s1, v_s2, v_sr;
    long long o_s0, o_s1, o_s2, o_sr;
    long long do_s0, do_s1, do_s2, do_sr;
    long long dq_s0, dq_s1, dq_s2, dq_sr;
    long long dk_s0, dk_s1, dk_s2, dk_sr;
    long long dv_s0, dv_s1, dv_s2, dv_sr;
    long long lse_s0, lse_s1, lse_s2, lse_sr;
    long long dqa_s0, dqa_s1, dqa_s2, dqa_sr;
    long long q_red, kv_red;
    long long n_mblocks, n_nblocks;
    long long deterministic;
    double scale_log2;     // softmax scale * log2(e)
    double scale;
    const int* cu_q;       // packed varlen batches only (null otherwise), see bwd_varlen_segment
    const int* cu_k;
};
static_assert(sizeof(BwdParams) == 68 * 8, "BwdParams must match cuflash/_launch.py");

// A batch entry as its three collapsed coordinates.
struct BwdIndex { unsigned int i0, i1, i2; };

// Batch entries a block owns / loops over, for the reduction mask `red` (q_red or kv_red): the
// grid enumerates the owners (every axis not in `red`), the block sums over the axes in `red`.
// The host checks that both counts, and every grid, are below 2^31.
__device__ __forceinline__ unsigned int bwd_axis_size(const BwdParams& p, int a) {
    return static_cast<unsigned int>(a == 0 ? p.nb0 : (a == 1 ? p.nb1 : p.nb2));
}
__device__ __forceinline__ unsigned int bwd_owner_count(const BwdParams& p, long long red) {
    unsigned int n = 1;
#pragma unroll
    for (int a = 0; a < 3; ++a) n *= ((red >> a) & 1) ? 1u : bwd_axis_size(p, a);
    return n;
}
__device__ __forceinline__ unsigned int bwd_reduce_count(const BwdParams& p, long long red) {
    unsigned int n = 1;
#pragma unroll
    for (int a = 0; a < 3; ++a) n *= ((red >> a) & 1) ? bwd_axis_size(p, a) : 1u;
    return n;
}
// Owner `owner` (< bwd_owner_count) and reduction step `r` (< bwd_reduce_count) -> coordinates.
// Axis 2 varies fastest in both, as in the flat index.
__device__ __forceinline__ BwdIndex bwd_index(const BwdParams& p, long long red,
                                              unsigned int owner, unsigned int r) {
    unsigned int c[3];
#pragma unroll
    for (int a = 2; a >= 0; --a) {
        const unsigned int n = bwd_axis_size(p, a);
        if ((red >> a) & 1) { c[a] = r % n; r /= n; }
        else { c[a] = owner % n; owner /= n; }
    }
    BwdIndex ix;
    ix.i0 = c[0]; ix.i1 = c[1]; ix.i2 = c[2];
    return ix;
}
__device__ __forceinline__ long long bwd_offset(const BwdIndex& ix, long long s0, long long s1,
                                                long long s2) {
    return static_cast<long long>(ix.i0) * s0 + static_cast<long long>(ix.i1) * s1 +
           static_cast<long long>(ix.i2) * s2;
}
// The flat full-batch index (delta's layout).
__device__ __forceinline__ long long bwd_flat(const BwdParams& p, const BwdIndex& ix) {
    return (static_cast<long long>(ix.i0) * p.nb1 + ix.i1) * p.nb2 + ix.i2;
}

// Offsets of every tensor for one batch entry.
struct BwdOffsets { long long q, k, v, o, dout, lse, delta, dq, dk, dv, dqa; };
__device__ __forceinline__ BwdOffsets bwd_offsets(const BwdParams& p, const BwdIndex& ix) {
    BwdOffsets r;
    r.q = bwd_offset(ix, p.q_s0, p.q_s1, p.q_s2);
    r.k = bwd_offset(ix, p.k_s0, p.k_s1, p.k_s2);
    r.v = bwd_offset(ix, p.v_s0, p.v_s1, p.v_s2);
    r.o = bwd_offset(ix, p.o_s0, p.o_s1, p.o_s2);
    r.dout = bwd_offset(ix, p.do_s0, p.do_s1, p.do_s2);
    r.lse = bwd_offset(ix, p.lse_s0, p.lse_s1, p.lse_s2);
    r.delta = bwd_flat(p, ix) * p.sq;
    r.dq = bwd_offset(ix, p.dq_s0, p.dq_s1, p.dq_s2);
    r.dk = bwd_offset(ix, p.dk_s0, p.dk_s1, p.dk_s2);
    r.dv = bwd_offset(ix, p.dv_s0, p.dv_s1, p.dv_s2);
    r.dqa = bwd_offset(ix, p.dqa_s0, p.dqa_s1, p.dqa_s2);
    return r;
}

// Packed variable-length batches (cuflash.attention_varlen_backward, the *_varlen kernels). The
// host launches the plain kernels' grids over a batch (nb0, nb1, nb2) = (B sequences, Hkv,
// H / Hkv) with sq, sk = max_seqlen_q/k, batch stride 0 on axis 0 for every tensor and axis 0 in
// neither q_red nor kv_red. A block of owner `owner` (for the reduction mask `red`) belongs to
// sequence s = owner / (owners per sequence); bwd_varlen_segment turns p into the *segment view*
// of s: sq, sk its lengths, nb0 = 1 (so the owner index, whose multiple of the per-sequence
// owners is then dropped by bwd_index, and bwd_flat give the head h), the pointers moved to the
// sequence's first row (rows cu_q[s].. of q, o, dout, dq, lse and dq_accum, keys cu_k[s].. of k,
// v, dk, dv; dq_accum holds rows (H, total_q, dqa_sr)), and the row-statistics workspaces moved
// to the sequence's own section: delta (H, Sq_s) at H * cu_q[s], lse_acc's m and l (2, H, Sq_s)
// at 2 * H * cu_q[s]. The kernel body then runs unchanged on it; blocks past the sequence's rows
// or keys leave before it (the *_varlen wrappers).
template <typename T, typename Acc>
__device__ __forceinline__ void bwd_varlen_segment(BwdParams& p, unsigned int owner,
                                                   long long red) {
    const unsigned int per_seq = bwd_owner_count(p, red) / static_cast<unsigned int>(p.nb0);
    const unsigned int s = owner / per_seq;
    const long long q0 = p.cu_q[s], k0 = p.cu_k[s];
    const long long heads = p.nb1 * p.nb2;
    p.sq = p.cu_q[s + 1] - q0;
    p.sk = p.cu_k[s + 1] - k0;
    p.nb0 = 1;
    p.q = static_cast<const T*>(p.q) + q0 * p.q_sr;
    p.o = static_cast<const T*>(p.o) + q0 * p.o_sr;
    p.dout = static_cast<const T*>(p.dout) + q0 * p.do_sr;
    p.dq = static_cast<T*>(p.dq) + q0 * p.dq_sr;
    p.lse = p.lse + q0 * p.lse_sr;
    p.k = static_cast<const T*>(p.k) + k0 * p.k_sr;
    p.v = static_cast<const T*>(p.v) + k0 * p.v_sr;
    p.dk = static_cast<T*>(p.dk) + k0 * p.dk_sr;
    p.dv = static_cast<T*>(p.dv) + k0 * p.dv_sr;
    p.delta = static_cast<Acc*>(p.delta) + heads * q0;
    if (p.lse_acc != nullptr) p.lse_acc = static_cast<Acc*>(p.lse_acc) + 2 * heads * q0;
    if (p.dq_accum != nullptr) p.dq_accum = p.dq_accum + q0 * p.dqa_sr;
}

// The segment view in shared memory, built by thread 0 (a barrier follows): a body then reads
// its fields as it reads the kernel's parameters, instead of holding the moved pointers and
// lengths in registers across its loops (in registers the tensor-core D = 128 twins spilled).
template <typename T, typename Acc>
__device__ __forceinline__ const BwdParams& bwd_varlen_segment_shared(const BwdParams& p_in,
                                                                      unsigned int owner,
                                                                      long long red) {
    __shared__ BwdParams view;
    if (threadIdx.x == 0) {
        BwdParams p = p_in;
        bwd_varlen_segment<T, Acc>(p, owner, red);
        view = p;
    }
    __syncthreads();
    return view;
}

// The first query row that sees key j under the bottom-right causal mask (j <= i + Sk - Sq).
__device__ __forceinline__ long long causal_first_row(long long j, long long sq, long long sk) {
    const long long r = j - (sk - sq);
    return r > 0 ? r : 0;
}

// Backward helpers of the key-parallel tensor-core kernels (attn_bwd_mma.cu, attn_bwd_wgmma.cu).
// dst[0] += a, dst[1] += b in global memory (float atomics; dst 8-byte aligned): one vector
// reduction on sm_90, two scalar ones before.
__device__ __forceinline__ void bwd_red_add2(float* dst, float a, float b) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.relaxed.gpu.global.add.v2.f32 [%0], {%1, %2};\n"
                 :: "l"(dst), "f"(a), "f"(b) : "memory");
#else
    atomicAdd(dst, a);
    atomicAdd(dst + 1, b);
#endif
}

// The turn counter of a dq tile (DET): acquire / release on an int in global memory.
__device__ __forceinline__ int bwd_turn_load(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void bwd_turn_store(int* p, int v) {
    asm volatile("st.release.gpu.global.s32 [%0], %1;\n" :: "l"(p), "r"(v) : "memory");
}

// The work of one block of a key-parallel backward kernel with BN keys per block and query tiles
// of BM rows (attn_bwd_wgmma.cu; the same arithmetic as attn_bwd_mma.cu's): its k/v owner, its
// key block (numbered from the end of the grid, so that the deterministic turns wait only for
// blocks dispatched before), the reduction steps over kv_red, and the query tiles it visits:
// all, or under the causal mask those from the tile of the first row that sees its first key.
struct BwdKeyBlock {
    unsigned int owner, n_red;
    int nblock, key0, sq, sk, d, diag, n_mtiles, m_first, n_iter;
    // The visit after (query tile mt, reduction step red with batch coordinates ix): the next
    // query tile, or the first one of the next step (whose coordinates are the only division).
    __device__ __forceinline__ void step(const BwdParams& p, int& mt, int& red,
                                         BwdIndex& ix) const {
        if (++mt < n_mtiles) return;
        mt = m_first;
        if (++red < static_cast<int>(n_red)) ix = bwd_index(p, p.kv_red, owner, red);
    }
};
// The number of SMs as the hardware numbers them (%nsmid: the largest SM id + 1).
__device__ __forceinline__ unsigned int sm_count() {
    unsigned int n;
    asm("mov.u32 %0, %%nsmid;\n" : "=r"(n));
    return n;
}
// DET_ORDER (the deterministic turns, notes/BACKWARD.md "Deterministic dq on Hopper"): blocks in
// groups of W = max(1, SMs / n_nblocks) owners, rank-major inside a group (rank r = the r-th key
// block from the end: every owner's rank 0, then every rank 1, ...), so that the W slots the
// rank-r blocks of one group free are taken by the rank-r blocks of the next and an owner's
// ranks start one after another, not in bursts. Rank r - 1 of an owner is always dispatched
// before rank r (the turns still wait only for earlier blocks), and which block index runs
// which key block changes no sum.
template <int BM, int BN, bool CAUSAL, bool DET_ORDER = false>
__device__ __forceinline__ BwdKeyBlock bwd_key_block(const BwdParams& p) {
    BwdKeyBlock b;
    const unsigned int nn = static_cast<unsigned int>(p.n_nblocks);
    unsigned int rank = blockIdx.x % nn;
    b.owner = blockIdx.x / nn;
    if (DET_ORDER) {
        const unsigned int owners = gridDim.x / nn, w = max(1u, sm_count() / nn);
        const unsigned int group = blockIdx.x / (w * nn), in = blockIdx.x - group * w * nn;
        const unsigned int wg = min(w, owners - group * w);  // owners in this group
        rank = in / wg;
        b.owner = group * w + in % wg;
    }
    b.nblock = static_cast<int>(nn - 1 - rank);
    b.key0 = b.nblock * BN;
    b.sq = static_cast<int>(p.sq);
    b.sk = static_cast<int>(p.sk);
    b.d = static_cast<int>(p.d);
    b.diag = b.sk - b.sq;  // row i sees keys j <= i + diag
    b.n_red = bwd_reduce_count(p, p.kv_red);
    b.n_mtiles = (b.sq + BM - 1) / BM;
    const int first_row = CAUSAL ? static_cast<int>(causal_first_row(b.key0, p.sq, p.sk)) : 0;
    b.m_first = first_row >= b.sq ? b.n_mtiles : first_row / BM;
    b.n_iter = static_cast<int>(b.n_red) * (b.n_mtiles - b.m_first);
    return b;
}

}  // namespace cuflash
