"""User hooks (score_mod / mask_mod, cuflash/mods.py) on the CPU: the NumPy path against the
float64 references forward and backward under the project's pass rule, hooks against the
built-in variants they restate (a tanh softcap, a bias tensor, a mask tensor: the same numbers),
rows left without keys, the checks and their messages, and NVRTC's errors mapped to the user's
line (the launch parameters: tests/test_variants_launch.py)."""
import numpy as np
import pytest

import cuflash
from cuflash import MaskMod, ScoreMod
from cuflash import reference as R
from cuflash.mods import HookCompileError, check_compiles, example_hooks

from test_callcache import FakeArray, fake  # noqa: F401  (the stand-in CuPy fixture)

EX = example_hooks()
B, H = 2, 3
SHAPES = [(7, 7), (33, 45), (45, 33), (1, 20)]


def _inputs(rng, sq, sk, d=16, dtype="float32", batch=(B, H)):
    npdt = np.float64 if dtype == "float64" else np.float32
    q, k, v = (R.round_to(rng.standard_normal(batch + (n, d)), dtype).astype(npdt)
               for n in (sq, sk, sk))
    do = R.round_to(rng.standard_normal(batch + (sq, d)), dtype).astype(npdt)
    return q, k, v, do


def _check_fwd_bwd(q, k, v, do, causal, dtype, **kw):
    """The CPU path under the pass rule, forward (o, lse) and backward; returns (o, lse, grads)."""
    o, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True, **kw)
    rule = R.pass_threshold(q, k, v, causal=causal, dtype=dtype, **kw)
    verdict = rule.judge(o)
    assert verdict.passed, verdict.reasons
    _, lse_ref = R.attention_ref(q, k, v, causal=causal, **kw)
    assert np.array_equal(np.isneginf(lse), np.isneginf(lse_ref))
    fin = np.isfinite(lse_ref)
    assert np.all(np.abs(lse[fin] - lse_ref[fin]) <= 1e-4 + 1e-5 * np.abs(lse_ref[fin]))
    grads = cuflash.attention_backward(do, q, k, v, o, lse, causal=causal, **kw)
    ref = R.attention_backward_ref(do, q, k, v, causal=causal, **kw)
    tols, _ = R.grad_pass_threshold(do, q, k, v, causal=causal, dtype=dtype, ref=ref, **kw)
    for name, g, r, t in zip(("dq", "dk", "dv"), grads, ref, tols):
        assert np.isfinite(g).all(), name
        err = float(np.abs(g.astype(np.float64) - r).max())
        assert err <= t, f"{name}: {err:.3g} > {t:.3g}"
    return o, lse, grads


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", SHAPES)
def test_tanh_cap_as_score_mod_is_the_builtin_softcap(sq, sk, causal, dtype):
    rng = np.random.default_rng([sq, sk, causal, len(dtype)])
    q, k, v, do = _inputs(rng, sq, sk, dtype=dtype)
    q = q * 3   # scores well into the cap
    o1, l1, g1 = _check_fwd_bwd(q, k, v, do, causal, dtype, score_mod=EX["tanh_cap"])
    o2, l2 = cuflash.attention(q, k, v, causal=causal, return_lse=True, softcap=2.0)
    # the same arithmetic in the same order: the same numbers
    assert np.array_equal(o1, o2) and np.array_equal(l1, l2)
    g2 = cuflash.attention_backward(do, q, k, v, o2, l2, causal=causal, softcap=2.0)
    assert all(np.array_equal(a, b) for a, b in zip(g1, g2))
    r1 = R.attention_ref(q, k, v, causal=causal, score_mod=EX["tanh_cap"])
    r2 = R.attention_ref(q, k, v, causal=causal, softcap=2.0)
    assert all(np.array_equal(a, b) for a, b in zip(r1, r2))
    b1 = R.attention_backward_ref(do, q, k, v, causal=causal, score_mod=EX["tanh_cap"])
    b2 = R.attention_backward_ref(do, q, k, v, causal=causal, softcap=2.0)
    assert all(np.allclose(a, b, rtol=1e-13, atol=1e-14) for a, b in zip(b1, b2))


def _rel_table(rng):
    return rng.standard_normal(H * 16).astype(np.float32)


def _rel_bias_tensor(table, sq, sk):
    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    return table.reshape(H, 16)[:, np.clip(j - i + 8, 0, 15)]     # (H, Sq, Sk)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", SHAPES)
def test_relative_position_bias(sq, sk, causal):
    rng = np.random.default_rng([sq, sk, causal, 7])
    q, k, v, do = _inputs(rng, sq, sk)
    table = _rel_table(rng)
    kw = dict(score_mod=EX["rel_bias"], mod_args=table)
    o, lse, grads = _check_fwd_bwd(q, k, v, do, causal, "float32", **kw)
    bias = _rel_bias_tensor(table, sq, sk)
    ref_h = R.attention_ref(q, k, v, causal=causal, **kw)
    ref_b = R.attention_ref(q, k, v, causal=causal, bias=bias)
    assert all(np.allclose(a, b, rtol=1e-13, atol=1e-13) for a, b in zip(ref_h, ref_b))
    gb = cuflash.attention_backward(do, q, k, v, o, lse, causal=causal, bias=bias)
    assert all(np.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(grads, gb))


def test_score_mod_gradient_against_finite_differences():
    """The user's derivative enters the reference backward correctly (float64, small case)."""
    rng = np.random.default_rng(3)
    q, k, v, do = _inputs(rng, 5, 6, d=4, dtype="float64", batch=(1, 2))
    q *= 2
    mod = ScoreMod("score * score / 4 + args[h] * score",
                   numpy=lambda s, b, h, qi, kj, a: s * s / 4 + a[h] * s,
                   grad_cuda="score / 2 + args[h]",
                   grad_numpy=lambda s, b, h, qi, kj, a: s / 2 + a[h])
    kw = dict(score_mod=mod, mod_args=np.array([0.5, -1.0], np.float32), window=(3, 1))
    ref = R.attention_backward_ref(do, q, k, v, **kw)
    fd = R.attention_backward_fd(do, q, k, v, **kw)
    for a, b in zip(ref, fd):
        assert np.allclose(a, b, rtol=1e-6, atol=1e-8)
    got = cuflash.attention_backward(do, q, k, v, *cuflash.attention(q, k, v, return_lse=True,
                                                                      **kw), **kw)
    for a, b in zip(got, ref):
        assert np.allclose(a, b, rtol=1e-9, atol=1e-11)


def test_b_and_h_index_the_batch():
    """h: the last batch axis, b: the flat index over the axes before it."""
    rng = np.random.default_rng(5)
    batch = (2, 2, 3)
    q, k, v, do = _inputs(rng, 9, 11, batch=batch)
    args = rng.standard_normal(3 + 4).astype(np.float32)
    mod = ScoreMod.additive("score + args[h] + 2 * args[3 + b]",
                            lambda s, b, h, qi, kj, a: s + a[h] + 2 * a[3 + b])
    bias = (args[:3][None, None, :] + 2 * args[3:].reshape(2, 2)[:, :, None])[..., None, None]
    got = cuflash.attention(q, k, v, score_mod=mod, mod_args=args)
    ref = R.attention_ref(q, k, v, bias=np.broadcast_to(bias, batch + (1, 1)).astype(np.float64))
    assert np.allclose(got, ref[0], atol=1e-5)
    assert np.allclose(R.attention_ref(q, k, v, score_mod=mod, mod_args=args)[0], ref[0],
                       atol=1e-13)


def _doc_ids(n, rng):
    cuts = np.sort(rng.choice(np.arange(1, n), size=min(3, n - 1), replace=False)) if n > 1 \
        else []
    ids = np.zeros(n, np.float32)
    for c in cuts:
        ids[c:] += 1
    return ids


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", SHAPES)
def test_document_mask(sq, sk, causal):
    rng = np.random.default_rng([sq, sk, causal, 11])
    q, k, v, do = _inputs(rng, sq, sk)
    ids = _doc_ids(max(sq, sk), rng)
    kw = dict(mask_mod=EX["document"], mod_args=ids)
    o, lse, grads = _check_fwd_bwd(q, k, v, do, causal, "float32", **kw)
    mask = ids[:sq, None] == ids[None, :sk]
    o2, l2 = cuflash.attention(q, k, v, causal=causal, return_lse=True, mask=mask)
    assert np.array_equal(o, o2) and np.array_equal(lse, l2)
    g2 = cuflash.attention_backward(do, q, k, v, o2, l2, causal=causal, mask=mask)
    assert all(np.array_equal(a, b) for a, b in zip(grads, g2))


@pytest.mark.parametrize("sq,sk", [(40, 40), (30, 50), (1, 20)])
def test_prefix_lm_mask(sq, sk):
    rng = np.random.default_rng([sq, sk, 13])
    q, k, v, do = _inputs(rng, sq, sk)
    o, _, _ = _check_fwd_bwd(q, k, v, do, False, "float32", mask_mod=EX["prefix_lm"])
    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    ref = R.attention_ref(q, k, v, mask=(j < 16) | (j <= i))[0]
    assert np.allclose(o, ref, atol=1e-5)


def test_rows_without_keys_give_zero_and_no_nan():
    rng = np.random.default_rng(17)
    q, k, v, do = _inputs(rng, 12, 10)
    none_for_odd = MaskMod("q_idx % 2 == 0 && kv_idx <= q_idx",
                           numpy=lambda b, h, qi, kj, a: (qi % 2 == 0) & (kj <= qi))
    kw = dict(mask_mod=none_for_odd, score_mod=EX["tanh_cap"])
    o, lse, grads = _check_fwd_bwd(q, k, v, do, False, "float32", **kw)
    assert np.all(o[..., 1::2, :] == 0) and np.all(np.isneginf(lse[..., 1::2]))
    assert np.all(grads[0][..., 1::2, :] == 0)
    assert all(np.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("causal", [False, True])
def test_hooks_compose_with_builtin_parts(causal):
    rng = np.random.default_rng([19, causal])
    sq = sk = 41
    q, k, v, do = _inputs(rng, sq, sk)
    kw = dict(window=(9, 4), alibi_slopes=rng.uniform(0.05, 0.3, (H,)).astype(np.float32),
              bias=rng.standard_normal((1, sk)).astype(np.float32), score_mod=EX["tanh_cap"],
              mask_mod=EX["document"], mod_args=_doc_ids(sk, rng))
    _check_fwd_bwd(q, k, v, do, causal, "float32", **kw)


# ---- checks and messages ----------------------------------------------------------------

def _small():
    x = np.random.default_rng(0).standard_normal((1, 2, 4, 8)).astype(np.float32)
    return x, x, x


@pytest.mark.parametrize("code,match", [
    ("score; } __global__ void f() {", "__global__"),
    ("score; } int x = 0; {", "unbalanced"),
    ("#define X 1", "preprocessor"),
    ("score /* c */", "block comments"),
    ('score + "a"', "string literals"),
    ("__shfl_sync(0xffffffff, score, 0)", "warp-synchronous"),
    ("asm volatile(score)", "asm"),
    ("Acc t = score; t += 1;", "return statement"),
    ("(score", "unclosed"),
    ("", "empty"),
    # block-wide barriers in divergent code hang the block (they compiled before)
    ("__syncthreads_count(1) ? score : score", "barriers"),
    ("__syncthreads_or(q_idx > 3) ? score : score", "barriers"),
    # NVRTC reads the source up to a NUL: the rest of the generated struct was cut off
    ("score\0 + 1", "control characters"),
    # writing through args (the user's table, read by every thread) dropped its const
    ("((float*)args)[0] = score; return score;", "pointer casts"),
    ("*(float * const)args = 1; return score;", "pointer casts"),
])
def test_bad_code_is_refused_before_nvrtc(code, match):
    with pytest.raises(ValueError, match=match):
        ScoreMod(code, numpy=lambda s, *r: s)


def test_hook_types_and_grad_pairs():
    with pytest.raises(TypeError, match="string"):
        ScoreMod(lambda s: s, numpy=lambda s, *r: s)
    with pytest.raises(TypeError, match="callable"):
        MaskMod("true", numpy="true")
    with pytest.raises(ValueError, match="both"):
        ScoreMod("score", numpy=lambda s, *r: s, grad_cuda="1")
    with pytest.raises(ValueError, match="lipschitz"):
        ScoreMod("score", numpy=lambda s, *r: s, lipschitz=-1)
    q, k, v = _small()
    with pytest.raises(TypeError, match="cuflash.ScoreMod"):
        cuflash.attention(q, k, v, score_mod="score + 1")
    with pytest.raises(TypeError, match="cuflash.MaskMod"):
        cuflash.attention(q, k, v, mask_mod=EX["tanh_cap"])


def test_mod_args_checks():
    q, k, v = _small()
    with pytest.raises(ValueError, match="without score_mod"):
        cuflash.attention(q, k, v, mod_args=np.zeros(3, np.float32))
    with pytest.raises(TypeError, match="1-D float32"):
        cuflash.attention(q, k, v, score_mod=EX["rel_bias"], mod_args=np.zeros(3))
    with pytest.raises(TypeError, match="1-D float32"):
        cuflash.attention(q, k, v, score_mod=EX["rel_bias"],
                          mod_args=np.zeros((2, 3), np.float32))


def test_numpy_callable_results_are_checked():
    q, k, v = _small()
    wrong_shape = ScoreMod("score", numpy=lambda s, *r: s[..., :1, :1, None])
    with pytest.raises(ValueError, match="does not broadcast"):
        cuflash.attention(q, k, v, score_mod=wrong_shape)
    narrow = ScoreMod("score", numpy=lambda s, *r: s.astype(np.float16))
    with pytest.raises(TypeError, match="scores' dtype"):
        cuflash.attention(q, k, v, score_mod=narrow)
    with pytest.raises(TypeError, match="scores' dtype"):   # float32 result for float64 scores
        R.attention_ref(q, k, v, score_mod=ScoreMod("score",
                                                    numpy=lambda s, *r: s.astype(np.float32)))
    not_bool = MaskMod("kv_idx <= q_idx", numpy=lambda b, h, qi, kj, a: (kj <= qi).astype(int))
    with pytest.raises(TypeError, match="bool"):
        cuflash.attention(q, k, v, mask_mod=not_bool)


def test_backward_needs_the_derivative():
    q, k, v = _small()
    nograd = ScoreMod("score * 2", numpy=lambda s, *r: s * 2)
    o, lse = cuflash.attention(q, k, v, score_mod=nograd, return_lse=True)
    with pytest.raises(ValueError, match="derivative of score_mod"):
        cuflash.attention_backward(q, q, k, v, o, lse, score_mod=nograd)
    with pytest.raises(ValueError, match="derivative of score_mod"):
        R.attention_backward_ref(q, q, k, v, score_mod=nograd)
    with pytest.raises(ValueError, match="derivative of score_mod"):
        R.naive_attention_backward(q, q, k, v, dtype="float32", score_mod=nograd)


def test_pass_rule_without_lipschitz():
    """No declared Lipschitz constant: no a-priori bound; the measured rule alone for float32
    (it still catches a wrong result), refused for float64; never a silent pass."""
    rng = np.random.default_rng(23)
    q, k, v, _ = _inputs(rng, 20, 24)
    mod = ScoreMod("score * 2", numpy=lambda s, *r: s * 2)
    with pytest.raises(ValueError, match="lipschitz"):
        R.error_bound(q, k, v, dtype="float32", score_mod=mod)
    rule = R.pass_threshold(q, k, v, dtype="float32", score_mod=mod)
    o = cuflash.attention(q, k, v, score_mod=mod)
    assert rule.judge(o).passed
    assert not rule.judge(cuflash.attention(q, k, v, softcap=1.0)).passed
    with pytest.raises(ValueError, match="lipschitz"):
        R.pass_threshold(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                         dtype="float64", score_mod=mod)
    declared = ScoreMod("score * 2", numpy=lambda s, *r: s * 2, lipschitz=2.0)
    rule = R.pass_threshold(q, k, v, dtype="float32", score_mod=declared)
    assert rule.judge(o).passed and np.isfinite(rule.bound).all()


def test_fast_kernels_refuse_and_name_the_hook():
    from types import SimpleNamespace

    from cuflash._dispatch_variants import variant_backward_plan_for, variant_plan_for
    from cuflash.variants import Variant

    var = Variant(score_mod=EX["tanh_cap"], mask_mod=EX["document"], mod_batch=(2, 3))
    for kern in ("tensorcore", "hopper"):
        prob = SimpleNamespace(kernel=kern, variant=var, dtype_name="float16", d=64, dv=64,
                               causal=False)
        with pytest.raises(ValueError, match="score_mod and mask_mod"):
            variant_backward_plan_for(prob)
    prob.kernel = "decode"   # no policy in this forward family yet (the Hopper forward has one)
    with pytest.raises(ValueError, match="kernel='decode'.*score_mod and mask_mod"):
        variant_plan_for(prob, 90)
    window = SimpleNamespace(kernel="decode", variant=Variant(left=16, right=0),
                             dtype_name="float16", d=64, dv=64, causal=False)
    with pytest.raises(ValueError, match=r"kernel='decode'.*attention variant \(.*window"):
        variant_plan_for(window, 90)
    prob.kernel = "tensorcore"   # no GPU described (compute capability None): refused, with why
    with pytest.raises(ValueError, match=r"score_mod\[.*compute capability 8.0"):
        variant_plan_for(prob)
    prob = SimpleNamespace(kernel="auto", variant=var, dtype_name="float16", d=64, dv=64,
                           causal=True)
    plan = variant_plan_for(prob)   # no GPU described: the generic kernels, saying why
    assert plan.label.startswith("generic<") and "tensor-core kernel cannot" in plan.label
    assert "cuflash::UserVariant<cuflash::Variant<false, false, false, cuflash::NoBias, false>, " \
           "cuflash_user::Mod_" in plan.spec.name
    assert f"score_mod[{EX['tanh_cap'].digest[:8]}]" in plan.label
    assert "struct Mod_" in plan.spec.extra_source and EX["tanh_cap"].cuda in \
        plan.spec.extra_source


def test_specialisation_is_keyed_by_the_code():
    from cuflash._dispatch_variants import generic_variant_plan
    from cuflash.variants import Variant

    def spec(mod):
        return generic_variant_plan("float32", 64, 64, False, Variant(score_mod=mod)).spec

    a = ScoreMod("score + 1", numpy=lambda s, *r: s + 1)
    a2 = ScoreMod("score + 1", numpy=lambda s, *r: s + 1)
    b = ScoreMod("score + 2", numpy=lambda s, *r: s + 2)
    assert spec(a) == spec(a2)
    assert spec(a).name != spec(b).name and spec(a).extra_source != spec(b).extra_source


def _nvrtc_or_skip():
    try:
        from cuflash._compile import _nvrtc
        _nvrtc()
    except Exception as exc:  # pragma: no cover - depends on the machine
        pytest.skip(f"NVRTC not available: {exc}")


def test_nvrtc_errors_show_the_users_line():
    _nvrtc_or_skip()
    check_compiles(EX["tanh_cap"], EX["document"])      # the examples compile
    bad = ScoreMod("Acc t = score;\nreturn t + undefined_thing(q_idx);",
                   numpy=lambda s, *r: s)
    with pytest.raises(HookCompileError) as err:
        check_compiles(bad, None)
    msg = str(err.value)
    assert "score_mod, line 2" in msg and "undefined_thing" in msg
    assert "return t + undefined_thing(q_idx);" in msg and "NVRTC's log" in msg
    badm = MaskMod("kv_idx <= q_idx && nope", numpy=lambda *a: True)
    with pytest.raises(HookCompileError, match="mask_mod, line 1"):
        check_compiles(None, badm)


def test_grouped_query_heads_with_hooks_are_refused():
    rng = np.random.default_rng(29)
    q = rng.standard_normal((1, 4, 6, 8)).astype(np.float32)
    k = rng.standard_normal((1, 2, 6, 8)).astype(np.float32)
    with pytest.raises(ValueError, match="grouped-query"):
        cuflash.attention(q, k, k, score_mod=EX["tanh_cap"])
    with pytest.raises(ValueError, match="grouped-query"):
        R.attention_ref(q, k, k, mask_mod=EX["prefix_lm"])


def test_dbias_under_a_score_mod_is_refused():
    q, k, v = _small()
    bias = np.zeros((4, 4), np.float32)
    o, lse = cuflash.attention(q, k, v, bias=bias, score_mod=EX["tanh_cap"], return_lse=True)
    with pytest.raises(ValueError, match="return_dbias=True cannot be combined with score_mod"):
        cuflash.attention_backward(q, q, k, v, o, lse, bias=bias, score_mod=EX["tanh_cap"],
                                   return_dbias=True)
    with pytest.raises(ValueError, match="return_dbias=True cannot be combined with score_mod"):
        R.attention_backward_ref(q, q, k, v, bias=bias, score_mod=EX["tanh_cap"],
                                 return_dbias=True)
    # without dbias, bias and score_mod combine
    g = cuflash.attention_backward(q, q, k, v, o, lse, bias=bias, score_mod=EX["tanh_cap"])
    assert all(np.isfinite(x).all() for x in g)


def test_expression_with_a_trailing_comment_and_read_only_scores():
    _nvrtc_or_skip()
    mod = ScoreMod("score * 2  // doubled", numpy=lambda s, *r: s * 2)
    check_compiles(mod, None)
    q, k, v = _small()
    inplace = ScoreMod("score * 2", numpy=lambda s, *r: s.__imul__(2))
    with pytest.raises(ValueError, match="read-only"):
        cuflash.attention(q, k, v, score_mod=inplace)


# ---- review r7: hooks' checks up front ---------------------------------------------------

def test_numpy_callables_with_the_wrong_signature_are_refused_at_construction():
    """Before: accepted, then a bare TypeError from the first tile that named no hook."""
    with pytest.raises(TypeError, match=r"score_mod's numpy must take the 6 positional "
                                        r"arguments \(score, b, h, q_idx, kv_idx, args\)"):
        ScoreMod("score", numpy=lambda s: s)
    with pytest.raises(TypeError, match="score_mod's grad_numpy must take the 6"):
        ScoreMod("score", numpy=lambda s, *r: s, grad_cuda="1", grad_numpy=lambda s, b: 1.0)
    with pytest.raises(TypeError, match=r"mask_mod's numpy must take the 5 positional "
                                        r"arguments \(b, h, q_idx, kv_idx, args\)"):
        MaskMod("true", numpy=lambda s, b, h, qi, kj, a: True)   # a score_mod's signature
    # defaults, *args and objects whose signature Python cannot read are accepted
    ScoreMod("score", numpy=lambda s, b, h, qi, kj, a, extra=1: s)
    MaskMod("true", numpy=lambda *r: True)


def test_a_hook_reading_args_needs_mod_args():
    """Before: the CPU path raised a bare IndexError from inside the NumPy callable, and the GPU
    kernels read through the null (or empty) args pointer."""
    q, k, v = _small()
    for kw in (dict(score_mod=EX["rel_bias"]), dict(mask_mod=EX["document"])):
        name = next(iter(kw))
        with pytest.raises(ValueError, match=f"{name}'s CUDA code reads args but mod_args is "
                                             "not given"):
            cuflash.attention(q, k, v, **kw)
        with pytest.raises(ValueError, match="mod_args is empty"):
            cuflash.attention(q, k, v, mod_args=np.zeros(0, np.float32), **kw)
        with pytest.raises(ValueError, match="reads args"):
            R.attention_ref(q, k, v, **kw)
        with pytest.raises(ValueError, match="reads args"):
            cuflash.dispatch_info(q, k, v, **kw)
    o, lse = cuflash.attention(q, k, v, score_mod=EX["tanh_cap"], return_lse=True)
    with pytest.raises(ValueError, match="reads args"):   # the derivative's code counts too
        grad_reads = ScoreMod("score * 2", numpy=lambda s, *r: s * 2,
                              grad_cuda="Acc(2) + args[0] * 0",
                              grad_numpy=lambda s, b, h, qi, kj, a: 2 + a[0] * 0)
        cuflash.attention_backward(q, q, k, v, o, lse, score_mod=grad_reads)
    # a comment that names args is not a read; hooks that read nothing need no mod_args
    ScoreMod("score * 2  // no args here", numpy=lambda s, *r: s * 2)
    assert not ScoreMod("score * 2  // args", numpy=lambda s, *r: s * 2).reads_args
    assert not EX["tanh_cap"].reads_args and not EX["prefix_lm"].reads_args
    assert EX["rel_bias"].reads_args and EX["document"].reads_args


def test_hooks_are_immutable():
    """Before: assigning ``cuda`` after construction skipped every check of the text (the
    struct took it verbatim: it could close the function and declare a kernel)."""
    mod = ScoreMod("score * 2", numpy=lambda s, *r: s * 2)
    for name, value in (("cuda", "return score; } __global__ void f() {"),
                        ("numpy", lambda s, *r: s), ("lipschitz", -1.0), ("grad_cuda", "1")):
        with pytest.raises(AttributeError, match="immutable"):
            setattr(mod, name, value)
    with pytest.raises(AttributeError, match="immutable"):
        del mod.cuda
    mask = MaskMod("kv_idx <= q_idx", numpy=lambda b, h, qi, kj, a: kj <= qi)
    with pytest.raises(AttributeError, match="immutable"):
        mask.cuda = "true"
    assert mod.cuda == "return (score * 2\n);" and mask.cuda == "return (kv_idx <= q_idx\n);"


@pytest.mark.parametrize("code", ["score * 2  // halved; then doubled", "score * 2  // {x}",
                                  "score * 2  // return it"])
def test_comments_do_not_make_an_expression_a_body(code):
    """Before: a ';' or '{' in a trailing comment refused the expression, and 'return' in one
    made it a body without a return."""
    mod = ScoreMod(code, numpy=lambda s, *r: s * 2)
    assert mod.cuda == f"return ({code}\n);"
    _nvrtc_or_skip()
    check_compiles(mod, None)


def test_numpy_callables_cannot_write_mod_args():
    """Before: the user's own mod_args array reached the callables writable (a callable that
    updated it in place changed it for the following tiles and for the caller)."""
    q, k, v = _small()
    table = np.arange(4, dtype=np.float32)
    writes = ScoreMod.additive("score + args[0]", lambda s, b, h, qi, kj, a: s + a.__iadd__(1)[0])
    with pytest.raises(ValueError, match="read-only"):
        cuflash.attention(q, k, v, score_mod=writes, mod_args=table)
    mwrites = MaskMod("args[0] > 0", numpy=lambda b, h, qi, kj, a: a.__imul__(0)[0] == 0)
    with pytest.raises(ValueError, match="read-only"):
        cuflash.attention(q, k, v, mask_mod=mwrites, mod_args=table)
    assert np.array_equal(table, np.arange(4, dtype=np.float32))


def test_gpu_path_refuses_bad_hooks_before_any_launch(fake):  # noqa: F811
    """The GPU host path on stand-in CuPy arrays: a hook reading args without mod_args (before:
    launched with a null args pointer) and a hook NVRTC rejects (HookCompileError naming the
    hook's line, from the checks) launch nothing; a good hook launches its UserVariant kernel."""
    q, k, v = (FakeArray((2, 3, 100, 64), ptr=(1 << 20) + i * (1 << 24)) for i in range(3))
    with pytest.raises(ValueError, match="score_mod's CUDA code reads args but mod_args is "
                                         "not given"):
        cuflash.attention(q, k, v, score_mod=EX["rel_bias"])
    with pytest.raises(ValueError, match="mask_mod's CUDA code reads args"):
        cuflash.attention(q, k, v, mask_mod=EX["document"])
    with pytest.raises(ValueError, match="mod_args is on the CPU"):
        cuflash.attention(q, k, v, mask_mod=EX["document"], mod_args=np.zeros(100, np.float32))
    with pytest.raises(TypeError, match="1-D float32"):
        cuflash.attention(q, k, v, mask_mod=EX["document"],
                          mod_args=FakeArray((100,), "float64"))
    assert fake["launches"] == []
    _nvrtc_or_skip()
    bad = ScoreMod("score + nope", numpy=lambda s, *r: s)
    with pytest.raises(HookCompileError, match="score_mod, line 1: error: identifier \"nope\""):
        cuflash.attention(q, k, v, score_mod=bad)
    assert fake["launches"] == []
    cuflash.attention(q, k, v, score_mod=EX["tanh_cap"])
    assert "cuflash_user::Mod_" in fake["launches"][-1][4]


def test_hooks_see_the_query_head_and_unaligned_indices():
    """What the docs now say: with k and v broadcasting a size-1 head axis, h is the query head;
    q_idx and kv_idx are the row's and the key's own indices with Sq != Sk (not shifted by
    Sk - Sq as causal is), so 'kv_idx <= q_idx' is the top-left diagonal."""
    rng = np.random.default_rng(31)
    q = rng.standard_normal((2, 3, 5, 8)).astype(np.float32)
    k, v = (rng.standard_normal((2, 1, 9, 8)).astype(np.float32) for _ in range(2))
    per_head = ScoreMod.additive("score + args[h]", lambda s, b, h, qi, kj, a: s + a[h])
    table = rng.standard_normal(3).astype(np.float32)
    got = cuflash.attention(q, k, v, score_mod=per_head, mod_args=table)
    bias = table.astype(np.float64)[:, None, None]                  # (H, 1, 1) over query heads
    assert np.allclose(got, R.attention_ref(q, k, v, bias=bias)[0], atol=1e-5)
    tl = MaskMod("kv_idx <= q_idx", numpy=lambda b, h, qi, kj, a: kj <= qi)
    i, j = np.arange(5)[:, None], np.arange(9)[None, :]
    o = cuflash.attention(q, k, v, mask_mod=tl)
    assert np.array_equal(o, cuflash.attention(q, k, v, mask=j <= i))
    assert not np.allclose(o, cuflash.attention(q, k, v, causal=True))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(9, 13), (13, 9)])
def test_identity_score_mod_is_plain_attention_bit_for_bit(sq, sk, causal, dtype):
    """On the CPU path the identity hook changes no arithmetic (the scale multiplies each tile
    on both paths; the hook returns its input): o, lse and the gradients are plain attention's
    bit for bit. (The tensor-core kernels scale first on their variant path, one rounding
    apart from the plain kernels' folded scale: there the pass rule judges.)"""
    rng = np.random.default_rng([sq, sk, causal, len(dtype), 37])
    q, k, v, do = _inputs(rng, sq, sk, dtype=dtype)
    ident = ScoreMod("score", numpy=lambda s, b, h, qi, kj, a: s, grad_cuda="Acc(1)",
                     grad_numpy=lambda s, b, h, qi, kj, a: 1.0, lipschitz=1.0)
    o1, l1 = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    o2, l2 = cuflash.attention(q, k, v, causal=causal, return_lse=True, score_mod=ident)
    assert np.array_equal(o1, o2) and np.array_equal(l1, l2)
    g1 = cuflash.attention_backward(do, q, k, v, o1, l1, causal=causal)
    g2 = cuflash.attention_backward(do, q, k, v, o2, l2, causal=causal, score_mod=ident)
    assert all(np.array_equal(a, b) for a, b in zip(g1, g2))
    r1 = R.attention_ref(q, k, v, causal=causal)
    r2 = R.attention_ref(q, k, v, causal=causal, score_mod=ident)
    assert all(np.array_equal(a, b) for a, b in zip(r1, r2))


@pytest.mark.parametrize("sq,sk", [(9, 13), (13, 9), (7, 7)])
def test_alibi_as_a_score_mod_with_the_offset_in_args(sq, sk):
    """ALiBi restated as a hook: the slopes and the bottom-right offset Sk - Sq come in args
    (a hook is not told Sq or Sk). The float64 references agree to rounding, the CPU path passes
    the rule forward and backward, and agrees with the built-in alibi_slopes to float32
    rounding (the hook forms slope * distance in float32, the built-in part in float64)."""
    rng = np.random.default_rng([sq, sk, 41])
    q, k, v, do = _inputs(rng, sq, sk)
    slopes = rng.uniform(0.05, 0.5, H).astype(np.float32)
    args = np.concatenate([slopes, [sk - sq]]).astype(np.float32)
    alibi = ScoreMod.additive(
        "score - args[h] * fabs(Acc(q_idx + (long long)args[3] - kv_idx))",
        lambda s, b, h, qi, kj, a: s - a[h] * np.abs(qi + a[3].astype(np.int64) - kj))
    kw = dict(score_mod=alibi, mod_args=args)
    for causal in (False, True):
        o, lse, grads = _check_fwd_bwd(q, k, v, do, causal, "float32", **kw)
        ref_h = R.attention_ref(q, k, v, causal=causal, **kw)
        ref_b = R.attention_ref(q, k, v, causal=causal, alibi_slopes=slopes)
        assert all(np.allclose(a, b, rtol=1e-12, atol=1e-12) for a, b in zip(ref_h, ref_b))
        o2, l2 = cuflash.attention(q, k, v, causal=causal, return_lse=True, alibi_slopes=slopes)
        assert np.allclose(o, o2, rtol=0, atol=1e-6) and np.allclose(lse, l2, rtol=0, atol=1e-5)
    _nvrtc_or_skip()
    check_compiles(alibi, None)


def test_a_minus_inf_bias_is_the_score_mods_input():
    """As the docs now say: the bias is part of the score_mod's input, so a -inf bias entry
    masks only where the hook keeps it -inf. The tanh cap maps it to -2: those keys stay
    visible (a row whose bias is all -inf is an average, not 0), on the CPU path and in the
    reference alike; mask= hides them whatever the hook does."""
    rng = np.random.default_rng(43)
    q, k, v, _ = _inputs(rng, 6, 6)
    bias = np.zeros((6, 6), np.float32)
    bias[:, 0] = -np.inf
    bias[1, :] = -np.inf
    cap = EX["tanh_cap"]
    o = cuflash.attention(q, k, v, bias=bias, score_mod=cap)
    assert np.allclose(o, R.attention_ref(q, k, v, bias=bias, score_mod=cap)[0], atol=1e-5)
    s = np.einsum("...id,...jd->...ij", q.astype(np.float64), k) / np.sqrt(16)
    p = np.exp(2 * np.tanh(np.where(np.isfinite(bias), s, -np.inf) / 2))   # the cap of -inf: -2
    p /= p.sum(-1, keepdims=True)
    assert np.allclose(o, p @ v, atol=1e-5)
    assert np.all(np.abs(o[..., 1, :]) > 0)
    masked = cuflash.attention(q, k, v, mask=np.isfinite(bias), score_mod=cap)
    assert np.all(masked[..., 1, :] == 0)
    assert not np.allclose(o, masked)
