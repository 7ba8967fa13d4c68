"""SASS instruction counts of the tensor-core backward's main loop (attn_bwd_mma.cu), sm_90, per
warp and query tile, for the defaults and the speed candidates (_dispatch.TC_BWD_CANDIDATES):
the largest loop that holds HMMAs, from the disassembly (static counts: both sides of a branch
are counted, e.g. the masked and unmasked exp2 of the lean form and its rare reduction-step
branch). CPU only (NVRTC and the nvidia-cuda-nvdisasm wheel); from the repository root:

    PYTHONPATH=. python benchmarks/bwd_sass.py [--cand base,lean] [--causal] [--det]

notes/BACKWARD.md ("Speed candidates") reads these counts."""
import argparse
import collections
import re
import sys

from cuflash import _dispatch
from fp32_tc_sass import sass_lines  # benchmarks/, next to this file

KEEP = ("HMMA", "LDSM", "IMAD", "IADD3", "ISETP", "LEA", "MUFU", "LDS", "STS", "FFMA", "FSEL",
        "F2FP", "HADD2", "REDG", "LDGSTS", "BAR", "BRA", "I2F")


def loop_ops(spec):
    """(compile report, opcodes of the largest loop holding HMMAs)."""
    rep, lines, labels = sass_lines(spec.name, spec.family)
    loops = []
    for i, (op, args) in enumerate(lines):
        m = re.search(r"(\.L_x_\d+)", args) if op == "BRA" else None
        if m and labels.get(m.group(1), i + 1) <= i:
            lo = labels[m.group(1)]
            n = sum(o == "HMMA" for o, _ in lines[lo:i])
            if n:
                loops.append((n, i - lo, lo, i))
    _, _, lo, hi = max(loops)
    return rep, [o for o, _ in lines[lo:hi + 1]]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cand", default=",".join(_dispatch.TC_BWD_CANDIDATES))
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--det", action="store_true")
    args = ap.parse_args(argv)
    saved = dict(_dispatch.TC_BWD_CONFIGS)
    for name in args.cand.split(","):
        for dpad, cfg in _dispatch.TC_BWD_CANDIDATES[name].items():
            _dispatch.TC_BWD_CONFIGS[dpad] = cfg
            try:
                bp = _dispatch.bwd_tensorcore_plan("float16", dpad, args.causal, args.det, 90)
            finally:
                _dispatch.TC_BWD_CONFIGS.clear()
                _dispatch.TC_BWD_CONFIGS.update(saved)
            spec = bp.passes[0][1].spec
            rep, ops = loop_ops(spec)
            c = collections.Counter(ops)
            print(f"{name:14s} D{dpad}: {rep.registers} registers, spills "
                  f"{rep.spill_stores}/{rep.spill_loads} B; loop {len(ops)} instructions: "
                  + ", ".join(f"{k} {c[k]}" for k in KEEP))
    return 0


if __name__ == "__main__":
    sys.exit(main())
