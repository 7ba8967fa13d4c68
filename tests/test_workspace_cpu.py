"""workspace= of the decode-path entry points without a GPU (issue 14): the size queries, the
workspace layout and its checks, and where the launch puts the split partials, with stand-in
arrays and recorded launches (tests/test_workspace_gpu.py runs the same on a GPU)."""
import contextlib
import types

import numpy as np
import pytest

import cuflash
from cuflash import _compile, _decode, _kvcache, _launch, _varlen

from test_backward_cpu import launches  # noqa: F401  (the recorded-launches fixture)

#: An H200's limits (what the split choice reads).
ATTRS = {"max_smem_optin": 232448, "sm_count": 132, "compute_capability": 90}
ALIGN = _launch.WORKSPACE_ALIGN


def _align(n):
    return -(-n // ALIGN) * ALIGN


class FakeArray:
    """What the decode launch and the workspace checks read from a CuPy array."""

    def __init__(self, shape, ptr, itemsize=2):
        self.shape, self.itemsize, self.ndim = tuple(shape), itemsize, len(shape)
        self.strides = tuple(int(np.prod(shape[i + 1:])) * itemsize for i in range(len(shape)))
        self.data = types.SimpleNamespace(ptr=ptr)
        self.nbytes = int(np.prod(shape)) * itemsize

    def __getitem__(self, sl):  # a flat uint8 workspace sliced from an offset
        assert self.ndim == 1 and self.itemsize == 1 and sl.step is None and sl.stop is None
        return FakeArray((self.shape[0] - sl.start,), self.data.ptr + sl.start, 1)


def _formula(entries, splits, rows, d, mt=1):
    """The documented size: align(4 E s R Dpad) + align(4 E s R) with more than one split,
    R = rows rounded up to the plan's 16 MT rows per block."""
    if splits == 1:
        return 0
    r = 16 * mt * -(-rows // (16 * mt))
    dpad = _decode.head_dim_bucket(d, _decode.DECODE_DPADS)
    return _align(4 * entries * splits * r * dpad) + _align(4 * entries * splits * r)


# ---------------------------------------------------------------------------------------------
# The size of the split partials

@pytest.mark.parametrize("sizes,g,sq,sk,d", [
    ((1, 1, 8), 4, 1, 131072, 128),    # B = 1, Hkv = 8, Sk = 128k: one full wave of splits
    ((1, 64, 8), 4, 1, 8192, 128),     # B = 64: a few splits
    ((1, 1, 1), 32, 1, 1000, 64),      # MQA, 32 packed rows
    ((1, 2, 4), 3, 7, 113, 96),        # 21 rows (two row tiles), padded head dim
    ((1, 512, 32), 1, 1, 64, 128),     # many entries, short keys: no split
    ((1, 1, 1), 1, 1, 1, 256),
])
def test_decode_partials_size(sizes, g, sq, sk, d):
    plan = _decode.decode_plan("float16", d, False, paged=False, rows=g * sq)
    mt = plan.block_m // 16
    cfg = _decode.configure(plan, sizes, g, sq, sk, d, ATTRS)
    entries = sizes[0] * sizes[1] * sizes[2]
    n_tiles = -(-sk // _decode.DECODE_BN)
    assert cfg.entries == entries and cfg.rows == g * sq
    assert cfg.n_rtiles == mt * -(-g * sq // (16 * mt))
    assert 1 <= cfg.splits <= _decode.MAX_SPLITS
    assert cfg.splits * cfg.split_tiles >= n_tiles > (cfg.splits - 1) * cfg.split_tiles
    assert cfg.grid == entries * (cfg.n_rtiles // mt) * cfg.splits
    assert cfg.part_bytes == _formula(entries, cfg.splits, g * sq, d, mt)
    assert cfg.part_bytes % ALIGN == 0 and cfg.o_part_bytes % ALIGN == 0
    if sk == 131072:
        assert cfg.splits > 1 and cfg.part_bytes > 0   # the case the workspace exists for
    if sk <= 64:
        assert cfg.splits == 1 and cfg.part_bytes == 0


def test_configure_checks_the_device():
    plan = _decode.decode_plan("bfloat16", 256, True, paged=True)
    with pytest.raises(ValueError, match="bytes of shared memory per block"):
        _decode.configure(plan, (1, 1, 1), 1, 1, 100, 256, dict(ATTRS, max_smem_optin=48 * 1024))
    with pytest.raises(ValueError, match="below 2\\*\\*31"):
        _decode.configure(plan, (1, 1, 1), 1, 1, 2**31, 256, ATTRS)


def test_grid_limits_refuse_only_launches_that_exceed_them(monkeypatch):
    """The combine's grid (packed rows of every entry, CB) bounds a launch only when the keys
    are split; with one split no combine runs, so more than 2**31 - 1 packed rows in all (B x
    Hkv entries of G x Sq rows; the main grid has one block per 16 MT of them) still launch.
    The main grid's own limit and a split launch's combine limit still refuse."""
    from cuflash._launch import MAX_GRID_X

    plan = _decode.decode_plan("float16", 64, False, paged=False, rows=32)
    entries = 2**26                        # 2**31 packed rows at G = 32: one block each of 32
    cfg = _decode.configure(plan, (1, 1, entries), 32, 1, 64, 64, ATTRS)
    assert cfg.splits == 1 and cfg.grid == entries < MAX_GRID_X
    assert cfg.entries * cfg.rows > MAX_GRID_X
    with pytest.raises(ValueError, match="too many for one launch"):   # 2**32 row blocks
        _decode.configure(_decode.decode_plan("float16", 64, False, paged=False, rows=1),
                          (1, 1, 2**32), 1, 1, 64, 64, ATTRS)
    # a split launch with a combine grid past the limit is refused (the split rule keeps the
    # blocks to ~8 waves, so only a forced split count reaches it)
    monkeypatch.setattr(_decode, "choose_splits", lambda *a, **k: 2)
    with pytest.raises(ValueError, match="combine rows is too many for one launch"):
        _decode.configure(plan, (1, 1, entries), 32, 1, 64, 64, ATTRS)


def test_dense_query_follows_the_grouped_heads():
    """attention's size for a grouped-query decode step: entries = B x Hkv, G = H / Hkv rows,
    computed from the checked problem the call would launch (NumPy arrays stand in for the GPU
    ones: the size needs shapes and strides only)."""
    from cuflash import _checks

    for b, h, hkv, sk, lse in ((1, 32, 8, 131072, False), (3, 16, 2, 5000, True),
                               (2, 8, 8, 70000, True)):
        q = np.zeros((b, h, 1, 128), np.float16)
        k = np.zeros((b, hkv, 1, 128), np.float16)     # Sk only matters through the problem
        kb = np.lib.stride_tricks.as_strided(k, (b, hkv, sk, 128), (hkv * 256, 256, 0, 2))
        prob = _checks.check_attention(q, kb, kb, causal=False, scale=None, return_lse=lse,
                                       out=None, stream=None, kernel="auto")
        plan = _decode.decode_plan("float16", 128, False, paged=False)
        got = _decode.dense_workspace_bytes(plan, prob, ATTRS)
        cfg = _decode.configure(plan, (1, b, hkv), h // hkv, 1, sk, 128, ATTRS)
        assert got == cfg.part_bytes == _formula(b * hkv, cfg.splits, h // hkv, 128)
        assert got > 0


def _kv_prob(*, b=4, h=32, hkv=8, sq=1, d=128, snew=0, capacity=16384, page=0, seqlens_int=None):
    return types.SimpleNamespace(dtype_name="float16", d=d, causal=False, b=b, h=h, hkv=hkv,
                                 sq=sq, snew=snew, capacity=capacity, page=page,
                                 block_table=object() if page else None, seqlens_int=seqlens_int)


def test_documented_partial_rows_follow_the_row_blocks():
    """The workspace layout the docstrings and notes/INFERENCE.md give: R packed rows per entry
    and split are G * Sq (G * max_seqlen_q) rounded up to the block's 16 MT rows, i.e. to 32
    when G * Sq > 16 and Dpad <= 128 (MT = 2). They said ``16 * ceil(G * Sq / 16)``, which at
    G * Sq = 48, D = 128 gives 48 rows where the launch has 64: a workspace sized by it is
    refused."""
    from pathlib import Path

    for rows, d, r in ((48, 128, 64), (17, 64, 32), (16, 128, 16), (48, 256, 48), (3, 96, 16)):
        plan = _decode.decode_plan("float16", d, False, paged=False, rows=rows)
        cfg = _decode.configure(plan, (1, 1, 8), rows, 1, 131072, d, ATTRS)
        assert cfg.splits > 1 and 16 * cfg.n_rtiles == r
        dpad = _decode.head_dim_bucket(d, _decode.DECODE_DPADS)
        assert cfg.part_bytes == _align(4 * 8 * cfg.splits * r * dpad) + _align(
            4 * 8 * cfg.splits * r)
    notes = (Path(__file__).resolve().parent.parent / "notes" / "INFERENCE.md").read_text()
    docs = {"attention": cuflash.attention.__doc__,
            "attention_with_kvcache": cuflash.attention_with_kvcache.__doc__,
            "attention_varlen": cuflash.attention_varlen.__doc__, "notes": notes}
    for name, doc in docs.items():
        flat = " ".join(doc.split())
        assert "ceil(G * Sq / 16)" not in flat and "ceil(G Sq / 16)" not in flat, name
        assert "ceil(G * max_seqlen_q / 16)" not in flat, name
        assert "of 32 when" in flat and "<= 128" in flat, name


@pytest.mark.parametrize("snew", [0, 1, 4])
@pytest.mark.parametrize("seqlens_int", [None, 0, 9000])
@pytest.mark.parametrize("page", [0, 16])
def test_kvcache_workspace_layout(snew, seqlens_int, page):
    prob = _kv_prob(snew=snew, seqlens_int=seqlens_int, page=page, b=1, sq=2)
    plan, cfg, need = _kvcache.kvcache_launch(prob, ATTRS)
    assert plan.label.startswith("decode<float16,D128") and ("paged" in plan.label) == bool(page)
    # an int cache_seqlens: the grid covers its length (+ Snew); an array: the capacity
    keys = prob.capacity if seqlens_int is None else seqlens_int + snew
    ref = _decode.configure(plan, (1, 1, 8), 4, 2, keys, 128, ATTRS)
    assert cfg == ref
    lens = _align(4 * prob.b) if snew else 0
    assert need == lens + _formula(8, cfg.splits, 8, 128)
    if keys > 4096:
        assert cfg.splits > 1


def test_varlen_workspace_layout():
    prob = types.SimpleNamespace(dtype_name="bfloat16", d=64, dv=64, causal=True, nseq=2, h=16,
                                 hkv=4, max_q=3, max_k=60000, kernel="auto")
    plan, cfg, need = _varlen.varlen_launch(prob, ATTRS)
    assert cfg == _decode.configure(plan, (1, 2, 4), 4, 3, 60000, 64, ATTRS)
    assert cfg.splits > 1 and need == _formula(8, cfg.splits, 12, 64)
    # the dense mma.sync twin (kernel="tensorcore") needs no workspace
    prob.kernel = "tensorcore"
    plan, cfg, need = _varlen.varlen_launch(prob, ATTRS)
    assert plan.label.startswith("varlen-tensorcore<") and cfg is None and need == 0


# ---------------------------------------------------------------------------------------------
# The public queries and checks on NumPy inputs

def _kv_args():
    q = np.ones((2, 1, 8, 16), np.float32)
    kc = np.ones((2, 32, 2, 16), np.float32)
    return q, kc, kc, np.array([3, 4], np.int32)


def _varlen_args():
    q = np.ones((10, 4, 16), np.float32)
    cu = np.array([0, 4, 10], np.int32)
    return q, q, q, cu, cu, 6, 6


def test_queries_are_zero_on_numpy_inputs_and_validate():
    x = np.ones((2, 8, 16), np.float32)
    assert cuflash.attention_workspace_size(x, x, x) == 0
    assert cuflash.attention_workspace_size(x, x, x, causal=True, return_lse=True) == 0
    assert cuflash.attention_with_kvcache_workspace_size(*_kv_args()) == 0
    assert cuflash.attention_with_kvcache_workspace_size(
        *_kv_args(), k_new=np.ones((2, 1, 2, 16), np.float32),
        v_new=np.ones((2, 1, 2, 16), np.float32)) == 0
    assert cuflash.attention_varlen_workspace_size(*_varlen_args()) == 0
    # they validate like the calls
    with pytest.raises(ValueError, match="do not broadcast"):
        cuflash.attention_workspace_size(x, x[:1].repeat(3, 0), x[:1].repeat(3, 0))
    with pytest.raises(ValueError, match="inputs are on the CPU"):
        cuflash.attention_workspace_size(x, x, x, kernel="decode")
    q, kc, vc, lens = _kv_args()
    with pytest.raises(ValueError, match="lie in"):
        cuflash.attention_with_kvcache_workspace_size(q, kc, vc, np.array([3, 33], np.int32))
    with pytest.raises(ValueError, match="more than max_seqlen"):
        cuflash.attention_varlen_workspace_size(*_varlen_args()[:5], 5, 6)


def test_workspace_on_numpy_inputs_is_refused():
    x = np.ones((2, 8, 16), np.float32)
    ws = np.zeros(1024, np.uint8)
    msg = "workspace= applies to GPU inputs only"
    with pytest.raises(ValueError, match=msg):
        cuflash.attention(x, x, x, workspace=ws)
    with pytest.raises(ValueError, match=msg):
        cuflash.attention_with_kvcache(*_kv_args(), workspace=ws)
    with pytest.raises(ValueError, match=msg):
        cuflash.attention_varlen(*_varlen_args(), workspace=ws)
    # and the NumPy results without it are unchanged
    np.testing.assert_array_equal(cuflash.attention(x, x, x), cuflash.attention(x, x, x))


def test_int_cache_seqlens_is_checked_on_the_host():
    q, kc, vc, _ = _kv_args()
    for bad in (-1, 33):
        with pytest.raises(ValueError, match="cache_seqlens must lie in \\[0, 32\\]"):
            cuflash.attention_with_kvcache(q, kc, vc, bad)
    kn = np.ones((2, 2, 2, 16), np.float32)
    with pytest.raises(ValueError, match="lie in \\[0, 30\\].*with 2 appended.*got 31"):
        cuflash.attention_with_kvcache(q, kc.copy(), vc.copy(), 31, k_new=kn, v_new=kn)
    # an int gives the same result as the array of that length
    o1 = cuflash.attention_with_kvcache(q, kc, vc, 5)
    o2 = cuflash.attention_with_kvcache(q, kc, vc, np.array([5, 5], np.int32))
    np.testing.assert_array_equal(o1, o2)


# ---------------------------------------------------------------------------------------------
# The checks of a caller's workspace and where the launch puts the partials

def test_scratch_checks_size_and_alignment():
    ws = FakeArray((4096,), 1 << 44, 1)
    assert _decode.scratch(4096, ws, None, "attention_workspace_size") is ws
    assert _decode.scratch(0, ws, None, "attention_workspace_size") is ws
    assert _decode.scratch(0, None, None, "attention_workspace_size") is None
    with pytest.raises(ValueError, match="workspace has 4096 bytes; this call needs 4097 "
                                         "\\(cuflash.attention_varlen_workspace_size\\)"):
        _decode.scratch(4097, ws, None, "attention_varlen_workspace_size")
    with pytest.raises(ValueError, match="256-byte boundary"):
        _decode.scratch(16, FakeArray((4096,), (1 << 44) + 16, 1), None,
                        "attention_workspace_size")


def _geom(sizes, g, sq, sk, d):
    return _decode.DecodeGeometry(sizes=sizes, g=g, sq=sq, sk=sk, d=d, q=(0, 0, 0, 0, d),
                                  o=(0, 0, 0, 0, d), l=(0, 0, 0, 0, 1), k=(0, 0, 0, d),
                                  v=(0, 0, 0, d))


def test_launch_puts_the_partials_in_the_workspace(launches):
    plan = _decode.decode_plan("float16", 128, False, paged=False)
    geom = _geom((1, 1, 8), 4, 1, 131072, 128)
    cfg = _decode.configure(plan, geom.sizes, geom.g, geom.sq, geom.sk, geom.d, ATTRS)
    assert cfg.splits > 1
    ptr = iter(range(1 << 24, 1 << 40, 1 << 24))
    q, k, v, o = (FakeArray((8, 4, 128), next(ptr)) for _ in range(4))
    lse = FakeArray((8, 4), next(ptr), 4)
    base = 1 << 44
    ws = FakeArray((cfg.part_bytes + 512,), base, 1)
    _decode.launch(plan, geom, q, k, v, o, lse, scale=0.1, device_id=0, stream=None, cfg=cfg,
                   parts=ws[512:])
    comb = _decode.combine_spec("float16", 128, 1 if _decode.DECODE_VERSION == 1 else 2)
    assert [r[0] for r in launches] == [plan.spec.name, comb.name]
    p = launches[0][3]
    assert int(p["o_part"]) == base + 512
    assert int(p["lse_part"]) == base + 512 + cfg.o_part_bytes
    assert int(p["n_splits"]) == cfg.splits and launches[0][1] == cfg.grid
    assert bytes(launches[1][3]) == bytes(p)
    # the lse partials end inside the workspace
    end = int(p["lse_part"]) + 4 * cfg.entries * cfg.splits * 16 * cfg.n_rtiles
    assert end <= base + ws.nbytes
    launches.clear()
    with pytest.raises(ValueError, match="split partials need"):
        _decode.launch(plan, geom, q, k, v, o, lse, scale=0.1, device_id=0, stream=None,
                       cfg=cfg, parts=None)
    assert not launches


def test_one_split_needs_no_workspace(launches):
    plan = _decode.decode_plan("float16", 64, True, paged=False)
    geom = _geom((1, 64, 8), 1, 1, 64, 64)
    cfg = _decode.configure(plan, geom.sizes, geom.g, geom.sq, geom.sk, geom.d, ATTRS)
    assert cfg.splits == 1 and cfg.part_bytes == 0
    x = FakeArray((512, 64), 1 << 30)
    _decode.launch(plan, geom, x, x, x, x, None, scale=0.1, device_id=0, stream=None, cfg=cfg)
    assert len(launches) == 1 and int(launches[0][3]["o_part"]) == 0


# ---------------------------------------------------------------------------------------------
# The GPU paths end to end with a stand-in CuPy (what runs on the host: checks, layout, which
# buffer each launch reads and writes, on which stream; no device)

class GArr:
    """A stand-in CuPy array: shape, dtype, strides, a pointer; flat views and slices."""

    def __init__(self, shape, dtype, ptr, log, strides=None, device=0):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.itemsize, self.ndim = self.dtype.itemsize, len(self.shape)
        contiguous = tuple(int(np.prod(self.shape[i + 1:])) * self.itemsize
                           for i in range(self.ndim))
        self.strides = contiguous if strides is None else tuple(strides)
        self.size = int(np.prod(self.shape))
        self.nbytes = self.size * self.itemsize
        self.data = types.SimpleNamespace(ptr=ptr, device_id=device)
        self.device = types.SimpleNamespace(id=device)
        self.flags = types.SimpleNamespace(c_contiguous=self.strides == contiguous)
        self._log = log

    def _like(self, shape, dtype=None, ptr=None):
        return GArr(shape, dtype or self.dtype, self.data.ptr if ptr is None else ptr, self._log)

    def reshape(self, *shape):
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        assert self.flags.c_contiguous
        shape = tuple(self.size // -int(np.prod(shape)) if n == -1 else n for n in shape)
        return self._like(shape)

    def view(self, dtype):
        assert self.ndim == 1 and self.flags.c_contiguous
        return self._like((self.nbytes // np.dtype(dtype).itemsize,), dtype)

    def __getitem__(self, sl):
        assert self.ndim == 1 and isinstance(sl, slice) and sl.step is None
        start, stop, _ = sl.indices(self.shape[0])
        return self._like((stop - start,), ptr=self.data.ptr + start * self.itemsize)

    def fill(self, value):
        self._log.append(("fill", self.data.ptr, self.nbytes, float(value)))


@pytest.fixture
def fakecp(monkeypatch):
    import sys

    log = []
    ptrs = iter(range(1 << 32, 1 << 44, 1 << 26))
    current = []

    class Stream:
        def __init__(self, ptr):
            self.ptr = ptr

        def __enter__(self):
            current.append(self)
            return self

        def __exit__(self, *a):
            current.pop()
            return False

    default = Stream(0)

    cp = types.ModuleType("cupy")
    cp.ndarray = GArr
    cp.float32, cp.int32, cp.uint8 = np.float32, np.int32, np.uint8

    def empty(shape, dtype):
        shape = (shape,) if isinstance(shape, int) else shape
        a = GArr(shape, dtype, next(ptrs), log)
        log.append(("malloc", a.nbytes, (current or [default])[-1].ptr))
        return a

    def add(a, b, out):
        log.append(("add", a.data.ptr, int(b), out.data.ptr, (current or [default])[-1].ptr))

    cp.empty, cp.add = empty, add
    cp.cuda = types.SimpleNamespace(Device=lambda i: contextlib.nullcontext(),
                                   runtime=types.SimpleNamespace(getDevice=lambda: 0),
                                   ExternalStream=Stream,
                                   get_current_stream=lambda: (current or [default])[-1])
    monkeypatch.setitem(sys.modules, "cupy", cp)

    def get_kernel(spec, dev, smem=0):
        def kernel(grid, block, args, shared_mem=0, stream=None):
            log.append(("launch", spec.name, grid[0], args[0], stream.ptr))
        return kernel

    monkeypatch.setattr(_compile, "get_kernel", get_kernel)
    monkeypatch.setitem(_launch._DEVICE_ATTRS, 0, ATTRS)
    monkeypatch.setattr(_launch, "_PARAM_CACHE", type(_launch._PARAM_CACHE)())
    from cuflash import _callcache

    _callcache.clear()
    ns = types.SimpleNamespace(log=log, new=lambda shape, dtype="float16": empty(shape, dtype),
                               stream=Stream(0xABC0))
    yield ns
    _callcache.clear()


def _events(log, kind):
    return [e for e in log if e[0] == kind]


def test_attention_decode_path_uses_the_workspace(fakecp):
    q = fakecp.new((1, 32, 1, 128))
    k = fakecp.new((1, 8, 20000, 128))
    o, lse = fakecp.new((1, 32, 1, 128)), fakecp.new((1, 32, 1), "float32")
    size = cuflash.attention_workspace_size(q, k, k, return_lse=True, out=(o, lse))
    assert size > 0
    ws = fakecp.new((size,), "uint8")
    fakecp.log.clear()
    res = cuflash.attention(q, k, k, return_lse=True, out=(o, lse), workspace=ws,
                            stream=fakecp.stream)
    assert res[0] is o and res[1] is lse
    assert not _events(fakecp.log, "malloc"), "nothing allocated with out= and workspace="
    dec, comb = _events(fakecp.log, "launch")
    assert dec[1].startswith("cuflash::cuflash_attn_decode<cuflash::fp16_t, 128,")
    assert comb[1].startswith("cuflash::cuflash_decode_combine")
    p = dec[3]
    assert int(p["n_splits"]) > 1 and int(p["g"]) == 4 and int(p["nb2"]) * int(p["nb1"]) == 8
    cfg_bytes = _align(4 * 8 * int(p["n_splits"]) * 16 * 128)
    assert int(p["o_part"]) == ws.data.ptr and int(p["lse_part"]) == ws.data.ptr + cfg_bytes
    assert dec[4] == comb[4] == fakecp.stream.ptr
    # too small: refused before any launch
    fakecp.log.clear()
    with pytest.raises(ValueError, match="this call needs .*attention_workspace_size"):
        cuflash.attention(q, k, k, return_lse=True, out=(o, lse), workspace=ws[:size - 1])
    assert not _events(fakecp.log, "launch")
    # without workspace: one allocation of the partials, made on the launch stream
    cuflash.attention(q, k, k, return_lse=True, out=(o, lse), stream=fakecp.stream)
    assert _events(fakecp.log, "malloc") == [("malloc", size, fakecp.stream.ptr)]


@pytest.mark.parametrize("lens_kind", ["array", "int"])
@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_path_uses_the_workspace(fakecp, lens_kind, paged):
    b, hkv, h, d, snew = 2, 2, 8, 128, 3
    q = fakecp.new((b, 1, h, d))
    if paged:
        kc = fakecp.new((2 * 600, 16, hkv, d))
        bt = fakecp.new((b, 600), "int32")
    else:
        kc, bt = fakecp.new((b, 9600, hkv, d)), None
    kn = fakecp.new((b, snew, hkv, d))
    lens = fakecp.new((b,), "int32") if lens_kind == "array" else 9000
    kw = dict(block_table=bt, k_new=kn, v_new=kn)
    size = cuflash.attention_with_kvcache_workspace_size(q, kc, kc, lens, **kw)
    ws = fakecp.new((size,), "uint8")
    o = fakecp.new((b, 1, h, d))
    fakecp.log.clear()
    cuflash.attention_with_kvcache(q, kc, kc, lens, **kw, out=o, workspace=ws,
                                   stream=fakecp.stream)
    log = fakecp.log
    assert not _events(log, "malloc")
    kernels = _events(log, "launch")
    assert [e[1].split("<")[0] for e in kernels] == [
        "cuflash::cuflash_kv_append", "cuflash::cuflash_attn_decode",
        "cuflash::cuflash_decode_combine"]
    app, dec = kernels[0][3], kernels[1][3]
    assert all(e[4] == fakecp.stream.ptr for e in kernels)
    assert int(dec["o_part"]) == ws.data.ptr + 256 and int(dec["n_splits"]) > 1
    assert size == 256 + _formula(b * hkv, int(dec["n_splits"]), h // hkv, d)
    if lens_kind == "array":   # append from the caller's lengths; decode from lengths + Snew
        assert int(app["seqlens"]) == lens.data.ptr
        assert _events(log, "add") == [("add", lens.data.ptr, snew, ws.data.ptr,
                                        fakecp.stream.ptr)]
        assert int(dec["seqlens"]) == ws.data.ptr and int(dec["sk"]) == kc.shape[1] * (
            600 if paged else 1)
    else:                      # the int: append positions in the workspace, decode over L keys
        assert _events(log, "fill") == [("fill", ws.data.ptr, 4 * b, 9000.0)]
        assert int(app["seqlens"]) == ws.data.ptr
        assert int(dec["seqlens"]) == 0 and int(dec["sk"]) == 9000 + snew
    assert log.index(_events(log, "add" if lens_kind == "array" else "fill")[0]) < \
        log.index(kernels[1])


def test_kvcache_int_zero_launches_nothing(fakecp):
    q, kc = fakecp.new((2, 1, 4, 64)), fakecp.new((2, 64, 2, 64))
    o, lse = fakecp.new((2, 1, 4, 64)), fakecp.new((2, 4, 1), "float32")
    fakecp.log.clear()
    cuflash.attention_with_kvcache(q, kc, kc, 0, return_lse=True, out=(o, lse))
    assert not _events(fakecp.log, "launch") and not _events(fakecp.log, "malloc")
    assert _events(fakecp.log, "fill") == [("fill", o.data.ptr, o.nbytes, 0.0),
                                           ("fill", lse.data.ptr, lse.nbytes, -np.inf)]


def test_varlen_path_uses_the_workspace(fakecp):
    q, k = fakecp.new((40, 16, 64)), fakecp.new((20000, 4, 64))
    cu = fakecp.new((4,), "int32")
    args = (q, k, k, cu, cu, 16, 9000)
    size = cuflash.attention_varlen_workspace_size(*args)
    assert size > 0
    ws, o = fakecp.new((size,), "uint8"), fakecp.new((40, 16, 64))
    fakecp.log.clear()
    cuflash.attention_varlen(*args, out=o, workspace=ws)
    assert not _events(fakecp.log, "malloc")
    dec = _events(fakecp.log, "launch")[0][3]
    assert int(dec["o_part"]) == ws.data.ptr and int(dec["cu_q"]) == cu.data.ptr
    assert size == _formula(3 * 4, int(dec["n_splits"]), 4 * 16, 64)
    with pytest.raises(ValueError, match="256-byte boundary"):
        cuflash.attention_varlen(*args, out=o, workspace=fakecp.new((size + 256,), "uint8")[16:])
