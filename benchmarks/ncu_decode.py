"""ncu target for the decode gap at long keys (issue 14): cuflash's decode kernel (kernel="auto")
and PyTorch SDPA's CUDNN backend (enable_gqa) on one long-key GQA decode, float16: B = 8, H = 32,
Hkv = 8, Sq = 1, Sk = 128k, D = 128 (2.1 GB of K and V each, far past the L2). Three warm-up
rounds, then one call of each inside cudaProfilerStart/Stop; after it, cuflash's output of one
batch entry is checked against the float64 reference with the project's pass rule. From the
repository root, on the GPU machine:

    PYTHONPATH=. ncu --profile-from-start off --clock-control none --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
        --section LaunchStats python3 benchmarks/ncu_decode.py

``--b/--sk/--hkv`` pick another point; ``--versions 2,4,5`` profiles cuflash's decode kernel at
each of those kernel versions (`_decode.DECODE_VERSION`, in that order, each checked after the
profiled range) before cuDNN. For the L2 breakdown by source (the L2 fabric between the two
partitions included), add ``--set full`` and read the report's raw page
(``ncu --import r.ncu-rep --page raw --csv``).
"""
import argparse

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import cupy as cp

import cuflash
from cuflash import reference

ap = argparse.ArgumentParser()
ap.add_argument("--b", type=int, default=8)
ap.add_argument("--sk", type=int, default=131072)
ap.add_argument("--hkv", type=int, default=8)
ap.add_argument("--versions", default="", help="comma-separated decode kernel versions "
                "(default: the module's DECODE_VERSION only)")
args = ap.parse_args()
from cuflash import _decode  # noqa: E402

VERSIONS = [int(x) for x in args.versions.split(",") if x] or [_decode.DECODE_VERSION]
B, H, HKV, SK, D = args.b, 32, args.hkv, args.sk, 128
q = torch.randn(B, H, 1, D, device="cuda", dtype=torch.float16)
k, v = (torch.randn(B, HKV, SK, D, device="cuda", dtype=torch.float16) for _ in range(2))
qc, kc, vc = (cp.from_dlpack(x) for x in (q, k, v))
outs = {ver: cp.empty_like(qc) for ver in VERSIONS}


def run_all():
    for ver in VERSIONS:
        _decode.DECODE_VERSION = ver
        cuflash.attention(qc, kc, vc, out=outs[ver])
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


for _ in range(3):
    run_all()
torch.cuda.synchronize()
for ver in VERSIONS:
    _decode.DECODE_VERSION = ver
    print(f"cuflash (version {ver}):", cuflash.dispatch_info(qc, kc, vc))
cp.cuda.runtime.profilerStart()
run_all()
torch.cuda.synchronize()
cp.cuda.runtime.profilerStop()

# Query head 0 of batch entry 0 (kv head 0) against float64, with the project's pass rule.
qs = cp.asnumpy(qc[0, 0])
ks, vs = cp.asnumpy(kc[0, 0]), cp.asnumpy(vc[0, 0])
rule = reference.pass_threshold(qs, ks, vs, dtype="float16")
for ver in VERSIONS:
    print(f"cuflash version {ver} (0, 0) against float64:", rule.judge(cp.asnumpy(outs[ver][0, 0])))
