"""Attention variants (window, softcap, ALiBi, bias, mask) on the CPU: the float64 references
against the definitions written out element by element, their gradients against finite
differences, and the NumPy path (forward and backward) against the references under the project's
pass rule (cuflash.reference.pass_threshold / grad_pass_threshold)."""
import math

import numpy as np
import pytest

import cuflash
from cuflash import reference as R
from cuflash._cpu import attention_numpy
from cuflash._cpu_backward import attention_backward_numpy
from cuflash.variants import variant_of

BIG = 10 ** 6   # a window extent past both ends


def _definition(q, k, v, *, causal, scale, window=None, softcap=None, alibi_slopes=None,
                bias=None, mask=None):
    """The variant semantics of cuflash.variants, one (batch, row, key) at a time in float64."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    sq, sk, dv = q.shape[-2], k.shape[-2], v.shape[-1]
    qb, kb, vb = (np.broadcast_to(x, batch + x.shape[-2:]) for x in (q, k, v))
    full = batch + (sq, sk)
    bb = None if bias is None else np.broadcast_to(np.asarray(bias, np.float64), full)
    mb = None if mask is None else np.broadcast_to(mask, full)
    sl = None if alibi_slopes is None else np.broadcast_to(
        np.asarray(alibi_slopes, np.float64)[..., None, None], batch + (1, 1))
    left, right = window if window is not None else (-1, -1)
    o = np.zeros(batch + (sq, dv))
    lse = np.full(batch + (sq,), -np.inf)
    off = sk - sq
    for b in np.ndindex(*batch):
        for i in range(sq):
            s = np.full(sk, -np.inf)
            for j in range(sk):
                if causal and j > i + off:
                    continue
                if left >= 0 and j < i + off - left:
                    continue
                if right >= 0 and j > i + off + right:
                    continue
                if mb is not None and not mb[b + (i, j)]:
                    continue
                t = scale * float(np.dot(qb[b + (i,)], kb[b + (j,)]))
                if softcap:
                    t = softcap * math.tanh(t / softcap)
                if sl is not None:
                    t -= sl[b + (0, 0)] * abs(i + off - j)
                if bb is not None:
                    t += bb[b + (i, j)]
                s[j] = t
            if np.all(s == -np.inf):
                continue
            m = s.max()
            e = np.exp(s - m)
            o[b + (i,)] = e @ vb[b] / e.sum()
            lse[b + (i,)] = m + math.log(e.sum())
    return o, lse


def _inputs(rng, batch, sq, sk, d, dv, *, qscale=1.0):
    q = rng.standard_normal(batch + (sq, d)) * qscale
    k = rng.standard_normal(batch + (sk, d))
    v = rng.standard_normal(batch + (sk, dv))
    return q, k, v


def _variants(rng, batch, sq, sk):
    h = batch[-1]
    return {
        "window": dict(window=(3, 2)),
        "window-left0": dict(window=(0, -1)),
        "window-right0": dict(window=(-1, 0)),
        "window-1-1": dict(window=(1, 1)),
        "window-past-ends": dict(window=(BIG, BIG)),
        "softcap": dict(softcap=0.7),
        "alibi-h": dict(alibi_slopes=rng.uniform(0.05, 0.5, (h,)).astype(np.float32)),
        "alibi-bh": dict(alibi_slopes=rng.uniform(0.05, 0.5, batch[-2:]).astype(np.float32)),
        "bias-full": dict(bias=rng.standard_normal(batch + (sq, sk))),
        "bias-rows-shared": dict(bias=rng.standard_normal((1, sk)).astype(np.float32)),
        "bias-head": dict(bias=rng.standard_normal((h, sq, sk)).astype(np.float16)),
        "mask": dict(mask=rng.random((sq, sk)) > 0.4),
        "mask-empty-rows": dict(mask=_empty_row_mask(rng, batch, sq, sk)),
        "combined": dict(window=(4, 1), softcap=1.3,
                         alibi_slopes=rng.uniform(0.05, 0.5, (h,)).astype(np.float32),
                         bias=rng.standard_normal((h, 1, sk)), mask=rng.random((sq, sk)) > 0.2),
    }


def _empty_row_mask(rng, batch, sq, sk):
    m = rng.random(batch + (sq, sk)) > 0.5
    m[..., ::3, :] = False          # every third row sees no key
    return m


VARIANT_NAMES = list(_variants(np.random.default_rng(0), (2, 3), 4, 4))


@pytest.mark.parametrize("name", VARIANT_NAMES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(5, 7), (7, 5), (1, 6)])
def test_reference_matches_definition(name, causal, sq, sk):
    rng = np.random.default_rng(hash((name, causal, sq, sk)) % 2**32)
    batch = (2, 3)
    q, k, v = _inputs(rng, batch, sq, sk, 8, 5, qscale=3.0)
    kw = _variants(rng, batch, sq, sk)[name]
    scale = 0.4
    o, lse = R.attention_ref(q, k, v, causal=causal, scale=scale, **kw)
    o_d, lse_d = _definition(q, k, v, causal=causal, scale=scale, **kw)
    np.testing.assert_allclose(o, o_d, rtol=1e-12, atol=1e-12)
    assert np.array_equal(np.isinf(lse), np.isinf(lse_d))
    fin = np.isfinite(lse_d)
    np.testing.assert_allclose(lse[fin], lse_d[fin], rtol=1e-12, atol=1e-12)
    assert not np.isnan(o).any()


@pytest.mark.parametrize("name", ["window", "softcap", "alibi-h", "bias-full",
                                  "bias-rows-shared", "mask-empty-rows", "combined"])
@pytest.mark.parametrize("causal", [False, True])
def test_reference_gradients_finite_differences(name, causal):
    rng = np.random.default_rng(7 + VARIANT_NAMES.index(name))
    batch = (1, 2)
    q, k, v = _inputs(rng, batch, 4, 5, 3, 2, qscale=2.0)
    kw = _variants(rng, batch, 4, 5)[name]
    do = rng.standard_normal(batch + (4, 2))
    with_bias = "bias" in kw
    g = R.attention_backward_ref(do, q, k, v, causal=causal, return_dbias=with_bias, **kw)
    f = R.attention_backward_fd(do, q, k, v, causal=causal, return_dbias=with_bias, **kw)
    assert len(g) == (4 if with_bias else 3)
    for a, b in zip(g, f):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
        assert np.isfinite(a).all()


def _dtypes():
    out = ["float16", "float32", "float64"]
    try:
        import ml_dtypes  # noqa: F401
        out.append("bfloat16")
    except ImportError:
        pass
    return out


def _cast(x, dt):
    if dt == "bfloat16":
        import ml_dtypes
        return np.asarray(x).astype(ml_dtypes.bfloat16)
    return np.asarray(x).astype(dt)


@pytest.mark.parametrize("dt", _dtypes())
@pytest.mark.parametrize("name", VARIANT_NAMES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(113, 113), (7, 113), (113, 7), (1, 40)])
def test_cpu_forward_and_backward_pass_rule(dt, name, causal, sq, sk):
    rng = np.random.default_rng(hash((dt, name, causal, sq, sk)) % 2**32)
    batch = (2, 3)
    q, k, v = (_cast(x, dt) for x in _inputs(rng, batch, sq, sk, 16, 8))
    kw = _variants(rng, batch, sq, sk)[name]
    q64, k64, v64 = (np.asarray(x, np.float64) for x in (q, k, v))
    out = np.full(batch + (sq, 8), np.nan, dtype=q.dtype)
    o, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True, out=out, **kw)
    assert o is out
    rule = R.pass_threshold(q64, k64, v64, causal=causal, dtype=dt, **kw)
    verdict = rule.judge(o)
    assert verdict.passed, verdict.reasons
    _, lse_ref = R.attention_ref(q64, k64, v64, causal=causal, **kw)
    assert np.array_equal(np.isneginf(lse), np.isneginf(lse_ref))
    empty = np.isneginf(lse_ref)
    assert (np.asarray(o, np.float64)[empty] == 0).all()

    do = _cast(rng.standard_normal(batch + (sq, 8)), dt)
    with_bias = "bias" in kw
    grads = cuflash.attention_backward(do, q, k, v, o, lse, causal=causal,
                                       return_dbias=with_bias, **kw)
    do64 = np.asarray(do, np.float64)
    ref = R.attention_backward_ref(do64, q64, k64, v64, causal=causal, return_dbias=with_bias,
                                   **kw)
    tols, _ = R.grad_pass_threshold(do64, q64, k64, v64, causal=causal, dtype=dt, ref=ref,
                                    return_dbias=with_bias, **kw)
    assert len(grads) == len(ref) == len(tols)
    for name_g, g, r, t in zip(("dq", "dk", "dv", "dbias"), grads, ref, tols):
        g = np.asarray(g, np.float64)
        assert g.shape == r.shape, name_g
        assert np.isfinite(g).all(), name_g
        err = float(np.abs(g - r).max())
        assert err <= t, f"{name_g}: {err:.3g} > {t:.3g}"
    if with_bias:
        assert grads[3].dtype == kw["bias"].dtype


@pytest.mark.parametrize("block_k", [1, 7, 16])
@pytest.mark.parametrize("name", ["window", "window-1-1", "combined", "mask-empty-rows",
                                  "bias-head"])
def test_cpu_small_tiles(block_k, name):
    """Many tiles, windows that skip most of them, and bias/mask slices per tile."""
    rng = np.random.default_rng(block_k)
    batch = (2, 3)
    q, k, v = (x.astype(np.float32) for x in _inputs(rng, batch, 50, 61, 8, 4))
    kw = _variants(rng, batch, 50, 61)[name]
    var = variant_of(kw, q, k, v)
    o, lse = attention_numpy(q, k, v, causal=False, scale=0.35, out=None, need_lse=True,
                             block_k=block_k, variant=var)
    rule = R.pass_threshold(q, k, v, scale=0.35, dtype="float32", key_tile=1, **kw)
    assert rule.judge(o).passed, rule.judge(o).reasons
    do = rng.standard_normal(batch + (50, 4)).astype(np.float32)
    with_bias = "bias" in kw
    g = attention_backward_numpy(do, q, k, v, o, lse, causal=False, scale=0.35,
                                 block_k=block_k, variant=var, return_dbias=with_bias)
    ref = R.attention_backward_ref(do, q, k, v, scale=0.35, return_dbias=with_bias, **kw)
    tols, _ = R.grad_pass_threshold(do, q, k, v, scale=0.35, dtype="float32", ref=ref,
                                    return_dbias=with_bias, **kw)
    for a, r, t in zip(g, ref, tols):
        assert float(np.abs(np.asarray(a, np.float64) - r).max()) <= t


def test_window_skips_tiles(monkeypatch):
    """A window of w keys touches about Sq * w scores, not Sq * Sk: count the matmul work."""
    import cuflash._cpu as cpu
    rng = np.random.default_rng(3)
    q, k, v = (x.astype(np.float32) for x in _inputs(rng, (1,), 512, 512, 8, 8))
    var = variant_of(dict(window=(16, 0)), q, k, v)
    seen = []
    real = np.matmul

    def counting(a, b, *args, **kwargs):
        r = real(a, b, *args, **kwargs)
        if b.shape[-2] == 8 and a.shape[-1] == 8:   # the score product q . k^T
            seen.append(r.shape[-2] * r.shape[-1])
        return r

    monkeypatch.setattr(cpu.np, "matmul", counting)
    cpu.attention_numpy(q, k, v, causal=False, scale=0.3, out=None, need_lse=False,
                        block_k=32, variant=var)
    monkeypatch.undo()
    assert sum(seen) < 512 * 512 / 4


def test_softcap_large_scores():
    rng = np.random.default_rng(11)
    q, k, v = _inputs(rng, (2,), 33, 47, 16, 8, qscale=200.0)
    for dt in ("float16", "float32"):
        qc, kc, vc = (x.astype(dt) for x in (q, k, v))
        o = cuflash.attention(qc, kc, vc, softcap=5.0)
        rule = R.pass_threshold(*(x.astype(np.float64) for x in (qc, kc, vc)), dtype=dt,
                                softcap=5.0)
        assert np.isfinite(o).all()
        assert rule.judge(o).passed, rule.judge(o).reasons


def test_empty_rows_zero_everything():
    rng = np.random.default_rng(5)
    q, k, v = (x.astype(np.float32) for x in _inputs(rng, (2,), 9, 9, 4, 4))
    q[0, 3] = np.nan                  # a NaN query in a row that sees nothing stays harmless
    mask = np.ones((9, 9), bool)
    mask[3] = False
    o, lse = cuflash.attention(q, k, v, mask=mask, return_lse=True)
    assert (o[:, 3] == 0).all() and np.isneginf(lse[:, 3]).all()
    assert np.isfinite(o[1]).all()
    do = rng.standard_normal(o.shape).astype(np.float32)
    dq, dk, dv = cuflash.attention_backward(do, q, k, v, o, lse, mask=mask)
    assert (dq[:, 3] == 0).all()
    assert np.isfinite(dk[1]).all() and np.isfinite(dv[1]).all()
    # a window that no row reaches: every row empty
    o, lse = cuflash.attention(q[1], k[1], v[1], window=(0, 0), mask=~np.eye(9, dtype=bool),
                               return_lse=True)
    assert (o == 0).all() and np.isneginf(lse).all()


def test_causal_window_combination_is_intersection():
    rng = np.random.default_rng(9)
    q, k, v = _inputs(rng, (2,), 11, 13, 4, 4)
    a = cuflash.attention(q, k, v, causal=True, window=(3, 5))
    b = cuflash.attention(q, k, v, window=(3, 0))
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-14)


def test_variant_argument_errors():
    rng = np.random.default_rng(0)
    q, k, v = (x.astype(np.float32) for x in _inputs(rng, (2, 3), 5, 6, 4, 4))
    o, lse = cuflash.attention(q, k, v, return_lse=True)
    cases = [
        (dict(window=(1,)), TypeError, "window"),
        (dict(window=(1.5, 2)), TypeError, "window"),
        (dict(window=(-2, 0)), ValueError, "window"),
        (dict(softcap=-1.0), ValueError, "softcap"),
        (dict(softcap=float("inf")), ValueError, "softcap"),
        (dict(softcap="1"), TypeError, "softcap"),
        (dict(alibi_slopes=np.ones(3)), TypeError, "alibi_slopes"),
        (dict(alibi_slopes=np.ones(4, np.float32)), ValueError, "alibi_slopes"),
        (dict(alibi_slopes=np.ones((1, 2, 3), np.float32)), ValueError, "alibi_slopes"),
        (dict(bias=np.ones((5, 7), np.float32)), ValueError, "bias"),
        (dict(bias=np.ones((4, 3, 5, 6), np.float32)), ValueError, "bias"),
        (dict(bias=np.ones((5, 6), np.int32)), TypeError, "bias"),
        (dict(bias=np.ones(6, np.float32)), ValueError, "bias"),
        (dict(mask=np.ones((5, 6), np.float32)), TypeError, "mask"),
        (dict(mask=np.ones((5, 5), bool)), ValueError, "mask"),
        (dict(bias=[[1.0]]), TypeError, "bias"),
    ]
    for kw, exc, word in cases:
        with pytest.raises(exc, match=word):
            cuflash.attention(q, k, v, **kw)
        with pytest.raises(exc, match=word):
            cuflash.attention_backward(o, q, k, v, o, lse, **kw)
    with pytest.raises(ValueError, match="return_dbias"):
        cuflash.attention_backward(o, q, k, v, o, lse, return_dbias=True)
    with pytest.raises(TypeError, match="return_dbias"):
        cuflash.attention_backward(o, q, k, v, o, lse, bias=np.ones((5, 6)), return_dbias=1)
    with pytest.raises(TypeError, match="unexpected"):
        R.attention_ref(q, k, v, windw=(1, 1))
    assert cuflash.dispatch_info(q, k, v, window=(1, 1)) == "cpu-numpy"


def test_plain_variant_is_plain():
    """All-default variant arguments give exactly the plain result."""
    rng = np.random.default_rng(1)
    q, k, v = (x.astype(np.float32) for x in _inputs(rng, (2,), 17, 19, 8, 8))
    a = cuflash.attention(q, k, v, causal=True)
    b = cuflash.attention(q, k, v, causal=True, window=(-1, -1), softcap=0.0)
    assert np.array_equal(a, b)


def test_variants_with_grouped_query_heads_are_refused():
    # GQA splits the head axis while bias/mask/slopes broadcast against the caller's axes; the
    # combination is not built yet and must fail loudly rather than guess an alignment.
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 4, 7, 16)).astype(np.float32)
    k = v = rng.standard_normal((1, 2, 7, 16)).astype(np.float32)
    with pytest.raises(ValueError, match="grouped-query"):
        cuflash.attention(q, k, v, softcap=5.0)
    o, lse = cuflash.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match="grouped-query"):
        cuflash.attention_backward(o, q, k, v, o, lse, window=(2, 0))
