"""The gradient section of ``cuflash-check``: :func:`cuflash.attention_backward` against the
float64 reference gradients.

A gradient case is one backward call (after the forward that gives its o and lse) compared, for
each of dq, dk and dv, with :func:`cuflash.reference.attention_backward_ref` on the very values
the kernels received, under the gradient pass rule (:data:`GRAD_RULE`,
:func:`cuflash.reference.grad_pass_threshold`): the forward's rule applied to each gradient, with
the naive same-precision backward as the bar. The section runs on the standard grid below and,
for a user's ``.npz``, when the file holds an upstream gradient ``do``. It sits on the public API
and :mod:`cuflash.reference` only; the device abstraction (moving arrays) is the forward audit's.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from cuflash import attention, attention_backward, backward_dispatch_info
from cuflash import reference

GRAD_RULE = (
    "Gradients: each of dq, dk, dv PASSES when max|X - X_ref| <= 2 * max|X_naive - X_ref| + "
    "4 * u * A_X (reference.grad_pass_threshold: the forward's rule per gradient), where X_ref "
    "is the float64 gradient of sum(do * attention(q, k, v)) from SciPy's softmax (checked "
    "against central finite differences in the tests), X_naive the backward a user gets by "
    "differentiating the naive same-precision attention (each stage rounded to the dtype, "
    "products accumulated in float32) and A_X the size of the terms each gradient element sums "
    "(reference.gradient_scales). For float64 an a priori bound on a float64 backward's error "
    "stands in for the naive error (marked *). Every gradient element must be written (the out= "
    "buffers are pre-filled with NaN) and finite where the reference is."
)

#: (Sq, Sk) pairs, (D, Dv) pairs and broadcast layouts of the standard gradient audit.
SEQ_PAIRS = [(1, 1), (7, 7), (113, 113), (113, 7), (7, 113), (1, 1000), (1000, 1000)]
HEAD_DIMS = [(16, 16), (64, 64), (128, 128), (256, 256), (64, 32), (1, 1)]
#: (q batch, k/v batch): full heads, and multi-query (one key/value head for 3 query heads).
LAYOUTS = [((2, 3), (2, 3)), ((2, 3), (2, 1))]
QUICK = [((2, 3), (2, 3), 7, 7, 16, 16, False), ((2, 3), (2, 1), 113, 7, 64, 64, True),
         ((2, 3), (2, 3), 7, 113, 64, 32, True)]
#: Seeds of the gradient grid: rng([seed, SEED_OFFSET + index]), apart from the forward grid's.
SEED_OFFSET = 1 << 20


@dataclass(frozen=True)
class GradShape:
    batch_q: Tuple[int, ...]
    batch_kv: Tuple[int, ...]
    sq: int
    sk: int
    d: int
    dv: int
    causal: bool

    @property
    def label(self) -> str:
        b = np.broadcast_shapes(self.batch_q, self.batch_kv)
        mqa = "" if self.batch_kv == tuple(b) else f" kv{self.batch_kv}"
        return "(" + ",".join(str(x) for x in tuple(b) + (self.sq, self.sk, self.d, self.dv)) \
            + ")" + mqa


def standard_grid(quick: bool = False) -> List[GradShape]:
    if quick:
        return [GradShape(*c) for c in QUICK]
    shapes = []
    for sq, sk in SEQ_PAIRS:
        for li, (bq, bkv) in enumerate(LAYOUTS):
            if max(sq, sk) >= 1000:
                bq, bkv = (1, 2), (1, 2) if li == 0 else (1, 1)
            for d, dv in HEAD_DIMS:
                if li == 1 and (d, dv) not in ((64, 64), (128, 128)):
                    continue  # the MQA layout on two head dims
                for causal in (False, True):
                    shapes.append(GradShape(bq, bkv, sq, sk, d, dv, causal))
    return shapes


@dataclass
class GradInputs:
    """float64 q, k, v, do (before rounding to the audited dtype) and the call options."""
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    do: np.ndarray
    causal: bool
    scale: Optional[float]
    label: str
    seed: Optional[List[int]] = None
    exact: Optional[str] = None  # dtype whose values these already are


def draw_inputs(shape: GradShape, seed: int, index: int) -> GradInputs:
    """q ~ N(0, 4) (a peaked softmax), k, v, do ~ N(0, 1), from rng([seed, offset + index])."""
    rng = np.random.default_rng([seed, SEED_OFFSET + index])
    batch = tuple(np.broadcast_shapes(shape.batch_q, shape.batch_kv))
    q = 2.0 * rng.standard_normal(shape.batch_q + (shape.sq, shape.d))
    k = rng.standard_normal(shape.batch_kv + (shape.sk, shape.d))
    v = rng.standard_normal(shape.batch_kv + (shape.sk, shape.dv))
    do = rng.standard_normal(batch + (shape.sq, shape.dv))
    return GradInputs(q, k, v, do, shape.causal, None, shape.label,
                      seed=[seed, SEED_OFFSET + index])


@dataclass
class GradCaseResult:
    dtype: str
    kernel_arg: str
    kernel: str
    shape: str
    causal: bool
    seed: Optional[List[int]] = None
    scale: Optional[float] = None
    err: Dict[str, float] = field(default_factory=dict)        # max abs error per gradient
    threshold: Dict[str, float] = field(default_factory=dict)
    naive_err: Dict[str, float] = field(default_factory=dict)
    naive_kind: str = "measured"
    passed: bool = False
    reasons: List[str] = field(default_factory=list)
    seconds: float = 0.0


NAMES = ("dq", "dk", "dv")


def _kernels(device, args, causal) -> List[Tuple[str, str]]:
    """(kernel argument, plan label): auto, and on a GPU every other backward that runs these."""
    pairs = [("auto", backward_dispatch_info(*args, causal=causal))]
    if device.name == "gpu":
        for arg in ("tensorcore", "hopper", "generic"):
            try:
                name = backward_dispatch_info(*args, causal=causal, kernel=arg)
            except ValueError:  # no such backward for these inputs
                continue
            # (auto's label may carry the reason it fell back: compare the plan names)
            if all(name.split(" (")[0] != n.split(" (")[0] for _, n in pairs):
                pairs.append((arg, name))
    return pairs


def run_inputs(device, inp: GradInputs, dtypes: Sequence[str],
               raise_call_errors: bool = False) -> List[GradCaseResult]:
    """Audit the backward for ``inp`` in every dtype through every backward kernel."""
    from cuflash._audit import numpy_dtype  # the forward audit's dtype mapping (ml_dtypes)

    results = []
    for dtype in dtypes:
        npdt = numpy_dtype(dtype)
        if inp.exact == dtype:
            rq, rk, rv, rdo = inp.q, inp.k, inp.v, inp.do
        else:
            rq, rk, rv, rdo = (reference.round_to(x, dtype) for x in (inp.q, inp.k, inp.v,
                                                                        inp.do))
        ref = None
        g = [device.to_device(x.astype(npdt)) for x in (rq, rk, rv, rdo)]
        try:
            o, lse = attention(*g[:3], causal=inp.causal, scale=inp.scale, return_lse=True)
            args = (g[3], g[0], g[1], g[2], o, lse)
            kernels = _kernels(device, args, inp.causal)
        except (ValueError, TypeError) as exc:
            if raise_call_errors:
                raise
            res = GradCaseResult(dtype, "auto", "-", inp.label, bool(inp.causal), inp.seed,
                                 inp.scale)
            res.reasons.append(f"forward or dispatch raised {type(exc).__name__}: {exc}")
            results.append(res)
            continue
        for arg, name in kernels:
            t0 = time.perf_counter()
            res = GradCaseResult(dtype, arg, name, inp.label, bool(inp.causal), inp.seed,
                                 inp.scale, naive_kind="bound" if dtype == "float64"
                                 else "measured")
            out = tuple(device.to_device(np.full(x.shape, np.nan, npdt)) for x in (rq, rk, rv))
            try:
                got = attention_backward(*args, causal=inp.causal, scale=inp.scale, out=out,
                                         kernel=arg)
                host = [np.asarray(device.to_host(x)).astype(np.float64) for x in got]
            except (ValueError, TypeError) as exc:
                if raise_call_errors:
                    raise
                res.reasons.append(f"attention_backward raised {type(exc).__name__}: {exc}")
                results.append(res)
                continue
            except Exception as exc:  # a launch or compile failure is a failed case
                res.reasons.append(f"attention_backward raised {type(exc).__name__}: {exc}")
                results.append(res)
                continue
            if ref is None:
                g_ref = reference.attention_backward_ref(rdo, rq, rk, rv, causal=inp.causal,
                                                         scale=inp.scale)
                tols, naive = reference.grad_pass_threshold(rdo, rq, rk, rv, causal=inp.causal,
                                                            scale=inp.scale, dtype=dtype,
                                                            ref=g_ref)
                ref = (g_ref, tols, naive)
            score(res, host, *ref)
            if not all(device.same_buffer(a, b) for a, b in zip(got, out)):
                res.reasons.append("the returned gradients are not the out= buffers")
                res.passed = False
            res.seconds = time.perf_counter() - t0
            results.append(res)
    return results


def score(res: GradCaseResult, got, g_ref, tols, naive) -> GradCaseResult:
    for name, x, r, tol, ne in zip(NAMES, got, g_ref, tols, naive):
        res.threshold[name], res.naive_err[name] = float(tol), float(ne)
        if x.shape != r.shape:
            res.reasons.append(f"{name} has shape {x.shape}, expected {r.shape}")
            res.err[name] = math.inf
            continue
        bad = int(np.count_nonzero(~np.isfinite(x) & np.isfinite(r)))
        if bad:
            res.reasons.append(f"{bad} {name} elements are NaN/inf (never written, or overflow)")
        diff = np.abs(x - r)
        res.err[name] = float(np.max(diff)) if diff.size else 0.0
        if not res.err[name] <= tol:
            res.reasons.append(f"{name}: max abs error {res.err[name]:.3g} > threshold {tol:.3g}")
    res.passed = not res.reasons
    return res


def run_grid(device, dtypes: Sequence[str], seed: int, quick: bool = False,
             progress=None) -> List[GradCaseResult]:
    results = []
    for index, shape in enumerate(standard_grid(quick)):
        results.extend(run_inputs(device, draw_inputs(shape, seed, index), dtypes))
        if progress is not None:
            progress(1)
    return results


def inputs_from_npz(path: str, dtypes_requested: Sequence[str]):
    """GradInputs from an .npz holding q, k, v and do (None when it has no ``do``), and the
    dtypes to audit (the file's, or those requested). A ``do`` that is not a real array
    (complex, bool, text) is an AuditError."""
    with np.load(path, allow_pickle=False) as f:
        if "do" not in f.files:
            return None, []
        arrays = [f[n] for n in ("q", "k", "v", "do")]
        causal = bool(f["causal"]) if "causal" in f.files else False
        scale = float(f["scale"]) if "scale" in f.files else None
    if arrays[3].dtype.kind not in "fiu":
        # np.asarray(a complex do, float64) would drop the imaginary part without a word.
        from cuflash._audit import AuditError

        raise AuditError(f"{path}: 'do' must be a real array (o's shape), got dtype "
                         f"{arrays[3].dtype} and shape {arrays[3].shape}")
    names = {a.dtype.name for a in arrays}
    if dtypes_requested:
        dtypes, exact = list(dtypes_requested), None
    else:
        dtypes = [arrays[0].dtype.name]
        exact = dtypes[0] if len(names) == 1 else None
    q, k, v, do = (np.asarray(a, dtype=np.float64) for a in arrays)
    batch = tuple(np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2]))
    label = "(" + ",".join(str(x) for x in batch + (q.shape[-2], k.shape[-2], q.shape[-1],
                                                    v.shape[-1])) + ")"
    return GradInputs(q, k, v, do, causal, scale, label, exact=exact), dtypes


def nonfinite_reason(inp: GradInputs) -> str:
    """Why the gradients of ``inp`` cannot be judged ("" when they can): NaN or inf in q, k, v
    or do. The float64 reference gradients (:func:`cuflash.reference.attention_backward_ref`)
    do not carry them (a NaN score's weight counts as 0 there), so a correct backward, whose
    gradients are NaN where the mathematics makes them NaN, would be reported as failing."""
    held = [n for n in ("q", "k", "v", "do")
            if not np.all(np.isfinite(np.asarray(getattr(inp, n), dtype=np.float64)))]
    if not held:
        return ""
    return (f"{', '.join(held)} hold{'s' if len(held) == 1 else ''} NaN/inf, which the float64 "
            "reference gradients do not carry, so there is nothing to judge dq, dk, dv against")


def _fmt(x) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "nan"
    if math.isinf(x):
        return "inf"
    return f"{x:.2e}"


def format_cases(results: Sequence[GradCaseResult]) -> str:
    if not results:
        return ""
    from cuflash._audit import _table

    head = ["dtype", "kernel", "shape (B,H,Sq,Sk,D,Dv)", "causal"]
    for n in NAMES:
        head += [f"{n} err", f"{n} thr"]
    head += ["result"]
    rows = []
    for r in results:
        row = [r.dtype, r.kernel.split("<", 1)[0], r.shape, "yes" if r.causal else "no"]
        star = "*" if r.naive_kind == "bound" else ""
        for n in NAMES:
            row += [_fmt(r.err.get(n, math.nan)), _fmt(r.threshold.get(n, math.nan)) + star]
        row.append("PASS" if r.passed else "FAIL")
        rows.append(row)
    text = "gradients (cuflash.attention_backward vs float64):\n" + \
        _table(head, rows, right=range(4, 10))
    if any(r.naive_kind == "bound" for r in results):
        text += ("\n* float64: thresholds from an a priori bound on a float64 backward's error "
                 "(the naive\n  float64 backward is the reference itself); see --help.")
    return text


def format_failures(results: Sequence[GradCaseResult]) -> str:
    return "\n".join(f"FAIL gradients {r.dtype} {r.kernel} {r.shape} causal={r.causal}"
                     f"{f' seed {r.seed}' if r.seed else ''}: " + "; ".join(r.reasons)
                     for r in results if not r.passed)


def to_json(results: Sequence[GradCaseResult], skipped: str = "") -> Dict[str, Any]:
    """The gradient section as JSON; ``skipped``: why a FILE's gradients were not audited."""
    from cuflash._audit import _json_num

    def case(r):
        d = {}
        for k, v in r.__dict__.items():
            d[k] = {n: _json_num(x) for n, x in v.items()} if isinstance(v, dict) else _json_num(v)
        d["result"] = "PASS" if r.passed else "FAIL"
        return d

    return {"pass_rule": GRAD_RULE, "skipped": skipped or None,
            "cases": [case(r) for r in results],
            "summary": {"passed": sum(r.passed for r in results),
                        "failed": sum(not r.passed for r in results)}}
