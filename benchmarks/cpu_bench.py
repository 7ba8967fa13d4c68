#!/usr/bin/env python
"""The CPU path (cuflash.attention on NumPy arrays) against plain NumPy.

    PYTHONPATH=. python benchmarks/cpu_bench.py                 # the two shapes of issue 16
    PYTHONPATH=. python benchmarks/cpu_bench.py --shape 2,8,4096,64 --repeats 7

Plain NumPy is matmul -> softmax -> matmul in the input dtype, written the obvious way::

    s = (q @ k.swapaxes(-1, -2)) * scale
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    o = p @ v

(an Sq x Sk matrix per head). The two are timed in turns, `--repeats` times each after one
warm-up call, and the minimum and median wall times are reported with their ratio (plain /
cuflash: above 1 means cuflash is faster). Both outputs are compared with the float64
reference on the first head (cuflash.reference.attention_ref) to show the accuracy is the same.
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import cuflash  # noqa: E402
from cuflash import reference  # noqa: E402


def plain_numpy(q, k, v, scale):
    s = (q @ k.swapaxes(-1, -2)) * q.dtype.type(scale)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return p @ v


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", action="append",
                    help="B,H,S,D (repeatable); default 1,8,2048,64 and 4,16,1024,128")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--causal", action="store_true", help="cuflash with causal=True (plain NumPy "
                    "is then given the same mask as -inf scores)")
    args = ap.parse_args(argv)
    shapes = [tuple(int(x) for x in s.split(",")) for s in (args.shape or
                                                           ["1,8,2048,64", "4,16,1024,128"])]
    print(f"numpy {np.__version__}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, dtype {args.dtype}, {args.repeats} repeats")
    rng = np.random.default_rng(0)
    for shape in shapes:
        q, k, v = (rng.standard_normal(shape).astype(args.dtype) for _ in range(3))
        scale = 1.0 / math.sqrt(shape[-1])

        def run_plain():
            if args.causal:
                raise SystemExit("--causal: compare against your own masked baseline")
            return plain_numpy(q, k, v, scale)

        def run_cuflash():
            return cuflash.attention(q, k, v, causal=args.causal)

        o_p, o_c = run_plain(), run_cuflash()  # warm-up, and the outputs for the accuracy check
        times = {"plain": [], "cuflash": []}
        for _ in range(args.repeats):
            for name, fn in (("plain", run_plain), ("cuflash", run_cuflash)):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        q0, k0, v0 = (x[(0,) * (x.ndim - 2)].astype(np.float64) for x in (q, k, v))
        o_ref, _ = reference.attention_ref(q0, k0, v0, causal=args.causal)
        err = {n: float(np.max(np.abs(o[(0,) * (o.ndim - 2)].astype(np.float64) - o_ref)))
               for n, o in (("plain", o_p), ("cuflash", o_c))}
        tp, tc = (np.array(times[n]) * 1e3 for n in ("plain", "cuflash"))
        print(f"{shape}: plain NumPy min {tp.min():.0f} ms, median {np.median(tp):.0f} ms; "
              f"cuflash min {tc.min():.0f} ms, median {np.median(tc):.0f} ms; "
              f"ratio (plain/cuflash) min {tp.min() / tc.min():.2f}x, "
              f"median {np.median(tp) / np.median(tc):.2f}x; max abs error (head 0) "
              f"plain {err['plain']:.2e}, cuflash {err['cuflash']:.2e}")


if __name__ == "__main__":
    main()
