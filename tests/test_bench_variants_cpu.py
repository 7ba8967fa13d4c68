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
