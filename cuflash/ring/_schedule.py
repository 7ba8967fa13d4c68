"""The ring schedule, forward and backward, written once for every transport.

Forward (per local rank ``r``, steps ``t = 0 .. R-1``; at step ``t`` the rank holds the
key/value shard of rank ``j = (r - t) % R``)::

    start shift(kv[cur] -> next rank's kv[nxt])          # communication stream
    for each call in pair_calls(r, j):                   # compute stream, at most 2 calls
        o, lse = attention(q half, kv[cur] rows [k0, k1), causal per call)
        acc[half].merge(o, lse)                          # float32, in the ring's fixed order
    wait(shift); cur, nxt = nxt, cur                     # compute waits on an event

Backward: the queries, do, o and lse stay; the key/value shard travels as in the forward and a
float32 (dk, dv) accumulator travels one step behind it: at step ``t`` the rank adds its
contribution to the accumulator of shard ``j`` (which arrived during this step's compute) and
sends it on; after the ``R``-th shift every accumulator is back on the rank that owns the shard.
Each pair's gradients come from `cuflash.attention_backward` with the *global* o and lse, so
``P = exp(s - lse)`` and ``delta = rowsum(do * o)`` are the full softmax's, not the pair's.
"""
from __future__ import annotations

import numpy as np

from ._layout import ZigzagLayout, pair_calls


def _batch_shape(*arrays):
    return tuple(np.broadcast_shapes(*(a.shape[:-2] for a in arrays)))


def _halves(x, n0):
    return x[..., :n0, :], x[..., n0:, :]


def _row_buffers(ops, xs, rows, copy_from=None):
    """Zeroed buffers shaped like each of ``xs`` with ``rows`` rows (contiguous, x's dtype); the
    first rows filled from ``copy_from`` (the rank's own shard) when given. Zeroed, so that no
    step ever reads unwritten memory (rows past a shorter shard, or `NullTransport`'s buffers,
    which nothing sends into)."""
    out = []
    for i, x in enumerate(xs):
        b = ops.empty(x.shape[:-2] + (rows, x.shape[-1]), x.dtype)
        b.view(ops.xp.uint8)[...] = 0
        if copy_from is not None:
            _copy(ops, b[..., : x.shape[-2], :], copy_from[i])
        out.append(b)
    return tuple(out)


def _copy(ops, dst, src):
    """dst[...] = src for any dtype (16-bit types moved as integers, so that CuPy needs no
    bfloat16 kernels)."""
    if ops.backend == "cupy":
        cp = ops.xp
        if src.dtype.itemsize == 2:
            cp.copyto(dst.view(cp.uint16), src.view(cp.uint16))
        else:
            cp.copyto(dst, src)
    else:
        dst[...] = src


def _finish(ops, halves, dtype):
    """The rank's result from its two float32 halves: concatenated, rounded once to dtype."""
    return ops.cast(ops.xp.concatenate(halves, axis=-2), dtype)


def ring_forward(transport, ops, layout: ZigzagLayout, qs, ks, vs, *, causal, scale):
    """Ring attention forward over ``transport``.

    Parameters
    ----------
    transport : a transport of :mod:`cuflash.ring.transport`
    ops : `_ops.NumPyOps` or `_ops.CuPyOps`
    layout : ZigzagLayout
    qs, ks, vs : dict rank -> array
        Each local rank's zigzag shard: q ``(..., n_r, D)``, k ``(..., n_r, D)``,
        v ``(..., n_r, Dv)``, with ``n_r = layout.shard_len(r)``.
    causal : bool
    scale : float

    Returns
    -------
    os, lses : dict rank -> array
        ``(..., n_r, Dv)`` in q's dtype and ``(..., n_r)`` float32: the rank's rows of the full
        attention and their log-sum-exps.
    """
    R, ranks = transport.world, transport.local_ranks
    with transport.compute():
        nmax = layout.max_shard_len
        bufs = [{r: _row_buffers(ops, (ks[r], vs[r]), nmax, (ks[r], vs[r])) for r in ranks},
                {r: _row_buffers(ops, (ks[r], vs[r]), nmax) for r in ranks}]
        accs, qh = {}, {}
        for r in ranks:
            batch = _batch_shape(qs[r], ks[r], vs[r])
            qh[r] = _halves(qs[r], layout.half_len(r, 0))
            accs[r] = [ops.accumulator(batch + (layout.half_len(r, h), vs[r].shape[-1]))
                       for h in (0, 1)]
        cur = 0
        for t in range(R):
            handle = transport.shift(bufs[cur], bufs[1 - cur]) if t + 1 < R else None
            for r in ranks:
                kb, vb = bufs[cur][r]
                for c in pair_calls(layout, r, (r - t) % R, causal):
                    o, lse = ops.attention(qh[r][c.half], kb[..., c.k0:c.k1, :],
                                           vb[..., c.k0:c.k1, :], causal=c.causal, scale=scale)
                    accs[r][c.half].add(o, lse)
            if t + 1 < R:
                transport.wait(handle)
                cur = 1 - cur
        os_, lses = {}, {}
        for r in ranks:
            os_[r] = _finish(ops, [a.o for a in accs[r]], qs[r].dtype)
            lses[r] = ops.xp.concatenate([a.lse for a in accs[r]], axis=-1)
    return os_, lses


def ring_backward(transport, ops, layout: ZigzagLayout, dos, qs, ks, vs, os_, lses, *, causal,
                  scale):
    """Ring attention backward over ``transport``: ``(dqs, dks, dvs)``, dicts rank -> the
    gradients of the rank's shards (its q, k, v shapes and dtype).

    ``dos``, ``os_``, ``lses``: dict rank -> the upstream gradient, and the forward's output and
    lse for the rank's rows (what `ring_forward` returned). Other arguments as `ring_forward`.
    """
    R, ranks = transport.world, transport.local_ranks
    with transport.compute():
        nmax = layout.max_shard_len
        kv = [{r: _row_buffers(ops, (ks[r], vs[r]), nmax, (ks[r], vs[r])) for r in ranks},
              {r: _row_buffers(ops, (ks[r], vs[r]), nmax) for r in ranks}]
        dkv = [{r: tuple(ops.zeros(b.shape) for b in kv[0][r]) for r in ranks} for _ in range(2)]
        side, dq = {}, {}
        for r in ranks:
            n0 = layout.half_len(r, 0)
            lse = ops.xp.ascontiguousarray(lses[r])
            side[r] = (_halves(dos[r], n0), _halves(qs[r], n0), _halves(os_[r], n0),
                       (ops.xp.ascontiguousarray(lse[..., :n0]),
                        ops.xp.ascontiguousarray(lse[..., n0:])))
            dq[r] = [ops.zeros(h.shape) for h in side[r][1]]
        cur, dcur, dhandle = 0, 0, None
        for t in range(R):
            handle = transport.shift(kv[cur], kv[1 - cur]) if t + 1 < R else None
            parts = {}
            for r in ranks:
                kb, vb = kv[cur][r]
                (do_h, q_h, o_h, lse_h), parts[r] = side[r], []
                for c in pair_calls(layout, r, (r - t) % R, causal):
                    h = c.half
                    dq_p, dk_p, dv_p = ops.backward(
                        do_h[h], q_h[h], kb[..., c.k0:c.k1, :], vb[..., c.k0:c.k1, :], o_h[h],
                        lse_h[h], causal=c.causal, scale=scale)
                    ops.add_into(dq[r][h], dq_p)
                    parts[r].append((c, dk_p, dv_p))
            transport.wait(dhandle)  # shard j's accumulator arrived during this step's compute
            for r in ranks:
                dk_acc, dv_acc = dkv[dcur][r]
                for c, dk_p, dv_p in parts[r]:
                    ops.add_into(dk_acc[..., c.k0:c.k1, :], dk_p)
                    ops.add_into(dv_acc[..., c.k0:c.k1, :], dv_p)
            dhandle = transport.shift(dkv[dcur], dkv[1 - dcur])
            dcur = 1 - dcur
            if t + 1 < R:
                transport.wait(handle)
                cur = 1 - cur
        transport.wait(dhandle)  # after R shifts each accumulator is home
        dqs, dks, dvs = {}, {}, {}
        for r in ranks:
            n = layout.shard_len(r)
            dqs[r] = _finish(ops, dq[r], qs[r].dtype)
            dk_acc, dv_acc = dkv[dcur][r]
            dks[r] = ops.cast(dk_acc[..., :n, :], ks[r].dtype)
            dvs[r] = ops.cast(dv_acc[..., :n, :], vs[r].dtype)
    return dqs, dks, dvs
