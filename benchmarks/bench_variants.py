#!/usr/bin/env python
"""Forward and backward speed of the attention variants: cuflash with softcap, ALiBi, a sliding
window, a bias tensor and a boolean mask, against plain cuflash on the same inputs, torch SDPA
with the same ``attn_mask`` (bias, mask and the window and ALiBi as a float mask) and torch's
FlexAttention (compiled; score_mod / block mask) where torch has it, issue 15's targets.

    PYTHONPATH=. python benchmarks/bench_variants.py                  # S = 4096, 16384
    PYTHONPATH=. python benchmarks/bench_variants.py --s 2048 --quick --json /tmp/v.json
    PYTHONPATH=. python benchmarks/bench_variants.py --kernels hopper --backward 0 --flex 0

--kernels: the cuflash forward kernels timed per variant (default "auto,hopper": the
dispatcher's choice, and the Hopper forward with the variant's policy by name, attn_wgmma.cu:
cuflash_fwd_wgmma_var; one that cannot run the inputs is reported, not timed). Each row's "per
tile" is against plain cuflash under the same kernel= (plain's row of that kernel; plain runs
first, keep it in --variants), so every row of every kernel has one. The backward (and torch's,
FlexAttention's) runs once per variant and --impl form, on the first kernel's row: it does not
depend on the forward's kernel. --variants: plain, softcap, alibi, window, bias, mask and
"positional" (window, softcap and ALiBi together: under VARIANT_FUSED_SCALE the forwards take the
fused form and, at D = 128, the mma.sync backward the unfused one, _dispatch_variants.fused_form;
its backward label says which), and the user hooks of issue 15's FlexAttention target (HOOKS):
"mod-alibi" (ALiBi as a score_mod, its slopes in mod_args), "mod-document" (a document mask as a
mask_mod, `doc_ids`), "mod-window" (the sliding window of --window as a mask_mod), each with the
same expression as FlexAttention's score_mod / mask_mod and no SDPA peer. Their checked rows are
the first ones, not the last (`_checked_rows`: a hook sees the rows' own q_idx).

--impl: forms of the variant kernels to time against each other in the same run (default
"base"): "base" = the dispatcher's flags as they are, "fma-rcp" = softcap's reciprocal on the FMA
pipe (_dispatch_variants.SOFTCAP_RCP_FMA), "fused" = the scale fused into the transform, raw
scores without one (VARIANT_FUSED_SCALE), "fma-rcp+fused" = both, "affine" = ALiBi in the
softmax's affine units on the Hopper forward (ALIBI_AFFINE; causal), "affine+fused",
"hopperbwd" = the variants' backward on the Hopper backward with the policy
(HOPPER_BWD_VARIANTS, on by default since session n; the row's bwd_label says which backward ran,
and bwd_per_tile is against plain's Hopper backward), "mmabwd" = the same flag off (the mma.sync
backward that sm_90 took before), "noblocks" = the mask without its block summary
(`_mask_blocks.ENABLED` off: every masked tile read per element), "narrowhooks" = the hook
rows' Hopper forward on 32-key tiles (HOPPER_HOOK_WIDE off), "hookblocks" = the mask_mod rows'
forwards narrowed to the key tiles the hook's block summary does not hide (HOOK_BLOCKS; the
summary pass is inside the timed call); a form's rows only for the variants
it changes (IMPLS). Each form's
row is checked like every other.

    PYTHONPATH=. python benchmarks/bench_variants.py --s 16384 --kernels hopper --backward 0 \
        --flex 0 --quick --impl base,fma-rcp,fused,fma-rcp+fused,affine,affine+fused
    PYTHONPATH=. python benchmarks/bench_variants.py --s 16384 --kernels hopper --backward 1 \
        --torch 0 --flex 0 --impl base,fused --variants plain,softcap,alibi,window,positional
    PYTHONPATH=. python benchmarks/bench_variants.py --s 16384 --kernels auto --backward 1 \
        --torch 0 --flex 0 --impl base,hopperbwd --variants plain,softcap,alibi,window

Every result is checked first: cuflash's (and torch's) output on a few (batch, head) slices
against the float64 reference (cuflash.reference.attention_ref with the same variant) under the
project's pass rule (reference.pass_threshold); a failing implementation is not timed. Timing:
--warmup untimed calls, then --repeats calls each between CUDA events; the median is reported.

Backward (--backward 1, the default): cuflash.attention_backward from the forward's o and lse
(without dbias), torch's backward of the same forward through autograd. Checked first: the dq of
the last rows of the same slices against the float64 reference of that sub-problem (a row's dq
depends on that row alone) under reference.grad_pass_threshold, and cuflash's backward run on the
sub-problem itself (its dq, dk, dv: the same plan, keys whole) under the same rule.

Columns: ms; "per tile" compares time per visited unit of work with plain cuflash's,
plain_ms / pairs_plain / (ms / pairs) where pairs counts the (query, key) pairs each computes
by position (a window of w keys: ~S * w; every other variant: all of them), so 1.0 means the
variant costs what plain attention costs per pair it visits (the target: >= 0.9 for softcap,
ALiBi and the window). "vs torch" is torch's time over cuflash's for the same variant (bias and
mask target: >= 1.0 against cuDNN; the backend torch ran is named).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--s", default="4096,16384", help="sequence lengths (Sq = Sk)")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=32768, help="B * S (B at least 1)")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--window", type=int, default=4096, help="left extent of the window")
    ap.add_argument("--causal", type=int, default=1)
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="warmup 1, repeats 3")
    ap.add_argument("--json", default=None)
    ap.add_argument("--variants", default="plain,softcap,alibi,window,bias,mask")
    ap.add_argument("--backward", type=int, default=1, help="also time the backward")
    ap.add_argument("--flex", type=int, default=1, help="torch FlexAttention peers (compiled)")
    ap.add_argument("--torch", type=int, default=1,
                    help="torch SDPA peers (0: cuflash rows only, e.g. comparing --impl forms)")
    ap.add_argument("--kernels", default="auto,hopper",
                    help="cuflash forward kernels to time per variant (kernel= values)")
    ap.add_argument("--impl", default="base",
                    help="forms of the variant kernels to compare: " + ",".join(IMPLS))
    ap.add_argument("--check-rows", type=int, default=256,
                    help="query rows per (batch, head) slice checked against float64")
    args = ap.parse_args(argv)
    if args.quick:
        args.warmup, args.repeats = 1, 3
    return args


#: --impl forms: {name: (flags of cuflash._dispatch_variants to set, variants they change)}.
IMPLS = {"base": ({}, None), "fma-rcp": ({"SOFTCAP_RCP_FMA": True}, {"softcap"}),
         "fused": ({"VARIANT_FUSED_SCALE": True},
                   {"softcap", "alibi", "window", "bias", "mask", "positional"}),
         "fma-rcp+fused": ({"SOFTCAP_RCP_FMA": True, "VARIANT_FUSED_SCALE": True},
                           {"softcap", "positional"}),
         "affine": ({"ALIBI_AFFINE": True}, {"alibi"}),
         "affine+fused": ({"ALIBI_AFFINE": True, "VARIANT_FUSED_SCALE": True}, {"alibi"}),
         # the backward on the Hopper kernel with the policy (attn_bwd_wgmma.cu:
         # cuflash_bwd_wgmma_var) where hopper_bwd_variant_reason takes the variant; its
         # forward is base's
         "hopperbwd": ({"HOPPER_BWD_VARIANTS": True},
                       {"softcap", "alibi", "window", "bias", "mask", "positional"}),
         # the same backward on the mma.sync kernel (the flag off, as before session n)
         "mmabwd": ({"HOPPER_BWD_VARIANTS": False},
                    {"softcap", "alibi", "window", "bias", "mask", "positional"}),
         # no block summary of the mask (cuflash._mask_blocks.ENABLED off): every masked tile
         # read per element, as before session q
         "noblocks": ({"_mask_blocks.ENABLED": False}, {"mask"}),
         # the hook policies' Hopper forward on the 32-key tiles of before session r
         # (_dispatch_variants.HOPPER_HOOK_WIDE off)
         "narrowhooks": ({"HOPPER_HOOK_WIDE": False}, {"mod-alibi", "mod-window", "mod-document"}),
         # the forwards with a mask_mod narrowed to the tiles its summary does not hide
         # (_dispatch_variants.HOOK_BLOCKS, off by default since session s)
         "hookblocks": ({"HOOK_BLOCKS": True}, {"mod-window", "mod-document"})}


def _flag_home(key):
    """(module, attribute) of an --impl flag: `_dispatch_variants` unless ``module.attr``."""
    import importlib
    mod, _, attr = key.rpartition(".")
    return importlib.import_module("cuflash." + (mod or "_dispatch_variants")), attr


class impl_flags:
    """Context: the dispatcher flags of one --impl form set, restored on exit. Re-entrant (the
    timed backward enters it inside the check's `with`): each entry keeps its own saved values,
    so the outermost exit restores what was set before it. (Until 2026-12-03 one saved dict was
    overwritten by the inner entry, and a form's flags leaked into the later rows' "base".)"""

    def __init__(self, name):
        self.flags = IMPLS[name][0]
        self.saved = []

    def __enter__(self):
        self.saved.append({k: getattr(*_flag_home(k)) for k in self.flags})
        for k, v in self.flags.items():
            setattr(*_flag_home(k), v)

    def __exit__(self, *exc):
        for k, v in self.saved.pop().items():
            setattr(*_flag_home(k), v)


def time_ms(fn, warmup, repeats):
    """Median milliseconds of `fn` between CUDA events (bench_inference's timer)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_inference import _events
    return _events(fn, warmup, repeats) * 1e3


def variant_kwargs(name, rng, b, h, s, args):
    import cupy
    if name == "plain":
        return {}
    if name == "softcap":
        return dict(softcap=30.0)
    if name == "alibi":
        return dict(alibi_slopes=cupy.asarray(
            (2.0 ** (-8.0 * np.arange(1, h + 1) / h)).astype(np.float32)))
    if name == "window":
        return dict(window=(args.window, -1))
    if name == "positional":   # window, softcap and ALiBi together (two transforms)
        return dict(window=(args.window, -1), **variant_kwargs("softcap", rng, b, h, s, args),
                    **variant_kwargs("alibi", rng, b, h, s, args))
    if name == "bias":   # one float16 (S, S) bias shared by every batch entry and head
        return dict(bias=cupy.random.standard_normal((1, s, s), dtype=cupy.float32)
                    .astype(cupy.float16))
    if name in HOOKS:   # user hooks (cuflash.mods), the expressions FlexAttention gets too
        return hook_kwargs(name, h, s, args)
    if name == "mask":   # a padding-like mask per batch entry, (B, 1, S, S), built on the device
        # (a host array is B S^2 bytes: 512 MiB at S = 16k, copied over and back per check)
        j = cupy.arange(s)
        last = s - (cupy.arange(b) * 97) % max(1, s // 4) - 1   # keys >= last hidden
        m = cupy.broadcast_to((j[None, :] < last[:, None])[:, None, None, :], (b, 1, s, s))
        m = cupy.ascontiguousarray(m)
        m[..., 0] = True
        return dict(mask=m)
    raise ValueError(name)


#: The user-hook rows (issue 15's FlexAttention target: "ALiBi-as-score_mod, a document mask and
#: a sliding window as mask_mod"): cuflash.mods hooks with the same expressions as flex_mods'.
HOOKS = ("mod-alibi", "mod-document", "mod-window")


def doc_ids(s):
    """Document ids of the S positions (float32, one per position, the mask_mod's args): two
    short documents first (positions 0-99, 100-199: the checked first rows cross a boundary),
    then lengths drawn from 500..4000 with a fixed seed."""
    rng = np.random.default_rng(1234)
    lens = [100, 100]
    while sum(lens) < s:
        lens.append(int(rng.integers(500, 4001)))
    ids = np.repeat(np.arange(len(lens)), lens)[:s]
    return ids.astype(np.float32)


def hook_kwargs(name, h, s, args):
    """cuflash's arguments of a HOOKS row (the hooks and their mod_args on the device)."""
    import cupy

    from cuflash.mods import MaskMod, ScoreMod
    if name == "mod-alibi":   # ALiBi's slopes per head in args (the alibi row's slopes)
        slopes = (2.0 ** (-8.0 * np.arange(1, h + 1) / h)).astype(np.float32)
        mod = ScoreMod.additive("score - args[h] * Acc(llabs(q_idx - kv_idx))",
                                lambda sc, b, hh, qi, kj, a: sc - a[hh] * np.abs(qi - kj))
        return dict(score_mod=mod, mod_args=cupy.asarray(slopes))
    if name == "mod-document":
        mod = MaskMod("args[q_idx] == args[kv_idx]",
                      numpy=lambda b, hh, qi, kj, a: a[qi] == a[kj])
        return dict(mask_mod=mod, mod_args=cupy.asarray(doc_ids(s)))
    if name == "mod-window":
        left = int(args.window)
        mod = MaskMod(f"kv_idx >= q_idx - {left}",
                      numpy=lambda b, hh, qi, kj, a: kj >= qi - left)
        return dict(mask_mod=mod)
    raise ValueError(name)


def visible_pairs(name, s, causal, args):
    full = s * (s + 1) / 2 if causal else float(s) * s
    if name == "mod-document":
        _, lens = np.unique(doc_ids(s), return_counts=True)
        lens = lens.astype(np.float64)
        return float(np.sum(lens * (lens + 1) / 2 if causal else lens * lens))
    if name not in ("window", "positional", "mod-window"):
        return full
    i = np.arange(s, dtype=np.float64)
    lo = np.maximum(0, i - args.window)
    hi = i if causal else np.full(s, s - 1.0)
    return float(np.sum(hi - lo + 1))


def torch_mask(name, kw, b, h, s, causal, dtype, left):
    """The same variant as an SDPA attn_mask (bool or additive float), or None (plain)."""
    import torch
    dev = "cuda"
    if name in ("plain", "softcap", "positional") or name in HOOKS:   # (softcap: no SDPA form;
        return None                                                 # the hooks: Flex's target)
    i = torch.arange(s, device=dev)[:, None]
    j = torch.arange(s, device=dev)[None, :]
    tdt = getattr(torch, dtype)
    if name == "alibi":
        sl = torch.as_tensor(kw["alibi_slopes"], device=dev)
        m = -sl[:, None, None] * (i - j).abs()[None].to(torch.float32)
        if causal:
            m = m.masked_fill(j > i, float("-inf"))
        return m.to(tdt)[None]
    if name == "window":
        keep = j >= i - left
        if causal:
            keep = keep & (j <= i)
        return keep[None, None]
    if name == "bias":
        m = torch.as_tensor(kw["bias"], device=dev).to(tdt)[None]
        if causal:
            m = m.masked_fill(j > i, float("-inf"))
        return m
    if name == "mask":
        keep = torch.as_tensor(kw["mask"], device=dev)
        if causal:
            keep = keep & (j <= i)
        return keep
    raise ValueError(name)


def _shifted_hook(hook, bi, hi):
    """A hook whose NumPy form sees batch entry (b + bi, h + hi): the (bi, hi) slice's reference
    (a (1, 1) batch) then computes what the full problem's hook computes there. Only the
    references run it: its CUDA code still reads the slice's own b and h."""
    from cuflash.mods import MaskMod, ScoreMod
    if isinstance(hook, ScoreMod):
        f, g = hook.numpy, hook.grad_numpy
        return ScoreMod(hook.cuda, lambda sc, b, h, qi, kj, a: f(sc, b + bi, h + hi, qi, kj, a),
                        grad_cuda=hook.grad_cuda, lipschitz=hook.lipschitz,
                        grad_numpy=None if g is None else
                        (lambda sc, b, h, qi, kj, a: g(sc, b + bi, h + hi, qi, kj, a)))
    return MaskMod(hook.cuda, lambda b, h, qi, kj, a: hook.numpy(b + bi, h + hi, qi, kj, a))


def _sub_kwargs(kw, q, bi, hi, r0, shift_hooks=True):
    """The variant's arguments (NumPy) of the (bi, hi) slice's query rows r0.. with the keys kept
    whole: rows i of that Sq' problem are rows i + r0 of the full one under every variant (each
    aligns on i + Sk - Sq); user hooks see the slice's batch entry (`_shifted_hook`) unless
    `shift_hooks` is False (cuflash run on the slice itself)."""
    import cupy
    sub = {}
    for n, x in kw.items():
        if n in ("score_mod", "mask_mod") and x is not None and shift_hooks:
            x = _shifted_hook(x, bi, hi)
        elif isinstance(x, cupy.ndarray) and n == "mod_args":   # indexed by q_idx, kv_idx, h:
            x = cupy.asnumpy(x)                                 # whole (see _checked_rows)
        elif isinstance(x, cupy.ndarray):
            if n == "alibi_slopes":
                x = x[hi:hi + 1]
            else:   # broadcast to (B, H, ...) then take the slice, keeping a (1, 1) batch; on
                # the device, so that only the slice is copied to the host
                full = cupy.broadcast_to(x, (q.shape[0], q.shape[1]) + x.shape[-2:])
                x = full[bi:bi + 1, hi:hi + 1, r0:] if x.shape[-2] > 1 else \
                    full[bi:bi + 1, hi:hi + 1]
            x = cupy.asnumpy(x)
        sub[n] = x
    return sub


def _host64(x):
    import cupy
    return cupy.asnumpy(cupy.asarray(x).astype(cupy.float32)).astype(np.float64)


def _checked_rows(kw, sq, sk, causal, rows):
    """(r0, r1, k1): the checked query rows [r0, r1) and the keys [0, k1) of their sub-problem.
    The built-in variants align on i + Sk - Sq, so the last rows with every key are rows of
    their own Sq' problem. User hooks see the rows' own q_idx (cuflash.mods), so their rows are
    the first ones: with every key, or under causal with keys [0, r1) (the rest is hidden), the
    sub-problem's q_idx and kv_idx are the full problem's."""
    if "score_mod" in kw or "mask_mod" in kw:
        r1 = min(rows, sq)
        return 0, r1, (r1 if causal and sq == sk else sk)
    return max(0, sq - rows), sq, sk


def check(o, q, k, v, causal, kw, dtype, slices, rows=256):
    """o against the float64 reference on a few (batch, head) slices, by the pass rule, on
    `rows` query rows (`_checked_rows`, `_sub_kwargs`)."""
    import cupy
    from cuflash import reference as R
    r0, r1, k1 = _checked_rows(kw, q.shape[-2], k.shape[-2], causal, rows)
    for bi, hi in slices:
        sub = _sub_kwargs(kw, q, bi, hi, r0)
        qs = cupy.asnumpy(q[bi:bi + 1, hi:hi + 1, r0:r1]).astype(np.float64)
        ks, vs = (cupy.asnumpy(t[bi:bi + 1, hi:hi + 1, :k1]).astype(np.float64) for t in (k, v))
        rule = R.pass_threshold(qs, ks, vs, causal=causal, dtype=dtype, **sub)
        got = np.asarray(o[bi:bi + 1, hi:hi + 1, r0:r1].get(), dtype=np.float64)
        verdict = rule.judge(got)
        if not verdict.passed:
            return f"slice ({bi}, {hi}): {verdict.reasons}"
    return None


def check_backward(dq, q, k, v, do, causal, kw, dtype, slices, rows=256, run_sub=True):
    """dq (of the full problem) on the last `rows` query rows of a few (batch, head) slices
    against the float64 reference of that sub-problem, by grad_pass_threshold's dq entry; with
    `run_sub`, also cuflash's forward and backward on the sub-problem itself, every gradient
    (dk and dv of the sub-problem sum over its rows only, so they are checked there)."""
    import cupy

    import cuflash
    from cuflash import reference as R
    r0, r1, k1 = _checked_rows(kw, q.shape[-2], k.shape[-2], causal, rows)
    for bi, hi in slices:
        sub = _sub_kwargs(kw, q, bi, hi, r0)
        qs = q[bi:bi + 1, hi:hi + 1, r0:r1]
        ks, vs = k[bi:bi + 1, hi:hi + 1, :k1], v[bi:bi + 1, hi:hi + 1, :k1]
        dos = do[bi:bi + 1, hi:hi + 1, r0:r1]
        h = [_host64(t) for t in (dos, qs, ks, vs)]
        ref = R.attention_backward_ref(*h, causal=causal, **sub)
        tols, _ = R.grad_pass_threshold(*h, causal=causal, dtype=dtype, ref=ref, **sub)
        got = _host64(dq[bi:bi + 1, hi:hi + 1, r0:r1])
        err = float(np.abs(got - ref[0]).max())
        if not np.isfinite(got).all() or err > tols[0]:
            return f"slice ({bi}, {hi}): dq error {err:.3g} > {tols[0]:.3g}"
        if run_sub:
            own = _sub_kwargs(kw, q, bi, hi, r0, shift_hooks=False)
            if any(n in kw for n in ("score_mod", "mask_mod")):   # the slice's own b, h
                ref = R.attention_backward_ref(*h, causal=causal, **own)
                tols, _ = R.grad_pass_threshold(*h, causal=causal, dtype=dtype, ref=ref, **own)
            dkw = {n: (cupy.asarray(x) if isinstance(x, np.ndarray) else x)
                   for n, x in own.items()}
            qc, kc, vc, doc = (cupy.ascontiguousarray(t) for t in (qs, ks, vs, dos))
            o, lse = cuflash.attention(qc, kc, vc, causal=causal, return_lse=True, **dkw)
            grads = cuflash.attention_backward(doc, qc, kc, vc, o, lse, causal=causal, **dkw)
            for name, g, r, t in zip(("dq", "dk", "dv"), grads, ref, tols):
                e = float(np.abs(_host64(g) - r).max())
                if not np.isfinite(_host64(g)).all() or e > t:
                    return f"slice ({bi}, {hi}) sub-problem: {name} error {e:.3g} > {t:.3g}"
    return None


def flex_mods(name, kw, causal, left):
    """(score_mod, mask_mod) of the variant for torch's FlexAttention (None where it has none)."""
    import torch
    dev = "cuda"
    score_mod = mask_mod = None
    if name == "positional":   # softcap, then ALiBi (cuflash's order), under the window
        cap = float(kw["softcap"])
        sl = torch.as_tensor(kw["alibi_slopes"], device=dev)

        def score_mod(score, b, h, qi, kj):
            return cap * torch.tanh(score / cap) - sl[h] * (qi - kj).abs()
    elif name == "softcap":
        cap = float(kw["softcap"])

        def score_mod(score, b, h, qi, kj):
            return cap * torch.tanh(score / cap)
    elif name == "alibi":
        sl = torch.as_tensor(kw["alibi_slopes"], device=dev)

        def score_mod(score, b, h, qi, kj):
            return score - sl[h] * (qi - kj).abs()
    elif name == "bias":
        bias = torch.as_tensor(kw["bias"], device=dev)

        def score_mod(score, b, h, qi, kj):
            return score + bias[0, qi, kj]
    elif name == "mod-alibi":   # the slopes are the mod's args
        sl = torch.as_tensor(kw["mod_args"], device=dev)

        def score_mod(score, b, h, qi, kj):
            return score - sl[h] * (qi - kj).abs()
    keep = None
    if name in ("window", "positional", "mod-window"):
        def keep(b, h, qi, kj):
            return kj >= qi - left
    elif name == "mod-document":
        doc = torch.as_tensor(kw["mod_args"], device=dev)

        def keep(b, h, qi, kj):
            return doc[qi] == doc[kj]
    elif name == "mask":
        m = torch.as_tensor(kw["mask"], device=dev)

        def keep(b, h, qi, kj):
            return m[b, 0, qi, kj]
    if causal and keep is not None:
        def mask_mod(b, h, qi, kj, keep=keep):
            return keep(b, h, qi, kj) & (kj <= qi)
    elif causal:
        def mask_mod(b, h, qi, kj):
            return kj <= qi
    else:
        mask_mod = keep
    return score_mod, mask_mod


def time_torch_backward(fwd, tq, tk, tv, tdo, warmup, repeats):
    """Milliseconds of torch's backward of one forward (autograd.grad, the graph kept)."""
    import torch
    out = fwd()
    return time_ms(lambda: torch.autograd.grad(out, (tq, tk, tv), tdo, retain_graph=True),
                   warmup, repeats), torch.autograd.grad(out, (tq, tk, tv), tdo,
                                                        retain_graph=True)[0]


def main(argv=None):
    import cupy

    import cuflash

    args = parse_args(argv)
    t_start = time.time()
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except Exception:   # pragma: no cover - optional
        torch = None
    rows = []
    for s in (int(x) for x in args.s.split(",")):
        b, h, d = max(1, args.tokens // s), args.heads, args.d
        rng = np.random.default_rng(s)
        if torch is not None:
            tq, tk, tv, tdo = (torch.randn(b, h, s, d, device="cuda",
                                           dtype=getattr(torch, args.dtype)) for _ in range(4))
            for t in (tq, tk, tv):
                t.requires_grad_(True)
            q, k, v, do = (cupy.from_dlpack(t.detach()) for t in (tq, tk, tv, tdo))
        else:
            dt = cupy.float16 if args.dtype == "float16" else None
            q, k, v, do = (cupy.random.standard_normal((b, h, s, d)).astype(dt)
                           for _ in range(4))
        causal = bool(args.causal)
        slices = [(0, 0), (b - 1, h - 1)]
        plain_ms, plain_bwd_ms = {}, None   # plain's forward ms per kernel= value
        flex = None
        if torch is not None and args.flex:
            try:
                from torch.nn.attention.flex_attention import create_block_mask, flex_attention
                # the backward is timed by replaying one graph (retain_graph=True), which a
                # compiled backward with donated buffers refuses (torch 2.11 did so for the mask
                # row's FlexAttention, whose mask_mod reads a tensor: H200, 2026-12-05)
                import torch._functorch.config as _fconfig
                if hasattr(_fconfig, "donated_buffer"):
                    _fconfig.donated_buffer = False
                flex = torch.compile(flex_attention)
            except Exception:   # pragma: no cover - torch without FlexAttention
                flex = None
        kernels = args.kernels.split(",")
        impls = args.impl.split(",")
        for name, kern, impl in ((n, kn, im) for n in args.variants.split(",")
                                 for kn in kernels for im in impls):
            changes = IMPLS[impl][1]
            if impl != impls[0] and (changes is None or name not in changes):
                continue   # this form does not change this variant's kernels
            first = kern == kernels[0] and impl == impls[0]   # backward, peers: once a variant
            if first:
                kw = variant_kwargs(name, rng, b, h, s, args)
            row = dict(s=s, b=b, h=h, d=d, causal=causal, variant=name, kernel=kern, impl=impl)
            with impl_flags(impl):
                try:
                    row["label"] = cuflash.dispatch_info(q, k, v, causal=causal, kernel=kern,
                                                         **kw)
                except ValueError as exc:   # this kernel cannot run the inputs
                    row["label"] = "-"
                    row["cuflash_error"] = str(exc)[:200]
                run = lambda: cuflash.attention(q, k, v, causal=causal,  # noqa: E731
                                                kernel=kern, **kw)
                bad = row.get("cuflash_error") or check(run(), q, k, v, causal, kw, args.dtype,
                                                        slices, rows=args.check_rows)
                if not bad:
                    row["ms"] = time_ms(run, args.warmup, args.repeats)
            if bad:
                row["cuflash_error"] = bad
            else:
                if name == "plain" and impl == impls[0]:
                    plain_ms[kern] = row["ms"]
                pairs = visible_pairs(name, s, causal, args)
                # per visited pair against plain under the same kernel= (else under auto)
                ref_ms = plain_ms.get(kern, plain_ms.get("auto"))
                if ref_ms is not None:
                    row["per_tile"] = (ref_ms / visible_pairs("plain", s, causal, args)) / (
                        row["ms"] / pairs)
                if args.backward and kern == kernels[0]:   # (each --impl form: its own)
                    flags = impl_flags(impl)
                    with flags:
                        o, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True, **kw)
                        row["bwd_label"] = cuflash.backward_dispatch_info(do, q, k, v, o, lse,
                                                                          causal=causal, **kw)

                    def brun(flags=flags, o=o, lse=lse):
                        with flags:
                            return cuflash.attention_backward(do, q, k, v, o, lse,
                                                              causal=causal, **kw)
                    with flags:
                        bad = check_backward(brun()[0], q, k, v, do, causal, kw, args.dtype,
                                             slices, rows=args.check_rows)
                    if bad:
                        row["cuflash_bwd_error"] = bad
                    else:
                        row["bwd_ms"] = time_ms(brun, args.warmup, args.repeats)
                        if name == "plain" and impl == impls[0]:
                            plain_bwd_ms = row["bwd_ms"]
                        if plain_bwd_ms is not None:
                            row["bwd_per_tile"] = (plain_bwd_ms / visible_pairs(
                                "plain", s, causal, args)) / (row["bwd_ms"] / pairs)
            if (torch is not None and args.torch and name not in ("softcap", "positional")
                    and name not in HOOKS and first):
                tm = torch_mask(name, kw, b, h, s, causal, args.dtype, args.window)
                for backend in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION"):
                    try:
                        with sdpa_kernel(getattr(SDPBackend, backend)):
                            tfn = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa
                                tq, tk, tv, attn_mask=tm, is_causal=causal and tm is None)
                            to = tfn()
                        torch.cuda.synchronize()
                    except Exception:
                        continue
                    bad = check(cupy.from_dlpack(to.detach()), q, k, v, causal, kw, args.dtype, slices)
                    if bad:
                        row[f"torch_{backend}_error"] = bad
                        continue

                    def tfn_ctx(fn=tfn, be=backend):
                        with sdpa_kernel(getattr(SDPBackend, be)):
                            fn()
                    row["torch_backend"] = backend
                    row["torch_ms"] = time_ms(tfn_ctx, args.warmup, args.repeats)
                    if "ms" in row:
                        row["vs_torch"] = row["torch_ms"] / row["ms"]
                    if args.backward:
                        try:
                            def tfwd(be=backend, m=tm):
                                with sdpa_kernel(getattr(SDPBackend, be)):
                                    return torch.nn.functional.scaled_dot_product_attention(
                                        tq, tk, tv, attn_mask=m, is_causal=causal and m is None)
                            with sdpa_kernel(getattr(SDPBackend, backend)):
                                bms, tdq = time_torch_backward(tfwd, tq, tk, tv, tdo,
                                                               args.warmup, args.repeats)
                            bad = check_backward(cupy.from_dlpack(tdq), q, k, v, do, causal, kw,
                                                 args.dtype, slices, run_sub=False)
                            if bad:
                                row["torch_bwd_error"] = bad
                            else:
                                row["torch_bwd_ms"] = bms
                                if "bwd_ms" in row:
                                    row["bwd_vs_torch"] = bms / row["bwd_ms"]
                        except Exception as exc:   # this backend has no backward for it
                            row["torch_bwd_error"] = f"{type(exc).__name__}: {exc}"[:200]
                    break
            if flex is not None and first:
                try:
                    score_mod, mask_mod = flex_mods(name, kw, causal, args.window)
                    bm = (create_block_mask(mask_mod, b if name == "mask" else None, None, s, s,
                                            device="cuda") if mask_mod is not None else None)
                    ffwd = lambda: flex(tq, tk, tv, score_mod=score_mod,  # noqa: E731
                                        block_mask=bm)
                    fo = ffwd()
                    bad = check(cupy.from_dlpack(fo.detach()), q, k, v, causal, kw, args.dtype,
                                slices)
                    if bad:
                        row["flex_error"] = bad
                    else:
                        row["flex_ms"] = time_ms(lambda: ffwd(), args.warmup, args.repeats)
                        if "ms" in row:
                            row["vs_flex"] = row["flex_ms"] / row["ms"]
                        if args.backward:
                            bms, fdq = time_torch_backward(ffwd, tq, tk, tv, tdo, args.warmup,
                                                           args.repeats)
                            bad = check_backward(cupy.from_dlpack(fdq), q, k, v, do, causal,
                                                 kw, args.dtype, slices, run_sub=False)
                            if bad:
                                row["flex_bwd_error"] = bad
                            else:
                                row["flex_bwd_ms"] = bms
                                if "bwd_ms" in row:
                                    row["bwd_vs_flex"] = bms / row["bwd_ms"]
                except Exception as exc:   # pragma: no cover - FlexAttention refused it
                    row["flex_error"] = f"{type(exc).__name__}: {exc}"[:200]
            rows.append(row)
            row["elapsed_s"] = round(time.time() - t_start, 1)
            print(f"[{row['elapsed_s']:7.1f} s] S={s} {name:8s} {kern:7s} {impl:8s} "
                  f"{row.get('ms', float('nan')):8.3f} ms  per tile "
                  f"{row.get('per_tile', float('nan')):5.2f}  torch "
                  f"{row.get('torch_backend', '-')} {row.get('torch_ms', float('nan')):8.3f} ms"
                  f"  vs torch {row.get('vs_torch', float('nan')):5.2f}  flex "
                  f"{row.get('flex_ms', float('nan')):8.3f} ms  [{row['label']}]"
                  f"\n       backward {row.get('bwd_ms', float('nan')):8.3f} ms  per tile "
                  f"{row.get('bwd_per_tile', float('nan')):5.2f}  torch "
                  f"{row.get('torch_bwd_ms', float('nan')):8.3f} ms  flex "
                  f"{row.get('flex_bwd_ms', float('nan')):8.3f} ms  [{row.get('bwd_label', '-')}]"
                  + "".join(f"  {k}: {v}" for k, v in row.items() if k.endswith("_error")),
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
