"""Helpers for the GPU tests: inputs of any dtype (bfloat16 included) made from float64 values,
NaN-poisoned output buffers, and the float64 comparison with the project's one pass rule,
`cuflash.reference.pass_threshold` (the 2x-naive threshold and the a-priori bound)."""
import numpy as np

from cuflash import reference


def cupy():
    import cupy as cp

    return cp


def bf16_dtype():
    """CuPy's bfloat16 dtype, or None when ml_dtypes is missing."""
    try:
        import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy)
    except ImportError:
        return None
    return np.dtype("bfloat16")


def to_gpu(x64, dtype):
    """A GPU array of `dtype` holding `x64`, which must already be representable in `dtype`."""
    cp = cupy()
    if dtype == "bfloat16":
        bits = (np.ascontiguousarray(x64, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
        return cp.asarray(bits).view(bf16_dtype())
    return cp.asarray(np.asarray(x64, dtype=dtype))


def to_host64(a):
    """A GPU array of any supported dtype as a float64 NumPy array."""
    cp = cupy()
    if a.dtype.name == "bfloat16":
        bits = cp.asnumpy(a.view(cp.uint16)).astype(np.uint32) << 16
        return bits.view(np.float32).astype(np.float64)
    return cp.asnumpy(a).astype(np.float64)


def poisoned(shape, dtype):
    """An uninitialised GPU array with every byte 0xFF: NaN in every float format."""
    cp = cupy()
    a = cp.empty(shape, dtype=bf16_dtype() if dtype == "bfloat16" else dtype)
    a.view(cp.uint8).fill(0xFF)
    return a


def random_inputs(rng, batch_q, batch_kv, sq, sk, d, dv, dtype, scale_v=1.0):
    """Fresh random q, k, v (float64 arrays whose values are representable in `dtype`)."""
    q = reference.round_to(rng.standard_normal(batch_q + (sq, d)), dtype)
    k = reference.round_to(rng.standard_normal(batch_kv + (sk, d)), dtype)
    v = reference.round_to(scale_v * rng.standard_normal(batch_kv + (sk, dv)), dtype)
    return q, k, v


def reference_result(q, k, v, *, causal, scale, dtype, precision=None):
    """(o_ref, lse_ref, rule) for inputs q, k, v, with `rule` the `cuflash.reference.PassRule`
    that `check_against_reference` judges by, for reuse across kernels run on the same inputs.
    `precision`: the float32 product mode (None or "highest", "high") whose rule applies."""
    o_ref, lse_ref = reference.attention_ref(q, k, v, causal=causal, scale=scale)
    rule = reference.pass_threshold(q, k, v, causal=causal, scale=scale, dtype=dtype, o_ref=o_ref,
                                    precision=precision)
    return o_ref, lse_ref, rule


def check_against_reference(o_gpu, lse_gpu, q, k, v, *, causal, scale, dtype, extra_tol=0.0,
                            ref=None, precision=None, lse_tol=(1e-4, 1e-5)):
    """Assert the pass rule for `o_gpu` (both bars widened by `extra_tol`) and a tight match for
    `lse_gpu` (|error| <= lse_tol[0] + lse_tol[1] |lse_ref|). `ref`: a `reference_result` for
    these inputs, if already computed. Returns (max abs error, naive error)."""
    if ref is None:
        ref = reference_result(q, k, v, causal=causal, scale=scale, dtype=dtype,
                               precision=precision)
    o_ref, lse_ref, rule = ref
    if extra_tol:
        rule = rule.widened(extra_tol)
    o = to_host64(o_gpu)
    assert not np.isnan(o).any(), f"{int(np.isnan(o).sum())} output elements are NaN (unwritten?)"
    verdict = rule.judge(o)
    assert verdict.passed, "; ".join(verdict.reasons) + f" (naive {rule.naive_err:.3e})"
    err = verdict.max_abs_err
    if lse_gpu is not None:
        lse = to_host64(lse_gpu)
        assert not np.isnan(lse).any(), "lse has NaN (unwritten?)"
        ninf = np.isneginf(lse_ref)
        assert np.array_equal(np.isneginf(lse), ninf), "lse = -inf exactly where no key is visible"
        fin = ~ninf
        if fin.any():
            lerr = np.abs(lse[fin] - lse_ref[fin])
            bound = lse_tol[0] + lse_tol[1] * np.abs(lse_ref[fin])
            assert np.all(lerr <= bound), f"lse error {lerr.max():.3e}"
    return err, rule.naive_err


# ---------------------------------------------------------------------------------------------
# Backward pass

def random_backward_inputs(rng, batch_q, batch_k, sq, sk, d, dv, dtype, batch_v=None):
    """Fresh random q, k, v and an upstream gradient do (float64 arrays representable in dtype).
    `batch_v` defaults to `batch_k`; do has the broadcast batch shape."""
    batch_v = batch_k if batch_v is None else batch_v
    q = reference.round_to(rng.standard_normal(batch_q + (sq, d)), dtype)
    k = reference.round_to(rng.standard_normal(batch_k + (sk, d)), dtype)
    v = reference.round_to(rng.standard_normal(batch_v + (sk, dv)), dtype)
    batch = np.broadcast_shapes(batch_q, batch_k, batch_v)
    do = reference.round_to(rng.standard_normal(batch + (sq, dv)), dtype)
    return q, k, v, do


def grad_reference(do, q, k, v, *, causal, scale, dtype):
    """(float64 gradients, thresholds, naive errors), each a (dq, dk, dv) triple: what
    `check_grads_against_reference` compares with, reusable across kernels on the same inputs."""
    g_ref = reference.attention_backward_ref(do, q, k, v, causal=causal, scale=scale)
    tols, naive = reference.grad_pass_threshold(do, q, k, v, causal=causal, scale=scale,
                                                dtype=dtype, ref=g_ref)
    return g_ref, tols, naive


def check_grads_against_reference(grads, do, q, k, v, *, causal, scale, dtype, ref=None,
                                  label=""):
    """Assert, for each of the GPU gradients (dq, dk, dv): the shape and dtype of q, k, v, no
    NaN (outputs are poisoned with NaN, so NaN means unwritten), and the gradient pass rule.
    Failure messages say which gradient, where, by how much, and which kernel (`label`)."""
    if ref is None:
        ref = grad_reference(do, q, k, v, causal=causal, scale=scale, dtype=dtype)
    g_ref, tols, naive = ref
    where = (f"[{label}, {dtype}, q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)}, "
             f"causal={causal}]")
    errs = []
    for name, g, r, tol, ne in zip(("dq", "dk", "dv"), grads, g_ref, tols, naive):
        assert tuple(g.shape) == tuple(r.shape), f"{where} {name} shape {g.shape} != {r.shape}"
        want = "bfloat16" if dtype == "bfloat16" else np.dtype(dtype).name
        assert g.dtype.name == want, f"{where} {name} dtype {g.dtype} != {want}"
        h = to_host64(g)
        nan = np.isnan(h)
        if nan.any():
            idx = tuple(int(i) for i in np.argwhere(nan)[0])
            rows = np.unique(np.argwhere(nan)[:, -2])
            raise AssertionError(f"{where} {name}: {int(nan.sum())} of {h.size} elements NaN "
                                 f"(unwritten?), first at {idx}; rows {rows[:10].tolist()}"
                                 f"{'...' if rows.size > 10 else ''}")
        diff = np.abs(h - r)
        err = float(diff.max())
        if not err <= tol:
            idx = tuple(int(i) for i in np.unravel_index(int(np.argmax(diff)), diff.shape))
            bad_rows = np.unique(np.argwhere(diff > tol)[:, -2])
            raise AssertionError(
                f"{where} {name}: max abs error {err:.3e} > threshold {tol:.3e} (naive "
                f"{dtype} backward {ne:.3e}) at {idx}: got {h[idx]:.6g}, expected {r[idx]:.6g}; "
                f"{int((diff > tol).sum())} elements over, rows {bad_rows[:10].tolist()}"
                f"{'...' if bad_rows.size > 10 else ''}")
        errs.append(err)
    return errs


def seeded_rng(seed, *key):
    """A generator for one test case: the session's `seed` (printed on failure) and the case's
    parameters."""
    from seeds import case_rng

    return case_rng(seed, *key)


def skip_unsupported_dtype(dtype):
    """pytest.skip for bfloat16 when ml_dtypes (CuPy's bfloat16 dtype) is missing."""
    import pytest

    if dtype == "bfloat16" and bf16_dtype() is None:
        pytest.skip("bfloat16 on the GPU needs ml_dtypes (CuPy's bfloat16 dtype)")


def check_variant_case(q, k, v, qg, kg, vg, kw, dkw, *, causal, dtype, rng, seed,
                       kernel="generic", bwd_kernel=None, deterministic=False):
    """One attention variant (built-in parts or user hooks) on the GPU against the float64
    references: the forward with `kernel` ("generic" or "tensorcore", asserted through
    dispatch_info) into NaN-poisoned o and lse under `pass_threshold` (and the lse rule
    of `check_against_reference`), then the backward (dbias too when `kw` has a bias) into
    poisoned buffers under `grad_pass_threshold`, from that forward's o and lse, with
    `bwd_kernel` ("generic" or "tensorcore", asserted through backward_dispatch_info; None: the
    forward's kernel where the tensor-core backward takes the dtype, D and the hooks, else
    "generic") and
    `deterministic` (then a second backward must equal the first bit for bit). `kw` holds the
    variant as NumPy arrays (for the references), `dkw` on the device. Returns (dispatch label,
    o on the host, lse on the host)."""
    import cuflash

    cp = cupy()
    batch, sq, dv = q.shape[:-2], q.shape[-2], v.shape[-1]
    label = cuflash.dispatch_info(qg, kg, vg, causal=causal, kernel=kernel, **dkw)
    assert label.startswith(f"{kernel}<"), label
    o = poisoned(batch + (sq, dv), dtype)
    lse = poisoned(batch + (sq,), "float32")
    cuflash.attention(qg, kg, vg, causal=causal, return_lse=True, out=(o, lse), kernel=kernel,
                      **dkw)
    rule = reference.pass_threshold(q, k, v, causal=causal, dtype=dtype, **kw)
    verdict = rule.judge(to_host64(o))
    assert verdict.passed, (seed, label, verdict.reasons)
    _, lse_ref = reference.attention_ref(q, k, v, causal=causal, **kw)
    lse_h = cp.asnumpy(lse).astype(np.float64)
    assert np.array_equal(np.isneginf(lse_h), np.isneginf(lse_ref)), seed
    fin = np.isfinite(lse_ref)
    # the lse rule of check_against_reference: |error| <= 1e-4 + 1e-5 |lse_ref|
    assert np.all(np.abs(lse_h[fin] - lse_ref[fin]) <= 1e-4 + 1e-5 * np.abs(lse_ref[fin])), seed

    do = reference.round_to(rng.standard_normal(batch + (sq, dv)), dtype)
    with_bias = kw.get("bias") is not None
    if bwd_kernel is None:   # the tensor-core backward: 16-bit, D <= 128 (TC_BWD_CONFIGS), with
        # user hooks D <= TC_BWD_HOOK_MAX_D (beyond, the dispatcher refuses kernel="tensorcore")
        from cuflash._dispatch_variants import TC_BWD_HOOK_MAX_D
        hooks = kw.get("score_mod") is not None or kw.get("mask_mod") is not None
        tc = (kernel == "tensorcore" and dtype in ("float16", "bfloat16")
              and q.shape[-1] <= (TC_BWD_HOOK_MAX_D if hooks else 128))
        bwd_kernel = "tensorcore" if tc else "generic"
    dog = to_gpu(do, dtype)
    blabel = cuflash.backward_dispatch_info(dog, qg, kg, vg, o, lse, causal=causal,
                                            deterministic=deterministic, kernel=bwd_kernel,
                                            return_dbias=with_bias, **dkw)
    assert blabel.startswith(f"{bwd_kernel}-bwd<"), blabel

    def backward():
        outs = tuple(poisoned(x.shape, dtype) for x in (qg, kg, vg))
        return cuflash.attention_backward(dog, qg, kg, vg, o, lse, causal=causal, out=outs,
                                          return_dbias=with_bias, kernel=bwd_kernel,
                                          deterministic=deterministic, **dkw)

    grads = backward()
    if deterministic:
        again = backward()
        for gname, a, b in zip(("dq", "dk", "dv", "dbias"), grads, again):
            assert cp.array_equal(a, b, equal_nan=True), (gname, blabel, seed)
    ref = reference.attention_backward_ref(do, q, k, v, causal=causal, return_dbias=with_bias,
                                           **kw)
    tols, _ = reference.grad_pass_threshold(do, q, k, v, causal=causal, dtype=dtype, ref=ref,
                                            return_dbias=with_bias, **kw)
    assert len(grads) == len(ref)
    for gname, g, r, t in zip(("dq", "dk", "dv", "dbias"), grads, ref, tols):
        g = to_host64(g)
        assert g.shape == r.shape, gname
        assert np.isfinite(g).all(), (gname, seed)
        err = float(np.abs(g - r).max())
        assert err <= t, f"{gname}: {err:.3g} > {t:.3g} ({label}, {blabel}, seed {seed})"
    return label, to_host64(o), lse_h
