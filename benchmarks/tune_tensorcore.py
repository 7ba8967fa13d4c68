"""Compare tile configurations of cuflash's tensor-core kernel against PyTorch's FLASH backend.

For performance work (notes/PERF.md), not the published table (benchmarks/bench.py). For each point
of a small grid and each candidate configuration (cuflash._dispatch.TC_CONFIGS entries: BN, warps,
MT, min blocks per SM, staged epilogue), it checks the output of one (batch, head) slice against the
float64 reference with the project's pass rule, then times 10 back-to-back calls between two CUDA
events (so Python's launch time hides behind the GPU's queue), median of --repeats such timings.

    PYTHONPATH=. python benchmarks/tune_tensorcore.py [--d 64,128,256] [--s 512,2048,8192]

Needs a GPU, CuPy and PyTorch (for the peer and the random inputs).
"""
import argparse
import json
import sys

import numpy as np

CANDIDATES = {
    64: [(64, 4, 2, 2, False), (64, 4, 2, 2, True), (64, 4, 1, 4, True)],
    128: [(64, 4, 2, 2, False), (64, 4, 2, 2, True), (48, 4, 2, 2, True)],
    256: [(64, 4, 1, 2, False), (64, 4, 1, 2, True), (32, 4, 1, 2, True)],
}
BURST = 10


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", default="64,128,256")
    ap.add_argument("--s", default="512,2048,8192")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args(argv)

    import cupy as cp
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import cuflash
    from cuflash import _dispatch, reference

    def timed(fn):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(args.repeats):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(BURST):
                fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) / BURST)
        return float(np.median(ts))

    for d in (int(x) for x in args.d.split(",")):
        for s in (int(x) for x in args.s.split(",")):
            for causal in (False, True):
                b, h = 16384 // s, 2048 // d
                q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.float16)
                           for _ in range(3))
                qc, kc, vc = (cp.from_dlpack(x) for x in (q, k, v))
                out = cp.empty_like(qc)
                flops = 4 * b * h * s * s * d / (2 if causal else 1)  # 4*B*H*Sq*Sk*D, halved causal
                q64, k64, v64 = (x[0, 0].double().cpu().numpy() for x in (q, k, v))
                o_ref, _ = reference.attention_ref(q64, k64, v64, causal=causal)
                tol, _ = reference.pass_threshold(q64, k64, v64, causal=causal, dtype="float16",
                                                  o_ref=o_ref)
                row = {"D": d, "S": s, "causal": causal}
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    row["flash"] = round(flops / timed(
                        lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)) / 1e9, 1)
                saved = dict(_dispatch.TC_CONFIGS)
                try:
                    for cfg in CANDIDATES[d]:
                        _dispatch.TC_CONFIGS[d] = cfg
                        try:
                            cuflash.attention(qc, kc, vc, causal=causal, out=out)
                            err = float(np.max(np.abs(cp.asnumpy(out[0, 0]).astype(np.float64) - o_ref)))
                            if not err <= tol:
                                row[str(cfg)] = f"FAIL err {err:.2e} > {tol:.2e}"
                                continue
                            ms = timed(lambda: cuflash.attention(qc, kc, vc, causal=causal, out=out))
                            row[str(cfg)] = round(flops / ms / 1e9, 1)
                        except Exception as exc:  # a config that does not fit this GPU
                            row[str(cfg)] = f"n/a: {type(exc).__name__}: {exc}"[:100]
                finally:
                    _dispatch.TC_CONFIGS.clear()
                    _dispatch.TC_CONFIGS.update(saved)
                print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
