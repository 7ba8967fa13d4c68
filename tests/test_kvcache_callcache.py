"""The call cache of `attention_with_kvcache` (cuflash/_kvcache.py, `_kv_signature`/`_kv_hit`)
without a GPU, on test_callcache.py's stand-in CuPy (extended with the views, `add` and `fill`
the lengths section needs). A repeated signature skips the checks and the planning yet launches
exactly what the full path launches for the same buffers: the append, the lengths' update, the
decode and the combine, with the same parameter bytes but for the per-call addresses (outputs,
scratch). Any change of signature takes the full path again. The GPU tests of
`attention_with_kvcache` (tests/test_inference_gpu.py) call it repeatedly with one signature, so
they run the hit path against the float64 reference."""
import numpy as np
import pytest

import cuflash
from cuflash import _callcache, _decode, _kvcache
from test_callcache import FakeArray, _current_stream, fake  # noqa: F401  (the fixture)

_DEC, _APP = _decode.DECODE_PARAMS_DTYPE, _decode.APPEND_PARAMS_DTYPE
_PTR_IT = iter(range(1 << 41, 1 << 50, 1 << 24))


def _new(shape, dtype="float16"):
    return FakeArray(shape, dtype, ptr=next(_PTR_IT))


@pytest.fixture
def kvfake(fake, monkeypatch):
    """`fake` plus what the lengths section of the scratch uses: 1-D slices (views at an
    offset), `fill` and `cupy.add` (logged as launches named "fill" / "add" with the
    addresses and value), and a count of the kvcache checks."""
    import sys

    cp = sys.modules["cupy"]

    def getitem(self, sl):
        assert isinstance(sl, slice) and sl.step is None and self.ndim == 1
        start = sl.start or 0
        stop = self.shape[0] if sl.stop is None else min(sl.stop, self.shape[0])
        return FakeArray((stop - start,), self.dtype, ptr=self.data.ptr + start * self.itemsize,
                         device=self.data.device_id)

    def fill(self, value):
        fake["launches"].append(("fill", self.data.ptr, self.shape, int(value),
                                 _current_stream().ptr))

    def add(x, y, out):
        fake["launches"].append(("add", x.data.ptr, int(y), out.data.ptr, out.shape,
                                 _current_stream().ptr))

    monkeypatch.setattr(FakeArray, "__getitem__", getitem, raising=False)
    monkeypatch.setattr(FakeArray, "fill", fill, raising=False)
    cp.add, cp.int32 = add, np.int32
    fake["kvchecks"] = 0
    real = _kvcache.check_kvcache

    def counting(*a, **kw):
        fake["kvchecks"] += 1
        return real(*a, **kw)

    monkeypatch.setattr(_kvcache, "check_kvcache", counting)
    _callcache.clear()
    yield fake
    _callcache.clear()


def _args(paged, seqlens, snew, b=2, smax=2048, hkv=2, h=8, d=64, sq=1, page=16):
    """One call's arguments (fresh addresses): contiguous or paged caches, cache_seqlens an int
    or a (B,) int32 array, Snew new keys appended (0: none)."""
    q = _new((b, sq, h, d))
    if paged:
        pages = b * smax // page
        kc, vc = _new((pages, page, hkv, d)), _new((pages, page, hkv, d))
        bt = _new((b, smax // page), "int32")
    else:
        kc, vc, bt = _new((b, smax, hkv, d)), _new((b, smax, hkv, d)), None
    lens = 1000 if seqlens == "int" else _new((b,), "int32")
    kw = dict(block_table=bt)
    if snew:
        kw.update(k_new=_new((b, snew, hkv, d)), v_new=_new((b, snew, hkv, d)))
    return (q, kc, vc, lens), kw


def _norm(launches, allocs):
    """The launch log with every address that comes from this call's allocations (outputs,
    scratch) replaced by its allocation's index, so two calls' logs compare."""
    index = {}
    for a in allocs:
        index.setdefault(a[0], len(index))

    def rel(p):
        p = int(p)
        for base, size, _ in allocs:
            if base <= p < base + max(size, 1):
                return ("alloc", index[base], p - base)
        return p

    out = []
    for x in launches:
        if x[0] in ("fill", "add"):
            out.append(tuple(rel(v) if isinstance(v, int) and v > 1 << 20 else v for v in x))
            continue
        grid, block, raw, smem, name, st = x
        dt = _APP if "kv_append" in name else _DEC
        p = np.frombuffer(raw, dtype=dt).copy()[0]
        fields = tuple(rel(p[f]) if f in _decode._DEC_PTRS + _decode._APP_PTRS else int(p[f])
                       if dt.fields[f][0].kind in "iu" else float(p[f]) for f in dt.names)
        out.append((grid, block, fields, smem, name, st))
    return out


@pytest.mark.parametrize("with_out", [False, True])
@pytest.mark.parametrize("return_lse", [False, True])
@pytest.mark.parametrize("snew", [0, 1, 3])
@pytest.mark.parametrize("seqlens", ["int", "array"])
@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_hit_launches_what_the_full_path_launches(kvfake, paged, seqlens, snew,
                                                          return_lse, with_out):
    fake = kvfake

    def outs(pos):
        if not with_out:
            return None
        o = _new((pos[0].shape[0], pos[0].shape[1], pos[0].shape[2], pos[0].shape[3]))
        return (o, _new(pos[0].shape[:1] + pos[0].shape[2:3] + pos[0].shape[1:2], "float32")) \
            if return_lse else o

    pos, kw = _args(paged, seqlens, snew)
    cuflash.attention_with_kvcache(*pos, out=outs(pos), return_lse=return_lse, **kw)
    assert fake["kvchecks"] == 1
    pos, kw = _args(paged, seqlens, snew)          # the same signature, other buffers
    out = outs(pos)
    n, na = len(fake["launches"]), len(fake["allocs"])
    res_hit = cuflash.attention_with_kvcache(*pos, out=out, return_lse=return_lse, **kw)
    hit, hit_allocs = fake["launches"][n:], fake["allocs"][na:]
    assert fake["kvchecks"] == 1, "a repeated signature must not rerun the checks"
    _callcache.clear()
    n, na = len(fake["launches"]), len(fake["allocs"])
    res_full = cuflash.attention_with_kvcache(*pos, out=out, return_lse=return_lse, **kw)
    full, full_allocs = fake["launches"][n:], fake["allocs"][na:]
    assert fake["kvchecks"] == 2
    assert _norm(hit, hit_allocs) == _norm(full, full_allocs)
    names = [x[0] if x[0] in ("fill", "add") else x[4] for x in hit]
    assert sum("kv_append" in x for x in names) == (1 if snew else 0)
    assert ("add" in names) == (snew > 0 and seqlens == "array")
    assert ("fill" in names) == (snew > 0 and seqlens == "int")
    dec = [x for x in hit if x[0] not in ("fill", "add") and "attn_decode<" in x[4]]
    assert len(dec) == 1
    p = np.frombuffer(dec[0][2], dtype=_DEC)[0]
    q, kc, vc, lens = pos
    assert (int(p["q"]), int(p["k"]), int(p["v"])) == (q.data.ptr, kc.data.ptr, vc.data.ptr)
    o_hit = res_hit[0] if return_lse else res_hit
    assert int(p["o"]) == o_hit.data.ptr
    if with_out:
        assert o_hit is (out[0] if return_lse else out)
    if paged:
        assert int(p["block_table"]) == kw["block_table"].data.ptr
    if seqlens == "array" and not snew:
        assert int(p["seqlens"]) == lens.data.ptr
    app = [x for x in hit if x[0] not in ("fill", "add") and "kv_append" in x[4]]
    if app:
        a = np.frombuffer(app[0][2], dtype=_APP)[0]
        assert (int(a["k_new"]), int(a["v_new"])) == (kw["k_new"].data.ptr, kw["v_new"].data.ptr)
        if seqlens == "array":
            assert int(a["seqlens"]) == lens.data.ptr


@pytest.mark.parametrize("change", [
    lambda pos, kw: ((pos[0], pos[1], pos[2], 999), kw),                     # int length
    lambda pos, kw: ((_new((2, 2, 8, 64)),) + pos[1:], kw),                  # Sq
    lambda pos, kw: (pos, dict(kw, causal=True)),
    lambda pos, kw: (pos, dict(kw, scale=0.5)),
    lambda pos, kw: (pos, dict(kw, return_lse=True)),
    lambda pos, kw: (pos, dict(kw, k_new=_new((2, 1, 2, 64)), v_new=_new((2, 1, 2, 64)))),
    lambda pos, kw: ((pos[0], _new((2, 4096, 2, 64)), _new((2, 4096, 2, 64)), pos[3]), kw),
])
def test_any_change_of_a_kvcache_signature_takes_the_full_path(kvfake, change):
    pos, kw = _args(False, "int", 0)
    cuflash.attention_with_kvcache(*pos, **kw)
    cuflash.attention_with_kvcache(*_args(False, "int", 0)[0], **kw)
    assert kvfake["kvchecks"] == 1
    pos2, kw2 = change(*_args(False, "int", 0))
    cuflash.attention_with_kvcache(*pos2, **kw2)
    assert kvfake["kvchecks"] == 2


def test_errors_still_raise_after_a_recorded_kvcache_call(kvfake):
    pos, kw = _args(False, "int", 0)
    cuflash.attention_with_kvcache(*pos, **kw)
    with pytest.raises(ValueError, match="cache_seqlens"):
        cuflash.attention_with_kvcache(pos[0], pos[1], pos[2], 4096, **kw)   # over capacity
    with pytest.raises(ValueError, match="k_new and v_new"):
        cuflash.attention_with_kvcache(*pos, k_new=_new((2, 1, 2, 64)))
    with pytest.raises(TypeError, match="stream"):
        cuflash.attention_with_kvcache(*pos, stream=object(), **kw)


def test_kvcache_hit_on_another_stream_allocates_there(kvfake):
    from test_callcache import Stream

    s1, s2 = Stream(0x1100), Stream(0x2200)
    pos, kw = _args(False, "array", 1)
    cuflash.attention_with_kvcache(*pos, stream=s1, **kw)
    n, na = len(kvfake["launches"]), len(kvfake["allocs"])
    cuflash.attention_with_kvcache(*_args(False, "array", 1)[0], stream=s2,
                                   **_args(False, "array", 1)[1])
    assert kvfake["kvchecks"] == 1
    assert all(x[-1] == s2.ptr for x in kvfake["launches"][n:])
    assert all(a[2] == s2.ptr for a in kvfake["allocs"][na:])


def test_numpy_and_other_types_are_not_cached():
    q = np.zeros((1, 1, 8, 64), np.float16)
    kc = np.zeros((1, 32, 2, 64), np.float16)
    assert _kvcache._kv_signature(q, kc, kc, 4, None, None, None, False, None, False, None,
                                  None, "auto") is None


def test_a_decode_version_switch_is_not_served_from_an_old_record(kvfake, monkeypatch):
    """Assigning `_decode.DECODE_VERSION` moves the tables' generation on: a kvcache record of
    the default version misses under version 1, which launches its own kernels with its own
    split rule (here 4 splits and the version-1 combine where the default takes one split), and
    a workspace sized under the default is refused with the size query's name before anything
    is launched."""
    fake = kvfake
    b, hkv, h, d, smax = 32, 2, 64, 64, 256     # 64 entries of G = 32 rows, 256 keys

    def args():
        q = _new((b, 1, h, d))
        kc, vc = _new((b, smax, hkv, d)), _new((b, smax, hkv, d))
        return q, kc, vc, smax

    def names(since):
        return [x[4] for x in fake["launches"][since:] if x[0] not in ("fill", "add")]

    ws = _new((256,), "uint8")
    assert cuflash.attention_with_kvcache_workspace_size(*args()) == 0
    fake["kvchecks"] = 0   # (the size query checks too)
    for _ in range(2):
        n = len(fake["launches"])
        cuflash.attention_with_kvcache(*args(), workspace=ws)
        assert [x.rsplit(",", 1)[1] for x in names(n)] == [f" {_decode.DECODE_VERSION}>"]  # 1 split
    assert fake["kvchecks"] == 1, "the second call is a hit"
    monkeypatch.setattr(_decode, "DECODE_VERSION", 1)
    need = cuflash.attention_with_kvcache_workspace_size(*args())
    assert need > ws.nbytes
    n = len(fake["launches"])
    with pytest.raises(ValueError, match="needs .*attention_with_kvcache_workspace_size"):
        cuflash.attention_with_kvcache(*args(), workspace=ws)
    assert not names(n)
    cuflash.attention_with_kvcache(*args(), workspace=_new((need,), "uint8"))
    dec, comb = names(n)
    assert dec.startswith("cuflash::cuflash_attn_decode<") and dec.endswith(", 1>")
    assert comb.startswith("cuflash::cuflash_decode_combine<") and comb.endswith(", 1>")
    p = np.frombuffer(fake["launches"][-2][2], dtype=_DEC)[0]
    assert int(p["n_splits"]) == 4
