"""Per-key-tile SASS instruction counts of the float32 "highest" kernel (attn_mma.cu), sm_90, from
the disassembly: the scores' k-loop body (one 16-column block; `#pragma unroll 1`, so it is the
innermost backward branch around HMMAs) times D / 16, plus the P.V stretch (first to last HMMA
after that loop, the straight-line unrolled product). Per warp and tile; every instruction is one
issue slot of a sub-partition. CPU only (NVRTC and the nvidia-cuda-nvdisasm wheel); from the
repository root: PYTHONPATH=. python benchmarks/fp32_tc_sass.py [3xtf32|3xfp16] (the form of
"highest": _dispatch.TC_F32_FORM's by default; notes/FLOAT32.md). The 3xfp16 form's counts also
give the HMMA shapes (HMMA.16816.F32 for fp16 products, HMMA.1688.F32.TF32 for TF32 ones)."""
import collections, os, re, subprocess, sys, tempfile
from pathlib import Path
from cuflash import _compile, _dispatch

KEEP = ("HMMA", "FADD", "FMUL", "FFMA", "LDS", "LDSM", "IADD3", "LOP3", "MUFU", "FSETP", "FSEL",
        "F2F", "HADD2")


def sass_lines(name, family="attn_mma"):
    """(compile report, [(opcode without modifiers, operands)], {label: index}) of one kernel
    specialisation for sm_90 (benchmarks/bwd_sass.py uses it too)."""
    nvdisasm = str(sorted(p for e in sys.path for p in Path(e).glob("nvidia/*/bin/nvdisasm"))[-1])
    rep = _compile.compile_report(_compile.Specialisation(family, name), "sm_90")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        Path(path).write_bytes(rep.cubin)
        out = subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True,
                             check=True).stdout
    lines, labels = [], {}
    for ln in out.splitlines():
        m = re.match(r"\s*(\.L_x_\d+):", ln)
        if m:
            labels[m.group(1)] = len(lines)
            continue
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*(.*?);", ln)
        if m:
            lines.append((m.group(2).split(".")[0], m.group(3), m.group(2)))
    return rep, lines, labels


def hist(lines):
    c = collections.Counter(ln[0] for ln in lines)
    return c, sum(c.values())


def main(form=None):
    form = form or _dispatch.tc_f32_form("highest")
    for dpad in (64, 128):
        plan = _dispatch.tensorcore_plan("float32", dpad, False, 90, "highest", form=form)
        bn = plan.block_n
        rep, lines, labels = sass_lines(plan.spec.name)
        shapes = collections.Counter(full for op, _, full in lines if op == "HMMA")
        loops = []
        for i, (op, args, _) in enumerate(lines):
            if op == "BRA":
                m = re.search(r"(\.L_x_\d+)", args)
                if m and labels.get(m.group(1), i + 1) <= i:
                    lo = labels[m.group(1)]
                    if any(ln[0] == "HMMA" for ln in lines[lo:i]):
                        loops.append((i - lo, lo, i))
        _, lo, hi = min(loops)
        kc_body = lines[lo:hi + 1]
        after = [i for i in range(hi + 1, len(lines)) if lines[i][0] == "HMMA"]
        pv = lines[after[0]:after[-1] + 1]
        kc, nkc = hist(kc_body)
        pc, npv = hist(pv)
        steps = dpad // 16
        tot = nkc * steps + npv
        hm = kc["HMMA"] * steps + pc["HMMA"]
        print(f"{form} D={dpad} BN={bn} regs={rep.registers}: per tile and warp {tot} instructions, "
              f"{hm} HMMA, {kc['FADD'] * steps + pc['FADD']} FADD "
              f"(scores: {steps} x {nkc} [{kc['HMMA']} HMMA, {kc['FADD']} FADD], "
              f"P.V: {npv} [{pc['HMMA']} HMMA, {pc['FADD']} FADD]); "
              + " ".join(f"{o}={kc[o] * steps + pc[o]}" for o in KEEP)
              + f"; static HMMA shapes {dict(shapes)}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:2])
