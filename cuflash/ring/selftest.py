"""Correctness run of ring attention over NCCL, one process per GPU, against float64.

    python -m cuflash.ring.selftest -n 8            # launches 8 ranks, then judges
    python -m cuflash.ring.selftest -n 2 --quick

Every rank builds the same global inputs (a fixed seed), runs `ring_attention` (and the
backward) on its zigzag shard over `NcclTransport`, and saves its rows; the launching process
then assembles the whole sequence and judges it with cuflash.reference's pass rules (forward:
`pass_threshold` and lse within 1e-4 + 1e-5 |lse|; backward: `grad_pass_threshold`). Cases:
float16, bfloat16 (with ml_dtypes) and float32 forward, float16/bfloat16 backward, causal and
not, a length that 2R divides and a tail that it does not. Exit status 0 when every case passes.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np

from .. import reference


def _cases(world, quick):
    dtypes = ["float16", "float32"]
    try:
        import ml_dtypes  # noqa: F401

        dtypes.insert(1, "bfloat16")
    except ImportError:
        pass
    lens = [64 * 2 * world] if quick else [64 * 2 * world, 64 * 2 * world + 2 * world - 1]
    out = []
    for dt in dtypes:
        for causal in (False, True):
            for s in lens:
                out.append((dt, causal, s, dt != "float32"))
    return out


def _inputs(case_id, dt, s):
    rng = np.random.default_rng([2026, case_id])
    shape = (2, 4, s, 64)
    return [reference.round_to(rng.standard_normal(shape), dt) for _ in range(4)]  # q k v do


def _np_dtype(dt):
    if dt == "bfloat16":
        import ml_dtypes  # noqa: F401
    return np.dtype(dt)


def _to_gpu(x64, dt):
    import cupy as cp

    if dt == "bfloat16":
        bits = (np.ascontiguousarray(x64, dtype=np.float32).view(np.uint32) >> 16)
        return cp.asarray(bits.astype(np.uint16)).view(_np_dtype(dt))
    return cp.asarray(x64.astype(dt))


def _to_host64(a):
    import cupy as cp

    if a.dtype.name == "bfloat16":
        bits = cp.asnumpy(a.view(cp.uint16)).astype(np.uint32) << 16
        return bits.view(np.float32).astype(np.float64)
    return cp.asnumpy(a).astype(np.float64)


def rank_main(out_dir, quick):
    """One rank: run every case, save this rank's rows as float64 in out_dir."""
    import cupy as cp

    from . import launch, ring_attention, ring_attention_backward, shard

    tr = launch.transport_from_env()
    r, w = tr.local_ranks[0], tr.world
    for i, (dt, causal, s, bwd) in enumerate(_cases(w, quick)):
        q, k, v, do = (shard(_to_gpu(x, dt), world=w, rank=r) for x in _inputs(i, dt, s))
        o, lse = ring_attention(q, k, v, transport=tr, causal=causal, seq_len=s,
                                return_lse=True)
        res = {"o": o, "lse": lse}
        if bwd:
            res["dq"], res["dk"], res["dv"] = ring_attention_backward(
                do, q, k, v, o, lse, transport=tr, causal=causal, seq_len=s)
        tr.compute_stream.synchronize()
        np.savez(os.path.join(out_dir, f"case{i}_rank{r}.npz"),
                 **{n: (_to_host64(x) if n != "lse" else cp.asnumpy(x).astype(np.float64))
                    for n, x in res.items()})
    launch.barrier(tr)


def judge(out_dir, world, quick):
    """Assemble every case from the ranks' files and judge it; returns the failures."""
    from . import unshard

    failures = []
    for i, (dt, causal, s, bwd) in enumerate(_cases(world, quick)):
        q, k, v, do = _inputs(i, dt, s)
        parts = [np.load(os.path.join(out_dir, f"case{i}_rank{r}.npz")) for r in range(world)]
        full = {n: unshard([p[n] if n != "lse" else p[n][..., None] for p in parts],
                           seq_len=s) for n in parts[0].files}
        full["lse"] = full["lse"][..., 0]
        o_ref, lse_ref = reference.attention_ref(q, k, v, causal=causal)
        rule = reference.pass_threshold(q, k, v, causal=causal, dtype=dt, o_ref=o_ref)
        verdict = rule.judge(full["o"])
        lerr = np.abs(full["lse"] - lse_ref)
        ok = verdict.passed and bool(np.all(lerr <= 1e-4 + 1e-5 * np.abs(lse_ref)))
        line = (f"case {i}: {dt} causal={causal} S={s} world={world}: forward "
                f"err/thr {verdict.frac_threshold:.3f}, lse err {lerr.max():.2e}")
        if bwd:
            g_ref = reference.attention_backward_ref(do, q, k, v, causal=causal)
            tols, _ = reference.grad_pass_threshold(do, q, k, v, causal=causal, dtype=dt,
                                                    ref=g_ref)
            fr = [np.abs(full[n] - g).max() / t for n, g, t in zip(("dq", "dk", "dv"), g_ref,
                                                                    tols)]
            ok = ok and max(fr) <= 1
            line += ", backward err/thr " + " ".join(f"{x:.3f}" for x in fr)
        print(("PASS " if ok else "FAIL ") + line, flush=True)
        if not ok:
            failures.append(line)
    return failures


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m cuflash.ring.selftest")
    ap.add_argument("-n", "--nproc", type=int, default=None,
                    help="launch this many ranks (one per GPU), then judge")
    ap.add_argument("--out", default=None, help="directory for the ranks' results")
    ap.add_argument("--quick", action="store_true", help="one sequence length per case")
    a = ap.parse_args(argv)
    from . import launch

    if launch.in_launched_process():
        rank_main(a.out, a.quick)
        return 0
    if a.nproc is None:
        ap.error("-n is required (outside a launched process)")
    out = a.out or tempfile.mkdtemp(prefix="cuflash_ring_")
    args = ["--out", out] + (["--quick"] if a.quick else [])
    status = launch.launch(a.nproc, "cuflash.ring.selftest", args, module=True)
    if status != 0:
        print(f"a rank failed (exit status {status})", file=sys.stderr)
        return status
    failures = judge(out, a.nproc, a.quick)
    print(f"{len(failures)} of {len(_cases(a.nproc, a.quick))} cases failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
