#!/usr/bin/env python
"""Inference benchmark (issue 14): decoding (Sq = 1) in GB/s of K and V read, cuflash against
PyTorch SDPA's cuDNN and FLASH backends (enable_gqa) in the same run; cuflash's paged cache
(page 16) against its contiguous one; varlen prefill through each attention_varlen kernel
(--varlen-impl) and torch's FlashAttention-2 varlen forward, against the same token count through
cuflash's dense kernel; GQA prefill (B = 1, H = 32, Hkv = 8, S = 8k,
causal, bfloat16) against torch's cuDNN and FLASH backends.

Run from the repository root::

    PYTHONPATH=. python benchmarks/bench_inference.py --quick      # < 60 s on an H200
    PYTHONPATH=. python benchmarks/bench_inference.py              # the issue's grid
    PYTHONPATH=. python benchmarks/bench_inference.py --markdown /tmp/inference.md
    PYTHONPATH=. python benchmarks/bench_inference.py --only decode --b 1,64 --sk 8192,131072
    PYTHONPATH=. python benchmarks/bench_inference.py --only decode,kvcache \
        --impl cuflash,cuflash-v1,torch-cudnn,torch-flash     # the decode kernels' versions

`--impl` picks the decode part's implementations (default cuflash, torch-cudnn, torch-flash):
`--force-splits 1,2,4` adds `cuflash-s1`, `cuflash-s2`, ... (the default version with the split
count forced; configure caps it at one split per key tile), to measure the split rule's choice,
and for each `cuflash-vN` in `--impl` also `cuflash-vN-s1`, ... (that version, counts forced).
`cuflash-v1` is cuflash with `_decode.DECODE_VERSION = 1` (session f's decode kernels and split
rule; `cuflash` is the default version 2), `cuflash-v3` with version 3 (version 2 plus the
L2::256B prefetch hint on the K/V copies), `cuflash-v4` with version 4 (sm_90: version 2 with
one bulk copy per K/V row), `cuflash-v5` with version 5 (version 2 with the K/V copies under
an evict-first L2 policy), `cuflash-v6` with version 6 (version 2 with swizzled K/V tiles in
shared memory), `cuflash-v7` with version 7 (version 2 with three K/V stages per warp at
MT = 2, the G = 32 points), `cuflash-v8` with version 8 (version 6 with combine version 3, a
warp a packed row, up to 16 splits), so the versions are timed in one run on the same inputs;
with them, the kvcache part adds `contiguous-v1`, `paged16-v1` (`-v3` ... `-v8`). `cuflash-rule3` is
the default version with split rule 3 (`_decode.DECODE_SPLIT_RULE = 3`; `cuflash` has the
default, rule 4 since session m), `cuflash-rule4` with rule 4 (rule 2, one split where rule 3
picks one), `cuflash-v6-rule4` and `cuflash-v8-rule4` versions 6 and 8 under rule 4, checked and
timed like the others (`cuflash-vN` runs its version under the default rule); each decode row's
label ends with the split count every cuflash implementation ran
(`splits cuflash=3,cuflash-rule3=1,cuflash-s1=1`).

Every result is checked before it is timed: two (batch, kv head) slices of the output (the
first and the last), with their query heads, against the float64 reference under the project's
pass rule (cuflash.reference.pass_threshold). A failing implementation is reported, not timed.
Time: GPU time, as benchmarks/bench.py measures it (its `time_impl`): after --warmup calls, a
spinning kernel holds the stream while the --repeats timed calls and their CUDA events are
enqueued, so the events time the GPU's work and not the Python before each launch (host time per
call is benchmarks/host_time.py's measurement); the median is reported. The decode and kvcache
grids rotate over enough copies of their inputs that K and V are not in L2 when read (at least
2 x the L2 size in all, up to 16 copies). Until 2026-12-02 (session f) each call was timed alone
between two events after a synchronisation, which added the host time before the launch to
every implementation's GPU time (about 45 us a cuflash decode call: B = 1, Sk = 128k, Hkv = 8 read
at 3.1 TB/s that way). GB/s counts the bytes of K and V of every sequence once
(B * Sk * Hkv * D * 2 * itemsize); the copy ceiling of an H200 is about 4.3 TB/s.
"""
from __future__ import annotations

import argparse
import math
import sys
import time

import os

import numpy as np

import cuflash
from cuflash import reference

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import Spinner, time_impl  # noqa: E402  (bench.py's timing method, one copy)

H, D = 32, 128
FULL = dict(b=(1, 8, 64), sk=(1024, 8192, 32768, 131072), hkv=(32, 8, 1))
QUICK = dict(b=(1, 64), sk=(8192, 131072), hkv=(8,))
MAX_KV_BYTES = 40 * 2**30  # skip points whose K + V exceed this


_SPINNER = None
TIME_CAP_S = 2.0  # most seconds the timed calls of one implementation and point may take


def _events(fn, warmup, repeats, n_sets=None):
    """Median GPU seconds of `fn(i)` (i: the input set, 0 .. n_sets - 1) or, without `n_sets`,
    of `fn()`, by bench.py's `time_impl`: warm-up calls, then the timed calls between CUDA events
    enqueued behind a spinning kernel on the current CuPy stream (torch's default stream is the
    same legacy stream)."""
    import cupy as cp

    global _SPINNER
    if _SPINNER is None:
        _SPINNER = Spinner(cp)
        if _SPINNER.err:
            print(f"spin kernel unavailable ({_SPINNER.err}): host time leaks into the timings",
                  file=sys.stderr)
    run = fn if n_sets is not None else (lambda i: fn())
    times, _, _ = time_impl(cp, run, cp.cuda.get_current_stream(), n_sets or 1, warmup, repeats,
                            TIME_CAP_S, _SPINNER)
    return float(np.median(times)) * 1e-3


def _n_sets(nbytes, l2_bytes=None):
    """Copies of a point's inputs that keep K and V out of L2 between calls: enough for twice
    the L2 size in all, at most 16 (one when a single copy already exceeds it)."""
    if l2_bytes is None:
        import cupy as cp

        l2_bytes = cp.cuda.Device().attributes.get("L2CacheSize", 60 * 2**20)
    return int(min(16, max(1, math.ceil(2 * l2_bytes / max(1, nbytes)))))


def _host(x):
    import cupy as cp

    return cp.asnumpy(cp.asarray(x).astype(cp.float32)).astype(np.float64)


class _Checker:
    """The pass rules of one point's inputs, computed once and applied to every implementation's
    output (the float64 reference and the rule's naive counterpart are the costly part: at
    Sk = 128k computing them per implementation took most of the run's time).
    q: (B, H, 1, D); k, v: (B, Hkv, Sk, D) (CuPy views). Judges slices (0, 0), (B-1, Hkv-1)."""

    def __init__(self, q, k, v, b, hkv):
        self.g = g = q.shape[1] // hkv
        self.rules = []
        for bi, hi in dict.fromkeys(((0, 0), (b - 1, hkv - 1))):
            qs = _host(q[bi, hi * g:(hi + 1) * g])
            ks, vs = _host(k[bi, hi:hi + 1]), _host(v[bi, hi:hi + 1])
            self.rules.append((bi, hi, reference.pass_threshold(qs, ks, vs, dtype="float16")))

    def __call__(self, o):
        """None if `o` (B, H, 1, D) passes on every judged slice, else the reasons."""
        g = self.g
        for bi, hi, rule in self.rules:
            verdict = rule.judge(_host(o[bi, hi * g:(hi + 1) * g]))
            if not verdict.passed:
                return "; ".join(verdict.reasons)
        return None


def _torch_impls():
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except Exception:
        return {}
    out = {}
    for name, be in (("torch-cudnn", SDPBackend.CUDNN_ATTENTION),
                     ("torch-flash", SDPBackend.FLASH_ATTENTION)):
        def run(q, k, v, be=be, causal=False):
            with sdpa_kernel([be]):
                return torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
        out[name] = run
    return out


class _DecodeVersion:
    """`with _DecodeVersion(v):` runs cuflash's decode family at kernel version `v` (None: the
    default) and, with `rule`, split rule `rule` (`_decode.DECODE_SPLIT_RULE`; None: the
    default), restoring the module's values after (assigning them invalidates the call caches'
    records, so each version and rule records its own)."""

    def __init__(self, version, rule=None):
        self.version, self.rule = version, rule

    def __enter__(self):
        from cuflash import _decode

        self.saved = _decode.DECODE_VERSION, _decode.DECODE_SPLIT_RULE
        if self.version is not None:
            _decode.DECODE_VERSION = self.version
        if self.rule is not None:
            _decode.DECODE_SPLIT_RULE = self.rule

    def __exit__(self, *exc):
        from cuflash import _decode

        if _decode.DECODE_VERSION != self.saved[0]:
            _decode.DECODE_VERSION = self.saved[0]
        if _decode.DECODE_SPLIT_RULE != self.saved[1]:
            _decode.DECODE_SPLIT_RULE = self.saved[1]


class _ForcedSplits:
    """`with _ForcedSplits(n):` makes cuflash's decode split choice return `n` (None: its own
    rule; `configure` still caps it at one split per key tile), restoring the rule after."""

    def __init__(self, n):
        self.n = n

    def __enter__(self):
        from cuflash import _decode

        self.saved = _decode.choose_splits
        if self.n is not None:
            _decode.choose_splits = lambda *a, **kw: self.n

    def __exit__(self, *exc):
        from cuflash import _decode

        if _decode.choose_splits is not self.saved:
            _decode.choose_splits = self.saved


#: cuflash's decode implementations -> the decode kernels' version they run.
CUFLASH_IMPLS = {"cuflash": None, "cuflash-v1": 1, "cuflash-v2": 2, "cuflash-v3": 3, "cuflash-v4": 4,
                 "cuflash-v5": 5, "cuflash-v6": 6,
                 "cuflash-v7": 7, "cuflash-v8": 8}
#: cuflash's decode implementations with a named split rule -> (version, rule); version None is
#: the default version.
CUFLASH_RULE_IMPLS = {"cuflash-rule3": (None, 3), "cuflash-rule4": (None, 4),
                      "cuflash-v6-rule4": (6, 4), "cuflash-v8-rule4": (8, 4)}


def bench_decode(grid, args, rows):
    import cupy as cp
    import torch

    torch_impls = {k: v for k, v in _torch_impls().items() if k in args.impls}
    for b in grid["b"]:
        for sk in grid["sk"]:
            for hkv in grid["hkv"]:
                kv_bytes = 2 * b * sk * hkv * D * 2
                if kv_bytes > MAX_KV_BYTES:
                    continue
                n = _n_sets(kv_bytes)
                sets = [tuple(torch.randn(*shape, device="cuda", dtype=torch.float16)
                              for shape in ((b, H, 1, D), (b, hkv, sk, D), (b, hkv, sk, D)))
                        for _ in range(n)]
                cps = [tuple(cp.from_dlpack(x) for x in st) for st in sets]
                q, k, v = cps[0]
                res = {}
                o = cp.empty((b, H, 1, D), dtype=cp.float16)
                fn = lambda i: cuflash.attention(*cps[i], out=o)  # noqa: E731
                check = _Checker(q, k, v, b, hkv)
                label = ""
                impls = [(nm, ver, None, None) for nm, ver in CUFLASH_IMPLS.items()
                         if nm in args.impls]
                impls += [(nm, ver, None, rule) for nm, (ver, rule) in CUFLASH_RULE_IMPLS.items()
                          if nm in args.impls]
                impls += [(f"cuflash-s{ns}", None, ns, None) for ns in args.force_splits]
                impls += [(f"{nm}-s{ns}", ver, ns, None) for nm, ver in CUFLASH_IMPLS.items()
                          if ver is not None and nm in args.impls for ns in args.force_splits]
                splits = {}
                for name, version, nsplit, rule in impls:
                    with _DecodeVersion(version, rule), _ForcedSplits(nsplit):
                        o.fill(np.nan)
                        fn(0)
                        splits[name] = _decode_splits(b, sk, hkv)
                        why = check(o)
                        res[name] = why or kv_bytes / _events(fn, args.warmup, args.repeats,
                                                              n) / 1e9
                        label = label or cuflash.dispatch_info(q, k, v)
                if splits:   # the split counts each implementation ran (the rules' choices)
                    label += " splits " + ",".join(f"{k}={v}" for k, v in splits.items())
                for name, run in torch_impls.items():
                    try:
                        to = run(*sets[0])
                        why = check(cp.from_dlpack(to))
                        res[name] = why or kv_bytes / _events(
                            lambda i: run(*sets[i]), args.warmup, args.repeats, n) / 1e9
                    except Exception as exc:  # backend refuses the shape
                        res[name] = f"n/a ({type(exc).__name__})"
                rows.append(("decode", b, sk, hkv, res, label))
                _print_row(rows[-1])
                sets = cps = q = k = v = o = to = None
                torch.cuda.empty_cache()


def _decode_splits(b, sk, hkv):
    """The split count `configure` gives cuflash's decode kernel at (B, Sk, Hkv) now (under the
    current version, rule and any forced count: the host's own arithmetic, as the launch does)."""
    from cuflash import _decode, _launch

    g = H // hkv
    plan = _decode.decode_plan("float16", D, False, False, rows=g)
    attrs = _launch.device_attributes(0)
    return _decode.configure(plan, (1, b, hkv), g, 1, sk, D, attrs).splits


def bench_paged(grid, args, rows):
    """attention_with_kvcache, contiguous (B, Sk, Hkv, D) vs paged (page 16, shuffled pages)."""
    import cupy as cp

    rng = np.random.default_rng(0)
    for b in grid["b"]:
        for sk in grid["sk"]:
            for hkv in grid["hkv"]:
                kv_bytes = 2 * b * sk * hkv * D * 2
                if 2 * kv_bytes > MAX_KV_BYTES:
                    continue
                n = _n_sets(kv_bytes)
                lens = cp.full((b,), sk, dtype=cp.int32)
                page = 16
                per = sk // page
                sets = []
                for _ in range(n):
                    q = cp.random.standard_normal((b, 1, H, D), dtype=cp.float32).astype(cp.float16)
                    kc = cp.random.standard_normal((b, sk, hkv, D), dtype=cp.float32).astype(
                        cp.float16)
                    vc = cp.random.standard_normal((b, sk, hkv, D), dtype=cp.float32).astype(
                        cp.float16)
                    perm = rng.permutation(b * per).astype(np.int32)
                    bt = cp.asarray(perm.reshape(b, per))
                    kp = cp.empty((b * per, page, hkv, D), dtype=cp.float16)
                    vp = cp.empty_like(kp)
                    kp[bt.ravel()] = kc.reshape(b * per, page, hkv, D)
                    vp[bt.ravel()] = vc.reshape(b * per, page, hkv, D)
                    sets.append((q, kc, vc, kp, vp, bt))
                q, kc, vc = sets[0][:3]
                res = {}
                check = _Checker(q.transpose(0, 2, 1, 3), kc.transpose(0, 2, 1, 3),
                                 vc.transpose(0, 2, 1, 3), b, hkv)
                o = cp.empty((b, 1, H, D), dtype=cp.float16)
                versions = [("", None)] + [(f"-v{v}", v) for v in (1, 2, 3, 4, 5, 6, 7, 8)
                                           if f"cuflash-v{v}" in args.impls]
                for (name, paged), (suffix, version) in ((x, y) for y in versions for x in (
                        ("contiguous", False), ("paged16", True))):
                    def fn(i, paged=paged):
                        q_, kc_, vc_, kp_, vp_, bt_ = sets[i]
                        if paged:
                            return cuflash.attention_with_kvcache(q_, kp_, vp_, lens,
                                                                  block_table=bt_, out=o)
                        return cuflash.attention_with_kvcache(q_, kc_, vc_, lens, out=o)
                    with _DecodeVersion(version):
                        o.fill(np.nan)
                        fn(0)
                        why = check(o.transpose(0, 2, 1, 3))
                        res[name + suffix] = why or kv_bytes / _events(
                            fn, args.warmup, args.repeats, n) / 1e9
                rows.append(("kvcache", b, sk, hkv, res, ""))
                _print_row(rows[-1])
                sets = q = kc = vc = o = None
                cp.get_default_memory_pool().free_all_blocks()


VARLEN_IMPLS = ("auto", "decode", "tensorcore", "hopper", "hopper-g2", "hopper-g4",
                "torch-flash-varlen")


def _varlen_impl(impl):
    """(attention_varlen kernel, _varlen.VARLEN_HOPPER_GROUP) of a --varlen-impl name:
    "hopper-gN" is the Hopper twin with blocks walking N slots of their sequence (persistent
    within a sequence), every other name the kernel of that name with one slot a block."""
    if impl.startswith("hopper-g"):
        return "hopper", int(impl[len("hopper-g"):])
    return impl, 1


def _torch_flash_varlen():
    """FlashAttention-2's varlen forward as torch ships it (aten::_flash_attention_forward with
    cumulative sequence lengths), or None where this torch has none."""
    try:
        import torch

        op = torch.ops.aten._flash_attention_forward
    except Exception:
        return None

    def run(tq, tk, tv, cu, max_len):
        return op(tq, tk, tv, cu, cu, max_len, max_len, 0.0, True, False)[0]
    return run


def bench_varlen(args, rows):
    """Varlen prefill: random lengths 1..8k up to 64k tokens (8k with --quick), causal, H = 32,
    Hkv = 8, D = 128, float16: cuflash.attention_varlen through each of its kernels
    (--varlen-impl: "auto", whatever kernel="auto" picks; "decode", the decode family with
    per-sequence offsets; "tensorcore" and "hopper", the dense mma.sync and Hopper forwards'
    varlen twins; "hopper-gN", the Hopper twin with N slots a block, _varlen.VARLEN_HOPPER_GROUP) and
    FlashAttention-2's varlen forward inside torch where it has one, against cuflash.attention
    on dense (B, H, 8192, D) batches of the same token count, in TFLOP/s of the causal work.
    Each result is checked first (query head 0 of the first and the shortest sequence)."""
    import cupy as cp

    rng = np.random.default_rng(1)
    total = 8192 if args.quick else 65536
    lens = []
    while sum(lens) < total:
        lens.append(int(rng.integers(1, 8193)))
    lens[-1] -= sum(lens) - total
    lens = [x for x in lens if x > 0]
    cu = cp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
    hkv = 8
    q = cp.random.standard_normal((total, H, D), dtype=cp.float32).astype(cp.float16)
    k = cp.random.standard_normal((total, hkv, D), dtype=cp.float32).astype(cp.float16)
    v = cp.random.standard_normal((total, hkv, D), dtype=cp.float32).astype(cp.float16)
    flops = sum(2.0 * 2 * L * (L + 1) / 2 * D * H for L in lens)
    s0 = int(np.argmin(lens))  # check the shortest and the first sequences

    rules = {}   # the float64 rule of each checked sequence, made once for every implementation

    def check(o):
        for s in sorted({s0, 0}):
            # query head 0 and its kv head 0 (groups of H / Hkv): the float64 reference and the
            # naive counterpart of all 32 heads of an up-to-8k sequence take minutes on the host
            a, b = int(cu[s]), int(cu[s + 1])
            if s not in rules:
                qs, ks, vs = (_host(x[a:b, :1]).transpose(1, 0, 2) for x in (q, k, v))
                rules[s] = reference.pass_threshold(qs, ks, vs, causal=True, dtype="float16")
            verdict = rules[s].judge(_host(o[a:b, :1]).transpose(1, 0, 2))
            if not verdict.passed:
                return "FAILED " + "; ".join(verdict.reasons)
        return None

    res = {}
    labels = []
    impls = [x for x in args.varlen_impl.split(",") if x]
    from cuflash import _varlen

    group0 = _varlen.VARLEN_HOPPER_GROUP
    for impl in impls:
        name = "cuflash-varlen" + ("" if impl == "auto" else "-" + impl)
        impl, _varlen.VARLEN_HOPPER_GROUP = _varlen_impl(impl)
        if impl == "torch-flash-varlen":
            run = _torch_flash_varlen()
            if run is None:
                res[impl] = "n/a (no aten::_flash_attention_forward)"
                continue
            import torch

            tq, tk, tv, tcu = (torch.from_dlpack(x) for x in (q, k, v, cu))
            fn = lambda: run(tq, tk, tv, tcu, max(lens))  # noqa: E731
            name = impl
            try:
                o = cp.from_dlpack(fn())
            except Exception as exc:  # this torch's build refuses the call
                res[name] = f"n/a ({type(exc).__name__}: {str(exc)[:60]})"
                continue
        else:
            fn = lambda impl=impl: cuflash.attention_varlen(  # noqa: E731
                q, k, v, cu, cu, max(lens), max(lens), causal=True, kernel=impl)
            try:
                labels.append(f"{impl}: " + cuflash.varlen_dispatch_info(
                    q, k, v, cu, cu, max(lens), max(lens), causal=True, kernel=impl))
            except ValueError as exc:  # e.g. kernel="hopper" off sm_90
                res[name] = f"n/a ({str(exc)[:60]})"
                continue
            o = fn()
        why = check(o)
        res[name] = why or flops / _events(fn, args.warmup, args.repeats) / 1e12
        o = None
    _varlen.VARLEN_HOPPER_GROUP = group0
    bd = total // 8192
    qd = q.reshape(bd, 8192, H, D).transpose(0, 2, 1, 3)
    kd = k.reshape(bd, 8192, hkv, D).transpose(0, 2, 1, 3)
    vd = v.reshape(bd, 8192, hkv, D).transpose(0, 2, 1, 3)
    labels.append("dense: " + cuflash.dispatch_info(qd, kd, vd, causal=True))
    od = cuflash.attention(qd, kd, vd, causal=True)
    why = _first_head_check(od, qd, kd, vd)
    if why:
        res["cuflash-dense-8k"] = "FAILED " + why
    else:
        t = _events(lambda: cuflash.attention(qd, kd, vd, causal=True), args.warmup,
                    args.repeats)
        res["cuflash-dense-8k"] = bd * 2.0 * 2 * 8192 * 8193 / 2 * D * H / t / 1e12
    # the dense kernel family the varlen twin runs (mma.sync), same batch, for the 0.9x target
    # of the family it belongs to
    if "tensorcore" in impls:
        od = cuflash.attention(qd, kd, vd, causal=True, kernel="tensorcore")
        why = _first_head_check(od, qd, kd, vd)
        res["cuflash-dense-8k-tensorcore"] = ("FAILED " + why) if why else (
            bd * 2.0 * 2 * 8192 * 8193 / 2 * D * H / _events(
                lambda: cuflash.attention(qd, kd, vd, causal=True, kernel="tensorcore"),
                args.warmup, args.repeats) / 1e12)
    rows.append(("varlen", len(lens), total, hkv, res, "; ".join(labels)))
    _print_row(rows[-1])


#: The query rows `_first_head_check` judges at long sequences: [start, stop) blocks of 256
#: (negative: from the end). A block [i0, i1) of a causal problem with Sq = Sk is judged as the
#: problem q[i0:i1], k[:i1], v[:i1]: under the bottom-right causal alignment its row r sees keys
#: j <= r + i1 - (i1 - i0) = i0 + r, exactly what row i0 + r of the whole problem sees.
CHECK_ROW_BLOCKS = ((0, 256), (-1280, -1024), (-256, None))


def _first_head_check(o, q, k, v, dtype="float16", rows=None):
    """Judge query head 0 of batch entry 0 of a causal (B, H, S, D) result with Sq = Sk (its kv
    head is 0) against the float64 reference with the pass rule: None if it passes, else the
    reasons. `rows`: None judges every row; else (start, stop) blocks of rows, each judged as
    the causal problem of its rows and the keys up to its last row (CHECK_ROW_BLOCKS), which
    keeps the float64 reference of an 8k head to seconds on two cores."""
    s = q.shape[2]
    blocks = [(0, s)] if rows is None else [slice(a, b).indices(s)[:2] for a, b in rows]
    for i0, i1 in blocks:
        if i1 <= i0:
            continue
        rule = reference.pass_threshold(_host(q[0, :1, i0:i1]), _host(k[0, :1, :i1]),
                                        _host(v[0, :1, :i1]), causal=True, dtype=dtype)
        verdict = rule.judge(_host(o[0, :1, i0:i1]))
        if not verdict.passed:
            return f"rows {i0}:{i1}: " + "; ".join(verdict.reasons)
    return None


def bench_gqa(args, rows):
    """GQA prefill (issue 14): B = 1, H = 32, Hkv = 8, S = 8k (2k with --quick), D = 128, causal,
    bfloat16: cuflash.attention with the kv heads shared by groups of 4 query heads, against
    torch SDPA's cuDNN and FLASH backends (enable_gqa) on the same tensors, in TFLOP/s."""
    import cupy as cp
    import torch

    s, hkv = (2048 if args.quick else 8192), 8
    tq = torch.randn(1, H, s, D, device="cuda", dtype=torch.bfloat16)
    tk = torch.randn(1, hkv, s, D, device="cuda", dtype=torch.bfloat16)
    tv = torch.randn(1, hkv, s, D, device="cuda", dtype=torch.bfloat16)
    q, k, v = (cp.from_dlpack(x) for x in (tq, tk, tv))
    flops = 2.0 * 2 * s * (s + 1) / 2 * D * H
    res = {}
    fn = lambda: cuflash.attention(q, k, v, causal=True)  # noqa: E731
    check_rows = None if args.quick else CHECK_ROW_BLOCKS
    why = _first_head_check(fn(), q, k, v, "bfloat16", check_rows)
    res["cuflash"] = ("FAILED " + why) if why else \
        flops / _events(fn, args.warmup, args.repeats) / 1e12
    for name, run in _torch_impls().items():
        try:
            why = _first_head_check(cp.from_dlpack(run(tq, tk, tv, causal=True)), q, k, v,
                                    "bfloat16", check_rows)
            res[name] = ("FAILED " + why) if why else flops / _events(
                lambda: run(tq, tk, tv, causal=True), args.warmup, args.repeats) / 1e12
        except Exception as exc:  # backend refuses the shape
            res[name] = f"n/a ({type(exc).__name__})"
    rows.append(("gqa", 1, s, hkv, res, cuflash.dispatch_info(q, k, v, causal=True)))
    _print_row(rows[-1])


def _print_row(row):
    kind, b, sk, hkv, res, label = row
    cells = "  ".join(f"{k}={v:7.0f}" if isinstance(v, float) else f"{k}={v}"
                      for k, v in res.items())
    unit = "TFLOP/s" if kind in ("varlen", "gqa") else "GB/s"
    print(f"{kind:8s} B={b:<3d} Sk={sk:<7d} Hkv={hkv:<3d} {unit}: {cells}  {label}", flush=True)


def _markdown(rows):
    out = []
    for kind in ("decode", "kvcache", "varlen", "gqa"):
        sel = [r for r in rows if r[0] == kind]
        if not sel:
            continue
        impls = list(sel[0][4])
        if kind == "gqa":
            out.append(f"\nGQA prefill (causal, B = 1, H = {H}, D = {D}, bfloat16), TFLOP/s; "
                       "Sk = S\n")
        elif kind == "varlen":
            out.append(f"\nvarlen prefill (causal, H = {H}, D = {D}, float16), TFLOP/s; B = "
                       "sequences, Sk = total tokens\n")
        else:
            out.append(f"\n{kind} (H = {H}, D = {D}, float16, Sq = 1), GB/s of K + V\n")
        out.append("| B | Sk | Hkv | " + " | ".join(impls) + " |")
        out.append("|" + " --- |" * (3 + len(impls)))
        for _, b, sk, hkv, res, _ in sel:
            cells = [f"{res[i]:.0f}" if isinstance(res[i], float) else str(res[i])
                     for i in impls]
            out.append(f"| {b} | {sk} | {hkv} | " + " | ".join(cells) + " |")
        if kind == "decode" and "torch-cudnn" in impls:
            ratios = [r[4]["cuflash"] / r[4]["torch-cudnn"] for r in sel
                      if isinstance(r[4].get("cuflash"), float)
                      and isinstance(r[4].get("torch-cudnn"), float)]
            if ratios:
                gm = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
                out.append(f"\ncuflash / cuDNN: geometric mean {gm:.2f}x, min {min(ratios):.2f}x "
                           f"over {len(ratios)} points")
        for other in ("cuflash-v1", "cuflash-v2", "cuflash-v3", "cuflash-v4", "cuflash-v5",
                      "cuflash-v6", "cuflash-v7", "cuflash-v8", *CUFLASH_RULE_IMPLS):
            if kind != "decode" or other not in impls:
                continue
            for ref in ("torch-cudnn", "cuflash"):
                ratios = [r[4][other] / r[4][ref] for r in sel
                          if isinstance(r[4].get(other), float)
                          and isinstance(r[4].get(ref), float)]
                if ratios:
                    gm = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
                    out.append(f"\n{other} / {ref}: geometric mean {gm:.2f}x, min "
                               f"{min(ratios):.2f}x, max {max(ratios):.2f}x over {len(ratios)} "
                               "points")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few points (< 60 s)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--only", default="decode,kvcache,varlen,gqa",
                    help="comma-separated parts: decode,kvcache,varlen,gqa")
    ap.add_argument("--markdown", default=None, help="write the tables to this file")
    ap.add_argument("--varlen-impl", default=",".join(VARLEN_IMPLS),
                    help="comma-separated implementations of the varlen part: "
                         + ", ".join(VARLEN_IMPLS))
    ap.add_argument("--force-splits", default="",
                    help="comma-separated split counts: adds decode impls cuflash-sN (the "
                         "default version with its split count forced to N, capped at one "
                         "split per key tile), to measure the split rule's choice; and "
                         "cuflash-vN-sN for each cuflash-vN in --impl")
    ap.add_argument("--impl", default="cuflash,torch-cudnn,torch-flash",
                    help="comma-separated decode implementations: cuflash, cuflash-v1 / cuflash-v2 / "
                         "-v3 ... -v8 (the decode kernels' versions 1, 3, 4: sm_90, 5, 6, 7, 8), "
                         "cuflash-rule3 / -rule4 (split rules 3, 4), "
                         "cuflash-v6-rule4 / -v8-rule4, "
                         "torch-cudnn, torch-flash")
    for axis in ("b", "sk", "hkv"):
        ap.add_argument(f"--{axis}", default=None,
                        help=f"comma-separated {axis} values of the decode/kvcache grid "
                             "(default: the issue's, or --quick's)")
    args = ap.parse_args(argv)
    if not cuflash.gpu_available():
        print("no GPU: nothing to benchmark", file=sys.stderr)
        return 1
    args.repeats = args.repeats or (5 if args.quick else 20)
    args.impls = tuple(args.impl.split(","))
    args.force_splits = tuple(int(x) for x in args.force_splits.split(",") if x)
    unknown = (set(args.impls) - set(CUFLASH_IMPLS) - set(CUFLASH_RULE_IMPLS)
               - {"torch-cudnn", "torch-flash"})
    if unknown:
        ap.error(f"unknown --impl {sorted(unknown)}")
    grid = dict(QUICK if args.quick else FULL)
    for axis in ("b", "sk", "hkv"):
        if getattr(args, axis):
            grid[axis] = tuple(int(x) for x in getattr(args, axis).split(","))
    rows = []
    t0 = time.time()
    parts = args.only.split(",")
    if "decode" in parts:
        bench_decode(grid, args, rows)
    if "kvcache" in parts:
        bench_paged(grid, args, rows)
    if "varlen" in parts:
        bench_varlen(args, rows)
    if "gqa" in parts:
        bench_gqa(args, rows)
    md = _markdown(rows)
    print(md)
    print(f"\n{time.time() - t0:.0f} s", file=sys.stderr)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(md + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
