// attn_mma.cu: tensor-core forward kernel for float16 / bfloat16 / float32 (sm_80 and later).
//
// Variants (kernels_cu/variants.cuh, notes/VARIANTS.md): the body takes the policy V as a template
// parameter. cuflash_fwd_mma is the plain policy (one argument; the code it had before policies,
// checked on the SASS: benchmarks/sass_counts.py); cuflash_fwd_mma_var<..., V> takes VariantParams
// as a second argument. The window narrows the key tiles a block visits (key_range); on each tile
// the scores are scaled, transformed and, on partial tiles (tile_kind, the causal diagonal, the key
// tail), masked by the policy where they sit in registers (variant_scores); the softmax then runs
// in scaled units. Partial tiles of a policy that hides keys take the non-finite V scan.
//
// Version 3: float32 operands (T = float) through TF32 mma.sync m16n8k8, with TERMS = 3 products
// (split precision, float32-accurate: common.cuh, Tf32Split) or TERMS = 1 (one-pass TF32). The
// structure (tiles, cp.async pipeline, online softmax, epilogue) is the 16-bit kernel's; what
// differs is how fragments reach the tensor cores: float32 tiles sit in shared memory as they are,
// each lane reads its fragment values with 16-byte (Q, K) or 4-byte (V) loads and rounds or splits
// them to TF32 in registers, and the products follow (see "float32 operands" below). With TERMS = 3
// the large product of every k8 step (hi * hi) is promoted, i.e. formed from a zeroed accumulator
// and added to S, or to O, in IEEE float32, rather than chained through the tensor cores' float32
// accumulation, which truncates: in the scores everywhere, in P.V from sm_90 on (on sm_80 P.V's
// large products chain from zero over one key tile). The small cross products of each tile's P.V
// go to fresh accumulators added to O after the tile (Mma32Ops::PROMOTE; notes/FLOAT32.md).
//
// Version 4: float32 "highest" in the fp16-split form (OP = fp16_t, "3xfp16"; fp16split.cuh,
// notes/FLOAT32.md: "mma.sync 3xfp16"): every tile scaled by a power of two of its own and split
// in place in shared memory into fp16 hi and lo halves (split16_block), then the 16-bit kernel's
// ldmatrix reads and three m16n8k16 fp16 products per multiply-add (Mma16SplitOps): half the
// tensor-core instructions of 3xTF32's m16n8k8 and a quarter of its conversions. OP = T (every
// other instantiation) is the code it was.
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
// float32 operands. m16n8k8 TF32 fragments (g = lane / 4, t4 = lane % 4): A holds rows g, g + 8
// and k columns t4, t4 + 4; B (= K^T for the scores) keys g and k rows t4, t4 + 4. Since a dot
// product does not depend on the order of its terms, each 16-column block of Q and K is read in a
// permuted order: lane t4 takes physical columns 4 t4 .. 4 t4 + 3 as (step 0: t4, t4 + 4; step 1:
// t4, t4 + 4), one 16-byte load per row and block. Likewise the keys of each k8 step of P.V are
// permuted so that P's accumulator fragment is its A fragment as it stands (logical k t4 <-> key
// 2 t4, k t4 + 4 <-> key 2 t4 + 1): lane (g, t4) reads V rows 2 t4 and 2 t4 + 1 at column g. Row
// strides keep both access patterns free of bank conflicts (MmaConfig: SQK, SV).
// Cost per k8 step and n8 tile: TERMS tensor-core products; each operand value is converted once
// per warp that uses it (cvt.rna.tf32, and for TERMS = 3 a subtraction and a second cvt).
//
// Requirements checked on the host (cuflash/_dispatch.py): D == Dv, D % 8 == 0 (16-bit) or
// D % 4 == 0 (float32), D <= DPAD, every row of q, k, v, o 16-byte aligned. Head dims below DPAD
// are zero-padded in shared memory.
#include "common.cuh"
#include "fp16split.cuh"
#include "variants.cuh"

namespace cuflash {

template <typename T, int DPAD, int BN, int NWARPS, int MT, bool F16S_ = false>
struct MmaConfig {
    static constexpr bool F32 = sizeof(T) == 4;   // float32 operands (TF32 or fp16-split products)
    // float32 through fp16-split products (OP = fp16_t, "3xfp16"; see Mma16SplitOps): every
    // tile lands as float32 and is rewritten in place as fp16 hi and lo halves of each row.
    static constexpr bool F16S = F32 && F16S_;
    static constexpr int BM = 16 * MT * NWARPS;   // query rows per block
    static constexpr int THREADS = 32 * NWARPS;
    // Row strides in elements. 16-bit: +16 bytes per row, so ldmatrix rows hit all banks. float32:
    // Q and K rows are read as 16-byte vectors by lanes (g, t4) at row g, word 4 t4; a stride of
    // 16 (mod 32) words puts the 8 lanes of each quarter-warp phase on distinct banks. V is read as
    // words at rows 2 t4 and 2 t4 + 1, column g: a stride of 4 (mod 16) words does the same.
    // F16S: every tile DPAD + 4 words a row (4 DPAD + 16 bytes, 16 mod 128), so that the fp16
    // rows of its hi and lo halves are ldmatrix rows free of bank conflicts, as the 16-bit
    // kernel's.
    static constexpr int SQK = F16S ? DPAD + 4 : F32 ? DPAD + 16 : DPAD + 8;
    static constexpr int SV = F32 ? DPAD + 4 : DPAD + 8;
    static constexpr int EPC = 16 / static_cast<int>(sizeof(T));  // elements per 16-byte chunk
    static constexpr int CHUNKS = DPAD / EPC;      // 16-byte chunks per row
    static constexpr int NT_S = BN / 8;            // n8 tiles of scores per m-tile
    static constexpr int NT_O = DPAD / 8;          // n8 tiles of output per m-tile
    // float32, TERMS = 3: the per-tile P.V accumulators (large and small products) cover OG n8
    // tiles of O at a time: 8 (64 columns, 64 more registers) where O itself is small, 4 from
    // D = 128 on, where the O accumulators take 64 or more registers.
    static constexpr int OG = NT_O >= 16 ? 4 : NT_O % 8 == 0 ? 8 : NT_O % 6 == 0 ? 6 : 4;
    // float32, TERMS = 3: the scores' small cross products get their own accumulators (BN / 2
    // more registers) except at D = 256, where O's 128 registers leave no room for them.
    static constexpr bool SPLIT_S = DPAD <= 192;
    static constexpr int SMEM_ELEMS = (BM + BN) * SQK + BN * SV;
    // F16S: 2 NWARPS words after the tiles for the block's max reductions (split16_block).
    static constexpr int RED_WORDS = F16S ? 2 * NWARPS : 0;
    static_assert(DPAD % 16 == 0 && BN % 16 == 0, "tile shapes must be multiples of 16");
    static_assert(!F32 || DPAD % 32 == 0, "float32 head-dim buckets are multiples of 32");
    static_assert(NT_O % OG == 0, "output groups must tile the head dim");
};

// load_tile: common.cuh (shared with the tensor-core backward, attn_bwd_mma.cu).

// ---- the products of one K/V tile, 16-bit operands (ldmatrix + mma.sync m16n8k16).
template <typename T, int DPAD, int BN, int NWARPS, int MT>
struct Mma16Ops {
    using Cfg = MmaConfig<T, DPAD, BN, NWARPS, MT>;
    // Per-lane ldmatrix row addresses. A operand (Q rows): matrices (rows 0-7 | 8-15) x
    // (k 0-7 | 8-15). B from K (non-transposed): (keys 0-7 | 8-15 -> two n-tiles) x (k 0-7 | 8-15).
    // B from V (transposed): (keys 0-7 | 8-15) x (d 0-7 | 8-15 -> two n-tiles).
    unsigned int q_base, k_base, v_base;
    __device__ __forceinline__ Mma16Ops(const T* q_s, const T* k_s, const T* v_s, int warp,
                                        int lane) {
        const int lr = lane % 8, lm = lane / 8;
        q_base = smem_addr(q_s + (warp * MT * 16 + lr + 8 * (lm % 2)) * Cfg::SQK + 8 * (lm / 2));
        k_base = smem_addr(k_s + (lr + 8 * (lm / 2)) * Cfg::SQK + 8 * (lm % 2));
        v_base = smem_addr(v_s + (lr + 8 * (lm % 2)) * Cfg::SV + 8 * (lm / 2));
    }
    // S = Q K_j^T: MT x (16 x BN) per warp; each K fragment feeds MT products.
    __device__ __forceinline__ void scores(float (&s)[MT][Cfg::NT_S][4]) const {
#pragma unroll
        for (int kk = 0; kk < DPAD / 16; ++kk) {
            unsigned int a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                ldmatrix_x4(q_base + (mt * 16 * Cfg::SQK + kk * 16) * 2, a[mt][0], a[mt][1],
                            a[mt][2], a[mt][3]);
#pragma unroll
            for (int nn = 0; nn < BN / 16; ++nn) {
                unsigned int b0, b1, b2, b3;
                ldmatrix_x4(k_base + (nn * 16 * Cfg::SQK + kk * 16) * 2, b0, b1, b2, b3);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    Mma<T>::run(s[mt][2 * nn], a[mt], b0, b1);
                    Mma<T>::run(s[mt][2 * nn + 1], a[mt], b2, b3);
                }
            }
        }
    }
    // O += P V_j: P (16 x BN per m-tile, packed to 16 bits) from registers as A operands, V_j
    // from shared memory; each V fragment feeds MT products.
    __device__ __forceinline__ void pv(float (&acc_o)[MT][Cfg::NT_O][4],
                                       const unsigned int (&pk)[MT][BN / 16][4]) const {
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
#pragma unroll
            for (int nn = 0; nn < DPAD / 16; ++nn) {
                unsigned int b0, b1, b2, b3;
                ldmatrix_x4_trans(v_base + (kk * 16 * Cfg::SV + nn * 16) * 2, b0, b1, b2, b3);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    Mma<T>::run(acc_o[mt][2 * nn], pk[mt][kk], b0, b1);
                    Mma<T>::run(acc_o[mt][2 * nn + 1], pk[mt][kk], b2, b3);
                }
            }
        }
    }
};

// ---- the products of one K/V tile, float32 operands (TF32 mma.sync m16n8k8; see the header).
template <int TERMS, int DPAD, int BN, int NWARPS, int MT>
struct Mma32Ops {
    using Cfg = MmaConfig<float, DPAD, BN, NWARPS, MT>;
    using Split = Tf32Split<TERMS>;
    // TERMS = 3: every k8 step's large product (hi * hi) is promoted, i.e. formed in a zeroed
    // fragment and added to its accumulator (the scores; O for P.V) in IEEE float32, in both
    // products (common.cuh: mma_f32). Chained through the tensor cores' truncating
    // accumulation instead, the D / 8 steps of the scores made the kernel 2-6x less accurate than
    // naive float32 on short rows (H200; notes/FLOAT32.md has the model and the numbers).
    // TERMS = 1 (one-pass TF32, 2^-11 operand rounding) keeps the plain chain. P.V is promoted
    // from sm_90 on: for sm_80 ptxas then kept many products' fragments live (D = 64: 172 -> 255
    // registers, spills at D = 64 and 96), so there P.V keeps the per-tile chain from zero, whose
    // error the model puts a little above the promoted form's (notes/FLOAT32.md).
    static constexpr bool PROMOTE = TERMS == 3;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
    static constexpr bool PROMOTE_PV = false;
#else
    static constexpr bool PROMOTE_PV = PROMOTE;
#endif
    const float* q_lane;  // this lane's first Q word: row warp * MT * 16 + g, word 4 t4
    const float* k_lane;  // key g, word 4 t4
    const float* v_lane;  // key 2 t4, column g
    __device__ __forceinline__ Mma32Ops(const float* q_s, const float* k_s, const float* v_s,
                                        int warp, int lane) {
        const int g = lane / 4, t4 = lane % 4;
        q_lane = q_s + (warp * MT * 16 + g) * Cfg::SQK + 4 * t4;
        k_lane = k_s + g * Cfg::SQK + 4 * t4;
        v_lane = v_s + 2 * t4 * Cfg::SV + g;
    }
    // S = Q K_j^T. With TERMS = 3 the small cross products go to their own accumulators and are
    // added to the large ones at the end (common.cuh: mma_f32).
    __device__ __forceinline__ void scores(float (&s)[MT][Cfg::NT_S][4]) const {
        constexpr bool SPLIT = TERMS == 3 && Cfg::SPLIT_S;
        float s_small[MT][SPLIT ? Cfg::NT_S : 1][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int i = 0; i < (SPLIT ? Cfg::NT_S : 1); ++i)
#pragma unroll
                for (int e = 0; e < 4; ++e) s_small[mt][i][e] = 0.f;
        // Not unrolled: with every block's loads in view, ptxas hoisted them and ran out of
        // registers (spills at D >= 128); the loop costs one address increment per block.
#pragma unroll 1
        for (int kc = 0; kc < DPAD / 16; ++kc) {
            // A fragments of both k8 steps of this 16-column block: rows g and g + 8.
            Split a[MT][2][4] = {};
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const float4 x = lds128(q_lane + mt * 16 * Cfg::SQK + 16 * kc);
                const float4 y = lds128(q_lane + (mt * 16 + 8) * Cfg::SQK + 16 * kc);
                a[mt][0][0] = Split(x.x); a[mt][0][1] = Split(y.x);
                a[mt][0][2] = Split(x.y); a[mt][0][3] = Split(y.y);
                a[mt][1][0] = Split(x.z); a[mt][1][1] = Split(y.z);
                a[mt][1][2] = Split(x.w); a[mt][1][3] = Split(y.w);
            }
#pragma unroll
            for (int nt = 0; nt < Cfg::NT_S; ++nt) {
                const float4 kb = lds128(k_lane + nt * 8 * Cfg::SQK + 16 * kc);
                const Split b00(kb.x), b01(kb.y), b10(kb.z), b11(kb.w);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    // Without SPLIT the small products go into the scores' own chain.
                    float(&sm)[4] = SPLIT ? s_small[mt][SPLIT ? nt : 0] : s[mt][nt];
                    mma_f32<TERMS, PROMOTE>(s[mt][nt], sm, a[mt][0], b00, b01);
                    mma_f32<TERMS, PROMOTE>(s[mt][nt], sm, a[mt][1], b10, b11);
                }
            }
        }
        if constexpr (SPLIT) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < Cfg::NT_S; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) s[mt][nt][e] += s_small[mt][nt][e];
        }
    }
    // O += P V_j with P the float32 probabilities in the score registers. TERMS = 3: per group of
    // OG output n8 tiles, the tile's small products go to fresh accumulators, added to O with IEEE
    // additions after the tile; the large ones are promoted straight into O (PROMOTE_PV: `big`
    // starts as O, so it takes no registers of its own: sm_90 D = 128 went from 238-244 registers
    // to 221-226). Unpromoted (sm_80), the large products chain from zero through the tile and
    // are added with the small ones. TERMS = 1: straight into O.
    __device__ __forceinline__ void pv(float (&acc_o)[MT][Cfg::NT_O][4],
                                       const float (&p)[MT][Cfg::NT_S][4]) const {
        constexpr int OG = TERMS == 3 ? Cfg::OG : Cfg::NT_O;
#pragma unroll
        for (int og = 0; og < Cfg::NT_O / OG; ++og) {
            float big[MT][OG][4], small[MT][TERMS == 3 ? OG : 1][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int i = 0; i < OG; ++i)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        big[mt][i][e] =
                            TERMS == 3 && !PROMOTE_PV ? 0.f : acc_o[mt][og * OG + i][e];
                        if (TERMS == 3 || i == 0) small[mt][TERMS == 3 ? i : 0][e] = 0.f;
                    }
#pragma unroll
            for (int kk = 0; kk < Cfg::NT_S; ++kk) {
                // A = P's accumulator fragment of score tile kk, keys permuted (see the header).
                Split a[MT][4] = {};
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    a[mt][0] = Split(p[mt][kk][0]);
                    a[mt][1] = Split(p[mt][kk][2]);
                    a[mt][2] = Split(p[mt][kk][1]);
                    a[mt][3] = Split(p[mt][kk][3]);
                }
#pragma unroll
                for (int i = 0; i < OG; ++i) {
                    const float* vp = v_lane + kk * 8 * Cfg::SV + (og * OG + i) * 8;
                    const Split b0(lds32(vp)), b1(lds32(vp + Cfg::SV));
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt)
                        mma_f32<TERMS, PROMOTE_PV>(big[mt][i], small[mt][TERMS == 3 ? i : 0],
                                                a[mt], b0, b1);
                }
            }
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int i = 0; i < OG; ++i)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        if constexpr (TERMS == 3 && PROMOTE_PV)
                            acc_o[mt][og * OG + i][e] = big[mt][i][e] + small[mt][i][e];
                        else if constexpr (TERMS == 3)
                            acc_o[mt][og * OG + i][e] += big[mt][i][e] + small[mt][i][e];
                        else
                            acc_o[mt][og * OG + i][e] = big[mt][i][e];
                    }
        }
    }
};

// ---- the products of one K/V tile, float32 operands in the fp16-split form (OP = fp16_t,
// "3xfp16"; fp16split.cuh, notes/FLOAT32.md: "fp16 split" and "mma.sync 3xfp16").
// Every tile (Q once per block, each K and V tile) lands as float32 and is rewritten in place by
// split16_block: row r's first 2 DPAD bytes become the fp16 hi parts of x 2^e, the next 2 DPAD
// bytes the lo parts (e: one power of two per tile). The consumers are the 16-bit kernel's
// ldmatrix reads (V transposed by ldmatrix.trans) on the hi and the lo rows, three m16n8k16 fp16
// products per multiply-add (hi hi, hi lo, lo hi; lo lo, 2^-22 of the product, is dropped):
// - S: each k16 step's hi hi product is formed from a zeroed fragment and added to S in IEEE
//   float32 (promoted: the tensor cores' accumulation truncates; notes/FLOAT32.md), the small
//   ones chain over the tile in s2; S = (S + s2) 2^-(eq + ek) (scale_pow2: exact);
// - P V: P (<= 2^8) split as P 2^P16_LOG2 in registers (pack_p_f16split); per k16 step and n8
//   tile of O the hi hi product from zero is added to the tile's sum in IEEE float32, the small
//   ones chain over the tile per group of OG n8 tiles; after the tile both go into O through one
//   FFMA by 2^-(P16_LOG2 + ev) (a power of two: exact).
template <int DPAD, int BN, int NWARPS, int MT>
struct Mma16SplitOps {
    using Cfg = MmaConfig<float, DPAD, BN, NWARPS, MT, true>;
    static_assert(Cfg::SQK == Cfg::SV, "one row stride for every split tile");
    static constexpr unsigned int RS = Cfg::SQK * 4;  // row stride in bytes
    static constexpr unsigned int LO = DPAD * 2;      // the lo half of a row, in bytes
    // Per-lane ldmatrix row addresses (bytes), as in Mma16Ops.
    unsigned int q_base, k_base, v_base;
    // The three products of one k16 step and n8 tile: the large one (a_hi b_hi) into t from zero
    // (the caller promotes it), the small ones (a_hi b_lo, a_lo b_hi) chained in `small`.
    static __device__ __forceinline__ void step(float (&t)[4], float (&small)[4],
                                                const unsigned int (&ah)[4],
                                                const unsigned int (&al)[4], const unsigned int* bh,
                                                const unsigned int* bl) {
#pragma unroll
        for (int e = 0; e < 4; ++e) t[e] = 0.f;
        Mma<fp16_t>::run(t, ah, bh[0], bh[1]);
        Mma<fp16_t>::run(small, ah, bl[0], bl[1]);
        Mma<fp16_t>::run(small, al, bh[0], bh[1]);
    }
    // The hi and lo fragments of one ldmatrix position (x4; TRANS: ldmatrix.trans, for V).
    template <bool TRANS>
    static __device__ __forceinline__ void ld_split(unsigned int addr, unsigned int (&hi)[4],
                                                    unsigned int (&lo)[4]) {
        if constexpr (TRANS) {
            ldmatrix_x4_trans(addr, hi[0], hi[1], hi[2], hi[3]);
            ldmatrix_x4_trans(addr + LO, lo[0], lo[1], lo[2], lo[3]);
        } else {
            ldmatrix_x4(addr, hi[0], hi[1], hi[2], hi[3]);
            ldmatrix_x4(addr + LO, lo[0], lo[1], lo[2], lo[3]);
        }
    }
    __device__ __forceinline__ Mma16SplitOps(const float* q_s, const float* k_s, const float* v_s,
                                             int warp, int lane) {
        const int lr = lane % 8, lm = lane / 8;
        q_base = smem_addr(q_s) + (warp * MT * 16 + lr + 8 * (lm % 2)) * RS + 16 * (lm / 2);
        k_base = smem_addr(k_s) + (lr + 8 * (lm / 2)) * RS + 16 * (lm % 2);
        v_base = smem_addr(v_s) + (lr + 8 * (lm % 2)) * RS + 16 * (lm / 2);
    }
    // S = Q K_j^T of the inputs (s: zero on entry); e_qk = eq + ek.
    __device__ __forceinline__ void scores(float (&s)[MT][Cfg::NT_S][4], int e_qk) const {
        float s2[MT][Cfg::NT_S][4] = {};  // the small products
        // Not unrolled (as Mma32Ops::scores): with every step's loads in view ptxas hoisted them
        // (D = 128: 255 registers and spills).
#pragma unroll 1
        for (int kk = 0; kk < DPAD / 16; ++kk) {
            unsigned int ah[MT][4], al[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                ld_split<false>(q_base + mt * 16 * RS + kk * 32, ah[mt], al[mt]);
#pragma unroll
            for (int nn = 0; nn < BN / 16; ++nn) {
                unsigned int bh[4], bl[4];  // keys 16 nn .. (two n8 tiles) x k 16 kk ..
                ld_split<false>(k_base + nn * 16 * RS + kk * 32, bh, bl);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        float t[4];
                        step(t, s2[mt][2 * nn + h], ah[mt], al[mt], bh + 2 * h, bl + 2 * h);
#pragma unroll
                        for (int e = 0; e < 4; ++e) s[mt][2 * nn + h][e] += t[e];
                    }
            }
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            float(&flat)[Cfg::NT_S * 4] = reinterpret_cast<float(&)[Cfg::NT_S * 4]>(s[mt]);
#pragma unroll
            for (int i = 0; i < Cfg::NT_S; ++i)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[mt][i][e] += s2[mt][i][e];
            scale_pow2(flat, -e_qk);  // exact: S of x, not of x 2^e
        }
    }
    // O += P V_j with P the float32 probabilities in the score registers, V_j 2^ev in shared
    // memory.
    __device__ __forceinline__ void pv(float (&acc_o)[MT][Cfg::NT_O][4],
                                       const float (&p)[MT][Cfg::NT_S][4], int ev) const {
        // TILE_SUM: each k16 step's large product is added to the tile's sum in IEEE float32
        // and O takes the tile in one FFMA (one rounding of O a tile); promoting each step
        // straight into O rounded it BN / 16 + 1 times, about twice the error on long rows
        // (notes/FLOAT32.md, "O rounded once per tile"). From D = 192 on (BN = 32 and 16: two
        // steps and one a tile) the sum's registers spilled, so each step goes into O there
        // (the same at D = 256, one step a tile; one rounding more at D = 192).
        constexpr bool TILE_SUM = DPAD <= 128;
        // Groups of OG n8 tiles of O: the tile's large and small products of a group take
        // 2 MT OG 4 registers, so at D = 128 (O: 64) a group is two n8 tiles.
        constexpr int OG = TILE_SUM && DPAD >= 128 ? 2 : Cfg::OG;
        static_assert(OG % 2 == 0, "ldmatrix.trans gives two n8 tiles of V");
        unsigned int ph[MT][BN / 16][4], pl[MT][BN / 16][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) pack_p_f16split<Cfg::NT_S>(p[mt], ph[mt], pl[mt]);
        const float f = pow2f(-(P16_LOG2 + ev));  // 2^-133 .. 2^107
#pragma unroll
        for (int og = 0; og < Cfg::NT_O / OG; ++og) {
            // A scheduling fence (f is never 0, but neither compiler knows it): ptxas does not
            // move instructions across a branch, so each group's V loads and products stay in
            // the group. Without it ptxas issued the later groups' loads and from-zero products
            // early: 255 registers and spills at D = 128.
            // From DPAD = 96 on the test differs per group (f's bits are never a small integer:
            // f >= 2^-133, bits >= 2^16): the same test in every group was merged into one (one
            // branch before the first group) and ptxas issued 12 of the V ldmatrix loads of later
            // groups at once (spills; DPAD = 192). At DPAD = 96 with the tile sum, NVRTC 13.0 (the
            // GPU machine's) gave the causal form without staged O 255 registers and 88 B of
            // spills with the merged test; 225-232 registers under 13.0 and 13.5 with this one.
            if (DPAD >= 96 ? __float_as_uint(f) == static_cast<unsigned int>(og) : f == 0.f)
                asm volatile("trap;");
            float small[MT][OG][4] = {};              // the tile's small products of this group
            float big[MT][TILE_SUM ? OG : 1][4];      // TILE_SUM: its large products' sum
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk) {
#pragma unroll
                for (int n2 = 0; n2 < OG / 2; ++n2) {
                    const int nt = og * OG + 2 * n2;  // first of the two n8 tiles of O
                    unsigned int bh[4], bl[4];  // keys 16 kk .. x columns 8 nt .. (two n8 tiles)
                    ld_split<true>(v_base + kk * 16 * RS + nt * 16, bh, bl);
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            float t[4];
                            step(t, small[mt][2 * n2 + h], ph[mt][kk], pl[mt][kk], bh + 2 * h,
                                 bl + 2 * h);
                            if constexpr (TILE_SUM) {
                                float(&b)[4] = big[mt][2 * n2 + h];
#pragma unroll
                                for (int e = 0; e < 4; ++e) b[e] = kk == 0 ? t[e] : b[e] + t[e];
                            } else {
#pragma unroll
                                for (int e = 0; e < 4; ++e)
                                    acc_o[mt][nt + h][e] = fmaf(t[e], f, acc_o[mt][nt + h][e]);
                            }
                        }
                }
            }
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int i = 0; i < OG; ++i)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        float tile = small[mt][i][e];
                        if constexpr (TILE_SUM) tile = big[mt][i][e] + tile;
                        acc_o[mt][og * OG + i][e] = fmaf(tile, f, acc_o[mt][og * OG + i][e]);
                    }
        }
    }
};

// split16_block (a float32 tile split in place into fp16 hi and lo rows): fp16split.cuh.

// ---- P.V of a masked tile whose V holds a NaN or an infinity.
// Under the causal mask some rows do not see some keys of a tile; their P is 0 there, but a
// tensor-core product still adds 0 * NaN = NaN (and 0 * inf) to those rows, where the mathematical
// answer, and the float64 reference's, is that a key a row cannot see does not touch it. The
// kernel finds such tiles (a scan of V from the first key the block's first row does not see,
// tile_has_nonfinite) and computes their P.V here instead, in float32 scalar arithmetic over the
// keys each row sees: NaN and inf then reach exactly the rows that see them. It is the rare path
// (a non-finite value in V on a diagonal tile), written for few registers, not speed: each warp
// parks its P (as the product would take it: 16-bit P for 16-bit inputs) in its own Q rows of
// shared memory, which only it reads, KC keys at a time, and the block reloads Q afterwards.
// `ps` is this warp's m-tile scratch (16 rows of SP elements of P's type PT).
// `vis(h, key)`: the variant's visibility of key (< Sk) for half h's row (true: plain).
template <int NT_O, int KC, int SP, int SV, bool CAUSAL, typename T, typename PT, typename RowOf,
          typename Vis>
__device__ __forceinline__ void pv_visible_keys(float (&acc_o)[NT_O][4], const PT* ps,
                                                const T* v_s, int key0, int sk, int diag,
                                                RowOf row_of, Vis vis, int g, int t4) {
#pragma unroll 1
    for (int j = 0; j < KC; ++j) {
        const float p0 = to_float(ps[g * SP + j]), p1 = to_float(ps[(g + 8) * SP + j]);
        const int key = key0 + j;
        bool vis0 = key < sk, vis1 = key < sk;
        if (CAUSAL) {
            vis0 = vis0 && key <= row_of(0) + diag;
            vis1 = vis1 && key <= row_of(1) + diag;
        }
        if (vis0) vis0 = vis(0, key);
        if (vis1) vis1 = vis(1, key);
        const T* vrow = v_s + j * SV + 2 * t4;
#pragma unroll
        for (int nt = 0; nt < NT_O; ++nt) {
            float x[2];  // this lane's two columns of n8 tile nt, one load
            if constexpr (sizeof(T) == 4) {
                const float2 w = *reinterpret_cast<const float2*>(vrow + nt * 8);
                x[0] = w.x;
                x[1] = w.y;
            } else {
                const unsigned int w = *reinterpret_cast<const unsigned int*>(vrow + nt * 8);
                x[0] = unpack_half<T>(w, false);
                x[1] = unpack_half<T>(w, true);
            }
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                if (vis0) acc_o[nt][e] += p0 * x[e];
                if (vis1) acc_o[nt][2 + e] += p1 * x[e];
            }
        }
    }
}

// Whether rows [row_from, ROWS) of a tile (row stride STRIDE elements, CHUNKS 16-byte chunks a
// row) in shared memory hold a NaN or an infinity, over this thread's share of the chunks.
template <typename T, int ROWS, int CHUNKS, int STRIDE, int THREADS>
__device__ __forceinline__ bool tile_has_nonfinite(const T* smem, int row_from, int tid) {
    constexpr int EPC = 16 / static_cast<int>(sizeof(T));
    bool bad = false;
#pragma unroll 1
    for (int i = row_from * CHUNKS + tid; i < ROWS * CHUNKS; i += THREADS) {
        const uint4 w = *reinterpret_cast<const uint4*>(smem + (i / CHUNKS) * STRIDE +
                                                        (i % CHUNKS) * EPC);
        if constexpr (sizeof(T) == 4)
            bad = bad || nonfinite_word<float>(w.x) || nonfinite_word<float>(w.y) ||
                  nonfinite_word<float>(w.z) || nonfinite_word<float>(w.w);
        else
            bad = bad || nonfinite16<T>(w);
    }
    return bad;
}

// The variant's scores (variant_scores: scale, transform, mask) are in variants.cuh, shared with
// the Hopper forward (attn_wgmma.cu).

template <typename T, int TERMS, int DPAD, int BN, int NWARPS, int MT, bool STAGE_O, bool CAUSAL,
          typename V, typename OP = T>
__device__ __forceinline__ void fwd_mma_body(const AttnParams& p, const VariantParams& vp) {
    constexpr bool F16S = sizeof(T) == 4 && sizeof(OP) == 2;  // the fp16-split form
    using Cfg = MmaConfig<T, DPAD, BN, NWARPS, MT, F16S>;
    static_assert(Cfg::F32 ? (TERMS == 1 || TERMS == 3) : TERMS == 1,
                  "TERMS: 1 for 16-bit operands; 1 (one-pass TF32) or 3 (split) for float32");
    static_assert(sizeof(OP) == sizeof(T) || (F16S && TERMS == 3),
                  "OP: T, or fp16_t for float32's 3xfp16 form");
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* q_s = reinterpret_cast<T*>(smem_raw);
    T* k_s = q_s + Cfg::BM * Cfg::SQK;
    T* v_s = k_s + BN * Cfg::SQK;
    // F16S: words for the tiles' max reductions (split16_block): K and V tiles, then Q.
    [[maybe_unused]] unsigned int* red = reinterpret_cast<unsigned int*>(v_s + BN * Cfg::SV);

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
    // The fp16-split form from DPAD = 192 on (O alone takes DPAD / 2 registers): the K and V
    // base pointers are recomputed from the kernel parameters at each tile's loads instead of
    // held through the loop, where ptxas spilled them (notes/FLOAT32.md, "D = 192 and 256").
    constexpr bool REMAT_KV = F16S && DPAD >= 192;
    const auto k_at = [&]() {
        if constexpr (REMAT_KV)
            return static_cast<const T*>(p.k) + batch_offsets(p, block_coord_again(p).b).k;
        else
            return k;
    };
    // The same for the thread index the tile loads' addresses derive from: read afresh (asm
    // volatile) at each tile, so that ptxas recomputes the per-chunk addresses there instead of
    // holding them through the loop.
    const auto tid_at = [&]() {
        if constexpr (REMAT_KV) {
            unsigned int t;
            asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
            return static_cast<int>(t);
        } else {
            return tid;
        }
    };
    const auto v_at = [&]() {
        if constexpr (REMAT_KV)
            return static_cast<const T*>(p.v) + batch_offsets(p, block_coord_again(p).b).v;
        else
            return v;
    };
    const int sq = static_cast<int>(p.sq), sk = static_cast<int>(p.sk);
    const int row0 = static_cast<int>(bc.mblock) * Cfg::BM;
    const int d = static_cast<int>(p.d);
    const int diag = sk - sq;  // row i sees keys j <= i + diag

    int n_tiles = (keys_needed<CAUSAL>(row0, Cfg::BM, sq, sk) + BN - 1) / BN;
    const int masked_from = first_masked_tile<CAUSAL>(row0, BN, sq, sk);
    // The variant's policy, bound to the block's batch entry; its window narrows the key tiles
    // the block visits to [j_first, n_tiles) (a window of w keys costs ~ Sq * w).
    V var;
    int j_first = 0;
    if constexpr (!V::PLAIN) {
        const unsigned int ub = static_cast<unsigned int>(bc.b);
        const unsigned int n2 = static_cast<unsigned int>(p.nb2);
        const unsigned int n1 = static_cast<unsigned int>(p.nb1);
        var.bind(vp, p.sq, p.sk, (ub / n2) / n1, (ub / n2) % n1, ub % n2);
        long long j0, j1;
        var.key_range(row0, min(row0 + Cfg::BM, sq), j0, j1, p.sk);
        n_tiles = min(n_tiles, static_cast<int>((j1 + BN - 1) / BN));
        j_first = static_cast<int>(j0 / BN);
    }

    load_tile<Cfg::BM, Cfg::CHUNKS, Cfg::SQK, Cfg::THREADS>(q_s, q, p.q_sr, row0, sq, d, tid);
    if constexpr (F16S) cp_async_commit();  // Q alone, split before K_0 lands
    if (j_first < n_tiles)
        load_tile<BN, Cfg::CHUNKS, Cfg::SQK, Cfg::THREADS>(k_s, k, p.k_sr, j_first * BN, sk, d,
                                                           tid);
    cp_async_commit();
    // F16S: the exponents of the block's Q tile and of the K and V tiles being computed (the
    // split tiles hold x 2^e).
    [[maybe_unused]] int eq = 0, ek = 0, ev = 0;
    if constexpr (F16S) {
        cp_async_wait<1>();
        // Its own words of `red` (the K and V tiles' follow): the first K tile's split may start
        // before every thread has read these; its barriers order Q's writes before the scores.
        split16_block<Cfg::BM, Cfg::CHUNKS, Cfg::SQK, Cfg::THREADS>(q_s, red + NWARPS, tid, eq,
                                                                   false, 0);
    }

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
    // Units of the scores the softmax sees: raw (the scale folded into exp2) on the plain path,
    // scaled on the variant path (variant_scores).
    const float scale_log2 = softmax_units_log2<V>(p.scale_log2);
    using Ops = typename Select<
        F16S, Mma16SplitOps<DPAD, BN, NWARPS, MT>,
        typename Select<Cfg::F32, Mma32Ops<TERMS, DPAD, BN, NWARPS, MT>,
                        Mma16Ops<T, DPAD, BN, NWARPS, MT>>::type>::type;
    const Ops ops(q_s, k_s, v_s, warp, lane);

    for (int j = j_first; j < n_tiles; ++j) {
        const int key0 = j * BN;
        cp_async_wait<0>();
        if constexpr (F16S) {
            // K_j landed (this thread's chunks); split16_block's barrier: every thread's, and
            // every warp is done with V_{j-1}. The split, then a barrier before the scores.
            split16_block<BN, Cfg::CHUNKS, Cfg::SQK, Cfg::THREADS>(k_s, red, tid, ek, false, 0);
        } else {
            __syncthreads();  // K_j (and Q) landed; every warp is done with V_{j-1}
        }
        load_tile<BN, Cfg::CHUNKS, Cfg::SV, Cfg::THREADS>(v_s, v_at(), p.v_sr, key0, sk, d,
                                                          tid_at());
        cp_async_commit();
        if constexpr (F16S) __syncthreads();  // K_j's hi and lo rows are written

        float s[MT][Cfg::NT_S][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int i = 0; i < Cfg::NT_S; ++i)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[mt][i][e] = 0.f;
        if constexpr (F16S)
            ops.scores(s, eq + ek);
        else
            ops.scores(s);

        // Mask (on tiles from masked_from on), then the online softmax of the thread's rows and
        // the lazy rescale of O (common.cuh: softmax_step). 16-bit: P then goes to 16 bits right
        // away, in the A-operand layout of the P.V product: it halves the registers P occupies
        // while V_j is awaited. float32: P stays in the score registers.
        const bool need_mask = j >= masked_from;
        // Variants: the tile's kind by position (TILE_PARTIAL: a window edge or a mask; a
        // non-empty one, as [j_first, n_tiles) holds no empty tile).
        [[maybe_unused]] bool var_partial = false;
        if constexpr (!V::PLAIN)
            var_partial = var.tile_kind(row0, min(row0 + Cfg::BM, sq), key0, key0 + BN) ==
                          TILE_PARTIAL;
        [[maybe_unused]] unsigned int pk[MT][Cfg::F32 ? 1 : BN / 16][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            float alpha[2];
            if constexpr (!V::PLAIN) {
                // softcap_fast unless float32 at float32 accuracy (TERMS = 3: tanhf).
                variant_scores<Cfg::NT_S, CAUSAL, TERMS == 1>(
                    s[mt], var, need_mask || var_partial, key0, t4, sq, sk, row_of(mt, 0), diag,
                    static_cast<float>(p.scale));
            }
            // One-pass TF32 takes every rescale (LAZY = false: common.cuh, RESCALE_LOG2).
            softmax_step<Cfg::NT_S, CAUSAL, !(Cfg::F32 && TERMS == 1)>(
                s[mt], m_run[mt], l_run[mt], alpha, V::PLAIN && need_mask, key0, t4, sk,
                row_of(mt, 0), diag, scale_log2);
            rescale_rows<Cfg::NT_O>(acc_o[mt], alpha);
            if constexpr (!Cfg::F32) pack_p<T, Cfg::NT_S>(s[mt], pk[mt]);
        }

        cp_async_wait<0>();
        // V_j landed; every warp is done with K_j. Under the causal mask, a tile with keys that
        // some row of the block does not see (from hidden on) is also scanned for NaN and
        // infinities in V there (the OR over the block is the barrier): see pv_visible_keys.
        // (Keys past Sk arrive as zeros, so without the causal mask every real key is seen by
        // every row and no tile needs the scan.)
        // A variant that hides keys (window, mask) scans every partial tile from its first key.
        bool v_nonfinite = false;
        const int hidden = row0 + diag + 1 - key0;  // first key of the tile row0 does not see
        const bool var_scan = V::MASKS && var_partial;
        const bool scan_v = (CAUSAL && hidden < BN) || var_scan;
        if constexpr (F16S) {
            // The scan over this thread's chunks of V_j, the barrier of the max reduction, and
            // (a finite tile) V_j's split; a tile the scan flags stays float32.
            v_nonfinite = split16_block<BN, Cfg::CHUNKS, Cfg::SV, Cfg::THREADS>(
                v_s, red, tid, ev, scan_v, hidden > 0 && !var_scan ? hidden : 0);
        } else if (scan_v) {
            v_nonfinite = __syncthreads_or(tile_has_nonfinite<T, BN, Cfg::CHUNKS, Cfg::SV,
                                                              Cfg::THREADS>(
                              v_s, hidden > 0 && !var_scan ? hidden : 0, tid)) != 0;
        } else {
            __syncthreads();
        }
        const auto load_next_k = [&]() {
            if (j + 1 < n_tiles) {
                load_tile<BN, Cfg::CHUNKS, Cfg::SQK, Cfg::THREADS>(k_s, k_at(), p.k_sr, key0 + BN,
                                                                   sk, d, tid_at());
                cp_async_commit();
            }
        };
        if (!v_nonfinite) load_next_k();
        if (F16S && !v_nonfinite) __syncthreads();  // V_j's hi and lo rows are written
        if (v_nonfinite) {
            // The rare tile of pv_visible_keys (block-uniform: the scan's OR). K_j's buffer is
            // free (the next K tile is requested after this), and each warp parks its P there,
            // in a region of its own, KC keys at a time.
            using PT = typename Select<Cfg::F32, float, T>::type;  // P as the product takes it
            constexpr int REGION = BN * Cfg::SQK * static_cast<int>(sizeof(T)) / NWARPS;  // bytes
            // Row stride of P, even: its float2 / 4-byte stores stay aligned (an odd one, as
            // 3xfp16 at D = 256 with BN = 16 would give, 65 words, faults).
            constexpr int SP = REGION / 16 / static_cast<int>(sizeof(PT)) / 2 * 2;
            constexpr int KC = (SP >= BN ? BN : SP >= 32 && BN % 32 == 0 ? 32 : 16 <= SP ? 16 : 8);
            static_assert(BN % KC == 0 && KC <= SP, "the scratch passes must tile the key tile");
            PT* ps = reinterpret_cast<PT*>(reinterpret_cast<unsigned char*>(k_s) + warp * REGION);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
                for (int c0 = 0; c0 < BN; c0 += KC) {
                    __syncwarp();  // the previous pass's reads are done
#pragma unroll
                    for (int nt = c0 / 8; nt < (c0 + KC) / 8; ++nt)
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            PT* dst = ps + (g + 8 * h) * SP + nt * 8 - c0 + 2 * t4;
                            if constexpr (Cfg::F32)
                                *reinterpret_cast<float2*>(dst) =
                                    make_float2(s[mt][nt][2 * h], s[mt][nt][2 * h + 1]);
                            else
                                *reinterpret_cast<unsigned int*>(dst) =
                                    pk[mt][nt / 2][(nt % 2) * 2 + h];
                        }
                    __syncwarp();
                    pv_visible_keys<Cfg::NT_O, KC, SP, Cfg::SV, CAUSAL>(
                        acc_o[mt], ps, v_s + c0 * Cfg::SV, key0 + c0, sk, diag,
                        [&](int h) { return row_of(mt, h); },
                        [&](int h, int key) {
                            if constexpr (V::MASKS) {
                                const int r = row_of(mt, h);
                                return var.visible_tc(V::READS ? min(r, sq - 1) : r, key);
                            } else {
                                return true;
                            }
                        },
                        g, t4);
                }
            }
            __syncthreads();  // every warp is done with K_j's buffer
            load_next_k();
        } else if constexpr (F16S) {
            ops.pv(acc_o, s, ev);
        } else if constexpr (Cfg::F32) {
            ops.pv(acc_o, s);
        } else {
            ops.pv(acc_o, pk);
        }
    }
    cp_async_wait<0>();  // nothing in flight when the block exits

    // Epilogue: finish the row sums over the quad, divide once, write O and lse (natural log;
    // -inf for a row that saw no key). O's base is formed only now, so it holds no registers
    // through the main loop.
    //
    // STAGE_O: each warp parks its O tile (the output type) in its own Q rows of shared memory
    // (only this warp ever reads them), then writes whole rows with 16-byte coalesced stores
    // instead of 4- or 8-byte stores scattered over 8 rows. The barrier first makes sure no
    // thread's Q copy is still in flight (a block with no key tile never waited for Q).
    const long long b_idx = block_coord_again(p).b;
    T* o = static_cast<T*>(p.o) + batch_offsets(p, b_idx).o;
    T* o_s = q_s + warp * MT * 16 * Cfg::SQK;
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
                p.lse[b_idx * p.sq + row] = row_lse(m_run[mt][h], l, scale_log2);
            }
            if (!STAGE_O && row >= sq) continue;
            T* dst = STAGE_O ? o_s + (mt * 16 + g + 8 * h) * Cfg::SQK
                             : o + static_cast<long long>(row) * p.o_sr;
#pragma unroll
            for (int nt = 0; nt < Cfg::NT_O; ++nt) {
                const int col = nt * 8 + 2 * t4;
                if (STAGE_O || col < d)
                    store2<T>(dst + col, acc_o[mt][nt][2 * h] * inv, acc_o[mt][nt][2 * h + 1] * inv);
            }
        }
    if constexpr (STAGE_O) {
        __syncwarp();
        const int wrow0 = row0 + warp * MT * 16;
#pragma unroll
        for (int i = lane; i < MT * 16 * Cfg::CHUNKS; i += 32) {
            const int r = i / Cfg::CHUNKS, c = i % Cfg::CHUNKS;
            if (wrow0 + r < sq && c * Cfg::EPC < d) {
                *reinterpret_cast<uint4*>(o + static_cast<long long>(wrow0 + r) * p.o_sr +
                                          c * Cfg::EPC) =
                    *reinterpret_cast<const uint4*>(o_s + r * Cfg::SQK + c * Cfg::EPC);
            }
        }
    }
}

// cuflash_fwd_mma: the plain policy (one kernel argument, the code it always had);
// cuflash_fwd_mma_var<..., V>: a variant's policy V (variants.cuh), VariantParams the second
// argument. Both are named instantiations a profiler shows.
template <typename T, int TERMS, int DPAD, int BN, int NWARPS, int MT, int MINB, bool STAGE_O,
          bool CAUSAL, typename OP = T>
__global__ void __launch_bounds__(32 * NWARPS, MINB) cuflash_fwd_mma(const AttnParams p) {
    fwd_mma_body<T, TERMS, DPAD, BN, NWARPS, MT, STAGE_O, CAUSAL, PlainVariant, OP>(
        p, VariantParams{});
}
template <typename T, int TERMS, int DPAD, int BN, int NWARPS, int MT, int MINB, bool STAGE_O,
          bool CAUSAL, typename V>
__global__ void __launch_bounds__(32 * NWARPS, MINB)
cuflash_fwd_mma_var(const AttnParams p, const VariantParams vp) {
    fwd_mma_body<T, TERMS, DPAD, BN, NWARPS, MT, STAGE_O, CAUSAL, V>(p, vp);
}
// cuflash_fwd_mma_varlen: the plain policy on a packed variable-length batch (attention_varlen;
// common.cuh: fwd_varlen_segment), the body on its block's segment view; same template arguments
// and launch configuration as cuflash_fwd_mma, the grid over (sequences, Hkv, G) x query blocks
// of max_seqlen_q rows.
template <typename T, int TERMS, int DPAD, int BN, int NWARPS, int MT, int MINB, bool STAGE_O,
          bool CAUSAL, typename OP = T>
__global__ void __launch_bounds__(32 * NWARPS, MINB)
cuflash_fwd_mma_varlen(const AttnParams p_in, const VarlenParams vl) {
    const AttnParams* p = fwd_varlen_segment_shared<T>(p_in, vl, 16 * MT * NWARPS);
    if (p == nullptr) return;
    fwd_mma_body<T, TERMS, DPAD, BN, NWARPS, MT, STAGE_O, CAUSAL, PlainVariant, OP>(
        *p, VariantParams{});
}

}  // namespace cuflash
