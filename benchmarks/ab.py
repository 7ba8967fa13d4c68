"""A/B timing of kernel source trees: the same calls, each variant's kernels, interleaved.

For performance work (notes/PERF.md). Every variant is a directory holding the kernel sources
(a `kernels_cu` of another commit, e.g. from ``git worktree add /tmp/old <commit>``); the Python
side is this tree's, so the variants must agree on the kernels' names, template parameters and
parameter layout. Each variant's kernels are compiled into their own in-process cache; at every
point the variants' outputs are checked (slice (0, 0) against the float64 reference with the
project's pass rule, and no NaN anywhere in an output poisoned with NaN), then timed in rounds
that alternate between the variants (10 back-to-back calls between two CUDA events, queued
behind bench.py's spinning kernel; median over rounds). Timing the variants interleaved in one
process removes most of the drift between separate runs, which reached several % here.

    PYTHONPATH=. python benchmarks/ab.py --variant old=/tmp/old/kernels_cu --variant new=kernels_cu \\
        --points 256:512,256:512:causal,64:512:causal [--rounds 9]

A point is D:S[:causal] on the standard grid (B = 16384 / S, H = 2048 / D, float16) with
the dispatcher's choice of kernel ("auto"). Prints one JSON line per point: TFLOP/s per variant
and cuDNN's (PyTorch SDPA's CUDNN backend), timed in the same process. Needs a GPU, CuPy, PyTorch.
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", action="append", required=True, metavar="NAME=DIR",
                    help="a name and a directory of kernel sources (repeat, at least two)")
    ap.add_argument("--points", default="256:512,256:512:causal,128:512,64:512:causal")
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args(argv)
    variants = {}
    for item in args.variant:
        name, _, path = item.partition("=")
        src = Path(path).resolve()
        if not name or not (src / "attn_wgmma.cu").is_file():
            ap.error(f"--variant {item!r}: expected NAME=DIR with DIR holding the kernel sources")
        variants[name] = src
    if len(variants) < 2:
        ap.error("give at least two variants")

    import cupy as cp
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import cuflash
    from cuflash import _compile
    from bench import Spinner  # benchmarks/bench.py, next to this file
    from tune import GridPoint, burst_ms

    spinner = Spinner(cp)
    caches = {name: ({}, {}) for name in variants}

    def use(name):  # point the compiler and the loaded-kernel cache at one variant
        _compile.SOURCE_DIR = variants[name]
        _compile.family_source.cache_clear()
        _compile._kernels, _compile._smem_limit = caches[name]

    for point in args.points.split(","):
        parts = point.split(":")
        d, s, causal = int(parts[0]), int(parts[1]), parts[2:] == ["causal"]
        pt = GridPoint(d, s, causal)
        q, k, v, out, flops = pt.q, pt.k, pt.v, pt.out, pt.flops
        row = {"D": d, "S": s, "causal": causal}

        def sdpa():
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            for _ in range(3):
                sdpa()
            row["cudnn"] = round(flops / np.median([burst_ms(sdpa, spinner) for _ in range(args.rounds)])
                                 / 1e9, 1)

        def ours():
            return cuflash.attention(pt.qc, pt.kc, pt.vc, causal=causal, out=out)

        times = {}
        for name in variants:
            use(name)
            out.fill(float("nan"))
            ours()
            err = pt.error()
            n_nan = int(cp.isnan(out).sum())
            if err <= pt.tol and n_nan == 0:
                times[name] = []
                for _ in range(3):
                    ours()
            else:
                row[name] = f"FAIL: max error {err:.2e} (pass {pt.tol:.2e}), {n_nan} NaN"
        for _ in range(args.rounds):
            for name in times:
                use(name)
                times[name].append(burst_ms(ours, spinner))
        for name, ts in times.items():
            row[name] = round(flops / np.median(ts) / 1e9, 1)
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
