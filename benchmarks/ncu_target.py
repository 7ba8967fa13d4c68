"""ncu target: cuflash (kernel="auto", the Hopper kernel on an H100/H200) and PyTorch SDPA's CUDNN
backend at D = 256, S = 512 (B = 32, H = 8), float16, without and with the causal mask; three
warm-up rounds, then one call of each inside cudaProfilerStart/Stop. notes/PERF.md has the
readings. From the repository root, on the GPU machine:

    PYTHONPATH=. ncu --profile-from-start off --clock-control none --section SpeedOfLight \
        --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
        --section WarpStateStats --section LaunchStats --section Occupancy \
        python3 benchmarks/ncu_target.py

(Edit B, H, S, D for another point.) After the profiled range it checks cuflash's output of one
(batch, head) slice against the float64 reference with the project's pass rule.
"""

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import cupy as cp

import cuflash
from cuflash import reference

B, H, S, D = 32, 8, 512, 256
q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.float16) for _ in range(3))
qc, kc, vc = (cp.from_dlpack(x) for x in (q, k, v))
out = cp.empty_like(qc)


def run_all():
    for causal in (False, True):
        cuflash.attention(qc, kc, vc, causal=causal, out=out)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        for causal in (False, True):
            F.scaled_dot_product_attention(q, k, v, is_causal=causal)


for _ in range(3):
    run_all()
torch.cuda.synchronize()
torch.cuda.profiler.start()
run_all()
torch.cuda.synchronize()
torch.cuda.profiler.stop()

# out holds the causal result (the last cuflash call): check one slice.
q64, k64, v64 = (x[0, 0].double().cpu().numpy() for x in (q, k, v))
o_ref, _ = reference.attention_ref(q64, k64, v64, causal=True)
rule = reference.pass_threshold(q64, k64, v64, causal=True, dtype="float16", o_ref=o_ref)
verdict = rule.judge(cp.asnumpy(out[0, 0]).astype(np.float64))
if not verdict.passed:
    raise SystemExit("cuflash output wrong: " + "; ".join(verdict.reasons))
print(f"done; cuflash checked: max abs error {verdict.max_abs_err:.2e} <= {rule.threshold:.2e}, "
      f"{verdict.frac_bound:.2f} of the a-priori bound")
