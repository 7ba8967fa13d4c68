"""The Hopper backward (kernels_cu/attn_bwd_wgmma.cu) without a GPU: its plans and launch
configuration on the host, and its indexing through the thread-level NumPy model
(tests/bwd_wgmma_model.py) run on the parameter block launch_backward builds."""
import types

import pytest

from cuflash import _dispatch

from test_backward_cpu import _run_kernel_model


def test_hopper_backward_plans():
    """Both head dims, both masks, both modes: the mma backward's plan model (preprocess, keys,
    dq conversion; the dq accumulator rows with the turn-counter padding), sm_90a, launchable on
    an H200 (227 KiB of shared memory, 256 threads), labels that say what runs."""
    for dt in _dispatch.HOPPER_BWD_DTYPES:
        for dpad, (bm, bn) in _dispatch.HOPPER_BWD_CONFIGS.items():
            for causal in (False, True):
                for det in (False, True):
                    bp = _dispatch.bwd_hopper_plan(dt, dpad, causal, det)
                    assert [g for g, _ in bp.passes] == ["keys", "dq_convert"]
                    assert bp.dq_accum_row == dpad + _dispatch.TC_BWD_DQ_PAD
                    assert bp.deterministic == det and not bp.lse_acc
                    kern = bp.passes[0][1]
                    assert kern.spec.arch == "sm_90a" and kern.spec.family == "attn_bwd_wgmma"
                    assert kern.smem_bytes <= 227 * 1024
                    assert kern.threads == (256 if dpad > 128 else 128 * (bn // 64))
                    assert (kern.block_m, kern.block_n) == (bm, bn)
                    mask = "causal" if causal else "full"
                    assert bp.label == (f"hopper-bwd<{dt},D{dpad},BM{bm},BN{bn},"
                                        f"{'det,' if det else ''}{mask}>")
                    assert kern.spec.name.endswith(", true, cuflash::PlainVariant>")
    with pytest.MonkeyPatch.context() as mp:  # the other dS layout says so
        mp.setattr(_dispatch, "HOPPER_BWD_DS_KMAJOR", False)
        bp = _dispatch.bwd_hopper_plan("float16", 64, True, True)
        assert bp.label == "hopper-bwd<float16,D64,BM128,BN128,det,dsT,causal>"
        assert bp.passes[0][1].spec.name.endswith(", false, cuflash::PlainVariant>")
    with pytest.MonkeyPatch.context() as mp:  # the overlapped schedule: D = 256 only, says so
        mp.setattr(_dispatch, "HOPPER_BWD_OVERLAP", True)
        bp = _dispatch.bwd_hopper_plan("bfloat16", 256, True, True)
        assert bp.label == "hopper-bwd<bfloat16,D256,BM64,BN64,det,ov,causal>"
        assert bp.passes[0][1].spec.name.endswith(", true, cuflash::PlainVariant, true>")
        assert bp.passes[0][1].smem_bytes == 223248  # the same buffers
        for dpad in (64, 128):  # no such schedule there: the same kernels
            assert _dispatch.bwd_hopper_plan("float16", dpad, False, False).passes[0][1].spec \
                .name.endswith(", true, cuflash::PlainVariant>")
    # smaller head dims take the next tile (zero-padded)
    assert "D64," in _dispatch.bwd_hopper_plan("float16", 40, False, False).label
    assert "D128," in _dispatch.bwd_hopper_plan("float16", 72, False, False).label
    assert "D256,BM64,BN64," in _dispatch.bwd_hopper_plan("float16", 136, False, False).label
    # D = 256: two warpgroups (256 threads) on 64 keys; both dS layouts fit (227 KiB)
    k256 = _dispatch.bwd_hopper_plan("bfloat16", 256, True, True).passes[0][1]
    assert (k256.threads, k256.smem_bytes) == (256, 223248)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_dispatch, "HOPPER_BWD_DS_KMAJOR", False)
        assert _dispatch.bwd_hopper_plan("float16", 256, False, False).passes[0][1] \
            .smem_bytes == 223248 - 64 * 64 * 2


def _prob(**kw):
    base = dict(kernel="hopper", dtype_name="float16", d=64, dv=64, causal=True,
                deterministic=False)
    base.update(kw)
    return types.SimpleNamespace(**base)


def test_hopper_backward_dispatch(monkeypatch):
    """kernel="hopper" demands it (compute capability 9.0, the tensor-core backward's
    conditions) and says why not; auto takes it only with HOPPER_BWD_AUTO, on 9.0 only."""
    assert _dispatch.backward_plan_for(_prob(), 90).label == \
        "hopper-bwd<float16,D64,BM128,BN128,causal>"
    assert _dispatch.backward_plan_for(_prob(deterministic=True, d=128, dv=128,
                                             dtype_name="bfloat16"), 90).label == \
        "hopper-bwd<bfloat16,D128,BM64,BN128,det,causal>"
    for cc, edit, why in ((80, {}, "compute capability 9.0"),
                          (90, dict(dtype_name="float32"), "float16 and bfloat16"),
                          (90, dict(d=264, dv=264), "up to 256"),
                          (90, dict(dv=32), "D == Dv"), (90, dict(d=60, dv=60), "multiple of 8")):
        with pytest.raises(ValueError, match=f"kernel='hopper'.*{why}"):
            _dispatch.backward_plan_for(_prob(**edit), cc)
    assert _dispatch.HOPPER_BWD_AUTO  # on since the H200 tests passed
    monkeypatch.setattr(_dispatch, "HOPPER_BWD_AUTO", False)
    assert _dispatch.backward_plan_for(_prob(kernel="auto"), 90).label.startswith(
        "tensorcore-bwd")
    monkeypatch.setattr(_dispatch, "HOPPER_BWD_AUTO", True)
    assert _dispatch.backward_plan_for(_prob(kernel="auto"), 90).label.startswith("hopper-bwd")
    assert _dispatch.backward_plan_for(_prob(kernel="auto"), 80).label.startswith(
        "tensorcore-bwd")
    assert _dispatch.backward_plan_for(_prob(kernel="auto", d=256, dv=256), 90).label == \
        "hopper-bwd<float16,D256,BM64,BN64,causal>"
    assert _dispatch.backward_plan_for(_prob(kernel="auto", d=256, dv=256), 80).label \
        .startswith("generic-bwd")  # the mma.sync backward stops at 128
    assert _dispatch.backward_plan_for(_prob(kernel="tensorcore"), 90).label.startswith(
        "tensorcore-bwd")


def test_hopper_backward_is_compiled_and_not_varlen():
    """The compile check builds every Hopper plan (sm_90a), and no _varlen twin of it (the
    varlen backward never picks it)."""
    names = {s.name for s in _dispatch.backward_kernel_specs(90)}
    for dt in _dispatch.HOPPER_BWD_DTYPES:
        for dpad in _dispatch.HOPPER_BWD_CONFIGS:
            for causal in (False, True):
                for det in (False, True):
                    kern = _dispatch.bwd_hopper_plan(dt, dpad, causal, det).passes[0][1]
                    assert kern.spec.name in names
    assert not any("cuflash_bwd_wgmma" in s.name for s in _dispatch.backward_kernel_specs(80))
    assert not any("cuflash_bwd_wgmma" in s.name
                   for s in _dispatch.varlen_backward_kernel_specs(90))


# (dtype, q batch, k batch, Sq, Sk, D, causal, deterministic, layout): the three tiles (D = 64: BM
# 128 with dQ split over query panels; D = 128: BM 64 split over head-dim panels; D = 256), padded
# head dims,
# tails of both, several key blocks and query tiles, Sq > Sk (rows without keys) and Sq < Sk,
# MQA (dk, dv summed over query heads), and (S, H, D) memory seen as (H, S, D).
HOPPER_MODEL_CASES = [
    ("float16", (2,), (2,), 150, 200, 64, True, True, "contiguous"),
    ("bfloat16", (1, 2), (1, 1), 70, 260, 48, False, False, "contiguous"),
    ("float16", (2,), (2,), 200, 130, 128, True, True, "bshd"),
    ("bfloat16", (1,), (1,), 45, 150, 120, False, True, "contiguous"),
    ("float16", (3,), (1,), 130, 129, 64, False, True, "contiguous"),
    # D = 256 (SPLIT: two warpgroups share 64 keys, splitting queries of S^T and columns of
    # dK, dV, dQ), and head dims padded to it
    ("float16", (2,), (2,), 150, 200, 256, True, True, "contiguous"),
    ("bfloat16", (1,), (1,), 130, 70, 200, True, False, "bshd"),
    ("float16", (3,), (1,), 70, 129, 192, False, True, "contiguous"),
]


@pytest.mark.parametrize("ds_kmajor", [True, False])
@pytest.mark.parametrize("dtype,qb,kb,sq,sk,d,causal,det,layout", HOPPER_MODEL_CASES)
def test_hopper_kernel_model(dtype, qb, kb, sq, sk, d, causal, det, layout, ds_kmajor,
                             monkeypatch):
    """Both dS layouts for dQ (_dispatch.HOPPER_BWD_DS_KMAJOR)."""
    monkeypatch.setattr(_dispatch, "HOPPER_BWD_DS_KMAJOR", ds_kmajor)
    _run_kernel_model("hopper", dtype, qb, kb, sq, sk, d, causal, det, 90, layout, monkeypatch)


@pytest.mark.parametrize("dtype,qb,kb,sq,sk,d,causal,det,layout",
                         [c for c in HOPPER_MODEL_CASES if c[5] > 128])
def test_hopper_kernel_model_overlapped(dtype, qb, kb, sq, sk, d, causal, det, layout,
                                        monkeypatch):
    """The D = 256 form with its overlapped schedule (_dispatch.HOPPER_BWD_OVERLAP): the same
    products on the same operands, so the thread-level model's gradients stand; the order of
    its phases is checked by tests/bwd_wgmma_schedule.py (test_hopper_schedule_*)."""
    monkeypatch.setattr(_dispatch, "HOPPER_BWD_OVERLAP", True)
    _run_kernel_model("hopper", dtype, qb, kb, sq, sk, d, causal, det, 90, layout, monkeypatch)


@pytest.mark.parametrize("ds_kmajor", [True, False])
def test_hopper_model_catches_a_layout_error(monkeypatch, ds_kmajor):
    """The model is sharp: reading K for dQ = dS K without the transpose bit of B (the K-major
    reading the S^T product uses for the same tile: a plausible slip) gives a wrong dq."""
    import bwd_wgmma_model as model

    monkeypatch.setattr(_dispatch, "HOPPER_BWD_DS_KMAJOR", ds_kmajor)

    real_mn = model.read_mn_major
    calls = {"n": 0}
    k_bytes = model.Cfg(64, 128, 128).kv_bytes  # K is the first tile in shared memory

    def wrong(smem, desc, n):
        if model.desc_fields(desc)[0] < k_bytes:  # only dQ reads K through an MN-major desc
            calls["n"] += 1
            return model.read_k_major(smem, desc, n)
        return real_mn(smem, desc, n)

    monkeypatch.setattr(model, "read_mn_major", wrong)
    with pytest.raises(AssertionError, match="dq"):
        _run_kernel_model("hopper", "float16", (1,), (1,), 100, 140, 64, False, False, 90,
                          "contiguous", monkeypatch)
    assert calls["n"] > 0


@pytest.mark.parametrize("wrong", ["query_half", "dst_is_pt"])
def test_hopper_model_split_catches_a_slip(monkeypatch, wrong):
    """The D = 256 (SPLIT) path of the model is sharp: the second warpgroup reading the first
    one's query half for S^T / dP^T, or dK reading P^T where dS^T belongs, gives wrong
    gradients."""
    import bwd_wgmma_model as model

    real_init = model.Cfg.__init__

    def init(self, *a, **kw):
        real_init(self, *a, **kw)
        if wrong == "dst_is_pt":
            self.dst_off = self.pt_off

    monkeypatch.setattr(model.Cfg, "__init__", init)
    if wrong == "query_half":
        real_k = model.read_k_major
        c = model.Cfg(256, 64, 64)

        def k_major(smem, desc, rows):  # the B of S^T / dP^T (Q, dO rows) from query 0 always
            start, _, _ = model.desc_fields(desc)
            if rows == c.sn and c.q_off <= start < c.ds_off:
                off = (start - c.q_off) % c.q_panel
                if off >= c.sn * 128:
                    desc = model.wgmma_desc(start - c.sn * 128, 16, 1024)
            return real_k(smem, desc, rows)

        monkeypatch.setattr(model, "read_k_major", k_major)
    with pytest.raises(AssertionError, match="model error"):
        _run_kernel_model("hopper", "float16", (1,), (1,), 100, 90, 256, False, False, 90,
                          "contiguous", monkeypatch)


@pytest.mark.parametrize("nsm", [1, 3, 7, 132])
@pytest.mark.parametrize("d,causal", [(64, False), (256, False), (128, True)])
def test_hopper_deterministic_block_order(d, causal, nsm, monkeypatch):
    """The deterministic mode's block order (common.cuh bwd_key_block, DET_ORDER: groups of
    max(1, SMs / key blocks) owners, rank-major inside) and start gate (no mask, grids of 8
    waves or more: nsm = 1 here) for several SM counts (%nsmid): every (owner, key block) runs once, and run in
    block-index order every turn and gate is ready when its block gets there (so no block
    waits for one dispatched after it), with the gradients right."""
    _run_kernel_model("hopper", "float16", (5,), (5,), 300, 260, d, causal, True, 90,
                      "contiguous", monkeypatch, nsm=nsm)


def test_hopper_block_order_model_is_sharp():
    """block_order: rank r - 1 of an owner has a lower block index than rank r, for every grid
    and SM count (what the turns' deadlock freedom rests on), and the mapping is a bijection."""
    import bwd_wgmma_model as model

    for nn in (1, 2, 3, 5, 32, 128, 256):
        for owners in (1, 2, 5, 7, 33, 128):
            for nsm in (1, 3, 132, 144):
                grid = nn * owners
                where = {}
                for bid in range(grid):
                    where[model.block_order(bid, grid, nn, True, nsm)] = bid
                assert len(where) == grid
                for (o, r), bid in where.items():
                    assert 0 <= o < owners and 0 <= r < nn
                    if r:
                        assert where[(o, r - 1)] < bid


@pytest.mark.parametrize("n_iter", [1, 2, 3, 5])
@pytest.mark.parametrize("overlap", [False, True])
def test_hopper_schedule_is_ordered(overlap, n_iter):
    """Both schedules of the D = 256 form (tests/bwd_wgmma_schedule.py): every shared-memory
    buffer is written and read (cp.async, st.shared, the wgmmas' operand reads) in intervals a
    barrier apart, every store that a wgmma reads is fenced to the async proxy before its
    barrier, no accumulator is touched while its commit group is pending, and nothing is left
    pending at the end."""
    import bwd_wgmma_schedule as sched

    assert sched.check(sched.block_ops(n_iter, overlap)) == []


@pytest.mark.parametrize("slip", ["no_barrier_1b", "no_fence_1b", "dq_wait_2", "no_final_wait",
                                  "loads_before_barrier_1", "dv_with_s", "plain_dv_early"])
def test_hopper_schedule_model_is_sharp(slip):
    """The schedule checker catches plausible slips of the overlapped schedule: dV issued
    without barrier 1b (the other warpgroup's P^T half may not be stored yet) or without the
    fence before it, the dq atomics after wait_group 2 (dQ still pending), no wait for dK at
    the end of a tile (the next tile's stores into dS^T and loads into Q race it), the next
    tile's loads before barrier 1 (into the stage the other warpgroup may still read), dV
    issued in S^T's commit group before P^T exists, and the plain schedule's dV moved before
    barrier 2 without a barrier of its own."""
    import bwd_wgmma_schedule as sched

    overlap = slip != "plain_dv_early"
    real = sched.tile_ops

    def tile_ops(it, n_iter, ov):
        ops = real(it, n_iter, ov)
        if slip == "no_barrier_1b":
            ops.remove(("bar", "1b"))
        elif slip == "no_fence_1b":
            del ops[ops.index(("bar", "1b")) - 1]
        elif slip == "dq_wait_2":
            at = max(i for i, op in enumerate(ops) if op == ("wait", 1))
            ops[at] = ("wait", 2)
        elif slip == "no_final_wait":
            at = max(i for i, op in enumerate(ops) if op == ("wait", 0))
            del ops[at:at + 2]
        elif slip == "loads_before_barrier_1":
            cps = [op for op in ops if op[0] == "cp"]
            ops = [op for op in ops if op[0] != "cp"]
            ops[1:1] = cps
        elif slip == "dv_with_s":
            dv = next(op for op in ops if op[0] == "mma" and op[2] == "dv")
            at = ops.index(dv)
            del ops[at:at + 2]
            ops.insert(ops.index(("bar", "1")) + 1, dv)
        elif slip == "plain_dv_early":
            dv = next(op for op in ops if op[0] == "mma" and op[2] == "dv")
            ops.remove(dv)
            ops[ops.index(("sts", "PT")) + 1:ops.index(("sts", "PT")) + 1] = [dv, ("commit",)]
        return ops

    ops = []
    for it in range(3):
        ops += tile_ops(it, 3, overlap)
    ops = sched.block_ops(0, overlap)[:-1] + ops + [("cpwait",)]
    assert sched.check(ops) != [], slip
