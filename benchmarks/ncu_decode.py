"""ncu target for the decode gap at long keys (issue 14): cuflash's decode kernel (kernel="auto")
and PyTorch SDPA's CUDNN backend (enable_gqa) on one long-key GQA decode, float16: B = 8, H = 32,
Hkv = 8, Sq = 1, Sk = 128k, D = 128 (2.1 GB of K and V each, far past the L2). Three warm-up
rounds, then one call of each inside cudaProfilerStart/Stop; after it, cuflash's output of one
batch entry is checked against the float64 reference with the project's pass rule. From the
repository root, on the GPU machine:

    PYTHONPATH=. ncu --profile-from-start off --clock-control none --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
        --section LaunchStats python3 benchmarks/ncu_decode.py

``--b/--sk/--hkv`` pick another point.
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
args = ap.parse_args()
B, H, HKV, SK, D = args.b, 32, args.hkv, args.sk, 128
q = torch.randn(B, H, 1, D, device="cuda", dtype=torch.float16)
k, v = (torch.randn(B, HKV, SK, D, device="cuda", dtype=torch.float16) for _ in range(2))
qc, kc, vc = (cp.from_dlpack(x) for x in (q, k, v))
out = cp.empty_like(qc)


def run_all():
    cuflash.attention(qc, kc, vc, out=out)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


for _ in range(3):
    run_all()
torch.cuda.synchronize()
print("cuflash:", cuflash.dispatch_info(qc, kc, vc))
cp.cuda.runtime.profilerStart()
run_all()
torch.cuda.synchronize()
cp.cuda.runtime.profilerStop()

# Query head 0 of batch entry 0 (kv head 0) against float64, with the project's pass rule.
qs = cp.asnumpy(qc[0, 0])
ks, vs = cp.asnumpy(kc[0, 0]), cp.asnumpy(vc[0, 0])
rule = reference.pass_threshold(qs, ks, vs, dtype="float16")
print("cuflash (0, 0) against float64:", rule.judge(cp.asnumpy(out[0, 0])))
