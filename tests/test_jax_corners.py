"""cuflash.jax corners, on the CPU backend (the callbacks run cuflash's NumPy path inside jit):
merge_states' weights, checks and gradients, float64 gradients through lse, NumPy float64
inputs with jax_enable_x64 off, static arguments given as JAX values, kernel= without a GPU
backend, and error messages in JAX's layout. Each of these was a defect (fixed in the same
change); the compositions that were already right are in tests/test_jax.py. Tiny shapes."""
import numpy as np
import pytest
from scipy.special import expit

jax = pytest.importorskip("jax", reason="JAX is not installed (pip install 'cuflash[jax]')")
import jax.numpy as jnp  # noqa: E402

import cuflash.jax as cj  # noqa: E402
from cuflash import reference as ref  # noqa: E402

from seeds import SEED, case_rng  # noqa: E402
from test_cpu_corners import check_merged  # noqa: E402
from test_jax import (_check_forward, _check_grads, _f64, _inputs, _j,  # noqa: E402
                      _lse_loss_grads_f64)

JAX_GPU = jax.default_backend() == "gpu"
DTYPES = ["float16", "bfloat16", "float32", "float64"]


def _rng(*key):
    return case_rng(SEED, "jax_corners", *key)


def _x64():
    """A context with jax_enable_x64 on (float64 JAX arrays)."""
    ctx = getattr(jax, "enable_x64", None)
    if ctx is None:  # JAX before 0.7
        from jax.experimental import enable_x64 as ctx
    return ctx(True)


def _jx(x, dt):
    """A JAX array of float64 `x` (values representable in dt) in dtype dt."""
    return jnp.asarray(x).astype(dt) if dt == "float64" else _j(x, dt)


def _naive(q, k, v, causal):
    """(o, lse) by matmul -> softmax -> matmul in the inputs' dtype (JAX layout, GQA by
    repeating k, v), bottom-right causal; rows that see no key give o = 0, lse = 0 and zero
    gradients."""
    sq, sk, g = q.shape[-3], k.shape[-3], q.shape[-2] // k.shape[-2]
    kr, vr = jnp.repeat(k, g, axis=-2), jnp.repeat(v, g, axis=-2)
    s = jnp.einsum("...qhd,...khd->...hqk", q, kr) / np.sqrt(q.shape[-1])
    if causal:
        s = jnp.where(np.arange(sk)[None, :] <= np.arange(sq)[:, None] + sk - sq, s, -jnp.inf)
    row = jax.nn.logsumexp(s, axis=-1)
    p = jnp.where(jnp.isneginf(row)[..., None], 0.0, jnp.exp(s - row[..., None]))
    return (jnp.einsum("...hqk,...khd->...qhd", p, vr),
            jnp.swapaxes(jnp.where(jnp.isneginf(row), 0.0, row), -1, -2))


# ---- merge_states --------------------------------------------------------------------------

@pytest.mark.parametrize("dt", DTYPES)
def test_merge_states_weights_from_the_lse_difference(dt):
    """cj.merge_states took its weights as exp(lse_a - logaddexp(lse_a, lse_b)), carrying the
    merged lse's float32 rounding into every output: an error of 1.2e-3 at |lse| = 1e4 on O(1)
    outputs, where `cuflash.merge_states` (and the exact merge) depend on lse_a - lse_b only.
    Now the core's weights, under jit, against the same float64 truth and rounding rule as the
    core's test; rows empty on one or both sides merge as the identity."""
    rng = _rng("merge", dt)
    with _x64():
        for big in (0.0, 1e2, 1e4):
            o_a, o_b = (ref.round_to(rng.standard_normal((2, 9, 3, 8)), dt) for _ in range(2))
            la, lb = ((big + rng.standard_normal((2, 9, 3))).astype(np.float32)
                      for _ in range(2))
            la[0, :5] = -np.inf
            lb[0, 3:7] = -np.inf            # rows 3, 4: both empty
            o_a[0, :5] = 0
            o_b[0, 3:7] = 0
            o, lse = jax.jit(cj.merge_states)(_jx(o_a, dt), jnp.asarray(la), _jx(o_b, dt),
                                              jnp.asarray(lb))
            assert o.dtype == jnp.dtype(dt) and lse.dtype == jnp.float32
            o64 = np.asarray(o) if dt == "float64" else _f64(o)
            check_merged(o64, np.asarray(lse), o_a, la, o_b, lb, dt, f"L = {big:g}")
            assert np.all(np.asarray(o)[0, 3:5] == 0)


def test_merge_states_gradients_where_both_parts_are_empty():
    """Rows that neither part saw (lse = -inf on both sides, as causal chunks give): the merge
    is o = 0, lse = -inf, and its gradients must be 0 there, not NaN (logaddexp's gradient at
    (-inf, -inf) is NaN); elsewhere the lse gradients are the weights, w_a + w_b = 1; under
    jit and vmap."""
    rng = _rng("merge-grad")
    o_a, o_b = (jnp.asarray(rng.standard_normal((3, 6, 2, 4)), jnp.float32) for _ in range(2))
    la, lb = (rng.standard_normal((3, 6, 2)).astype(np.float32) for _ in range(2))
    la[:, :2] = -np.inf
    lb[:, 1:3] = -np.inf                    # row 1: both empty
    o_a, o_b = o_a.at[:, :2].set(0), o_b.at[:, 1:3].set(0)

    def loss(oa, la, ob, lb):
        o, lse = cj.merge_states(oa, la, ob, lb)
        return jnp.sum(o) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    grads = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2, 3))))(
        o_a, jnp.asarray(la), o_b, jnp.asarray(lb))
    for g in grads:
        assert np.all(np.isfinite(np.asarray(g)))
        assert np.all(np.asarray(g)[:, 1] == 0)
    # elsewhere: o = w_a o_a + w_b o_b with w_a = expit(la - lb), so d/dla of sum(o) + lse is
    # w_a w_b (sum(o_a) - sum(o_b)) + w_a (float64, from the difference)
    seen = np.isfinite(la) | np.isfinite(lb)
    diff = np.where(seen, la.astype(np.float64) - np.where(seen, lb, 0), 0.0)
    wa, wb = expit(diff), expit(-diff)
    sa, sb = (np.sum(np.asarray(x, np.float64), axis=-1) for x in (o_a, o_b))
    for g, want in ((grads[1], wa * wb * (sa - sb) + wa), (grads[3], wa * wb * (sb - sa) + wb)):
        got = np.asarray(g, np.float64)
        np.testing.assert_allclose(got[seen], want[seen], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("change,exc,match", [
    (lambda a: (a[0], jnp.swapaxes(a[1], -1, -2), a[2], a[3]), ValueError, "lse_a has shape"),
    (lambda a: (a[0], a[1][..., :1], a[2], a[3]), ValueError, "lse_a has shape"),
    (lambda a: (a[0], a[1], a[2].astype(jnp.float16), a[3]), TypeError, "same dtype"),
    (lambda a: (a[0], a[1], a[2], a[3].astype(jnp.float16)), TypeError, "lse_b has dtype"),
    (lambda a: (a[0], a[1], a[2][:, :4], a[3]), ValueError, "same shape"),
    (lambda a: (a[0].astype(jnp.int32), a[1], a[2].astype(jnp.int32), a[3]), TypeError,
     "dtype int32"),
])
def test_merge_states_checks_at_trace_time(change, exc, match):
    """cj.merge_states checked nothing: an lse of the wrong layout or a size-1 axis broadcast
    silently (or failed inside jnp.maximum), mixed dtypes merged. Now the core's checks, at
    trace time."""
    rng = _rng("merge-check")
    args = (jnp.asarray(rng.standard_normal((2, 5, 3, 4)), jnp.float32),
            jnp.asarray(rng.standard_normal((2, 5, 3)), jnp.float32),
            jnp.asarray(rng.standard_normal((2, 5, 3, 4)), jnp.float32),
            jnp.asarray(rng.standard_normal((2, 5, 3)), jnp.float32))
    with pytest.raises(exc, match=match):
        jax.make_jaxpr(cj.merge_states)(*change(args))


# ---- attention ----------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
def test_float64_gradients_through_lse_stay_float64(causal):
    """A cotangent on lse summed its terms into dq and dk in float32 for every dtype, so with
    jax_enable_x64 a float64 loss using o and lse had float64 gradients good to 1e-7 only. The
    cotangent is made exact (w representable in float32, lse's dtype), so the bar is float64's:
    the rule's tolerance with a naive float64 JAX implementation's error."""
    dt = "float64"
    rng = _rng("lse64", causal)
    q, k, v, do = _inputs(rng, dt, (2,), 9, 5, 4, 2, 8, 8)
    w = ref.round_to(rng.standard_normal((2, 9, 4)), "float32")

    def loss(attn):
        def f(q, k, v):
            o, lse = attn(q, k, v)
            return jnp.sum(o * do) + jnp.sum(lse * w)
        return f

    with _x64():
        args = [jnp.asarray(x) for x in (q, k, v)]
        ours = jax.jit(jax.grad(loss(lambda *a: cj.attention(*a, causal=causal,
                                                             return_lse=True)),
                                argnums=(0, 1, 2)))(*args)
        naive_g = jax.grad(loss(lambda *a: _naive(*a, causal)), argnums=(0, 1, 2))(*args)
    for name, a, nv, r in zip(("dq", "dk", "dv"), ours, naive_g,
                              _lse_loss_grads_f64(q, k, v, do, w, causal=causal)):
        assert a.dtype == jnp.float64 and a.shape == r.shape, name
        naive_err = float(np.max(np.abs(np.asarray(nv) - r)))
        tol = ref.tolerance(dt, r, naive_err, out_scale=float(np.max(np.abs(r))))
        err = float(np.max(np.abs(np.asarray(a) - r)))
        assert err <= tol, f"{name}: {err:.3e} > {tol:.3e}"


@pytest.mark.skipif(jax.config.jax_enable_x64, reason="needs jax_enable_x64 off")
def test_numpy_float64_inputs_with_x64_off_are_float32():
    """With jax_enable_x64 off JAX makes a NumPy float64 array a float32 one, but the checks
    took its float64 dtype: NumPy float64 q beside float32 JAX k, v raised 'same dtype', and a
    scale valid for float64 only (1e-300) passed the trace-time check and failed inside the
    callback (a JaxRuntimeError when run). Now the checks see JAX's dtypes."""
    dt = "float32"
    q, k, v, do = _inputs(_rng("np64"), dt, (2,), 6, 7, 4, 2, 8, 8)
    o = cj.attention(q, _j(k, dt), _j(v, dt), causal=True)      # q: NumPy float64
    assert o.dtype == jnp.float32
    _check_forward(o, q, k, v, causal=True, dtype=dt)
    g = jax.grad(lambda *a: jnp.sum(cj.attention(*a) * _j(do, dt)), argnums=(0, 1, 2))(q, k, v)
    _check_grads(g, q, k, v, do, causal=False, dtype=dt)
    with pytest.raises(ValueError, match="scale=1e-300 is not usable with float32"):
        jax.make_jaxpr(lambda: cj.attention(q, k, v, scale=1e-300))()


@pytest.mark.parametrize("name,value", [("scale", 0.5), ("causal", True), ("return_lse", True),
                                        ("deterministic", True)])
def test_static_arguments(name, value):
    """Static arguments given as traced values (a jit argument, a vmapped batch of scales)
    raised 'must be a real number or None, got DynamicJaxprTracer' (or BatchTracer); now the
    message says they must be static and how. A concrete 0-d JAX array (jnp.float32(0.5), as
    jax.nn.dot_product_attention takes) is read as its Python value, with the same result."""
    q, k, v, _ = (_j(x, "float32") for x in _inputs(_rng("static"), "float32", (1,), 4, 5, 2, 1,
                                                       8, 8))
    with pytest.raises(TypeError, match=f"{name} must be static"):
        jax.jit(lambda x: cj.attention(q, k, v, **{name: x}))(value)
    if name == "scale":
        with pytest.raises(TypeError, match="scale must be static"):
            jax.vmap(lambda s: cj.attention(q, k, v, scale=s))(jnp.asarray([0.5, 0.25]))
    conc = jnp.float32(value) if name == "scale" else jnp.bool_(value)
    a = cj.attention(q, k, v, **{name: conc})
    b = cj.attention(q, k, v, **{name: value})
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.skipif(JAX_GPU, reason="JAX has a GPU backend: kernel= applies there")
@pytest.mark.parametrize("kernel", ["generic", "tensorcore", "hopper", "decode"])
def test_gpu_kernel_without_a_gpu_backend_raises_at_trace_time(kernel):
    """Without a GPU backend the callbacks run the NumPy path, which takes kernel='auto' only:
    a GPU kernel passed the trace-time check and failed when the callback ran, as a
    JaxRuntimeError ('INTERNAL: Error when calling buffer callback' around 'the inputs are on
    the CPU (NumPy)'). Now a ValueError at trace time, saying why."""
    q = jnp.ones((1, 4, 2, 8), jnp.float32)
    with pytest.raises(ValueError, match=f"kernel='{kernel}'.*no GPU backend"):
        jax.make_jaxpr(lambda q: cj.attention(q, q, q, kernel=kernel))(q)


@pytest.mark.parametrize("qs,ks,match", [
    ((2, 5, 4, 8), (3, 6, 2, 8), r"do not broadcast.*q \(2, 5, 4, 8\), k \(3, 6, 2, 8\)"),
    ((1, 0, 4, 8), (1, 6, 2, 8), r"zero-length axis.*q \(1, 0, 4, 8\)"),
    ((1, 5, 2, 8), (1, 6, 0, 8), r"k has a zero-length axis.*k \(1, 6, 0, 8\)"),
])
def test_shape_errors_name_the_jax_layout_shapes(qs, ks, match):
    """The checks run on cuflash views (..., Hk, H // Hk, S, D), and their messages gave only
    those shapes ('the batch axes of q (2, 2, 2), k (3, 2, 1)' for q (2, 5, 4, 8)); zero k
    heads were reported as 'not a multiple'. Now the JAX-layout shapes are named too."""
    q, k = jnp.ones(qs, jnp.float32), jnp.ones(ks, jnp.float32)
    with pytest.raises(ValueError, match=match):
        jax.make_jaxpr(lambda q, k: cj.attention(q, k, k))(q, k)


def test_forward_mode_raises_jax_error():
    """A custom_vjp function has no forward mode: jvp and jacfwd raise JAX's own TypeError at
    trace time (documented), before any callback runs."""
    q = jnp.ones((1, 3, 2, 4), jnp.float32)
    with pytest.raises(TypeError, match="forward-mode"):
        jax.jvp(lambda q: cj.attention(q, q, q), (q,), (q,))
    with pytest.raises(TypeError, match="forward-mode"):
        jax.jacfwd(lambda q: cj.attention(q, q, q))(q)


@pytest.mark.parametrize("sq,sk", [(9, 4), (1, 6)])
def test_gradients_of_lse_alone(sq, sk):
    """(Right before this change; guards the symbolic-zero cotangent of o.) A loss on lse only,
    causal with rows that see no key (Sq > Sk) and Sq = 1, under jit(vmap(grad)) with k, v
    unmapped: dv is zero, dq and dk are the lse term alone, no NaN on the empty rows."""
    dt = "float32"
    rng = _rng("lse-only", sq, sk)
    n = 8   # examples under vmap: the rule's naive error is measured over all of them
    per = [_inputs(rng, dt, (), sq, sk, 4, 2, 8, 8) for _ in range(n)]
    w = [ref.round_to(rng.standard_normal((sq, 4)), dt) for _ in range(n)]
    k, v = per[0][1], per[0][2]

    def loss(q, k, v, w):
        return jnp.sum(cj.attention(q, k, v, causal=True, return_lse=True)[1] * w)

    g = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2)), in_axes=(0, None, None, 0)))(
        _j(np.stack([p[0] for p in per]), dt), _j(k, dt), _j(v, dt), _j(np.stack(w), dt))
    naive_g = jax.vmap(jax.grad(lambda q, k, v, w: jnp.sum(_naive(q, k, v, True)[1] * w),
                                argnums=(0, 1, 2)), in_axes=(0, None, None, 0))(
        _j(np.stack([p[0] for p in per]), dt), _j(k, dt), _j(v, dt), _j(np.stack(w), dt))
    # The rule on the whole vmapped call, as the audit applies it to a whole problem: the
    # largest error over the examples against the naive one's largest (per example of 2, the
    # naive gradient of a 1-row problem was luckier than twice cuflash's on 1 seed of 26).
    refs = [_lse_loss_grads_f64(per[i][0], k, v, np.zeros((sq, 4, 8)), w[i], causal=True)
            for i in range(n)]
    for j, name in enumerate(("dq", "dk", "dv")):
        rr = np.stack([r[j] for r in refs])
        a, nv = _f64(g[j]), _f64(naive_g[j])
        assert a.shape == rr.shape and not np.isnan(a).any(), name
        naive_err = float(np.max(np.abs(nv - rr)))
        tol = ref.tolerance(dt, rr, naive_err, out_scale=float(np.max(np.abs(rr))))
        err = float(np.max(np.abs(a - rr)))
        assert err <= tol, f"{name}: {err:.3e} > {tol:.3e}"
    assert np.all(np.asarray(g[2]) == 0)
