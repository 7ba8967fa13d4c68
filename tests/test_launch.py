"""Host-side launch logic without a GPU: the parameter blocks mirror the kernels' structs, the
Hopper kernel's tensor maps describe each input's layout (broadcast batch axes included), and a
repeated call reuses its parameter block. Arrays and the driver are stand-ins."""
import types

import numpy as np
import pytest

from cuflash import _compile, _dispatch, _launch, _tma


class FakeArray:
    """What launch_forward reads from a CuPy array: shape, strides, itemsize, data.ptr."""

    def __init__(self, shape, elem_strides, ptr, itemsize=2):
        self.shape, self.itemsize, self.ndim = tuple(shape), itemsize, len(shape)
        self.strides = tuple(s * itemsize for s in elem_strides)
        self.data = types.SimpleNamespace(ptr=ptr)


@pytest.fixture
def launches(monkeypatch):
    """Record tensor-map requests and launches instead of calling the driver."""
    record = {"maps": [], "launches": []}

    def encode(dtype_name, address, dims, strides, box):
        record["maps"].append((address, list(dims), list(strides), list(box)))
        return bytes([len(record["maps"])]) * _tma.MAP_BYTES

    def kernel(grid, block, args, shared_mem=0, stream=None):
        record["launches"].append((grid, block, args[0], shared_mem))

    monkeypatch.setattr(_tma, "encode_tiled", encode)
    monkeypatch.setattr(_compile, "get_kernel", lambda spec, dev, smem: kernel)
    monkeypatch.setattr(_launch, "_stream_ptr", lambda s: None)
    monkeypatch.setattr(_launch, "_PARAM_CACHE", type(_launch._PARAM_CACHE)())
    return record


def _problem(q, k, v, batch, sq, sk, d):
    return types.SimpleNamespace(q=q, k=k, v=v, batch_shape=batch, sq=sq, sk=sk, d=d, dv=d,
                                 dtype_name="float16", scale=0.125, stream=None, device_id=0)


ATTRS = {"max_smem_optin": 232448, "sm_count": 132}


def test_param_dtypes_match_the_structs():
    """The sizes the kernels static_assert (common.cuh, attn_wgmma.cu)."""
    assert _launch.PARAMS_DTYPE.itemsize == 31 * 8
    hp = _launch.HOPPER_PARAMS_DTYPE
    assert hp.itemsize == 768
    assert hp.fields["q"][1] == 384 and hp.fields["coord_mask"][1] == 384 + 31 * 8
    assert hp.fields["kx"][1] == 640 and hp.fields["vx_sr"][1] == 640 + 9 * 8
    assert [hp.fields[f"tm_{t}"][1] for t in "qkv"] == [0, 128, 256]
    sp = _launch.SPLIT16_PAIR_DTYPE   # one launch splits K and V (cuflash_split16_kv)
    assert sp.itemsize == 23 * 8 and sp.fields["v"][1] == 11 * 8 and sp.fields["first_v"][1] == 176


def test_hopper_maps_bshd_view_and_broadcast_kv(launches):
    """q: a (B, S, H, D) buffer seen as (B, H, S, D); k, v: one head shared by all (MQA)."""
    B, H, S, D = 2, 4, 300, 128
    q = FakeArray((B, H, S, D), (S * H * D, D, H * D, 1), 1 << 20)
    k = FakeArray((B, 1, S, D), (S * D, 0, D, 1), 2 << 20)
    v = FakeArray((B, 1, S, D), (S * D, 0, D, 1), 3 << 20)
    o = FakeArray((B, H, S, D), (H * S * D, S * D, D, 1), 4 << 20)
    plan = _dispatch.hopper_plan("float16", D, True, S)
    _launch.launch_forward(plan, _problem(q, k, v, (B, H), S, S, D), o, None, ATTRS)
    (qm, km, vm) = launches["maps"]
    # dims (D, rows, batch axis 2 = H, axis 1 = B, axis 0 = 1), byte strides of dims 1..4
    assert qm[:2] == (1 << 20, [D, S, H, B, 1])
    assert qm[2][:3] == [H * D * 2, D * 2, S * H * D * 2]
    assert km[1] == [D, S, 1, B, 1] and km[2][0] == D * 2 and km[2][2] == S * D * 2
    assert qm[3] == [64, plan.block_m, 1, 1, 1]
    bn = plan.block_n
    assert km[3] == vm[3] == [64, bn, 1, 1, 1]
    grid, block, params, smem = launches["launches"][0]
    # q has batch axes 1 and 2 (bits 1, 2); k and v only axis 1 (bits 4 and 7)
    assert int(params["coord_mask"]) == (1 << 1) | (1 << 2) | (1 << 4) | (1 << 7)
    assert (int(params["nb0"]), int(params["nb1"]), int(params["nb2"])) == (1, B, H)
    assert bytes(params["tm_k"]) == bytes([2]) * 128
    # causal: a block's work item is a pair of query blocks (attn_wgmma.cu: WorkWalk)
    assert plan.pairs
    n_items = -(-(-(-S // plan.block_m)) // 2) * B * H
    assert grid == ((min(n_items, 132) if plan.persistent else n_items),)
    assert block == (plan.threads,) and smem == plan.smem_bytes


def test_repeated_call_reuses_parameters(launches):
    B, H, S, D = 2, 3, 100, 64
    st = (H * S * D, S * D, D, 1)
    q, k, v, o = (FakeArray((B, H, S, D), st, (i + 1) << 20) for i in range(4))
    plan = _dispatch.hopper_plan("float16", D, False, S)
    prob = _problem(q, k, v, (B, H), S, S, D)
    _launch.launch_forward(plan, prob, o, None, ATTRS)
    _launch.launch_forward(plan, prob, o, None, ATTRS)
    assert len(launches["maps"]) == 3, "the second call reused the tensor maps"
    first, second = launches["launches"]
    assert first[0] == second[0] and bytes(first[2]) == bytes(second[2])
    o2 = FakeArray((B, H, S, D), st, 9 << 20)  # another output buffer: new parameters
    _launch.launch_forward(plan, prob, o2, None, ATTRS)
    assert len(launches["maps"]) == 6
    assert int(launches["launches"][2][2]["o"]) == 9 << 20


@pytest.mark.parametrize("precision,terms,form", [("highest", 3, "3xfp16"), ("highest", 3, "3xtf32"),
                                                 ("high", 1, "tf32")])
@pytest.mark.parametrize("D", [64, 128, 96])
def test_hopper_float32_maps_and_plan(launches, D, precision, terms, form, monkeypatch):
    """float32 on the Hopper kernel: boxes of 32 columns (128 bytes: the 128-byte swizzle; the
    3xfp16 form lands float32 tiles too), the precision's TERMS and operand type in the
    instantiation, the form in the label, shared memory within one block's."""
    B, H, S = 2, 4, 300
    st = (H * S * D, S * D, D, 1)
    q, k, v, o = (FakeArray((B, H, S, D), st, (i + 1) << 20, itemsize=4) for i in range(4))
    monkeypatch.setattr(_dispatch, "HOPPER_F32_FORM", {"highest": form} if form == "3xfp16" else {})
    plan = _dispatch.hopper_plan("float32", D, True, S, precision)
    dpad = 64 if D <= 64 else 128
    assert plan.spec.name.startswith(f"cuflash::cuflash_fwd_wgmma<float, {terms}, {dpad}, ")
    assert plan.spec.name.endswith(", cuflash::fp16_t>") == (form == "3xfp16"), plan.spec.name
    assert plan.label.startswith(f"hopper<float32,{form},D{dpad},"), plan.label
    assert plan.smem_bytes <= ATTRS["max_smem_optin"]
    prob = _problem(q, k, v, (B, H), S, S, D)
    prob.dtype_name = "float32"
    _launch.launch_forward(plan, prob, o, None, ATTRS)
    qm, km, vm = launches["maps"]
    assert qm[3] == [32, plan.block_m, 1, 1, 1]
    assert km[3] == vm[3] == [32, plan.block_n, 1, 1, 1]
    assert qm[2][0] == D * 4
    assert launches["launches"][0][3] == plan.smem_bytes


def _f32_prob(d, kernel="auto", precision="highest", B=1, H=2, S=256):
    """A float32 Problem stand-in of head dim d on (fake) GPU arrays, for plan_for."""
    x = FakeArray((B, H, S, d), (H * S * d, S * d, d, 1), 1 << 20, itemsize=4)
    return types.SimpleNamespace(q=x, k=x, v=x, out=None, backend="gpu", kernel=kernel,
                                 dtype_name="float32", d=d, dv=d, sq=S, sk=S, scale=0.125,
                                 precision=precision, causal=False, variant=None)


@pytest.mark.parametrize("auto_hopper", [False, True])
def test_float32_dispatch_on_hopper(monkeypatch, auto_hopper):
    """With _dispatch.HOPPER_F32_AUTO, kernel="auto" takes the Hopper float32 form on compute
    capability 9.0 for 64 <= D <= 128 (D % 8 == 0), with the precision's TERMS; without it (the
    default until that form has had a complete GPU run) auto keeps the mma.sync kernel and
    kernel="hopper" opts in. kernel="tensorcore" keeps the mma.sync kernel, and sm_80 never sees
    the Hopper form."""
    monkeypatch.setattr(_tma, "available", lambda: True)
    monkeypatch.setattr(_dispatch, "HOPPER_F32_AUTO", auto_hopper)
    # the D <= 128 forms; D = 129..256 on Hopper: test_float32_d256_hopper_follows_its_flag
    monkeypatch.setattr(_dispatch, "HOPPER_F32_D256", False)
    prob = _f32_prob

    for precision in ("highest", "high"):
        hmode = "3xfp16" if precision == "highest" else "tf32"  # HOPPER_F32_FORM
        mode = _dispatch.tc_f32_form(precision)  # TC_F32_FORM: 3xfp16 for "highest" too
        for d in (64, 96, 128):
            plan = _dispatch.plan_for(prob(d, precision=precision), 90)
            forced = _dispatch.plan_for(prob(d, "hopper", precision), 90)
            assert forced.label.startswith(f"hopper<float32,{hmode},"), forced.label
            assert forced.spec.family == "attn_wgmma"
            kind, kmode = ("hopper", hmode) if auto_hopper else ("tensorcore", mode)
            assert plan.label.startswith(f"{kind}<float32,{kmode},"), plan.label
            tc = _dispatch.plan_for(prob(d, "tensorcore", precision), 90)
            assert tc.label.startswith(f"tensorcore<float32,{mode},"), tc.label
            assert not _dispatch.plan_for(prob(d, precision=precision), 80).label.startswith(
                "hopper")
        for d in (32, 100):  # below 64, or not a multiple of 8: the mma.sync kernel
            assert _dispatch.plan_for(prob(d, precision=precision), 90).label.startswith(
                "tensorcore<float32"), d
    with pytest.raises(ValueError, match="kernel='hopper'.*head dims from 64 to 128"):
        _dispatch.plan_for(prob(160, "hopper"), 90)


@pytest.mark.parametrize("wide_auto", [False, True])
@pytest.mark.parametrize("cc", [80, 90])
def test_float32_wide_dispatch(monkeypatch, wide_auto, cc):
    """float32 "highest" at D = 129..256: kernel="tensorcore" takes the mma.sync 3xfp16 form
    (DPAD 192: 32 keys a tile; 256: 16), kernel="auto" only with _dispatch.F32_D256_AUTO (else
    the generic kernel); "high" keeps its TF32 form under auto either way; above 256 and for D
    not a multiple of 4 the tensor-core kernel says why not."""
    monkeypatch.setattr(_tma, "available", lambda: True)
    monkeypatch.setattr(_dispatch, "F32_D256_AUTO", wide_auto)
    # the mma.sync form; the Hopper one at D > 128: test_float32_d256_hopper_follows_its_flag
    monkeypatch.setattr(_dispatch, "HOPPER_F32_D256", False)
    prob = _f32_prob

    for d, dpad, bn in ((132, 192, 32), (192, 192, 32), (200, 256, 16), (256, 256, 16)):
        want = f"tensorcore<float32,3xfp16,D{dpad},BM64,BN{bn},"
        tc = _dispatch.plan_for(prob(d, "tensorcore"), cc)
        assert tc.label.startswith(want) and tc.spec.name.endswith("cuflash::fp16_t>"), tc.label
        auto = _dispatch.plan_for(prob(d), cc)
        assert auto.label.startswith(want if wide_auto else "generic<float32"), auto.label
        # "high" keeps its TF32 tiles where they fit the block's shared memory (not
        # sm_80's D = 256 exception, 205824 bytes against 163 KiB: tests/test_arch_limits_cpu.py)
        tiles = _dispatch.tensorcore_plan("float32", d, False, cc, "high")
        fits = tiles.smem_bytes <= _dispatch.smem_optin_bytes(cc)
        assert _dispatch.plan_for(prob(d, precision="high"), cc).label.startswith(
            "tensorcore<float32,tf32," if fits else "generic<float32,"), (d, cc)
        assert fits or (cc, dpad) == (80, 256)
    assert _dispatch.plan_for(prob(128), cc).label.startswith(
        "hopper<float32,3xfp16," if cc == 90 and _dispatch.HOPPER_F32_AUTO
        else "tensorcore<float32,3xfp16,D128,")
    with pytest.raises(ValueError, match="kernel='tensorcore'.*multiple of 4"):
        _dispatch.plan_for(prob(202, "tensorcore"), cc)


def test_hopper_narrows_short_query_blocks():
    """Three consumers (BM = 192) give way to two (BM = 128) only where the last query block
    would leave the wider block's gain unused: ViT's Sq = 197 and 256; Sq = 577 (75% of 768 rows
    used against 90% of 640) and the benchmark grid's Sq = 512.. keep BM = 192. The rule uses the
    real Sq, not the key count."""
    def bm(sq, sk=4096, causal=False):
        return _dispatch.hopper_plan("float16", 64, causal, sk, sq=sq).block_m

    assert [bm(sq) for sq in (1, 197, 256)] == [128] * 3
    assert [bm(sq) for sq in (384, 512, 577, 1024, 2048, 16384)] == [192] * 6
    assert bm(None) == 192 and bm(197, sk=197) == 128
    assert bm(197, sk=8192, causal=True) == 128 and bm(8192, sk=8192, causal=True) == 192
    assert _dispatch.hopper_plan("float16", 128, False, 4096, sq=197).block_m == 128


@pytest.mark.parametrize("flag", [False, True])
def test_float32_d256_hopper_follows_its_flag(launches, monkeypatch, flag):
    """float32 "highest" at D = 129..256 on Hopper: with _dispatch.HOPPER_F32_D256 off,
    kernel="hopper" refuses it and auto keeps the mma.sync form; on, kernel="hopper" (and auto,
    where HOPPER_F32_AUTO takes the Hopper form) runs the head-dim split form: BM = 64, two
    consumers (384 threads), one stage of BN = 64, Q boxes of 64 rows, shared memory within one
    block's (WgmmaConfig::SMEM: 230512 B). The compile set has its two specialisations either way."""
    monkeypatch.setattr(_tma, "available", lambda: True)
    monkeypatch.setattr(_dispatch, "HOPPER_F32_D256", flag)
    monkeypatch.setattr(_dispatch, "F32_D256_AUTO", True)
    for d in (136, 192, 256):
        if not flag:
            with pytest.raises(ValueError, match="kernel='hopper'.*head dims from 64 to 128"):
                _dispatch.plan_for(_f32_prob(d, "hopper"), 90)
            continue
        plan = _dispatch.plan_for(_f32_prob(d, "hopper"), 90)
        assert plan.label.startswith("hopper<float32,3xfp16,D256,BM64,BN64,S1,Q1,hsplit,"), \
            plan.label
        op = "fp16pre_t" if _dispatch.HOPPER_F32_PRESPLIT else "fp16_t"  # K, V split per call
        assert plan.spec.name == ("cuflash::cuflash_fwd_wgmma<float, 3, 256, 64, 1, 1, 2, false, "
                                  f"false, false, cuflash::{op}>"), plan.spec.name
        assert ("presplit," in plan.label) == _dispatch.HOPPER_F32_PRESPLIT, plan.label
        assert (plan.block_m, plan.block_n, plan.threads, plan.smem_bytes) == (64, 64, 384, 230512)
        assert plan.smem_bytes <= ATTRS["max_smem_optin"]
    from cuflash._dispatch_variants import hopper_variant_reason
    why = hopper_variant_reason(_f32_prob(256, "hopper"), 90)  # variants: not on this form
    assert why is not None and ("variant policies" in why) == flag, why
    assert hopper_variant_reason(_f32_prob(128, "hopper"), 90) is None
    auto = _dispatch.plan_for(_f32_prob(256), 90).label
    assert auto.startswith("hopper<float32,3xfp16,D256," if flag and _dispatch.HOPPER_F32_AUTO
                           else "tensorcore<float32,3xfp16,D256,"), auto
    # below HOPPER_F32_D256_AUTO_MIN_D auto keeps the mma.sync form (measured at D = 256 only)
    for d in (136, 192):
        auto = _dispatch.plan_for(_f32_prob(d), 90).label
        assert auto.startswith("tensorcore<float32,3xfp16,D"), (d, auto)
    auto = _dispatch.plan_for(_f32_prob(200), 90).label
    assert auto.startswith("hopper<float32,3xfp16,D256," if flag and _dispatch.HOPPER_F32_AUTO
                           else "tensorcore<float32,3xfp16,D256,"), auto
    names = {s.name for s in (p.spec for p in _dispatch.all_specialisations(90))}
    for causal in ("false", "true"):
        assert ("cuflash::cuflash_fwd_wgmma<float, 3, 256, 64, 1, 1, 2, false, false, "
                f"{causal}, cuflash::fp16_t>") in names
    if flag:  # the launch: boxes of 32 columns x 64 query rows, the plan's shared memory
        B, H, S, D = 2, 4, 300, 256
        st = (H * S * D, S * D, D, 1)
        q, k, v, o = (FakeArray((B, H, S, D), st, (i + 1) << 20, itemsize=4) for i in range(4))
        plan = _dispatch.hopper_plan("float32", D, True, S)
        prob = _problem(q, k, v, (B, H), S, S, D)
        prob.dtype_name = "float32"
        _launch.launch_forward(plan, prob, o, None, ATTRS)
        qm, km, vm = launches["maps"]
        assert qm[3] == [32, 64, 1, 1, 1] and km[3] == vm[3] == [32, 64, 1, 1, 1]
        assert launches["launches"][0][3] == plan.smem_bytes == 230512


# ---------------------------------------------------------------------------------------------
# Batch axes that run backwards: no tensor map for them (the strides are unsigned)

def _dense_prob(q, k, dtype="float16", kernel="auto", d=128):
    batch = tuple(np.broadcast_shapes(q.shape[:-2], k.shape[:-2]))
    return types.SimpleNamespace(
        backend="gpu", q=q, k=k, v=k, out=None, batch_shape=batch, sq=q.shape[-2],
        sk=k.shape[-2], d=d, dv=d, dtype_name=dtype, scale=0.125, causal=True, kernel=kernel,
        precision="highest", variant=None, stream=None, device_id=0)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("which", ["q_heads", "q_batch", "k_heads", "both"])
def test_hopper_refuses_backward_batch_axes(which, dtype, monkeypatch):
    """cuTensorMapEncodeTiled takes unsigned byte strides: a view whose batch axis runs
    backwards (q[:, ::-1], q[::-1], the GQA split of either) reached the driver as 2^64 - |s|
    and failed the launch under kernel="auto", where the mma.sync kernel reads the view through
    its signed strides. Auto must take the mma.sync kernel; kernel="hopper" must say why."""
    from cuflash import _dispatch_variants

    monkeypatch.setattr(_tma, "available", lambda: True)
    monkeypatch.setattr(_dispatch, "HOPPER_F32_AUTO", True)
    item = 4 if dtype == "float32" else 2
    B, H, S, D = 2, 4, 512, 128
    fwd = (H * S * D, S * D, D, 1)
    base = 1 << 30
    last_head = (H - 1) * S * D
    views = {  # (elem strides, pointer offset in elements) of a (B, H, S, D) view
        "fwd": (fwd, 0),
        "heads": ((H * S * D, -S * D, D, 1), last_head),
        "batch": ((-H * S * D, S * D, D, 1), (B - 1) * H * S * D),
        "both": ((-H * S * D, -S * D, D, 1), (B - 1) * H * S * D + last_head),
    }

    def arr(kind):
        st, off = views[kind]
        return FakeArray((B, H, S, D), st, base + off * item, itemsize=item)

    qk = {"q_heads": ("heads", "fwd"), "q_batch": ("batch", "fwd"),
          "k_heads": ("fwd", "heads"), "both": ("both", "both")}[which]
    ok = _dense_prob(arr("fwd"), arr("fwd"), dtype)
    assert _dispatch.hopper_reason(ok, 90) is None  # the control: forward strides take Hopper
    assert _dispatch.plan_for(ok, 90).label.startswith("hopper<")
    prob = _dense_prob(arr(qk[0]), arr(qk[1]), dtype)
    why = _dispatch.hopper_reason(prob, 90)
    assert why is not None and "run backwards" in why, why
    assert _dispatch.plan_for(prob, 90).label.startswith("tensorcore<")
    prob.variant = object()  # the Hopper variant plans share the plain kernel's conditions
    assert _dispatch_variants.hopper_variant_reason(prob, 90) == why
    prob.variant = None
    prob.kernel = "hopper"
    with pytest.raises(ValueError, match="kernel='hopper'.*run backwards"):
        _dispatch.plan_for(prob, 90)


def test_encode_tiled_refuses_negative_strides():
    """The last guard before ctypes, which would wrap a negative stride silently: a clear
    ValueError (raised before the driver is looked up, so this runs without one)."""
    with pytest.raises(ValueError, match="must not be negative"):
        _tma.encode_tiled("float16", 1 << 20, [128, 512, 4, 2, 1], [256, -131072, 524288, 0],
                          [64, 128, 1, 1, 1])


def test_presplit_params_keep_the_float32_inputs(launches, monkeypatch):
    """A HOPPER_F32_PRESPLIT launch: the tensor maps and HopperParams::kx / vx (with the split
    arrays' own strides) point at the split K and V, while a.k / a.v keep the float32 inputs and
    their strides, which the kernel's exact row path reads (a NaN in V at a key a causal row
    cannot see; the row is recomputed from the inputs). Broadcast key/value heads: stride 0 in
    both."""
    monkeypatch.setattr(_tma, "available", lambda: True)
    B, H, S, D = 2, 3, 200, 128
    plan = _dispatch.hopper_plan("float32", D, True, S, "highest", presplit=True)
    w = 2 * plan.presplit_dpad + 64
    q = FakeArray((B, H, S, D), (H * S * D, S * D, D, 1), 1 << 20, 4)
    k = FakeArray((B, 1, S, D), (S * D * 2, 0, 2 * D, 1), 2 << 20, 4)   # every other row
    v = FakeArray((B, 1, S, D), (S * D, 0, D, 1), 3 << 20, 4)
    o = FakeArray((B, H, S, D), (H * S * D, S * D, D, 1), 4 << 20, 4)
    ks = FakeArray((B, 1, S, w), (S * w, S * w, w, 1), 5 << 20, 2)
    vs = FakeArray((B, 1, S, w), (S * w, S * w, w, 1), 6 << 20, 2)
    prob = types.SimpleNamespace(q=q, k=k, v=v, batch_shape=(B, H), sq=S, sk=S, d=D, dv=D,
                                 dtype_name="float32", scale=0.125, stream=None, device_id=0)
    p, grid, (q2, k2, v2), _ = _launch.forward_params(plan, prob, q, k, v, o, None, ATTRS,
                                                      split_kv=(ks, vs))
    assert (q2, k2, v2) == (q, k, v)
    assert (int(p["k"]), int(p["v"])) == (2 << 20, 3 << 20)
    assert (int(p["kx"]), int(p["vx"])) == (5 << 20, 6 << 20)
    assert int(p["k_sr"]) == 2 * D and int(p["v_sr"]) == D
    assert int(p["kx_sr"]) == int(p["vx_sr"]) == w
    # batch (B, H): the kernel's axes 1 (B) and 2 (H); heads broadcast for k, v and their splits
    assert [int(p[f"k_s{i}"]) for i in (1, 2)] == [S * D * 2, 0]
    assert [int(p[f"kx_s{i}"]) for i in (1, 2)] == [S * w, 0]
    assert [int(p[f"vx_s{i}"]) for i in (1, 2)] == [S * w, 0]
    maps = launches["maps"]
    assert [m[0] for m in maps] == [1 << 20, 5 << 20, 6 << 20]
    assert maps[1][1][0] == maps[2][1][0] == 2 * plan.presplit_dpad   # 16-bit columns mapped
    assert maps[1][2][0] == w * 2   # the split rows' byte pitch
    # without the split the block has zeros there and maps k and v themselves
    launches["maps"].clear()
    plain = _dispatch.hopper_plan("float32", D, True, S, "highest", presplit=False)
    p, *_ = _launch.forward_params(plain, prob, q, k, v, o, None, ATTRS)
    assert int(p["kx"]) == int(p["vx"]) == 0
    assert [m[0] for m in launches["maps"]] == [1 << 20, 2 << 20, 3 << 20]


def test_presplit_only_where_key_tiles_are_reused(monkeypatch):
    """HOPPER_F32_PRESPLIT_MIN_REUSE: the split pass is taken where a key tile is visited by at
    least that many query blocks on average (ceil(Sq / BM), halved under the causal mask); Sq
    unknown (the compile set) counts as reused; 0 takes it everywhere."""
    monkeypatch.setattr(_dispatch, "HOPPER_F32_PRESPLIT_MIN_REUSE", 3)

    def pre(d, causal, sq):
        plan = _dispatch.hopper_plan("float32", d, causal, 4096, "highest", sq=sq, presplit=True)
        assert ("presplit," in plan.label) == (plan.presplit_dpad > 0), plan.label
        return plan.presplit_dpad > 0

    assert not pre(128, True, 512) and not pre(64, True, 512)   # BM = 128: 4 blocks, causal 2
    assert pre(128, False, 512) and pre(128, True, 1024) and pre(64, True, 1024)
    assert pre(256, True, 512)   # BM = 64: 8 blocks, causal 4
    assert not pre(128, False, 256) and pre(128, False, 384)
    assert pre(128, True, None)
    assert _dispatch.presplit_reuse(128, 1000, True) == 4.0
    monkeypatch.setattr(_dispatch, "HOPPER_F32_PRESPLIT_MIN_REUSE", 0)
    assert pre(128, True, 1)
