"""Registers and SASS instruction counts (per opcode) of every plain tensor-core forward
specialisation (attn_mma.cu) for sm_80 and sm_90, as JSON, to check that a change to the kernel
leaves the plain code as it was: run before and after, then compare (--compare A B). Needs NVRTC
and nvdisasm (the nvidia-cuda-nvdisasm wheel), no GPU. ``--backward``: the plain tensor-core
backward's specialisations instead (attn_bwd_mma.cu: every dispatched plan and speed candidate).
``--variants``: the tensor-core backward's variant compile set (sm_90), for the per-tile costs
in notes/VARIANTS.md (compare against a --backward file: --per-tile A B).

    python benchmarks/sass_counts.py before.json
    python benchmarks/sass_counts.py --compare before.json after.json
    python benchmarks/sass_counts.py --backward bwd.json
    python benchmarks/sass_counts.py --variants bwd_var.json
"""
import collections
import json
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def _nvdisasm():
    found = shutil.which("nvdisasm")
    for entry in ([] if found else sys.path):
        hits = sorted(Path(entry).glob("nvidia/*/bin/nvdisasm"))
        if hits:
            return str(hits[-1])
    return found


def counts(spec, arch, nvd):
    from cuflash import _compile
    rep = _compile.compile_report(spec, arch)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(rep.cubin)
        f.flush()
        sass = subprocess.run([nvd, "-c", f.name], capture_output=True, text=True,
                              check=True).stdout
    ops = collections.Counter()
    for line in sass.splitlines():
        line = line.strip()
        if line.startswith("/*") and "*/" in line:
            tok = line.split("*/", 1)[1].split()
            if tok and tok[0].startswith("@"):   # predicated
                tok = tok[1:]
            if tok and not tok[0].startswith("."):
                ops[tok[0].rstrip(";")] += 1
    return {"regs": rep.registers, "spills": rep.spill_stores + rep.spill_loads,
            "total": sum(ops.values()), "ops": dict(ops)}


def main(argv):
    if argv[:1] == ["--compare"]:
        a, b = (json.load(open(x)) for x in argv[1:3])
        diff = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        for k in diff:
            print("differs:", k, a.get(k, {}).get("regs"), b.get(k, {}).get("regs"),
                  a.get(k, {}).get("total"), b.get(k, {}).get("total"))
        print(f"{len(set(a) & set(b)) - len(diff)} identical, {len(diff)} differ")
        return 1 if diff else 0
    from cuflash import _dispatch
    nvd = _nvdisasm()
    if argv[:1] == ["--backward"]:
        argv = argv[1:]
        jobs = []
        for arch in ("sm_80", "sm_90"):
            cc = int(arch[3:])
            plans = (_dispatch.all_backward_specialisations(cc)
                     + _dispatch.bwd_candidate_plans(cc))
            for bp in plans:
                for _, plan in bp.passes:
                    if plan.spec.family == "attn_bwd_mma" and (plan.spec, arch) not in jobs:
                        jobs.append((plan.spec, arch))
    elif argv[:1] == ["--variants"]:
        from cuflash._dispatch_variants import tensorcore_variant_backward_compile_specs
        argv = argv[1:]
        jobs = [(spec, "sm_90") for spec in tensorcore_variant_backward_compile_specs(90)]
    else:
        jobs = [(plan.spec, arch) for arch in ("sm_80", "sm_90")
                for plan in _dispatch.all_specialisations(int(arch[3:]))
                if plan.spec.family == "attn_mma"]
    with ThreadPoolExecutor(2) as ex:
        res = dict(zip((f"{a} {s.name}" for s, a in jobs),
                       ex.map(lambda j: counts(*j, nvd), jobs)))
    json.dump(res, open(argv[0], "w"), indent=1, sort_keys=True)
    print(len(res), "specialisations")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
