"""The dense varlen forward's host side, without a GPU (attention_varlen's "tensorcore" path,
kernels_cu/attn_mma.cu: cuflash_fwd_mma_varlen): the dispatch choice, the plans and kernel names,
the compile set, and the parameter blocks run through a transcription of the kernel's block
mapping and segment view (common.cuh: block_coord, batch_offsets, fwd_varlen_segment) on a byte-
addressed memory model, against the float64 varlen reference: every row of every sequence lands
at its own address once (o and lse in FlashAttention's (H, total_q) layout, strided views, grouped
heads, empty sequences), rows of no sequence are never touched."""
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from cuflash import _decode, _dispatch, _launch, _varlen, precompile, reference

from seeds import SEED, case_rng
from varlen_util import make_varlen


def _rng(*key):
    return case_rng(SEED, "varlen_dense_cpu", *key)


def _prob(kernel="auto", max_q=1000, max_k=1000, h=8, hkv=2, d=128, dtype="float16",
          causal=True):
    return SimpleNamespace(kernel=kernel, max_q=max_q, max_k=max_k, h=h, hkv=hkv, d=d, dv=d,
                           dtype_name=dtype, causal=causal)


# ---------------------------------------------------------------------------------------------
# Dispatch

@pytest.mark.parametrize("dense_auto", [False, True])
def test_dispatch_choice(monkeypatch, dense_auto):
    monkeypatch.setattr(_varlen, "VARLEN_DENSE_AUTO", dense_auto)
    # (the mma.sync twin's choice; on sm_90 auto prefers the Hopper twin with VARLEN_HOPPER_AUTO,
    # on by default: the Hopper twin's dispatch test below)
    monkeypatch.setattr(_varlen, "VARLEN_HOPPER_AUTO", False)
    # D = 128 takes direct stores of O (TC_VARLEN_ARCH_CONFIGS: the staged epilogue spilled)
    dense = _dispatch._varlen_kernel(_dispatch.tensorcore_plan(
        "float16", 128, True, 90, config=lambda dpad, cfg: (48, 4, 2, 2, False)))
    assert dense.label == "varlen-tensorcore<float16,D128,BM128,BN48,causal>"
    assert dense.spec.name.startswith("cuflash::cuflash_fwd_mma_varlen<cuflash::fp16_t, 1, 128,")
    # prefill: the dense twin under auto when the flag is on; always under kernel="tensorcore"
    assert _varlen.varlen_plan_for(_prob(), 90) == (dense if dense_auto else _decode.decode_plan(
        "float16", 128, True, paged=False, rows=4 * 1000))
    assert _varlen.varlen_plan_for(_prob("tensorcore"), 90) == dense
    assert _varlen.varlen_plan_for(_prob("decode"), 90).spec.family == "attn_decode"
    # decode-like calls stay on the decode family under auto (few rows a sequence)
    for max_q, h in ((1, 32), (16, 8), (4, 32)):
        prob = _prob(max_q=max_q, h=h, hkv=h // 4 if h > 4 else 1)
        assert _varlen.decode_like(prob)
        assert _varlen.varlen_plan_for(prob, 90).spec.family == "attn_decode"
    assert not _varlen.decode_like(_prob(max_q=17, h=4, hkv=4))      # more than 16 rows
    assert not _varlen.decode_like(_prob(max_q=16, h=32, hkv=2))     # 256 packed rows
    # sm_80 takes its own tile table (48-key tiles at D = 96, 128)
    p80 = _varlen.varlen_plan_for(_prob("tensorcore", d=96, dtype="bfloat16", causal=False), 80)
    assert p80.label == "varlen-" + _dispatch.tensorcore_plan("bfloat16", 96, False, 80).label
    # and at D = 128 direct stores of O on both architectures, where the dense kernel stages O
    for cc in (80, 90):
        p = _varlen.varlen_plan_for(_prob("tensorcore", d=128), cc)
        assert p.label == "varlen-tensorcore<float16,D128,BM128,BN48,causal>"
        assert p.spec.name.endswith("128, 48, 4, 2, 2, false, true>")
        assert "stagedO" in _dispatch.tensorcore_plan("float16", 128, True, cc).label
    # other head dims keep the dense plan's tiles, the staged epilogue included
    p = _varlen.varlen_plan_for(_prob("tensorcore", d=64), 90)
    assert p.label == "varlen-" + _dispatch.tensorcore_plan("float16", 64, True, 90).label


def test_dense_reason_and_explicit_kernel_errors(monkeypatch):
    monkeypatch.setattr(_varlen, "VARLEN_DENSE_AUTO", True)
    assert _varlen.dense_reason(_prob(d=256), 90) is None
    # head dims past the kernel's fall back under auto (the decode check refuses them later) and
    # raise under kernel="tensorcore"
    assert "head dims up to 256" in _varlen.dense_reason(_prob(d=264), 90)
    with pytest.raises(ValueError, match=r"kernel='tensorcore'\) cannot run.*head dims up to 256"):
        _varlen.varlen_plan_for(_prob("tensorcore", d=264), 90)
    with pytest.raises(ValueError, match="max_seqlen_q and max_seqlen_k must be below"):
        _varlen.varlen_plan_for(_prob("tensorcore", max_k=2**31), 90)


def test_kernel_choices_are_checked():
    import cuflash

    q = np.ones((10, 4, 16), np.float16)
    cu = np.array([0, 4, 10], np.int32)
    with pytest.raises(ValueError, match="kernel"):
        cuflash.attention_varlen(q, q, q, cu, cu, 6, 6, kernel="hopper-varlen")
    # NumPy inputs: a GPU kernel name is refused, as "decode" always was
    for kernel in ("decode", "tensorcore", "hopper"):
        with pytest.raises(ValueError, match="selects a GPU kernel"):
            cuflash.attention_varlen(q, q, q, cu, cu, 6, 6, kernel=kernel)
        with pytest.raises(ValueError, match="selects a GPU kernel"):
            cuflash.varlen_dispatch_info(q, q, q, cu, cu, 6, 6, kernel=kernel)
    assert cuflash.varlen_dispatch_info(q, q, q, cu, cu, 6, 6) == "cpu-numpy"
    assert _varlen.VARLEN_KERNELS == ("auto", "decode", "tensorcore", "hopper")


def test_float32_is_not_offered():
    with pytest.raises(ValueError, match="float16 and bfloat16, not float32"):
        _dispatch.varlen_tensorcore_plan("float32", 128, True, 80)


def test_compile_set_holds_the_twins():
    for cc in (80, 90):
        specs = precompile.specialisations(cc)
        want = _dispatch.varlen_forward_kernel_specs(cc)
        # sm_80 also builds sm_86 / sm_89's D = 256 tiles (TC_VARLEN_ARCH_CONFIGS[86])
        assert len(want) == 2 * len(_dispatch.TC_CONFIGS) * 2 + (4 if cc == 80 else 0)
        if cc == 80:
            assert all(_dispatch.varlen_tensorcore_plan(dt, 256, c, 86).spec in want
                       for dt in ("float16", "bfloat16") for c in (False, True))
        assert all(s in specs for s in want)
        assert all("cuflash_fwd_mma_varlen<" in s.name for s in want)


def test_param_structs_mirror_the_kernel():
    src = (Path(__file__).resolve().parents[1] / "kernels_cu" / "common.cuh").read_text()
    body = re.search(r"struct VarlenParams \{(.*?)\};", src, re.S).group(1)
    fields = re.findall(r"\b(\w+);", body)
    assert fields == list(_launch.VARLEN_PARAMS_DTYPE.names)
    assert _launch.VARLEN_PARAMS_DTYPE.itemsize == 5 * 8
    mma = (Path(__file__).resolve().parents[1] / "kernels_cu" / "attn_mma.cu").read_text()
    assert "cuflash_fwd_mma_varlen(const AttnParams p_in, const VarlenParams vl)" in mma


# ---------------------------------------------------------------------------------------------
# The parameter blocks on a memory model

class _Mem:
    """Byte-addressed memory of float64 cells: each region is a flat buffer standing for a
    tensor of `item`-byte elements at a base address."""

    def __init__(self):
        self.regions = []

    def add(self, flat, base, item):
        self.regions.append((base, flat, item))

    def _at(self, addr):
        for base, flat, item in self.regions:
            if base <= addr < base + flat.size * item:
                assert (addr - base) % item == 0, "misaligned element address"
                return flat, (addr - base) // item
        raise AssertionError(f"address {addr:#x} is in no tensor")

    def read(self, addr, n):
        flat, i = self._at(addr)
        assert i + n <= flat.size
        return flat[i:i + n].copy()

    def write(self, addr, vals):
        flat, i = self._at(addr)
        flat[i:i + len(vals)] = vals


class _Fake:
    """A strided view `x` (element strides `estrides`) of a region at `ptr` + `eoff` elements,
    standing for a CuPy array of `item`-byte elements (data.ptr, shape, strides, itemsize)."""

    def __init__(self, shape, estrides, ptr, item):
        self.shape, self.itemsize = tuple(shape), item
        self.strides = tuple(s * item for s in estrides)
        self.data = SimpleNamespace(ptr=ptr)


def _place(mem, x, base, item, pad_heads=0, pad_rows=0):
    """x (n, H, D) into a region with `pad_heads` extra heads and `pad_rows` extra rows (a
    strided view of a larger buffer, its tail poisoned with NaN), starting one row in."""
    n, h, d = x.shape
    buf = np.full((n + 1 + pad_rows, h + pad_heads, d), np.nan)
    buf[1:n + 1, :h] = x
    mem.add(buf.reshape(-1), base, item)
    est = ((h + pad_heads) * d, d, 1)
    return buf, _Fake(x.shape, est, base + (h + pad_heads) * d * item, item)


def _blocks_mma(p, grid, bm, cu_q):
    """(batch entry, query block) of every live block of the mma.sync twin (block_coord, and
    fwd_varlen_segment's exit), one per block."""
    nm = int(p["n_mblocks"])
    heads = int(p["nb1"]) * int(p["nb2"])
    for flat in range(grid):
        b, mblock = flat // nm, nm - 1 - flat % nm
        s = b // heads
        if mblock * bm < cu_q[s + 1] - cu_q[s]:
            yield b, [mblock]


def _blocks_hopper(p, vl, grid, bm, cu_q, causal):
    """The same for the Hopper twin: cuflash_fwd_wgmma_varlen's compact slot numbering
    (common.cuh: varlen_slot, the owner by counting starts), the renumbering in the view, then
    WorkWalk over the sequence's own query blocks (pairs under the causal mask)."""
    heads = int(p["nb1"]) * int(p["nb2"])
    nseq = int(p["nb0"])
    slots = int(vl["slots"])
    group = int(vl["group"])
    assert grid == heads * slots and group >= 1
    rows = (2 * bm if causal else bm) * group
    starts = [int(cu_q[s]) // rows + s for s in range(nseq)]
    for blk in range(grid):
        h, u = blk // slots, blk % slots
        s = sum(st <= u for st in starts) - 1     # the ballot count of varlen_slot
        r = u - starts[s]
        b = s * heads + h
        nm_s = -(-int(cu_q[s + 1] - cu_q[s]) // bm)
        per_s = (nm_s + 1) // 2 if causal else nm_s
        if r * group >= per_s:
            continue
        slot, half, items = b * per_s + r * group, 0, []
        n_slots = b * per_s + min(per_s, (r + 1) * group)   # the view's end
        while slot < n_slots:       # WorkWalk<PAIRS, ONE = true>::next
            rr = slot % per_s
            assert slot // per_s == b
            items.append(rr if half else nm_s - 1 - rr)
            if causal and half == 0 and rr != nm_s - 1 - rr:
                half = 1
            else:
                half = 0
                slot += 1
        yield b, items


def _run_model(p, vl, grid, bm, mem, item, causal, maps=None):
    """Every block of the grid through its block mapping, the segment view and the body's
    addressing (a float64 transcription of the kernels' row/key ranges, masks and stores). With
    `maps` (the Hopper twin: the tensor maps' (address, dims, strides) per tensor), q, k and v
    rows are read through the tensor-map coordinates (row + the sequence's first row, the batch
    coordinates where coord_mask has the axis, zeros past the rows), as TMA does."""
    nb1, nb2 = int(p["nb1"]), int(p["nb2"])
    heads = nb1 * nb2
    cu = {}
    for name in ("cu_q", "cu_k"):
        flat, i = mem._at(int(vl[name]))
        cu[name] = flat[i:].astype(np.int64)
    d = int(p["d"])
    blocks = (_blocks_mma(p, grid, bm, cu["cu_q"]) if maps is None else
              _blocks_hopper(p, vl, grid, bm, cu["cu_q"], causal))
    writes = {}
    for b, mblocks in blocks:
        s, h = b // heads, b % heads
        q0, k0 = cu["cu_q"][s], cu["cu_k"][s]
        sq = cu["cu_q"][s + 1] - q0
        sk = cu["cu_k"][s + 1] - k0
        view = {n: int(p[n]) for n in ("q", "k", "v", "o", "lse")}
        view["q"] += q0 * int(p["q_sr"]) * item
        view["o"] += q0 * int(p["o_sr"]) * item
        view["k"] += k0 * int(p["k_sr"]) * item
        view["v"] += k0 * int(p["v_sr"]) * item
        if view["lse"]:
            view["lse"] += (h * int(vl["lse_hs"]) + q0 - b * sq) * 4
        # batch_offsets
        i2, t = b % nb2, b // nb2
        i1, i0 = t % nb1, t // nb1
        off = {n: i0 * int(p[f"{n}_s0"]) + i1 * int(p[f"{n}_s1"]) + i2 * int(p[f"{n}_s2"])
               for n in "qkvo"}

        def row_of(t, j):
            if maps is None:
                base = {0: view["q"], 1: view["k"], 2: view["v"]}[t]
                n = "qkv"[t]
                return mem.read(base + (off[n] + j * int(p[f"{n}_sr"])) * item, d)
            addr, dims, strides, mask = maps[t]
            row = j + (q0 if t == 0 else k0)
            if row >= dims[1]:
                return np.zeros(d)
            c = [i2 if (mask >> (3 * t + 2)) & 1 else 0, i1 if (mask >> (3 * t + 1)) & 1 else 0,
                 i0 if (mask >> (3 * t)) & 1 else 0]
            for ci, n in zip(c, dims[2:]):
                assert ci < n
            return mem.read(addr + row * strides[0] + sum(ci * st for ci, st in
                                                          zip(c, strides[1:])), d)

        keys = np.array([row_of(1, j) for j in range(sk)]).reshape(sk, d)
        vals = np.array([row_of(2, j) for j in range(sk)]).reshape(sk, d)
        for mblock in mblocks:
            for row in range(mblock * bm, min((mblock + 1) * bm, sq)):
                qr = row_of(0, row)
                lim = min(sk, row + sk - sq + 1) if causal else sk
                if lim <= 0:
                    o_row, lse_row = np.zeros(d), -np.inf
                else:
                    sc = keys[:lim] @ qr * float(p["scale"])
                    m = sc.max()
                    w = np.exp(sc - m)
                    o_row, lse_row = w @ vals[:lim] / w.sum(), m + np.log(w.sum())
                oa = view["o"] + (off["o"] + row * int(p["o_sr"])) * item
                assert oa not in writes, "an output row written twice"
                writes[oa] = True
                mem.write(oa, o_row)
                if view["lse"]:
                    mem.write(view["lse"] + (b * sq + row) * 4, [lse_row])


@pytest.mark.parametrize("family,group", [("attn_mma", 1), ("attn_wgmma", 1), ("attn_wgmma", 2),
                                          ("attn_wgmma", 3), ("attn_wgmma", 4)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 1)], ids=lambda x: f"H{x[0]}kv{x[1]}")
@pytest.mark.parametrize("lens", [([5, 1, 0, 40, 3, 17], [6, 3, 4, 1, 0, 33]), ([1], [1]),
                                  ([33, 2], [2, 33]), ([70, 9, 64], [70, 90, 1]),
                                  ([32, 31, 1, 33, 64, 0, 16, 17], [1, 2, 3, 40, 5, 6, 7, 8])],
                         ids=lambda x: "q" + "-".join(map(str, x[0])))
def test_parameter_block_on_the_memory_model(lens, heads, causal, family, group, monkeypatch):
    """The parameter blocks `dense_params` builds for strided packed views (extra heads and rows
    in the buffers), lse (H, total_q) with a padded head stride, through each twin's block
    mapping and addressing (the Hopper one's through its tensor maps; group: the slots a Hopper
    block walks, VARLEN_HOPPER_GROUP): each sequence's rows equal the float64 reference, every row
    is written once, nothing else is written."""
    from cuflash import _tma

    monkeypatch.setattr(_varlen, "VARLEN_HOPPER_GROUP", group)
    rng = _rng("model", tuple(lens[0]), heads, causal, family)
    h, hkv = heads
    d, item, bm = 8, 2, 16
    q, k, v, cu_q, cu_k = make_varlen(rng, np.array(lens[0]), np.array(lens[1]), h, hkv, d,
                                      "float64")
    mem = _Mem()
    qb, fq = _place(mem, q, 1 << 24, item, pad_heads=1)
    kb, fk = _place(mem, k, 2 << 24, item, pad_heads=2, pad_rows=3)
    vb, fv = _place(mem, v, 3 << 24, item)
    ob, fo = _place(mem, np.full(q.shape, np.nan), 4 << 24, item, pad_heads=3, pad_rows=2)
    total_q = q.shape[0]
    lse_buf = np.full((h, total_q + 5), np.nan)
    mem.add(lse_buf.reshape(-1), 5 << 24, 4)
    flse = _Fake((h, total_q), (total_q + 5, 1), 5 << 24, 4)
    cuq = np.asarray(cu_q, np.float64)
    cuk = np.asarray(cu_k, np.float64)
    mem.add(cuq, 6 << 24, 4)
    mem.add(cuk, 7 << 24, 4)
    fcq, fck = (_Fake((len(lens[0]) + 1,), (1,), base, 4) for base in (6 << 24, 7 << 24))
    max_q, max_k = max(1, max(lens[0])), max(1, max(lens[1]))
    prob = SimpleNamespace(q=fq, k=fk, v=fv, cu_q=fcq, cu_k=fck, max_q=max_q, max_k=max_k,
                           nseq=len(lens[0]), h=h, hkv=hkv, d=d, dv=d, scale=0.3, causal=causal,
                           dtype_name="float16")
    hopper = family == "attn_wgmma"
    plan = SimpleNamespace(block_m=bm, block_n=16, pairs=hopper and causal, presplit_dpad=0,
                           spec=SimpleNamespace(family=family))
    encoded = []

    def fake_encode(dtype_name, address, dims, strides, box):
        encoded.append((address, list(dims), list(strides), list(box)))
        return bytes(128)
    monkeypatch.setattr(_tma, "encode_tiled", fake_encode)
    p, vl, grid = _varlen.dense_params(plan, prob, fo, flse)
    nm = -(-max_q // bm)
    if hopper:   # the compact grid: floor(total_q / U) + B slots a head
        assert grid == (total_q // ((2 * bm if causal else bm) * group) + len(lens[0])) * h
        assert int(vl["group"]) == group
        assert int(vl["slots"]) * h == grid
    else:
        assert grid == nm * len(lens[0]) * h and int(vl["slots"]) == 0
    assert (p["sq"], p["sk"], p["nb0"], p["nb1"], p["nb2"]) == (max_q, max_k, len(lens[0]), hkv,
                                                                h // hkv)
    assert int(vl["lse_hs"]) == total_q + 5 and int(vl["cu_q"]) == 6 << 24
    maps = None
    if hopper:
        assert p.dtype == _launch.HOPPER_PARAMS_DTYPE and len(encoded) == 3
        mask = int(p["coord_mask"])
        maps = [(a, dims, strides, mask) for a, dims, strides, _ in encoded]
        assert [e[1][1] for e in encoded] == [q.shape[0], k.shape[0], k.shape[0]]
        assert [e[3][1] for e in encoded] == [bm, 16, 16]
    _run_model(p, vl, grid, bm, mem, item, causal, maps)
    o_ref, lse_ref = reference.attention_varlen_ref(q, k, v, cu_q, cu_k, causal=causal,
                                                    scale=0.3)
    o = ob[1:total_q + 1, :h]
    np.testing.assert_allclose(o, o_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse_buf[:, :total_q], lse_ref, rtol=1e-12, atol=1e-12)
    # nothing outside the sequences' rows and heads was written
    assert np.isnan(ob[0]).all() and np.isnan(ob[total_q + 1:]).all() and \
        np.isnan(ob[:, h:]).all()
    assert np.isnan(lse_buf[:, total_q:]).all()
    # the inputs were only read
    assert np.array_equal(qb[1:total_q + 1, :h], q) and np.array_equal(kb[1:k.shape[0] + 1, :hkv], k)


def _hopper_prob(kernel="hopper", d=128, causal=True, max_q=1000, max_k=3000, total=5000):
    prob = _prob(kernel, max_q=max_q, max_k=max_k, d=d, causal=causal)
    prob.q = _Fake((total, 8, d), (8 * d, d, 1), 1 << 20, 2)
    prob.k = prob.v = _Fake((total, 2, d), (2 * d, d, 1), 2 << 20, 2)
    return prob


def test_hopper_dispatch(monkeypatch):
    from cuflash import _tma

    monkeypatch.setattr(_tma, "available", lambda: True)
    for causal in (False, True):
        plan = _varlen.varlen_plan_for(_hopper_prob(causal=causal), 90)
        assert "asyncO" not in plan.label   # the twin keeps the direct stores (HOPPER_ASYNC_O)
        with monkeypatch.context() as mp:   # ... so its plan is the dense one without it
            mp.setattr(_dispatch, "HOPPER_ASYNC_O", False)
            dense = _dispatch.hopper_plan("float16", 128, causal, 3000, sq=1000)
        assert plan.label == "varlen-" + dense.label.replace("persistent,", "")
        assert plan.spec.name == dense.spec.name.replace("cuflash_fwd_wgmma<",
                                                         "cuflash_fwd_wgmma_varlen<")
        assert plan.spec.arch == "sm_90a" and not plan.persistent and plan.pairs == causal
        assert (plan.block_m, plan.block_n, plan.threads, plan.smem_bytes) == \
            (dense.block_m, dense.block_n, dense.threads, dense.smem_bytes)
        assert plan.spec in _dispatch.varlen_hopper_kernel_specs()
        assert plan.spec in precompile.specialisations(90)
        # with the twin's 1024 bytes of static shared memory it fits the H200's 227 KiB
        assert plan.smem_bytes + _varlen.VARLEN_STATIC_SMEM["attn_wgmma"] <= 232448
    for dpad in (64, 128, 256):
        for causal in (False, True):
            for mq, mk in ((100, 100), (8192, 8192)):
                plan = _dispatch.varlen_hopper_plan("bfloat16", dpad, causal, mq, mk)
                assert plan.smem_bytes + _varlen.VARLEN_STATIC_SMEM["attn_wgmma"] <= 232448
                assert plan.spec in _dispatch.varlen_hopper_kernel_specs()
    with pytest.raises(ValueError, match=r"kernel='hopper'\) cannot run.*compute capability 9"):
        _varlen.varlen_plan_for(_hopper_prob(), 80)
    with pytest.raises(ValueError, match=r"kernel='hopper'\) cannot run.*from 64"):
        _varlen.varlen_plan_for(_hopper_prob(d=32), 90)
    monkeypatch.setattr(_tma, "available", lambda: False)
    with pytest.raises(ValueError, match="tensor-map API"):
        _varlen.varlen_plan_for(_hopper_prob(), 90)
    monkeypatch.setattr(_tma, "available", lambda: True)
    # auto: the Hopper twin only with both flags, where it can run; else the mma.sync twin
    monkeypatch.setattr(_varlen, "VARLEN_DENSE_AUTO", True)
    for hopper_auto in (False, True):
        monkeypatch.setattr(_varlen, "VARLEN_HOPPER_AUTO", hopper_auto)
        label90 = _varlen.varlen_plan_for(_hopper_prob("auto"), 90).label
        assert label90.startswith("varlen-hopper<" if hopper_auto else "varlen-tensorcore<")
        assert _varlen.varlen_plan_for(_hopper_prob("auto"), 80).label.startswith(
            "varlen-tensorcore<")
        assert _varlen.varlen_plan_for(_hopper_prob("auto", d=32), 90).label.startswith(
            "varlen-tensorcore<")
        assert _varlen.varlen_plan_for(_hopper_prob("auto", max_q=1), 90).spec.family == \
            "attn_decode"
