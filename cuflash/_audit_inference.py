"""cuflash-check's audits of the inference entry points (issue 14): grouped-query heads through
`attention` (every kernel the device offers, decode-shaped and prefill-shaped), and
`attention_with_kvcache` (a paged cache: appends to an empty cache, to a one-key one and
across a page) and `attention_varlen` (ragged lengths), each sequence judged by the
per-case rule of `_audit` against the float64 reference; and `attention_varlen_backward` on the
varlen forward's (o, lse), each sequence's dq, dk, dv judged by the gradient rule
(`reference.grad_pass_threshold`)."""
from __future__ import annotations

import math
from typing import List

import numpy as np

from cuflash import (attention, attention_varlen, attention_varlen_backward,
                     attention_with_kvcache, reference, varlen_dispatch_info)


def _sequence_verdict(dtype, o, lse, q, k, v, causal, spec="auto"):
    """(err, threshold, passed, why) of one sequence in (H, S, D) layout; lse (H, Sq). ``spec``:
    the audited call (`_audit`'s kernel spec); float32's one-pass TF32 mode (".../high") is judged
    by its own rule, as in the main grid."""
    from ._audit import CaseResult, _lse_extra, case_rule, score_output, spec_precision

    o_ref, lse_ref = reference.attention_ref(q, k, v, causal=causal)
    res = CaseResult(dtype=dtype, kernel_arg="auto", kernel="", shape="", causal=causal)
    score_output(res, o, lse, lse_ref,
                 case_rule(q, k, v, causal, None, dtype, o_ref, spec_precision(spec)),
                 lse_extra=_lse_extra(spec, q, k, None))
    return res.max_abs_err, res.threshold, res.passed, "; ".join(res.reasons)


def _worst(verdicts):
    """Fold per-sequence verdicts: the largest error (and its threshold), all must pass."""
    err, thr, ok, why = 0.0, math.nan, True, []
    for e, t, p, w in verdicts:
        if not e <= err:
            err, thr = e, t
        ok = ok and p
        if w:
            why.append(w)
    return err, thr, ok, "; ".join(why)


def _gqa(device, dtypes, rng):
    from ._audit import PropertyResult, _describe_exc, _device_kernels, call_kwargs, numpy_dtype
    from ._audit import short_kernel

    out = []
    for sq, sk, causal in ((1, 1000, False), (37, 300, True)):
        q0 = 2.0 * rng.standard_normal((2, 8, sq, 64))
        k0, v0 = (rng.standard_normal((2, 2, sk, 64)) for _ in range(2))
        for dtype in dtypes:
            q, k, v = (reference.round_to(x, dtype) for x in (q0, k0, v0))
            npdt = numpy_dtype(dtype)
            for kernel_arg, kname in _device_kernels(device, dtype, q, k, v):
                where = f"{device.name}, {dtype}, {short_kernel(kname)}, Sq={sq}"
                try:
                    o, lse = attention(*(device.to_device(x.astype(npdt)) for x in (q, k, v)),
                                       causal=causal, return_lse=True, **call_kwargs(kernel_arg))
                    o, lse = device.to_host(o), device.to_host(lse)
                except Exception as exc:
                    out.append(PropertyResult("grouped-query heads (8 over 2)", where, math.nan,
                                              math.nan, False, f"raised {_describe_exc(exc)}"))
                    continue
                err, thr, ok, why = _sequence_verdict(dtype, o, lse, q, k, v, causal, kernel_arg)
                out.append(PropertyResult("grouped-query heads (8 over 2)", where, err, thr, ok,
                                          why or "query head h uses kv head h // 4"))
    return out


def _kvcache(device, dtypes, rng):
    from ._audit import PropertyResult, _describe_exc, numpy_dtype

    out = []
    b, sq, h, hkv, d, page, snew = 3, 2, 8, 2, 64, 16, 3
    lens = np.array([0, 1, 14], np.int32)      # an empty cache, one key, 14 + 3 crosses a page
    n_pages = 6
    bt = rng.permutation(n_pages)[:b * 2].reshape(b, 2).astype(np.int32)
    for dtype in dtypes:
        kc, vc = (reference.round_to(rng.standard_normal((n_pages, page, hkv, d)), dtype)
                  for _ in range(2))
        kn, vn = (reference.round_to(rng.standard_normal((b, snew, hkv, d)), dtype)
                  for _ in range(2))
        q = reference.round_to(2.0 * rng.standard_normal((b, sq, h, d)), dtype)
        npdt = numpy_dtype(dtype)
        where = f"{device.name}, {dtype}, page {page}"
        try:
            o, lse = attention_with_kvcache(
                *(device.to_device(x.astype(npdt)) for x in (q, kc, vc)), device.to_device(lens),
                block_table=device.to_device(bt), k_new=device.to_device(kn.astype(npdt)),
                v_new=device.to_device(vn.astype(npdt)), causal=True, return_lse=True)
            o, lse = device.to_host(o).astype(np.float64), device.to_host(lse)
        except Exception as exc:
            out.append(PropertyResult("KV cache (paged, append)", where, math.nan, math.nan,
                                      False, f"raised {_describe_exc(exc)}"))
            continue
        verdicts = []
        for i in range(b):
            k_i, v_i = reference.gather_kv_cache(kc, vc, int(lens[i]), i, bt)
            k_i, v_i = np.concatenate([k_i, kn[i]]), np.concatenate([v_i, vn[i]])
            verdicts.append(_sequence_verdict(dtype, o[i].transpose(1, 0, 2), lse[i],
                                              q[i].transpose(1, 0, 2), k_i.transpose(1, 0, 2),
                                              v_i.transpose(1, 0, 2), True))
        err, thr, ok, why = _worst(verdicts)
        out.append(PropertyResult("KV cache (paged, append)", where, err, thr, ok,
                                  why or "cached 0, 1, 14 keys + 3 new ones, causal"))
    return out


def _varlen(device, dtypes, rng):
    from ._audit import PropertyResult, _describe_exc, numpy_dtype

    out = []
    lens_q, lens_k = np.array([1, 37, 5]), np.array([1, 300, 0])
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    # On a GPU also the dense kernels' varlen twins by name (the Hopper one where it runs).
    kernels = ("auto",) if device.name == "cpu" else ("auto", "tensorcore", "hopper")
    for dtype, kernel in ((dt, kn) for dt in dtypes for kn in kernels):
        q = reference.round_to(2.0 * rng.standard_normal((int(cu_q[-1]), 8, 64)), dtype)
        k, v = (reference.round_to(rng.standard_normal((int(cu_k[-1]), 2, 64)), dtype)
                for _ in range(2))
        npdt = numpy_dtype(dtype)
        where = f"{device.name}, {dtype}" + ("" if kernel == "auto" else f", kernel={kernel}")
        args = [device.to_device(x.astype(npdt)) for x in (q, k, v)] + [
            device.to_device(cu_q), device.to_device(cu_k), int(lens_q.max()), int(lens_k.max())]
        if kernel == "hopper":
            try:
                varlen_dispatch_info(*args, causal=True, kernel=kernel)
            except ValueError as exc:
                if "compute capability 9.0 only" in str(exc):
                    continue   # not this GPU's kernel
        try:
            o, lse = attention_varlen(*args, causal=True, return_lse=True, kernel=kernel)
            o, lse = device.to_host(o).astype(np.float64), device.to_host(lse)
        except Exception as exc:
            out.append(PropertyResult("varlen (packed sequences)", where, math.nan, math.nan,
                                      False, f"raised {_describe_exc(exc)}"))
            continue
        verdicts = []
        for s in range(lens_q.size):
            a, b_, c, e = cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]
            if e == c:
                empty = bool(np.all(o[a:b_] == 0) and np.all(np.isneginf(lse[:, a:b_])))
                verdicts.append((0.0, 0.0, empty, "" if empty else "a keyless sequence"))
                continue
            verdicts.append(_sequence_verdict(
                dtype, o[a:b_].transpose(1, 0, 2), lse[:, a:b_], q[a:b_].transpose(1, 0, 2),
                k[c:e].transpose(1, 0, 2), v[c:e].transpose(1, 0, 2), True))
        err, thr, ok, why = _worst(verdicts)
        out.append(PropertyResult("varlen (packed sequences)", where, err, thr, ok,
                                  why or "lengths (1, 1), (37, 300), (5, 0), causal"))
        if kernel == "auto":
            out.append(_varlen_backward(device, dtype, rng, (q, k, v), (o, lse), cu_q, cu_k,
                                        (int(lens_q.max()), int(lens_k.max())), where))
    return out


def _varlen_backward(device, dtype, rng, qkv, o_lse, cu_q, cu_k, maxlens, where):
    """One PropertyResult: attention_varlen_backward on the forward's (o, lse) (round trip), each
    sequence's dq, dk, dv against attention_backward_ref under grad_pass_threshold; the reported
    error and threshold are those of the worst ratio."""
    from ._audit import PropertyResult, _describe_exc, numpy_dtype

    name = "varlen backward (packed sequences)"
    npdt = numpy_dtype(dtype)
    q, k, v = qkv
    o, lse = o_lse
    do = reference.round_to(rng.standard_normal(o.shape), dtype)
    try:
        grads = attention_varlen_backward(
            *(device.to_device(x.astype(npdt)) for x in (do, q, k, v, o)),
            device.to_device(lse), device.to_device(cu_q), device.to_device(cu_k), *maxlens,
            causal=True)
        grads = [device.to_host(g).astype(np.float64) for g in grads]
    except Exception as exc:
        return PropertyResult(name, where, math.nan, math.nan, False,
                              f"raised {_describe_exc(exc)}")
    verdicts = []
    for s in range(cu_q.size - 1):
        a, b_, c, e = (int(x) for x in (cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]))
        if a == b_ or c == e:
            zero = all(bool(np.all(g[lo:hi] == 0)) for g, lo, hi in
                       zip(grads, (a, c, c), (b_, e, e)))
            verdicts.append((0.0, 0.0, zero, "" if zero else f"sequence {s} not 0"))
            continue
        seg = [x.transpose(1, 0, 2) for x in (do[a:b_], q[a:b_], k[c:e], v[c:e])]
        ref = reference.attention_backward_ref(*seg, causal=True)
        tols, _ = reference.grad_pass_threshold(*seg, causal=True, dtype=dtype, ref=ref)
        for gname, g, r, tol, lo, hi in zip(("dq", "dk", "dv"), grads, ref, tols, (a, c, c),
                                            (b_, e, e)):
            err = float(np.max(np.abs(g[lo:hi].transpose(1, 0, 2) - r)))
            ok = err <= tol  # NaN fails
            verdicts.append((err, tol, ok, "" if ok else f"sequence {s} {gname}"))
    worst = max(verdicts, key=lambda x: x[0] / x[1] if x[1] > 0 else 0.0)
    ok = all(x[2] for x in verdicts)
    why = "; ".join(x[3] for x in verdicts if x[3])
    return PropertyResult(name, where, worst[0], worst[1], ok,
                          why or "round trip of the varlen forward, causal")


def inference_audits(device, dtypes, rng) -> List:
    """PropertyResults of the grouped-query, KV-cache and varlen audits on `device`. On a GPU
    the KV-cache and varlen entry points take float16 and bfloat16 only (other dtypes are left
    out, not failed)."""
    out = _gqa(device, dtypes, rng)
    cache_dtypes = [dt for dt in dtypes if device.name == "cpu" or dt in ("float16", "bfloat16")]
    out += _kvcache(device, cache_dtypes, rng)
    out += _varlen(device, cache_dtypes, rng)
    return out
