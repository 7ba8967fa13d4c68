"""The Hopper forward's async O epilogue (attn_wgmma.cu: cuflash_fwd_wgmma_ao, ASYNC_O) on the
host, without a GPU: the dispatch flag `_dispatch.HOPPER_ASYNC_O` (on by default since session n) and a table
entry with `HopperTiles.async_o` select it where its staging rows fit, its plans name the kernel
of their own and say so in the label, the twins (variants, varlen) and float32 keep the direct
stores, and benchmarks/tune.py's "aO" candidates are what they say."""
import pytest

from cuflash import _dispatch, _dispatch_variants

from conftest import load_benchmark

# (padded head dim, causal, long keys) entries of HOPPER_TABLE whose tiles take the async form
FITS = {(64, False, False), (64, False, True), (64, True, False), (64, True, True),
        (128, False, False), (128, True, False), (128, True, True)}


def _plan(key, dtype="float16"):
    dpad, causal, long_keys = key
    return _dispatch.hopper_plan(dtype, dpad, causal, _dispatch.HOPPER_LONG_SK + long_keys)


def _stage_bytes(consumers, dpad):
    # attn_wgmma.cu: 16 rows of OST_PITCH = 2 DPAD + 64 bytes per consumer warp, + 128 alignment
    return 128 + 4 * consumers * 16 * (2 * dpad + 64)


def test_on_by_default_where_it_fits():
    """The default plans take the async epilogue at exactly the table entries it fits (FITS),
    the others keep the direct stores, and the compile set holds what the default dispatches."""
    from conftest import FLAGS_SET

    if FLAGS_SET:
        pytest.skip(f"flags set by --cuflash-flag: {FLAGS_SET}")
    assert _dispatch.HOPPER_ASYNC_O is True
    assert not any(t.async_o for t, _ in _dispatch.HOPPER_TABLE.values())   # the flag does it
    names = {plan.spec.name for plan in _dispatch.all_specialisations(90)}
    for key in _dispatch.HOPPER_TABLE:
        for dt in _dispatch.HOPPER_DTYPES:
            plan = _plan(key, dt)
            kern = "cuflash_fwd_wgmma_ao<" if key in FITS else "cuflash_fwd_wgmma<"
            assert plan.spec.name.startswith("cuflash::" + kern), plan.spec.name
            assert ("asyncO" in plan.label) == (key in FITS), plan.label
            assert plan.spec.name in names


@pytest.mark.parametrize("key", sorted(_dispatch.HOPPER_TABLE))
def test_flag_takes_the_async_kernel_where_it_fits(key, monkeypatch):
    monkeypatch.setattr(_dispatch, "HOPPER_ASYNC_O", False)
    off = _plan(key)
    monkeypatch.setattr(_dispatch, "HOPPER_ASYNC_O", True)
    on = _plan(key)
    cfg, _ = _dispatch.HOPPER_TABLE[key]
    assert _dispatch.hopper_async_o_fits(cfg, key[0]) == (key in FITS)
    if key in FITS:
        assert on.spec.name == off.spec.name.replace("cuflash_fwd_wgmma<",
                                                     "cuflash_fwd_wgmma_ao<"), on.spec.name
        assert on.label == off.label.replace("pingpong,", "pingpong,asyncO,"), on.label
        assert on.smem_bytes == off.smem_bytes + _stage_bytes(cfg.consumers, key[0])
        assert on.smem_bytes <= _dispatch.SMEM_OPTIN_BYTES[90]
        assert (on.block_m, on.block_n, on.threads, on.persistent, on.pairs) == \
            (off.block_m, off.block_n, off.threads, off.persistent, off.pairs)
    else:  # D = 256 (BN = 80) and D = 128 long keys (BN = 176): no room beside the tiles
        assert on == off


def test_short_query_blocks_keep_it(monkeypatch):
    """Three consumers narrowed to two for Sq = 197 (hopper_choice) still take the async form,
    with the staging rows of two consumers."""
    monkeypatch.setattr(_dispatch, "HOPPER_ASYNC_O", True)
    plan = _dispatch.hopper_plan("bfloat16", 64, False, 197, sq=197)
    assert "BM128" in plan.label and "asyncO" in plan.label, plan.label
    assert plan.spec.name.startswith("cuflash::cuflash_fwd_wgmma_ao<cuflash::bf16_t, 1, 64, 128, 2, 1, 2,")


def test_table_entry_selects_it_without_the_flag(monkeypatch):
    """benchmarks/tune.py's way: a HOPPER_TABLE entry with async_o set."""
    monkeypatch.setattr(_dispatch, "HOPPER_ASYNC_O", False)
    table = {key: (t._replace(async_o=True), p) for key, (t, p) in _dispatch.HOPPER_TABLE.items()}
    monkeypatch.setattr(_dispatch, "HOPPER_TABLE", table)
    assert "asyncO" in _dispatch.hopper_plan("float16", 64, True, 512, sq=512).label
    # where it does not fit the entry runs the direct stores, as its label says
    assert "asyncO" not in _dispatch.hopper_plan("float16", 256, True, 512, sq=512).label


def test_twins_and_float32_keep_direct_stores(monkeypatch):
    monkeypatch.setattr(_dispatch, "HOPPER_ASYNC_O", True)
    vl = _dispatch.varlen_hopper_plan("float16", 64, True, 512, 512)
    assert vl.spec.name.startswith("cuflash::cuflash_fwd_wgmma_varlen<"), vl.spec.name
    assert "asyncO" not in vl.label
    from cuflash.variants import Variant

    var = _dispatch_variants.hopper_variant_plan("float16", 64, True, 512,
                                                Variant(softcap=30.0), sq=512)
    assert var.spec.name.startswith("cuflash::cuflash_fwd_wgmma_var<"), var.spec.name
    assert "asyncO" not in var.label
    f32 = _dispatch.hopper_plan("float32", 64, True, 512, "highest")
    assert "_ao<" not in f32.spec.name and "asyncO" not in f32.label


@pytest.fixture(scope="module")
def tune():
    return load_benchmark("tune")


def test_tune_candidates_label_and_fit(tune):
    """Every "aO" candidate fits (else it would time the direct stores under an aO label) and
    stands beside the same tiles without it; the labels tell them apart."""
    n = 0
    for d, cands in tune.CANDIDATES["hopper"].items():
        labels = [tune.label("hopper", c) for c in cands]
        assert len(set(labels)) == len(labels), labels
        for (t, persistent), lab in zip(cands, labels):
            assert (" aO" in lab) == t.async_o, lab
            if t.async_o:
                n += 1
                assert _dispatch.hopper_async_o_fits(t, d), lab
                assert (t._replace(async_o=False), persistent) in cands, lab
    assert n >= 3
    t = _dispatch.HopperTiles(128, 2, 1, 2, True, True, async_o=True)
    assert tune.label("hopper", (t, True)) == "BN128 S2 Q1 C2 ov pp aO P"
