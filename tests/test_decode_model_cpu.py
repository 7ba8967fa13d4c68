"""The decode kernel's work split (tests/decode_model.py: row blocks of 16 MT rows, key splits,
warps, the warp merge and the split combine, with the kernel's index arithmetic) against the
float64 reference under the project's rule, for grouped-query groups 1, 4, 8 and 32, Sq = 1 and
Sq > 1, tails 1/7/113/1000, empty caches, MT = 1 and 2, and split counts forced to the extremes
(one split; one key tile per split). CPU only; the GPU runs the same cases in
tests/test_inference_gpu.py."""
import math

import numpy as np
import pytest

from cuflash import _decode, reference

from decode_model import decode_model
from seeds import SEED, case_rng

MAX = 10**6   # a forced split count past every cap: one key tile per split


@pytest.mark.parametrize("version", [2, 1])
@pytest.mark.parametrize("splits", [None, 1, MAX])
@pytest.mark.parametrize("mt", [1, 2])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sk", [1, 7, 113, 1000])
@pytest.mark.parametrize("g,sq", [(1, 1), (4, 1), (8, 1), (32, 1), (8, 3), (4, 16)])
def test_decode_split_model(g, sq, sk, causal, mt, splits, version):
    rng = case_rng(SEED, "decode-model", g, sq, sk, causal, mt, splits, version)
    d = 64
    q = reference.round_to(rng.standard_normal((g, sq, d)), "float16")
    k, v = (reference.round_to(rng.standard_normal((sk, d)), "float16") for _ in range(2))
    scale = 1 / math.sqrt(d)
    o, lse, used = decode_model(q, k, v, causal=causal, scale=scale, mt=mt, splits=splits,
                                version=version)
    n_tiles = -(-sk // _decode.DECODE_BN)
    if splits == MAX:
        assert used == n_tiles
    elif splits == 1:
        assert used == 1
    assert not np.isnan(o).any() and not np.isnan(lse).any(), "a row was not written"
    rule = reference.pass_threshold(q, k[None], v[None], causal=causal, dtype="float16",
                                    scale=scale)
    verdict = rule.judge(o)
    assert verdict.passed, "; ".join(verdict.reasons)
    _, lse_ref = reference.attention_ref(q, k[None], v[None], causal=causal, scale=scale)
    fin = np.isfinite(lse_ref)
    assert np.array_equal(np.isneginf(lse), ~fin)
    assert np.all(np.abs(lse[fin] - lse_ref[fin]) <= 1e-4 + 1e-5 * np.abs(lse_ref[fin]))


@pytest.mark.parametrize("mt", [1, 2])
def test_decode_split_model_empty_cache(mt):
    """A sequence with no key: o = 0 and lse = -inf on every row (no tile, no split work)."""
    rng = case_rng(SEED, "decode-model-empty", mt)
    q = reference.round_to(rng.standard_normal((32, 2, 64)), "float16")
    k = v = np.zeros((0, 64))
    o, lse, used = decode_model(q, k, v, causal=False, scale=0.125, mt=mt)
    assert used == 1 and np.all(o == 0) and np.all(np.isneginf(lse))


def test_row_tiles_per_block():
    """MT = 2 exactly when an entry has more than 16 packed rows and D <= 128; the plan carries
    it in block_m, the kernel name and the label; configure pads the row tiles to it."""
    for d, rows, mt in ((128, 1, 1), (128, 16, 1), (128, 17, 2), (64, 32, 2), (128, 128, 2),
                        (256, 32, 1), (96, 24, 2)):
        plan = _decode.decode_plan("float16", d, False, False, rows=rows)
        assert plan.block_m == 16 * mt
        assert (f", 2, false, false, {_decode.DECODE_VERSION}>" in plan.spec.name) == (mt == 2)
        assert ("R32" in plan.label) == (mt == 2)
        attrs = dict(max_smem_optin=227 * 1024, sm_count=132)
        g = rows
        cfg = _decode.configure(plan, (1, 2, 3), g, 1, 5000, d, attrs)
        assert cfg.n_rtiles % mt == 0 and 16 * cfg.n_rtiles >= rows
        assert cfg.grid == 6 * (cfg.n_rtiles // mt) * cfg.splits
    for d, rows, n in ((128, 1, 3), (128, 32, 2), (256, 1, 1), (256, 32, 1), (64, 1, 4),
                       (64, 32, 3)):
        assert _decode.blocks_per_sm(_decode.decode_plan("float16", d, False, False, rows=rows),
                                     d) == n, (d, rows)


ISSUE_GRID = [(b, sk, hkv) for b in (1, 8, 64) for sk in (1024, 8192, 32768, 131072)
              for hkv in (32, 8, 1)]


@pytest.mark.parametrize("b,sk,hkv", ISSUE_GRID)
def test_issue_grid_fills_the_gpu(b, sk, hkv):
    """At every point of issue 14's decode grid (H = 32, D = 128, Sq = 1) on 132 SMs, K and V
    are read once per entry (one row block: G <= 32 rows), and the split keeps every block slot
    at least half busy in the first wave unless the keys run out (at most one split per 4 key
    tiles)."""
    g = 32 // hkv
    plan = _decode.decode_plan("float16", 128, False, False, rows=g)
    cfg = _decode.configure(plan, (1, b, hkv), g, 1, sk, 128,
                            dict(max_smem_optin=227 * 1024, sm_count=132))
    assert cfg.n_rtiles // (plan.block_m // 16) == 1          # one row block per entry
    slots = 132 * _decode.blocks_per_sm(plan, 128)
    n_tiles = sk // _decode.DECODE_BN
    cap = -(-n_tiles // _decode.DECODE_WARPS)
    assert cfg.grid >= min(slots, b * hkv * cap) * 0.5 or cfg.splits == cap


@pytest.mark.parametrize("dpad", _decode.DECODE_DPADS)
def test_combine_columns(dpad):
    """Version 2's combine grid (rows, CB): CB a power of two dividing the row's DPAD / 4 float4
    chunks, the least with which no thread of the 128 loads more than COMBINE_LOADS splits
    (attn_decode.cu's constant, read from the source), for every split count up to
    MAX_SPLITS; version 1 and one split: CB = 1."""
    import re

    from kernels_cu import SOURCE_DIR

    src = (SOURCE_DIR / "attn_decode.cu").read_text()
    assert int(re.search(r"constexpr int COMBINE_LOADS = (\d+);", src).group(1)) == \
        _decode.COMBINE_LOADS
    assert int(re.search(r"constexpr int MAX_SPLITS = (\d+);", src).group(1)) == \
        _decode.MAX_SPLITS
    ch = dpad // 4
    for s in range(1, _decode.MAX_SPLITS + 1):
        cb = _decode.combine_columns(s, dpad, 2)
        assert _decode.combine_columns(s, dpad, 1) == 1
        assert cb & (cb - 1) == 0 and ch % cb == 0
        ng = _decode.COMBINE_THREADS * cb // ch
        assert -(-s // ng) <= _decode.COMBINE_LOADS
        if cb > 1:
            assert -(-s // (ng // 2)) > _decode.COMBINE_LOADS   # the least such CB
    assert _decode.combine_columns(1, dpad, 2) == 1


def test_versions_plans_and_specialisations():
    """Each kernel version has its own instantiation (the name's last template argument) and
    label suffix; version 1 pairs with combine version 1, versions 2 and 3 with 2; the compile
    check's list has every version's kernels; an unknown version is refused."""
    for v, suffix in ((1, ",v1>"), (2, "full>"), (3, ",v3>"), (4, ",v4>")):
        plan = _decode.decode_plan("bfloat16", 128, False, True, rows=32, version=v)
        assert plan.spec.name.endswith(f", {v}>") and plan.label.endswith(suffix)
        assert _decode.version_of(plan) == v
        cfg = _decode.configure(plan, (1, 1, 1), 32, 1, 8192, 128,
                                dict(max_smem_optin=227 * 1024, sm_count=132))
        comb = _decode.combine_spec_for(plan, cfg).name
        assert comb.endswith(f", {1 if v == 1 else 2}>")
        assert cfg.comb_cb == (1 if v == 1 else _decode.combine_columns(cfg.splits, 128))
    names = {s.name for s in _decode.all_decode_specialisations()}
    for v in _decode.DECODE_VERSIONS:
        for rows in (1, 32):
            for paged in (False, True):
                assert _decode.decode_plan("float16", 64, True, paged, rows=rows,
                                           version=v).spec.name in names
    assert _decode.decode_plan("float16", 64, True, False, version=4).spec.arch == "sm_90"
    with pytest.raises(ValueError, match="sm_90 only"):
        _decode.configure(_decode.decode_plan("float16", 64, True, False, version=4), (1, 1, 1),
                          1, 1, 100, 64, dict(max_smem_optin=227 * 1024, sm_count=108,
                                              compute_capability=80))
    with pytest.raises(ValueError, match="versions"):
        _decode.decode_plan("float16", 64, True, False, version=5)
