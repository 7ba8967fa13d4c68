#!/usr/bin/env python
"""The decode kernel's launch at every point of issue 14's decode grid (H = 32, D = 128,
float16, Sq = 1) on an H200 (132 SMs), from the host's own rules (`_decode.decode_plan`,
`configure`, `choose_splits`), and the time the split model predicts, before (one 16-row tile
per block, the old wave-count split rule) and now. No GPU needed::

    PYTHONPATH=. python benchmarks/decode_model.py [--host-us 20] [--markdown]

Columns: E entries (B x Hkv), G rows per entry, MT row tiles per block, RB row blocks per entry
(K and V are read RB times), s splits, grid blocks, slots (SMs x blocks per SM), waves, MB read
per block, KB in flight per SM (warps x one 8 KB tile each, the least a two-stage warp holds
while it waits), the modelled time (host + kernel + combine) and GB/s of K + V counted once.
The model: `_decode.choose_splits`'s (full occupancy streams DECODE_BW; a block costs
DECODE_T_BLOCK plus its busiest warp's tiles at one warp's share; the combine DECODE_T_COMBINE),
and --host-us of host time before the first launch, which the benchmark's events include."""
from __future__ import annotations

import argparse

from cuflash import _decode

H, D, SM = 32, 128, 132
GRID = [(b, sk, hkv) for b in (1, 8, 64) for sk in (1024, 8192, 32768, 131072)
        for hkv in (32, 8, 1)]
ATTRS = dict(max_smem_optin=227 * 1024, sm_count=SM)


def _old_splits(work, n_key_tiles, slots):
    """The rule before: fewest waves per split within 3%, >= 4 tiles per warp, <= 8 waves."""
    cap = max(1, -(-n_key_tiles // 16))
    cap = min(cap, max(1, -(-8 * slots // work)), _decode.MAX_SPLITS)
    cost = {s: -(-work * s // slots) / s for s in range(1, cap + 1)}
    best = min(cost.values())
    return min(s for s, c in cost.items() if c <= best * 1.03)


def _model_time(work, n_key_tiles, splits, slots):
    warps = _decode.DECODE_WARPS
    t_tile = 2 * _decode.DECODE_BN * D * 2 * slots * warps / _decode.DECODE_BW
    split_tiles = -(-n_key_tiles // splits)
    per_warp = -(-split_tiles // warps)
    waves = -(-work * splits // slots)
    return waves * (_decode.DECODE_T_BLOCK + per_warp * t_tile) + \
        (_decode.DECODE_T_COMBINE if splits > 1 else 0.0), waves


def rows(host_us):
    out = []
    for b, sk, hkv in GRID:
        g = H // hkv
        kv = 2 * b * sk * hkv * D * 2
        n_key_tiles = -(-sk // _decode.DECODE_BN)
        res = {}
        # before: MT = 1, 3 blocks per SM, the old rule
        rb_old = -(-g // 16)
        slots_old = SM * 3
        s_old = _old_splits(b * hkv * rb_old, n_key_tiles, slots_old)
        t_old, _ = _model_time(b * hkv * rb_old, n_key_tiles, s_old, slots_old)
        plan = _decode.decode_plan("float16", D, False, False, rows=g)
        cfg = _decode.configure(plan, (1, b, hkv), g, 1, sk, D, ATTRS)
        mt = plan.block_m // 16
        rb = cfg.n_rtiles // mt
        per_sm = _decode.blocks_per_sm(plan, D)
        slots = SM * per_sm
        t_new, waves = _model_time(b * hkv * rb, n_key_tiles, cfg.splits, slots)
        block_mb = cfg.split_tiles * 2 * _decode.DECODE_BN * D * 2 / 1e6
        inflight = per_sm * _decode.DECODE_WARPS * 8
        h = host_us * 1e-6
        res = dict(b=b, sk=sk, hkv=hkv, E=b * hkv, G=g, MT=mt, RB=rb, rb_old=rb_old, s=cfg.splits,
                   s_old=s_old, grid=cfg.grid, slots=slots, waves=waves, block_mb=block_mb,
                   inflight_kb=inflight, t_old=h + t_old, t_new=h + t_new,
                   gbs_old=kv / (h + t_old) / 1e9, gbs_new=kv / (h + t_new) / 1e9)
        out.append(res)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--host-us", type=float, default=20.0)
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    hdr = ("| B | Sk | Hkv | E | G | MT | RB (before) | s (before) | grid | slots | waves "
           "| MB/block | KB in flight/SM | us before | us now | GB/s before | GB/s now |")
    print(hdr)
    print("|" + "---:|" * 17)
    for r in rows(args.host_us):
        print(f"| {r['b']} | {r['sk']} | {r['hkv']} | {r['E']} | {r['G']} | {r['MT']} "
              f"| {r['RB']} ({r['rb_old']}) | {r['s']} ({r['s_old']}) | {r['grid']} "
              f"| {r['slots']} | {r['waves']} | {r['block_mb']:.2f} | {r['inflight_kb']} "
              f"| {r['t_old'] * 1e6:.0f} | {r['t_new'] * 1e6:.0f} | {r['gbs_old']:.0f} "
              f"| {r['gbs_new']:.0f} |")


if __name__ == "__main__":
    main()
