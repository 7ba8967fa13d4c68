"""Dispatch of attention variants (window, softcap, ALiBi, bias, mask; cuflash/variants.py).

Every variant runs on the generic kernels, instantiated with the policy of kernels_cu/variants.cuh
as a template parameter: ``cuflash_fwd_generic_var<T, Acc, DB, DVB, CAUSAL, Variant<WINDOW,
SOFTCAP, ALIBI, BiasT, MASK>>``. The tensor-core (mma.sync) and Hopper kernels take no policy yet
(notes/VARIANTS.md: the plan); ``kernel="auto"`` passes them over and the plan's label says why,
``kernel="tensorcore"`` / ``"hopper"`` raise ValueError saying why.
"""
from __future__ import annotations

from ._dispatch import _CXX_TYPE, Plan, Specialisation

#: Why the fast kernels are passed over for a variant (in the plan label of kernel="auto").
FAST_KERNELS_REASON = "variants run on the generic kernels only so far"


def policy_name(variant) -> str:
    """The C++ policy type of a `cuflash.variants.Variant`, e.g.
    ``cuflash::Variant<true, false, false, cuflash::NoBias, false>``."""
    b = "true" if variant.has_window else "false"
    s = "true" if variant.softcap else "false"
    a = "true" if variant.alibi_slopes is not None else "false"
    m = "true" if variant.mask is not None else "false"
    bias = ("cuflash::NoBias" if variant.bias is None
            else _CXX_TYPE[_dtype_name(variant.bias.dtype)])
    base = f"cuflash::Variant<{b}, {s}, {a}, {bias}, {m}>"
    if not getattr(variant, "has_mods", False):
        return base
    from .mods import hook_type   # user hooks wrap the built-in policy (variants.cuh)
    sm = "true" if variant.score_mod is not None else "false"
    mm = "true" if variant.mask_mod is not None else "false"
    return (f"cuflash::UserVariant<{base}, {hook_type(variant.score_mod, variant.mask_mod)}, "
            f"{sm}, {mm}>")


def _hook_source(variant) -> str:
    """The generated hook struct a specialisation's source needs ("" without hooks)."""
    if not getattr(variant, "has_mods", False):
        return ""
    from .mods import hook_source
    return hook_source(variant.score_mod, variant.mask_mod)


def _dtype_name(dt):
    import numpy as np
    return np.dtype(dt).name


def policy_label(variant) -> str:
    """The variant's parts for a plan label, e.g. ``window,softcap,bias<float16>``."""
    parts = []
    if variant.has_window:
        parts.append("window")
    if variant.softcap:
        parts.append("softcap")
    if variant.alibi_slopes is not None:
        parts.append("alibi")
    if variant.bias is not None:
        parts.append(f"bias<{_dtype_name(variant.bias.dtype)}>")
    if variant.mask is not None:
        parts.append("mask")
    for name, hook in (("score_mod", variant.score_mod), ("mask_mod", variant.mask_mod)):
        if hook is not None:   # user hooks, named by their code's hash
            parts.append(f"{name}[{hook.digest[:8]}]")
    return ",".join(parts)


def generic_variant_plan(dtype_name: str, d: int, dv: int, causal: bool, variant,
                         reason: str = "") -> Plan:
    """The generic forward kernel with the variant's policy (attn_generic.cu:
    cuflash_fwd_generic_var); the same configuration as the plain generic plan."""
    import dataclasses

    from ._dispatch import generic_plan

    base = generic_plan(dtype_name, d, dv, causal)
    name = (base.spec.name.replace("cuflash_fwd_generic<", "cuflash_fwd_generic_var<")[:-1]
            + f", {policy_name(variant)}>")
    label = base.label[:-1] + f",{policy_label(variant)}>" + (f" ({reason})" if reason else "")
    return dataclasses.replace(base, label=label, spec=Specialisation(
        base.spec.family, name, extra_source=_hook_source(variant)))


def variant_plan_for(prob) -> Plan:
    """The forward plan of a problem with a variant (``prob.variant`` not None)."""
    if prob.kernel in ("tensorcore", "hopper"):
        hooks = prob.variant.hook_names() if getattr(prob.variant, "has_mods", False) else []
        what = (f"the user hook{'s' if len(hooks) > 1 else ''} {' and '.join(hooks)} "
                "(compiled into the generic kernels only)" if hooks
                else f"the attention variant ({policy_label(prob.variant)})")
        raise ValueError(f"kernel={prob.kernel!r} cannot run these inputs: {what} is not "
                         "supported there yet; use kernel='auto' or 'generic'")
    reason = FAST_KERNELS_REASON if prob.kernel == "auto" else ""
    return generic_variant_plan(prob.dtype_name, prob.d, prob.dv, prob.causal, prob.variant,
                                reason)


class _Spec:
    """A stand-in Variant for compile checks (only which parts are on matters)."""

    def __init__(self, window=False, softcap=False, alibi=False, bias=None, mask=False):
        import numpy as np
        self.has_window, self.softcap = window, 1.0 if softcap else 0.0
        self.alibi_slopes = np.zeros(1, np.float32) if alibi else None
        self.bias = None if bias is None else np.zeros(1, dtype=_np_dtype(bias))
        self.mask = np.zeros(1, bool) if mask else None
        self.score_mod = self.mask_mod = None
        self.has_mods = False


def _np_dtype(name):
    import numpy as np
    if name == "bfloat16":
        import ml_dtypes
        return ml_dtypes.bfloat16
    return np.dtype(name)


def _compile_policies(dt):
    """(policy, causal) pairs of the compile check for one dtype: every part alone (full mask)
    and the combination of all five parts, with and without causal."""
    bias = "float32" if dt != "float64" else "float64"
    every = _Spec(window=True, softcap=True, alibi=True, bias=bias, mask=True)
    alone = [_Spec(window=True), _Spec(softcap=True), _Spec(alibi=True), _Spec(bias=bias),
             _Spec(mask=True)]
    return [(pol, False) for pol in alone] + [(every, False), (every, True)]


def variant_compile_specs():
    """The forward variant specialisations the compile check builds (D64; the combination also
    at D128 and D256, where registers are tightest)."""
    out = []
    for dt in ("float16", "bfloat16", "float32", "float64"):
        for pol, causal in _compile_policies(dt):
            out.append(generic_variant_plan(dt, 64, 64, causal, pol).spec)
        every = _compile_policies(dt)[-1][0]
        for db in (128, 256):
            out.append(generic_variant_plan(dt, db, db, True, every).spec)
    return out


def bwd_generic_variant_plan(dtype_name: str, d: int, dv: int, causal: bool, variant,
                             reason: str = ""):
    """The generic backward with the variant's policy: the plain generic plan's configuration,
    its dq and dk/dv passes as cuflash_bwd_dq_generic_var / cuflash_bwd_dkdv_generic_var."""
    import dataclasses

    from ._dispatch import bwd_generic_plan

    base = bwd_generic_plan(dtype_name, d, dv, causal)
    pol, tag = policy_name(variant), policy_label(variant)
    passes = []
    for grid, plan in base.passes:
        name = plan.spec.name.replace("_generic<", "_generic_var<")[:-1] + f", {pol}>"
        passes.append((grid, dataclasses.replace(
            plan, label=plan.label[:-1] + f",{tag}>",
            spec=Specialisation(plan.spec.family, name,
                                extra_source=_hook_source(variant)))))
    label = base.label[:-1] + f",{tag}>" + (f" ({reason})" if reason else "")
    return dataclasses.replace(base, label=label, passes=tuple(passes))


def variant_backward_plan_for(prob):
    """The backward plan of a problem with a variant."""
    if prob.kernel in ("tensorcore", "hopper"):
        hooks = prob.variant.hook_names() if getattr(prob.variant, "has_mods", False) else []
        what = f" for the user hook(s) {' and '.join(hooks)}" if hooks else ""
        raise ValueError(f"kernel={prob.kernel!r} has no backward kernel{what} yet; "
                         "use kernel='auto' or 'generic'")
    return bwd_generic_variant_plan(prob.dtype_name, prob.d, prob.dv, prob.causal,
                                    prob.variant)


def variant_backward_compile_specs():
    """The backward variant specialisations the compile check builds: softcap alone (its
    derivative) and the combination of all parts with and without causal, D64 and D128."""
    out = []
    for dt in ("float16", "bfloat16", "float32", "float64"):
        pols = _compile_policies(dt)
        for db, (pol, causal) in [(64, pols[1]), (64, pols[-2]), (64, pols[-1]),
                                  (128, pols[-1])]:
            for _, plan in bwd_generic_variant_plan(dt, db, db, causal, pol).passes:
                out.append(plan.spec)
    return out


def mod_compile_specs():
    """Forward and backward specialisations with user hooks (`cuflash.mods.example_hooks`) for
    the compile check (sm_90): a score_mod alone, score_mod + mask_mod, both with window and
    ALiBi (tests/test_mods_gpu.py's composed case), and both on top of all built-in parts at
    D128."""
    from .mods import example_hooks
    ex = example_hooks()
    cap, rel, doc = ex["tanh_cap"], ex["rel_bias"], ex["document"]
    out = []
    for dt in ("float16", "bfloat16", "float32", "float64"):
        pols = _compile_policies(dt)
        cases = [(_with_mods(_Spec(), cap, None), False, 64),
                 (_with_mods(_Spec(), rel, doc), True, 64),
                 (_with_mods(_Spec(window=True, alibi=True), cap, doc), True, 64),
                 (_with_mods(pols[-1][0], cap, doc), True, 128)]
        for pol, causal, db in cases:
            out.append(generic_variant_plan(dt, db, db, causal, pol).spec)
            for _, plan in bwd_generic_variant_plan(dt, db, db, causal, pol).passes:
                out.append(plan.spec)
    return out


def _with_mods(spec, score_mod, mask_mod):
    spec.score_mod, spec.mask_mod = score_mod, mask_mod
    spec.has_mods = True
    return spec
