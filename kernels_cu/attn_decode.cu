// attn_decode.cu: decoding attention (few query rows, many keys) for float16 / bfloat16, sm_80+,
// with the query heads of a grouped-query group packed into one tile, the keys split across
// warps and blocks, and K/V read from a dense tensor, a contiguous KV cache or a paged one.
//
// Work split. A block owns MT 16-row tiles (16 MT "packed rows") of one (batch, kv head) entry
// and one split of its keys. Packed row r = i * G + j is query i (< Sq) of query head j (< G) of
// the group, so a K/V tile in shared memory feeds every query head that uses it: K and V are
// read once per group (once per 16 MT rows when G * Sq > 16 MT; MT = 2 takes G = 32 in one
// block). Within the block each of the NWARPS warps walks its own key tiles (tile t of the split
// goes to warp t % NWARPS) with its own two-stage cp.async pipeline: no block-wide barrier in
// the main loop. Per tile a warp computes the (16 MT) x BN scores with mma.sync m16n8k16 (Q by
// ldmatrix from shared memory, each K fragment by ldmatrix once for the MT row tiles), the
// online softmax per row tile (common.cuh: softmax_step), and O += P V (each V fragment by
// ldmatrix.trans once for the MT row tiles).
//
// Epilogue. The warps' states (m, l, O) merge through shared memory in warp order; the block
// then writes either the final o and lse (one split) or a normalised partial (o, lse) in float32
// to the workspace, which `cuflash_decode_combine` merges over the splits in split order with
// the merge operator (merge.cu's rule). Nothing depends on timing: results are bitwise equal
// from run to run for a given split count, which the host derives from the problem and the
// device's SM count only.
//
// Addressing (DecodeParams). Batch entries are up to three collapsed axes (nb0, nb1, nb2) with a
// stride each; the group axis has a stride for q, o and lse (K and V do not move along it).
// KV cache: `seqlens` (int32 per index along axis 1, the sequence) gives each sequence's number
// of keys, and `block_table` (int32, a row of page numbers per sequence) maps key j to page
// block_table[seq][j >> page_log2], row j & (page - 1); the page's first element is
// page * k_page (v_page), its rows k_sr (v_sr) apart, axis 2 (the kv head) k_s2 (v_s2) apart.
// A page holds at least BN keys and BN divides it, so each key tile lies in one page.
// Packed variable-length batches (`cu_q`, `cu_k`, FlashAttention's cu_seqlens): sequence s has
// cu_q[s + 1] - cu_q[s] query rows from row cu_q[s] of q (and o, lse) and cu_k[s + 1] - cu_k[s]
// keys from row cu_k[s] of k and v; sq and sk are then the largest of them, the grid covers
// ceil(G * sq / (16 MT)) row blocks per sequence and the blocks past a sequence's rows exit at
// once.
// Causal masks are bottom-right aligned per sequence: query i sees keys j <= i + Sk_seq - Sq_seq.
#include "common.cuh"

namespace cuflash {

struct DecodeParams {
    const void* q;
    const void* k;
    const void* v;
    void* o;
    float* lse;              // null: no lse wanted (one split only)
    float* o_part;           // (entries, splits, RPAD, DPAD) float32 partial outputs, or null
    float* lse_part;         // (entries, splits, RPAD) partial lse
    const int* seqlens;      // per sequence key counts, or null: every sequence has sk keys
    const int* block_table;  // paged cache, or null
    const int* cu_q;         // packed variable-length batch: query rows of sequence s start at
    const int* cu_k;         // cu_q[s] (keys at cu_k[s]), s = the index along axis 1; or null
    long long sq, sk, d, g;  // queries, keys (max), head dim, query heads per kv head
    long long nb0, nb1, nb2;
    long long q_s0, q_s1, q_s2, q_sg, q_sr;
    long long k_s0, k_s1, k_s2, k_sr;
    long long v_s0, v_s1, v_s2, v_sr;
    long long o_s0, o_s1, o_s2, o_sg, o_sr;
    long long l_s0, l_s1, l_s2, l_sg, l_sr;
    long long n_rtiles;      // 16-row tiles per entry: ceil(G * Sq / 16), padded to MT's multiple
    long long n_splits;      // key splits per (entry, row tile)
    long long split_tiles;   // key tiles of BN per split
    long long page_log2;     // paged: log2(page size); bt_stride: pages per table row
    long long bt_stride;
    long long k_page, v_page;
    double scale_log2;
};
static_assert(sizeof(DecodeParams) == 49 * 8, "DecodeParams must match cuflash/_decode.py");

template <int DPAD, int BN, int NWARPS, int MT = 1, int NS = 2>
struct DecodeConfig {
    static constexpr int S = DPAD + 8;          // row stride (elements): conflict-free ldmatrix
    static constexpr int THREADS = 32 * NWARPS;
    static constexpr int ROWS = 16 * MT;        // packed rows per block: MT m16 row tiles
    static constexpr int NT_S = BN / 8;
    static constexpr int NT_O = DPAD / 8;
    static constexpr int STAGE = 2 * BN * S;    // K then V of one tile, elements
    static constexpr int WARP_ELEMS = NS * STAGE;  // NS stages per warp (2; version 7: 3)
    static constexpr int OS = DPAD + 4;         // float row stride of the epilogue's O
    static_assert(DPAD % 16 == 0 && BN % 16 == 0, "tile shapes are multiples of 16");
    static_assert(MT == 1 || MT == 2, "one or two row tiles per block");
};

struct Entry { long long q, k, v, o, l; int seq, kvh; };

__device__ __forceinline__ Entry entry_offsets(const DecodeParams& p, unsigned int e) {
    const unsigned int n2 = static_cast<unsigned int>(p.nb2), n1 = static_cast<unsigned int>(p.nb1);
    const unsigned int i2 = e % n2, t = e / n2;
    const unsigned int i1 = t % n1, i0 = t / n1;
    Entry r;
    r.q = i0 * p.q_s0 + i1 * p.q_s1 + (long long)i2 * p.q_s2;
    r.k = i0 * p.k_s0 + i1 * p.k_s1 + (long long)i2 * p.k_s2;
    r.v = i0 * p.v_s0 + i1 * p.v_s1 + (long long)i2 * p.v_s2;
    r.o = i0 * p.o_s0 + i1 * p.o_s1 + (long long)i2 * p.o_s2;
    r.l = i0 * p.l_s0 + i1 * p.l_s1 + (long long)i2 * p.l_s2;
    r.seq = static_cast<int>(i1);
    r.kvh = static_cast<int>(i2);
    return r;
}

// A sequence's query rows and keys, moving the entry's offsets to its first row when packed.
struct SeqRange { int sq, sk; };
__device__ __forceinline__ SeqRange seq_range(const DecodeParams& p, Entry& off) {
    SeqRange r{static_cast<int>(p.sq), p.seqlens ? p.seqlens[off.seq] : static_cast<int>(p.sk)};
    if (p.cu_q) {
        const long long q0 = p.cu_q[off.seq];
        r.sq = p.cu_q[off.seq + 1] - static_cast<int>(q0);
        off.q += q0 * p.q_sr;
        off.o += q0 * p.o_sr;
        off.l += q0 * p.l_sr;
    }
    if (p.cu_k) {
        const long long k0 = p.cu_k[off.seq];
        r.sk = p.cu_k[off.seq + 1] - static_cast<int>(k0);
        off.k += k0 * p.k_sr;
        off.v += k0 * p.v_sr;
    }
    return r;
}

// The first K and V rows of the key tile starting at key0 (through page `page` when paged).
template <typename T, bool PAGED>
__device__ __forceinline__ void tile_rows(const DecodeParams& p, const T* k, const T* v, int kvh,
                                          int page, int key0, const T*& kb, const T*& vb) {
    if constexpr (PAGED) {
        const long long in_page = key0 & ((1 << p.page_log2) - 1);
        kb = static_cast<const T*>(p.k) + page * p.k_page + kvh * p.k_s2 + in_page * p.k_sr;
        vb = static_cast<const T*>(p.v) + page * p.v_page + kvh * p.v_s2 + in_page * p.v_sr;
    } else {
        kb = k + key0 * p.k_sr;
        vb = v + key0 * p.v_sr;
    }
}

// One warp's copy of key tile `tile` (BN keys from key0 = tile * BN) of K and V into `dst`
// (K rows then V rows, stride S), zero-filling keys >= sk and columns >= d.
// Paged: `page` is the tile's page number, read ahead by the caller (page_of) so that the
// table's latency is not on the path of the copy. PF256: with the L2::256B prefetch hint.
// EF: under the evict-first L2 policy `pol` (version 5). SW (version 6): rows DPAD apart (a
// multiple of 128 bytes) with the 16-byte chunks of row r XOR-swizzled by r & 7, so the eight
// lanes that copy one 128-byte line of global memory write one aligned 128-byte segment of
// shared memory (the padded rows, DPAD + 8 apart, split it over two segments, and the H200
// measured 1.5x the L2 sector reads of the K/V bytes: notes/INFERENCE.md, "Version 6").
template <typename T, int DPAD, int BN, bool PAGED, bool PF256 = false, bool EF = false,
          bool SW = false>
__device__ __forceinline__ void load_kv_tile(T* dst, const DecodeParams& p, const T* k,
                                             const T* v, int kvh, int page, int tile, int sk,
                                             int d, int lane, unsigned long long pol = 0) {
    using Cfg = DecodeConfig<DPAD, BN, 1>;
    constexpr int EPC = 8, CHUNKS = DPAD / EPC;
    const int key0 = tile * BN;
    const T* kb;
    const T* vb;
    tile_rows<T, PAGED>(p, k, v, kvh, page, key0, kb, vb);
#pragma unroll
    for (int i = lane; i < BN * CHUNKS; i += 32) {
        const int r = i / CHUNKS, c = i % CHUNKS;
        const bool ok = key0 + r < sk && c * EPC < d;
        if constexpr (SW) {
            const int sc = (c ^ (r & 7)) * EPC;
            cp_async16(smem_addr(dst + r * DPAD + sc), ok ? kb + r * p.k_sr + c * EPC : k,
                       ok ? 16 : 0);
            cp_async16(smem_addr(dst + (BN + r) * DPAD + sc), ok ? vb + r * p.v_sr + c * EPC : v,
                       ok ? 16 : 0);
        } else if constexpr (EF) {
            cp_async16_policy(smem_addr(dst + r * Cfg::S + c * EPC),
                              ok ? kb + r * p.k_sr + c * EPC : k, ok ? 16 : 0, pol);
            cp_async16_policy(smem_addr(dst + (BN + r) * Cfg::S + c * EPC),
                              ok ? vb + r * p.v_sr + c * EPC : v, ok ? 16 : 0, pol);
        } else if constexpr (PF256) {
            cp_async16_l2pf256(smem_addr(dst + r * Cfg::S + c * EPC),
                               ok ? kb + r * p.k_sr + c * EPC : k, ok ? 16 : 0);
            cp_async16_l2pf256(smem_addr(dst + (BN + r) * Cfg::S + c * EPC),
                               ok ? vb + r * p.v_sr + c * EPC : v, ok ? 16 : 0);
        } else {
            cp_async16(smem_addr(dst + r * Cfg::S + c * EPC), ok ? kb + r * p.k_sr + c * EPC : k,
                       ok ? 16 : 0);
            cp_async16(smem_addr(dst + (BN + r) * Cfg::S + c * EPC),
                       ok ? vb + r * p.v_sr + c * EPC : v, ok ? 16 : 0);
        }
    }
}

// Version 4 (sm_90): the same tile by one bulk copy (cp.async.bulk, the TMA unit) per row, lane
// r < BN copying K row r and lane BN + r V row r (d * 2 bytes each), completing on the stage's
// mbarrier `bar`, which lane 0 arms with the tile's bytes first. Rows past sk are zeroed with
// ordinary stores (the pad columns d .. DPAD - 1 were zeroed once, and no copy writes them).
// Every lane fences its earlier generic accesses of the stage (reads of the last tile, zero
// rows) against the async proxy before the warp's copies are issued. Needs key tile < the
// block's last tile (so at least one key of it is < sk).
template <typename T, int DPAD, int BN, bool PAGED>
__device__ __forceinline__ void load_kv_tile_bulk(T* dst, unsigned int bar, const DecodeParams& p,
                                                  const T* k, const T* v, int kvh, int page,
                                                  int tile, int sk, int d, int lane) {
#if __CUDA_ARCH__ >= 900
    static_assert(2 * BN == 32, "one lane per K or V row of a tile");
    using Cfg = DecodeConfig<DPAD, BN, 1>;
    const int key0 = tile * BN;
    const int nvalid = min(BN, sk - key0);
    const T* kb;
    const T* vb;
    tile_rows<T, PAGED>(p, k, v, kvh, page, key0, kb, vb);
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    if (lane == 0) mbar_arrive_expect_tx(bar, static_cast<unsigned int>(4 * nvalid * d));
    __syncwarp();
    const int r = lane % BN;
    const bool is_v = lane >= BN;
    T* row = dst + (is_v ? BN + r : r) * Cfg::S;
    if (r < nvalid) {
        const T* src = is_v ? vb + r * p.v_sr : kb + r * p.k_sr;
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
                     " [%0], [%1], %2, [%3];\n"
                     :: "r"(smem_addr(row)), "l"(src), "r"(2 * d), "r"(bar) : "memory");
    } else {
#pragma unroll
        for (int c = 0; c < DPAD; c += 8)
            *reinterpret_cast<uint4*>(row + c) = make_uint4(0, 0, 0, 0);
    }
#endif
}

// The page holding key tile `tile` of sequence `seq` (0 when not paged or past the tiles).
template <int BN, bool PAGED>
__device__ __forceinline__ int page_of(const DecodeParams& p, int seq, int tile, int t_end) {
    if constexpr (!PAGED) return 0;
    return tile < t_end ? p.block_table[seq * p.bt_stride + ((tile * BN) >> p.page_log2)] : 0;
}

// acc += w * x, a float4 at a time (the combine's and the epilogue's sums).
__device__ __forceinline__ void axpy4(float4& acc, float w, const float4& x) {
    acc.x += w * x.x;
    acc.y += w * x.y;
    acc.z += w * x.z;
    acc.w += w * x.w;
}

// V: the epilogue's version. 1: session f's (every thread of the block re-derives its row's
// warp weights for each of its ROWS * DPAD / THREADS elements: 32 serial passes of ~175
// instructions at MT = 2); 2: one thread per row derives the row's weights f_w / l and lse
// once, then the block combines the warps' O in float4 chunks (8 passes of ~25 at MT = 2) and
// stores 8- or 16-byte chunks. Same merge order (warp 0 .. NWARPS - 1), same NaN and empty-row
// rules; the last bits may differ from V = 1 (a multiply by 1 / l instead of a division).
// 3: version 2 with the L2::256B prefetch hint on the K/V copies (same results as 2, bitwise).
// 4 (sm_90 only): version 2 with one bulk copy per K/V row on a per-stage mbarrier
// (load_kv_tile_bulk) instead of 16 lanes' 16-byte cp.async (same results as 2, bitwise).
// 5: version 2 with the K/V copies under an evict-first L2 policy (same results as 2, bitwise).
// 6: version 2 with the K/V tiles swizzled in shared memory (load_kv_tile's SW; same results as
// 2, bitwise).
// 7: version 2 with three K/V stages per warp at MT = 2 (two tiles in flight while a third is
// computed: a warp with few tiles, G = 32 at short keys, waits ~one tile latency less; MT = 1
// keeps two stages, so its code is version 2's). Each warp walks the same tiles in the same
// order, so results equal version 2's bitwise.
template <typename T, int DPAD, int BN, int NWARPS, int MT, bool CAUSAL, bool PAGED, int V>
__global__ void __launch_bounds__(32 * NWARPS)
cuflash_attn_decode(const DecodeParams p) {
    static_assert(V >= 1 && V <= 8, "decode kernel versions 1 to 8");
    constexpr bool PF = V == 3;
    constexpr bool EF = V == 5;
    constexpr bool SW = V == 6 || V == 8;  // the swizzled K/V tiles (load_kv_tile); 8: 6's main
                                           // kernel, launched with combine version 3
    static_assert(!SW || DPAD >= 64, "the swizzle needs eight 16-byte chunks a row");
    constexpr bool BULK = V == 4;
    constexpr int NS = (V == 7 && MT == 2) ? 3 : 2;  // K/V stages per warp
    __shared__ __align__(8) unsigned long long kv_bars[BULK ? 2 * NWARPS : 1];
    using Cfg = DecodeConfig<DPAD, BN, NWARPS, MT, NS>;
    constexpr int ROWS = Cfg::ROWS;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* q_s = reinterpret_cast<T*>(smem_raw);
    T* kv_s = q_s + ROWS * Cfg::S;

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int gq = lane / 4, t4 = lane % 4;
    // blockIdx.x = (entry * n_rblocks + rblock) * n_splits + split, n_rblocks = n_rtiles / MT
    // (the host pads n_rtiles, the 16-row tiles per entry, to a multiple of MT)
    const unsigned int flat = blockIdx.x;
    const unsigned int n_rblocks = static_cast<unsigned int>(p.n_rtiles) / MT;
    const unsigned int split = flat % static_cast<unsigned int>(p.n_splits);
    const unsigned int er = flat / static_cast<unsigned int>(p.n_splits);
    const unsigned int rblock = er % n_rblocks;
    const unsigned int entry = er / n_rblocks;
    Entry off = entry_offsets(p, entry);
    const int d = static_cast<int>(p.d), G = static_cast<int>(p.g);
    const SeqRange sr = seq_range(p, off);
    const int sq = sr.sq, sk = sr.sk;
    const int rows = G * sq;
    const int r0 = static_cast<int>(rblock) * ROWS;
    if (r0 >= rows) return;  // a row block past this sequence's rows (the whole block leaves)
    const T* q = static_cast<const T*>(p.q) + off.q;
    const T* k = static_cast<const T*>(p.k) + off.k;
    const T* v = static_cast<const T*>(p.v) + off.v;

    // Q tile: packed row r -> (query r / G, head r % G); rows >= G * Sq are zero.
    {
        constexpr int CHUNKS = DPAD / 8;
        for (int i = tid; i < ROWS * CHUNKS; i += Cfg::THREADS) {
            const int r = i / CHUNKS, c = i % CHUNKS;
            const int pr = r0 + r;
            const bool ok = pr < rows && c * 8 < d;
            int qr, hj;  // query row and head of packed row pr
            if constexpr (V >= 2) {  // one unsigned division (V = 1: two signed ones)
                qr = static_cast<int>(static_cast<unsigned int>(pr) / static_cast<unsigned int>(G));
                hj = pr - qr * G;
            } else {
                qr = pr / G;
                hj = pr % G;
            }
            const T* src = ok ? q + hj * p.q_sg + (long long)qr * p.q_sr + c * 8 : q;
            cp_async16(smem_addr(q_s + r * Cfg::S + c * 8), src, ok ? 16 : 0);
        }
        cp_async_commit();
    }

    // This block's key tiles: split `split` of the keys its last query row can see.
    const int last_q = min(sq - 1, (min(r0 + ROWS, rows) - 1) / G);
    const int keys = CAUSAL ? max(0, min(sk, last_q + sk - sq + 1)) : sk;
    const int n_tiles = (keys + BN - 1) / BN;
    const int t_begin = static_cast<int>(split) * static_cast<int>(p.split_tiles);
    const int t_end = min(n_tiles, t_begin + static_cast<int>(p.split_tiles));

    T* my = kv_s + warp * Cfg::WARP_ELEMS;
    // Per row tile mt of the block: O, the running max and sum of the lane's two rows.
    float acc_o[MT][Cfg::NT_O][4];
    float m_run[MT][2], l_run[MT][2];
    int qi[MT][2];  // query index of the lane's rows gq and gq + 8 of tile mt (causal mask)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int i = 0; i < Cfg::NT_O; ++i)
            acc_o[mt][i][0] = acc_o[mt][i][1] = acc_o[mt][i][2] = acc_o[mt][i][3] = 0.f;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            m_run[mt][h] = neg_inf<float>();
            l_run[mt][h] = 0.f;
            qi[mt][h] = (r0 + 16 * mt + gq + 8 * h) / G;
        }
    }
    const int diag = sk - sq;

    const int lr = lane % 8, lm = lane / 8;
    const unsigned int q_base = smem_addr(q_s + (lr + 8 * (lm % 2)) * Cfg::S + 8 * (lm / 2));
    // SW: the lane's row start; its chunk 2 kk + (lm % 2) of K (2 nn + lm / 2 of V) sits at
    // chunk (2 kk) ^ ky ((2 nn) ^ vy) of the row, since every row it addresses has r & 7 = lr.
    const unsigned int k_off = SW ? (lr + 8 * (lm / 2)) * DPAD * 2
                                  : ((lr + 8 * (lm / 2)) * Cfg::S + 8 * (lm % 2)) * 2;
    const unsigned int v_off = SW ? (BN + lr + 8 * (lm % 2)) * DPAD * 2
                                  : ((BN + lr + 8 * (lm % 2)) * Cfg::S + 8 * (lm / 2)) * 2;
    const unsigned int ky = (lm % 2) ^ lr, vy = (lm / 2) ^ lr;

    const unsigned long long kv_pol = EF ? l2_evict_first_policy() : 0ull;
    int t = t_begin + warp;
    // the page of the tile the loop issues first (t + (NS - 1) NWARPS), read one tile ahead
    int page_next = page_of<BN, PAGED>(p, off.seq, t + (NS - 1) * NWARPS, t_end);
    // BULK: the warp's two stage barriers and their phase bits; the pad columns zeroed once.
    const unsigned int bar0 = smem_addr(&kv_bars[BULK ? 2 * warp : 0]);
    unsigned int phases = 0;
    if constexpr (BULK) {
        if (lane == 0) {
            mbar_init(bar0, 1);
            mbar_init(bar0 + 8, 1);
            mbar_fence_init();
        }
        for (int i = lane; i < 2 * 2 * BN * (DPAD / 8); i += 32) {
            const int r = i / (DPAD / 8), c = (i % (DPAD / 8)) * 8;
            if (c >= d) *reinterpret_cast<uint4*>(my + r * Cfg::S + c) = make_uint4(0, 0, 0, 0);
        }
        __syncwarp();
    }
    if (t < t_end) {
        const int page_t = page_of<BN, PAGED>(p, off.seq, t, t_end);
        if constexpr (BULK)
            load_kv_tile_bulk<T, DPAD, BN, PAGED>(my, bar0, p, k, v, off.kvh, page_t, t, sk, d,
                                                  lane);
        else
            load_kv_tile<T, DPAD, BN, PAGED, PF, EF, SW>(my, p, k, v, off.kvh, page_t, t, sk, d, lane,
                                                      kv_pol);
    }
    cp_async_commit();
    if constexpr (NS == 3) {  // the second tile in flight before the loop (its own group)
        const int t1 = t + NWARPS;
        if (t1 < t_end)
            load_kv_tile<T, DPAD, BN, PAGED, PF, EF, SW>(my + Cfg::STAGE, p, k, v, off.kvh,
                                                          page_of<BN, PAGED>(p, off.seq, t1,
                                                                             t_end),
                                                          t1, sk, d, lane, kv_pol);
        cp_async_commit();
    }
    cp_async_wait<NS - 1>();  // this thread's Q chunks have landed (its K/V tiles may not)
    __syncthreads();     // and everyone's: the whole Q tile is visible
    int stage = 0;
#pragma unroll 1
    for (; t < t_end; t += NWARPS) {
        const int tn = t + (NS - 1) * NWARPS;  // the tile issued now, into the stage last read
        const int page_tn = page_next;
        page_next = page_of<BN, PAGED>(p, off.seq, tn + NWARPS, t_end);  // used next iteration
        const int st_n = NS == 2 ? (stage ^ 1) : (stage == 0 ? NS - 1 : stage - 1);
        if (tn < t_end) {
            if constexpr (BULK)
                load_kv_tile_bulk<T, DPAD, BN, PAGED>(my + (stage ^ 1) * Cfg::STAGE,
                                                      bar0 + 8 * (stage ^ 1), p, k, v, off.kvh,
                                                      page_tn, tn, sk, d, lane);
            else
                load_kv_tile<T, DPAD, BN, PAGED, PF, EF, SW>(my + st_n * Cfg::STAGE, p, k,
                                                         v, off.kvh, page_tn, tn, sk, d, lane,
                                                         kv_pol);
        }
        cp_async_commit();
        cp_async_wait<NS - 1>();  // tile t has landed for this lane ...
        if constexpr (BULK) {  // (BULK: tile t's bulk copies have completed its stage's phase)
            mbar_wait(bar0 + 8 * stage, (phases >> stage) & 1u);
            phases ^= 1u << stage;
        }
        __syncwarp();        // ... and for the whole warp, which alone reads it
        const unsigned int kv_base = smem_addr(my + stage * Cfg::STAGE);
        // S = Q K^T for every row tile: each K fragment is loaded once and feeds the MT tiles.
        float s[MT][Cfg::NT_S][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int i = 0; i < Cfg::NT_S; ++i)
                s[mt][i][0] = s[mt][i][1] = s[mt][i][2] = s[mt][i][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < DPAD / 16; ++kk) {
            unsigned int a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                ldmatrix_x4(q_base + (mt * 16 * Cfg::S + kk * 16) * 2, a[mt][0], a[mt][1],
                            a[mt][2], a[mt][3]);
#pragma unroll
            for (int nn = 0; nn < BN / 16; ++nn) {
                unsigned int b0, b1, b2, b3;
                ldmatrix_x4(SW ? kv_base + k_off + nn * 16 * DPAD * 2 + (((2 * kk) ^ ky) << 4)
                               : kv_base + k_off + (nn * 16 * Cfg::S + kk * 16) * 2,
                            b0, b1, b2, b3);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    Mma<T>::run(s[mt][2 * nn], a[mt], b0, b1);
                    Mma<T>::run(s[mt][2 * nn + 1], a[mt], b2, b3);
                }
            }
        }
        const int key0 = t * BN;
        unsigned int pk[MT][BN / 16][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int nt = 0; nt < Cfg::NT_S; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = key0 + nt * 8 + 2 * t4 + (e % 2);
                    bool ok = key < sk;
                    if (CAUSAL) ok = ok && key <= qi[mt][e / 2] + diag;
                    s[mt][nt][e] = ok ? s[mt][nt][e] : neg_inf<float>();
                }
            float alpha[2];
            softmax_step<Cfg::NT_S, false>(s[mt], m_run[mt], l_run[mt], alpha, false, 0, t4, sk,
                                           0, 0, static_cast<float>(p.scale_log2));
            rescale_rows<Cfg::NT_O>(acc_o[mt], alpha);
            pack_p<T, Cfg::NT_S>(s[mt], pk[mt]);
        }
        // O += P V: each V fragment is loaded once and feeds the MT tiles.
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
            for (int nn = 0; nn < DPAD / 16; ++nn) {
                unsigned int b0, b1, b2, b3;
                ldmatrix_x4_trans(SW ? kv_base + v_off + kk * 16 * DPAD * 2
                                           + (((2 * nn) ^ vy) << 4)
                                     : kv_base + v_off + (kk * 16 * Cfg::S + nn * 16) * 2,
                                  b0, b1, b2,
                                  b3);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    Mma<T>::run(acc_o[mt][2 * nn], pk[mt][kk], b0, b1);
                    Mma<T>::run(acc_o[mt][2 * nn + 1], pk[mt][kk], b2, b3);
                }
            }
        __syncwarp();  // every lane is done with this stage before it is refilled
        if constexpr (NS == 2)
            stage ^= 1;
        else
            stage = stage == NS - 1 ? 0 : stage + 1;
    }
    cp_async_wait<0>();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // the row sums over the quad
            l_run[mt][h] += __shfl_xor_sync(0xffffffffu, l_run[mt][h], 1);
            l_run[mt][h] += __shfl_xor_sync(0xffffffffu, l_run[mt][h], 2);
        }
    __syncthreads();  // every warp is out of its tiles: the K/V space holds the warps' O now

    // Merge the warps' states in warp order. O of warp w: ROWS x DPAD floats at
    // ob + w * ROWS * OS.
    float* ob = reinterpret_cast<float*>(kv_s);
    float* mb = ob + NWARPS * ROWS * Cfg::OS;  // m (scaled to exp2 units) per warp and row
    float* lb = mb + NWARPS * ROWS;            // l per warp and row
    const float c = static_cast<float>(p.scale_log2);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int nt = 0; nt < Cfg::NT_O; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                ob[(warp * ROWS + 16 * mt + gq + 8 * (e / 2)) * Cfg::OS + nt * 8 + 2 * t4
                   + (e % 2)] = acc_o[mt][nt][e];
        if (t4 == 0) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = warp * ROWS + 16 * mt + gq + 8 * h;
                mb[r] = m_run[mt][h] == neg_inf<float>() ? m_run[mt][h] : m_run[mt][h] * c;
                lb[r] = l_run[mt][h];
            }
        }
    }
    __syncthreads();

    const bool one = p.n_splits == 1;
    if constexpr (V >= 2) {
        // Thread r < ROWS: row r's warp weights f_w / l (over mb's row r, which only this
        // thread reads), its lse and its kind (1: normal, 0: no key, NaN: a NaN score) into
        // lb[r] and lb[ROWS + r] (lb's row-r entries of warps 0 and 1, read here first).
        if (tid < ROWS) {
            const int r = tid;
            float mx = neg_inf<float>();
            bool nan_row = false;
#pragma unroll
            for (int w = 0; w < NWARPS; ++w) {
                mx = fmaxf(mx, mb[w * ROWS + r]);
                nan_row = nan_row || isnan(lb[w * ROWS + r]);
            }
            float f[NWARPS], l = 0.f;
#pragma unroll
            for (int w = 0; w < NWARPS; ++w) {
                const float mw = mb[w * ROWS + r];
                f[w] = (mx == neg_inf<float>() || mw == neg_inf<float>()) ? 0.f
                                                                          : fast_exp2(mw - mx);
                l += f[w] * lb[w * ROWS + r];
            }
            const float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
            for (int w = 0; w < NWARPS; ++w) mb[w * ROWS + r] = f[w] * inv;
            float lse = l > 0.f ? (mx + __log2f(l)) * 0.6931471805599453f : neg_inf<float>();
            float kind = l > 0.f ? 1.f : 0.f;
            if (nan_row) lse = kind = __int_as_float(0x7fc00000);
            lb[r] = lse;
            lb[ROWS + r] = kind;
        }
        __syncthreads();
        constexpr int C4 = DPAD / 4;  // float4 chunks of a row
        for (int i = tid; i < ROWS * C4; i += Cfg::THREADS) {
            const int r = i / C4, col = (i % C4) * 4;
            const int pr = r0 + r;
            if (pr >= rows || col >= d) continue;  // D % 8 == 0: a chunk is all in or all out
            float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int w = 0; w < NWARPS; ++w) {
                const float fw = mb[w * ROWS + r];
                const float4 x = *reinterpret_cast<const float4*>(ob + (w * ROWS + r) * Cfg::OS
                                                                  + col);
                axpy4(acc, fw, x);
            }
            const float kind = lb[ROWS + r];
            if (kind != 1.f) {  // no key: 0; a NaN score: NaN
                const float z = kind == 0.f ? 0.f : __int_as_float(0x7fc00000);
                acc = make_float4(z, z, z, z);
            }
            const float lse = lb[r];
            const unsigned int gu = static_cast<unsigned int>(G);
            const int qi_r = static_cast<int>(static_cast<unsigned int>(pr) / gu);
            const int hj = pr - qi_r * G;
            if (one) {
                T* o = static_cast<T*>(p.o) + off.o + hj * p.o_sg + (long long)qi_r * p.o_sr;
                *reinterpret_cast<uint2*>(o + col) =
                    make_uint2(pack2<T>(acc.x, acc.y), pack2<T>(acc.z, acc.w));
                if (col == 0 && p.lse) p.lse[off.l + hj * p.l_sg + (long long)qi_r * p.l_sr] = lse;
            } else {
                const long long prow = (static_cast<long long>(entry) * p.n_splits + split)
                                       * (16 * p.n_rtiles) + pr;
                *reinterpret_cast<float4*>(p.o_part + prow * DPAD + col) = acc;
                if (col == 0) p.lse_part[prow] = lse;
            }
        }
        return;
    }
    for (int i = tid; i < ROWS * DPAD; i += Cfg::THREADS) {
        const int r = i / DPAD, col = i % DPAD;
        const int pr = r0 + r;
        if (pr >= rows || col >= d) continue;
        float mx = neg_inf<float>();
        bool nan_row = false;  // a NaN (or +inf) score: l is NaN, and so is the row's result
#pragma unroll
        for (int w = 0; w < NWARPS; ++w) {
            mx = fmaxf(mx, mb[w * ROWS + r]);
            nan_row = nan_row || isnan(lb[w * ROWS + r]);
        }
        float l = 0.f, acc = 0.f;
        if (mx != neg_inf<float>()) {
#pragma unroll
            for (int w = 0; w < NWARPS; ++w) {
                const float mw = mb[w * ROWS + r];
                const float f = mw == neg_inf<float>() ? 0.f : fast_exp2(mw - mx);
                l += f * lb[w * ROWS + r];
                acc += f * ob[(w * ROWS + r) * Cfg::OS + col];
            }
        }
        float val = l > 0.f ? acc / l : 0.f;
        float lse = l > 0.f ? (mx + __log2f(l)) * 0.6931471805599453f : neg_inf<float>();
        if (nan_row) val = lse = __int_as_float(0x7fc00000);
        const int qi_r = pr / G, hj = pr % G;
        if (one) {
            T* o = static_cast<T*>(p.o) + off.o + hj * p.o_sg + (long long)qi_r * p.o_sr;
            o[col] = from_acc<T>(val);
            if (col == 0 && p.lse) p.lse[off.l + hj * p.l_sg + (long long)qi_r * p.l_sr] = lse;
        } else {
            const long long prow = (static_cast<long long>(entry) * p.n_splits + split)
                                   * (16 * p.n_rtiles) + pr;
            p.o_part[prow * DPAD + col] = val;
            if (col == 0) p.lse_part[prow] = lse;
        }
    }
}

// The combine block's entry, packed row and entry offsets (blockIdx.x = entry * G * Sq + row);
// false for a row past its sequence's (packed varlen batches), whose block leaves.
// `row`: the flat packed row (entry * G * Sq + row); combine_row takes blockIdx.x.
__device__ __forceinline__ bool combine_row_at(const DecodeParams& p, unsigned int row,
                                               unsigned int& entry, unsigned int& pr,
                                               Entry& off) {
    const unsigned int rows = static_cast<unsigned int>(p.g * p.sq);
    entry = row / rows;
    pr = row % rows;
    off = entry_offsets(p, entry);
    return pr < static_cast<unsigned int>(p.g * seq_range(p, off).sq);
}
__device__ __forceinline__ bool combine_row(const DecodeParams& p, unsigned int& entry,
                                            unsigned int& pr, Entry& off) {
    return combine_row_at(p, blockIdx.x, entry, pr, off);
}

// The split lse of row `base` (ns of them, rpad apart) -> the row's max, sum of weights and
// NaN flag (warp 0's fixed butterfly: every lane ends with the same bits), and each split's
// weight exp(lse_s - max) / sum in w_s (DIVIDE: as a division, version 1; else times 1 / sum).
// Ends with a barrier.
template <bool DIVIDE>
__device__ __forceinline__ void combine_weights(const DecodeParams& p, float* w_s, float* stat,
                                                long long base, long long rpad, int ns, int tid) {
    const int lane = tid % 32;
    for (int s = tid; s < ns; s += 128) w_s[s] = p.lse_part[base + s * rpad];
    __syncthreads();
    if (tid < 32) {
        float mx = neg_inf<float>();
        bool nan = false;    // a split whose row met a NaN score: the row is NaN
        for (int s = lane; s < ns; s += 32) {
            mx = fmaxf(mx, w_s[s]);
            nan = nan || isnan(w_s[s]);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        nan = __any_sync(0xffffffffu, nan);
        float sum = 0.f;
        if (mx != neg_inf<float>() && !nan)
            for (int s = lane; s < ns; s += 32) sum += expf(w_s[s] - mx);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        if (lane == 0) {
            stat[0] = mx;
            stat[1] = sum;
            stat[2] = nan ? 1.f : 0.f;
        }
    }
    __syncthreads();
    const float mx = stat[0], sum = stat[1];
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    for (int s = tid; s < ns; s += 128)
        w_s[s] = (sum > 0.f && w_s[s] != neg_inf<float>())
                     ? (DIVIDE ? expf(w_s[s] - mx) / sum : expf(w_s[s] - mx) * inv) : 0.f;
    __syncthreads();
}

// Store float4 chunk c4 of packed row pr's merged o (NaN for a NaN row) and, from chunk 0, its
// lse (mx + log sum; -inf for a row with no key).
template <typename T>
__device__ __forceinline__ void combine_store(const DecodeParams& p, const Entry& off,
                                              unsigned int pr, int c4, float4 acc, bool nan_row,
                                              float mx, float sum) {
    const unsigned int gu = static_cast<unsigned int>(p.g);
    const int qi = pr / gu, hj = pr % gu;
    T* o = static_cast<T*>(p.o) + off.o + hj * p.o_sg + (long long)qi * p.o_sr;
    const int col = 4 * c4;
    if (col < p.d) {  // D % 8 == 0: a chunk is all in or all out
        if (nan_row) {
            const float qn = __int_as_float(0x7fc00000);
            acc = make_float4(qn, qn, qn, qn);
        }
        *reinterpret_cast<uint2*>(o + col) =
            make_uint2(pack2<T>(acc.x, acc.y), pack2<T>(acc.z, acc.w));
    }
    if (c4 == 0 && p.lse)
        p.lse[off.l + hj * p.l_sg + (long long)qi * p.l_sr] =
            nan_row ? __int_as_float(0x7fc00000) : sum > 0.f ? mx + logf(sum) : neg_inf<float>();
}

template <typename T, int DPAD>
__device__ __forceinline__ void decode_combine_v2(const DecodeParams& p);
template <typename T, int DPAD>
__device__ __forceinline__ void decode_combine_v3(const DecodeParams& p);

// Merge the splits' partial (o, lse) of each packed row, in a fixed order (merge.cu's operator):
// lse = log sum_s exp(lse_s), o = sum_s exp(lse_s - lse) o_s. One block of 128 threads per row.
// The split lse go through shared memory once; warp 0 takes their max and sum with a fixed
// butterfly (every lane ends with the same bits); the weighted sum of the o_s is spread over
// NG = 512 / DPAD groups of threads, each reading float4 chunks of the splits g, g + NG, ...
// (independent loads, unrolled), and the groups' sums add up in group order: bitwise the same
// from run to run, whatever the timing.
//
// V = 2 (the launch is a grid (rows, CB), CB a power of two dividing DPAD / 4, chosen by the host
// so that a thread has at most COMBINE_LOADS splits): block (row, y) covers the row's float4
// chunks y * CHB .. (y + 1) * CHB - 1, CHB = DPAD / 4 / CB, with NG = 128 / CHB split groups;
// a thread issues the loads of all its splits first (independent, in flight together, before
// the weights are known), then the lse pass runs, then the weighted sums in split order and
// the groups in group order: one round trip to the partials instead of ns / (4 NG) (V = 1:
// 4 loads a thread in flight, 32 rows x 256 splits took 16 dependent rounds on 32 SMs).
constexpr int MAX_SPLITS = 256;  // cuflash/_decode.py caps the split count here
constexpr int COMBINE_LOADS = 8;  // V = 2: partial rows a thread loads at once (_decode.py)
template <typename T, int DPAD, int V>
__global__ void __launch_bounds__(128) cuflash_decode_combine(const DecodeParams p) {
    static_assert(V >= 1 && V <= 3, "combine versions 1 to 3");
    if constexpr (V == 2) {
        decode_combine_v2<T, DPAD>(p);
        return;
    } else if constexpr (V == 3) {
        decode_combine_v3<T, DPAD>(p);
        return;
    }
    constexpr int CH = DPAD / 4;  // float4 chunks of one partial row
    constexpr int NG = 128 / CH;  // split groups
    static_assert(128 % CH == 0 && NG >= 1, "the combine's 128 threads cover a row in chunks");
    __shared__ float w_s[MAX_SPLITS];
    __shared__ float4 red[NG][CH];
    __shared__ float stat[3];
    unsigned int entry, pr;
    Entry off;
    if (!combine_row(p, entry, pr, off)) return;
    const int tid = threadIdx.x;
    const int ns = static_cast<int>(p.n_splits);
    const long long rpad = 16 * p.n_rtiles;
    const long long base = static_cast<long long>(entry) * ns * rpad + pr;
    combine_weights<true>(p, w_s, stat, base, rpad, ns, tid);
    const float mx = stat[0], sum = stat[1];
    const bool nan_row = stat[2] != 0.f;
    const int c4 = tid % CH, gi = tid / CH;
    const float4* op = reinterpret_cast<const float4*>(p.o_part + base * DPAD) + c4;
    const long long sstride = rpad * CH;  // float4s from one split's row to the next's
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
    for (int s = gi; s < ns; s += NG) {
        const float w = w_s[s];
        const float4 x = op[s * sstride];
        axpy4(acc, w, x);
    }
    if (NG > 1) {
        red[gi][c4] = acc;
        __syncthreads();
    }
    if (gi == 0) {
#pragma unroll
        for (int g = 1; g < NG; ++g) {
            const float4 y = red[g][c4];
            axpy4(acc, 1.f, y);
        }
        combine_store<T>(p, off, pr, c4, acc, nan_row, mx, sum);
    }
}

template <typename T, int DPAD>
__device__ __forceinline__ void decode_combine_v2(const DecodeParams& p) {
    constexpr int CH = DPAD / 4;  // float4 chunks of one partial row
    __shared__ float w_s[MAX_SPLITS];
    __shared__ float4 red[128];
    __shared__ float stat[3];
    unsigned int entry, pr;
    Entry off;
    if (!combine_row(p, entry, pr, off)) return;
    const int tid = threadIdx.x;
    const int chb = CH / static_cast<int>(gridDim.y);  // chunks of this block (a power of two)
    const int ng = 128 / chb;                           // split groups
    const int c4 = static_cast<int>(blockIdx.y) * chb + tid % chb, gi = tid / chb;
    const int ns = static_cast<int>(p.n_splits);
    const long long rpad = 16 * p.n_rtiles;
    const long long base = static_cast<long long>(entry) * ns * rpad + pr;
    const float4* op = reinterpret_cast<const float4*>(p.o_part + base * DPAD) + c4;
    const long long sstride = rpad * CH;  // float4s from one split's row to the next's
    float4 x[COMBINE_LOADS];
#pragma unroll
    for (int j = 0; j < COMBINE_LOADS; ++j) {  // splits gi + j ng, in flight together
        const int s = gi + j * ng;
        x[j] = s < ns ? op[s * sstride] : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    combine_weights<false>(p, w_s, stat, base, rpad, ns, tid);
    const float mx = stat[0], sum = stat[1];
    const bool nan_row = stat[2] != 0.f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int j = 0; j < COMBINE_LOADS; ++j) {
        const int s = gi + j * ng;
        if (s < ns) {
            const float w = w_s[s];
            axpy4(acc, w, x[j]);
        }
    }
    for (int s = gi + COMBINE_LOADS * ng; s < ns; s += ng) {  // more splits than the host plans
        const float w = w_s[s];
        const float4 y = op[s * sstride];
        axpy4(acc, w, y);
    }
    if (ng > 1) {
        red[tid] = acc;
        __syncthreads();
    }
    if (gi == 0) {
        for (int g = 1; g < ng; ++g) {  // the groups in group order
            const float4 y = red[g * chb + tid];
            axpy4(acc, 1.f, y);
        }
        combine_store<T>(p, off, pr, c4, acc, nan_row, mx, sum);
    }
}

// V = 3 (decode kernel version 8; the host launches it only for 2 <= ns <= COMBINE3_SPLITS):
// one warp per packed row, four rows a block of 128 threads (a 1-D grid of ceil(rows / 4)
// blocks), no block barrier and no shared memory. Lane c holds float4 chunk c (and c + 32 at
// DPAD = 256) of every split's partial row and the lse of split c: all of a lane's loads are
// issued together, before any result is needed (one round trip to the partials), the max and
// the sum of weights take version 2's warp-0 butterfly over the same per-lane values, and each
// split's weight reaches the lanes by a shuffle. The weighted sum runs in version 2's order at
// CB = 1 (NG = 512 / DPAD split groups: splits g, g + NG, ... per group, the groups added in
// group order; CB = 1 is version 2's grid for every ns <= COMBINE3_SPLITS), so o and lse equal
// version 2's bit for bit.
template <typename T, int DPAD>
__device__ __forceinline__ void decode_combine_v3(const DecodeParams& p) {
    constexpr int CH = DPAD / 4;           // float4 chunks of one partial row
    constexpr int CPL = (CH + 31) / 32;    // chunks per lane
    constexpr int NG = 512 / DPAD;         // version 2's split groups at CB = 1
    constexpr int NS3 = DPAD > 128 ? 8 : 16;  // _decode.py: COMBINE3_SPLITS
    static_assert(NS3 <= 32 && NS3 <= 8 * NG, "one lse a lane; version 2 at CB = 1");
    const int lane = threadIdx.x % 32;
    const unsigned int row = blockIdx.x * 4u + threadIdx.x / 32;
    const unsigned int nrows = static_cast<unsigned int>(p.nb0 * p.nb1 * p.nb2 * p.g * p.sq);
    unsigned int entry, pr;
    Entry off;
    if (row >= nrows || !combine_row_at(p, row, entry, pr, off)) return;  // the whole warp
    const int ns = static_cast<int>(p.n_splits);
    const long long rpad = 16 * p.n_rtiles;
    const long long base = static_cast<long long>(entry) * ns * rpad + pr;
    const float4* op = reinterpret_cast<const float4*>(p.o_part + base * DPAD) + lane;
    const long long sstride = rpad * CH;  // float4s from one split's row to the next's
    float4 x[CPL][NS3];
#pragma unroll
    for (int j = 0; j < NS3; ++j) {  // every load of the lane in flight together
#pragma unroll
        for (int c = 0; c < CPL; ++c)
            x[c][j] = (j < ns && lane + 32 * c < CH) ? op[j * sstride + 32 * c]
                                                      : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    const float ls = lane < ns ? p.lse_part[base + lane * rpad] : neg_inf<float>();
    float mx = ls;
    const bool nan_row = __any_sync(0xffffffffu, isnan(ls));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float sum = 0.f;
    if (mx != neg_inf<float>() && !nan_row && lane < ns) sum += expf(ls - mx);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    const float w = (sum > 0.f && ls != neg_inf<float>()) ? expf(ls - mx) * inv : 0.f;
    float4 acc[CPL];
#pragma unroll
    for (int g = 0; g < NG; ++g) {  // version 2's groups, in group order
        float4 a[CPL];
#pragma unroll
        for (int c = 0; c < CPL; ++c) a[c] = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int j = g; j < NS3; j += NG) {  // the group's splits in split order
            const float wj = __shfl_sync(0xffffffffu, w, j);
            if (j < ns) {
#pragma unroll
                for (int c = 0; c < CPL; ++c) axpy4(a[c], wj, x[c][j]);
            }
        }
#pragma unroll
        for (int c = 0; c < CPL; ++c) {
            if (g == 0) acc[c] = a[c];
            else axpy4(acc[c], 1.f, a[c]);
        }
    }
#pragma unroll
    for (int c = 0; c < CPL; ++c)
        if (lane + 32 * c < CH)
            combine_store<T>(p, off, pr, lane + 32 * c, acc[c], nan_row, mx, sum);
}

// Append new keys and values to a KV cache in place: row n of k_new (seq b, kv head h) goes to
// key seqlens[b] + n of sequence b (through the block table when paged). One 16-byte chunk a
// thread. k_new/v_new: (B, Snew, Hkv, D) with strides nk_s1 (seq), nk_sr (row), nk_s2 (head).
struct AppendParams {
    const void* k_new;
    const void* v_new;
    void* k;
    void* v;
    const int* seqlens;
    const int* block_table;
    long long b, snew, hkv, d;
    long long nk_s1, nk_sr, nk_s2, nv_s1, nv_sr, nv_s2;
    long long k_s1, k_sr, k_s2, v_s1, v_sr, v_s2;
    long long page_log2, bt_stride, k_page, v_page;
};
static_assert(sizeof(AppendParams) == 26 * 8, "AppendParams must match cuflash/_decode.py");

template <typename T, bool PAGED>
__global__ void cuflash_kv_append(const AppendParams p) {
    const long long chunks = p.d / 8;
    const long long idx = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (idx >= p.b * p.snew * p.hkv * chunks) return;
    const long long c = idx % chunks;
    long long t = idx / chunks;
    const long long h = t % p.hkv;
    t /= p.hkv;
    const long long n = t % p.snew;
    const long long b = t / p.snew;
    const long long key = p.seqlens[b] + n;
    long long kdst, vdst;
    if constexpr (PAGED) {
        const long long page = p.block_table[b * p.bt_stride + (key >> p.page_log2)];
        const long long in_page = key & ((1LL << p.page_log2) - 1);
        kdst = page * p.k_page + in_page * p.k_sr + h * p.k_s2;
        vdst = page * p.v_page + in_page * p.v_sr + h * p.v_s2;
    } else {
        kdst = b * p.k_s1 + key * p.k_sr + h * p.k_s2;
        vdst = b * p.v_s1 + key * p.v_sr + h * p.v_s2;
    }
    const T* kn = static_cast<const T*>(p.k_new) + b * p.nk_s1 + n * p.nk_sr + h * p.nk_s2;
    const T* vn = static_cast<const T*>(p.v_new) + b * p.nv_s1 + n * p.nv_sr + h * p.nv_s2;
    reinterpret_cast<uint4*>(static_cast<T*>(p.k) + kdst)[c] = reinterpret_cast<const uint4*>(kn)[c];
    reinterpret_cast<uint4*>(static_cast<T*>(p.v) + vdst)[c] = reinterpret_cast<const uint4*>(vn)[c];
}

}  // namespace cuflash
