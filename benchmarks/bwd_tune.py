"""A/B the tensor-core backward's speed candidates against PyTorch's FLASH and CUDNN backwards.

For performance work (notes/BACKWARD.md "Speed candidates"), not the published table
(benchmarks/bench.py --pass backward). Candidates are the entries of
`cuflash._dispatch.TC_BWD_CANDIDATES` (tiles and OPT bits per padded head dim), each put in place
of `TC_BWD_CONFIGS` for its head dims while it runs (this script is the only place that does:
the library reads its tables, never an environment variable). At each point of the standard
grid (float16, B = 16384 / S, H = 2048 / D, random normal inputs and upstream gradient from
torch) every candidate's dq, dk, dv of slice (0, 0) are first checked against the float64
gradients with the project's rule (cuflash.reference.grad_pass_threshold), in both modes; then
10 back-to-back calls are timed between two CUDA events, queued behind bench.py's spinning
kernel, median of --repeats. Torch's backwards run through torch.autograd.grad on a retained
graph (the backward kernels alone). FLOPs are 2.5x the forward's 4 B H S^2 D, halved causal.
Prints one JSON line per point: TFLOP/s of flash, cudnn, each candidate ("name") and its
deterministic=True form ("name/det"), and then, per candidate, x FLASH and det / default.

    PYTHONPATH=. python benchmarks/bwd_tune.py [--d 64,128] [--s 1024,4096] [--cand base,lean]

Compiles the candidates' kernels first (cuflash.precompile, all CPU cores). Needs a GPU, CuPy
and PyTorch.
"""
import argparse
import json
import os
import sys

import numpy as np

from tune import burst_ms  # benchmarks/tune.py, next to this file


def _candidates(dispatch, names, d):
    return [n for n in names if d in dispatch.TC_BWD_CANDIDATES[n]]


def _set(dispatch, saved, name, d):
    dispatch.TC_BWD_CONFIGS.clear()
    dispatch.TC_BWD_CONFIGS.update(saved)
    dispatch.TC_BWD_CONFIGS[d] = dispatch.TC_BWD_CANDIDATES[name][d]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", default="64,128")
    ap.add_argument("--s", default="1024,4096")
    ap.add_argument("--cand", default=None, help="comma-separated TC_BWD_CANDIDATES names")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)

    import cupy as cp
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import cuflash
    from cuflash import _dispatch, _launch, precompile, reference
    from bench import Spinner

    names = args.cand.split(",") if args.cand else list(_dispatch.TC_BWD_CANDIDATES)
    unknown = [n for n in names if n not in _dispatch.TC_BWD_CANDIDATES]
    if unknown:
        ap.error(f"--cand: unknown {unknown}; known: {list(_dispatch.TC_BWD_CANDIDATES)}")
    cc = _launch.device_attributes(cp.cuda.Device().id)["compute_capability"]
    specs = list(dict.fromkeys(plan.spec for bp in _dispatch.bwd_candidate_plans(cc)
                               for _, plan in bp.passes))
    built, _ = precompile.precompile(specs, f"sm_{cc}", jobs=os.cpu_count() or 1)
    print(f"# compiled {built} of {len(specs)} candidate kernels for sm_{cc}", flush=True)

    spinner = Spinner(cp)
    if spinner.err:
        print(f"# spin kernel unavailable ({spinner.err}): host time may leak into the timings")

    def timed(fn):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        return float(np.median([burst_ms(fn, spinner) for _ in range(args.repeats)]))

    saved = dict(_dispatch.TC_BWD_CONFIGS)
    for d in (int(x) for x in args.d.split(",")):
        for s in (int(x) for x in args.s.split(",")):
            for causal in (False, True):
                b, h = 16384 // s, 2048 // d
                tq, tk, tv, tdo = (torch.randn(b, h, s, d, device="cuda", dtype=torch.float16)
                                   for _ in range(4))
                flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)
                row = {"D": d, "S": s, "causal": causal}
                for peer, backend in (("flash", SDPBackend.FLASH_ATTENTION),
                                      ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                    try:
                        with sdpa_kernel(backend):
                            leaves = tuple(x.detach().requires_grad_() for x in (tq, tk, tv))
                            o = F.scaled_dot_product_attention(*leaves, is_causal=causal)
                            row[peer] = round(flops / timed(lambda: torch.autograd.grad(
                                o, leaves, grad_outputs=tdo, retain_graph=True)) / 1e9, 1)
                            del o, leaves
                    except RuntimeError as exc:  # backend unavailable for this shape or GPU
                        row[peer] = f"n/a: {exc}"[:60]
                q, k, v, do = (cp.from_dlpack(x) for x in (tq, tk, tv, tdo))
                o, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
                h64 = [cp.asnumpy(x[0, 0]).astype(np.float64) for x in (do, q, k, v)]
                g_ref = reference.attention_backward_ref(*h64, causal=causal)
                tols, _ = reference.grad_pass_threshold(*h64, causal=causal, dtype="float16",
                                                        ref=g_ref)
                outs = tuple(cp.empty_like(x) for x in (q, k, v))
                for name in _candidates(_dispatch, names, d):
                    _set(_dispatch, saved, name, d)
                    try:
                        for det in (False, True):
                            key = name + ("/det" if det else "")
                            kw = dict(causal=causal, deterministic=det, out=outs,
                                      kernel="tensorcore")
                            for x in outs:
                                x.fill(cp.nan)
                            cuflash.attention_backward(do, q, k, v, o, lse, **kw)
                            bad = []
                            for gname, g, r, tol in zip(("dq", "dk", "dv"), outs, g_ref, tols):
                                err = float(np.max(np.abs(
                                    cp.asnumpy(g[0, 0]).astype(np.float64) - r)))
                                if not err <= tol or bool(cp.isnan(g).any()):
                                    bad.append(f"{gname} err {err:.2e} > {tol:.2e} or NaN")
                            if bad:
                                row[key] = "FAIL " + "; ".join(bad)
                                continue
                            ms = timed(lambda: cuflash.attention_backward(do, q, k, v, o, lse,
                                                                          **kw))
                            row[key] = round(flops / ms / 1e9, 1)
                    except Exception as exc:  # a config that does not fit this GPU
                        row[name] = f"n/a: {type(exc).__name__}: {exc}"[:100]
                    finally:
                        _dispatch.TC_BWD_CONFIGS.clear()
                        _dispatch.TC_BWD_CONFIGS.update(saved)
                for name in _candidates(_dispatch, names, d):
                    a, a_det = row.get(name), row.get(name + "/det")
                    if isinstance(a, float) and isinstance(row.get("flash"), float):
                        row[name + " xFLASH"] = round(a / row["flash"], 2)
                    if isinstance(a, float) and isinstance(a_det, float):
                        row[name + " det/default"] = round(a / a_det, 2)
                print(json.dumps(row), flush=True)
                del tq, tk, tv, tdo, q, k, v, do, o, lse, outs
    return 0


if __name__ == "__main__":
    sys.exit(main())
