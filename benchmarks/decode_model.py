#!/usr/bin/env python
"""The decode kernel's launch at every point of issue 14's decode grid (H = 32, D = 128,
float16, Sq = 1) on an H200 (132 SMs), from the host's own rules (`_decode.decode_plan`,
`configure`, `choose_splits`) for both kernel versions (`_decode.DECODE_VERSION` 1: session f's;
2: the one-pass epilogue, the combine with its loads in flight, the split rule that charges the
partials), and the GPU time a latency model predicts for each. No GPU needed::

    PYTHONPATH=. python benchmarks/decode_model.py [--markdown]
    PYTHONPATH=. python benchmarks/decode_model.py --rules   # split rules 2 and 3 (issue 14)
    PYTHONPATH=. python benchmarks/decode_model.py --fit     # rule 3's fit and residuals

`--rules` prints, at every point, the splits that rule 2 (the default) and rule 3
(`_decode.DECODE_SPLIT_RULE = 3`) pick, with rule 3's model time (`_decode.split_time_v3` plus
the main kernel's launch) for both choices, the GB/s it implies and cuDNN's measured GB/s where
known. `--fit` refits rule 3's constants by least squares on log time to the version-2 H200
measurements in MEASURED_V2 (needs SciPy) and prints the residuals of the adopted constants.

Columns: E entries (B x Hkv), G rows per entry, MT row tiles per block, s splits (v1 -> v2),
grid blocks (v2), slots (SMs x blocks per SM), tiles per warp (v2), combine rounds (v1 -> v2:
dependent round trips to the partials per thread), the modelled GPU time and GB/s of K + V
counted once, for v1 and v2, and session f's measured GB/s (call 4, GPU time) where it exists.

The latency model (GPU time, as bench_inference.py measures it since session f: no host time):
    t = T_LAUNCH + waves x (T_FIRST + tiles per warp x t_tile + t_epilogue)
        + [s > 1] (T_LAUNCH + T_LSE + rounds x T_L2 + partial bytes x 2 / BW)
- t_tile: one 8 KB tile at one warp's share of BW when every slot is busy (4 warps a block);
- t_epilogue: the block epilogue's serial instructions per thread (SASS, sm_90, NVRTC 13.0:
  v1 ROWS x DPAD / 128 passes of ~175 instructions, v2 one row pass of ~60 plus ROWS x DPAD /
  512 passes of ~132), at CLK_PER_INSTR cycles each (4 warps a block, latency-exposed smem
  loads, 1.755 GHz);
- rounds: v1 ceil(s / (4 NG)) (4 loads a thread in flight, NG = 4 split groups at D = 128);
  v2 1 (CB column blocks give 128 CB / 32 split groups, so that a thread has <= 8 splits, and
  it issues all of their loads before the lse pass).
The constants are fitted by eye to session f's seven measured points (v1): the model lands
within ~20% of them (low at Hkv = 1, where the measured time is 4-8 us longer), so read its v2
column as a prediction of the gain's size, not as a measurement.
"""
from __future__ import annotations

import argparse

from cuflash import _decode

H, D, SM = 32, 128, 132
GRID = [(b, sk, hkv) for b in (1, 8, 64) for sk in (1024, 8192, 32768, 131072)
        for hkv in (32, 8, 1)]
ATTRS = dict(max_smem_optin=227 * 1024, sm_count=SM)
#: session f, call 4 (benchmarks/RESULTS.md): (B, Sk, Hkv) -> (cuflash v1, cuDNN) GB/s
MEASURED = {(1, 8192, 8): (1450, 1862), (1, 8192, 1): (173, 339), (1, 131072, 8): (3681, 4108),
            (1, 131072, 1): (1395, 2023), (8, 8192, 8): (3311, 3810), (8, 8192, 1): (1073, 1613),
            (8, 131072, 8): (4123, 4517)}

#: Version 2 on the H200 (session g, calls 2-3, benchmarks/RESULTS.md; GPU time from GB/s and
#: the K/V bytes): (B, Sk, Hkv, splits) -> (us, splits' source). Forced splits (`--force-splits`)
#: at Sk = 1k: one split 3370 GB/s at B = 8, Hkv = 32 (call 3; the rule's 3 splits 2846 in call 2
#: and 2813 in call 3, 47.5 us their mean), and +2-4% over the rule's 2 at B = 64, Hkv = 8
#: (taken as +3%).
MEASURED_V2 = {(1, 1024, 1, 16): 12.5, (64, 1024, 1, 4): 27.2, (8, 1024, 32, 1): 39.8,
               (8, 1024, 32, 3): 47.5, (64, 1024, 8, 1): 84.2, (64, 1024, 8, 2): 86.7,
               (1, 131072, 8, 48): 144.9, (8, 131072, 1, 32): 153.9, (8, 32768, 32, 3): 1038.0}
#: cuDNN (torch SDPA) in the same runs, GB/s: (B, Sk, Hkv) -> GB/s.
CUDNN = {(1, 1024, 1): 54, (64, 1024, 1): 1971, (8, 1024, 32): 3656, (64, 1024, 8): 3975,
         (1, 131072, 8): 4134, (8, 131072, 1): 2764, (8, 32768, 32): 4525}

BW = 4.0e12            # K/V streaming rate of a full grid (bytes/s)
T_LAUNCH = 2.0e-6      # per kernel in a stream (launch and drain)
T_FIRST = 1.0e-6       # Q and the first tile's DRAM latency
T_LSE = 1.5e-6         # the combine's lse pass (a load, two barriers, the butterflies)
T_L2 = 0.6e-6          # one dependent round trip to the (L2-resident) partials
CLK = 1.755e9
CLK_PER_INSTR = 2.0


def _epilogue_s(version, mt):
    rows = 16 * mt
    if version == 1:
        instr = rows * D / 128 * 175
    else:
        instr = 60 + rows * D / 512 * 132
    return instr * CLK_PER_INSTR / CLK


def _rounds(version, splits):
    if splits <= 1:
        return 0
    ch = D // 4
    if version == 1:   # 4 loads a thread in flight, NG = 128 / ch split groups
        return -(-splits // (4 * (128 // ch)))
    cb = _decode.combine_columns(splits, D, 2)   # <= COMBINE_LOADS a thread, all in flight
    per_thread = -(-splits // (128 * cb // ch))
    return -(-per_thread // _decode.COMBINE_LOADS)


def model(b, sk, hkv, version):
    """(DecodeLaunch, modelled seconds, tiles per warp, waves, rounds, slots) at one point."""
    g = H // hkv
    plan = _decode.decode_plan("float16", D, False, False, rows=g, version=version)
    cfg = _decode.configure(plan, (1, b, hkv), g, 1, sk, D, ATTRS)
    mt = plan.block_m // 16
    slots = SM * _decode.blocks_per_sm(plan, D)
    tile = 2 * _decode.DECODE_BN * D * 2
    t_tile = tile * slots * _decode.DECODE_WARPS / BW
    per_warp = -(-cfg.split_tiles // _decode.DECODE_WARPS)
    waves = -(-cfg.grid // slots)
    t = T_LAUNCH + waves * (T_FIRST + per_warp * t_tile + _epilogue_s(version, mt))
    rounds = _rounds(version, cfg.splits)
    if cfg.splits > 1:
        part = cfg.grid * min(g, 16 * mt) * D * 4
        t += T_LAUNCH + T_LSE + rounds * T_L2 + 2 * part / BW
    return cfg, t, per_warp, waves, rounds, slots, mt


def rows():
    out = []
    for b, sk, hkv in GRID:
        kv = 2 * b * sk * hkv * D * 2
        c1, t1, _, _, r1, _, _ = model(b, sk, hkv, 1)
        c2, t2, pw, waves, r2, slots, mt = model(b, sk, hkv, 2)
        meas = MEASURED.get((b, sk, hkv))
        out.append(dict(b=b, sk=sk, hkv=hkv, E=b * hkv, G=H // hkv, MT=mt, s1=c1.splits,
                        s2=c2.splits, grid=c2.grid, slots=slots, per_warp=pw, waves=waves,
                        r1=r1, r2=r2, t1=t1, t2=t2, gbs1=kv / t1 / 1e9, gbs2=kv / t2 / 1e9,
                        meas=meas))
    return out


def _geometry(b, sk, hkv, rule=3):
    """(plan, work, key tiles, slots, tile bytes, partial bytes per block, MT) at one point."""
    g = H // hkv
    plan = _decode.decode_plan("float16", D, False, False, rows=g, rule=rule)
    mt = plan.block_m // 16
    work = b * hkv * -(-g // (16 * mt))
    slots = SM * _decode.blocks_per_sm(plan, D)
    return (plan, work, -(-sk // _decode.DECODE_BN), slots, 2 * _decode.DECODE_BN * D * 2,
            min(g, 16 * mt) * D * 4, mt)


def rule3_time(b, sk, hkv, s, consts=None):
    """Rule 3's modelled GPU time (seconds, the main kernel's launch included) of `s` splits at
    (B, Sk, Hkv); `consts`: (bw, t_tile MT=1, t_tile MT=2, t_combine), None for the module's."""
    _, work, tiles, slots, tb, pb, mt = _geometry(b, sk, hkv)
    kw = {}
    if consts is not None:
        bw, tt1, tt2, tc = consts
        kw = dict(bw=bw, t_tile=tt1 if mt == 1 else tt2, t_combine=tc)
    t, _, _ = _decode.split_time_v3(work, tiles, s, slots, tb, pb, mt, **kw)
    return _decode.DECODE_T_LAUNCH_V3 + t


def rules_table():
    print("| B | Sk | Hkv | E | G | MT | s rule 2 | s rule 3 | grid rule 3 | slots "
          "| us (model, rule 2's s) | us (model, rule 3's s) | GB/s (model, rule 3) "
          "| cuDNN GB/s (measured) |")
    print("|" + "---:|" * 14)
    for b, sk, hkv in GRID:
        g = H // hkv
        s = {}
        for rule in (2, 3):
            plan = _decode.decode_plan("float16", D, False, False, rows=g, rule=rule)
            s[rule] = _decode.configure(plan, (1, b, hkv), g, 1, sk, D, ATTRS)
        _, work, _, slots, _, _, mt = _geometry(b, sk, hkv)
        kv = 2 * b * sk * hkv * D * 2
        t2, t3 = (rule3_time(b, sk, hkv, s[r].splits) for r in (2, 3))
        cu = CUDNN.get((b, sk, hkv), "")
        print(f"| {b} | {sk} | {hkv} | {b * hkv} | {g} | {mt} | {s[2].splits} | {s[3].splits} "
              f"| {s[3].grid} | {slots} | {t2 * 1e6:.1f} | {t3 * 1e6:.1f} "
              f"| {kv / t3 / 1e9:.0f} | {cu} |")


def fit():
    """Least squares on log time of rule 3's (bw, t_tile MT=1, t_tile MT=2, t_combine) to
    MEASURED_V2, the block and launch times held at their SASS-count values; prints the fitted
    constants and the residuals of the fitted and of the adopted (module) constants."""
    import math

    pts = list(MEASURED_V2.items())

    def resid(c):
        return [math.log(rule3_time(b, sk, hkv, s, c) / (us * 1e-6))
                for (b, sk, hkv, s), us in pts]

    adopted = (_decode.DECODE_BW_V3, _decode.DECODE_T_TILE_V3[1], _decode.DECODE_T_TILE_V3[2],
               _decode.DECODE_T_COMBINE_V3)
    try:
        from scipy.optimize import least_squares
    except ImportError:
        fitted = None
        print("(SciPy missing: residuals of the adopted constants only)")
    else:
        scale = (1e12, 1e-6, 1e-6, 1e-6)
        r = least_squares(lambda z: resid(tuple(a * c for a, c in zip(z, scale))),
                          [a / c for a, c in zip(adopted, scale)], bounds=(0.05, 20))
        fitted = tuple(a * c for a, c in zip(r.x, scale))
    print("| constants | BW TB/s | t_tile MT=1 us | t_tile MT=2 us | t_combine us | rms |")
    print("|---|---:|---:|---:|---:|---:|")
    rows = [("adopted", adopted)] + ([("fitted", fitted)] if fitted else [])
    for name, c in rows:
        rms = math.sqrt(sum(x * x for x in resid(c)) / len(pts))
        print(f"| {name} | {c[0] / 1e12:.2f} | {c[1] * 1e6:.2f} | {c[2] * 1e6:.2f} "
              f"| {c[3] * 1e6:.2f} | {rms:.3f} |")
    print()
    print("| B | Sk | Hkv | s | measured us | model us (adopted) | residual |"
          + (" model us (fitted) | residual |" if fitted else ""))
    print("|" + "---:|" * (9 if fitted else 7))
    for (b, sk, hkv, s), us in pts:
        line = f"| {b} | {sk} | {hkv} | {s} | {us:.1f}"
        for c in (adopted, fitted) if fitted else (adopted,):
            t = rule3_time(b, sk, hkv, s, c) * 1e6
            line += f" | {t:.1f} | {100 * (t / us - 1):+.0f}%"
        print(line + " |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--markdown", action="store_true", help="(the table is markdown always)")
    ap.add_argument("--rules", action="store_true", help="split rules 2 and 3 at every point")
    ap.add_argument("--fit", action="store_true", help="rule 3's fit and residuals")
    args = ap.parse_args()
    if args.fit:
        fit()
        return
    if args.rules:
        rules_table()
        return
    print("| B | Sk | Hkv | E | G | MT | s v1 -> v2 | grid | slots | tiles/warp | rounds v1 -> v2 "
          "| us v1 | us v2 | GB/s v1 | GB/s v2 | measured v1 / cuDNN | v2 / cuDNN (pred.) |")
    print("|" + "---:|" * 17)
    for r in rows():
        meas = f"{r['meas'][0]} / {r['meas'][1]}" if r["meas"] else ""
        pred = f"{r['gbs2'] / r['meas'][1]:.2f}x" if r["meas"] else ""
        print(f"| {r['b']} | {r['sk']} | {r['hkv']} | {r['E']} | {r['G']} | {r['MT']} "
              f"| {r['s1']} -> {r['s2']} | {r['grid']} | {r['slots']} | {r['per_warp']} "
              f"| {r['r1']} -> {r['r2']} | {r['t1'] * 1e6:.1f} | {r['t2'] * 1e6:.1f} "
              f"| {r['gbs1']:.0f} | {r['gbs2']:.0f} | {meas} | {pred} |")


if __name__ == "__main__":
    main()
