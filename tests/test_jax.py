"""cuflash.jax: results and gradients against float64 (cuflash.reference, its pass rules) and
against jax.nn.dot_product_attention, under jit, vmap, grad and jit(grad); causal, Sq != Sk,
grouped-query heads, lse and merging. On the CPU (CI) the buffer callback runs cuflash's NumPy
path; on a GPU (a CUDA jaxlib) the kernels, on XLA's buffers and stream."""
import zlib

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="JAX is not installed (pip install 'cuflash[jax]')")
import jax.numpy as jnp  # noqa: E402

import cuflash  # noqa: E402
import cuflash.jax as cj  # noqa: E402
from cuflash import reference as ref  # noqa: E402

DTYPES = ["float32", "float16", "bfloat16"]
JAX_GPU = jax.default_backend() == "gpu"
NO_JAX_GPU = "JAX's default backend is not a GPU (install a CUDA jaxlib and run on a GPU)"


def _rng(*parts):
    return np.random.default_rng(zlib.crc32(repr(parts).encode()))


def _inputs(rng, dtype, lead, sq, sk, h, hk, d, dv, lead_kv=None):
    """float64 q (lead, Sq, H, D), k (lead_kv, Sk, Hk, D), v, do: values representable in
    dtype, never zeros."""
    lead_kv = lead if lead_kv is None else lead_kv
    q = ref.round_to(rng.standard_normal(lead + (sq, h, d)) * 1.5, dtype)
    k = ref.round_to(rng.standard_normal(lead_kv + (sk, hk, d)), dtype)
    v = ref.round_to(rng.standard_normal(lead_kv + (sk, hk, dv)), dtype)
    do = ref.round_to(rng.standard_normal(np.broadcast_shapes(lead, lead_kv) + (sq, h, dv)),
                      dtype)
    return q, k, v, do


def _j(x, dtype):
    return jnp.asarray(np.asarray(x, dtype=np.float32)).astype(dtype)


def _cf(x, hk):
    """JAX layout (..., S, H, D) -> cuflash layout (..., hk, H // hk, S, D) (as cuflash.jax views
    XLA's buffers), NumPy."""
    *lead, s, h, d = x.shape
    y = np.asarray(x).reshape(tuple(lead) + (s, hk, h // hk, d))
    return np.moveaxis(y, -4, -2)


def _from_cf(x):
    """cuflash layout (..., hk, g, S, D) -> JAX layout (..., S, hk * g, D)."""
    y = np.moveaxis(np.asarray(x), -2, -4)
    return y.reshape(y.shape[:-3] + (y.shape[-3] * y.shape[-2], y.shape[-1]))


def _f64(x):
    return np.asarray(jnp.asarray(x).astype(jnp.float32), dtype=np.float64)


def _check_forward(o, q, k, v, *, causal, dtype, lse=None):
    hk = k.shape[-2]
    qc, kc, vc = _cf(q, hk), _cf(k, hk), _cf(v, hk)
    o_ref, lse_ref = ref.attention_ref(qc, kc, vc, causal=causal)
    rule = ref.pass_threshold(qc, kc, vc, causal=causal, dtype=dtype, o_ref=o_ref)
    o64 = _cf(_f64(o), hk)
    assert not np.isnan(o64).any()
    verdict = rule.judge(o64)
    assert verdict.passed, "; ".join(verdict.reasons)
    if lse is not None:
        lse_ref_j = _from_cf(lse_ref[..., None])[..., 0]  # (..., Sq, H)
        lse64 = np.asarray(lse, dtype=np.float64)
        assert lse.shape == lse_ref_j.shape and lse.dtype == jnp.float32
        assert np.array_equal(np.isneginf(lse64), np.isneginf(lse_ref_j))
        fin = np.isfinite(lse_ref_j)
        assert np.all(np.abs(lse64[fin] - lse_ref_j[fin]) <= 1e-4 + 1e-5 * np.abs(lse_ref_j[fin]))
    return rule


def _check_grads(grads, q, k, v, do, *, causal, dtype):
    hk = k.shape[-2]
    qc, kc, vc, doc = _cf(q, hk), _cf(k, hk), _cf(v, hk), _cf(do, hk)
    g_ref = ref.attention_backward_ref(doc, qc, kc, vc, causal=causal)
    tols, _ = ref.grad_pass_threshold(doc, qc, kc, vc, causal=causal, dtype=dtype, ref=g_ref)
    for name, g, r, tol, x in zip(("dq", "dk", "dv"), grads, g_ref, tols, (q, k, v)):
        assert g.shape == x.shape and g.dtype == jnp.dtype(dtype), name
        g64 = _cf(_f64(g), hk)
        assert not np.isnan(g64).any(), name
        err = float(np.max(np.abs(g64 - r)))
        assert err <= tol, f"{name}: error {err:.3e} > {tol:.3e}"


def _lse_loss_grads_f64(q, k, v, do, w, *, causal):
    """float64 (dq, dk, dv) of ``sum(o * do) + sum(lse * w)`` (JAX layout, ``w (..., Sq, H)``):
    the reference backward plus the lse term, ``d lse_i / d s_ij = p_ij`` (rows that see no key
    have p = 0), analytic from the reference's float64 softmax."""
    hk = k.shape[-2]
    qc, kc, vc, doc = _cf(q, hk), _cf(k, hk), _cf(v, hk), _cf(do, hk)
    wc = _cf(w[..., None], hk)[..., 0]
    dq, dk, dv = ref.attention_backward_ref(doc, qc, kc, vc, causal=causal)
    scale = 1 / np.sqrt(q.shape[-1])
    p = ref._probabilities_f64(qc, kc, vc, causal, scale)[0]
    dq = dq + scale * wc[..., None] * (p @ kc)
    dk = dk + scale * (np.swapaxes(p, -1, -2) @ (wc[..., None] * qc)).sum(axis=-3, keepdims=True)
    return tuple(_from_cf(x) for x in (dq, dk, dv))


def _bottom_right_mask(sq, sk):
    return jnp.asarray(np.arange(sk)[None, :] <= np.arange(sq)[:, None] + (sk - sq))


# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sq,sk,causal", [(1, 1, False), (7, 113, True), (113, 7, True),
                                          (64, 64, True), (37, 200, False)])
def test_forward_jit_matches_float64(dtype, sq, sk, causal):
    q, k, v, _ = _inputs(_rng(dtype, sq, sk, causal), dtype, (2,), sq, sk, 4, 4, 32, 32)
    f = jax.jit(lambda q, k, v: cj.attention(q, k, v, causal=causal, return_lse=True))
    o, lse = f(*(_j(x, dtype) for x in (q, k, v)))
    assert o.shape == (2, sq, 4, 32) and o.dtype == jnp.dtype(dtype)
    _check_forward(o, q, k, v, causal=causal, dtype=dtype, lse=lse)


@pytest.mark.parametrize("h,hk", [(8, 2), (6, 1), (4, 4)])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_matches_jax_dot_product_attention(h, hk, causal):
    """Same layout, head grouping and (for Sq != Sk, bottom-right) mask as JAX's attention."""
    dtype, sq, sk = "float32", 45, 70
    q, k, v, _ = _inputs(_rng(h, hk, causal), dtype, (2,), sq, sk, h, hk, 16, 16)
    qj, kj, vj = (_j(x, dtype) for x in (q, k, v))
    o = jax.jit(lambda q, k, v: cj.attention(q, k, v, causal=causal))(qj, kj, vj)
    mask = _bottom_right_mask(sq, sk) if causal else None
    o_jax = jax.nn.dot_product_attention(qj, kj, vj, mask=mask)
    rule = _check_forward(o, q, k, v, causal=causal, dtype=dtype)
    o_ref = _from_cf(ref.attention_ref(_cf(q, hk), _cf(k, hk), _cf(v, hk), causal=causal)[0])
    jax_err = float(np.max(np.abs(_f64(o_jax) - o_ref)))
    diff = float(np.max(np.abs(_f64(o) - _f64(o_jax))))
    assert diff <= rule.threshold + jax_err


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sq,sk,causal,h,hk", [(7, 113, True, 4, 4), (113, 7, False, 4, 2),
                                               (33, 33, True, 6, 1)])
def test_jit_grad_matches_float64(dtype, sq, sk, causal, h, hk):
    q, k, v, do = _inputs(_rng("g", dtype, sq, sk, causal, hk), dtype, (2,), sq, sk, h, hk, 16,
                          24)
    doj = _j(do, dtype)

    def loss(q, k, v):
        o = cj.attention(q, k, v, causal=causal)
        return jnp.sum(o.astype(jnp.float32) * doj.astype(jnp.float32))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*(_j(x, dtype) for x in (q, k, v)))
    _check_grads(grads, q, k, v, do, causal=causal, dtype=dtype)


def test_grad_without_jit_and_vjp_match_jit_grad():
    dtype = "float32"
    q, k, v, do = _inputs(_rng("vjp"), dtype, (), 20, 30, 2, 2, 8, 8)
    args = [_j(x, dtype) for x in (q, k, v)]
    o, vjp = jax.vjp(lambda q, k, v: cj.attention(q, k, v, causal=True), *args)
    _check_forward(o, q, k, v, causal=True, dtype=dtype)
    grads = vjp(_j(do, dtype))
    _check_grads(grads, q, k, v, do, causal=True, dtype=dtype)
    loss = lambda q, k, v: jnp.sum(cj.attention(q, k, v, causal=True) * _j(do, dtype))  # noqa
    for a, b in zip(jax.grad(loss, argnums=(0, 1, 2))(*args), grads):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("in_axes", [(0, 0, 0), (0, None, None), (None, 0, 0), (1, None, 1)])
def test_vmap_forward_and_grad(in_axes):
    """vmap over any argument subset: the mapped axis becomes a leading batch axis."""
    dtype, n = "float32", 3
    rng = _rng("vmap", in_axes)
    per = [_inputs(rng, dtype, (2,), 17, 23, 4, 2, 8, 8) for _ in range(n)]
    stacked = []
    for i in range(3):
        ax = in_axes[i]
        stacked.append(per[0][i] if ax is None else np.stack([p[i] for p in per], axis=ax))
    do = per[0][3]
    doj = _j(do, dtype)

    def loss(q, k, v):
        return jnp.sum(cj.attention(q, k, v, causal=True) * doj)

    args = [_j(x, dtype) for x in stacked]
    o = jax.vmap(lambda q, k, v: cj.attention(q, k, v, causal=True), in_axes=in_axes)(*args)
    g = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2)), in_axes=in_axes))(*args)
    for j in range(n):
        qkv = [per[0][i] if in_axes[i] is None else per[j][i] for i in range(3)]
        _check_forward(o[j], *qkv, causal=True, dtype=dtype)
        # every gradient is per mapped entry (the unmapped inputs' too, as vmap(grad) defines)
        _check_grads([x[j] for x in g], *qkv, do, causal=True, dtype=dtype)


def test_leading_axes_broadcast_and_three_dims():
    dtype = "float32"
    q, k, v, _ = _inputs(_rng("lead"), dtype, (3, 2), 9, 11, 2, 1, 8, 8, lead_kv=(1, 2))
    o = cj.attention(*(_j(x, dtype) for x in (q, k, v)))
    assert o.shape == (3, 2, 9, 2, 8)
    kb, vb = (np.broadcast_to(x, (3, 2) + x.shape[2:]) for x in (k, v))
    _check_forward(o, q, kb, vb, causal=False, dtype=dtype)
    o3 = cj.attention(*(_j(x[0, 0], dtype) for x in (q, k, v)))
    _check_forward(o3, q[0, 0], k[0, 0], v[0, 0], causal=False, dtype=dtype)


def test_lse_gradient_and_merge_states():
    """Gradients through lse (merging key halves), against the float64 gradients of the same
    loss; the bar is reference.tolerance with a naive float32 JAX implementation's error."""
    dtype, sq, sk, h, hk, d = "float32", 19, 40, 4, 2, 16
    q, k, v, do = _inputs(_rng("lse"), dtype, (2,), sq, sk, h, hk, d, d)
    w = _rng("w").standard_normal((2, sq, h))
    half = sk // 2

    def loss_split(q, k, v, attn):
        oa, la = attn(q, k[:, :half], v[:, :half])
        ob, lb = attn(q, k[:, half:], v[:, half:])
        o, lse = cj.merge_states(oa, la, ob, lb)
        return jnp.sum(o * jnp.asarray(do, o.dtype)) + jnp.sum(lse * jnp.asarray(w, lse.dtype))

    args = [_j(x, dtype) for x in (q, k, v)]
    ours = jax.jit(jax.grad(lambda *a: loss_split(*a, lambda q, k, v: cj.attention(
        q, k, v, return_lse=True)), argnums=(0, 1, 2)))(*args)

    def naive(q, k, v):  # matmul -> softmax -> matmul in float32, lse by logsumexp
        g = q.shape[-2] // k.shape[-2]
        kr, vr = jnp.repeat(k, g, axis=-2), jnp.repeat(v, g, axis=-2)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, kr) / np.sqrt(d)
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), vr)
        return o, jnp.swapaxes(jax.nn.logsumexp(s, axis=-1), -1, -2)

    naive_g = jax.grad(lambda *a: loss_split(*a, naive), argnums=(0, 1, 2))(*args)
    # float64 truth, independent of both: the full-key gradient of sum(o do) + sum(lse w)
    # (merging is exact)
    for name, a, nv, r_j in zip(("dq", "dk", "dv"), ours, naive_g,
                                _lse_loss_grads_f64(q, k, v, do, w, causal=False)):
        naive_err = float(np.max(np.abs(_f64(nv) - r_j)))
        tol = ref.tolerance(dtype, r_j, naive_err, out_scale=float(np.max(np.abs(r_j))))
        err = float(np.max(np.abs(_f64(a) - r_j)))
        assert err <= tol, f"{name}: {err:.3e} > {tol:.3e}"

    # merging the halves gives the full result (the forward rule)
    oa, la = cj.attention(args[0], args[1][:, :half], args[2][:, :half], return_lse=True)
    ob, lb = cj.attention(args[0], args[1][:, half:], args[2][:, half:], return_lse=True)
    o, lse = cj.merge_states(oa, la, ob, lb)
    _check_forward(o, q, k, v, causal=False, dtype=dtype, lse=lse)


def test_rows_without_keys_give_zero_and_no_nan_gradient():
    dtype = "float32"
    q, k, v, do = _inputs(_rng("empty"), dtype, (1,), 9, 4, 2, 2, 8, 8)
    args = [_j(x, dtype) for x in (q, k, v)]
    o, lse = cj.attention(*args, causal=True, return_lse=True)
    assert np.all(np.asarray(o)[:, :5] == 0) and np.all(np.isneginf(np.asarray(lse)[:, :5]))
    g = jax.grad(lambda *a: jnp.sum(cj.attention(*a, causal=True) * _j(do, dtype)),
                 argnums=(0, 1, 2))(*args)
    _check_grads(g, q, k, v, do, causal=True, dtype=dtype)
    assert np.all(np.asarray(g[0])[:, :5] == 0)


def test_scale_and_precision_pass_through():
    dtype = "float32"
    q, k, v, _ = _inputs(_rng("scale"), dtype, (1,), 8, 8, 2, 2, 8, 8)
    # on JAX's CPU device, so cuflash's NumPy path runs and the comparison can be bitwise
    args = [jax.device_put(_j(x, dtype), jax.devices("cpu")[0]) for x in (q, k, v)]
    o = cj.attention(*args, scale=0.3, precision=jax.lax.Precision.HIGHEST)
    o_np = cuflash.attention(_cf(q, 2).astype(np.float32), _cf(k, 2).astype(np.float32),
                             _cf(v, 2).astype(np.float32), scale=0.3)
    np.testing.assert_array_equal(_cf(np.asarray(o), 2), o_np)


@pytest.mark.parametrize("call,exc,match", [
    (lambda q, k, v: cj.attention(q[0, 0], k[0, 0], v[0, 0]), ValueError, "at least 3"),
    (lambda q, k, v: cj.attention(q, *(jnp.concatenate([x, x[:, :, :1]], axis=2) for x in (k, v))),
     ValueError, "multiple"),
    (lambda q, k, v: cj.attention(q, k, v[:, :, :1]), ValueError, "heads"),
    (lambda q, k, v: cj.attention(q.astype(jnp.int32), k, v), TypeError, "dtype"),
    (lambda q, k, v: cj.attention(q, k[..., :4], v), ValueError, "head dim"),
    (lambda q, k, v: cj.attention(q, k, v, scale=float("nan")), ValueError, "finite"),
    (lambda q, k, v: cj.attention(q, k, v, causal=1), TypeError, "causal"),
    (lambda q, k, v: cj.attention(q, k, v, kernel="fast"), ValueError, "kernel"),
    (lambda q, k, v: cj.attention(q, k, v, precision="low"), ValueError, "precision"),
])
def test_bad_input_raises_at_trace_time(call, exc, match):
    q = jnp.ones((1, 5, 4, 8), jnp.float32)
    k = v = jnp.ones((1, 6, 2, 8), jnp.float32)
    with pytest.raises(exc, match=match):
        jax.jit(call)(q, k, v)


# ---- GPU: XLA's buffers and stream --------------------------------------------------------

gpu = pytest.mark.skipif(not JAX_GPU, reason=NO_JAX_GPU)


@pytest.mark.gpu
@gpu
def test_gpu_no_copy_pointers_are_xla_buffers(monkeypatch):
    """Inside jit the kernels get XLA's own input buffers (pointer equality) and write the
    output buffer in place; nothing goes through the host."""
    from cuflash import _api

    seen = []
    real = _api.attention

    def spy(q, k, v, **kw):
        o = kw["out"][0] if isinstance(kw["out"], tuple) else kw["out"]
        seen.append((q.data.ptr, k.data.ptr, v.data.ptr, o.data.ptr, type(q).__module__))
        return real(q, k, v, **kw)

    monkeypatch.setattr(_api, "attention", spy)
    dtype = "float16"
    q, k, v, _ = _inputs(_rng("ptr"), dtype, (2,), 128, 128, 4, 4, 64, 64)
    args = [jax.device_put(_j(x, dtype)) for x in (q, k, v)]
    f = jax.jit(lambda q, k, v: cj.attention(q, k, v))
    with jax.transfer_guard("disallow"):
        o = f(*args)
        o.block_until_ready()
    qp, kp, vp, op, mod = seen[-1]
    assert mod.startswith("cupy")
    assert (qp, kp, vp) == tuple(a.unsafe_buffer_pointer() for a in args)
    assert op == o.unsafe_buffer_pointer()
    _check_forward(o, q, k, v, causal=False, dtype=dtype)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_gpu_ordering_on_xla_stream(dtype):
    """q produced by XLA work just before, the output consumed by XLA work just after: wrong
    stream ordering would read an unfinished q or an unwritten o (the output is poisoned with
    NaN by the XLA op that defines the inputs' size, and large matmuls make the producer slow)."""
    sq = sk = 1000
    q, k, v, do = _inputs(_rng("order", dtype), dtype, (2,), sq, sk, 4, 2, 64, 64)
    big = jnp.asarray(_rng("big").standard_normal((4096, 4096)), jnp.float32)

    @jax.jit
    def f(q0, k, v, big):
        m = big
        for _ in range(8):  # slow XLA work on the stream before q exists
            m = jnp.tanh(m @ big) * 0.01
        q = (q0.astype(jnp.float32) + 0.0 * m[0, 0]).astype(q0.dtype)
        o = cj.attention(q, k, v, causal=True)
        return o * 2, jnp.sum(o.astype(jnp.float32))

    o2, total = f(*(_j(x, dtype) for x in (q, k, v)), big)
    o = np.asarray(o2.astype(jnp.float32)) / 2
    _check_forward(jnp.asarray(o).astype(dtype), q, k, v, causal=True, dtype=dtype)
    assert np.isclose(float(total), float(np.sum(o, dtype=np.float64)), rtol=1e-3, atol=1e-2)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("sq,sk,causal,hk", [(1000, 1000, True, 2), (113, 1000, False, 4),
                                             (7, 7, True, 1)])
def test_gpu_forward_and_grad(dtype, sq, sk, causal, hk):
    q, k, v, do = _inputs(_rng("gpu", dtype, sq, sk, causal), dtype, (2,), sq, sk, 4, hk, 64,
                          64)
    doj = _j(do, dtype)
    args = [_j(x, dtype) for x in (q, k, v)]
    f = jax.jit(lambda *a: cj.attention(*a, causal=causal, return_lse=True))
    o, lse = f(*args)
    _check_forward(o, q, k, v, causal=causal, dtype=dtype, lse=lse)
    # the same signature again, on fresh inputs: the callback launches the recorded call with
    # the new buffers' pointers (cuflash/_callcache.py)
    q2, k2, v2, _ = _inputs(_rng("gpu2", dtype, sq, sk, causal), dtype, (2,), sq, sk, 4, hk, 64,
                            64)
    o2, lse2 = f(*(_j(x, dtype) for x in (q2, k2, v2)))
    _check_forward(o2, q2, k2, v2, causal=causal, dtype=dtype, lse=lse2)
    loss = lambda *a: jnp.sum(cj.attention(*a, causal=causal).astype(jnp.float32)  # noqa
                              * doj.astype(jnp.float32))
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)
    _check_grads(grads, q, k, v, do, causal=causal, dtype=dtype)
    gv = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2)), in_axes=(0, None, None)))(
        jnp.stack([args[0]] * 2), args[1], args[2])
    # each vmapped copy is a full per-example gradient (not summed over the vmapped axis); not
    # bitwise equal to `grads`: dq accumulates with float atomics on the GPU
    for i in range(2):
        _check_grads(tuple(g[i] for g in gv), q, k, v, do, causal=causal, dtype=dtype)
