"""cuflash-check's audit of the attention variants (window, softcap, ALiBi, bias, mask; see
cuflash/variants.py) and of the user hooks (score_mod / mask_mod, cuflash/mods.py: a
relative-position bias as score_mod, and a document mask as mask_mod with a tanh cap as score_mod,
a window and ALiBi): each built-in variant alone and all combined, with and without causal,
forward on the audited device in each audited dtype, judged by the project's pass rule
(`reference.pass_threshold` with the same variant arguments), plus the gradients (dbias
included) under `reference.grad_pass_threshold`.

The block mask (`cuflash.block_mask`, cuflash/_mask_blocks.py) gets its own shape, several
64 x 64 blocks on each axis, with a document-and-padding mask whose blocks are of all three
kinds (kept, hidden, mixed): there the tensor-core kernels compute the tiles whose blocks are
all kept without reading the mask, and the audit shows that this changes no result."""
from __future__ import annotations

from typing import List, Sequence

import numpy as np

from . import reference


def variant_cases(rng, batch, sq, sk):
    """(name, keyword arguments as NumPy arrays) of the audited variants."""
    h = batch[-1]
    return [
        ("window(5,0)", dict(window=(5, 0))),
        ("softcap(2)", dict(softcap=2.0)),
        ("alibi", dict(alibi_slopes=rng.uniform(0.02, 0.3, (h,)).astype(np.float32))),
        ("bias", dict(bias=rng.standard_normal((h, sq, sk)).astype(np.float32))),
        ("mask(empty rows)", dict(mask=_mask(rng, batch, sq, sk))),
        ("all combined", dict(window=(9, 2), softcap=1.5,
                              alibi_slopes=rng.uniform(0.02, 0.3, (h,)).astype(np.float32),
                              bias=rng.standard_normal((1, sk)).astype(np.float32),
                              mask=rng.random((sq, sk)) > 0.2)),
    ] + hook_cases(rng, batch, sq, sk)


def hook_cases(rng, batch, sq, sk):
    """(name, keyword arguments) of the audited user hooks (`cuflash.mods.example_hooks`)."""
    from .mods import example_hooks

    ex, h = example_hooks(), batch[-1]
    docs = np.cumsum(rng.random(max(sq, sk)) < 0.1).astype(np.float32)
    return [
        ("score_mod rel_bias", dict(score_mod=ex["rel_bias"],
                                    mod_args=rng.standard_normal(h * 16).astype(np.float32))),
        ("mask_mod document + score_mod tanh_cap + window + alibi",
         dict(mask_mod=ex["document"], score_mod=ex["tanh_cap"], mod_args=docs, window=(9, 2),
              alibi_slopes=rng.uniform(0.02, 0.3, (h,)).astype(np.float32))),
    ]


#: The block-mask case's shape: query and key blocks of cuflash._mask_blocks.BLOCK = 64, with
#: tails on both axes (150 = 2 x 64 + 22, 200 = 3 x 64 + 8).
BLOCK_MASK_SHAPE = (150, 200)


def block_mask_cases(rng, batch, sq, sk):
    """(name, keyword arguments) of the block-mask case: a `cuflash.BlockMask` of a NumPy mask
    (the references read its ``.mask``; the audit makes the device's own `block_mask` of it),
    documents [0, 128) and [128, Sk) (the 64 x 64 blocks inside the first document are kept,
    those across documents hidden) with per-entry padding of the keys from a random length on
    and random holes in the second document (mixed blocks); the loop's causal pass adds causal
    on top."""
    from ._mask_blocks import block_mask

    doc_q = (np.arange(sq) >= 128)[:, None]
    doc_k = (np.arange(sk) >= 128)[None, :]
    m = np.broadcast_to(doc_q == doc_k, batch + (sq, sk)).copy()
    lens = rng.integers(sk - 60, sk + 1, size=batch)        # padding from a key on
    m &= np.arange(sk) < lens[..., None, None]
    holes = rng.random(batch + (sq, sk)) < 0.01            # mixed blocks in the second document
    holes[..., :128, :] = False                            # (the first one's blocks stay kept)
    m &= ~holes
    return [("block_mask(documents+padding)", dict(mask=block_mask(m)))]


def _on_device(device, x):
    """A case's argument on the audited device: arrays moved, a BlockMask summarised again there
    (by the device's own summary, the code the audit is about)."""
    from ._mask_blocks import BlockMask, block_mask

    if isinstance(x, BlockMask):
        return block_mask(device.to_device(np.asarray(x.mask)))
    return device.to_device(x) if isinstance(x, np.ndarray) else x


def _mask(rng, batch, sq, sk):
    m = rng.random(batch + (sq, sk)) > 0.5
    m[..., ::5, :] = False
    return m


def grad_verdict(names, grads, refs, tols):
    """(worst error / threshold, reasons) of gradients against their float64 references.

    Parameters
    ----------
    names : sequence of str
        "dq", "dk", "dv" (and "dbias").
    grads, refs : sequences of ndarray
        The audited gradients (as float64 on the host) and the references, pairwise one shape.
    tols : sequence of float
        The thresholds of :func:`cuflash.reference.grad_pass_threshold`.

    Returns
    -------
    frac : float
        The largest ``max|g - ref| / tol``; inf where a gradient has the wrong shape, is
        non-finite where its reference is finite (or finite where it is not), has a NaN error,
        or errs under a zero threshold. Never NaN, so it compares like the other bars.
    reasons : list of str
        Why it fails (empty when ``frac <= 1``).
    """
    worst, reasons = 0.0, []
    for name, g, r, t in zip(names, grads, refs, tols):
        g, r = np.asarray(g, dtype=np.float64), np.asarray(r, dtype=np.float64)
        if g.shape != r.shape:
            worst = np.inf
            reasons.append(f"{name} has shape {g.shape}, expected {r.shape}")
            continue
        fin = np.isfinite(r)
        bad = int(np.count_nonzero(fin != np.isfinite(g)))
        with np.errstate(invalid="ignore"):
            diff = np.abs(g - r)[fin]
        err = float(np.max(diff)) if diff.size else 0.0
        frac = err / t if t > 0 else (0.0 if err == 0 else np.inf)
        frac = np.inf if bad or not frac == frac else frac
        if bad:
            reasons.append(f"{bad} {name} elements are non-finite where the reference is finite "
                           "(or finite where it is not)")
        if not frac <= 1.0:
            reasons.append(f"{name}: max abs error {err:.3g} > threshold {t:.3g}")
        worst = max(worst, frac)
    return float(worst), reasons


def variant_audits(device, dtypes: Sequence[str], rng, property_result, numpy_dtype) -> List:
    """PropertyResults of the variant audit (``property_result``: the audit's result class).

    Each result's ``measured`` is the worst fraction of a bar (the forward's err/thr and
    err/bound, its lse's error over its bound, each gradient's error over its threshold) and
    ``limit`` is 1: it passes when every bar holds.
    """
    from . import attention, attention_backward
    from ._audit import lse_check

    out = []
    batch, d = (2, 3), 32
    shapes = ((37, 45, variant_cases), BLOCK_MASK_SHAPE + (block_mask_cases,))
    for dtype in dtypes:
        npdt = numpy_dtype(dtype)
        for (sq, sk, cases), causal in ((sh, c) for sh in shapes for c in (False, True)):
            q, k, v = (reference.round_to(rng.standard_normal(batch + (n, d)), dtype)
                       for n in (sq, sk, sk))
            do = reference.round_to(rng.standard_normal(batch + (sq, d)), dtype)
            for name, kw in cases(rng, batch, sq, sk):
                where = f"{device.name}, {dtype}{', causal' if causal else ''}"
                dkw = {n: _on_device(device, x) for n, x in kw.items()}
                dev = [device.to_device(x.astype(npdt)) for x in (q, k, v)]
                try:
                    o, lse = attention(*dev, causal=causal, return_lse=True, **dkw)
                    grads = attention_backward(device.to_device(do.astype(npdt)), *dev, o, lse,
                                               causal=causal, return_dbias="bias" in kw, **dkw)
                except Exception as exc:  # reported as a failed audit, not a crash
                    out.append(property_result(f"variant {name}", where, float("nan"),
                                               float("nan"), False,
                                               f"raised {type(exc).__name__}: {exc}"))
                    continue
                o_ref, lse_ref = reference.attention_ref(q, k, v, causal=causal, **kw)
                rule = reference.pass_threshold(q, k, v, causal=causal, dtype=dtype, o_ref=o_ref,
                                                **kw)
                verdict = rule.judge(device.to_host(o).astype(np.float64))
                # The forward's rule (3): lse, as in the main grid.
                lse_err, lse_tol, lse_why = lse_check(device.to_host(lse), lse_ref, dtype)
                lse_frac = (lse_err / lse_tol if lse_tol > 0 else
                            (0.0 if lse_err == 0 else np.inf))
                if not lse_frac == lse_frac or (lse_why and lse_frac <= 1.0):
                    lse_frac = np.inf   # NaN, or a non-finite lse where it must be finite
                ref = reference.attention_backward_ref(do, q, k, v, causal=causal,
                                                       return_dbias="bias" in kw, **kw)
                tols, _ = reference.grad_pass_threshold(do, q, k, v, causal=causal, dtype=dtype,
                                                        ref=ref, return_dbias="bias" in kw, **kw)
                gfrac, gwhy = grad_verdict(("dq", "dk", "dv", "dbias"),
                                           [device.to_host(g) for g in grads], ref, tols)
                fwd = max(verdict.frac_threshold, verdict.frac_bound)
                measured = max(fwd if fwd == fwd else np.inf, lse_frac, gfrac)
                ok = verdict.passed and not lse_why and gfrac <= 1.0
                detail = "; ".join(verdict.reasons + lse_why + gwhy) or (
                    f"forward at {fwd:.2g}x its bars, lse at {lse_frac:.2g}x its bound, "
                    f"gradients at {gfrac:.2g}x their thresholds")
                out.append(property_result(f"variant {name}", where, measured, 1.0, ok, detail))
    return out
