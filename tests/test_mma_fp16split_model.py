"""The fp16-split ("3xfp16") form of the mma.sync float32 kernel (attn_mma.cu with OP = fp16_t;
notes/FLOAT32.md, "mma.sync 3xfp16"), checked on its NumPy model without a GPU.

The mma.sync form's arithmetic is the Hopper form's (tests/fp16split_model.py): per tile one
power of two (Q once per block of BM = 64 rows, each K and V tile of BN keys), fp16 hi + lo,
m16n8k16 products (k16 steps, head-dim columns in order), S's large products promoted per step
and its small ones chained over the tile, P split as P 2^7, P V's large products promoted per
step (summed over the tile in IEEE float32 up to D = 128, into O a step from D = 192 on) and its
small ones chained over the tile, O taking each by an FFMA after the tile. Only the tiles and
the sum differ: BM = 64 and the key tiles of _dispatch.TC_F16SPLIT_CONFIGS (64 keys to D = 64,
32 above). So the model is hopper_f32_model with those tiles; tests/test_gpu_float32.py runs the
kernel itself."""
import numpy as np
import pytest

from cuflash import _dispatch
from cuflash import reference as ref
from fp16split_model import hopper_f32_model
from test_fp16split_model import SHAPES, _draw, _magnitude_cases

F32 = "float32"
BM = 64  # 16 * MT * NWARPS of every TC_F16SPLIT_CONFIGS entry (checked below)


def _bn(d):
    dpad = _dispatch.head_dim_bucket(d, sorted(_dispatch.TC_F16SPLIT_CONFIGS))
    return _dispatch.TC_F16SPLIT_CONFIGS[dpad][0]


def _tile_sum(d):
    """attn_mma.cu's P V: the tile's promoted products summed before O takes them up to
    D = 128 (TILE_SUM), added to O a step from D = 192 on."""
    return _dispatch.head_dim_bucket(d, sorted(_dispatch.TC_F16SPLIT_CONFIGS)) <= 128


def _judge(q, k, v, causal=False, scale=None, seed=0, **kw):
    d = q.shape[-1]
    rule = ref.pass_threshold(q, k, v, causal=causal, scale=scale, dtype=F32)
    kw.setdefault("tile_sum", _tile_sum(d))
    return rule.judge(hopper_f32_model(q, k, v, causal=causal, scale=scale, form="3xfp16",
                                       bm=BM, bn=_bn(d), rng=np.random.default_rng(seed + 1000),
                                       **kw))


def test_tiles_are_the_kernels():
    """The model's tiles are the dispatched ones: BM = 16 MT NWARPS = 64 for every head dim."""
    for bn, nwarps, mt, _, _ in _dispatch.TC_F16SPLIT_CONFIGS.values():
        assert 16 * mt * nwarps == BM and bn in (16, 32, 64)
    plan = _dispatch.tensorcore_plan("float32", 100, False, 90, "highest")
    assert plan.block_m == BM and plan.block_n == _bn(100)


def test_model_within_the_rule_on_short_rows_and_tails():
    """Three draws of each shape (short rows, where the truncating accumulator shows most; tails;
    Sq != Sk; causal) pass the rule with room to spare, with the k16 step modelled as one
    truncating step and as two truncating k8 halves (how an m16n8k16 instruction accumulates is
    not documented)."""
    assert _worst_over(SHAPES, 3, 700) < 0.8


def _worst_over(shapes, draws, base):
    """Max err/threshold of the model over `draws` draws of each (sq, sk, d, causal), the k16
    step as one truncating step and as two k8 halves; every draw must pass the rule."""
    worst = 0.0
    for i, (sq, sk, d, causal) in enumerate(shapes):
        for seed in range(draws):
            q, k, v = _draw(np.random.default_rng(base + 100 * i + seed), 2, sq, sk, d)
            for kstep in (16, 8):
                vd = _judge(q, k, v, causal, seed=seed, kstep=kstep)
                assert vd.passed, ((sq, sk, d, causal, seed, kstep), vd.reasons)
                worst = max(worst, vd.frac_threshold)
    return worst


def test_promoted_pv_is_needed():
    """Why P V's large products are promoted per step (the kernel's from-zero fragments and their
    FFMA into O, at the cost of registers: attn_mma.cu, Mma16SplitOps::pv): with them chained over
    the tile instead (from zero, added to O after the tile) the model fails the rule on short
    rows, at BN = 32 as at BN = 64 (notes/FLOAT32.md, "mma.sync 3xfp16")."""
    promoted, chained = [], []
    for seed in range(6):
        q, k, v = _draw(np.random.default_rng(seed + 7), 2, 1, 64, 64)
        promoted.append(_judge(q, k, v, seed=seed))
        chained.append(_judge(q, k, v, seed=seed, promote_pv=False))
    assert all(vd.passed for vd in promoted), [vd.reasons for vd in promoted]
    assert not all(vd.passed for vd in chained)
    worst = [max(vd.frac_threshold for vd in x) for x in (promoted, chained)]
    assert worst[1] > 1.5 * worst[0], worst


@pytest.mark.parametrize("d,scale,sd", [(64, None, 3.0), (64, 2.5, 3.0), (128, 1.0, 3.0),
                                        (128, 2.5, 3.0), (96, 1.5, 3.0)])
def test_model_on_large_scores(d, scale, sd):
    """Issue 10's large-score inputs (scale 1.0-2.5, q and k with standard deviation 3)."""
    q, k, v = _draw(np.random.default_rng(d + int(10 * (scale or 0))), 1, 32, 300, d, sd)
    vd = _judge(q, k, v, scale=scale)
    assert vd.passed, vd.reasons
    assert vd.frac_threshold < 0.75


@pytest.mark.parametrize("d", [64, 128])
def test_model_on_long_keys(d):
    """Sk = 16k (issue 10's long keys), large scores, a few query rows."""
    q, k, v = _draw(np.random.default_rng(d + 1), 1, 4, 16384, d, 3.0)
    vd = _judge(q, k, v, scale=2.5 / np.sqrt(d))
    assert vd.passed, vd.reasons
    assert vd.frac_threshold < 0.75


@pytest.mark.parametrize("name", list(_magnitude_cases()))
def test_model_on_extreme_magnitudes(name):
    """Tiles 2^20 apart (K and V: 64-key halves, so at BN = 32 pairs of tiles share a magnitude),
    cancelling factors, subnormal values, values near the float32 maximum, one row 2^20 above its
    tile (test_fp16split_model.py's cases, D = 64)."""
    q, k, v = _magnitude_cases()[name]
    vd = _judge(q, k, v)
    assert vd.passed, vd.reasons
    assert vd.frac_threshold < 0.75


def test_model_nonfinite_and_zero_tiles():
    """A NaN or an inf in K reaches exactly the rows that see its key (causal); an all-zero K or V
    tile gives correct rows (its exponent is the clamp, 126: no NaN scale)."""
    q, k, v = _draw(np.random.default_rng(8), 1, 128, 128, 128)
    for bad in (np.nan, np.inf):
        kb = k.copy()
        kb[0, 100, 3] = bad
        o = hopper_f32_model(q, kb, v, causal=True, bm=BM, bn=_bn(128))
        assert np.all(np.isnan(o[0, 100:])), bad
        rule = ref.pass_threshold(q[:, :100], k[:, :100], v[:, :100], causal=True, dtype=F32)
        vd = rule.judge(o[0, :100][None])
        assert vd.passed, (bad, vd.reasons)
    kz, vz = k.copy(), v.copy()
    kz[:, 32:64] = 0.0
    vz[:, 64:96] = 0.0
    vd = _judge(q, kz, vz, causal=True)
    assert vd.passed, vd.reasons


def test_split_floor_of_tiny_values():
    """The fp16 split's absolute floor (cuflash.reference, `_split16_floor`): values about 2^-22 below
    their V tile's maximum, seen alone by causal row 0 (o = v_0 exactly), keep an absolute error
    near 2^-40 max|v| (fp16's subnormal spacing in lo), which is over the bound's relative
    terms alone (the H200 found it at D = 96 on a fresh draw, session f) and inside the floor.
    The floor stays 1e-10 of max|v|, so it cannot hide a wrong weight or a lost product."""
    rng = np.random.default_rng(96)
    q, k, v = _draw(rng, 1, 8, 8, 96)
    v[0, 0, :] = (1e-6 * rng.standard_normal(96)).astype(np.float32)   # full float32 mantissas
    v[0, 1, 0] = 3.5
    o = hopper_f32_model(q, k, v, causal=True, bm=BM, bn=_bn(96), rng=np.random.default_rng(1))
    o_ref, _ = ref.attention_ref(q, k, v, causal=True)
    err = np.abs(o - o_ref)[0, 0]
    relative_only = ref.error_bound(q, k, v, causal=True, dtype="float64")[0, 0] + \
        64 * 2.0 ** -24 * np.abs(o_ref[0, 0])       # e_prod relative to the element
    assert np.max(err) > 0 and np.max(err / relative_only) > 1.0, np.max(err / relative_only)
    bound = ref.error_bound(q, k, v, causal=True, dtype=F32)
    assert np.all(np.abs(o - o_ref) <= bound)
    assert ref._split16_floor(q, k, v, 1 / np.sqrt(96), 0.0, 0.0, 0.0, F32, None).max() \
        < 1e-10 * np.abs(v).max()
    assert _judge(q, k, v, causal=True, seed=1).passed


# The wide head dims (TC_F16SPLIT_CONFIGS' 192 and 256 entries: 32 and 16 keys a tile; under
# kernel="auto" only with _dispatch.F32_D256_AUTO). notes/FLOAT32.md, "mma.sync 3xfp16 at D = 192
# and 256".
WIDE_SHAPES = [(1, 16, 256, False), (1, 113, 256, False), (1, 128, 200, False),
               (16, 113, 192, False), (113, 113, 256, True), (1, 1000, 192, True),
               (7, 200, 256, True), (64, 200, 200, True)]


def test_wide_tiles():
    """D = 129..192 takes 32-key tiles, 193..256 16-key tiles, BM = 64."""
    assert [_bn(d) for d in (129, 160, 192, 193, 200, 256)] == [32] * 3 + [16] * 3
    for d in (160, 256):
        plan = _dispatch.tensorcore_plan("float32", d, False, 90, "highest")
        assert plan.block_m == BM and plan.block_n == _bn(d)
        assert plan.label.startswith(f"tensorcore<float32,3xfp16,D{192 if d <= 192 else 256},")


def test_wide_model_within_the_rule_on_short_rows_and_tails():
    """Two draws of each wide shape (short rows, one key tile of 16 keys, tails, Sq != Sk, causal)
    pass the rule with room to spare, with the k16 step as one and as two truncating steps."""
    assert _worst_over(WIDE_SHAPES, 2, 900) < 0.8


@pytest.mark.parametrize("d,scale", [(192, 1.0), (192, 2.5), (256, 1.0), (256, 2.5), (200, 1.5)])
def test_wide_model_on_large_scores(d, scale):
    """Issue 10's large-score inputs at D >= 192 (scale 1.0-2.5, q and k with standard deviation
    3: scores up to ~10^3, a one-hot softmax), over 300 keys and over 4096."""
    for sk in (300, 4096):
        q, k, v = _draw(np.random.default_rng(d + int(10 * scale) + sk), 1, 16, sk, d, 3.0)
        vd = _judge(q, k, v, scale=scale)
        assert vd.passed, (sk, vd.reasons)
        assert vd.frac_threshold < 0.75, (sk, vd.frac_threshold)
