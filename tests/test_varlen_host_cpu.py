"""attention_varlen's host side where kernel="auto" now takes the dense varlen twins, without a
GPU: what the checks let through to a launch (stand-in CuPy arrays of tests/test_workspace_cpu.py,
recorded launches) and the Hopper twin's 32-bit slot numbering (kernels_cu/attn_wgmma.cu:
cuflash_fwd_wgmma_varlen, common.cuh: varlen_slot) for the parameter block `dense_params` builds."""
from types import SimpleNamespace

import numpy as np
import pytest

import cuflash
from cuflash import _varlen

from test_workspace_cpu import GArr, _events, fakecp  # noqa: F401  (the stand-in CuPy fixture)


# ---------------------------------------------------------------------------------------------
# Offsets and tables on the GPU are read by the kernels as dense int32 arrays (data.ptr, index)

def _strided(fakecp, n, step=2, shape2=None):
    """A GPU int32 view taking every `step`-th element of a larger buffer (1-D), or the first
    `shape2[1]` columns of rows `shape2[2]` long (2-D): not contiguous."""
    if shape2 is None:
        base = fakecp.new((n * step,), "int32")
        return GArr((n,), "int32", base.data.ptr, fakecp.log, strides=(4 * step,))
    b, cols, row = shape2
    base = fakecp.new((b * row,), "int32")
    return GArr((b, cols), "int32", base.data.ptr, fakecp.log, strides=(4 * row, 4))


def test_strided_gpu_offsets_are_refused_before_any_launch(fakecp):
    """cu_seqlens views that are not contiguous: every kernel reads cu[s] at data.ptr + 4 s (no
    stride in VarlenParams, DecodeParams, BwdParams), so cu_seqlens[::2] of a larger array would
    give every sequence the wrong rows with no error. They must be refused (ValueError) on the
    GPU, before anything is launched, by the forward (both families), its queries and the
    backward; contiguous ones still launch with their own address."""
    q, k = fakecp.new((40, 8, 64)), fakecp.new((40, 2, 64))
    good = fakecp.new((4,), "int32")
    bad = _strided(fakecp, 4)
    for max_q in (16, 40):              # decode-like (decode family) and prefill (dense twin)
        for args in ((bad, good), (good, bad)):
            fakecp.log.clear()
            with pytest.raises(ValueError, match="contiguous"):
                cuflash.attention_varlen(q, k, k, *args, max_q, 40)
            with pytest.raises(ValueError, match="contiguous"):
                cuflash.attention_varlen_workspace_size(q, k, k, *args, max_q, 40)
            with pytest.raises(ValueError, match="contiguous"):
                cuflash.varlen_dispatch_info(q, k, k, *args, max_q, 40)
            assert not _events(fakecp.log, "launch")
        fakecp.log.clear()
        cuflash.attention_varlen(q, k, k, good, good, max_q, 40)
        launches = _events(fakecp.log, "launch")
        assert launches and all(int(e[3]["cu_q"]) == good.data.ptr for e in launches
                                if "cu_q" in e[3].dtype.names)
    o, lse = fakecp.new((40, 8, 64)), fakecp.new((8, 40), "float32")
    fakecp.log.clear()
    with pytest.raises(ValueError, match="contiguous"):
        cuflash.attention_varlen_backward(o, q, k, k, o, lse, bad, good, 40, 40)
    assert not _events(fakecp.log, "launch")


def test_strided_gpu_block_table_and_seqlens_are_refused(fakecp):
    """The same reader in attention_with_kvcache: the block table's rows are read bt_stride =
    shape[1] apart (DecodeParams, AppendParams), so block_table[:, :n] of a wider table sent
    every sequence but the first to other pages; cache_seqlens[::2] read other lengths."""
    b, hkv, h, d = 2, 2, 8, 64
    q, kc = fakecp.new((b, 1, h, d)), fakecp.new((16, 16, hkv, d))
    lens, bt = fakecp.new((b,), "int32"), fakecp.new((b, 4), "int32")
    for kw in ({"block_table": _strided(fakecp, 0, shape2=(b, 4, 8))},
               {"block_table": bt, "cache_seqlens": _strided(fakecp, b)}):
        args = dict({"block_table": bt, "cache_seqlens": lens}, **kw)
        fakecp.log.clear()
        with pytest.raises(ValueError, match="contiguous"):
            cuflash.attention_with_kvcache(q, kc, kc, args.pop("cache_seqlens"), **args)
        assert not _events(fakecp.log, "launch")
    fakecp.log.clear()
    cuflash.attention_with_kvcache(q, kc, kc, lens, block_table=bt)
    assert _events(fakecp.log, "launch")


def test_strided_numpy_offsets_still_work():
    """NumPy inputs index their offsets (any strides): unchanged."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((9, 2, 8))
    cu_full = np.array([0, 99, 4, 99, 9], np.int32)
    o = cuflash.attention_varlen(q, q, q, cu_full[::2], cu_full[::2], 5, 5)
    o2 = cuflash.attention_varlen(q, q, q, cu_full[::2].copy(), cu_full[::2].copy(), 5, 5)
    np.testing.assert_array_equal(o, o2)


# ---------------------------------------------------------------------------------------------
# The Hopper twin's slot numbering is 32-bit

def _u32_views(nseq, heads, lens_last, bm, pairs, group):
    """The Hopper twin's view of each live group of the *last* sequence (length `lens_last`,
    every earlier sequence one row) on its last head, in the kernel's unsigned int arithmetic
    (cuflash_fwd_wgmma_varlen: b = s H + h, view.slot = b per_s + r group, view.end = b per_s +
    min(per_s, (r + 1) group)), beside the exact values: [(slot32, end32, slot, end)]."""
    s, h = nseq - 1, heads - 1
    b = s * heads + h
    nm_s = -(-lens_last // bm)
    per_s = (nm_s + 1) // 2 if pairs else nm_s
    out = []
    for r in range(-(-per_s // group)):
        slot, end = b * per_s + r * group, b * per_s + min(per_s, (r + 1) * group)
        out.append((slot % 2**32, end % 2**32, slot, end))
    return out


@pytest.mark.parametrize("causal", [False, True])
def test_hopper_slot_numbering_fits_32_bits(causal, monkeypatch):
    """`dense_params` for the Hopper twin: the view's slot numbers b per_s + ... reach B H per_s
    (b = s H + h, per_s the sequence's query blocks or pairs), computed in 32 bits by the kernel.
    4095 one-row sequences then one of 2^20 (2^21 causal) rows, H = 128, D = 128: the grid is
    small (H (total_q / (U G) + B) blocks) but the last head's views wrap past 2^32, so their
    WorkWalk runs other slots' query blocks or none (rows left unwritten, no error). Such a call
    must be refused (ValueError) before any launch; one a query block shorter is accepted and
    does not wrap."""
    from cuflash import _dispatch, _tma

    monkeypatch.setattr(_tma, "encode_tiled", lambda *a: bytes(128))
    monkeypatch.setattr(_varlen, "VARLEN_HOPPER_GROUP", 4)
    nseq, h, hkv, d = 4096, 128, 16, 128
    plan = _dispatch.varlen_hopper_plan("float16", d, causal, 2**20, 2**20)
    bm = plan.block_m
    assert plan.pairs == causal and plan.spec.family == "attn_wgmma"
    u = bm * (2 if causal else 1)
    # the longest sequence whose last view still ends below 2^32, and one query block (pair) more
    per_ok = (2**32 - 1) // (nseq * h)
    for per, ok in ((per_ok, True), (per_ok + 1, False)):
        long_len = per * u
        views = _u32_views(nseq, h, long_len, bm, causal, 4)
        wraps = any((a, b) != (c, e) for a, b, c, e in views)
        assert wraps != ok        # the kernel's arithmetic wraps exactly past the bound
        total = nseq - 1 + long_len
        fake = lambda n, heads: SimpleNamespace(  # noqa: E731
            shape=(n, heads, d), strides=(heads * d * 2, d * 2, 2), itemsize=2,
            data=SimpleNamespace(ptr=1 << 30))
        cu = SimpleNamespace(data=SimpleNamespace(ptr=1 << 20))
        prob = SimpleNamespace(q=fake(total, h), k=fake(total, hkv), v=fake(total, hkv),
                               cu_q=cu, cu_k=cu, max_q=long_len, max_k=long_len, nseq=nseq,
                               h=h, hkv=hkv, d=d, dv=d, scale=0.1, causal=causal,
                               dtype_name="float16")
        o = fake(total, h)
        if ok:
            _, vl, grid = _varlen.dense_params(plan, prob, o, None)
            assert grid == h * int(vl["slots"]) < 2**31
        else:
            with pytest.raises(ValueError, match="32-bit"):
                _varlen.dense_params(plan, prob, o, None)


# ---------------------------------------------------------------------------------------------
# Head strides the Hopper twin's tensor maps cannot express

def _view(shape, estrides, ptr=1 << 30, item=2):
    return SimpleNamespace(shape=shape, strides=tuple(s * item for s in estrides), itemsize=item,
                           data=SimpleNamespace(ptr=ptr))


def _head_prob(q, k, kernel="auto"):
    cu = SimpleNamespace(data=SimpleNamespace(ptr=1 << 20))
    return SimpleNamespace(q=q, k=k, v=k, cu_q=cu, cu_k=cu, max_q=300, max_k=300, nseq=2,
                           h=q.shape[1], hkv=k.shape[1], d=128, dv=128, scale=0.1, causal=True,
                           dtype_name="float16", kernel=kernel)


def test_hopper_twin_head_strides(monkeypatch):
    """The tensor maps take byte strides as unsigned 64-bit multiples of 16 below 2^40
    (cuTensorMapEncodeTiled): a negative head stride (q[:, ::-1], which the mma.sync twin reads
    through its signed strides) reached the driver as 2^64 - |s| and failed the launch under
    kernel="auto" instead of taking the mma.sync twin; and a size-1 head axis (MQA's k, or
    H == Hkv's group axis) kept its stride, unchecked by the 16-byte rule (size-1 axes are
    skipped), where its coordinate is always 0. Auto must route the first to the mma.sync twin,
    and every encoded stride must be one the driver takes."""
    from cuflash import _dispatch, _tma

    monkeypatch.setattr(_tma, "available", lambda: True)
    encoded = []
    monkeypatch.setattr(_tma, "encode_tiled",
                        lambda dt, addr, dims, strides, box: encoded.append(strides) or bytes(128))
    d = 128
    rev_q = _view((600, 8, d), (8 * d, -d, 1), ptr=(1 << 30) + 7 * d * 2)
    k = _view((600, 2, d), (2 * d, d, 1))
    prob = _head_prob(rev_q, k)
    assert _varlen.hopper_reason(prob, 90) is not None
    assert _varlen.varlen_plan_for(prob, 90).label.startswith("varlen-tensorcore<")
    with pytest.raises(ValueError, match="kernel='hopper'"):
        _varlen.varlen_plan_for(_head_prob(rev_q, k, "hopper"), 90)
    # size-1 head axes with strides the driver refuses: MQA's k, and q of H == Hkv == 1
    plan = _dispatch.varlen_hopper_plan("float16", d, True, 300, 300)
    for q, kk in ((_view((600, 8, d), (8 * d, d, 1)), _view((600, 1, d), (d, 3, 1))),
                  (_view((600, 1, d), (d, -5, 1)), _view((600, 1, d), (d, 7, 1)))):
        prob = _head_prob(q, kk)
        assert _varlen.hopper_reason(prob, 90) is None
        encoded.clear()
        _varlen.dense_params(plan, prob, _view(q.shape, (q.shape[1] * d, d, 1)), None)
        assert len(encoded) == 3
        for strides in encoded:
            assert all(0 <= s < 2**40 and s % 16 == 0 for s in strides), strides
