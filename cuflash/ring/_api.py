"""Entry points of the ring: argument checks (once, before anything runs), the transport and
ops for the arrays at hand, and the schedule."""
from __future__ import annotations

from .. import _checks
from ._layout import ZigzagLayout
from ._ops import CuPyOps, NumPyOps
from ._schedule import ring_backward, ring_forward
from .transport import LocalGPUTransport, SimTransport

#: dtypes the ring forward and backward accept (see `_check_dtype`).
FORWARD_DTYPES = ("float16", "bfloat16", "float32")
BACKWARD_DTYPES = ("float16", "bfloat16")


def _check_dtype(dtype_name, what):
    allowed = FORWARD_DTYPES if what == "forward" else BACKWARD_DTYPES
    if dtype_name in allowed:
        return
    if what == "forward":
        why = ("the ring merges its partial results through float32 lse values (the merge "
               "operator's contract), which would hold float64 to about 1e-7 relative")
    else:
        why = ("every pair's backward must use the full softmax's statistics (the forward's o "
               "and float32 lse); cuflash's float32/float64 backward deliberately recomputes "
               "each row's max and sum from the keys it is given instead (notes/BACKWARD.md), "
               "which for one key shard are the shard's, not the sequence's (notes/RING.md)")
    raise TypeError(f"ring attention {what}: dtype {dtype_name} is not supported "
                    f"(supported: {', '.join(allowed)}): {why}")


def _check_forward(q, k, v, causal, scale):
    prob = _checks.check_attention(q, k, v, causal=causal, scale=scale, return_lse=True,
                                   out=None, stream=None, kernel="auto")
    if prob.sq != prob.sk:
        raise ValueError(f"ring attention shards one sequence of queries and keys: q has "
                         f"{prob.sq} rows and k {prob.sk}; they must be equal")
    _check_dtype(prob.dtype_name, "forward")
    return prob


def _check_backward_args(do, q, k, v, o, lse, causal, scale):
    prob = _checks.check_backward(do, q, k, v, o, lse, causal=causal, scale=scale,
                                  deterministic=False, out=None, workspace=None, stream=None,
                                  kernel="auto")
    if prob.sq != prob.sk:
        raise ValueError(f"ring attention shards one sequence of queries and keys: q has "
                         f"{prob.sq} rows and k {prob.sk}; they must be equal")
    _check_dtype(prob.dtype_name, "backward")
    return prob


def _ops_for(backend, device_id=None):
    return NumPyOps() if backend in ("cpu", "numpy") else CuPyOps(device_id)


def _xp(backend):
    if backend in ("cpu", "numpy"):
        import numpy

        return numpy
    import cupy

    return cupy


def _bits(x):
    """16-bit GPU arrays as uint16 views (so that CuPy's copies need no bfloat16 support)."""
    if x.dtype.itemsize == 2 and type(x).__module__.startswith("cupy"):
        import cupy

        return x.view(cupy.uint16), x.dtype
    return x, None


def _unbits(x, dtype):
    return x if dtype is None else x.view(dtype)


def _shard_all(layout, x, xp):
    b, dt = _bits(x)
    return {r: _unbits(layout.shard(b, r, xp), dt) for r in range(layout.world)}


def _unshard_all(layout, d, xp):
    shards = [d[r] for r in range(layout.world)]
    b = [_bits(s) for s in shards]
    return _unbits(layout.unshard([s for s, _ in b], xp), b[0][1])


def _local_transport(prob, world, stream):
    if prob.backend == "cpu":
        if stream is not None:
            raise ValueError("stream= applies to GPU inputs only; the inputs are NumPy arrays")
        return SimTransport(world)
    import cupy

    with cupy.cuda.Device(prob.device_id):  # the inputs' device, and a stream of it
        return LocalGPUTransport(world, device=prob.device_id, stream=_stream(stream))


def _stream(stream):
    if stream is None:
        return None
    import cupy

    if isinstance(stream, int):
        return cupy.cuda.ExternalStream(stream)
    return stream


def ring_attention_local(q, k, v, *, world, causal=False, scale=None, return_lse=False,
                         stream=None):
    """Ring attention over ``world`` ranks that all live on this device: the whole sequence in,
    the whole result out.

    NumPy inputs run the CPU simulation (ranks as NumPy shards, the ring as a loop, cuflash's
    NumPy attention per shard pair); CuPy inputs run every rank's shard on this GPU, the shifts
    as device-to-device copies on a second stream (no NCCL). Both run the one schedule that
    the NCCL path runs (`ring_attention`), and give `cuflash.attention`'s result.

    Parameters
    ----------
    q : array, shape (..., S, D)
    k : array, shape (..., S, D)
    v : array, shape (..., S, Dv)
        float16, bfloat16 or float32, as `cuflash.attention` takes them (batch axes broadcast);
        queries and keys are one sequence (``Sq == Sk == S``), split zigzag: ``2 * world``
        chunks, rank ``r`` holding chunks ``r`` and ``2 * world - 1 - r``. Any ``S >= 2 *
        world``: when ``2 * world`` does not divide S, the first ``S % (2 * world)`` chunks
        are one row longer (no padding).
    world : int
        The number of ranks (>= 1).
    causal : bool, optional
        The causal mask of the whole sequence (``Sq == Sk``, so top-left and bottom-right
        alignment agree).
    scale : float, optional
        Default ``1 / sqrt(D)``.
    return_lse : bool, optional
        Also return lse, float32 ``(..., S)``.
    stream : cupy.cuda.Stream or int, optional
        GPU only: the compute stream (default: CuPy's current stream).

    Returns
    -------
    o : array, shape (..., S, Dv), q's dtype
    lse : array, shape (..., S), float32
        Only with ``return_lse=True``.
    """
    prob = _check_forward(q, k, v, causal, scale)
    layout = ZigzagLayout(prob.sq, world)
    xp = _xp(prob.backend)
    transport = _local_transport(prob, world, stream)
    ops = _ops_for(prob.backend, prob.device_id)
    with transport.compute():  # the split and the join on the compute stream too
        qs, ks, vs = (_shard_all(layout, x, xp) for x in (prob.q, prob.k, prob.v))
        os_, lses = ring_forward(transport, ops, layout, qs, ks, vs, causal=prob.causal,
                                 scale=prob.scale)
        o = _unshard_all(layout, os_, xp)
        lse = layout.unshard_rows([lses[r] for r in range(world)], xp)
    return (o, lse) if return_lse else o


def ring_attention_backward_local(do, q, k, v, o, lse, *, world, causal=False, scale=None,
                                  stream=None):
    """Gradients ``(dq, dk, dv)`` of `ring_attention_local` by the ring backward, all ranks on
    this device (NumPy: the CPU simulation; CuPy: one GPU).

    Parameters
    ----------
    do : array, shape (..., S, Dv)
    q, k, v : arrays, as `ring_attention_local`
    o : array, shape (..., S, Dv)
    lse : array, shape (..., S), float32
        What ``ring_attention_local(q, k, v, ..., return_lse=True)`` (or `cuflash.attention`)
        returned.
    world, causal, scale, stream
        As `ring_attention_local`.

    Returns
    -------
    dq, dk, dv : arrays, the shapes and dtype of q, k, v

    Only float16 and bfloat16: see notes/RING.md (the backward of one shard pair must use the
    whole sequence's softmax statistics, which cuflash's float32/float64 backward does not).
    """
    prob = _check_backward_args(do, q, k, v, o, lse, causal, scale)
    layout = ZigzagLayout(prob.sq, world)
    xp = _xp(prob.backend)
    transport = _local_transport(prob, world, stream)
    ops = _ops_for(prob.backend, prob.device_id)
    with transport.compute():
        sh = [_shard_all(layout, x, xp) for x in (prob.do, prob.q, prob.k, prob.v, prob.o)]
        lses = {r: layout.shard(prob.lse[..., None], r, xp)[..., 0] for r in range(world)}
        dqs, dks, dvs = ring_backward(transport, ops, layout, *sh, lses, causal=prob.causal,
                                      scale=prob.scale)
        return tuple(_unshard_all(layout, d, xp) for d in (dqs, dks, dvs))


def _local_dict(transport, x, name):
    ranks = transport.local_ranks
    if isinstance(x, dict):
        if sorted(x) != sorted(ranks):
            raise ValueError(f"{name}: expected shards for ranks {list(ranks)}; got {sorted(x)}")
        return dict(x)
    if isinstance(x, (list, tuple)):
        if len(x) != len(ranks):
            raise ValueError(f"{name}: expected {len(ranks)} shards (one per local rank); "
                             f"got {len(x)}")
        return dict(zip(ranks, x))
    if len(ranks) != 1:
        raise ValueError(f"{name}: this transport runs {len(ranks)} ranks here; pass a list of "
                         f"their shards")
    return {ranks[0]: x}


def _shard_layout(transport, qs, seq_len):
    world = transport.world
    if seq_len is None:
        lens = {qs[r].shape[-2] for r in qs}
        if len(lens) != 1:
            raise ValueError("shards of different lengths: pass seq_len=")
        seq_len = lens.pop() * world
    layout = ZigzagLayout(int(seq_len), world)
    for r, x in qs.items():
        if x.shape[-2] != layout.shard_len(r):
            raise ValueError(f"rank {r}'s shard has {x.shape[-2]} rows; the zigzag split of "
                             f"{layout.seq_len} rows over {world} ranks gives it "
                             f"{layout.shard_len(r)} (cuflash.ring.shard)")
    return layout


def _unwrap(transport, d):
    ranks = transport.local_ranks
    return d[ranks[0]] if len(ranks) == 1 else [d[r] for r in ranks]


def ring_attention(q, k, v, *, transport, causal=False, scale=None, seq_len=None,
                   return_lse=False):
    """Ring attention on this process's shard(s): the multi-process (NCCL) entry point, and
    the general one for any transport.

    Parameters
    ----------
    q, k, v : array, or a list (or dict by rank) of arrays, one per ``transport.local_ranks``
        Each local rank's zigzag shard (`shard`): ``(..., n_r, D)``, ``(..., n_r, D)``,
        ``(..., n_r, Dv)``. One array when the transport has one local rank (NCCL: one rank
        per process). Every rank passes the same batch shape, D, Dv and dtype.
    transport : a transport of :mod:`cuflash.ring.transport`
        `NcclTransport` (one process per GPU), `LocalGPUTransport`, `SimTransport` (NumPy), or
        `NullTransport` (timing only).
    causal : bool, optional
        The causal mask of the whole sequence.
    scale : float, optional
        Default ``1 / sqrt(D)``.
    seq_len : int, optional
        The whole sequence's length. Default: the shard length times ``world`` (right when
        ``2 * world`` divides it; otherwise pass it).
    return_lse : bool, optional

    Returns
    -------
    o (and lse) : the rank's rows of the result, ``(..., n_r, Dv)`` in q's dtype (and
        ``(..., n_r)`` float32); lists when the transport has several local ranks.
    """
    qs, ks, vs = (_local_dict(transport, x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    probs = {r: _check_forward(qs[r], ks[r], vs[r], causal, scale) for r in qs}
    _check_backend(transport, probs)
    layout = _shard_layout(transport, qs, seq_len)
    p0 = next(iter(probs.values()))
    os_, lses = ring_forward(transport, _ops_for(transport.backend, p0.device_id), layout,
                             {r: p.q for r, p in probs.items()},
                             {r: p.k for r, p in probs.items()},
                             {r: p.v for r, p in probs.items()}, causal=p0.causal,
                             scale=p0.scale)
    o = _unwrap(transport, os_)
    return (o, _unwrap(transport, lses)) if return_lse else o


def ring_attention_backward(do, q, k, v, o, lse, *, transport, causal=False, scale=None,
                            seq_len=None):
    """Gradients of `ring_attention` for this process's shard(s): ``(dq, dk, dv)``, each the
    rank's shard's gradient (lists for several local ranks). ``do``, ``o``, ``lse``: the rank's
    upstream gradient and what `ring_attention(..., return_lse=True)` returned; the rest as
    `ring_attention`. float16 and bfloat16 only (notes/RING.md)."""
    args = [_local_dict(transport, x, n) for x, n in
            ((do, "do"), (q, "q"), (k, "k"), (v, "v"), (o, "o"), (lse, "lse"))]
    probs = {r: _check_backward_args(*(a[r] for a in args), causal, scale) for r in args[1]}
    _check_backend(transport, probs)
    layout = _shard_layout(transport, args[1], seq_len)
    p0 = next(iter(probs.values()))
    pick = lambda name: {r: getattr(p, name) for r, p in probs.items()}  # noqa: E731
    ops = _ops_for(transport.backend, p0.device_id)
    dqs, dks, dvs = ring_backward(transport, ops, layout, pick("do"), pick("q"), pick("k"),
                                  pick("v"), pick("o"), pick("lse"), causal=p0.causal,
                                  scale=p0.scale)
    return tuple(_unwrap(transport, d) for d in (dqs, dks, dvs))


def _check_backend(transport, probs):
    want = "cpu" if transport.backend == "numpy" else "gpu"
    for r, p in probs.items():
        if p.backend != want:
            raise ValueError(f"rank {r}'s arrays are on the {p.backend}; this transport "
                             f"({type(transport).__name__}) works on "
                             f"{'NumPy' if want == 'cpu' else 'CuPy'} arrays")


def shard(x, *, world, rank):
    """Rank ``rank``'s zigzag shard of ``x`` (rows on axis -2): chunks ``rank`` and
    ``2 * world - 1 - rank`` of ``2 * world``, concatenated. NumPy or CuPy."""
    layout = ZigzagLayout(x.shape[-2], world)
    b, dt = _bits(x)
    return _unbits(layout.shard(b, rank, _xp("numpy" if type(x).__module__.startswith("numpy")
                                             else "cupy")), dt)


def unshard(shards, *, seq_len=None):
    """The whole sequence from every rank's zigzag shard (a list by rank), the inverse of
    `shard`; ``seq_len`` defaults to the total of the shards' rows."""
    world = len(shards)
    n = sum(s.shape[-2] for s in shards) if seq_len is None else int(seq_len)
    layout = ZigzagLayout(n, world)
    xp = _xp("numpy" if type(shards[0]).__module__.startswith("numpy") else "cupy")
    return _unshard_all(layout, dict(enumerate(shards)), xp)
