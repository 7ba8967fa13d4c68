// mask_blocks.cu: the block summary of a boolean mask (cuflash.block_mask; issue 15).
//
// For a mask of shape (batch..., R, C) (R = Sq or 1, C = Sk or 1: the mask's own, unbroadcast
// axes) the summary holds one byte per MASK_BLOCK x MASK_BLOCK block (variants.cuh):
//   MASK_BLOCK_KEPT   every in-bounds entry of the block is true,
//   MASK_BLOCK_HIDDEN every one is false,
//   MASK_BLOCK_MIXED  otherwise,
// laid out (batch..., ceil(R / 64), ceil(C / 64)) contiguous. The tensor-core kernels read it in
// Variant::tile_kind: a tile whose blocks are all KEPT is TILE_FULL and reads no mask element.
//
// One 256-thread block per summary byte; it reads the 64 x 64 bytes once (memory-bound: one pass
// over the mask) and reduces with __syncthreads_and / __syncthreads_or. VEC: the mask's keys are
// contiguous and every row starts 16-byte aligned, so each thread reads its row's 16 bytes in one
// load (the launch checks the alignment); otherwise each thread reads 16 bytes one at a time,
// 64 threads along a row so that a warp's loads cover 32 consecutive keys.
// The mask's batch axes arrive collapsed to four (sizes n1..n3 of the inner three; the outer
// size follows from the grid), strides in elements (bytes), 0 where an axis broadcasts.
#include "common.cuh"
#include "variants.cuh"

namespace cuflash {

// The block's byte from every thread's (all kept, some kept) over its entries; every thread of
// the block calls it (two barriers).
__device__ __forceinline__ void store_block_kind(unsigned char* out, bool all_true,
                                                 bool any_true) {
    const int every = __syncthreads_and(all_true);
    const int some = __syncthreads_or(any_true);
    if (threadIdx.x == 0)
        *out = every ? MASK_BLOCK_KEPT : (some ? MASK_BLOCK_MIXED : MASK_BLOCK_HIDDEN);
}

template <bool VEC>
__global__ void __launch_bounds__(256)
cuflash_mask_blocks(const unsigned char* __restrict__ mask, unsigned char* __restrict__ out,
                    long long n1, long long n2, long long n3, long long s0, long long s1,
                    long long s2, long long s3, long long sr, long long sc, long long rows,
                    long long cols, long long nrb, long long ncb) {
    const long long blk = blockIdx.x;
    const long long cb = blk % ncb;
    const long long rb = (blk / ncb) % nrb;
    long long n = blk / (ncb * nrb);
    const long long i3 = n % n3;
    n /= n3;
    const long long i2 = n % n2;
    n /= n2;
    const long long i1 = n % n1;
    const long long i0 = n / n1;
    const unsigned char* base = mask + i0 * s0 + i1 * s1 + i2 * s2 + i3 * s3;
    const long long r0 = rb * MASK_BLOCK, c0 = cb * MASK_BLOCK;
    const int t = threadIdx.x;
    bool any_true = false, all_true = true;
    if constexpr (VEC) {
        // Thread t: row t / 4 of the block, keys (t % 4) * 16 .. + 16.
        const long long r = r0 + (t >> 2);
        const long long c = c0 + (t & 3) * 16;
        if (r < rows && c < cols) {
            const unsigned char* p = base + r * sr + c;
            if (c + 16 <= cols) {
                const uint4 w = *reinterpret_cast<const uint4*>(p);
                const unsigned int word[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    // All four bytes nonzero iff no byte is zero (the zero-byte test on a word).
                    const unsigned int zero_byte = (word[q] - 0x01010101u) & ~word[q] & 0x80808080u;
                    any_true = any_true || word[q] != 0u;
                    all_true = all_true && zero_byte == 0u;
                }
            } else {
                for (long long x = c; x < cols; ++x) {
                    const bool b = p[x - c] != 0;
                    any_true = any_true || b;
                    all_true = all_true && b;
                }
            }
        }
    } else {
        // Thread t: key t % 64 of the block, rows t / 64 + 4 q.
        const long long c = c0 + (t & 63);
        if (c < cols) {
#pragma unroll 4
            for (int q = 0; q < MASK_BLOCK / 4; ++q) {
                const long long r = r0 + (t >> 6) + 4 * q;
                if (r < rows) {
                    const bool b = base[r * sr + c * sc] != 0;
                    any_true = any_true || b;
                    all_true = all_true && b;
                }
            }
        }
    }
    // Threads past the mask's edge hold (false, true): neutral for both reductions.
    store_block_kind(out + blk, all_true, any_true);
}

// The same summary for a user mask_mod (cuflash/mods.py: MaskMod; Hook = the generated struct
// cuflash_user::Mod_<hash>, appended to this file's source): one byte per 64 x 64 block of
// (Sq, Sk) for each of the summary's entries e = b' * nh + h' (b' over nb batch indices, h' over
// nh heads: nb = 1 or nh = 1 where the hook's code does not name b or h, whose value it then
// cannot depend on, so one summary serves every entry), laid out (nb, nh, ceil(Sq / 64),
// ceil(Sk / 64)) contiguous. One 256-thread block per byte, as above: thread t evaluates row
// t / 4 of the block at keys (t % 4) * 16 .. + 16 (keys past Sk and rows past Sq are neutral),
// then the block reduces. Compute-bound (no tensor is read but the hook's args): Sq Sk nb nh
// evaluations of the hook.
template <typename Hook>
__global__ void __launch_bounds__(256)
cuflash_hook_blocks(const float* __restrict__ args, unsigned char* __restrict__ out,
                    long long nh, long long sq, long long sk, long long nrb, long long ncb) {
    const long long blk = blockIdx.x;
    const long long cb = blk % ncb;
    const long long rb = (blk / ncb) % nrb;
    const long long e = blk / (ncb * nrb);
    const long long b = e / nh, h = e % nh;
    const int t = threadIdx.x;
    const long long r = rb * MASK_BLOCK + (t >> 2);
    const long long c0 = cb * MASK_BLOCK + (t & 3) * 16;
    bool any_true = false, all_true = true;
    if (r < sq) {
#pragma unroll 4
        for (int x = 0; x < 16; ++x) {
            const long long c = c0 + x;
            if (c < sk) {
                const bool keep = Hook::mask_mod(b, h, r, c, args);
                any_true = any_true || keep;
                all_true = all_true && keep;
            }
        }
    }
    store_block_kind(out + blk, all_true, any_true);
}

// A mask_mod's ranges from its summary (UserVariant with BLOCKS, VariantParams::mod_ranges), one
// int32 record per summary entry of `stride` ints: first, per 64-row block (nrb of them), four
// int32 (cuflash_hook_ranges):
//   [lo, hi) = [64 c0, min(Sk, 64 (c1 + 1))), c0 / c1 the first / last block that is not HIDDEN,
//              or (0x7fffffff, 0) where every block is: the keys the row block may see;
//   [klo, khi) = the longest run of KEPT blocks (the first of equal ones) in the same units, or
//              (0, 0) where no block is KEPT: keys every row of the block sees;
// then, at 4 nrb, per 64-key block two int32 (cuflash_hook_col_ranges): [rlo, rhi) = [64 r0,
// min(Sq, 64 (r1 + 1))), r0 / r1 the first / last row block whose block in that column is not
// HIDDEN, or (0x7fffffff, 0): the rows that may see the key block (the backwards' row_range).
// One thread per row block (ncb <= a few thousand bytes), resp. per key block.
__global__ void __launch_bounds__(128)
cuflash_hook_ranges(const unsigned char* __restrict__ blocks, int* __restrict__ ranges,
                    long long rows, long long ncb, long long sk, long long nrb, long long stride) {
    const long long r = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const unsigned char* row = blocks + r * ncb;
    long long c0 = -1, c1 = -1;
    long long run0 = 0, best0 = 0, best = 0;   // the current run of KEPT blocks starts at run0
#pragma unroll 1
    for (long long c = 0; c < ncb; ++c) {
        const unsigned char k = row[c];
        if (k != MASK_BLOCK_HIDDEN) {
            if (c0 < 0) c0 = c;
            c1 = c;
        }
        if (k != MASK_BLOCK_KEPT) {
            run0 = c + 1;
        } else if (c + 1 - run0 > best) {
            best = c + 1 - run0;
            best0 = run0;
        }
    }
    int* out = ranges + (r / nrb) * stride + 4 * (r % nrb);
    out[0] = c0 < 0 ? 0x7fffffff : static_cast<int>(c0 * MASK_BLOCK);
    out[1] = c0 < 0 ? 0 : static_cast<int>(min(sk, (c1 + 1) * MASK_BLOCK));
    out[2] = best == 0 ? 0 : static_cast<int>(best0 * MASK_BLOCK);
    out[3] = best == 0 ? 0 : static_cast<int>(min(sk, (best0 + best) * MASK_BLOCK));
}

__global__ void __launch_bounds__(128)
cuflash_hook_col_ranges(const unsigned char* __restrict__ blocks, int* __restrict__ ranges,
                        long long cols, long long nrb, long long ncb, long long sq,
                        long long stride) {
    const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= cols) return;
    const long long e = i / ncb, c = i % ncb;
    const unsigned char* col = blocks + e * nrb * ncb + c;
    long long r0 = -1, r1 = -1;
#pragma unroll 1
    for (long long r = 0; r < nrb; ++r) {
        if (col[r * ncb] != MASK_BLOCK_HIDDEN) {
            if (r0 < 0) r0 = r;
            r1 = r;
        }
    }
    int* out = ranges + e * stride + 4 * nrb + 2 * c;
    out[0] = r0 < 0 ? 0x7fffffff : static_cast<int>(r0 * MASK_BLOCK);
    out[1] = r0 < 0 ? 0 : static_cast<int>(min(sq, (r1 + 1) * MASK_BLOCK));
}

}  // namespace cuflash
