"""Host time per attention call: wall clock over N calls of a tiny problem, one final sync.

A tiny problem (default B=1, H=1, S=16, D=64, float16) makes the GPU time negligible, so the
per-call time is what the host spends in Python, the library and the driver to enqueue one
launch. All rows run in this one process, back to back:

- cuflash on CuPy arrays, allocating the output, and with ``out=``;
- cuflash on torch tensors (DLPack/CUDA array interface), and torch's SDPA on the same tensors;
- JAX, each inside one ``jax.jit``-compiled function called N times: ``cuflash.jax.attention``,
  an empty ``buffer_callback`` with the same operands (the floor of that route), and
  ``jax.nn.dot_product_attention(implementation="cudnn")``;
- the same JAX calls of cuflash and of the empty callback with XLA command buffers (CUDA
  graphs) on: ``cuflash.jax.attention(..., command_buffer=True)`` and an empty
  ``buffer_callback(..., command_buffer_compatible=True)``, in a child process started with
  ``XLA_FLAGS=--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL
  --xla_gpu_graph_min_graph_size=1`` (XLA reads its flags once, when JAX starts). A replayed
  call runs no Python callback at all.

Every row runs for each sequence length in ``--s`` (default 16 and 128: the first takes the
decode kernel with ``kernel="auto"``, the second a dense kernel), and says which path it took
(``decode`` or ``dense``, from the plan label `cuflash.dispatch_info` gives, printed above the
rows) and, for the cuflash rows outside jit, whether the call's signature is recorded in the
call cache (``hit``: repeated calls skip the checks and the dispatcher, cuflash/_callcache.py).

Each row is the median of ``--repeats`` runs of ``--calls`` calls (the fastest in brackets),
after ``--warmup-s`` seconds of busy host (the first rows used to pay for the CPU clock's ramp).
The ``floor`` rows time, alone, what a record hit cannot avoid: CuPy's ``empty`` for o (and lse),
its parts (the ``ndarray`` constructor, the memory pool's malloc, an array around a block already
held) and a no-op kernel launch through ``Function.__call__`` (what a hit does) and through
``cupy.cuda.driver.launchKernel``.

Peers that are not installed are skipped (and say why). Targets (issue 13): <= 10 us for CuPy
with and without ``out=``, <= 20 us for torch tensors, JAX within 2x an empty buffer_callback.

    python benchmarks/host_time.py [--calls 2000] [--s 16,128] [--d 64] [--dtype float16]
                                   [--repeats 5] [--impl driver|cupy-call] [--no-floor]
                                   [--only cupy]
"""
import argparse
import json
import os
import subprocess
import sys
import time

# CuPy, torch and JAX share the GPU in this process: JAX must not take 75% of it at start.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


class Timing(float):
    """us per call (wall clock over the calls and the final sync), with ``enqueue``: the same
    before the sync. When the two are close the host is the bottleneck; when the total is
    larger the GPU was (the launch queue filled, or the last kernels were still running)."""

    enqueue = None
    best = None


#: Timed runs per row (`--repeats`): a row's figure is the median run, so that the first
#: rows of the process (S = 16's CuPy rows come first) are not charged for the CPU's clock
#: ramp or the pool's first growth; ``best`` is the fastest run.
REPEATS = [5]


def _time(fn, sync, calls, warmed=None):
    fn()
    sync()  # warm: compile, plan, caches
    for _ in range(10):
        fn()
    sync()
    if warmed is not None:
        warmed()
    runs = []
    for _ in range(REPEATS[0]):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        sync()
        runs.append(((time.perf_counter() - t0) / calls * 1e6, (t1 - t0) / calls * 1e6))
    runs.sort()
    total, enqueue = runs[len(runs) // 2]
    t = Timing(total)
    t.enqueue = enqueue
    t.best = runs[0][0]
    return t


def _spin(seconds):
    """Keep the host busy for `seconds` (the CPU's clock up before the first timed row)."""
    end = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < end:
        x += 1
    return x


#: A kernel that does nothing with a parameter block of DecodeParams' size (392 bytes), for
#: the launch floor rows.
_NOOP_SRC = r"""
struct Block { unsigned long long w[49]; };
extern "C" __global__ void cuflash_noop(Block b) {}
"""


def floor_rows(args):
    """What a hit cannot avoid, measured alone with the same timing: CuPy's allocation of o
    (and of lse), a launch of a no-op kernel with a 392-byte block passed by address through
    `Function.__call__` (what a record hit does) and through `cupy.cuda.driver.launchKernel`
    on a pre-packed ``void*[1]`` (the cheapest launch from Python), and the current-stream and
    device lookups. A hit costs about its Python (benchmarks/host_time_standin.py) plus the
    allocation rows plus the launch row."""
    import cupy as cp
    import numpy as np

    o_shape, lse_shape = (1, 1, args.s, args.d), (1, 1, args.s)
    sync = cp.cuda.Stream.null.synchronize
    rows = [("floor: cupy.empty(o)", _time(lambda: cp.empty(o_shape, dtype=args.dtype), sync,
                                           args.calls)),
            ("floor: cupy.empty(o) + cupy.empty(lse)",
             _time(lambda: (cp.empty(o_shape, dtype=args.dtype),
                            cp.empty(lse_shape, dtype=cp.float32)), sync, args.calls))]
    # Where cupy.empty's time goes (allocation from the pool, and the array object around it),
    # for issue 13's <= 10 us without out=: the ndarray constructor without cupy.empty's
    # wrapper, the pool's malloc alone, and an array around a block already held.
    pool = cp.get_default_memory_pool()
    nbytes = int(np.prod(o_shape)) * np.dtype(args.dtype).itemsize
    held = pool.malloc(nbytes)
    # The no-out= hit's allocation, as main made it before (a NumPy dtype instance, keyword),
    # as it makes it now (the dtype's scalar type, positional: `_callcache._dtype_arg`) and
    # with CUFLASH_FAST_EMPTY (`_callcache._fast_empty`: CuPy's two construction steps, the
    # default since 2026-12-03);
    # o and lse carved from one pool block (a candidate for return_lse=True, not taken).
    from cuflash import _callcache

    dt = np.dtype(args.dtype)
    t = _callcache._dtype_arg(dt)
    rows += [("floor: cupy.empty(o_shape, dtype=<numpy dtype>) [hit before]",
              _time(lambda: cp.empty(o_shape, dtype=dt), sync, args.calls)),
             ("floor: cupy.empty(o_shape, <scalar type>) [hit now, flag off]",
              _time(lambda: cp.empty(o_shape, t), sync, args.calls)),
             ("floor: cupy.ndarray(o_shape, <scalar type>)",
              _time(lambda: cp.ndarray(o_shape, t), sync, args.calls))]
    fast_was = _callcache.FAST_EMPTY
    _callcache.FAST_EMPTY = True
    try:
        fast = _callcache._fast_empty(cp)
    finally:
        _callcache.FAST_EMPTY = fast_was
    if fast is cp.empty:
        rows.append(("floor: CUFLASH_FAST_EMPTY constructor", "skipped: this CuPy's layout differs"))
    else:
        rows.append(("floor: CUFLASH_FAST_EMPTY constructor [hit, flag on]",
                     _time(lambda: fast(o_shape, t), sync, args.calls)))
    lse_at = -(-nbytes // 256) * 256   # (lse after o, 256-byte aligned)
    lse_bytes = int(np.prod(lse_shape)) * 4

    def one_block():
        mp = pool.malloc(lse_at + lse_bytes)
        return cp.ndarray(o_shape, t, mp), cp.ndarray(lse_shape, np.float32, mp + lse_at)
    rows.append(("floor: o and lse as two arrays on one pool block", _time(one_block, sync,
                                                                           args.calls)))
    rows += [("floor: cupy.ndarray(o_shape, dtype)",
              _time(lambda: cp.ndarray(o_shape, dtype=args.dtype), sync, args.calls)),
             ("floor: memory pool malloc (o's bytes) and free",
              _time(lambda: pool.malloc(nbytes), sync, args.calls)),
             ("floor: cupy.ndarray around a held block (no allocation)",
              _time(lambda: cp.ndarray(o_shape, dtype=args.dtype, memptr=held), sync,
                    args.calls))]
    try:
        # (RawKernel.kernel: the cupy.cuda.function.Function a cuflash record calls)
        fn = cp.RawKernel(_NOOP_SRC, "cuflash_noop").kernel
        block = np.zeros(49, np.uint64)
        arg = (cp.cuda.function.CPointer(block.ctypes.data),)
        grid, threads = (1,), (128,)
        rows.append(("floor: no-op launch, Function.__call__ (CPointer block)",
                     _time(lambda: fn(grid, threads, arg, 0, None), sync, args.calls)))
        params = np.array([block.ctypes.data], np.uint64)
        launch, f, pp = cp.cuda.driver.launchKernel, fn.ptr, params.ctypes.data
        rows.append(("floor: no-op launch, driver.launchKernel (pre-packed)",
                     _time(lambda: launch(f, 1, 1, 1, 128, 1, 1, 0, 0, pp, 0), sync,
                           args.calls)))
    except Exception as exc:  # another CuPy layout
        rows.append(("floor: no-op launches", f"skipped: {type(exc).__name__}: {exc}"[:120]))
    rows.append(("floor: cupy.cuda.get_current_stream()",
                 _time(cp.cuda.get_current_stream, sync, args.calls)))
    rows.append(("floor: cupy.cuda.runtime.getDevice()",
                 _time(cp.cuda.runtime.getDevice, sync, args.calls)))
    return rows


def _path(label):
    return "decode" if label.startswith("decode<") else "dense"


def _cached(q, k, v, out=None):
    """Whether this call's signature is recorded in cuflash's call cache (hits skip the
    checks and the dispatcher)."""
    from cuflash import _callcache

    key = _callcache.signature(q, k, v, False, None, False, out, "auto", None)
    return "hit" if key is not None and _callcache.lookup(key) is not None else "full path"


def cupy_rows(args):
    import cupy as cp

    import cuflash

    shape = (1, 1, args.s, args.d)
    q, k, v = (cp.random.standard_normal(shape).astype(args.dtype) for _ in range(3))
    out = cp.empty_like(q)
    sync = cp.cuda.Stream.null.synchronize
    path = _path(cuflash.dispatch_info(q, k, v))
    t1 = _time(lambda: cuflash.attention(q, k, v), sync, args.calls)
    t2 = _time(lambda: cuflash.attention(q, k, v, out=out), sync, args.calls)
    rows = [(f"cuflash, CuPy arrays [{path}, {_cached(q, k, v)}]", t1),
            (f"cuflash, CuPy arrays, out= [{path}, {_cached(q, k, v, out)}]", t2)]
    # the no-out= hit with CuPy's two construction steps (CUFLASH_FAST_EMPTY, read when a
    # record is made: the signature is recorded again), and with the garbage collector off
    # (each fresh array brings GC-tracked objects: whether collections cost here)
    from cuflash import _callcache

    was = _callcache.FAST_EMPTY
    _callcache.FAST_EMPTY = not was
    _callcache.clear()
    try:
        t3 = _time(lambda: cuflash.attention(q, k, v), sync, args.calls)
        state = _cached(q, k, v)   # (before the clear below: session j's label said "full path")
    finally:
        _callcache.FAST_EMPTY = was
        _callcache.clear()
    rows.append((f"cuflash, CuPy arrays, CUFLASH_FAST_EMPTY={int(not was)} [{path}, {state}]", t3))
    import gc

    gc.disable()
    try:
        t4 = _time(lambda: cuflash.attention(q, k, v), sync, args.calls)
    finally:
        gc.enable()
    rows.append((f"cuflash, CuPy arrays, gc disabled [{path}, {_cached(q, k, v)}]", t4))
    return rows


def torch_rows(args):
    import torch
    import torch.nn.functional as F

    import cuflash

    dt = getattr(torch, args.dtype)
    q, k, v = (torch.randn(1, 1, args.s, args.d, device="cuda", dtype=dt) for _ in range(3))
    sync = torch.cuda.synchronize
    path = _path(cuflash.dispatch_info(q, k, v))
    t = _time(lambda: cuflash.attention(q, k, v), sync, args.calls)
    return [(f"cuflash, torch tensors [{path}, {_cached(q, k, v)}]", t),
            ("torch SDPA (its default backend)",
             _time(lambda: F.scaled_dot_product_attention(q, k, v), sync, args.calls))]


def _jax_setup(args):
    """q, k, v (JAX layout (B, S, H, D)) and the timing helpers of the JAX rows."""
    import jax

    if jax.default_backend() != "gpu":
        raise RuntimeError(f"JAX's default backend is {jax.default_backend()}, not a GPU")
    shape = (1, args.s, 1, args.d)
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (jax.random.normal(kk, shape, dtype=args.dtype) for kk in keys)
    res = {}

    def timed(f, warmed=None):
        def run():
            res["o"] = f(q, k, v)
        return _time(run, lambda: jax.block_until_ready(res["o"]), args.calls, warmed)
    return q, k, v, timed


def _jax_callback_rows(args, cmdbuf):
    """cuflash.jax.attention and an empty buffer_callback with the same operands, jitted;
    `cmdbuf`: both command-buffer compatible (the process must run with CMDBUF_FLAGS)."""
    import jax
    from jax.experimental.buffer_callback import buffer_callback

    import cuflash.jax as cj

    q, k, v, timed = _jax_setup(args)
    empty = buffer_callback(lambda ctx, out, *a: None, jax.ShapeDtypeStruct(q.shape, q.dtype),
                            command_buffer_compatible=cmdbuf)
    import cupy as cp

    import cuflash

    path = _path(cuflash.dispatch_info(*(cp.empty((1, 1, args.s, args.d), args.dtype)
                                         for _ in range(3))))
    name = (f"JAX jit, command buffers: cuflash.jax.attention(command_buffer=True) [{path}]"
            if cmdbuf else f"JAX jit: cuflash.jax.attention [{path}]")
    prefix = "JAX jit, command buffers:" if cmdbuf else "JAX jit:"
    return [(name, timed(jax.jit(lambda q, k, v: cj.attention(q, k, v,
                                                              command_buffer=cmdbuf)))),
            (f"{prefix} empty buffer_callback", timed(jax.jit(lambda q, k, v: empty(q, k, v))))]


def jax_inside_rows(args):
    """`cuflash.jax.attention` once more (a new configuration, deterministic=True, so a fresh
    trace: the forward is the same), with its forward callback timed from inside (the Python
    callback alone, perf_counter_ns) and the Hopper kernel's tensor-map encodes counted
    (`_launch.forward_params` calls: a record hit with the last inputs encodes none)."""
    import jax

    import cuflash.jax as cj
    from cuflash import _launch

    q, k, v, timed = _jax_setup(args)
    spent, count, encodes = [0], [0], [0]
    real_fwd, real_fp = cj._fwd_callback, _launch.forward_params

    def timed_fwd(cfg, with_lse):
        cb = real_fwd(cfg, with_lse)

        def wrapped(*a):
            t0 = time.perf_counter_ns()
            try:
                return cb(*a)
            finally:
                spent[0] += time.perf_counter_ns() - t0
                count[0] += 1
        return wrapped

    def counting(*a, **kw):
        encodes[0] += 1
        return real_fp(*a, **kw)

    cj._fwd_callback, _launch.forward_params = timed_fwd, counting
    try:
        f = jax.jit(lambda q, k, v: cj.attention(q, k, v, deterministic=True))

        def reset():   # after the warm-up calls (the first one takes the full path)
            spent[0] = count[0] = encodes[0] = 0
        total = timed(f, reset)
    finally:
        cj._fwd_callback, _launch.forward_params = real_fwd, real_fp
    if not count[0]:
        return [("JAX jit: inside cuflash's callback", "skipped: the callback was not traced "
                 "anew (no per-call figure)")]
    n = count[0]
    from cuflash import _callcache

    sets = [len(r.maps) for r in _callcache._CACHE.values() if getattr(r, "hopper", False)]
    return [("JAX jit: cuflash.jax.attention, instrumented", total),
            ("JAX jit:   inside cuflash's Python callback", spent[0] / n / 1e3),
            ("JAX jit:   Hopper tensor-map encodes per call", f"{encodes[0] / n:.3f}"),
            ("JAX jit:   Hopper records' input pointer sets kept (max)",
             str(max(sets)) if sets else "no Hopper record")]


def jax_rows(args):
    import jax

    rows = _jax_callback_rows(args, False)
    rows += jax_inside_rows(args)
    _, _, _, timed = _jax_setup(args)
    try:
        h = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v,
                                                                 implementation="cudnn"))
        rows.append(("JAX jit: dot_product_attention cudnn", timed(h)))
    except Exception as exc:  # cuDNN attention unavailable for this dtype/shape/version
        rows.append(("JAX jit: dot_product_attention cudnn", f"skipped: {type(exc).__name__}: "
                     f"{str(exc).splitlines()[0][:80]}"))
    return rows


#: What a user sets to let XLA put cuflash's callbacks into command buffers (notes/JAX.md).
CMDBUF_FLAGS = "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"


def jax_cmdbuf_rows(args):
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + CMDBUF_FLAGS).strip()
    cmd = [sys.executable, os.path.abspath(__file__), "--jax-cmdbuf-child", "--calls",
           str(args.calls), "--s", str(args.s), "--d", str(args.d), "--dtype", args.dtype]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError((proc.stderr.strip().splitlines() or ["no output"])[-1])
    return [tuple(r) for r in json.loads(proc.stdout.strip().splitlines()[-1])]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--s", default="16,128",
                    help="sequence lengths (Sq = Sk), comma-separated: each gets every row")
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    ap.add_argument("--repeats", type=int, default=5,
                    help="timed runs of --calls calls per row; the median is shown")
    ap.add_argument("--warmup-s", type=float, default=0.5,
                    help="seconds of busy host before the first row (the CPU clock's ramp)")
    ap.add_argument("--impl", default="driver", choices=["driver", "cupy-call"],
                    help="how a record hit launches: driver.launchKernel on a pre-packed block "
                         "(the default) or CuPy's Function.__call__ (CUFLASH_DIRECT_LAUNCH=0)")
    ap.add_argument("--no-floor", action="store_true",
                    help="skip the floor rows (allocation, no-op launches)")
    ap.add_argument("--only", default="", help="run only these row groups, comma-separated "
                    "(cupy, torch, jax, jax-cmdbuf; the floor rows come with cupy)")
    ap.add_argument("--jax-cmdbuf-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    REPEATS[0] = max(1, args.repeats)
    # (read when cuflash is imported: every import here is later)
    os.environ["CUFLASH_DIRECT_LAUNCH"] = "1" if args.impl == "driver" else "0"
    lengths = [int(x) for x in str(args.s).split(",") if x]
    if args.jax_cmdbuf_child:
        args.s = lengths[0]
        print(json.dumps(_jax_callback_rows(args, True)))
        return
    print(f"host time per call, {args.calls} calls, (1, 1, S, {args.d}) {args.dtype}, "
          f"one sync at the end; median of {REPEATS[0]} runs; hits launch via {args.impl}")
    _spin(args.warmup_s)
    rows = []
    for s in lengths:
        args.s = s
        try:
            import cupy as cp

            import cuflash

            label = cuflash.dispatch_info(*(cp.empty((1, 1, s, args.d), args.dtype)
                                            for _ in range(3)))
        except Exception as exc:  # no GPU here
            label = f"unknown ({type(exc).__name__}: {exc})"[:100]
        rows.append((f"-- S = {s}: kernel='auto' takes {label}", None))
        parts = [("CuPy", cupy_rows)] + ([] if args.no_floor else [("CuPy floor", floor_rows)])
        parts += [("torch", torch_rows), ("JAX", jax_rows),
                  ("JAX command-buffer", jax_cmdbuf_rows)]
        if args.only:
            keep = {"cupy": ("CuPy", "CuPy floor"), "torch": ("torch",), "jax": ("JAX",),
                    "jax-cmdbuf": ("JAX command-buffer",)}
            names = {n for g in args.only.split(",") for n in keep.get(g.strip(), ())}
            parts = [p for p in parts if p[0] in names]
        for name, fn in parts:
            try:
                rows += fn(args)
            except Exception as exc:  # a peer that is missing or has no GPU here
                rows.append((f"{name} rows", f"skipped: {type(exc).__name__}: {exc}"[:120]))
    width = max(len(r[0]) for r in rows if r[1] is not None)
    print(f"{'':{width}s}   us/call  (enqueue: before the final sync)  [fastest run]")
    for name, t in rows:
        if t is None:
            print(name)
        elif isinstance(t, float):
            enq = getattr(t, "enqueue", None)
            best = getattr(t, "best", None)
            print(f"{name:{width}s}  {t:8.1f}" + ("" if enq is None else f"  ({enq:.1f})")
                  + ("" if best is None else f"  [{best:.1f}]"))
        else:
            print(f"{name:{width}s}  {t}")


if __name__ == "__main__":
    main()
