"""benchmarks/bench_variants.py's --impl forms: a form's dispatcher flags are restored after its
row, also when the form's context is entered again inside itself (the timed backward runs inside
the check's `with`). The H200 run of 2026-12-03 (session j) printed `fused-scale` on "base" rows
after the first fused row: the inner entry had overwritten the saved values."""
import pytest

from cuflash import _dispatch_variants as DV

from conftest import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_variants")


@pytest.mark.parametrize("impl", ["fused", "fma-rcp+fused", "affine", "affine+fused",
                                  "hopperbwd"])
def test_nested_form_context_restores_the_flags(bench, impl, monkeypatch):
    flags = bench.IMPLS[impl][0]
    for k in flags:
        monkeypatch.setattr(DV, k, not flags[k])
    before = {k: getattr(DV, k) for k in flags}
    ctx = bench.impl_flags(impl)
    with ctx:
        assert {k: getattr(DV, k) for k in flags} == flags
        with ctx:
            assert {k: getattr(DV, k) for k in flags} == flags
        assert {k: getattr(DV, k) for k in flags} == flags
    assert {k: getattr(DV, k) for k in flags} == before


def test_every_form_sets_existing_flags(bench):
    """A form's flags exist (_dispatch_variants' own, or ``module.attr`` of cuflash; a misspelt
    one would set a new attribute and time the base form under the form's name)."""
    for impl, (flags, _) in bench.IMPLS.items():
        for k in flags:
            mod, attr = bench._flag_home(k)
            assert hasattr(mod, attr) and isinstance(getattr(mod, attr), bool), (impl, k)
    assert bench.IMPLS["noblocks"][0] == {"_mask_blocks.ENABLED": False}
    from cuflash import _mask_blocks
    with bench.impl_flags("noblocks"):
        assert _mask_blocks.ENABLED is False
    assert _mask_blocks.ENABLED is True
    assert bench.IMPLS["hopperbwd"][0] == {"HOPPER_BWD_VARIANTS": True}
    assert bench.IMPLS["mmabwd"][0] == {"HOPPER_BWD_VARIANTS": False}


def _hook_kwargs_on_host(bench, name, h, s, window, monkeypatch):
    import types

    import numpy as np
    cupy = pytest.importorskip("cupy")
    monkeypatch.setattr(cupy, "asarray", np.asarray)   # no GPU here: the args stay NumPy
    return bench.hook_kwargs(name, h, s, types.SimpleNamespace(window=window))


@pytest.mark.parametrize("causal", [False, True])
def test_hook_rows_are_the_builtin_variants_they_stand_for(bench, causal, monkeypatch):
    """The user-hook rows' NumPy forms give what the built-in ALiBi and window give (the
    expressions FlexAttention gets are the same), on a problem whose first rows cross the
    document boundaries `doc_ids` puts at 100 and 200."""
    import numpy as np

    from cuflash import reference as R
    h, s, left = 3, 260, 37
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((1, h, s, 16)) for _ in range(3))
    al = _hook_kwargs_on_host(bench, "mod-alibi", h, s, left, monkeypatch)
    np.testing.assert_array_equal(
        R.attention_ref(q, k, v, causal=causal, **al)[0],
        R.attention_ref(q, k, v, causal=causal, alibi_slopes=al["mod_args"])[0])
    win = _hook_kwargs_on_host(bench, "mod-window", h, s, left, monkeypatch)
    np.testing.assert_array_equal(R.attention_ref(q, k, v, causal=causal, **win)[0],
                                  R.attention_ref(q, k, v, causal=causal, window=(left, -1))[0])
    doc = _hook_kwargs_on_host(bench, "mod-document", h, s, left, monkeypatch)
    ids = doc["mod_args"]
    assert list(ids[[0, 99, 100, 199, 200]]) == [0, 0, 1, 1, 2]
    np.testing.assert_array_equal(
        R.attention_ref(q, k, v, causal=causal, **doc)[0],
        R.attention_ref(q, k, v, causal=causal, mask=ids[:, None] == ids[None, :])[0])


def test_hook_rows_check_their_first_rows(bench):
    """A hook sees the rows' own q_idx, so its check takes the first rows (keys [0, r1) under
    causal); the built-in variants keep the last rows with every key."""
    assert bench._checked_rows({"mask_mod": 1}, 4096, 4096, True, 256) == (0, 256, 256)
    assert bench._checked_rows({"score_mod": 1}, 4096, 4096, False, 256) == (0, 256, 4096)
    assert bench._checked_rows({"window": (1, 0)}, 4096, 4096, True, 256) == (3840, 4096, 4096)


def test_a_slice_reference_sees_the_slice_heads_hook(bench, monkeypatch):
    """The check's (bi, hi) slice is a (1, 1) batch: a hook that reads args[h] must see head hi
    there (the H100 run of session r failed both cuflash and FlexAttention on slice (1, 15) of
    ALiBi as score_mod, whose reference had used head 0's slope)."""
    import numpy as np

    from cuflash import reference as R
    h, s = 4, 50
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((2, h, s, 16)) for _ in range(3))
    kw = _hook_kwargs_on_host(bench, "mod-alibi", h, s, 8, monkeypatch)
    full = R.attention_ref(q, k, v, causal=True, **kw)[0]
    sub = dict(kw, score_mod=bench._shifted_hook(kw["score_mod"], 1, 3))
    part = R.attention_ref(q[1:2, 3:4], k[1:2, 3:4], v[1:2, 3:4], causal=True, **sub)[0]
    np.testing.assert_array_equal(part, full[1:2, 3:4])
    plain = R.attention_ref(q[1:2, 3:4], k[1:2, 3:4], v[1:2, 3:4], causal=True, **kw)[0]
    assert not np.array_equal(plain, full[1:2, 3:4])
