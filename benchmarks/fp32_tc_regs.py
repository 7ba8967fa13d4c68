"""Registers, spills and SASS instruction counts of every float32 tensor-core specialisation
(attn_mma.cu, T = float) for sm_80 and sm_90, both epilogues, with the NVRTC the environment
selects (CUFLASH_NVRTC_LIBRARY). Static counts over the whole kernel (the scores' k-loop body is
not unrolled: it appears once per kernel; benchmarks/fp32_tc_sass.py counts per key tile). CPU
only; from the repository root: PYTHONPATH=. python benchmarks/fp32_tc_regs.py."""
import os, re, subprocess, sys, tempfile
from pathlib import Path
from cuflash import _compile, _dispatch

nvdisasm = sorted(Path(p) for e in sys.path for p in Path(e).glob("nvidia/*/bin/nvdisasm"))
nvdisasm = str(nvdisasm[-1]) if nvdisasm else None
ops = ("HMMA", "FADD", "FFMA", "FMUL", "LDS", "MUFU", "F2F")  # F2F: none expected (cvt.rna.tf32)
print("NVRTC", _compile.nvrtc_version() if hasattr(_compile, "nvrtc_version") else "")
for arch, cc in (("sm_80", 80), ("sm_90", 90)):
    for precision in ("highest", "high"):
        for dpad in _dispatch.f32_head_dims(precision, cc):
            cfg = _dispatch.tensorcore_config(dpad, cc, "float32", precision)
            for stage in ((cfg[4], not cfg[4]) if cc == 90 else (cfg[4],)):
                for causal in (False, True):
                    terms = _dispatch.F32_TERMS[precision][0]
                    b = {True: "true", False: "false"}
                    name = (f"cuflash::cuflash_fwd_mma<float, {terms}, {dpad}, {cfg[0]}, {cfg[1]}, "
                            f"{cfg[2]}, {cfg[3]}, {b[stage]}, {b[causal]}>")
                    rep = _compile.compile_report(_compile.Specialisation("attn_mma", name), arch)
                    counts = ""
                    if nvdisasm:
                        with tempfile.TemporaryDirectory() as tmp:
                            path = os.path.join(tmp, "k.cubin")
                            Path(path).write_bytes(rep.cubin)
                            sass = subprocess.run([nvdisasm, "-c", path], capture_output=True,
                                                  text=True, check=True).stdout
                        counts = " ".join("%s=%d" % (o, len(re.findall(r"\b%s\b" % o, sass)))
                                          for o in ops)
                    print(f"{arch} {precision:7s} D{dpad:<3d} BN{cfg[0]:<2d} "
                          f"{'staged' if stage else 'direct'} {'causal' if causal else 'full  '} "
                          f"regs={rep.registers:3d} spill={rep.spill_stores}/{rep.spill_loads} "
                          f"{counts}", flush=True)
