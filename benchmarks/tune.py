"""Compare tile configurations of cuflash's fast kernels against PyTorch's FLASH and CUDNN backends.

For performance work (notes/PERF.md), not the published table (benchmarks/bench.py). For each point
of a small grid and each candidate configuration of the chosen kernel, it checks the output of one
(batch, head) slice against the float64 reference with the project's pass rule, then times 10
back-to-back calls between two CUDA events, queued behind a spinning kernel (bench.py's) so that
Python's launch time is not timed, median of --repeats such timings. Candidates:

- ``--kernel tensorcore`` (mma.sync): `cuflash._dispatch.TC_CONFIGS` entries (BN, warps, MT, min
  blocks per SM, staged epilogue);
- ``--kernel hopper-f32`` (float32 "highest", the 3xfp16 Hopper form): (HopperTiles, K and V
  split once per call) for `cuflash._dispatch.HOPPER_F16SPLIT_TABLE` / `HOPPER_F16SPLIT_D256`
  ("pre" in the label: `HOPPER_F32_PRESPLIT` on for every Sq, else the split per tile), against
  torch's EFFICIENT backend on float32 inputs. ``--compile-only`` compiles the candidates'
  specialisations into the disk cache without a GPU (for benchmarks/pack_cache.sh's archive:
  ``CUFLASH_CACHE_DIR=... python benchmarks/tune.py --kernel hopper-f32 --compile-only``);
- ``--kernel hopper`` (TMA/wgmma): (`cuflash._dispatch.HopperTiles`, persistent launch), the
  values of `cuflash._dispatch.HOPPER_TABLE`, printed as "BN<keys> S<stages> Q<Q buffers>
  C<consumer warpgroups> [ov: overlapped softmax] [pp: ping-pong] [aO: O sent out through shared
  memory by bulk copies, HopperTiles.async_o] [P: persistent]". The aO candidates are the A/B of
  `cuflash._dispatch.HOPPER_ASYNC_O` (on by default since session n; a candidate runs with the
  flag off, so its own async_o decides): each beside the same tiles without it.

    PYTHONPATH=. python benchmarks/tune.py --kernel hopper [--d 64,128,256] [--s 512,2048,8192]
    PYTHONPATH=. python benchmarks/tune.py --shapes 32x12x197x64,64x16x256x64 --causal 0
    PYTHONPATH=. python benchmarks/tune.py --shapes 64x16x256x64 --causal 0 --match 'C2 ov pp'

``--match REGEX`` keeps the candidates whose label matches (re.search).

``--shapes`` (B x H x S x D, Sq = Sk) replaces the grid (B = 16384 / S, H = 2048 / D) with given
problems, e.g. issue 13's small ones; ``--causal`` picks the masks (default both).

Needs a GPU, CuPy and PyTorch (for the peers and the random inputs).
"""
import argparse
import json
import os
import re
import sys

import numpy as np

from cuflash._dispatch import HopperTiles as H

CANDIDATES = {
    "tensorcore": {
        64: [(64, 4, 2, 2, True), (64, 4, 1, 4, True)],
        128: [(64, 4, 2, 2, True), (48, 4, 2, 2, True)],
        256: [(64, 4, 1, 2, True), (32, 4, 1, 2, True)],
    },
    # (HopperTiles(BN, stages, consumers, overlap, pingpong), persistent launch)
    "hopper": {
        64: [(H(128, 2, 1, 2, False, True), True), (H(128, 2, 2, 2, False, True), True),
             (H(128, 2, 2, 2, True, True), True), (H(128, 2, 1, 3, True, True), True),
             (H(128, 2, 2, 3, True, True), True), (H(128, 2, 2, 3, True, True), False),
             (H(128, 2, 1, 3, False, True), True), (H(128, 2, 1, 2, True, True), True),
             (H(64, 2, 1, 2, True, True), True), (H(64, 3, 1, 2, True, True), True),
             (H(64, 2, 1, 3, True, True), True), (H(128, 2, 1, 2, True, True), False),
             # the async O epilogue beside the tiles above (HOPPER_ASYNC_O's A/B)
             (H(128, 2, 1, 2, True, True, async_o=True), True),
             (H(128, 2, 2, 2, True, True, async_o=True), True),
             (H(128, 2, 2, 2, False, True, async_o=True), True),
             (H(128, 2, 1, 3, True, True, async_o=True), True),
             (H(128, 2, 2, 3, True, True, async_o=True), True),
             # three K/V stages: two tiles of the next item in flight at an item boundary
             (H(128, 3, 1, 2, True, True), True), (H(128, 3, 2, 2, True, True), True),
             (H(128, 3, 2, 2, True, True, async_o=True), True)],
        128: [(H(128, 2, 1, 2, True, True), True), (H(128, 2, 2, 2, True, True), True),
              (H(176, 2, 1, 2, True, True), True), (H(128, 2, 2, 2, True, True), False),
              (H(176, 2, 1, 2, True, True), False), (H(64, 2, 1, 2, True, True), True),
              (H(64, 3, 1, 2, True, True), True), (H(128, 2, 1, 2, True, True), False),
              (H(128, 2, 1, 2, True, True, async_o=True), True)],  # (Q2 does not fit with it)
        256: [(H(80, 2, 1, 2, True, True), True), (H(64, 2, 1, 2, True, True), True),
              (H(80, 2, 1, 2, True, True), False)],
    },
    # float32 3xfp16: (HopperTiles, K and V split once per call). D = 256 is the head-dim split
    # form (two consumers on 64 rows); its one stage of BN = 64 fills shared memory, BN = 32 leaves
    # room for a second K/V stage or a second Q buffer (the next item's Q during this one).
    "hopper-f32": {
        64: [(H(64, 3, 1, 2, False, True), p) for p in (False, True)],
        128: [(H(64, 2, 1, 2, False, True), p) for p in (False, True)],
        256: [(H(bn, st, qs, 2, False, False, hsplit=True), p)
              for bn, st, qs in ((64, 1, 1), (32, 1, 1), (32, 2, 1), (32, 1, 2))
              for p in (False, True)],
    },
}
BURST = 10
SPIN_S = 0.003  # GPU busy time queued ahead of each burst


def label(kernel, cfg):
    if kernel == "tensorcore":
        return str(cfg)
    t, flag = cfg  # flag: a persistent launch (hopper), K and V split once (hopper-f32)
    last = (" pre" if flag else "") if kernel == "hopper-f32" else (" P" if flag else "")
    return (f"BN{t.bn} S{t.stages} Q{t.q_stages} C{t.consumers}{' ov' if t.overlap else ''}"
            f"{' pp' if t.pingpong else ''}{' aO' if t.async_o else ''}"
            f"{' hs' if t.hsplit else ''}{last}")


def f32_specs(d, cfg, causal):
    """The specialisations a hopper-f32 candidate launches at head dim d (the forward, and the
    split pass where K and V are split once)."""
    from cuflash import _dispatch

    tiles, presplit = cfg
    dpad = 256 if tiles.hsplit else d
    plan = _dispatch.hopper_plan("float32", d, causal, 4096, f16split_table={dpad: tiles},
                                 presplit=presplit)
    return [plan.spec] + ([_dispatch.presplit_spec(dpad, tiles.bn)] if presplit else [])


def burst_ms(fn, spinner):
    """Milliseconds per call of BURST back-to-back calls of fn, between two CUDA events."""
    import cupy as cp
    import torch

    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    # Keep the GPU busy while the burst is enqueued, so that host time is not timed (cuflash
    # and torch both launch on the legacy default stream here).
    spinner(cp.cuda.Stream.null, SPIN_S)
    a.record()
    for _ in range(BURST):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / BURST


class GridPoint:
    """Inputs of one point of the standard grid (B = 16384 / S, H = 2048 / D, float16 or
    `dtype`, random normal from torch), the output buffer, the FLOP count and the float64
    reference of slice (0, 0) with the project's pass threshold."""

    def __init__(self, d, s, causal, b=None, h=None, dtype="float16"):
        import cupy as cp
        import torch

        from cuflash import reference

        b = 16384 // s if b is None else b
        h = 2048 // d if h is None else h
        self.q, self.k, self.v = (torch.randn(b, h, s, d, device="cuda",
                                              dtype=getattr(torch, dtype))
                                  for _ in range(3))
        self.qc, self.kc, self.vc = (cp.from_dlpack(x) for x in (self.q, self.k, self.v))
        self.out = cp.empty_like(self.qc)
        self.flops = 4 * b * h * s * s * d / (2 if causal else 1)  # 4*B*H*Sq*Sk*D, halved causal
        q64, k64, v64 = (x[0, 0].double().cpu().numpy() for x in (self.q, self.k, self.v))
        self.o_ref, _ = reference.attention_ref(q64, k64, v64, causal=causal)
        self.rule = reference.pass_threshold(q64, k64, v64, causal=causal, dtype=dtype,
                                             o_ref=self.o_ref)

    def verdict(self):
        """The pass rule's verdict on slice (0, 0) of the output (reference.PassRule.judge)."""
        import cupy as cp

        return self.rule.judge(cp.asnumpy(self.out[0, 0]).astype(np.float64))


def _apply(dispatch, kernel, d, cfg):
    """Make `cfg` the dispatcher's choice for head dim d; returns a function that undoes it. The
    tables are replaced, not edited in place: the call cache (cuflash/_callcache.py) keeps the
    table objects a record was made under and reuses the record while they are the same."""
    if kernel == "tensorcore":
        saved = dispatch.TC_CONFIGS
        dispatch.TC_CONFIGS = {**saved, d: cfg}

        def undo():
            dispatch.TC_CONFIGS = saved
    elif kernel == "hopper-f32":
        tiles, presplit = cfg
        names = ("HOPPER_F16SPLIT_TABLE", "HOPPER_F16SPLIT_D256", "HOPPER_F32_PRESPLIT",
                 "HOPPER_F32_PRESPLIT_MIN_REUSE", "HOPPER_F32_D256")
        saved = {n: getattr(dispatch, n) for n in names}
        table = "HOPPER_F16SPLIT_D256" if tiles.hsplit else "HOPPER_F16SPLIT_TABLE"
        setattr(dispatch, table, {**saved[table], (256 if tiles.hsplit else d): tiles})
        dispatch.HOPPER_F32_PRESPLIT = bool(presplit)
        dispatch.HOPPER_F32_PRESPLIT_MIN_REUSE = 0  # the candidate's form at every Sq
        dispatch.HOPPER_F32_D256 = True

        def undo():
            for n, val in saved.items():
                setattr(dispatch, n, val)
    else:
        saved, gain, ao = dispatch.HOPPER_TABLE, dispatch.HOPPER_C3_GAIN, dispatch.HOPPER_ASYNC_O
        dispatch.HOPPER_TABLE = {key: (cfg if key[0] == d else val) for key, val in saved.items()}
        dispatch.HOPPER_C3_GAIN = float("inf")  # the candidate as given, whatever Sq is
        dispatch.HOPPER_ASYNC_O = False  # the candidate's own async_o says which epilogue runs

        def undo():
            dispatch.HOPPER_TABLE, dispatch.HOPPER_C3_GAIN = saved, gain
            dispatch.HOPPER_ASYNC_O = ao
    return undo


def masks_of(text):
    return [bool(int(x)) for x in text.split(",")]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", choices=sorted(CANDIDATES), default="hopper")
    ap.add_argument("--d", default="64,128,256")
    ap.add_argument("--s", default="512,2048,8192")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--shapes", default="", help="BxHxSxD problems instead of the grid")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--match", default="", help="only the candidates whose label matches")
    ap.add_argument("--compile-only", action="store_true",
                    help="hopper-f32: compile the candidates into the disk cache, no GPU")
    args = ap.parse_args(argv)
    f32 = args.kernel == "hopper-f32"
    if args.compile_only:
        from cuflash import precompile
        if not f32:
            ap.error("--compile-only: --kernel hopper-f32 only")
        specs = [sp for d in (int(x) for x in args.d.split(","))
                 for cfg in CANDIDATES[args.kernel].get(d, [])
                 if not args.match or re.search(args.match, label(args.kernel, cfg))
                 for causal in masks_of(args.causal) for sp in f32_specs(d, cfg, causal)]
        specs = list(dict.fromkeys(specs))
        now, cached = precompile.precompile(specs, "sm_90a", jobs=os.cpu_count() or 1)
        print(f"{len(specs)} specialisations: {now} compiled, {cached} cached")
        return 0
    masks = masks_of(args.causal)
    if args.shapes:
        points = [tuple(int(n) for n in sh.split("x")) for sh in args.shapes.split(",")]
    else:
        points = [(None, None, int(s), int(d)) for d in args.d.split(",") for s in args.s.split(",")]

    import cupy as cp
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import cuflash
    from cuflash import _dispatch
    from bench import Spinner  # benchmarks/bench.py, next to this file

    spinner = Spinner(cp)
    if spinner.err:
        print(f"spin kernel unavailable ({spinner.err}): host time may leak into the timings")

    def timed(fn):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        return float(np.median([burst_ms(fn, spinner) for _ in range(args.repeats)]))

    for b, h, s, d in points:
        for causal in masks:
            pt = GridPoint(d, s, causal, b, h, "float32" if f32 else "float16")
            q, k, v, qc, kc, vc, out, flops = (pt.q, pt.k, pt.v, pt.qc, pt.kc, pt.vc, pt.out,
                                               pt.flops)
            row = {"B": pt.q.shape[0], "H": pt.q.shape[1], "D": d, "S": s, "causal": causal}
            peers = ((("efficient", SDPBackend.EFFICIENT_ATTENTION),) if f32 else
                     (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)))
            for peer, backend in peers:
                try:
                    with sdpa_kernel(backend):
                        row[peer] = round(flops / timed(
                            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
                            / 1e9, 1)
                except RuntimeError as exc:  # backend unavailable for this shape or GPU
                    row[peer] = f"n/a: {exc}"[:60]
            for cfg in CANDIDATES[args.kernel][d]:
                if args.match and not re.search(args.match, label(args.kernel, cfg)):
                    continue
                undo = _apply(_dispatch, args.kernel, d, cfg)
                try:
                    kw = {"causal": causal, "out": out,
                          "kernel": "hopper" if f32 else args.kernel}
                    cuflash.attention(qc, kc, vc, **kw)
                    verdict = pt.verdict()
                    if not verdict.passed:
                        row[label(args.kernel, cfg)] = "FAIL " + "; ".join(verdict.reasons)
                        continue
                    ms = timed(lambda: cuflash.attention(qc, kc, vc, **kw))
                    row[label(args.kernel, cfg)] = round(flops / ms / 1e9, 1)
                except Exception as exc:  # a config that does not fit this GPU
                    row[label(args.kernel, cfg)] = f"n/a: {type(exc).__name__}: {exc}"[:100]
                finally:
                    undo()
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
