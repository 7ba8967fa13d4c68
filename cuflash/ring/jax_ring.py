"""Ring attention for JAX: `jax.shard_map` over one mesh axis, `jax.lax.ppermute` as the ring's
shift, and any per-shard attention ``f(q, k, v, *, causal, scale) -> (o, lse)``.

The zigzag split and the calls of every (query shard, key/value shard) pair are
:mod:`cuflash.ring._layout`'s, the same as the NumPy/CuPy schedule's. What differs is only what
JAX needs: the rank is traced (``jax.lax.axis_index``), so at each step the ranks whose calls
differ (under the causal mask: the ranks whose visiting shard comes from a lower rank and those
whose comes from a higher one) are told apart with ``jax.lax.switch`` over the distinct call
lists of that step; everything else is static. Arrays are immutable, so the double buffer is the
ppermute's result, issued before the step's compute so that XLA can overlap the two.

The default per-shard attention, `reference_attention`, is a plain jnp float32 softmax (for
tests and CPU); ``cuflash.jax.attention`` (the ``jax`` branch) plugs in as ``attention_fn``
once it exists, with ``return_lse=True``. Gradients: `jax.grad` differentiates the ring
(ppermute transposes to the reverse ring) through the per-shard function's own derivative,
which must cover the lse output too.

Needs ``2 * world`` to divide the sequence length (``shard_map`` splits evenly).
"""
from __future__ import annotations

import math

from ._layout import ZigzagLayout, pair_calls


def _jax():
    import jax
    import jax.numpy as jnp

    return jax, jnp


def reference_attention(q, k, v, *, causal, scale):
    """``(o, lse)`` of one shard pair in jnp, float32 arithmetic, causal bottom-right aligned
    (as `cuflash.attention`); every row must see a key (the ring's calls guarantee it)."""
    jax, jnp = _jax()
    s = jnp.einsum("...qd,...kd->...qk", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
    if causal:
        sq, sk = q.shape[-2], k.shape[-2]
        vis = jnp.arange(sk)[None, :] <= jnp.arange(sq)[:, None] + (sk - sq)
        s = jnp.where(vis, s, -jnp.inf)
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    p = jnp.exp(s - m)
    l = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("...qk,...kd->...qd", p, v.astype(jnp.float32)) / l
    return o.astype(q.dtype), (m + jnp.log(l))[..., 0]


def merge(o_a, lse_a, o_b, lse_b):
    """The merge operator on float32 normalised partials: `cuflash.jax.merge_states` (its
    weights from ``lse_a - lse_b``, normalised, so that they do not carry the merged lse's
    float32 rounding)."""
    from ..jax import merge_states

    return merge_states(o_a, lse_a, o_b, lse_b)


def ring_attention_sharded(q, k, v, *, axis_name, world, causal=False, scale=None,
                           attention_fn=None):
    """Ring attention inside ``shard_map``: this device's zigzag shard in, its rows out.

    Parameters
    ----------
    q, k, v : jax arrays, shapes (..., n, D), (..., n, D), (..., n, Dv)
        This device's shard: chunks ``r`` and ``2 * world - 1 - r`` of the sequence, each of
        ``n / 2`` rows (`cuflash.ring.shard`).
    axis_name : str
        The mesh axis the sequence is split over.
    world : int
        Its size.
    causal, scale
        As `cuflash.attention` (the whole sequence's causal mask).
    attention_fn : callable, optional
        ``f(q, k, v, *, causal, scale) -> (o, lse)`` for one shard pair; default
        `reference_attention`.

    Returns
    -------
    o : (..., n, Dv), q's dtype;  lse : (..., n), float32
    """
    jax, jnp = _jax()
    attn = attention_fn or reference_attention
    n = q.shape[-2]
    if n % 2:
        raise ValueError(f"a zigzag shard has two equal chunks; got {n} rows")
    layout = ZigzagLayout(n * world, world)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    c = n // 2
    qh = (q[..., :c, :], q[..., c:, :])
    rank = jax.lax.axis_index(axis_name)
    perm = [(r, (r + 1) % world) for r in range(world)]

    def apply(calls, kv, acc):
        kb, vb = kv
        acc = list(acc)
        for call in calls:
            o, lse = attn(qh[call.half], kb[..., call.k0:call.k1, :], vb[..., call.k0:call.k1, :],
                          causal=call.causal, scale=scale)
            o = o.astype(jnp.float32)
            lse = lse.astype(jnp.float32)
            acc[call.half] = (o, lse) if acc[call.half] is None else merge(*acc[call.half], o,
                                                                           lse)
        return tuple(acc)

    kv = (k, v)
    acc = (None, None)
    for t in range(world):
        nxt = jax.lax.ppermute(kv, axis_name, perm) if t + 1 < world else None
        per_rank = [tuple(pair_calls(layout, r, (r - t) % world, causal)) for r in range(world)]
        distinct = list(dict.fromkeys(per_rank))
        if t == 0:
            if len(distinct) != 1:  # pragma: no cover (t = 0 is the diagonal on every rank)
                raise AssertionError("step 0 differs between ranks")
            acc = apply(distinct[0], kv, acc)  # both halves see keys at step 0
        elif len(distinct) == 1:
            acc = apply(distinct[0], kv, acc)
        else:
            table = jnp.asarray([distinct.index(p) for p in per_rank], dtype=jnp.int32)
            branches = [lambda kv_, acc_, calls=calls: apply(calls, kv_, acc_)
                        for calls in distinct]
            acc = jax.lax.switch(table[rank], branches, kv, acc)
        if nxt is not None:
            kv = nxt
    o = jnp.concatenate([acc[0][0], acc[1][0]], axis=-2).astype(q.dtype)
    lse = jnp.concatenate([acc[0][1], acc[1][1]], axis=-1)
    return o, lse


def _shard_map():
    jax, _ = _jax()
    sm = getattr(jax, "shard_map", None)
    if sm is None:  # older JAX
        from jax.experimental.shard_map import shard_map as sm
    return sm


def zigzag_permutation(seq_len, world):
    """Row order that lays the sequence out as rank 0's shard, rank 1's, ...: ``x[..., perm, :]``
    is what ``shard_map`` must split evenly; ``argsort(perm)`` undoes it."""
    import numpy as np

    layout = ZigzagLayout(seq_len, world)
    if seq_len % (2 * world):
        raise ValueError(f"the JAX ring needs 2 * world = {2 * world} to divide the sequence "
                         f"length ({seq_len}): shard_map splits an axis evenly")
    idx = np.arange(seq_len)
    return np.concatenate([np.concatenate([idx[s] for s in layout.shard_slices(r)])
                           for r in range(world)])


def ring_attention_jax(q, k, v, *, mesh, axis_name, causal=False, scale=None,
                       attention_fn=None):
    """Ring attention of whole JAX arrays over the mesh axis ``axis_name``: ``(o, lse)``, in
    the sequence's own order, as `cuflash.attention(..., return_lse=True)` would give.

    The rows are put in zigzag order, split over the axis with ``shard_map``, run through
    `ring_attention_sharded`, and put back. ``q, k, v``: (..., S, D), (..., S, D), (..., S, Dv)
    with ``2 * mesh.shape[axis_name]`` dividing S. Differentiable with `jax.grad`.
    """
    jax, jnp = _jax()
    from jax.sharding import PartitionSpec as P

    world = int(mesh.shape[axis_name])
    s = q.shape[-2]
    if k.shape[-2] != s or v.shape[-2] != s:
        raise ValueError(f"ring attention shards one sequence: q has {s} rows, k "
                         f"{k.shape[-2]}, v {v.shape[-2]}")
    perm = jnp.asarray(zigzag_permutation(s, world))
    inv = jnp.argsort(perm)

    def spec(x, rows_last=False):
        lead = [None] * (x.ndim - (1 if rows_last else 2))
        return P(*lead, axis_name) if rows_last else P(*lead, axis_name, None)

    def body(qs, ks, vs):
        return ring_attention_sharded(qs, ks, vs, axis_name=axis_name, world=world,
                                      causal=causal, scale=scale, attention_fn=attention_fn)

    lse_proto = jax.ShapeDtypeStruct(q.shape[:-1], jnp.float32)
    f = jax.jit(_shard_map()(body, mesh=mesh, in_specs=(spec(q), spec(k), spec(v)),
                             out_specs=(spec(q), spec(lse_proto, rows_last=True))))
    o, lse = f(q[..., perm, :], k[..., perm, :], v[..., perm, :])
    return o[..., inv, :], lse[..., inv]
