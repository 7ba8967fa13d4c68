"""cuflash-check's audit of the attention variants (window, softcap, ALiBi, bias, mask; see
cuflash/variants.py) and of the user hooks (score_mod / mask_mod, cuflash/mods.py: a
relative-position bias as score_mod, and a document mask as mask_mod with a tanh cap as score_mod,
a window and ALiBi): each built-in variant alone and all combined, with and without causal,
forward on the audited device in each audited dtype, judged by the project's pass rule
(`reference.pass_threshold` with the same variant arguments), plus the gradients (dbias
included) under `reference.grad_pass_threshold`."""
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


def _mask(rng, batch, sq, sk):
    m = rng.random(batch + (sq, sk)) > 0.5
    m[..., ::5, :] = False
    return m


def variant_audits(device, dtypes: Sequence[str], rng, property_result, numpy_dtype) -> List:
    """PropertyResults of the variant audit (``property_result``: the audit's result class)."""
    from . import attention, attention_backward

    out = []
    batch, sq, sk, d = (2, 3), 37, 45, 32
    for dtype in dtypes:
        npdt = numpy_dtype(dtype)
        for causal in (False, True):
            q, k, v = (reference.round_to(rng.standard_normal(batch + (n, d)), dtype)
                       for n in (sq, sk, sk))
            do = reference.round_to(rng.standard_normal(batch + (sq, d)), dtype)
            for name, kw in variant_cases(rng, batch, sq, sk):
                where = f"{device.name}, {dtype}{', causal' if causal else ''}"
                dkw = {n: (device.to_device(x) if isinstance(x, np.ndarray) else x)
                       for n, x in kw.items()}
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
                rule = reference.pass_threshold(q, k, v, causal=causal, dtype=dtype, **kw)
                verdict = rule.judge(device.to_host(o).astype(np.float64))
                ref = reference.attention_backward_ref(do, q, k, v, causal=causal,
                                                       return_dbias="bias" in kw, **kw)
                tols, _ = reference.grad_pass_threshold(do, q, k, v, causal=causal, dtype=dtype,
                                                        ref=ref, return_dbias="bias" in kw, **kw)
                fracs = [float(np.max(np.abs(device.to_host(g).astype(np.float64) - r))) / t
                         if t > 0 else 0.0 for g, r, t in zip(grads, ref, tols)]
                gfrac = max(fracs) if fracs else 0.0
                ok = verdict.passed and gfrac <= 1.0
                detail = "; ".join(verdict.reasons) or (
                    f"gradients at {gfrac:.2g}x their threshold" if gfrac else "")
                out.append(property_result(f"variant {name}", where, verdict.frac_threshold,
                                           1.0, ok, detail or "forward and gradients pass"))
    return out
