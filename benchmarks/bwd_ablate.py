"""Ablations of the Hopper backward: what each part of its tile costs (notes/BACKWARD.md, "The dq
reductions"; notes/PERF.md's method: find where the time goes before changing it).

An ablated kernel is a copy of ``kernels_cu`` whose attn_bwd_wgmma.cu has one part removed, so
its gradients are wrong on purpose:

- ``noreduce``: the dq reductions predicated off (the dQ products and everything else kept; the
  predicate compares a dq value with a constant no input produces, so ptxas cannot drop the
  products that feed it);
- ``noload``: the next query tile's Q and dO copies not issued (its lse and delta still read).

A candidate is a copy with a part done another way (its gradients must match the base's):

- ``bulk`` (non-deterministic D = 64 and 128; notes/BACKWARD.md, "The dq reductions"): each
  warp's dq piece staged in the tile's own Q (warpgroup 0) or dO (warpgroup 1) stage, free once
  both warpgroups' products are complete (one more block barrier), and added by one
  ``cp.reduce.async.bulk`` of 256 bytes per row instead of 16- or 8-byte ``red`` per lane; the
  staged rows are read before the next barrier 1, after which the next tile's copies land
  there. Written in session z; not yet run on a GPU.

Variants are timed interleaved in rounds, in one process, beside torch's FLASH backward on the same
inputs (each round: 10 back-to-back calls between two CUDA events behind bench.py's spinning
kernel; the median over rounds), at points of the standard grid (B = 16384 / S, H = 2048 / D,
float16, ``kernel="hopper"``). Before timing, every variant's dq, dk, dv are compared with FLASH's
(max abs differences printed: the intact kernels must match the reference tree's, the ablated ones
show which gradient they break) and, with ``--bitwise``, the deterministic variants' results with
each other bit for bit. A variant is ``NAME=DIR[@PAD][@det]``: a kernel source directory, the dq
accumulator's row padding (``_dispatch.TC_BWD_DQ_PAD`` for its calls; default the tree's) and
``deterministic=True``. Kernels are compiled into per-variant in-process caches (the disk cache
key holds the source, so ``compile`` can fill ``$CUFLASH_CACHE_DIR`` on a machine without a GPU)::

    python3 benchmarks/bwd_ablate.py make /tmp/abl     # /tmp/abl/{base,noreduce,noload,bulk}
    python3 benchmarks/bwd_ablate.py compile --variant base=/tmp/abl/base --variant ... \\
        [--only "fp16_t, 256,"]
    python3 benchmarks/bwd_ablate.py run --variant base=/tmp/abl/base \\
        --variant noreduce=/tmp/abl/noreduce --variant det=/tmp/abl/base@@det \\
        --points 256:4096,256:4096:causal,128:4096 --rounds 5 --bitwise

Prints one JSON line per point: TFLOP/s (2.5x the forward's FLOPs) per variant and FLASH's.
``run`` needs a GPU of compute capability 9.0, CuPy and PyTorch.
"""
import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

_KERNEL = "attn_bwd_wgmma.cu"
_REDUCTIONS = (  # (the call as written in the kernel, the argument its predicate tests)
    ("bwd_red_add4(dst + 16 * j,", "(odd ? r0 : a0)"),
    ("bwd_red_add2(dst + nt * 8,", "dq[pc][nt * 4 + 2 * h]"),
)
_NEXT_LOAD = "load_rows(ix_n, mt_n * BM, 1 - buf, l2_next, dl_next);"
# noload: load_rows gets a `copy` argument (default true) around its two tile copies, and the
# next tile's call passes false (its lse and delta are still read).
_LOAD_EDITS = (
    ("const auto load_rows = [&](const BwdIndex& ix, int i0, int buf, float& l2, float& dl) {\n"
     "        const BwdOffsets off = bwd_offsets(p, ix);\n",
     "const auto load_rows = [&](const BwdIndex& ix, int i0, int buf, float& l2, float& dl,\n"
     "                               bool copy = true) {\n"
     "        const BwdOffsets off = bwd_offsets(p, ix);\n        if (copy) {\n"),
    ("                                         sq, d, tid);\n        l2 = __int_as_float(0x7f800000);",
     "                                         sq, d, tid);\n        }\n        l2 = __int_as_float(0x7f800000);"),
    (_NEXT_LOAD, "load_rows(ix_n, mt_n * BM, 1 - buf, l2_next, dl_next, false);"),
)


_BULK_EDITS = (
    ("""__device__ __forceinline__ void fence_async_smem() {
    asm volatile("fence.proxy.async.shared::cta;\\n" ::: "memory");
}
""", """__device__ __forceinline__ void fence_async_smem() {
    asm volatile("fence.proxy.async.shared::cta;\\n" ::: "memory");
}
__device__ __forceinline__ void sts_f2(unsigned int addr, float a, float b) {
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};\\n" :: "r"(addr), "f"(a), "f"(b) : "memory");
}
__device__ __forceinline__ void bulk_red_add(float* dst, unsigned int src, unsigned int bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\\n"
                 :: "l"(dst), "r"(src), "r"(bytes) : "memory");
}
"""),
    ("""    constexpr bool RED4 = POLICY::PLAIN && !(DPAD == 64 && CAUSAL);
""", """    constexpr bool BULK = POLICY::PLAIN && !DET && !Cfg::SPLIT && !OV;
    static_assert(!BULK || (Cfg::PIECES_WG == 1 && 4 * 16 * 256 == Cfg::Q_BYTES), "staging fits");
    constexpr bool RED4 = POLICY::PLAIN && !(DPAD == 64 && CAUSAL);
"""),
    ("""        fence_regs(dv_acc);
#pragma unroll
        for (int pc = 0; pc < Cfg::PIECES_WG; ++pc) {
            fence_regs(dq[pc]);
            const int piece = cw * Cfg::PIECES_WG + pc;
            const int mp = piece / Cfg::PANELS, np = piece % Cfg::PANELS;
""", """        fence_regs(dv_acc);
        if constexpr (BULK) __syncthreads();  // both warpgroups' reads of Q and dO are complete
#pragma unroll
        for (int pc = 0; pc < Cfg::PIECES_WG; ++pc) {
            fence_regs(dq[pc]);
            const int piece = cw * Cfg::PIECES_WG + pc;
            const int mp = piece / Cfg::PANELS, np = piece % Cfg::PANELS;
            if constexpr (BULK) {
                const unsigned int stg = (cw == 0 ? q_t : do_t) + warp * 16 * 256;
#pragma unroll
                for (int h = 0; h < 2; ++h)
#pragma unroll
                    for (int nt = 0; nt < 8; ++nt)
                        sts_f2(stg + (g + 8 * h) * 256 + (nt * 8 + 2 * t4) * 4,
                               dq[pc][nt * 4 + 2 * h], dq[pc][nt * 4 + 2 * h + 1]);
                fence_async_smem();
                __syncwarp();
                const int row = i0 + 64 * mp + 16 * warp + lane;
                if (lane < 16 && row < sq)
                    bulk_red_add(dqa + static_cast<long long>(row) * p.dqa_sr + 64 * np,
                                 stg + lane * 256, 256u);
                continue;
            }
"""),
    ("""        if constexpr (OV) {  // dK complete: dS^T and this stage's Q are free for the next tile
            wgmma_wait<0>();
            fence_regs(dk_acc);
        }
        kb.step(p, cur_mt, cur_red, cur_ix);""", """        if constexpr (BULK) {
            // The tile's additions one bulk group; its reads of the staged rows (the next tile's
            // load target) done before barrier 1. (Were it kept: attn_wgmma.cu's bulk-group
            // helpers to wgmma_ops.cuh, shared.)
            if (lane < 16)
                asm volatile("cp.async.bulk.commit_group;\\ncp.async.bulk.wait_group.read 0;\\n"
                             ::: "memory");
        }
        if constexpr (OV) {  // dK complete: dS^T and this stage's Q are free for the next tile
            wgmma_wait<0>();
            fence_regs(dk_acc);
        }
        kb.step(p, cur_mt, cur_red, cur_ix);"""),
)


def _ablate(text, what):
    if what == "noreduce":
        for call, arg in _REDUCTIONS:
            if text.count(call) != 1:
                raise SystemExit(f"{_KERNEL}: expected one {call!r}; update bwd_ablate.py")
            text = text.replace(call, f"if ({arg} == 1.2345e-30f) {call}")
    elif what in ("noload", "bulk"):
        for old, new in (_LOAD_EDITS if what == "noload" else _BULK_EDITS):
            if text.count(old) != 1:
                raise SystemExit(f"{_KERNEL}: expected one {old!r}; update bwd_ablate.py")
            text = text.replace(old, new)
    return text


def make(out, src):
    """Write out/base (a copy of src), out/noreduce, out/noload and out/bulk."""
    for name in ("base", "noreduce", "noload", "bulk"):
        d = Path(out) / name
        if d.exists():
            shutil.rmtree(d)
        shutil.copytree(src, d)
        f = d / _KERNEL
        f.write_text(_ablate(f.read_text(), name))
        print(d)


def parse_variants(items):
    """{name: (source dir, pad or None, deterministic)} from NAME=DIR[@PAD][@det]."""
    out = {}
    for item in items:
        name, _, rest = item.partition("=")
        parts = rest.split("@")
        d = Path(parts[0]).resolve()
        if not name or not (d / _KERNEL).is_file():
            raise SystemExit(f"--variant {item!r}: expected NAME=DIR[@PAD][@det], DIR with {_KERNEL}")
        pad = int(parts[1]) if len(parts) > 1 and parts[1] else None
        out[name] = (d, pad, parts[2:] == ["det"])
    return out


class Variants:
    """Points the compiler, its in-process kernel cache and the dq padding at one variant."""

    def __init__(self, variants):
        from cuflash import _compile, _dispatch
        self._compile, self._dispatch = _compile, _dispatch
        self.v = variants
        self.default_pad = _dispatch.TC_BWD_DQ_PAD
        self.caches = {d: ({}, {}) for d, _, _ in variants.values()}

    def use(self, name):
        d, pad, _ = self.v[name]
        self._compile.SOURCE_DIR = d
        self._compile.family_source.cache_clear()
        self._compile._kernels, self._compile._smem_limit = self.caches[d]
        self._dispatch.TC_BWD_DQ_PAD = self.default_pad if pad is None else pad


def compile_all(variants, only=None):
    """Compile every Hopper-backward specialisation (those whose name matches the regular
    expression ``only``, if given) of each variant into the disk cache."""
    import re
    from concurrent.futures import ThreadPoolExecutor

    from cuflash import _compile, _dispatch
    vs = Variants(variants)
    specs = [s for s in _dispatch.backward_kernel_specs(90) if s.family == "attn_bwd_wgmma"
             and (only is None or re.search(only, s.name))]
    for name in variants:
        vs.use(name)
        with ThreadPoolExecutor(2) as ex:
            list(ex.map(lambda s: _compile.compiled_image(s, "sm_90a"), specs))
        print("compiled", name, len(specs), flush=True)


def run(variants, points, rounds, bitwise):
    import numpy as np
    import cupy as cp
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import cuflash
    from bench import Spinner
    from tune import burst_ms

    vs = Variants(variants)
    names = list(variants)
    spinner = Spinner(cp)
    for point in points.split(","):
        parts = point.split(":")
        d, s, causal = int(parts[0]), int(parts[1]), parts[2:] == ["causal"]
        b, h = 16384 // s, 2048 // d
        flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)  # five products of 2 S S D
        g = torch.Generator(device="cuda").manual_seed(1234 + d + s)
        tq, tk, tv, tdo = (torch.randn(b, h, s, d, device="cuda", dtype=torch.float16,
                                       generator=g) for _ in range(4))
        q, k, v, do = (cp.from_dlpack(x) for x in (tq, tk, tv, tdo))
        vs.use(names[0])
        o, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
        grads = [cp.empty_like(x) for x in (q, k, v)]
        ws = {}
        for n in names:
            vs.use(n)
            ws[n] = cp.empty(cuflash.attention_backward_workspace_size(
                do, q, k, v, o, lse, causal=causal, deterministic=variants[n][2],
                kernel="hopper"), dtype=cp.uint8)

        def ours(n):
            return cuflash.attention_backward(do, q, k, v, o, lse, causal=causal,
                                              deterministic=variants[n][2], kernel="hopper",
                                              out=tuple(grads), workspace=ws[n])

        xs = [x.detach().clone().requires_grad_(True) for x in (tq, tk, tv)]
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(*xs, is_causal=causal)
        ref = torch.autograd.grad(out, xs, tdo, retain_graph=True)
        row = {"D": d, "S": s, "causal": causal, "label": str(cuflash.backward_dispatch_info(
            do, q, k, v, o, lse, causal=causal, kernel="hopper"))}
        kept = {}
        for n in names:
            vs.use(n)
            for x in grads:
                x.fill(float("nan"))
            ours(n)
            cp.cuda.Device().synchronize()
            row["maxdiff_" + n] = "/".join(
                f"{float(torch.max(torch.abs(torch.from_dlpack(a).float() - r.float()))):.1e}"
                for a, r in zip(grads, ref))
            if bitwise and variants[n][2]:
                kept[n] = [x.copy() for x in grads]
        first = next(iter(kept), None)
        for n in kept:
            if n != first:
                row[f"bitwise_{first}_{n}"] = all(
                    bool((x.view(cp.uint16) == y.view(cp.uint16)).all())
                    for x, y in zip(kept[first], kept[n]))

        def flash():
            return torch.autograd.grad(out, xs, tdo, retain_graph=True)

        for n in names:  # warm-up
            vs.use(n)
            ours(n)
        flash()
        times = {n: [] for n in names + ["flash"]}
        for _ in range(rounds):
            for n in names:
                vs.use(n)
                times[n].append(burst_ms(lambda: ours(n), spinner))
            times["flash"].append(burst_ms(flash, spinner))
        for n, ts in times.items():
            row[n] = round(flops / np.median(ts) / 1e9, 1)
        print(json.dumps(row), flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make", help="write the ablated kernel trees")
    m.add_argument("out")
    m.add_argument("--src", default=str(ROOT / "kernels_cu"))
    for name in ("compile", "run"):
        c = sub.add_parser(name)
        c.add_argument("--variant", action="append", required=True, metavar="NAME=DIR[@PAD][@det]")
        if name == "compile":
            c.add_argument("--only", metavar="REGEX",
                           help="only the specialisations whose name matches (re.search)")
        if name == "run":
            c.add_argument("--points", default="256:4096,256:4096:causal,128:4096,64:4096")
            c.add_argument("--rounds", type=int, default=5)
            c.add_argument("--bitwise", action="store_true",
                           help="compare the deterministic variants' results bit for bit")
    args = ap.parse_args(argv)
    if args.cmd == "make":
        make(args.out, args.src)
    elif args.cmd == "compile":
        compile_all(parse_variants(args.variant), args.only)
    else:
        run(parse_variants(args.variant), args.points, args.rounds, args.bitwise)
    return 0


if __name__ == "__main__":
    sys.exit(main())
