"""GPU tests of the mask's block summary (kernels_cu/mask_blocks.cu, cuflash.block_mask) and of
the tensor-core kernels that read it (Variant::tile_kind: a tile whose 64 x 64 blocks are all
kept is computed without reading the mask).

- The summary kernel equals `_mask_blocks.numpy_summary` byte for byte: tails, batch axes,
  broadcast rows / keys / batch axes, strided and transposed views (both load paths).
- Structured masks (padding, documents, per-head documents, a row-strided view, with a window)
  on the mma.sync and Hopper forwards and the mma.sync backward (and the Hopper backward at
  D = 256), against the float64 references under the pass rule with NaN-poisoned outputs
  (gpu_util.check_variant_case); each case's summary is asserted to hold kept, hidden and mixed
  blocks where the shape allows, so the full-tile path is reached.
- The summary changes which code computes a tile, not its result: o, lse, dq, dk, dv with the
  per-call summary, with a BlockMask and with the summary off (`_mask_blocks.ENABLED`) are equal
  bit for bit.
- The kernels do read it: a summary that calls every block kept (while the mask hides interior
  entries) gives the unmasked result.
Skipped without a GPU."""
import numpy as np
import pytest

import cuflash
from cuflash import _dispatch_variants, _mask_blocks
from cuflash import reference as R

from gpu_util import bf16_dtype, check_variant_case, cupy, poisoned, random_inputs, to_gpu, \
    to_host64
from seeds import SEED, case_rng

pytestmark = pytest.mark.gpu

BATCH_Q, BATCH_KV = (2, 3), (1, 3)


def _rng(*key):
    return case_rng(SEED, "block-mask", *key)


# ---- the summary kernel ------------------------------------------------------------------------

def _summary_gpu(m):
    return cupy().asnumpy(cuflash.block_mask(m).blocks)


@pytest.mark.parametrize("rows,cols", [(1, 1), (1, 40), (7, 7), (64, 64), (65, 129), (113, 1000),
                                       (1000, 113), (300, 1), (128, 4096)])
@pytest.mark.parametrize("batch", [(), (2,), (2, 3)])
@pytest.mark.parametrize("density", [0.0, 0.5, 0.999, 1.0])
def test_summary_matches_numpy(rows, cols, batch, density):
    cp = cupy()
    rng = _rng("summary", rows, cols, batch, density)
    m = rng.random(batch + (rows, cols)) < density
    if density == 0.5 and rows >= 64 and cols >= 64:   # whole kept and hidden blocks too
        m[..., :64, :64] = True
        m[..., -64:, -64:] = False
    got = _summary_gpu(cp.asarray(m))
    assert got.shape == _mask_blocks.summary_shape(m.shape)
    np.testing.assert_array_equal(got, _mask_blocks.numpy_summary(m))


# ---- the summary of a user mask_mod (mask_blocks.cu: cuflash_hook_blocks) ---------------------

@pytest.mark.parametrize("sq,sk", [(1, 1), (7, 130), (113, 64), (200, 1000), (1000, 7)])
@pytest.mark.parametrize("hook", ["document", "prefix_lm", "per_head_window"])
@pytest.mark.parametrize("batch", [(), (2, 3)])
def test_hook_summary_matches_numpy(sq, sk, hook, batch):
    """The mask_mod summary kernel equals `_mask_blocks.numpy_hook_summary` byte for byte (the
    output poisoned first, so an unwritten byte fails): tails, one summary for the batch where
    the code names neither b nor h, one per (b, h) where it names both."""
    from cuflash.mods import MaskMod, example_hooks
    cp = cupy()
    ex = example_hooks()
    ex["per_head_window"] = MaskMod(
        "kv_idx <= q_idx && q_idx - kv_idx < 8 * (h + 1) + b",
        numpy=lambda b, h, q, kv, a: (kv <= q) & (q - kv < 8 * (h + 1) + b))
    mm = ex[hook]
    rng = _rng("hook-summary", sq, sk, hook, batch)
    args = (np.sort(rng.integers(0, 5, max(sq, sk))).astype(np.float32)
            if mm.reads_args else None)
    want = _mask_blocks.numpy_hook_summary(mm, batch, sq, sk, args)
    out = cp.full(want.shape, 0xAB, dtype=np.uint8)   # no valid kind
    got = _mask_blocks.hook_summary(mm, batch, sq, sk, 0,
                                    None if args is None else cp.asarray(args), out=out)
    assert got is out
    np.testing.assert_array_equal(cp.asnumpy(got), want)
    # and its ranges (cuflash_hook_ranges, cuflash_hook_col_ranges) equal numpy_hook_record's
    # of the same summary (poisoned first: every int written)
    rec = _mask_blocks.numpy_hook_record(want, sq, sk)
    ranges = _mask_blocks.hook_ranges(got, sq, sk, 0, out=cp.full(rec.shape, -7, np.int32))
    np.testing.assert_array_equal(cp.asnumpy(ranges), rec)


@pytest.mark.parametrize("view", ["keys-strided", "rows-strided", "transposed", "offset",
                                  "broadcast-rows", "broadcast-keys", "broadcast-batch",
                                  "odd-row-stride", "torch-like-values"])
def test_summary_of_views(view):
    cp = cupy()
    rng = _rng("views", view)
    base = rng.random((2, 3, 300, 700)) < 0.98
    base[..., 64:192, 128:320] = True
    base[..., 200:, :64] = False
    g = cp.asarray(base)
    v = {"keys-strided": lambda: g[..., ::2],
         "rows-strided": lambda: g[..., ::3, :],
         "transposed": lambda: g.swapaxes(-1, -2),
         "offset": lambda: g[..., 5:, 3:],      # rows start unaligned: the byte-load path
         "broadcast-rows": lambda: cp.broadcast_to(g[..., :1, :], (2, 3, 300, 700)),
         "broadcast-keys": lambda: g[..., :, :1],
         "broadcast-batch": lambda: cp.broadcast_to(g[:1, :, :, :], (4, 3, 300, 700)),
         "odd-row-stride": lambda: cp.asarray(np.pad(base, [(0, 0)] * 3 + [(0, 3)]))[..., :700],
         "torch-like-values": lambda: g}[view]()
    if view == "torch-like-values":   # bytes other than 0 / 1 count as True (DLPack bools)
        raw = cp.asarray(base.astype(np.uint8) * 3)
        v = raw.view(cp.bool_)
    host = cp.asnumpy(v).astype(bool) if view != "torch-like-values" else base
    np.testing.assert_array_equal(_summary_gpu(v), _mask_blocks.numpy_summary(host))


def test_summary_runs_on_the_given_stream():
    cp = cupy()
    m = cp.asarray(_rng("stream").random((3, 200, 300)) < 0.9)
    s = cp.cuda.Stream(non_blocking=True)
    bm = cuflash.block_mask(m, stream=s)
    s.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(bm.blocks), _mask_blocks.numpy_summary(cp.asnumpy(m)))
    m[:, :64, :64] = False
    bm.refresh(stream=s)
    s.synchronize()
    assert (cp.asnumpy(bm.blocks)[:, 0, 0] == _mask_blocks.HIDDEN).all()


# ---- structured masks on the tensor-core kernels ----------------------------------------------

def _cuts(rng, n, parts):
    """Sorted cut points splitting [0, n) into `parts` documents (not 64-aligned)."""
    c = np.sort(rng.choice(np.arange(1, max(2, n)), size=min(parts - 1, max(0, n - 1)),
                           replace=False)) if n > 1 else np.array([], int)
    return c


def _documents(rng, sq, sk, lead=()):
    """A block-diagonal document mask: row i and key j in the same document (documents cut at
    proportional positions of the two axes)."""
    out = np.zeros(lead + (sq, sk), dtype=bool)
    for idx in np.ndindex(*lead) if lead else [()]:
        cq = _cuts(rng, sq, 4)
        ck = np.round(cq * sk / sq).astype(int)
        dq = np.searchsorted(cq, np.arange(sq), side="right")
        dk = np.searchsorted(ck, np.arange(sk), side="right")
        out[idx] = dq[:, None] == dk[None, :]
    return out


def mask_case(name, rng, sq, sk):
    """(host kw, device kw) of a structured mask named `name`."""
    cp = cupy()
    if name == "padding":          # keys past each batch entry's length hidden; rows broadcast
        lens = [sk - int(rng.integers(0, sk // 3 + 1)), max(1, sk // 2 + 5)]
        m = np.arange(sk)[None, :] < np.array(lens)[:, None]
        m = m[:, None, None, :]
        return dict(mask=m), dict(mask=cp.asarray(m))
    if name == "documents":        # shared by every batch entry and head
        m = _documents(rng, sq, sk)
        return dict(mask=m), dict(mask=cp.asarray(m))
    if name == "head-documents":   # per head (batch axis 0 broadcast), as a BlockMask
        m = _documents(rng, sq, sk, (BATCH_Q[-1],))
        return dict(mask=m), dict(mask=cuflash.block_mask(cp.asarray(m)))
    if name == "rows-strided":     # a view with every other row of a taller mask
        tall = _documents(rng, 2 * sq, sk)
        m = tall[::2]
        return dict(mask=m), dict(mask=cp.asarray(tall)[::2])
    if name == "window-documents":
        m = _documents(rng, sq, sk)
        return (dict(mask=m, window=(300, 40)), dict(mask=cp.asarray(m), window=(300, 40)))
    raise ValueError(name)


def _assert_structure(kw, sq, sk):
    """Kept, hidden and mixed blocks all occur where the shape has room for them."""
    s = _mask_blocks.numpy_summary(kw["mask"])
    if min(sq, sk) >= 700:
        assert {_mask_blocks.KEPT, _mask_blocks.MIXED} <= set(np.unique(s).tolist()), s


def _run(name, causal, dtype, sq, sk, kernel, d, bwd_kernel=None, deterministic=False):
    if dtype == "bfloat16" and bf16_dtype() is None:
        pytest.skip("bfloat16 on the GPU needs ml_dtypes")
    if kernel == "hopper" and cupy().cuda.Device().compute_capability != "90":
        pytest.skip("the Hopper kernels run on compute capability 9.0")
    rng = _rng(name, causal, dtype, sq, sk, kernel, d, deterministic)
    q, k, v = random_inputs(rng, BATCH_Q, BATCH_KV, sq, sk, d, d, dtype)
    kw, dkw = mask_case(name, rng, sq, sk)
    _assert_structure(kw, sq, sk)
    qg, kg, vg = (to_gpu(x, dtype) for x in (q, k, v))
    return check_variant_case(q, k, v, qg, kg, vg, kw, dkw, causal=causal, dtype=dtype, rng=rng,
                              seed=SEED, kernel=kernel, bwd_kernel=bwd_kernel,
                              deterministic=deterministic)


NAMES = ["padding", "documents", "head-documents", "rows-strided", "window-documents"]
SHAPES = [(1000, 1000), (113, 1000), (1000, 113), (7, 7), (1, 40)]
FAMILIES = [("tensorcore", "float16", 64), ("tensorcore", "bfloat16", 128),
            ("tensorcore", "float32", 64), ("hopper", "float16", 128), ("hopper", "bfloat16", 64)]


@pytest.mark.parametrize("sq,sk", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("kernel,dtype,d", FAMILIES)
def test_structured_masks(kernel, dtype, d, name, causal, sq, sk):
    # The backward of each: the mma.sync one for 16-bit inputs (the Hopper backward refuses
    # tensors at D <= 128), the generic one for float32.
    _run(name, causal, dtype, sq, sk, kernel, d)


@pytest.fixture
def hopper_bwd_variants(monkeypatch):
    if cupy().cuda.Device().compute_capability != "90":
        pytest.skip("the Hopper backward runs on compute capability 9.0")
    monkeypatch.setattr(_dispatch_variants, "HOPPER_BWD_VARIANTS", True)


@pytest.mark.parametrize("sq,sk", [(1000, 1000), (113, 1000), (1000, 113)])
@pytest.mark.parametrize("name", ["padding", "documents", "head-documents"])
@pytest.mark.parametrize("causal,det", [(True, True), (False, False)])
def test_structured_masks_hopper_backward_d256(hopper_bwd_variants, name, causal, det, sq, sk):
    _run(name, causal, "float16", sq, sk, "hopper", 256, bwd_kernel="hopper", deterministic=det)


# ---- the summary changes the path, not the result --------------------------------------------

def _outputs(q, k, v, do, kw, causal, kernel, bwd_kernel, dtype, monkeypatch, enabled):
    monkeypatch.setattr(_mask_blocks, "ENABLED", enabled)
    o = poisoned(q.shape[:-1] + (v.shape[-1],), dtype)
    lse = poisoned(q.shape[:-1], "float32")
    cuflash.attention(q, k, v, causal=causal, return_lse=True, out=(o, lse), kernel=kernel, **kw)
    grads = cuflash.attention_backward(do, q, k, v, o, lse, causal=causal, kernel=bwd_kernel,
                                       deterministic=True, **kw)   # (dq without atomics)
    return (o, lse) + tuple(grads)


@pytest.mark.parametrize("sq,sk", [(1000, 1000), (113, 1000), (2048, 777)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", ["padding", "documents", "window-documents"])
@pytest.mark.parametrize("kernel,dtype,d", [("tensorcore", "float16", 64),
                                            ("tensorcore", "float16", 128),
                                            ("hopper", "float16", 128),
                                            ("hopper", "bfloat16", 64)])
def test_summary_leaves_results_bitwise_equal(kernel, dtype, d, name, causal, sq, sk,
                                              monkeypatch):
    if dtype == "bfloat16" and bf16_dtype() is None:
        pytest.skip("bfloat16 on the GPU needs ml_dtypes")
    if kernel == "hopper" and cupy().cuda.Device().compute_capability != "90":
        pytest.skip("the Hopper kernels run on compute capability 9.0")
    cp = cupy()
    rng = _rng("bitwise", name, causal, sq, sk, kernel, d)
    q, k, v = random_inputs(rng, BATCH_Q, BATCH_KV, sq, sk, d, d, dtype)
    _, dkw = mask_case(name, rng, sq, sk)
    do = to_gpu(R.round_to(rng.standard_normal(q.shape), dtype), dtype)
    qg, kg, vg = (to_gpu(x, dtype) for x in (q, k, v))
    args = (qg, kg, vg, do)
    off = _outputs(*args, dkw, causal, kernel, "tensorcore", dtype, monkeypatch, False)
    per_call = _outputs(*args, dkw, causal, kernel, "tensorcore", dtype, monkeypatch, True)
    kept = dict(dkw, mask=cuflash.block_mask(dkw["mask"]))
    reused = _outputs(*args, kept, causal, kernel, "tensorcore", dtype, monkeypatch, True)
    for name_, a, b, c in zip(("o", "lse", "dq", "dk", "dv"), off, per_call, reused):
        assert cp.array_equal(a, b, equal_nan=True), (name_, SEED)
        assert cp.array_equal(a, c, equal_nan=True), (name_, SEED)


@pytest.mark.parametrize("kernel,d", [("tensorcore", 64), ("hopper", 128)])
def test_kernels_read_the_summary(kernel, d):
    """A summary that calls every block kept, for a mask hiding entries away from the key tail
    and the causal diagonal: every tile is computed as full, so the result is the unmasked
    attention's (and not the masked one's)."""
    if kernel == "hopper" and cupy().cuda.Device().compute_capability != "90":
        pytest.skip("the Hopper kernels run on compute capability 9.0")
    cp = cupy()
    sq = sk = 1024
    rng = _rng("lying", kernel, d)
    q, k, v = random_inputs(rng, BATCH_Q, BATCH_KV, sq, sk, d, d, "float16")
    m = np.ones((sq, sk), dtype=bool)
    m[:, 64:512] = rng.random((sq, 448)) < 0.3
    qg, kg, vg = (to_gpu(x, "float16") for x in (q, k, v))
    bm = cuflash.block_mask(cp.asarray(m))
    assert (cp.asnumpy(bm.blocks)[:, 1:8] == _mask_blocks.MIXED).all()
    bm.blocks[...] = _mask_blocks.KEPT                      # the lie
    o = cuflash.attention(qg, kg, vg, mask=bm, kernel=kernel)
    rule = R.pass_threshold(q, k, v, dtype="float16")       # the unmasked attention
    verdict = rule.judge(to_host64(o))
    assert verdict.passed, (SEED, verdict.reasons)
    o_masked, _ = R.attention_ref(q, k, v, mask=m)
    assert np.abs(to_host64(o) - o_masked).max() > 0.05
    # and the backward: the unmasked gradients
    do = R.round_to(rng.standard_normal(q.shape), "float16")
    o2, lse2 = cuflash.attention(qg, kg, vg, mask=bm, kernel=kernel, return_lse=True)
    grads = cuflash.attention_backward(to_gpu(do, "float16"), qg, kg, vg, o2, lse2, mask=bm,
                                       kernel="tensorcore")
    ref = R.attention_backward_ref(do, q, k, v)
    tols, _ = R.grad_pass_threshold(do, q, k, v, dtype="float16", ref=ref)
    for gname, g, r, t in zip(("dq", "dk", "dv"), grads, ref, tols):
        err = float(np.abs(to_host64(g) - r).max())
        assert err <= t, f"{gname}: {err:.3g} > {t:.3g} (seed {SEED})"
