"""Host side of the decode kernel family (kernels_cu/attn_decode.cu): plans, the split choice,
the parameter blocks and the launches, for `attention` (dense K/V, few query rows) and for
`attention_with_kvcache` (contiguous or paged caches, in-place append).

The geometry a launch needs is a `DecodeGeometry`: up to three batch ("entry") axes, each with a
stride per tensor, a group axis of ``g`` query heads that share one kv head (stride 0 for K and
V), ``Sq`` query rows, and the K/V addressing (dense strides, or a cache with per-sequence
lengths along entry axis 1 and optionally a block table). Nothing here synchronises; the only
allocation is the split workspace (float32 partial outputs), taken from CuPy's pool.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import numpy as np

from . import _compile
from ._dispatch import _CXX_TYPE, Plan, _aligned16, head_dim_bucket, tensorcore_reason

_LOG2E = 1.4426950408889634

_DEC_PTRS = ("q", "k", "v", "o", "lse", "o_part", "lse_part", "seqlens", "block_table", "cu_q",
             "cu_k")
_DEC_INTS = (("sq", "sk", "d", "g", "nb0", "nb1", "nb2",
              "q_s0", "q_s1", "q_s2", "q_sg", "q_sr", "k_s0", "k_s1", "k_s2", "k_sr",
              "v_s0", "v_s1", "v_s2", "v_sr", "o_s0", "o_s1", "o_s2", "o_sg", "o_sr",
              "l_s0", "l_s1", "l_s2", "l_sg", "l_sr", "n_rtiles", "n_splits", "split_tiles",
              "page_log2", "bt_stride", "k_page", "v_page"))
#: kernels_cu/attn_decode.cu: DecodeParams (49 fields of 8 bytes).
DECODE_PARAMS_DTYPE = np.dtype([(f, np.uint64) for f in _DEC_PTRS]
                               + [(f, np.int64) for f in _DEC_INTS]
                               + [("scale_log2", np.float64)])
_APP_PTRS = ("k_new", "v_new", "k", "v", "seqlens", "block_table")
_APP_INTS = ("b", "snew", "hkv", "d", "nk_s1", "nk_sr", "nk_s2", "nv_s1", "nv_sr", "nv_s2",
             "k_s1", "k_sr", "k_s2", "v_s1", "v_sr", "v_s2", "page_log2", "bt_stride", "k_page",
             "v_page")
#: kernels_cu/attn_decode.cu: AppendParams (26 fields of 8 bytes).
APPEND_PARAMS_DTYPE = np.dtype([(f, np.uint64) for f in _APP_PTRS]
                               + [(f, np.int64) for f in _APP_INTS])

DECODE_DTYPES = ("float16", "bfloat16")
#: Keys per K/V tile and warps per block. A tile never straddles a cache page (pages >= BN).
DECODE_BN = 16
DECODE_WARPS = 4
#: Head-dim buckets of the decode kernel (smaller head dims are zero-padded).
DECODE_DPADS = (64, 128, 256)
#: Head-dim buckets up to which a block takes two 16-row tiles (32 packed rows: MT = 2) when an
#: entry has more than 16 packed rows, so that K and V are read once per 32 rows instead of once
#: per 16 (G = 32, or G * Sq > 16). At D = 256 two tiles' O would not fit in registers.
DECODE_MT2_MAX_DPAD = 128
#: `attention(kernel="auto")` takes the decode kernel up to this many query rows ...
DECODE_MAX_SQ = 16
#: ... and this many packed rows (query heads of a group x query rows) per kv head.
DECODE_MAX_ROWS = 128
#: Most splits (attn_decode.cu: MAX_SPLITS, the combine's shared weights).
MAX_SPLITS = 256
#: Fewest key tiles a warp walks per split: the split count is at most ceil(tiles / (warps x
#: this)), so that every warp of a split has a tile (the cost model of `choose_splits` decides
#: the rest).
MIN_TILES_PER_WARP = 1
#: Shared memory an SM offers (H100/H200: 228 KiB, 1 KiB of it reserved per block).
_SM_SMEM = 228 * 1024
#: Blocks per SM the registers allow (65536 registers / 128 threads x the most any dtype, mask or
#: layout takes), by (Dpad, MT), from the compile check (NVRTC 13.0, sm_80 and sm_90): D = 64
#: 96-126 registers -> 4, MT = 2 128-165 -> 3; D = 128 164-168 -> 3, MT = 2 236-249 -> 2;
#: D = 256 249-255 -> 1 (its shared memory holds it to 1 anyway).
DECODE_REG_BLOCKS = {(64, 1): 4, (64, 2): 3, (128, 1): 3, (128, 2): 2, (256, 1): 1}
#: The split cost model (`choose_splits`): the bandwidth the full grid streams K/V at (an H200
#: streams ~4.3 TB/s; only the ratios to the two times below matter), a block's fixed time (Q,
#: the first tile's latency, the warp merge and the stores) and the combine's (a dependent
#: launch and its small kernel), seconds.
DECODE_BW = 4.0e12
DECODE_T_BLOCK = 2e-6
DECODE_T_COMBINE = 3e-6
#: The kernels' version (a template argument of both, `decode_plan`, `combine_spec`): 8 is the
#: default since 2026-12-03 (session m: on the H200 0.98-0.99x cuDNN's GB/s on the decode grid's
#: geometric mean, version 6 0.96x in the same run, version 2 0.90x in session k's, and its
#: decode-facing GPU tests passed with it as the default; benchmarks/RESULTS.md "session m"); 2
#: was the default from 2026-12-02 (session i; session g measured it at 0.91x cuDNN, version 1
#: 0.82x). 2 has the one-pass epilogue (per-row weights once, float4 chunks), the combine with
#: all of a thread's partial loads in flight over a (rows, DECODE_COMBINE_CB) grid, and
#: `choose_splits_v2`
#: (benchmarks/bench_inference.py --impl cuflash-v2); 1 is session f's kernels and split rule
#: (--impl cuflash-v1); 3 is version 2 with the L2::256B prefetch hint on the K/V copies (same
#: results; a DRAM-efficiency experiment, --impl cuflash-v3); 4 (sm_90 only: `configure` refuses it
#: elsewhere) is version 2 with one bulk copy (cp.async.bulk on an mbarrier) per K/V row instead of
#: 16 lanes' 16-byte cp.async (same results; --impl cuflash-v4); 5 is version 2 with the K/V
#: copies under an evict-first L2 policy (createpolicy; same results; an L2 experiment,
#: --impl cuflash-v5); 6 is version 2 with the K/V tiles swizzled in shared memory (rows 128-byte
#: aligned, chunks XOR-swizzled, so a global line lands in one shared-memory segment; same
#: results; --impl cuflash-v6); 7 is version 2 with three K/V stages per warp at MT = 2
#: (`decode_stages`; same results; for G = 32 at short keys, where a warp walks few tiles:
#: notes/INFERENCE.md "Short keys with one kv head", --impl cuflash-v7); 8 is version 6's main
#: kernel with combine version 3 wherever the split count allows it (`combine_version`: one warp
#: a packed row, no block barrier; same results; notes/INFERENCE.md "The combine at short keys",
#: --impl cuflash-v8). Assigning it moves the call caches' generation on
#: (_callcache._WatchedModule), so records of another version miss.
DECODE_VERSION = 8
#: The kernel versions `decode_plan` takes.
DECODE_VERSIONS = (1, 2, 3, 4, 5, 6, 7, 8)
#: Version 2's split model (`choose_splits_v2`): a block's fixed time (Q and the first tile's
#: latency, the warp merge, the stores: version 2's epilogue is ~1/5 of version 1's
#: instructions) and the combine's (a dependent launch, the lse pass and one round trip to the
#: partials); the partials' traffic (written once, read once) is charged at DECODE_BW.
DECODE_T_BLOCK_V2 = 1.5e-6
DECODE_T_COMBINE_V2 = 3e-6
#: attn_decode.cu: COMBINE_LOADS, the partial rows one combine thread loads at once (version 2).
COMBINE_LOADS = 8
#: attn_decode.cu: combine3_splits, the most splits combine version 3 takes, per Dpad (a lane
#: holds every split's chunk of its row in registers; version 2 has CB = 1 up to 4096 / Dpad
#: splits, so version 3 keeps version 2's order).
COMBINE3_SPLITS = {64: 16, 128: 16, 256: 8}
#: Packed rows per block of combine version 3 (one warp each).
COMBINE3_ROWS = 4
#: The split rule of kernel versions 2-8 (version 1 keeps its own): 2, `choose_splits_v2` (the
#: default until session m: a wave of blocks streams at one warp's full-grid share, so a grid that
#: leaves slots empty is charged as a full wave); 3, `choose_splits_v3` (selectable only: the
#: kernel time is the larger of the K/V bytes at DECODE_BW_V3 and the busiest slot's serial
#: chain of latency-bound tiles, so a part-filled grid streams at the bytes' rate when its
#: warps can keep that many tiles in flight; notes/INFERENCE.md "Split rule 3").
#: 4 (the default since session m): rule 2's count, except one split (no combine) wherever rule
#: 3's model finds one split fastest: the H200 measured one split 2-16% faster than rule 2's
#: choice at exactly those short-key points (session j: (8, 1k, 32), (64, 1k, 8), (64, 1k, 32); a
#: tie at (64, 8k, 32)), while rule 3's other choices lost at long keys; under version 8 rule 4
#: measured +17% at (8, 1k, 32), +2-4% at (64, 1k, 8/32) and the same elsewhere (session m).
#: `decode_plan` puts the rule in the plan (its label ends in ",rule3" / ",rule4"), so a plan
#: made under one rule configures with it and its workspace size is that rule's; assigning the
#: flag moves the call caches' generation on, as DECODE_VERSION does.
DECODE_SPLIT_RULE = 4
#: The split rules `decode_plan` takes.
DECODE_SPLIT_RULES = (2, 3, 4)
#: Rule 3's model (`split_time_v3`), fitted to the H200 measurements of version 2 listed in
#: benchmarks/decode_model.py (MEASURED_V2; `--fit` prints the fit and the residuals): the K/V
#: streaming rate of a grid that keeps enough tiles in flight; per MT (row tiles a block), a
#: warp's latency-bound time per key tile (its two-stage cp.async pipeline alone) and a block's
#: fixed time (Q and the first tile's latency, the epilogue: the SASS count of version 2's
#: epilogue, 588 and 1116 instructions at 2 cycles); the combine's fixed time (a dependent
#: launch, the lse pass, one round trip); the partials are written and read at DECODE_BW_V3.
#: The fit (bw, both t_tile and t_combine free; 9 points): 3.82 TB/s, 2.36 / 2.31 us, 7.37 us,
#: rms 8.5% on log time, residuals -15% (B = 64, Sk = 1k, Hkv = 1) to +13% (B = 1, Sk = 1k,
#: Hkv = 1); adopted rounded, one t_tile for both MT (the fit does not separate them). Few
#: points: t_combine absorbs the short-key Hkv = 1 points' unexplained time.
DECODE_BW_V3 = 3.8e12
DECODE_T_TILE_V3 = {1: 2.4e-6, 2: 2.4e-6}
DECODE_T_BLOCK_V3 = {1: 1.7e-6, 2: 2.3e-6}
DECODE_T_COMBINE_V3 = 7.4e-6
#: The main kernel's launch and drain (the same for every split count: only the predicted
#: times of benchmarks/decode_model.py include it).
DECODE_T_LAUNCH_V3 = 2e-6


def decode_stages(version: int, mt: int) -> int:
    """K/V stages per warp of the decode kernel (attn_decode.cu: NS): 3 for version 7 at MT = 2,
    else 2."""
    return 3 if version == 7 and mt == 2 else 2


def decode_smem_bytes(dpad: int, bn: int = DECODE_BN, nwarps: int = DECODE_WARPS,
                      mt: int = 1, stages: int = 2) -> int:
    """Dynamic shared memory of one block: the Q tile (16 `mt` rows), then the warps' K/V
    `stages` (`decode_stages`), which the epilogue reuses for the warps' O, m and l (whichever
    is larger)."""
    s = dpad + 8
    rows = 16 * mt
    q = rows * s * 2
    kv = nwarps * stages * 2 * bn * s * 2
    epi = nwarps * rows * (dpad + 4) * 4 + 2 * nwarps * rows * 4
    return q + max(kv, epi)


def row_tiles_per_block(dpad: int, rows: int) -> int:
    """MT, the 16-row tiles a block of the decode kernel covers for an entry of `rows` packed
    rows (G * Sq): 2 when there are more than 16 and the head dim allows, else 1."""
    return 2 if rows > 16 and dpad <= DECODE_MT2_MAX_DPAD else 1


def decode_plan(dtype_name: str, d: int, causal: bool, paged: bool, rows: int = 1,
                version: Optional[int] = None, rule: Optional[int] = None) -> Plan:
    """The decode kernel for (dtype, D, causal, paged) and `rows` packed rows per entry
    (G * Sq; the largest sequence's for varlen): `row_tiles_per_block` picks MT, which the
    plan's block_m (16 MT rows) carries to `configure`. `version`: the kernels' version
    (None: DECODE_VERSION); its label ends in ",v1" / ",v3" for versions 1 and 3. `rule`: the
    split rule of versions 2-4 (None: DECODE_SPLIT_RULE; version 1 has its own and ignores it);
    rules 3 and 4 add ",rule3" / ",rule4" to the label (the kernel is the same: `rule_of` reads
    it back)."""
    version = DECODE_VERSION if version is None else version
    if version not in DECODE_VERSIONS:
        raise ValueError(f"decode kernel versions are {DECODE_VERSIONS} (got {version})")
    rule = DECODE_SPLIT_RULE if rule is None else rule
    if rule not in DECODE_SPLIT_RULES:
        raise ValueError(f"decode split rules are {DECODE_SPLIT_RULES} (got {rule})")
    if version == 1:
        rule = 2      # (version 1's own rule; the label stays version 1's)
    dpad = head_dim_bucket(d, DECODE_DPADS)
    mt = row_tiles_per_block(dpad, rows)
    name = (f"cuflash::cuflash_attn_decode<{_CXX_TYPE[dtype_name]}, {dpad}, {DECODE_BN}, "
            f"{DECODE_WARPS}, {mt}, {'true' if causal else 'false'}, "
            f"{'true' if paged else 'false'}, {version}>")
    label = (f"decode<{dtype_name},D{dpad},BN{DECODE_BN},W{DECODE_WARPS},"
             f"{'R32,' if mt == 2 else ''}"
             f"{'paged' if paged else 'dense'},{'causal' if causal else 'full'}"
             f"{'' if version == 2 else f',v{version}'}{'' if rule == 2 else f',rule{rule}'}>")
    spec = _compile.Specialisation("attn_decode", name, arch="sm_90" if version == 4 else None)
    return Plan(label, spec, 16 * mt, DECODE_BN, 32 * DECODE_WARPS,
                decode_smem_bytes(dpad, mt=mt, stages=decode_stages(version, mt)))


def version_of(plan) -> int:
    """The kernels' version of a decode `plan` (its kernel name's last template argument)."""
    return int(plan.spec.name.rsplit(",", 1)[1].strip(" >"))


def rule_of(plan) -> int:
    """The split rule of a decode `plan` (`decode_plan`: 3 or 4 when its label carries ",rule3"
    or ",rule4", else 2)."""
    for r in (3, 4):
        if plan.label.endswith(f",rule{r}>"):
            return r
    return 2


def combine_spec(dtype_name: str, dpad: int, version: int = 2):
    return _compile.Specialisation(
        "attn_decode",
        f"cuflash::cuflash_decode_combine<{_CXX_TYPE[dtype_name]}, {dpad}, {version}>")


def combine_version(version: int, splits: int, dpad: int) -> int:
    """The combine version that goes with decode kernel `version` at `splits` key splits and
    head-dim bucket `dpad`: 1 for kernel version 1; 3 for version 8 when 2 <= splits <=
    COMBINE3_SPLITS[dpad] (one warp a packed row; above that, version 2's column blocks keep
    more loads in flight a row); else 2 (versions 3-7 change only the main kernel)."""
    if version == 1:
        return 1
    if version == 8 and 2 <= splits <= COMBINE3_SPLITS[dpad]:
        return 3
    return 2


def combine_spec_for(plan, cfg):
    """The combine kernel that goes with decode `plan` (same dtype) for `cfg`: version
    ``cfg.comb_ver`` (`combine_version`)."""
    return combine_spec(_dtype_of(plan), cfg.dpad, cfg.comb_ver)


def combine_columns(splits: int, dpad: int, version: int = 2) -> int:
    """CB, the column blocks per packed row of the combine's grid (rows, CB) for combine
    `version` (`combine_version`): version 2 takes
    the least power of two (at most DPAD / 4, the row's float4 chunks) with which no thread has
    more than COMBINE_LOADS splits (a block of 128 threads covers DPAD / 4 / CB chunks with
    128 CB / (DPAD / 4) split groups); versions 1 and 3: 1."""
    if version in (1, 3) or splits <= 1:
        return 1
    ch = dpad // 4
    cb = 1
    while cb < ch and -(-splits // (COMBINE_THREADS * cb // ch)) > COMBINE_LOADS:
        cb *= 2
    return cb


def append_spec(dtype_name: str, paged: bool):
    return _compile.Specialisation(
        "attn_decode",
        f"cuflash::cuflash_kv_append<{_CXX_TYPE[dtype_name]}, {'true' if paged else 'false'}>")


def all_decode_specialisations():
    """Every specialisation of the family, for the compile check."""
    out = []
    for dt in DECODE_DTYPES:
        for dpad in DECODE_DPADS:
            for causal in (False, True):
                for paged in (False, True):
                    for ver in (2, 1, 3, 4, 5, 6, 7, 8):
                        out.append(decode_plan(dt, dpad, causal, paged, version=ver).spec)
                        if dpad <= DECODE_MT2_MAX_DPAD:
                            out.append(decode_plan(dt, dpad, causal, paged, rows=32,
                                                   version=ver).spec)
            out.extend(combine_spec(dt, dpad, ver) for ver in (2, 1, 3))
        out.extend(append_spec(dt, paged) for paged in (False, True))
    return out


def blocks_per_sm(plan, dpad: int) -> int:
    """Blocks of a decode `plan` (head-dim bucket `dpad`) one SM holds at once: the least of
    what shared memory (the SM's 228 KiB, 1 KiB reserved per block) and the registers
    (DECODE_REG_BLOCKS) allow."""
    regs = DECODE_REG_BLOCKS.get((dpad, plan.block_m // 16), 1)
    return max(1, min(_SM_SMEM // (plan.smem_bytes + 1024), regs))


def choose_splits(work: int, n_key_tiles: int, sm_count: int, per_sm: int,
                  tile_bytes: int, part_bytes: int = 0, version: Optional[int] = None,
                  rule: Optional[int] = None, mt: int = 1) -> int:
    """Key splits per (entry, row block), from the problem and the SM count only (so results are
    reproducible run to run).

    `work`: blocks per split (entries x row blocks); `n_key_tiles`: key tiles (DECODE_BN keys)
    an entry has; `per_sm`: blocks an SM holds (`blocks_per_sm`); `tile_bytes`: the K and V
    bytes of one key tile (2 x BN x Dpad x 2).

    Model (decoding is memory-bound: notes/INFERENCE.md, "Split heuristic"): the GPU streams K
    and V at DECODE_BW when every block slot (SMs x per_sm, NWARPS warps each) is busy, so one
    warp streams DECODE_BW / (slots x NWARPS), and a block whose warps walk at most
    ceil(tiles / NWARPS) tiles each takes DECODE_T_BLOCK plus that many tiles at the warp's
    rate. s splits run ceil(work s / slots) waves of such blocks, plus DECODE_T_COMBINE when
    s > 1. The smallest s within 3% of the least modelled time wins. Saturation is assumed
    only at full occupancy (a wave of fewer blocks is charged as a full one), which errs
    towards filling the GPU: an idle slot costs bandwidth, an extra split only the small
    partials' traffic. The result is cached per arguments and model constants (the module's
    values at the call, so a changed constant is seen).

    That is version 1's rule (`version`, default DECODE_VERSION); version 2's is
    `choose_splits_v2`, which also charges `part_bytes`, the partial output one block writes
    (its packed rows x Dpad x 4 bytes). Versions 2-4 take the split `rule` (None:
    DECODE_SPLIT_RULE): 2 `choose_splits_v2`, 3 `choose_splits_v3`, which also reads `mt`, the
    plan's row tiles per block, 4 rule 2's count except 1 where rule 3's is 1."""
    version = DECODE_VERSION if version is None else version
    if version != 1:
        rule = DECODE_SPLIT_RULE if rule is None else rule
        if rule == 3:
            return choose_splits_v3(work, n_key_tiles, sm_count, per_sm, tile_bytes,
                                    part_bytes, mt)
        if rule == 4 and choose_splits_v3(work, n_key_tiles, sm_count, per_sm, tile_bytes,
                                          part_bytes, mt) == 1:
            return 1
        return choose_splits_v2(work, n_key_tiles, sm_count, per_sm, tile_bytes, part_bytes)
    return _choose_splits(work, n_key_tiles, sm_count, per_sm, tile_bytes, DECODE_WARPS,
                          MIN_TILES_PER_WARP, MAX_SPLITS, DECODE_BW, DECODE_T_BLOCK,
                          DECODE_T_COMBINE)


def choose_splits_v2(work: int, n_key_tiles: int, sm_count: int, per_sm: int, tile_bytes: int,
                     part_bytes: int) -> int:
    """Version 2's split count (arguments as `choose_splits`). Version 1's model (a wave of
    blocks streams as if every slot were busy, which errs towards filling the GPU: without a
    measurement of how few blocks saturate HBM, an idle slot is the costlier mistake) with
    version 2's constants (DECODE_T_BLOCK_V2, DECODE_T_COMBINE_V2) and the partials' traffic:
    s > 1 adds work x s x part_bytes, written and read back, at DECODE_BW. With G = 32 rows a
    split's partial is 16 KB (D = 128) against 8 KB of K and V per key tile, so at short keys
    the partials are not small. The smallest s within 3% of the least modelled time wins;
    caps as version 1's (a tile per warp, <= 8 waves, <= MAX_SPLITS). Cached per arguments and
    model constants."""
    return _choose_splits_v2(work, n_key_tiles, sm_count, per_sm, tile_bytes, part_bytes,
                             DECODE_WARPS, MIN_TILES_PER_WARP, MAX_SPLITS, DECODE_BW,
                             DECODE_T_BLOCK_V2, DECODE_T_COMBINE_V2)


def split_time_v2(work, n_key_tiles, s, slots, tile_bytes, part_bytes, warps=None, bw=None,
                  t_block=None, t_combine=None):
    """Version 2's modelled time (seconds) of `s` splits (see `choose_splits_v2`); None
    arguments take the module's constants. Returns (time, waves)."""
    warps = DECODE_WARPS if warps is None else warps
    bw = DECODE_BW if bw is None else bw
    t_block = DECODE_T_BLOCK_V2 if t_block is None else t_block
    t_combine = DECODE_T_COMBINE_V2 if t_combine is None else t_combine
    blocks = max(1, work) * s
    t_tile = tile_bytes * slots * warps / bw   # one tile at one warp's share of a full wave
    per_warp = -(-(-(-n_key_tiles // s)) // warps)   # tiles of a split's busiest warp
    waves = -(-blocks // slots)
    t = waves * (t_block + per_warp * t_tile)
    if s > 1:
        t += t_combine + 2 * blocks * part_bytes / bw
    return t, waves


@functools.lru_cache(maxsize=4096)
def _choose_splits_v2(work, n_key_tiles, sm_count, per_sm, tile_bytes, part_bytes, warps,
                      min_tiles, max_splits, bw, t_block, t_combine):
    slots = max(1, sm_count * per_sm)
    work = max(1, work)
    cap = max(1, -(-n_key_tiles // (warps * min_tiles)))
    cap = min(cap, max(1, -(-8 * slots // work)), max_splits)
    times = [split_time_v2(work, n_key_tiles, s, slots, tile_bytes, part_bytes, warps, bw,
                           t_block, t_combine)[0] for s in range(1, cap + 1)]
    best = min(times)
    return next(s for s, t in enumerate(times, 1) if t <= best * 1.03)


def choose_splits_v3(work: int, n_key_tiles: int, sm_count: int, per_sm: int, tile_bytes: int,
                     part_bytes: int, mt: int = 1) -> int:
    """Split rule 3 (arguments as `choose_splits`; `mt`: the plan's row tiles per block): the
    least modelled `split_time_v3` over the same caps as rules 1 and 2 (every warp of a split has
    a tile, <= 8 waves' worth of blocks, <= MAX_SPLITS), the smallest s within 3% of it. A
    function of the problem and the device only; cached per arguments and model constants."""
    return _choose_splits_v3(work, n_key_tiles, sm_count, per_sm, tile_bytes, part_bytes, mt,
                             DECODE_WARPS, MIN_TILES_PER_WARP, MAX_SPLITS, DECODE_BW_V3,
                             DECODE_T_TILE_V3[mt], DECODE_T_BLOCK_V3[mt], DECODE_T_COMBINE_V3)


def split_time_v3(work, n_key_tiles, s, slots, tile_bytes, part_bytes, mt=1, warps=None,
                  bw=None, t_tile=None, t_block=None, t_combine=None):
    """Rule 3's modelled GPU time (seconds, without the main kernel's launch) of `s` splits:

        max(K/V bytes / bw, waves x (t_block + tiles of a split's busiest warp x t_tile))
        + [s > 1] (t_combine + 2 x blocks x part_bytes / bw)

    The first term is the streaming rate of a grid that keeps enough tiles in flight, the
    second the chain of the busiest slot (its waves of blocks run one after another, and a warp
    alone takes t_tile a tile), so a grid of few blocks costs its latency and a grid of one or
    a few waves costs its bytes (rule 2 charged every wave as a full grid's share: one split
    at B = 8, Sk = 1k, Hkv = 32, 256 blocks of 396 slots, 53 us modelled against 40 measured,
    which made it pick 3). `s` is taken as `configure`
    takes it (ceil(tiles / ceil(tiles / s)) splits). None arguments: the module's constants for
    `mt`. Returns (time, waves, s)."""
    warps = DECODE_WARPS if warps is None else warps
    bw = DECODE_BW_V3 if bw is None else bw
    t_tile = DECODE_T_TILE_V3[mt] if t_tile is None else t_tile
    t_block = DECODE_T_BLOCK_V3[mt] if t_block is None else t_block
    t_combine = DECODE_T_COMBINE_V3 if t_combine is None else t_combine
    work = max(1, work)
    tiles = max(1, n_key_tiles)
    split_tiles = -(-tiles // s)
    s = -(-tiles // split_tiles)
    blocks = work * s
    waves = -(-blocks // slots)
    per_warp = -(-split_tiles // warps)
    t = max(work * tiles * tile_bytes / bw, waves * (t_block + per_warp * t_tile))
    if s > 1:
        t += t_combine + 2 * blocks * part_bytes / bw
    return t, waves, s


@functools.lru_cache(maxsize=4096)
def _choose_splits_v3(work, n_key_tiles, sm_count, per_sm, tile_bytes, part_bytes, mt, warps,
                      min_tiles, max_splits, bw, t_tile, t_block, t_combine):
    slots = max(1, sm_count * per_sm)
    work = max(1, work)
    cap = max(1, -(-n_key_tiles // (warps * min_tiles)))
    cap = min(cap, max(1, -(-8 * slots // work)), max_splits)
    times = [split_time_v3(work, n_key_tiles, s, slots, tile_bytes, part_bytes, mt, warps, bw,
                           t_tile, t_block, t_combine)[0] for s in range(1, cap + 1)]
    best = min(times)
    return next(s for s, t in enumerate(times, 1) if t <= best * 1.03)


@functools.lru_cache(maxsize=4096)
def _choose_splits(work, n_key_tiles, sm_count, per_sm, tile_bytes, warps, min_tiles,
                   max_splits, bw, t_block, t_combine):
    slots = max(1, sm_count * per_sm)
    work = max(1, work)
    cap = max(1, -(-n_key_tiles // (warps * min_tiles)))
    cap = min(cap, max(1, -(-8 * slots // work)), max_splits)  # <= ~8 waves of blocks
    t_tile = tile_bytes * slots * warps / bw   # one tile at one warp's rate
    times = []
    for s in range(1, cap + 1):
        per_warp = -(-(-(-n_key_tiles // s)) // warps)  # tiles of a split's busiest warp
        waves = -(-work * s // slots)
        times.append(waves * (t_block + per_warp * t_tile) + (t_combine if s > 1 else 0.0))
    best = min(times)
    return next(s for s, t in enumerate(times, 1) if t <= best * 1.03)


@dataclass
class DecodeGeometry:
    """Everything a decode launch addresses: see the module docstring and DecodeParams."""

    sizes: tuple                 # (nb0, nb1, nb2) entry axes
    g: int
    sq: int
    sk: int                      # keys (the largest sequence's for a cache)
    d: int
    q: tuple                     # strides (s0, s1, s2, sg, sr)
    o: tuple                     # (s0, s1, s2, sg, sr)
    l: tuple                     # (s0, s1, s2, sg, sr); zeros when no lse
    k: tuple                     # (s0, s1, s2, sr)
    v: tuple
    seqlens: object = None       # CuPy int32 (nb1,) or None
    block_table: object = None   # CuPy int32 (nb1, max_pages) or None
    page: int = 0
    k_page: int = 0
    v_page: int = 0
    cu_q: object = None          # CuPy int32 (nb1 + 1,): packed variable-length batch, or None
    cu_k: object = None

    @property
    def entries(self):
        return self.sizes[0] * self.sizes[1] * self.sizes[2]


@dataclass(frozen=True)
class DecodeLaunch:
    """The launch configuration of one decode call (`configure`): row tiles, key splits, grid,
    and the bytes of split partials it needs (0 with one split)."""

    entries: int
    rows: int                    # packed rows per entry: G * Sq
    n_rtiles: int                # 16-row tiles per entry (a multiple of the plan's MT)
    splits: int
    split_tiles: int
    grid: int
    dpad: int
    comb_cb: int = 1             # the combine's column blocks per row (`combine_columns`)
    comb_ver: int = 2            # the combine's version (`combine_version`)

    @property
    def comb_grid(self) -> tuple:
        """The combine's grid: (packed rows of every entry, column blocks); combine version 3:
        (ceil(packed rows / COMBINE3_ROWS), 1), a warp a row."""
        if self.comb_ver == 3:
            return (-(-self.entries * self.rows // COMBINE3_ROWS), 1)
        return (self.entries * self.rows, self.comb_cb)

    @property
    def o_part_bytes(self) -> int:
        return _align(4 * self.entries * self.splits * 16 * self.n_rtiles * self.dpad)

    @property
    def part_bytes(self) -> int:
        """Workspace bytes of the split partials: (entries, splits, R, Dpad) float32 partial
        outputs, then (entries, splits, R) float32 partial lse, R = 16 * n_rtiles, each section
        WORKSPACE_ALIGN-aligned; 0 when the keys are not split."""
        if self.splits == 1:
            return 0
        return self.o_part_bytes + _align(4 * self.entries * self.splits * 16 * self.n_rtiles)


def _align(n: int) -> int:
    from ._launch import WORKSPACE_ALIGN

    return -(-n // WORKSPACE_ALIGN) * WORKSPACE_ALIGN


def configure(plan, sizes, g, sq, sk, d, attrs) -> DecodeLaunch:
    """Check and choose the launch of `plan` over entry axes `sizes`, `g` query heads per kv
    head, `sq` query rows, `sk` keys (the most a sequence has) and head dim `d` on a device with
    `attrs` (max_smem_optin, sm_count). Host arithmetic only: the size queries use it too."""
    from ._launch import MAX_GRID_X

    rows = g * sq
    mt = plan.block_m // 16          # 16-row tiles per block (decode_plan: MT)
    n_rblocks = -(-rows // (16 * mt))
    n_rtiles = n_rblocks * mt        # 16-row tiles per entry, padded to a multiple of MT
    n_key_tiles = -(-sk // DECODE_BN)
    entries = sizes[0] * sizes[1] * sizes[2]
    dpad = head_dim_bucket(d, DECODE_DPADS)
    if max(sq, sk, rows) >= 2**31 - 1024:
        raise ValueError(f"Sq, Sk and G * Sq must be below 2**31 - 1024 (got {sq}, {sk}, {rows})")
    if plan.smem_bytes > attrs["max_smem_optin"]:
        raise ValueError(f"{plan.label} needs {plan.smem_bytes} bytes of shared memory per "
                         f"block; this GPU allows {attrs['max_smem_optin']}")
    version = version_of(plan)
    if version == 4 and attrs.get("compute_capability", 90) != 90:
        raise ValueError(f"{plan.label}: decode kernel version 4 (bulk copies) runs on sm_90 "
                         f"only (this GPU: {attrs['compute_capability']}); set "
                         "cuflash._decode.DECODE_VERSION to 2")
    splits = choose_splits(entries * n_rblocks, n_key_tiles, attrs["sm_count"],
                           blocks_per_sm(plan, dpad), 2 * DECODE_BN * dpad * 2,
                           min(rows, 16 * mt) * dpad * 4, version=version, rule=rule_of(plan),
                           mt=mt)
    split_tiles = max(1, -(-n_key_tiles // splits))
    splits = max(1, -(-n_key_tiles // split_tiles))
    grid = entries * n_rblocks * splits
    if grid > MAX_GRID_X:
        raise ValueError(f"{plan.label}: {grid} blocks is too many for one launch")
    if splits > 1 and entries * rows > MAX_GRID_X:   # the combine's grid (one split: none)
        raise ValueError(f"{plan.label}: {entries * rows} combine rows is too many for one "
                         "launch")
    comb_ver = combine_version(version, splits, dpad)
    return DecodeLaunch(entries, rows, n_rtiles, splits, split_tiles, grid, dpad,
                        combine_columns(splits, dpad, comb_ver), comb_ver)


def scratch(nbytes, workspace, stream, query):
    """A flat uint8 GPU buffer of at least `nbytes` for one call's scratch: the caller's
    `workspace` (checked: size, alignment; `query` names the size query in the error), or
    without one a CuPy pool allocation made on the launch `stream` (the pool then hands the
    block to later work only in that stream's order); None when nothing is needed."""
    from ._launch import workspace_base

    if workspace is not None:
        workspace_base(workspace, nbytes, query)
        return workspace
    if nbytes == 0:
        return None
    import cupy

    with stream:
        return cupy.empty(nbytes, dtype=cupy.uint8)


def decode_params(plan, geom, q, k, v, o, lse, *, scale, cfg, parts=None):
    """The DecodeParams block (a NumPy structured scalar) of one launch of `plan` for `geom`
    with the configuration `cfg`; `parts` as in `launch`. Everything after its first
    DECODE_PTRS_FIXED pointers (q, k, v, o, lse, o_part, lse_part) is a function of the plan,
    the geometry (and, paged or packed, of the seqlens / block table / cu arrays' addresses),
    the configuration and the scale: `_callcache` keeps those bytes per call signature."""
    o_part = lse_part = 0
    if cfg.splits > 1:
        if parts is None or parts.nbytes < cfg.part_bytes:
            raise ValueError(f"{plan.label}: the split partials need {cfg.part_bytes} bytes")
        o_part = parts.data.ptr
        lse_part = o_part + cfg.o_part_bytes
    paged = geom.block_table is not None
    # One tuple in DecodeParams order (a structured array built field by field costs ~50 us).
    return np.array((
        q.data.ptr, k.data.ptr, v.data.ptr, o.data.ptr, 0 if lse is None else lse.data.ptr,
        o_part, lse_part, 0 if geom.seqlens is None else geom.seqlens.data.ptr,
        geom.block_table.data.ptr if paged else 0,
        0 if geom.cu_q is None else geom.cu_q.data.ptr,
        0 if geom.cu_k is None else geom.cu_k.data.ptr,
        geom.sq, geom.sk, geom.d, geom.g, *geom.sizes, *geom.q, *geom.k, *geom.v, *geom.o,
        *geom.l, cfg.n_rtiles, cfg.splits, cfg.split_tiles,
        int(geom.page).bit_length() - 1 if paged else 0,
        geom.block_table.shape[1] if paged else 0, geom.k_page if paged else 0,
        geom.v_page if paged else 0, scale * _LOG2E), dtype=DECODE_PARAMS_DTYPE)[()]


#: The pointers at the front of DecodeParams that change from call to call of one signature of
#: dense `attention` (q, k, v, o, lse, o_part, lse_part; the four after them are 0 there).
DECODE_PTRS_FIXED = 7


def launch(plan, geom, q, k, v, o, lse, *, scale, device_id, stream, cfg, parts=None):
    """Launch the decode kernel (and, with more than one split, the combine) for `geom` with the
    configuration `cfg` (`configure`). `parts`: a uint8 GPU buffer of at least
    ``cfg.part_bytes`` (required when the keys are split); `stream`: a CuPy stream object."""
    params = decode_params(plan, geom, q, k, v, o, lse, scale=scale, cfg=cfg, parts=parts)
    kern = _compile.get_kernel(plan.spec, device_id, plan.smem_bytes)
    kern((cfg.grid,), (plan.threads,), (params,), shared_mem=plan.smem_bytes, stream=stream)
    if cfg.splits > 1:
        comb = _compile.get_kernel(combine_spec_for(plan, cfg), device_id)
        comb(cfg.comb_grid, (COMBINE_THREADS,), (params,), stream=stream)
    return cfg.splits


#: Threads per block of the combine kernel (versions 1 and 2: one block per packed output row,
#: or per column block of one; version 3: COMBINE3_ROWS rows, a warp each).
COMBINE_THREADS = 128


def _dtype_of(plan):
    return plan.label.split("<", 1)[1].split(",", 1)[0]


def cache_reason(prob, compute_capability, buffers) -> Optional[str]:
    """Why the decode kernel cannot run a KV-cache or varlen problem (anything with dtype_name,
    d, dv, scale), or None. `buffers`: the GPU arrays it reads or writes (None entries skipped)."""
    if compute_capability < 80:
        return f"it needs compute capability 8.0 or newer (this GPU: {compute_capability})"
    if prob.dtype_name not in DECODE_DTYPES:
        return (f"the decode kernel takes float16 and bfloat16; {prob.dtype_name} runs on the "
                "CPU path only for now")
    if prob.d != prob.dv or prob.d % 8:
        return f"it needs D == Dv and D % 8 == 0 (got D={prob.d}, Dv={prob.dv})"
    if not prob.scale > 0:
        return f"it folds a positive scale into exp2 (got scale={prob.scale})"
    if not all(_aligned16(x) for x in buffers if x is not None):
        return "every row of every input and output must start on a 16-byte boundary"
    return None


def attrs_or_raise(prob, entry_point, buffers):
    """The device attributes of `prob`'s GPU, or ValueError naming `entry_point` and why the
    decode kernel cannot run it (`cache_reason`)."""
    from ._launch import device_attributes

    attrs = device_attributes(prob.device_id)
    why = cache_reason(prob, attrs["compute_capability"], buffers)
    if why is not None:
        raise ValueError(f"{entry_point} cannot run these GPU inputs: {why}")
    return attrs


# ---------------------------------------------------------------------------------------------
# `attention` through the decode kernel

def _batch_geometry(prob, o, lse):
    """(sizes, g, strides per tensor) of a dense problem as entries x group, or a reason string
    when its collapsed batch layout has no such form."""
    from ._launch import _RowsView, collapse_batch

    tensors = [prob.q, prob.k, prob.v, o] + ([_RowsView(lse)] if lse is not None else [])
    sizes, bstr, rstr = collapse_batch(prob.batch_shape, *tensors)
    g, sg = 1, [0] * len(tensors)
    if sizes and bstr[1][-1] == 0 and bstr[2][-1] == 0 and bstr[0][-1] != 0:
        g = sizes.pop()
        sg = [s.pop() for s in bstr]
    if len(sizes) > 3:
        return "more than three batch axes that no stride pattern merges"
    while len(sizes) < 3:
        sizes.insert(0, 1)
        for s in bstr:
            s.insert(0, 0)
    return sizes, g, bstr, rstr, sg


def decode_reason(prob, compute_capability, o=None, lse=None) -> Optional[str]:
    """Why the decode kernel cannot run this `attention` problem, or None if it can."""
    why = tensorcore_reason(prob, compute_capability)
    if why is not None:
        return why
    if prob.dtype_name not in DECODE_DTYPES:
        return f"it takes float16 and bfloat16 inputs, not {prob.dtype_name}"
    geo = _batch_geometry(prob, prob.q if o is None else o, lse)
    if isinstance(geo, str):
        return geo
    return None


def wants_decode(prob, compute_capability) -> bool:
    """Whether `attention(kernel="auto")` should take the decode kernel: few query rows, the
    query heads of a group packed into at most DECODE_MAX_ROWS rows, and the kernel able to run."""
    if prob.sq > DECODE_MAX_SQ or prob.backend != "gpu":
        return False
    if prob.causal and prob.sq > 1:
        # Under a causal mask with Sq > 1 some rows cannot see the last keys, and the tensor-core
        # P.V would add 0 * NaN from a non-finite V there (the Hopper kernel's known defect);
        # the dense kernels keep NaN out of hidden rows, so auto leaves these to them.
        return False
    if decode_reason(prob, compute_capability) is not None:
        return False
    g = _batch_geometry(prob, prob.q, None)[1]
    return g * prob.sq <= DECODE_MAX_ROWS


def dense_rows(prob) -> int:
    """Packed rows per entry (G * Sq) of a dense `attention` problem, for `decode_plan`."""
    geo = _batch_geometry(prob, prob.q, None)
    return prob.sq if isinstance(geo, str) else geo[1] * prob.sq


def _dense_geometry(plan, prob, o, lse):
    geo = _batch_geometry(prob, o, lse)
    if isinstance(geo, str):
        raise ValueError(f"{plan.label} cannot address these buffers: {geo}")
    sizes, g, bstr, rstr, sg = geo
    l_str = (tuple(bstr[4]) + (sg[4], rstr[4])) if lse is not None else (0, 0, 0, 0, 0)
    return DecodeGeometry(
        sizes=tuple(sizes), g=g, sq=prob.sq, sk=prob.sk, d=prob.d,
        q=tuple(bstr[0]) + (sg[0], rstr[0]), o=tuple(bstr[3]) + (sg[3], rstr[3]), l=l_str,
        k=tuple(bstr[1]) + (rstr[1],), v=tuple(bstr[2]) + (rstr[2],))


class _Contiguous:
    """Shape and strides of the C-contiguous output `attention` allocates when out= is not
    given (what the geometry of a size query needs)."""

    def __init__(self, shape, itemsize):
        self.shape, self.itemsize, self.ndim = tuple(shape), itemsize, len(shape)
        self.strides = tuple(int(np.prod(shape[i + 1:])) * itemsize for i in range(len(shape)))


def dense_workspace_bytes(plan, prob, attrs) -> int:
    """Workspace bytes `attention` needs for `prob` on `plan` (a decode plan): the split
    partials, for the outputs the call would write (prob.out, or fresh contiguous ones)."""
    o = prob.out if prob.out is not None else _Contiguous(prob.o_shape, prob.q.itemsize)
    lse = prob.out_lse
    if lse is None and prob.return_lse:
        lse = _Contiguous(prob.lse_shape, 4)
    geom = _dense_geometry(plan, prob, o, lse)
    return configure(plan, geom.sizes, geom.g, geom.sq, geom.sk, geom.d, attrs).part_bytes


def dense_config(plan, prob, o, lse, attrs):
    """(DecodeGeometry, DecodeLaunch) of `attention` on the decode kernel for these outputs."""
    geom = _dense_geometry(plan, prob, o, lse)
    return geom, configure(plan, geom.sizes, geom.g, geom.sq, geom.sk, geom.d, attrs)


def launch_dense(plan, prob, o, lse, attrs):
    """`attention` on the decode kernel: K and V are the dense tensors of `prob`; the split
    partials go to ``prob.workspace`` (or a pool allocation on the launch stream)."""
    from ._launch import _stream_ptr

    if any(not _aligned16(x) for x in (o,)):
        raise ValueError("out: every row must start on a 16-byte boundary for the decode kernel")
    geom, cfg = dense_config(plan, prob, o, lse, attrs)
    st = _stream_ptr(prob.stream)
    parts = scratch(cfg.part_bytes, getattr(prob, "workspace", None), st,
                    "attention_workspace_size")
    return launch(plan, geom, prob.q, prob.k, prob.v, o, lse, scale=prob.scale,
                  device_id=prob.device_id, stream=st, cfg=cfg, parts=parts)
