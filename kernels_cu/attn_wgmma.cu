// attn_wgmma.cu: Hopper forward kernel for float16 / bfloat16 (sm_90a only).
//
// Versions (H200, float16, the standard grid; notes/PERF.md has the predictions and details):
//   1a  TMA loads, warpgroup MMA (wgmma) for both products, one producer warpgroup and two
//       consumer warpgroups. Against attn_mma.cu (mma.sync, ~360 TFLOP/s peak): wgmma keeps the
//       whole 64 x N product in the tensor cores without a per-fragment ldmatrix, operands come
//       straight from shared memory, and loads cost the consumers nothing.
//   1b  OVERLAP: the softmax of tile j runs while the tensor cores do P_{j-1} V_{j-1}. 1a + 1b:
//       1.40x FA2 geomean on a 12-point grid, 626 TFLOP/s at D = 128, S = 4096. Against 1a:
//       +2-11% at D = 128/256 and S >= 2048, up to -11% at D = 64 (enabled per head dim).
//   2   Persistent launches: a block loops over work items; the next item's first K tile and Q
//       are requested while the current one finishes. +1-29% at Sk <= 2048, but -2 to -15% there
//       under the causal mask at D >= 128 and up to -22% at Sk = 8192 (the dispatcher chooses
//       per call). With 1b: 1.61x FA2, 0.89x cuDNN, 740 TFLOP/s.
//   3   (benchmarks/tune.py, same-run TFLOP/s; cuflash/_dispatch.py: HOPPER_TABLE picks per call)
//       a. Causal work items are pairs of query blocks (WorkWalk): the round-robin of version 2
//          gave every block the same query block in each round. D = 128, S = 1024, causal:
//          404 TFLOP/s persistent with pairs (tune.py) where version 2 had 345 (bench.py, one
//          block per item; cuDNN 437 in both runs), and persistence now pays under the mask.
//       b. PINGPONG: the consumers take turns to issue their products (named barriers), so one's
//          softmax runs under the other's MMAs: +4-12% at D = 128 (S = 2048: 560 -> 615).
//       c. CONSUMERS = 3 (BM = 192, 160 registers each) at D = 64: +8-19% without the mask.
//       d. BN = 176 (D = 128, long keys) and BN = 80 (D = 256): 0 to +14% from S = 1024 on.
//       e. QSTAGES = 2 (the next item's Q loaded during this one): +0.3% to -4%, not dispatched.
//   4   (benchmarks/ab.py: the old and new sources timed interleaved in one process)
//       a. Per-warpgroup tile counts (tiles_needed): under the causal mask each consumer computes
//          only the key tiles its own 64 rows see, and rows past Sq compute none. D = 256,
//          S = 512, causal: +3-5% (tune.py, same run).
//       b. O leaves in 16-byte stores (common.cuh: quad_transpose). ncu's source counters at
//          D = 256, S = 512 put about a quarter of the warps' stall samples in the epilogue,
//          behind 4-byte stores throttled by the memory pipeline. With a and b: D = 256, S = 512
//          466 -> 553 TFLOP/s, causal 283 -> 360 (cuDNN 541, 356); D = 128, S = 512 +7-9%;
//          D = 64 within +-1.5%.
//       c. The consumer index is broadcast from lane 0 so that the compiler treats it as
//          warp-uniform (uniform registers); without that, a + b spilled 16-56 bytes at D = 256
//          and at BM = 192 and ran 4-15% slower (ab.py, D = 64, 128 and 256, S = 512-1024).
//
// Block = 1 + CONSUMERS warpgroups (384 or 512 threads), BM = 64 * CONSUMERS query rows:
//   - warpgroup 0, the producer, gives most of its registers away (setmaxnreg) and one thread
//     issues TMA copies: Q into one of QSTAGES buffers per work item, then K_j and V_j into a ring
//     of STAGES buffers, each with its own "full" mbarrier (TMA completes it by byte count) and
//     an "empty" mbarrier that the consumers' warps arrive on when they are done with the stage;
//   - warpgroups 1.., the consumers, own 64 query rows each. Per K/V tile:
//     S = Q K_j^T with wgmma m64nBNk16 (A = Q and B = K_j, both K-major in shared memory),
//     the online softmax in registers (common.cuh: softmax_step, shared with attn_mma.cu),
//     P converted to 16 bits in registers, O += P V_j with wgmma m64nDk16 (A = P from
//     registers, B = V_j N-major in shared memory).
// Without PINGPONG the consumers run independently and the warp schedulers interleave them; with
// it they issue their products in turn. The producer keeps STAGES tiles in flight.
//
// Shared memory: Q, K and V tiles are stored as 64-column panels (128 bytes per row) with the
// 128-byte swizzle, which is what TMA writes with CU_TENSOR_MAP_SWIZZLE_128B and what the wgmma
// descriptors (common.cuh: wgmma_desc) read; every panel starts on a 1024-byte boundary.
// Head dims below DPAD, and rows past Sq or Sk, arrive as zeros from the tensor maps' bounds.
//
// FLOPs per tile and consumer: 2 * 64 * BN * DPAD for each product. Causal: tiles past the
// block's last visible key are never loaded; the mask is applied only from masked_from on.
//
// Requirements checked on the host (cuflash/_dispatch.py: hopper_reason): compute capability 9.0,
// D == Dv, D % 8 == 0, 64 <= D <= DPAD, pointers, rows and batch strides of q, k, v and out
// multiples of 16 bytes (TMA loads, 16-byte stores of O).
#include "common.cuh"
#include "wgmma_ops.cuh"

namespace cuflash {

// The kernel parameter: the three tensor maps (made per call on the host: cuflash/_launch.py),
// then the parameters every forward kernel takes. coord_mask bit 3 * t + i is set when tensor t
// (0 = q, 1 = k, 2 = v) has batch axis i of the collapsed batch (nb0, nb1, nb2); where it is
// clear the tensor broadcasts over that axis and its tensor-map coordinate is 0.
struct HopperParams {
    TmaDesc tm_q, tm_k, tm_v;
    AttnParams a;
    long long coord_mask;
};
// The host mirrors this layout byte for byte (cuflash/_launch.py: HOPPER_PARAMS_DTYPE): a at 384,
// coord_mask right after it. (Checked through sizes: NVRTC 13.0 has no __builtin_offsetof.)
static_assert(sizeof(TmaDesc) == 128 && alignof(AttnParams) <= 64 && sizeof(AttnParams) % 8 == 0,
              "HopperParams layout");
static_assert(3 * sizeof(TmaDesc) + sizeof(AttnParams) + sizeof(long long) == 640,
              "HopperParams layout");
static_assert(sizeof(HopperParams) == 640, "HopperParams layout");

template <typename T, int DPAD, int BN, int STAGES, int QSTAGES, int CONSUMERS_>
struct WgmmaConfig {
    static constexpr int CONSUMERS = CONSUMERS_;        // consumer warpgroups, 64 rows each
    static constexpr int BM = 64 * CONSUMERS;           // query rows per block
    static constexpr int THREADS = 128 * (CONSUMERS + 1);
    static constexpr int PANELS = DPAD / 64;            // 64-column, 128-byte swizzled panels
    static constexpr int Q_PANEL = BM * 128;            // bytes per panel
    static constexpr int KV_PANEL = BN * 128;
    static constexpr int Q_BYTES = PANELS * Q_PANEL;     // one Q buffer (of QSTAGES)
    static constexpr int KV_BYTES = PANELS * KV_PANEL;  // one K or one V tile
    static constexpr int BAR_BYTES = 8 * (2 * QSTAGES + 4 * STAGES);
    // + 1024: the dynamic shared memory base is only 16-byte aligned; we round it up.
    static constexpr int SMEM = 1024 + QSTAGES * Q_BYTES + 2 * STAGES * KV_BYTES + BAR_BYTES;
    static constexpr int NT_S = BN / 8;                 // n8 tiles of scores per 16-row slab
    static constexpr int NT_O = DPAD / 8;
    // setmaxnreg: the producer keeps 24 registers, the consumers share the rest of the SM's
    // 64 K (a multiple of 8, at most 240): 240 with two consumers, 160 with three.
    static constexpr int PRODUCER_REGS = 24;
    static constexpr int CONSUMER_REGS_RAW = (65536 - PRODUCER_REGS * 128) / (128 * CONSUMERS);
    static constexpr int CONSUMER_REGS =
        (CONSUMER_REGS_RAW > 240 ? 240 : CONSUMER_REGS_RAW) / 8 * 8;
    static_assert(CONSUMERS == 2 || CONSUMERS == 3, "two or three consumer warpgroups");
    static_assert(QSTAGES == 1 || QSTAGES == 2, "one or two Q buffers");
    static_assert(DPAD % 64 == 0 && DPAD <= 256, "DPAD must be 64, 128, 192 or 256");
    static_assert(BN % 16 == 0 && BN >= 16 && BN <= 256, "BN must be a multiple of 16, <= 256");
    static_assert(PRODUCER_REGS * 128 + CONSUMER_REGS * 128 * CONSUMERS <= 65536,
                  "register budget of one SM");
};

// The work items (batch entry, query block) of one block, in order. Items are grouped into slots;
// block b takes slots b, b + gridDim.x, ... (the grid may be smaller than the number of slots:
// persistent launch). Without PAIRS a slot is one query block, heaviest first within a batch
// entry. With PAIRS (the causal mask, where query block m needs m + 1 key tiles) a slot is the
// pair of query blocks nm - 1 - r and r, so every slot holds nm + 1 tiles of work (the middle
// block of an odd nm comes alone): a static round-robin over slots is then balanced, where one
// over single blocks gave each block of a persistent launch the same query block in every round
// when gridDim.x % nm == 0 (up to 22% slower on the H200 than one block per item).
template <bool PAIRS>
struct WorkWalk {
    unsigned int nm, per_b, n_slots, slot, half;
    __device__ __forceinline__ explicit WorkWalk(const AttnParams& p)
        : nm(static_cast<unsigned int>(p.n_mblocks)),
          per_b(PAIRS ? (nm + 1) / 2 : nm),
          n_slots(per_b * static_cast<unsigned int>(p.nb0 * p.nb1 * p.nb2)),
          slot(blockIdx.x), half(0) {}
    __device__ __forceinline__ bool next(BlockCoord& c) {
        if (slot >= n_slots) return false;
        const unsigned int r = slot % per_b;
        c.b = slot / per_b;
        c.mblock = half ? r : nm - 1 - r;
        if (PAIRS && half == 0 && r != nm - 1 - r) {
            half = 1;
        } else {
            half = 0;
            slot += gridDim.x;
        }
        return true;
    }
};

// Key tiles of BN keys that query rows [row0, row0 + rows) need: none past Sq, and under the causal
// mask only up to the last key the last of those rows sees. The producer loads a block's tiles
// (rows = BM); each consumer computes only its own 64 rows' tiles: under the mask the upper
// warpgroups of a block skip a diagonal tile wherever a tile boundary falls between their rows'
// last keys (D = 256, BN = 80, S = 512: 32 warpgroup-tiles instead of 36 per four query
// blocks), and rows past Sq in a block's tail compute nothing.
template <bool CAUSAL, int BN>
__device__ __forceinline__ int tiles_needed(int row0, int rows, int sq, int sk) {
    return row0 >= sq ? 0 : (keys_needed<CAUSAL>(row0, rows, sq, sk) + BN - 1) / BN;
}

template <typename T, int DPAD, int BN, int STAGES, int QSTAGES, int CONSUMERS, bool OVERLAP,
          bool PINGPONG, bool CAUSAL>
__global__ void __launch_bounds__(WgmmaConfig<T, DPAD, BN, STAGES, QSTAGES, CONSUMERS>::THREADS, 1)
cuflash_fwd_wgmma(const __grid_constant__ HopperParams hp) {
    using Cfg = WgmmaConfig<T, DPAD, BN, STAGES, QSTAGES, CONSUMERS>;
    const AttnParams& p = hp.a;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const unsigned int q_s = (smem_addr(smem_raw) + 1023u) & ~1023u;
    const unsigned int k_s = q_s + QSTAGES * Cfg::Q_BYTES;       // + stage * KV_BYTES
    const unsigned int v_s = k_s + STAGES * Cfg::KV_BYTES;
    const unsigned int bars = v_s + STAGES * Cfg::KV_BYTES;
    // Q buffer qb holds the Q of work items wi with wi % QSTAGES == qb.
    const auto q_full = [bars](unsigned int qb) { return bars + 8u * qb; };
    const auto q_empty = [bars](unsigned int qb) { return bars + 8u * (QSTAGES + qb); };
    constexpr int KV_BAR0 = 2 * QSTAGES;
    const auto k_full = [bars](int st) { return bars + 8u * (KV_BAR0 + st); };
    const auto v_full = [bars](int st) { return bars + 8u * (KV_BAR0 + STAGES + st); };
    const auto k_empty = [bars](int st) { return bars + 8u * (KV_BAR0 + 2 * STAGES + st); };
    const auto v_empty = [bars](int st) { return bars + 8u * (KV_BAR0 + 3 * STAGES + st); };

    const int tid = threadIdx.x;
    const int sq = static_cast<int>(p.sq), sk = static_cast<int>(p.sk);
    const int diag = sk - sq;  // row i sees keys j <= i + diag
    // Producer and consumers walk the same items (WorkWalk); in a persistent launch the producer
    // loads the next item's Q and first K/V tiles while the consumers finish the current one.

    if (tid == 0) {
        for (int qb = 0; qb < QSTAGES; ++qb) {
            mbar_init(q_full(qb), 1);
            mbar_init(q_empty(qb), 4 * Cfg::CONSUMERS);  // one arrival per consumer warp
        }
        for (int st = 0; st < STAGES; ++st) {
            mbar_init(k_full(st), 1);
            mbar_init(v_full(st), 1);
            mbar_init(k_empty(st), 4 * Cfg::CONSUMERS);
            mbar_init(v_empty(st), 4 * Cfg::CONSUMERS);
        }
        mbar_fence_init();
    }
    __syncthreads();

    if (tid < 128) {
        // ---- producer warpgroup: one thread issues every copy.
        regs_dealloc<Cfg::PRODUCER_REGS>();
        if (tid != 0) return;
        const unsigned int n2 = static_cast<unsigned int>(p.nb2);
        const unsigned int n1 = static_cast<unsigned int>(p.nb1);
        const unsigned int cm = static_cast<unsigned int>(hp.coord_mask);
        unsigned int it = 0;  // K/V tiles loaded so far: stage it % STAGES, its use it / STAGES
        unsigned int wi = 0;  // work items so far
        WorkWalk<CAUSAL> walk(p);
        for (BlockCoord bc; walk.next(bc); ++wi) {
            const int row0 = static_cast<int>(bc.mblock) * Cfg::BM;
            const int n_tiles = tiles_needed<CAUSAL, BN>(row0, Cfg::BM, sq, sk);
            const unsigned int ub = static_cast<unsigned int>(bc.b);
            const int ix[3] = {static_cast<int>(ub / n2 / n1), static_cast<int>(ub / n2 % n1),
                               static_cast<int>(ub % n2)};
            // Tensor t's coordinates on batch axes 2, 1, 0 (innermost first): the batch index,
            // or 0 where t broadcasts over the axis.
            int c[3][3];
#pragma unroll
            for (int t = 0; t < 3; ++t)
#pragma unroll
                for (int ax = 0; ax < 3; ++ax) c[t][2 - ax] = (cm >> (3 * t + ax)) & 1u ? ix[ax] : 0;
            const auto load = [&](unsigned int dst, const TmaDesc* map, int t, int panel_bytes,
                                  int row, unsigned int bar, unsigned int bytes) {
                mbar_arrive_expect_tx(bar, bytes);
#pragma unroll
                for (int pn = 0; pn < Cfg::PANELS; ++pn)
                    tma_load_5d(dst + pn * panel_bytes, map, pn * 64, row, c[t][0], c[t][1],
                                c[t][2], bar);
            };
            // Q goes into its buffer once the consumers have computed the last scores of the item
            // that used it before (QSTAGES items back); the item's first K tile is requested
            // before that wait, so it is in flight meanwhile. With one buffer that wait holds up
            // every later load until the current item's last scores are in; with two, the
            // producer runs ahead by its K/V stages across item boundaries.
            const auto load_q = [&]() {
                const unsigned int qb = wi % QSTAGES;
                if (wi >= QSTAGES) mbar_wait(q_empty(qb), (wi / QSTAGES - 1) & 1);
                load(q_s + qb * Cfg::Q_BYTES, &hp.tm_q, 0, Cfg::Q_PANEL, row0, q_full(qb),
                     Cfg::Q_BYTES);
            };
            if (n_tiles == 0) load_q();
            for (int j = 0; j < n_tiles; ++j, ++it) {
                // Stage st held tile it - STAGES; K and V are released separately (K as soon as
                // its scores are computed), so K may come in while the old V is in use.
                const int st = it % STAGES;
                const unsigned int use = it / STAGES;
                if (it >= STAGES) mbar_wait(k_empty(st), (use - 1) & 1);
                load(k_s + st * Cfg::KV_BYTES, &hp.tm_k, 1, Cfg::KV_PANEL, j * BN, k_full(st),
                     Cfg::KV_BYTES);
                if (j == 0) load_q();
                if (it >= STAGES) mbar_wait(v_empty(st), (use - 1) & 1);
                load(v_s + st * Cfg::KV_BYTES, &hp.tm_v, 2, Cfg::KV_PANEL, j * BN, v_full(st),
                     Cfg::KV_BYTES);
            }
        }
        return;
    }

    // ---- consumer warpgroups
    regs_alloc<Cfg::CONSUMER_REGS>();
    // Consumer index (rows row0 + 64 * cw ...) and warp within the warpgroup (16 rows each),
    // broadcast from lane 0 so that the compiler knows them to be warp-uniform and keeps them,
    // and the per-item values derived from them, in uniform registers.
    const int cw = __shfl_sync(0xffffffffu, tid / 128, 0) - 1;
    const int warp = __shfl_sync(0xffffffffu, (tid / 32) % 4, 0);
    const int lane = tid % 32;
    const int g = lane / 4, t4 = lane % 4;
    const float scale_log2 = static_cast<float>(p.scale_log2);
    unsigned int q_wg = q_s + 64 * cw * 128;  // this consumer's 64 rows in each Q panel (per item)
    const int d = static_cast<int>(p.d);

    // PINGPONG: the consumers take turns to issue their matrix products, in the order 0, 1, ...,
    // so that while one warpgroup runs its softmax the tensor cores work for another, rather than
    // all consumers computing scores at once and then all running the softmax at once. Named
    // barrier 1 + c is "consumer c's turn": c waits on it (bar.sync) after the previous consumer
    // has arrived on it (bar.arrive) having issued its own products. The counts must match, so
    // turns are taken only for the first n_turns tiles of an item, the tiles every consumer
    // computes; a consumer's further tiles (its rows see more keys) go out without a turn. The
    // last consumer opens the first turn and consumer 0 absorbs the last arrival before it exits.
    const auto turn_take = [cw](bool turn) {
        if constexpr (PINGPONG) if (turn) named_bar_sync(1 + cw, 256);
    };
    const auto turn_pass = [cw](bool turn) {
        if constexpr (PINGPONG) if (turn) named_bar_arrive(1 + (cw + 1) % CONSUMERS, 256);
    };
    if (cw == CONSUMERS - 1) turn_pass(true);

    float acc_o[Cfg::NT_O][4];
    // wgmma's accumulator fragment of m64nN is the m16n8 layout of each warp's 16 rows, n8 tile
    // after n8 tile: the same registers viewed as [N / 8][4] or flat [N / 2].
    float(&o_flat)[DPAD / 2] = reinterpret_cast<float(&)[DPAD / 2]>(acc_o);
    float s[Cfg::NT_S][4];
    float(&s_flat)[BN / 2] = reinterpret_cast<float(&)[BN / 2]>(s);
    unsigned int pk[BN / 16][4];
    // S = Q K^T from stage st, DPAD / 16 wgmmas of k16; the k offset inside a 128-byte swizzled
    // row is a plain start-address offset of 32 bytes per step. Issued, not committed.
    const auto issue_s = [&](int st) {
#pragma unroll
        for (int kk = 0; kk < DPAD / 16; ++kk) {
            const unsigned int koff = (kk % 4) * 32;
            const unsigned long long da =
                wgmma_desc(q_wg + (kk / 4) * Cfg::Q_PANEL + koff, 16, 1024);
            const unsigned long long db =
                wgmma_desc(k_s + st * Cfg::KV_BYTES + (kk / 4) * Cfg::KV_PANEL + koff, 16, 1024);
            Wgmma<T, BN>::ss(s_flat, da, db, kk > 0 ? 1 : 0);
        }
    };
    // O += P V from stage st, BN / 16 wgmmas of k16 (16 keys = 16 rows of 128 bytes per panel).
    const auto issue_pv = [&](int st) {
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            const unsigned long long db =
                wgmma_desc(v_s + st * Cfg::KV_BYTES + kk * 16 * 128, Cfg::KV_PANEL, 1024);
            Wgmma<T, DPAD>::rs(o_flat, pk[kk], db, 1);
        }
    };
    // Every warp of the consumer arrives once on a barrier it is done with.
    const auto release = [lane](unsigned int bar) {
        __syncwarp();
        if (lane == 0) mbar_arrive(bar);
    };
    unsigned int it = 0;  // K/V tiles consumed so far, over all work items (as the producer)
    unsigned int wi = 0;
    // S_j has landed in registers: K_j's stage is free, and after the item's last tile Q is too
    // (the producer loads the next item's Q while this one's last P V and epilogue run).
    const auto scores_done = [&](int st, bool last) {
        release(k_empty(st));
        if (last) release(q_empty(wi % QSTAGES));
    };

    WorkWalk<CAUSAL> walk(p);
    for (BlockCoord bc; walk.next(bc); ++wi) {
        const int row0 = static_cast<int>(bc.mblock) * Cfg::BM;
        // This consumer's tiles and those every consumer computes (n_turns).
        const int n_tiles = tiles_needed<CAUSAL, BN>(row0 + 64 * cw, 64, sq, sk);
        int n_turns = n_tiles;
#pragma unroll
        for (int c = 0; c < CONSUMERS; ++c)
            n_turns = min(n_turns, tiles_needed<CAUSAL, BN>(row0 + 64 * c, 64, sq, sk));
        const int row_lo = row0 + 64 * cw + 16 * warp + g;  // the thread's rows: +0 and +8
        const int masked_from = first_masked_tile<CAUSAL>(row0 + 64 * cw, BN, sq, sk);
        const auto stage = [it](int j) { return static_cast<int>((it + j) % STAGES); };
        const auto parity = [it](int j) { return ((it + j) / STAGES) & 1u; };

        float m_run[2] = {neg_inf<float>(), neg_inf<float>()};
        float l_run[2] = {0.f, 0.f};
        float alpha[2];
#pragma unroll
        for (int i = 0; i < Cfg::NT_O; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_o[i][e] = 0.f;

        q_wg = q_s + (wi % QSTAGES) * Cfg::Q_BYTES + 64 * cw * 128;
        mbar_wait(q_full(wi % QSTAGES), (wi / QSTAGES) & 1u);
        if constexpr (!OVERLAP) {
            // Version 1a: each tile's products and softmax in sequence; other consumer
            // warpgroups fill the tensor cores meanwhile.
            for (int j = 0; j < n_tiles; ++j) {
                mbar_wait(k_full(stage(j)), parity(j));
                turn_take(j < n_turns);
                wgmma_fence();
                issue_s(stage(j));
                wgmma_commit();
                turn_pass(j < n_turns);
                wgmma_wait<0>();
                fence_regs(s_flat);
                scores_done(stage(j), j == n_tiles - 1);
                softmax_step<Cfg::NT_S, CAUSAL>(s, m_run, l_run, alpha, j >= masked_from, j * BN,
                                                t4, sk, row_lo, diag, scale_log2);
                rescale_rows<Cfg::NT_O>(acc_o, alpha);
                pack_p<T, Cfg::NT_S>(s, pk);
                mbar_wait(v_full(stage(j)), parity(j));
                wgmma_fence();
                issue_pv(stage(j));
                wgmma_commit();
                wgmma_wait<0>();
                fence_regs(o_flat);
                release(v_empty(stage(j)));
            }
        } else if (n_tiles > 0) {
            // Version 1b: the softmax of tile j runs while the tensor cores do P_{j-1} V_{j-1}.
            // S_j and P_{j-1} V_{j-1} go out as two commit groups; waiting for all but the newest
            // group returns S_j, then O is rescaled by alpha_j once P_{j-1} V_{j-1} is in it.
            mbar_wait(k_full(stage(0)), parity(0));
            turn_take(0 < n_turns);
            wgmma_fence();
            issue_s(stage(0));
            wgmma_commit();
            turn_pass(0 < n_turns);
            wgmma_wait<0>();
            fence_regs(s_flat);
            scores_done(stage(0), n_tiles == 1);
            softmax_step<Cfg::NT_S, CAUSAL>(s, m_run, l_run, alpha, 0 >= masked_from, 0, t4, sk,
                                            row_lo, diag, scale_log2);  // O is 0: no rescale
            pack_p<T, Cfg::NT_S>(s, pk);
            for (int j = 1; j < n_tiles; ++j) {
                mbar_wait(k_full(stage(j)), parity(j));
                mbar_wait(v_full(stage(j - 1)), parity(j - 1));
                turn_take(j < n_turns);
                wgmma_fence();
                issue_s(stage(j));
                wgmma_commit();
                issue_pv(stage(j - 1));
                wgmma_commit();
                turn_pass(j < n_turns);
                wgmma_wait<1>();  // S_j is in
                fence_regs(s_flat);
                scores_done(stage(j), j == n_tiles - 1);
                softmax_step<Cfg::NT_S, CAUSAL>(s, m_run, l_run, alpha, j >= masked_from, j * BN,
                                                t4, sk, row_lo, diag, scale_log2);
                wgmma_wait<0>();  // P_{j-1} V_{j-1} is in O
                fence_regs(o_flat);
                release(v_empty(stage(j - 1)));
                rescale_rows<Cfg::NT_O>(acc_o, alpha);
                pack_p<T, Cfg::NT_S>(s, pk);
            }
            mbar_wait(v_full(stage(n_tiles - 1)), parity(n_tiles - 1));
            wgmma_fence();
            issue_pv(stage(n_tiles - 1));
            wgmma_commit();
            wgmma_wait<0>();
            fence_regs(o_flat);
            release(v_empty(stage(n_tiles - 1)));
        }
        if (n_tiles == 0) release(q_empty(wi % QSTAGES));  // (else released with the last S)
        // The block's tiles past this consumer's: release their stages without using them, once
        // loaded (waiting for "full" first keeps the arrivals in the stage's current phase).
        const int n_block = tiles_needed<CAUSAL, BN>(row0, Cfg::BM, sq, sk);  // as loaded
        for (int j = n_tiles; j < n_block; ++j) {
            mbar_wait(k_full(stage(j)), parity(j));
            release(k_empty(stage(j)));
            mbar_wait(v_full(stage(j)), parity(j));
            release(v_empty(stage(j)));
        }
        it += n_block;

        // Epilogue: finish the row sums over the quad, divide once, write O and lse. It runs
        // while the producer already loads the next work item. O leaves in 16-byte stores (8
        // columns of a row per lane, after quad_transpose): with one 4-byte store per lane and
        // n8 tile the stores were throttled by the memory pipeline and took about a quarter of
        // the warps' time at D = 256, S = 512 (ncu source counters, notes/PERF.md).
        // Under a causal mask a row whose O is not finite is written by exact_row_pv instead
        // (common.cuh: a NaN or inf in V at a key the row cannot see must not reach it).
        const BatchOffsets off = batch_offsets(p, bc.b);
        T* o = static_cast<T*>(p.o) + off.o;
        float inv_h[2];
        int redo = 0;  // bit h: this quad's row h goes to the exact path
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float l = l_run[h];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            const int row = row_lo + 8 * h;
            const float inv = (l == 0.f) ? 0.f : 1.f / l;
            inv_h[h] = inv;
            if constexpr (CAUSAL) {
                float t = 0.f;  // NaN or inf anywhere in the row makes the sum non-finite
#pragma unroll
                for (int i = 0; i < Cfg::NT_O; ++i) t += acc_o[i][2 * h] + acc_o[i][2 * h + 1];
                int bad = !(fabsf(t) <= 3.0e38f);
                bad |= __shfl_xor_sync(0xffffffffu, bad, 1);
                bad |= __shfl_xor_sync(0xffffffffu, bad, 2);
                redo |= bad << h;
            }
            if (p.lse != nullptr && t4 == 0 && row < sq)
                p.lse[bc.b * p.sq + row] = row_lse(m_run[h], l, scale_log2);
            T* dst = o + static_cast<long long>(row) * p.o_sr;
#pragma unroll
            for (int c = 0; c < Cfg::NT_O / 4; ++c) {
                unsigned int w[4];
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    w[j] = pack2<T>(acc_o[4 * c + j][2 * h] * inv, acc_o[4 * c + j][2 * h + 1] * inv);
                quad_transpose(w, t4);  // (all lanes: the shuffles come before the row test)
                const int col = (4 * c + t4) * 8;  // D % 8 == 0: a chunk is all in or all out
                if (row < sq && col < d && !((redo >> h) & 1))
                    *reinterpret_cast<uint4*>(dst + col) = make_uint4(w[0], w[1], w[2], w[3]);
            }
        }
        if constexpr (CAUSAL) {
            if (__any_sync(0xffffffffu, redo != 0)) {  // non-finite inputs only
                const float m_c[2] = {m_run[0] == neg_inf<float>() ? 0.f : m_run[0] * scale_log2,
                                      m_run[1] == neg_inf<float>() ? 0.f : m_run[1] * scale_log2};
                for (int src = 0; src < 32; src += 4) {  // each quad's two rows, the whole warp
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int bits = __shfl_sync(0xffffffffu, redo, src);
                        const float mc = __shfl_sync(0xffffffffu, m_c[h], src);
                        const float inv = __shfl_sync(0xffffffffu, inv_h[h], src);
                        const int row = row0 + 64 * cw + 16 * warp + src / 4 + 8 * h;
                        if (!((bits >> h) & 1) || row >= sq) continue;
                        const int n_keys = max(0, min(sk, row + diag + 1));
                        exact_row_pv<T>(static_cast<const T*>(p.q) + off.q + row * p.q_sr,
                                        static_cast<const T*>(p.k) + off.k, p.k_sr,
                                        static_cast<const T*>(p.v) + off.v, p.v_sr,
                                        static_cast<int>(p.d), static_cast<int>(p.dv), n_keys,
                                        scale_log2, mc, inv, o + row * p.o_sr);
                    }
                }
            }
        }
    }
    if (cw == 0) turn_take(true);  // the last consumer's final pass (see turn_take above)
}

}  // namespace cuflash
