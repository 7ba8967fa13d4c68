"""Every kernel specialisation the dispatcher can pick compiles through NVRTC for sm_80 and sm_90
with no local-memory spills. Needs CuPy's NVRTC binding and the NVRTC library (the `test` extra
installs both), not a GPU. The registers and shared memory of each specialisation are printed in
the session summary.

The selected cases compile first on every core (NVRTC runs without the GIL;
CUFLASH_COMPILE_JOBS sets the thread count, 1 compiles each case in its own test), then each test
reads its report: on CI's 2 cores that halves the check's wall time.
"""
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cuflash import _compile, _dispatch, precompile

from conftest import COMPILE_REPORTS, HOPPER_SCHEDULES, hopper_schedule_table

ARCHS = ("sm_80", "sm_90")


def _specs(cc):
    return precompile.specialisations(cc)  # what cuflash-precompile builds: every launchable one


def _have_nvrtc():
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
    except Exception as exc:  # pragma: no cover - depends on the machine
        return f"{type(exc).__name__}: {exc}"
    return None


@pytest.fixture(scope="module", autouse=True)
def nvrtc_present():
    err = _have_nvrtc()
    if err is not None:
        pytest.fail("the NVRTC compile check needs CuPy and the NVRTC library; install the test "
                    f"extra (pip install -e '.[test]'). Import failed with {err}")


def _other_epilogue_specs(cc):
    """The other epilogue of every tensor-core config (direct stores, where staging is the
    default): tests/test_gpu.py and tests/test_gpu_float32.py run both. For sm_90 only: these
    variants are dispatched nowhere, and the GPU tests that force them run on the H200; for
    sm_80, NVRTC 13.0 spilled 8 bytes in the 16-bit D = 128 causal one once the non-finite path
    came in (attn_mma.cu: pv_visible_keys), and more in float32 ones."""
    from unittest import mock

    if cc != 90:
        return []

    staged = {k: v[:4] + (not v[4],) for k, v in _dispatch.TC_CONFIGS.items()}
    arch_staged = {a: {k: v[:4] + (not v[4],) for k, v in c.items()}
                   for a, c in _dispatch.TC_ARCH_CONFIGS.items()}
    f32_staged = {k: v[:4] + (not v[4],) for k, v in _dispatch.TC_F32_CONFIGS.items()}
    f16s_staged = {k: v[:4] + (not v[4],) for k, v in _dispatch.TC_F16SPLIT_CONFIGS.items()}
    with mock.patch.dict(_dispatch.TC_CONFIGS, staged), \
            mock.patch.dict(_dispatch.TC_ARCH_CONFIGS, arch_staged), \
            mock.patch.dict(_dispatch.TC_F32_CONFIGS, f32_staged), \
            mock.patch.dict(_dispatch.TC_F16SPLIT_CONFIGS, f16s_staged):
        specs = [_dispatch.tensorcore_plan(dt, dpad, causal, cc).spec
                 for dt in ("float16", "bfloat16") for dpad in _dispatch.TC_CONFIGS
                 for causal in (False, True)]
        specs += [_dispatch.tensorcore_plan("float32", dpad, causal, cc, precision,
                                            form=_dispatch.F32_TERMS[precision][1]).spec
                  for (dpad, precision) in _dispatch.TC_F32_CONFIGS
                  for causal in (False, True)]
        specs += [_dispatch.tensorcore_plan("float32", dpad, causal, cc, "highest",
                                            form="3xfp16").spec
                  for dpad in _dispatch.TC_F16SPLIT_CONFIGS for causal in (False, True)]
    return specs


def _hopper_schedule_specs():
    """Every Hopper schedule tests/test_gpu.py forces, for every head dim and mask."""
    specs = set()
    for sched in HOPPER_SCHEDULES:
        table = hopper_schedule_table(_dispatch.HOPPER_TABLE, *sched, True)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(_dispatch, "HOPPER_TABLE", table)
            for dpad, causal, long_keys in table:
                plan = _dispatch.hopper_plan("float16", dpad, causal,
                                             _dispatch.HOPPER_LONG_SK + long_keys)
                specs.add(plan.spec)
    return sorted(specs, key=lambda s: s.name)


def _hopper_async_o_specs():
    """The Hopper forward with the async O epilogue (_dispatch.HOPPER_ASYNC_O, on by default:
    cuflash_fwd_wgmma_ao) for every HOPPER_TABLE entry it fits, float16 and bfloat16, with the
    consumer counts tests/test_gpu.py::test_hopper_async_o forces (two and three at D = 64)."""
    specs = set()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_dispatch, "HOPPER_ASYNC_O", True)
        for (dpad, causal, long_keys), (cfg, _) in list(_dispatch.HOPPER_TABLE.items()):
            for consumers in ((2, 3) if dpad == 64 else (cfg.consumers,)):
                t = cfg._replace(consumers=consumers)
                if not _dispatch.hopper_async_o_fits(t, dpad):
                    continue
                mp.setattr(_dispatch, "HOPPER_TABLE",
                           {**_dispatch.HOPPER_TABLE, (dpad, causal, long_keys): (t, True)})
                mp.setattr(_dispatch, "HOPPER_C3_GAIN", float("inf"))
                for dt in _dispatch.HOPPER_DTYPES:
                    plan = _dispatch.hopper_plan(dt, dpad, causal,
                                                 _dispatch.HOPPER_LONG_SK + long_keys)
                    assert "_ao<" in plan.spec.name, plan.spec.name
                    specs.add(plan.spec)
    return sorted(specs, key=lambda s: s.name)


def _hopper_other_o_epilogue_specs():
    """The Hopper forward's table entries with _dispatch.HOPPER_ASYNC_O flipped (the direct
    stores, the default before session n), which tests/test_gpu.py's async O tests compare
    against and a caller gets by setting the flag."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_dispatch, "HOPPER_ASYNC_O", not _dispatch.HOPPER_ASYNC_O)
        return [_dispatch.hopper_plan(dt, dpad, causal, _dispatch.HOPPER_LONG_SK + long_keys).spec
                for dpad, causal, long_keys in _dispatch.HOPPER_TABLE
                for dt in _dispatch.HOPPER_DTYPES]


def _bwd_candidate_specs(cc):
    """The tensor-core backward's speed candidates (_dispatch.TC_BWD_CANDIDATES), which
    tests/test_backward_gpu.py and benchmarks/bwd_tune.py put in place of the defaults on the
    H200 (sm_90 only: a candidate that becomes a default is compiled for sm_80 with them)."""
    if cc != 90:
        return []
    return [plan.spec for bp in _dispatch.bwd_candidate_plans(cc) for _, plan in bp.passes]


def _hopper_bwd_other_layout_specs(cc):
    """The Hopper backward with its other dS layout (_dispatch.HOPPER_BWD_DS_KMAJOR flipped),
    which tests/test_backward_gpu.py forces on the H200."""
    if cc != 90:
        return []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_dispatch, "HOPPER_BWD_DS_KMAJOR", not _dispatch.HOPPER_BWD_DS_KMAJOR)
        return [_dispatch.bwd_hopper_plan(dt, dpad, causal, det).passes[0][1].spec
                for dt in _dispatch.HOPPER_BWD_DTYPES for dpad in _dispatch.HOPPER_BWD_CONFIGS
                for causal in (False, True) for det in (False, True)]


def _hopper_bwd_overlap_specs(cc):
    """The Hopper backward's D = 256 form with the overlapped schedule
    (_dispatch.HOPPER_BWD_OVERLAP), which tests/test_backward_gpu.py and the bench force."""
    if cc != 90:
        return []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_dispatch, "HOPPER_BWD_OVERLAP", not _dispatch.HOPPER_BWD_OVERLAP)
        return [_dispatch.bwd_hopper_plan(dt, 256, causal, det).passes[0][1].spec
                for dt in _dispatch.HOPPER_BWD_DTYPES
                for causal in (False, True) for det in (False, True)]


CASES = [(spec, arch) for arch in ARCHS
         for spec in (_specs(int(arch[3:])) + _other_epilogue_specs(int(arch[3:]))
                      + _bwd_candidate_specs(int(arch[3:]))
                      + _hopper_bwd_other_layout_specs(int(arch[3:]))
                      + _hopper_bwd_overlap_specs(int(arch[3:])))]
CASES += [(spec, "sm_90a")
          for spec in (_hopper_schedule_specs() + _hopper_async_o_specs()
                       + _hopper_other_o_epilogue_specs())
          if (spec, "sm_90a") not in CASES and (spec, "sm_90") not in CASES]
# Each distinct compilation once: a spec with a fixed arch compiles for it whatever the list it came
# from, and some plans appear in more than one list.
CASES = list({(spec, spec.arch or arch): None for spec, arch in CASES})
# Every plan the dispatcher can return on sm_80 and sm_90 devices is in CASES (the Hopper kernel's
# with arch sm_90a).
assert any(s.arch == "sm_90a" for s, _ in CASES)


#: (spec, arch) -> its CompileReport: the SASS tests below read the cubins the spill test
#: compiled, so each distinct specialisation compiles once per run (CI: 2 cores).
_REPORTS = {}


def _report(spec, arch=None):
    """`_compile.compile_report(spec, arch)`, once per (spec, arch) in this process."""
    key = (spec, arch or spec.arch)
    if key not in _REPORTS:
        _REPORTS[key] = _compile.compile_report(spec, key[1])
    return _REPORTS[key]


@pytest.fixture(scope="module", autouse=True)
def compile_selected_cases_in_parallel(request, nvrtc_present):
    """Fill `_REPORTS` for the compile cases this session selected, on every core. A case whose
    compile raises is left out, so that its own test compiles it again and reports the error."""
    keys = []
    for item in request.session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if item.module is request.module and "spec" in params and "arch" in params:
            key = (params["spec"], params["spec"].arch or params["arch"])
            if key not in _REPORTS:
                keys.append(key)
    keys = list(dict.fromkeys(keys))
    jobs = int(os.environ.get("CUFLASH_COMPILE_JOBS") or os.cpu_count() or 1)
    if jobs <= 1 or len(keys) <= 1:
        return

    def one(key):
        try:
            return key, _compile.compile_report(*key)
        except Exception:  # the case's own test compiles it again and shows the error
            return key, None

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for key, rep in pool.map(one, keys):
            if rep is not None:
                _REPORTS[key] = rep


@pytest.mark.parametrize("spec,arch", CASES,
                         ids=[f"{s.name.replace('cuflash::', '')}-{a}" for s, a in CASES])
def test_compiles_without_spills(spec, arch):
    rep = _report(spec, spec.arch or arch)  # sm_90a kernels: only for sm_90a
    COMPILE_REPORTS.append(rep)
    assert rep.spill_stores == 0 and rep.spill_loads == 0, rep.summary()
    assert rep.stack_bytes == 0, f"local memory in use: {rep.summary()}"
    serialized = [n for n in rep.notes if "serializ" in n]  # ptxas gave up pipelining wgmma
    assert not serialized, serialized
    assert rep.cubin_size > 0


def test_source_hash_covers_headers(tmp_path, monkeypatch):
    """The cache key (source hash) changes when an included header changes."""
    import kernels_cu

    names = ["attn_generic.cu"] + sorted(p.name for p in kernels_cu.SOURCE_DIR.glob("*.cuh"))
    for name in names:  # the family and every header it may include
        (tmp_path / name).write_text((kernels_cu.SOURCE_DIR / name).read_text())
    monkeypatch.setattr(_compile, "SOURCE_DIR", tmp_path)
    _compile.family_source.cache_clear()
    try:
        src1, h1 = _compile.family_source("attn_generic")
        assert "struct AttnParams" in src1  # the header was inlined
        _compile.family_source.cache_clear()
        (tmp_path / "common.cuh").write_text((tmp_path / "common.cuh").read_text() + "\n// edit\n")
        _, h2 = _compile.family_source("attn_generic")
        assert h1 != h2
    finally:
        _compile.family_source.cache_clear()


def test_missing_family_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="no kernel family"):
        _compile.family_source("does_not_exist")


@pytest.mark.parametrize("dtype,d,precision,form", [
    ("float16", 128, "highest", None), ("float32", 64, "high", None),
    ("float32", 128, "highest", "3xtf32"), ("float32", 64, "highest", "3xfp16"),
    ("float32", 128, "highest", "3xfp16"), ("float32", 256, "highest", "3xfp16")])
def test_hopper_kernel_uses_tma_and_wgmma(dtype, d, precision, form, monkeypatch):
    """The sm_90a cubin really holds the Hopper instructions (HGMMA: warpgroup MMA, UTMALDG: TMA
    loads) and no mma.sync (HMMA), checked on the disassembly when nvdisasm is available. The
    float32 TF32 forms' warpgroup MMAs are all TF32 (HGMMA.64xNx8.F32.TF32), three per
    multiply-add step for "highest"; the 3xfp16 form's are all fp16 (HGMMA.64xNx16.F32), three per
    k16 step of each product."""
    import re

    monkeypatch.setattr(_dispatch, "HOPPER_F32_D256", True)  # D = 256: the head-dim split form
    plan = _dispatch.hopper_plan(dtype, d, True, 1024, precision, form=form)
    assert (form or "") in plan.label
    assert ("hsplit" in plan.label) == (d == 256)
    sass = _sass(_report(plan.spec).cubin)
    assert "HGMMA" in sass and "UTMALDG" in sass
    assert "HMMA" not in sass.replace("HGMMA", "")
    hgmma = re.findall(r"HGMMA\.(\d+)x(\d+)x(\d+)\.F32\.?(\w*)", sass)
    assert hgmma, "no HGMMA with float32 accumulators found"
    if dtype == "float32" and form != "3xfp16":
        assert all(k == "8" and t == "TF32" for _, _, k, t in hgmma), sorted(set(hgmma))
        # one wgmma per k8 step of each product and term: S over D / 8 steps, P V over BN / 8
        terms = 3 if precision == "highest" else 1
        per_tile = terms * (d // 8 + plan.block_n // 8)
        assert len(hgmma) % per_tile == 0, (len(hgmma), per_tile)
    else:
        assert all(k == "16" and t in ("F16", "") for _, _, k, t in hgmma), sorted(set(hgmma))
        if form == "3xfp16":
            # S: D / 16 k16 steps of m64nBN; P V: BN / 16 steps of m64n64 per 64 columns of O;
            # three products each (hsplit: each consumer's half of the head dim, D / 2)
            dc = d // 2 if "hsplit" in plan.label else d
            per_tile = 3 * (dc // 16 + plan.block_n // 16 * (dc // 64))
            assert len(hgmma) % per_tile == 0, (len(hgmma), per_tile)
            assert {(m, n) for m, n, _, _ in hgmma} == {("64", str(plan.block_n)), ("64", "64")}


@pytest.mark.parametrize("d", [64, 128])
def test_hopper_async_o_sends_o_by_bulk_copies(d, monkeypatch):
    """The async O epilogue's kernel (cuflash_fwd_wgmma_ao) writes O with bulk copies from
    shared memory (UBLKCP) and no 16-byte global stores (the plain kernel's O stores; without the
    mask nothing else stores 16 bytes), and the plain kernel has no bulk copy."""
    monkeypatch.setattr(_dispatch, "HOPPER_ASYNC_O", False)
    plain = _dispatch.hopper_plan("float16", d, False, 1024, sq=1024)
    monkeypatch.setattr(_dispatch, "HOPPER_ASYNC_O", True)
    ao = _dispatch.hopper_plan("float16", d, False, 1024, sq=1024)
    assert "cuflash_fwd_wgmma_ao<" in ao.spec.name and "asyncO" in ao.label
    sass_ao, sass_plain = _sass(_report(ao.spec).cubin), _sass(_report(plain.spec).cubin)
    assert "UBLKCP" in sass_ao and "STG.E.128" not in sass_ao
    assert "UBLKCP" not in sass_plain and "STG.E.128" in sass_plain
    assert "HGMMA" in sass_ao and "UTMALDG" in sass_ao


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("d", [64, 128, 192, 256])
def test_tensorcore_fp16split_uses_fp16_mma(d, arch):
    """The mma.sync kernel's 3xfp16 form of float32 "highest" (attn_mma.cu, OP = fp16_t) runs fp16
    products with float32 accumulators only (HMMA.16816.F32, no TF32 HMMA), three per k16 step:
    the scores' k-loop body (one 16-column step, not unrolled: 3 BN / 8) and the unrolled P V
    (3 BN / 16 D / 8) in the cubin; its 3xTF32 form stays TF32 (HMMA.1688.F32.TF32)."""
    import re

    plan = _dispatch.tensorcore_plan("float32", d, False, int(arch[3:]), "highest",
                                     form="3xfp16")
    assert plan.label.startswith("tensorcore<float32,3xfp16,"), plan.label
    assert plan.spec.name.endswith(", cuflash::fp16_t>"), plan.spec.name
    hmma = re.findall(r"HMMA\.(\w+)\.F32(\.\w+)?", _sass(_report(plan.spec, arch).cubin))
    assert hmma and set(hmma) == {("16816", "")}, sorted(set(hmma))
    bn = plan.block_n
    assert len(hmma) == 3 * (bn // 8 + bn // 16 * (d // 8)), len(hmma)
    if d not in _dispatch.f32_head_dims("highest", int(arch[3:]), "3xtf32"):
        return  # sm_80 D = 128: no 3xTF32 form (TC_F32_ARCH_CONFIGS)
    old = _dispatch.tensorcore_plan("float32", d, False, int(arch[3:]), "highest", form="3xtf32")
    tf32 = re.findall(r"HMMA\.(\w+)\.F32(\.\w+)?", _sass(_report(old.spec, arch).cubin))
    assert tf32 and set(tf32) == {("1688", ".TF32")}, sorted(set(tf32))


def _sass(cubin):
    """The disassembly of a cubin (nvdisasm -c), or skip when nvdisasm is not installed."""
    import os
    import shutil
    import subprocess
    import sys
    import tempfile

    nvdisasm = shutil.which("nvdisasm")
    for entry in ([] if nvdisasm else sys.path):  # the nvidia-cuda-nvdisasm wheel (test extra)
        found = sorted(Path(entry).glob("nvidia/*/bin/nvdisasm"))
        if found:
            nvdisasm = str(found[-1])
            break
    if nvdisasm is None:
        pytest.skip("nvdisasm not installed (pip install nvidia-cuda-nvdisasm, in the test extra)")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True,
                              check=True).stdout


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("causal,det", [(False, False), (True, True)])
def test_f32_tensorcore_backward_uses_fp16_mma(causal, det, arch):
    """The float32 tensor-core backward (attn_bwd_mma.cu, T = float, OP = fp16_t) runs fp16
    products with float32 accumulators only (HMMA.16816.F32), three per k16 step and n8 tile, in
    the predicted static count: S^T (k-loop not unrolled: 3 BM / 8), dP^T (two halves, each loop
    not unrolled: 3 BM / 8), dV and dK (unrolled: 3 (BM / 16) (D / 8) each), dQ (unrolled over the
    block's BN / 16 key steps and the warp's DQ_COLS / 8 n8 tiles); at D = 64, BM = 32, BN = 64:
    12 + 12 + 48 + 48 + 48 = 168 (per tile and warp executed: 3 x 80 = 240, the S^T and dP^T
    loops running D / 16 = 4 steps). Its stats pass: S and dP loops, 3 BN / 8 each."""
    import re

    cc = int(arch[3:])
    bp = _dispatch.bwd_tensorcore_f32_plan(64, causal, det, cc)
    assert bp.label.startswith("tensorcore-bwd<float32,3xfp16,"), bp.label
    (_, stats), (_, kern) = bp.passes[:2]
    assert kern.spec.name.endswith(", cuflash::fp16_t>"), kern.spec.name
    bm, bn, nwarps, d = kern.block_m, kern.block_n, kern.threads // 32, 64
    dq_cols = d // (nwarps // (bm // 16))
    want = 3 * (bm // 8 + bm // 8 + 2 * (bm // 16) * (d // 8) + (bn // 16) * (dq_cols // 8))
    hmma = re.findall(r"HMMA\.(\w+)\.F32(\.\w+)?", _sass(_report(kern.spec, arch).cubin))
    assert hmma and set(hmma) == {("16816", "")}, sorted(set(hmma))
    assert len(hmma) == want, (len(hmma), want)
    hmma = re.findall(r"HMMA\.(\w+)\.F32(\.\w+)?", _sass(_report(stats.spec, arch).cubin))
    assert hmma and set(hmma) == {("16816", "")}, sorted(set(hmma))
    assert len(hmma) == 2 * 3 * (stats.block_n // 8), len(hmma)


@pytest.mark.parametrize("dtype,d", [("float16", 64), ("bfloat16", 128), ("float16", 256),
                                     ("bfloat16", 256)])
@pytest.mark.parametrize("causal,det", [(False, False), (True, True)])
def test_hopper_backward_uses_wgmma(dtype, d, causal, det):
    """The Hopper backward's cubin holds warpgroup MMAs only (no HMMA), 16-bit operands with
    float32 accumulators, and exactly the predicted count per query tile and warpgroup: S^T and
    dP^T D / 16 each (m64nBM), dV and dK BM / 16 each (m64nD), dQ BN / 16 per 64 x 64 piece
    (m64n64, PIECES / 2 pieces): 32 at D = 64 and 128. D = 256 (SPLIT: two warpgroups share
    the keys) halves the widths: S^T, dP^T m64n(BM / 2), dV, dK m64n(D / 2): 16 + 16 + 4 + 4 +
    8 = 48. The main loop is not unrolled, so the static count is that of one tile."""
    import re

    bp = _dispatch.bwd_hopper_plan(dtype, d, causal, det)
    kern = bp.passes[0][1]
    sass = _sass(_report(kern.spec).cubin)
    assert "HMMA" not in sass.replace("HGMMA", "")
    hgmma = re.findall(r"HGMMA\.64x(\d+)x16\.F32(\.BF16)?", sass)
    bm, bn = kern.block_m, kern.block_n
    split = d > 128  # BwdWgmmaConfig::SPLIT
    consumers = kern.threads // 128
    pieces = (bm // 64) * (d // 64) // consumers
    sn, dkv = (bm // consumers, d // consumers) if split else (bm, d)
    want = {str(sn): 2 * (d // 16)}
    want[str(dkv)] = want.get(str(dkv), 0) + 2 * (bm // 16)
    want["64"] = want.get("64", 0) + pieces * (bn // 16)
    got = {}
    for n, _ in hgmma:
        got[n] = got.get(n, 0) + 1
    assert got == want, (got, want)
    assert all((t == ".BF16") == (dtype == "bfloat16") for _, t in hgmma)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype,causal", [("float16", False), ("bfloat16", True)])
def test_hopper_backward_deterministic_hand_over_in_sass(dtype, causal, d):
    """The deterministic hand-over in the SASS (attn_bwd_wgmma.cu version 1.2; notes/
    BACKWARD.md, "The deterministic hand-over"): thread 0's st.release alone (MEMBAR.ALL.GPU,
    then STG.E.STRONG.GPU) at its two sites, the tile loop and the end, and no MEMBAR.SC.GPU (a
    __threadfence before the release cost 3-11%); inside the loop the next tile's copies
    (LDGSTS) come after the hand-over at D = 64 and 256 (NEXT_LATE) and before it at D = 128.
    The default kernel has no GPU-scope fence or strong store at all."""
    import re

    def ops(det):
        spec = _dispatch.bwd_hopper_plan(dtype, d, causal, det).passes[0][1].spec
        return re.findall(r"\b(MEMBAR\.[A-Z.]+|STG\.E\.STRONG\.GPU|LDGSTS|BAR\.SYNC)",
                          _sass(_report(spec).cubin))

    plain = ops(False)
    assert not [o for o in plain if o.startswith("MEMBAR") and o.endswith("GPU")], plain
    assert "STG.E.STRONG.GPU" not in plain
    det = ops(True)
    gpu_fences = [i for i, o in enumerate(det) if o.startswith("MEMBAR") and o.endswith("GPU")]
    assert [det[i] for i in gpu_fences] == ["MEMBAR.ALL.GPU"] * 2, det
    assert all(det[i + 1] == "STG.E.STRONG.GPU" for i in gpu_fences), det
    # the loop: from the first barrier (after the prologue's copies) to the second release
    loop = det[det.index("BAR.SYNC"):gpu_fences[1]]
    release = loop.index("STG.E.STRONG.GPU")
    copies = [i for i, o in enumerate(loop) if o == "LDGSTS"]
    assert copies, loop
    if d == 128:
        assert max(copies) < release, loop
    else:
        assert min(copies) > release, loop


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("dtype,causal,det", [("float16", False, False), ("bfloat16", True, True),
                                              ("float16", False, True)])
def test_hopper_backward_d256_schedule_matches_sass(dtype, causal, det, overlap):
    """The D = 256 form's main loop in the SASS shows the barriers, commit groups (their wgmma
    shapes) and wgmma waits of the schedule that tests/bwd_wgmma_schedule.py checks, in its
    order (both schedules: _dispatch.HOPPER_BWD_OVERLAP): the schedule model is the kernel's."""
    import re
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    import bwd_wgmma_schedule as sched

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_dispatch, "HOPPER_BWD_OVERLAP", overlap)
        spec = _dispatch.bwd_hopper_plan(dtype, 256, causal, det).passes[0][1].spec
    # the loop: the longest backward branch around HGMMAs (the tile loop is not unrolled)
    body, label_at = [], {}
    for ln in _sass(_report(spec).cubin).splitlines():
        m = re.match(r"\s*(\.L_x_\d+):", ln)
        if m:
            label_at[m.group(1)] = len(body)
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+([^;]*);", ln)
        if m:
            body.append(m.group(1))
    loops = []
    for i, ins in enumerate(body):
        m = re.search(r"BRA\s+`?\(?(\.L_x_\d+)", ins)
        if m and label_at.get(m.group(1), i + 1) <= i:
            lo = label_at[m.group(1)]
            if any("HGMMA" in x for x in body[lo:i]):
                loops.append((i - lo, lo, i))
    _, lo, hi = max(loops)
    seq, group = [], {}
    for ins in body[lo:hi + 1]:
        if "BAR.SYNC" in ins:
            seq.append(("bar",))
        elif "HGMMA" in ins:
            n = int(re.search(r"HGMMA\.64x(\d+)x16", ins).group(1))
            group[n] = group.get(n, 0) + 1
            if re.search(r",\s*gsb0\s*$", ins):
                seq.append(("group", tuple(sorted(group.items()))))
                group = {}
        elif "WARPGROUP.DEPBAR" in ins:
            seq.append(("wait", int(re.search(r"gsb0,\s*0x(\d+)", ins).group(1))))
    assert not group, "an HGMMA group without its gsb0 end"
    assert seq == sched.sass_sequence(sched.tile_ops(1, 3, overlap)), seq


def test_wgmma_header_is_current():
    """kernels_cu/wgmma_ops.cuh is what kernels_cu/gen_wgmma.py writes (run it after editing)."""
    import importlib.util

    import kernels_cu

    path = kernels_cu.SOURCE_DIR / "gen_wgmma.py"
    spec = importlib.util.spec_from_file_location("gen_wgmma", path)
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert (kernels_cu.SOURCE_DIR / "wgmma_ops.cuh").read_text() == gen.main(), \
        "wgmma_ops.cuh is stale: run python kernels_cu/gen_wgmma.py"


def test_precompile_fills_the_cache_that_get_kernel_reads(tmp_path, monkeypatch):
    """cuflash-precompile writes the images `_compile.compiled_image` (get_kernel's loader) then
    reads without compiling; the key separates architectures."""
    from click.testing import CliRunner

    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(tmp_path))
    r = CliRunner().invoke(precompile.main, ["--arch", "sm_80", "--arch", "sm_90", "--only",
                                             "merge_states<float, float>", "-j", "2"])
    assert r.exit_code == 0, r.output
    assert "sm_80: 1 compiled, 0 already cached" in r.output
    assert "sm_90: 1 compiled, 0 already cached" in r.output
    spec = _compile.Specialisation("merge", "cuflash::cuflash_merge_states<float, float>")
    assert _compile.cache_path(spec, "sm_80") != _compile.cache_path(spec, "sm_90")
    assert _compile.cache_path(spec, "sm_90").is_file()

    def no_compile(*a, **k):
        raise AssertionError("compiled although the image is cached")

    monkeypatch.setattr(_compile, "nvrtc_compile", no_compile)
    image, mangled, now = _compile.compiled_image(spec, "sm_90")
    assert not now and image[:4] == b"\x7fELF" and "cuflash_merge_states" in mangled
    r = CliRunner().invoke(precompile.main, ["--arch", "sm_90", "--only", "merge_states<float, f"])
    assert r.exit_code == 0 and "0 compiled, 1 already cached" in r.output, r.output


def test_precompile_ptx_for_a_virtual_target(tmp_path, monkeypatch):
    """A compute_XY target (a device newer than the NVRTC) gets PTX, which the driver loads."""
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(tmp_path))
    spec = _compile.Specialisation("merge", "cuflash::cuflash_merge_states<float, float>")
    image, mangled, now = _compile.compiled_image(spec, "compute_90")
    assert now and b".target sm_90" in image and image.endswith(b"\0")


def test_precompile_rejects_a_bad_arch():
    from click.testing import CliRunner

    r = CliRunner().invoke(precompile.main, ["--arch", "ampere", "--list"])
    assert r.exit_code != 0 and "expected sm_<compute capability>" in r.output


@pytest.mark.parametrize("d", [64, 128, 256])
def test_hopper_presplit_loads_split_tiles(d, monkeypatch):
    """HOPPER_F32_PRESPLIT: the same warpgroup MMAs per tile as the in-place 3xfp16 form, TMA
    loads, and no split of K and V left in the producer (fewer fp16 packs: Q's split and P's
    remain); the split kernel itself is plain CUDA (no HGMMA, no TMA)."""
    import re

    monkeypatch.setattr(_dispatch, "HOPPER_F32_D256", True)
    sass = {}
    for pre in (False, True):
        plan = _dispatch.hopper_plan("float32", d, True, 1024, "highest", presplit=pre)
        assert ("presplit" in plan.label) == pre and ("fp16pre_t" in plan.spec.name) == pre
        sass[pre] = _sass(_report(plan.spec).cubin)
    count = {pre: len(re.findall(r"HGMMA\.64x\d+x16\.F32", s)) for pre, s in sass.items()}
    assert count[True] == count[False] > 0, count
    assert "UTMALDG" in sass[True]
    packs = {pre: s.count("F2FP.F16.F32.PACK_AB") for pre, s in sass.items()}
    assert packs[True] < packs[False], packs
    split = _sass(_report(_dispatch.presplit_spec(d, plan.block_n)).cubin)
    assert "HGMMA" not in split and "UTMALDG" not in split and "F2FP.F16.F32.PACK_AB" in split
