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
    """A form's flags are _dispatch_variants' own (a misspelt one would set a new attribute and
    time the base form under the form's name)."""
    for impl, (flags, _) in bench.IMPLS.items():
        assert all(hasattr(DV, k) and isinstance(getattr(DV, k), bool) for k in flags), impl
    assert bench.IMPLS["hopperbwd"][0] == {"HOPPER_BWD_VARIANTS": True}
    assert bench.IMPLS["mmabwd"][0] == {"HOPPER_BWD_VARIANTS": False}
