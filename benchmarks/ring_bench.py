"""Weak scaling of ring attention (cuflash.ring): per-GPU throughput with a fixed shard per GPU
(default 128k tokens, D = 128) against one GPU doing the same shard work, and how much of the
communication the compute hides.

Multi-GPU (one process per GPU, NCCL):

    python -m cuflash.ring.launch -n 8 benchmarks/ring_bench.py --mode nccl

  Every rank times, with CUDA events on its compute stream, after warm-up:
    T_ring  the ring over NCCL (the slowest rank's time, an all-reduce of the times),
    T_null  the same rank's compute with no transfer at all (`NullTransport`: the same calls on
            the same shapes; this is "one GPU on the same shard work"),
    T_comm  the ring's R - 1 key/value shifts alone, without compute.
  weak-scaling efficiency = T_null / T_ring; communication hidden =
  (T_null + T_comm - T_ring) / T_comm, clipped to [0, 1].

One GPU (what runs today):

    PYTHONPATH=. python benchmarks/ring_bench.py --mode single --world 8

  T_null for one rank of a ``--world`` ring (the per-GPU work of the multi-GPU run), the plain
  one-GPU attention of the whole sequence divided by the world (the ideal split; ``--no-full``
  skips it), and with ``--local`` the whole ring on this GPU (`LocalGPUTransport`: every rank,
  the shifts as device copies) against world x T_null, with a float64 check of a few rows.

FLOPs: 4 D per visited (query, key) pair forward, 10 D backward (``--backward``; the backward
uses cuflash's generic backward kernel, much slower than the forward: give it a smaller
``--shard``).
"""
from __future__ import annotations

import argparse
import json
import math
import sys

import numpy as np


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["single", "nccl"], default="single")
    ap.add_argument("--world", type=int, default=8, help="ranks (single mode; nccl: the launch)")
    ap.add_argument("--shard", type=int, default=131072, help="tokens per GPU (per rank)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    ap.add_argument("--causal", default="0,1", help="0 and/or 1")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--backward", action="store_true", help="also time the backward")
    ap.add_argument("--local", action="store_true", help="single mode: the whole ring on 1 GPU")
    ap.add_argument("--no-full", action="store_true", help="single mode: skip the full call")
    ap.add_argument("--json", default=None, help="write the results here (rank 0)")
    return ap.parse_args(argv)


def _time(fn, stream, repeats, warmup):
    """Median milliseconds of fn() by CUDA events on ``stream``."""
    import cupy as cp

    for _ in range(warmup):
        fn()
    stream.synchronize()
    times = []
    for _ in range(repeats):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record(stream)
        fn()
        b.record(stream)
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b))
    return float(np.median(times))


def _random(shape, dtype, seed):
    import cupy as cp

    seed = int(np.random.SeedSequence(seed).generate_state(1)[0])
    x = cp.random.default_rng(seed).standard_normal(shape, dtype=cp.float32)
    if dtype == "bfloat16":
        import ml_dtypes  # noqa: F401

        bits = (x.view(cp.uint32) + cp.uint32(0x8000)) >> 16  # round half up: inputs only
        return bits.astype(cp.uint16).view(np.dtype("bfloat16"))
    return x.astype(dtype)


def _shard_inputs(a, rank, seed=0):
    shape = (a.batch, a.heads, a.shard, a.d)
    return [_random(shape, a.dtype, [seed, rank, i]) for i in range(4)]  # q k v do


def _flops(layout, rank, causal, a, per_pair):
    from cuflash import ring

    work = sum(w[rank] for w in ring.step_work(layout, causal))
    return per_pair * a.d * work * a.batch * a.heads


def _ring_fns(transport, q, k, v, do, causal, seq_len):
    from cuflash import ring

    state = {}

    def fwd():
        state["o"], state["lse"] = ring.ring_attention(q, k, v, transport=transport,
                                                       causal=causal, seq_len=seq_len,
                                                       return_lse=True)

    def bwd():
        ring.ring_attention_backward(do, q, k, v, state["o"], state["lse"],
                                     transport=transport, causal=causal, seq_len=seq_len)

    return fwd, bwd


def _comm_only(transport, k, v, world):
    """The ring's R - 1 key/value shifts with nothing else (the buffers the schedule uses)."""
    import cupy as cp

    bufs = [{transport.local_ranks[0]: (cp.empty_like(k), cp.empty_like(v))} for _ in range(2)]

    def run():
        cur = 0
        for _ in range(world - 1):
            h = transport.shift(bufs[cur], bufs[1 - cur])
            transport.wait(h)
            cur = 1 - cur

    return run


def _row(label, causal, t_ms, flops):
    return {"what": label, "causal": bool(causal), "ms": round(t_ms, 3),
            "tflops": round(flops / (t_ms * 1e-3) / 1e12, 1)}


def run_single(a):
    import cupy as cp

    import cuflash
    from cuflash import ring

    stream = cp.cuda.get_current_stream()
    world, s = a.world, a.shard * a.world
    layout = ring.ZigzagLayout(s, world)
    rows = []
    q, k, v, do = _shard_inputs(a, 0)
    for causal in [bool(int(c)) for c in a.causal.split(",")]:
        fl = _flops(layout, 0, causal, a, 4)
        fwd, bwd = _ring_fns(ring.NullTransport(world, 0), q, k, v, do, causal, s)
        t_null = _time(fwd, stream, a.repeats, a.warmup)
        rows.append(_row(f"T_null (rank 0 of {world}, compute only)", causal, t_null, fl))
        if a.backward:
            fwd()
            t_b = _time(bwd, stream, a.repeats, a.warmup)
            rows.append(_row("T_null backward", causal, t_b, _flops(layout, 0, causal, a, 10)))
        if not a.no_full:
            full = [_random((a.batch, a.heads, s, a.d), a.dtype, [9, i]) for i in range(3)]
            t_full = _time(lambda: cuflash.attention(*full, causal=causal), stream,
                           max(1, a.repeats // 2), 1)
            rows.append(_row(f"one call on S={s} / {world} (the ideal split)", causal,
                             t_full / world, fl))
            rows[-1]["split_efficiency"] = round(t_full / world / t_null, 3)
            del full
        if a.local:
            rows += _single_local(a, causal, stream, t_null)
    return rows


def _single_local(a, causal, stream, t_null):
    import cupy as cp

    from cuflash import ring

    world, s = a.world, a.shard * a.world
    full = [_random((a.batch, a.heads, s, a.d), a.dtype, [7, i]) for i in range(3)]
    fn = lambda: ring.ring_attention_local(*full, world=world, causal=causal)  # noqa: E731
    t = _time(fn, stream, max(1, a.repeats // 2), 1)
    row = {"what": f"whole ring of {world} on this GPU (LocalGPUTransport)", "causal": causal,
           "ms": round(t, 3), "vs_world_x_T_null": round(t / (world * t_null), 3)}
    # float64 check of 8 query rows of head 0 against all the keys they see
    o = fn()
    stream.synchronize()
    g = np.linspace(0, s - 1, 8).astype(int)
    from cuflash.ring._ops import CuPyOps

    f64 = lambda x: CuPyOps().to_acc(cp.ascontiguousarray(x)).astype(cp.float64)  # noqa: E731
    q64, k64, v64 = (f64(x[0, 0]) for x in full)
    sc = (q64[cp.asarray(g)] @ k64.T) / math.sqrt(a.d)
    if causal:
        sc = cp.where(cp.arange(s)[None, :] > cp.asarray(g)[:, None], -cp.inf, sc)
    p = cp.exp(sc - sc.max(axis=1, keepdims=True))
    ref = (p / p.sum(axis=1, keepdims=True)) @ v64
    got = f64(o[0, 0])[cp.asarray(g)]
    row["max_abs_err_8_rows"] = float(cp.abs(got - ref).max())
    return [row]


def run_nccl(a):
    import cupy as cp

    from cuflash import ring
    from cuflash.ring import launch

    tr = launch.transport_from_env()
    rank, world = tr.local_ranks[0], tr.world
    s = a.shard * world
    layout = ring.ZigzagLayout(s, world)
    q, k, v, do = _shard_inputs(a, rank)
    null = ring.NullTransport(world, rank, stream=tr.compute_stream)
    rows = []
    for causal in [bool(int(c)) for c in a.causal.split(",")]:
        passes = [("forward", 0, 4)] + ([("backward", 1, 10)] if a.backward else [])
        for label, which, per in passes:
            fl = _flops(layout, rank, causal, a, per)
            ring_fns = _ring_fns(tr, q, k, v, do, causal, s)
            null_fns = _ring_fns(null, q, k, v, do, causal, s)
            if which:
                ring_fns[0](), null_fns[0]()
            launch.barrier(tr)
            t_ring = _time(ring_fns[which], tr.compute_stream, a.repeats, a.warmup)
            t_null = _time(null_fns[which], tr.compute_stream, a.repeats, a.warmup)
            launch.barrier(tr)
            t_comm = _time(_comm_only(tr, k, v, world), tr.compute_stream, a.repeats, a.warmup)
            t = cp.asarray([t_ring, t_null, t_comm], dtype=cp.float32)
            from cupy.cuda import nccl

            tr.comm.allReduce(t.data.ptr, t.data.ptr, 3, nccl.NCCL_FLOAT32, nccl.NCCL_MAX,
                              tr.compute_stream.ptr)
            t_ring, t_null, t_comm = (float(x) for x in cp.asnumpy(t))
            hidden = min(1.0, max(0.0, (t_null + t_comm - t_ring) / t_comm)) if t_comm else 1.0
            rows.append({"what": f"{label}, {world} GPUs, {a.shard} tokens/GPU",
                         "causal": causal, "T_ring_ms": round(t_ring, 3),
                         "T_null_ms": round(t_null, 3), "T_comm_ms": round(t_comm, 3),
                         "tflops_per_gpu": round(fl / (t_ring * 1e-3) / 1e12, 1),
                         "efficiency": round(t_null / t_ring, 3),
                         "comm_hidden": round(hidden, 3)})
    return rows if rank == 0 else []


def main(argv=None):
    a = _args(argv)
    rows = run_single(a) if a.mode == "single" else run_nccl(a)
    if not rows:
        return 0
    head = (f"ring_bench --mode {a.mode}: B={a.batch} H={a.heads} D={a.d} {a.dtype}, "
            f"{a.shard} tokens per GPU")
    print(head)
    keys = list(dict.fromkeys(k for r in rows for k in r))
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(str(r.get(k, "")) for k in keys) + " |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"header": head, "args": vars(a), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
