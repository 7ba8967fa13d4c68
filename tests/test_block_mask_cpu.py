"""The mask's block summary without a GPU: `_mask_blocks.numpy_summary` (the GPU kernel's
reference) against a loop over blocks, `cuflash.block_mask` on NumPy masks and its errors, a
BlockMask accepted wherever ``mask=`` is (the NumPy attention, its backward, the references)
with results equal to the plain mask's, and the launch's VariantParams fields for a summary
(stand-in arrays)."""
import numpy as np
import pytest

import cuflash
from cuflash import _mask_blocks
from cuflash import reference as R
from cuflash._launch_variants import VARIANT_PARAMS_DTYPE, fill_params, variant_tensors
from cuflash.variants import Variant

from seeds import SEED, case_rng


def _loop_summary(m):
    *batch, r, c = m.shape
    rb, cb = -(-r // 64), -(-c // 64)
    out = np.zeros(tuple(batch) + (rb, cb), np.uint8)
    for idx in np.ndindex(*batch) if batch else [()]:
        for i in range(rb):
            for j in range(cb):
                blk = m[idx][i * 64:(i + 1) * 64, j * 64:(j + 1) * 64]
                out[idx + (i, j)] = 1 if blk.all() else (2 if not blk.any() else 0)
    return out


@pytest.mark.parametrize("shape", [(1, 1), (1, 40), (7, 7), (64, 64), (65, 129), (2, 113, 300),
                                   (2, 1, 200, 1), (3, 128, 256)])
@pytest.mark.parametrize("density", [0.0, 0.3, 0.995, 1.0])
def test_numpy_summary_matches_a_loop(shape, density):
    rng = case_rng(SEED, "np-summary", shape, density)
    m = rng.random(shape) < density
    if density == 0.3 and shape[-1] >= 64 and shape[-2] >= 64:
        m[..., :64, :64] = True
    s = _mask_blocks.numpy_summary(m)
    assert s.shape == _mask_blocks.summary_shape(shape) and s.dtype == np.uint8
    np.testing.assert_array_equal(s, _loop_summary(m))


def test_block_mask_on_numpy_and_its_errors():
    m = np.zeros((2, 100, 130), bool)
    m[:, :64, :64] = True
    bm = cuflash.block_mask(m)
    assert bm.mask is m and bm.shape == m.shape and bm.dtype == np.bool_
    assert bm.blocks.shape == (2, 2, 3)
    assert bm.blocks[0, 0, 0] == _mask_blocks.KEPT and bm.blocks[0, 1, 2] == _mask_blocks.HIDDEN
    assert cuflash.block_mask(bm) is bm
    m[:, 99, 129] = True
    bm.refresh()
    assert bm.blocks[0, 1, 2] == _mask_blocks.MIXED
    assert "BlockMask(shape=(2, 100, 130)" in repr(bm)
    with pytest.raises(TypeError, match="expected bool"):
        cuflash.block_mask(np.ones((4, 4), np.float32))
    with pytest.raises(ValueError, match="at least two"):
        cuflash.block_mask(np.ones(4, bool))
    with pytest.raises(TypeError):
        cuflash.block_mask([[True]])


def _inputs(rng, sq, sk, d=16):
    q = rng.standard_normal((2, 3, sq, d))
    k = rng.standard_normal((1, 3, sk, d))
    v = rng.standard_normal((1, 3, sk, d))
    return q, k, v


@pytest.mark.parametrize("causal", [False, True])
def test_block_mask_gives_the_plain_masks_results(causal):
    rng = case_rng(SEED, "np-bm", causal)
    sq, sk = 150, 200
    q, k, v = _inputs(rng, sq, sk)
    m = rng.random((3, sq, sk)) < 0.7
    m[:, :, :100] = True
    bm = cuflash.block_mask(m)
    o1, l1 = cuflash.attention(q, k, v, causal=causal, mask=m, return_lse=True)
    o2, l2 = cuflash.attention(q, k, v, causal=causal, mask=bm, return_lse=True)
    assert np.array_equal(o1, o2) and np.array_equal(l1, l2)
    do = rng.standard_normal(o1.shape)
    g1 = cuflash.attention_backward(do, q, k, v, o1, l1, causal=causal, mask=m)
    g2 = cuflash.attention_backward(do, q, k, v, o1, l1, causal=causal, mask=bm)
    for a, b in zip(g1, g2):
        assert np.array_equal(a, b)
    r1 = R.attention_ref(q, k, v, causal=causal, mask=m)
    r2 = R.attention_ref(q, k, v, causal=causal, mask=bm)
    assert all(np.array_equal(a, b) for a, b in zip(r1, r2))
    assert cuflash.dispatch_info(q, k, v, mask=bm) == cuflash.dispatch_info(q, k, v, mask=m)


def test_a_block_mask_with_a_wrong_summary_is_refused():
    rng = case_rng(SEED, "np-bad")
    q, k, v = _inputs(rng, 100, 100)
    m = np.ones((100, 100), bool)
    bad = _mask_blocks.BlockMask(m, np.ones((1, 1), np.uint8), None)
    with pytest.raises(ValueError, match="expected C-contiguous uint8 of shape \\(2, 2\\)"):
        cuflash.attention(q, k, v, mask=bad)
    bad = _mask_blocks.BlockMask(m, np.ones((2, 2), np.int32), None)
    with pytest.raises(ValueError, match="summary"):
        cuflash.attention(q, k, v, mask=bad)
    bad = _mask_blocks.BlockMask(np.ones((100, 100), np.float32), np.ones((2, 2), np.uint8), None)
    with pytest.raises(TypeError, match="mask has dtype float32"):
        cuflash.attention(q, k, v, mask=bad)


class _Fake:
    """An array stand-in (shape, strides in bytes, a data pointer) for the launch's host side."""

    def __init__(self, shape, strides, ptr, itemsize=1):
        self.shape, self.strides, self.itemsize = tuple(shape), tuple(strides), itemsize
        self.ndim = len(shape)

        class _D:
            pass
        self.data = _D()
        self.data.ptr = ptr


class _Prob:
    causal = False

    def __init__(self, var):
        self.variant = var


@pytest.mark.parametrize("mshape,sr,cmax", [((2, 1, 300, 500), 8, 7), ((1, 500), 0, 7),
                                            ((300, 1), 1, 0)])
def test_fill_params_passes_the_summary(mshape, sr, cmax):
    """VariantParams' mask_blocks fields: the pointer, the collapsed batch strides (from the
    same collapse as the mask's) and the row / key strides, 0 where the mask broadcasts."""
    mst = []
    acc = 1
    for n in reversed(mshape):
        mst.append(acc)
        acc *= n
    mask = _Fake(mshape, tuple(reversed(mst)), 0x6000)
    bshape = _mask_blocks.summary_shape(mshape)
    bst, acc = [], 1
    for n in reversed(bshape):
        bst.append(acc)
        acc *= n
    blocks = _Fake(bshape, tuple(reversed(bst)), 0x7000)
    var = Variant(mask=mask, mask_blocks=blocks)
    assert variant_tensors(var) == [mask, blocks]
    vp = fill_params(_Prob(var), [[0, 0, 1], [0, 0, 11]])
    assert vp.dtype == VARIANT_PARAMS_DTYPE
    assert int(vp["mask_blocks"]) == 0x7000 and int(vp["mask"]) == 0x6000
    assert [int(vp[f"mb_s{i}"]) for i in range(3)] == [0, 0, 11]
    assert (int(vp["mb_sr"]), int(vp["mb_cmax"])) == (sr, cmax)
    plain = fill_params(_Prob(Variant(mask=mask)), [[0, 0, 1]])
    assert int(plain["mask_blocks"]) == 0   # no summary: every masked tile partial


def test_no_summary_for_the_generic_kernels_or_when_off(monkeypatch):
    from cuflash._launch_variants import with_mask_blocks
    mask = _Fake((100, 100), (100, 1), 0x6000)
    var = Variant(mask=mask)
    assert with_mask_blocks(var, ("attn_generic",), 0, None) is var   # reads every element
    blocks = _Fake((2, 2), (2, 1), 0x7000)
    given = Variant(mask=mask, mask_blocks=blocks)
    assert with_mask_blocks(given, ("attn_mma",), 0, None) is given   # the caller's, kept
    monkeypatch.setattr(_mask_blocks, "ENABLED", False)
    assert with_mask_blocks(given, ("attn_mma",), 0, None).mask_blocks is None
    assert with_mask_blocks(var, ("attn_mma",), 0, None) is var


# ---- the summary of a user mask_mod (_mask_blocks.hook_summary) ------------------------------

def _per_head_window():
    from cuflash.mods import MaskMod
    # names b and h: a window whose width depends on the head, shifted per batch entry
    return MaskMod("kv_idx <= q_idx && q_idx - kv_idx < 8 * (h + 1) + b",
                   numpy=lambda b, h, q, kv, a: (kv <= q) & (q - kv < 8 * (h + 1) + b))


def test_hook_batch_names():
    """Which of b and h a hook's code names (comments do not count; a local called b does)."""
    from cuflash.mods import MaskMod, ScoreMod, example_hooks
    ex = example_hooks()
    assert ex["document"].batch_names == frozenset()
    assert ex["prefix_lm"].batch_names == frozenset()
    assert ex["rel_bias"].batch_names == frozenset({"h"})
    assert _per_head_window().batch_names == frozenset({"b", "h"})
    m = MaskMod("// b and h here are only words in a comment\nreturn kv_idx <= q_idx;",
                numpy=lambda b, h, q, kv, a: kv <= q)
    assert m.batch_names == frozenset()
    s = ScoreMod.additive("score + args[hb]", lambda s, b, h, q, kv, a: s)
    assert s.batch_names == frozenset()   # `hb` is not `h` or `b`


@pytest.mark.parametrize("sq,sk", [(1, 1), (7, 130), (113, 64), (200, 257)])
@pytest.mark.parametrize("batch", [(), (3,), (2, 3)])
def test_numpy_hook_summary_is_the_masks(sq, sk, batch):
    """numpy_hook_summary is the bool mask's summary (numpy_summary, the definition) of the mask
    the hook gives per batch entry, one entry per index the code names."""
    from cuflash.mods import example_hooks
    ex = example_hooks()
    rng = np.random.default_rng(sq * 1000 + sk + len(batch))
    ids = np.sort(rng.integers(0, 4, max(sq, sk))).astype(np.float32)
    qi, kj = np.arange(sq)[:, None], np.arange(sk)[None, :]
    H = batch[-1] if batch else 1
    B = int(np.prod(batch[:-1])) if len(batch) > 1 else 1
    for hook, args, dense in (
            (ex["document"], ids, lambda b, h: ids[qi] == ids[kj]),
            (ex["prefix_lm"], None, lambda b, h: (kj < 16) | (kj <= qi)),
            (_per_head_window(), None,
             lambda b, h: (kj <= qi) & (qi - kj < 8 * (h + 1) + b))):
        got = _mask_blocks.numpy_hook_summary(hook, batch, sq, sk, args)
        nb, nh = got.shape[:2]
        assert got.shape == _mask_blocks.hook_summary_shape(hook, batch, sq, sk)
        assert (nb, nh) == ((B, H) if hook.batch_names else (1, 1))
        for b in range(nb):
            for h in range(nh):
                want = _mask_blocks.numpy_summary(np.broadcast_to(dense(b, h), (sq, sk)))
                np.testing.assert_array_equal(got[b, h], want)


def _ranges_by_loop(summary, sk):
    """numpy_hook_ranges' definition, one row block at a time."""
    B, K, H = _mask_blocks.BLOCK, _mask_blocks.KEPT, _mask_blocks.HIDDEN
    out = np.zeros(summary.shape[:-1] + (4,), dtype=np.int64)
    for idx in np.ndindex(*summary.shape[:-1]):
        row = list(summary[idx])
        seen = [c for c, x in enumerate(row) if x != H]
        out[idx][:2] = ((seen[0] * B, min(sk, (seen[-1] + 1) * B)) if seen
                        else (_mask_blocks.EMPTY_LO, 0))
        best, start = 0, 0
        for c0 in range(len(row)):
            n = 0
            while c0 + n < len(row) and row[c0 + n] == K:
                n += 1
            if n > best:
                best, start = n, c0
        out[idx][2:] = (start * B, min(sk, (start + best) * B)) if best else (0, 0)
    return out


@pytest.mark.parametrize("sk", [1, 64, 100, 1000])
def test_numpy_hook_ranges_matches_a_loop(sk):
    """(lo, hi): the hull of the blocks that are not HIDDEN; (klo, khi): the longest run of KEPT
    blocks, the first of equal ones, clamped to Sk; the sentinels where there is none."""
    rng = np.random.default_rng(sk)
    cb = -(-sk // _mask_blocks.BLOCK)
    for trial in range(20):
        summary = rng.choice(np.array([_mask_blocks.MIXED, _mask_blocks.KEPT,
                                       _mask_blocks.HIDDEN], np.uint8), size=(2, 3, 5, cb),
                             p=rng.dirichlet(np.ones(3)))
        got = _mask_blocks.numpy_hook_ranges(summary, sk)
        assert got.dtype == np.int32 and got.shape == (2, 3, 5, 4)
        np.testing.assert_array_equal(got, _ranges_by_loop(summary, sk))
    # documents of 200 keys: every row block inside one sees a run of kept blocks
    ids = np.arange(1000) // 200
    summary = _mask_blocks.numpy_summary(ids[:, None] == ids[None, :])
    got = _mask_blocks.numpy_hook_ranges(summary, 1000)
    assert got[0].tolist() == got[1].tolist() == got[2].tolist() == [0, 256, 0, 192]
    assert got[3].tolist() == [0, 448, 0, 0]   # rows of two documents: no block kept
    assert got[4].tolist() == [192, 448, 256, 384]


@pytest.mark.parametrize("sq,sk", [(1, 1), (64, 100), (300, 1000), (1000, 7)])
def test_numpy_hook_col_ranges_and_record(sq, sk):
    """(rlo, rhi) per key block: the hull of the row blocks that are not HIDDEN in its column,
    clamped to Sq, the sentinel where all are; the record the kernels read is each entry's row
    part (4 ints a row block) followed by its column part (2 a key block)."""
    rng = np.random.default_rng(sq + sk)
    rb, cb = -(-sq // _mask_blocks.BLOCK), -(-sk // _mask_blocks.BLOCK)
    summary = rng.choice(np.array([_mask_blocks.MIXED, _mask_blocks.KEPT, _mask_blocks.HIDDEN],
                                  np.uint8), size=(2, 3, rb, cb), p=[0.2, 0.2, 0.6])
    got = _mask_blocks.numpy_hook_col_ranges(summary, sq)
    assert got.shape == (2, 3, cb, 2) and got.dtype == np.int32
    for idx in np.ndindex(2, 3, cb):
        seen = [r for r in range(rb) if summary[idx[0], idx[1], r, idx[2]] != _mask_blocks.HIDDEN]
        want = ((seen[0] * 64, min(sq, (seen[-1] + 1) * 64)) if seen
                else (_mask_blocks.EMPTY_LO, 0))
        assert tuple(got[idx]) == want, (idx, got[idx], want)
    rec = _mask_blocks.numpy_hook_record(summary, sq, sk)
    assert rec.shape == (2, 3, 4 * rb + 2 * cb) and rec.dtype == np.int32
    np.testing.assert_array_equal(rec[..., :4 * rb].reshape(2, 3, rb, 4),
                                  _mask_blocks.numpy_hook_ranges(summary, sk))
    np.testing.assert_array_equal(rec[..., 4 * rb:].reshape(2, 3, cb, 2), got)


def test_hook_summary_checks_args():
    from cuflash.mods import example_hooks
    doc = example_hooks()["document"]
    for args in (None, np.zeros(0, np.float32)):
        with pytest.raises(ValueError, match="reads args"):
            _mask_blocks.numpy_hook_summary(doc, (2,), 8, 8, args)
    with pytest.raises(TypeError, match="1-D float32"):
        _mask_blocks.numpy_hook_summary(doc, (2,), 8, 8, np.zeros(8))
