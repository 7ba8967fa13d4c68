"""The numerical audit behind ``cuflash-check``.

Everything here sits on the public API (:func:`cuflash.attention`, :func:`cuflash.merge_states`,
:func:`cuflash.dispatch_info`, :func:`cuflash.gpu_available`) and on :mod:`cuflash.reference`.
CuPy is touched only to move arrays to and from the GPU and to describe the device, and it is
imported lazily, so the CPU audit runs without it.

An audited case is one attention call compared with the float64 SciPy reference computed on the
very values the kernel received (the inputs are drawn in float64 and rounded to the dtype first):

* ``err``: max |o - o_ref|; ``rel``: ||o - o_ref|| / ||o_ref|| (Frobenius norms);
* ``naive``: max |o_naive - o_ref| for the unfused matmul -> softmax -> matmul written in the same
  precision (:func:`cuflash.reference.naive_attention`); for float64, where that computation is
  the reference itself, its forward-error bound instead
  (:func:`cuflash.reference.naive_error`);
* ``threshold``: :func:`cuflash.reference.tolerance`, i.e. ``2 * naive + 4 * u * A``;
* ``bound``: the a-priori forward-error bound of :func:`cuflash.reference.error_bound`, element
  by element (the table shows the error as a fraction of it, ``err/bound``);
* ``lse``: max |lse - lse_ref| over the rows whose reference lse is finite;
* ``peer_err``: where PyTorch or JAX imports, the max abs error of their SDPA on the same inputs,
  and ``ratio_to_peer``, cuflash's error over the best of them.

The pass rule is spelled out in :data:`PASS_RULE` (it is also the ``--help`` text of the CLI).
"""
from __future__ import annotations

import math
import platform
import secrets
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
from scipy.special import softmax as _scipy_softmax

from cuflash import attention, dispatch_info, gpu_available, merge_states
from cuflash import reference

ALL_DTYPES = ("float16", "bfloat16", "float32", "float64")

#: Relative bound of the lse check, as a function of the dtype: ``max(1e-5, 2 u)``.
#: lse is float32 and built from float32-accumulated scores for every dtype, so for float32 and
#: float64 it is good to a few 1e-7 relative; 16-bit kernels may sum the probabilities after
#: rounding them to the dtype, which moves l by up to u relative, i.e. lse by up to u absolute.
LSE_RTOL = {name: max(1e-5, 2.0 * reference.unit_roundoff(name)) for name in ALL_DTYPES}

#: Bound for the float64 property audits of the recurrence and of the merge operator.
EXACT_TOL = 1e-12

PASS_RULE = (
    "A case PASSES when all of these hold.\n\n"
    "(1) Output: max|o - o_ref| <= 2 * max|o_naive - o_ref| + 4 * u * A, where o_ref "
    "is the float64 SciPy reference computed on the same (rounded) inputs, o_naive a naive "
    "same-precision implementation (matmul -> softmax -> matmul, each stage rounded to the "
    "dtype, products accumulated in float32) and u the unit roundoff of the dtype (2^-11 "
    "float16, 2^-8 bfloat16, 2^-24 float32, 2^-53 float64): the rule FlashAttention's own "
    "tests use, with a small absolute term. A = max over rows and columns of sum_j p_j |v_j| "
    "(>= max|o_ref|) is the size of the terms each output sums: rounding the weights p, their "
    "sum and the output acts at that scale (a few roundings, hence 4u), and on problems with "
    "few output elements the measured naive error alone is too noisy to see it. For float64 the naive "
    "implementation performs the very operations of the reference (its measured error is 0), "
    "so its first-order forward-error bound u * max|v| * (2 (D+1) |scale| max||q_i|| "
    "max||k_j|| + 2 Sk + 4) stands in for it (marked * in the table).\n\n"
    "(1b) A-priori bound: |o - o_ref| <= B element by element, B a forward-error bound of a "
    "correct tiled online-softmax kernel in the dtype (derived in notes/ERROR_BOUND.md; "
    "cuflash.reference.error_bound). With w the exact softmax weights of the row, "
    "A = sum_j w_j |v_j| and sigma = sqrt(sum_j w_j v_j^2 - o^2) the spread of the values under "
    "the weights: B ~ rho * sigma + u_p * A + gamma * (A + |o|) + u * |o|, plus the float64 "
    "reference's own bound. rho = expm1(2 Delta), where Delta = (e_prod + 2 D ua) |scale| "
    "max_j |q_i|.|k_j| + 12 ua max_j |s_ij| + 8 ua + (Sk/16 + 2) * 12 ua (+ u for 16-bit) bounds "
    "the error of every exponent s_j - m: float32 dot products (2 ua per addition, for "
    "truncating tensor-core adders), exp2 with the scale folded in, every rescale of the state "
    "(key tiles of at least 16). u_p is the rounding of P before P.V (u for 16-bit; 64 ua for "
    "float32, which admits split-precision tensor-core products), gamma = 2 (Sk + 2 (Sk/16 + 2)) "
    "ua the accumulation of O and l, ua = 2^-24 (2^-53 for float64), e_prod = 2 ua (64 ua for "
    "float32). A broken naive implementation cannot inflate B: where the naive error exceeds "
    "5% of max|o_ref| the 2x-naive comparison is uninformative (marked ! in the table) and B "
    "is the bar that counts. The table gives the error as a fraction of each bar (err/thr, "
    "err/bound; both must be <= 1).\n\n"
    "(2) Every output element is finite wherever the reference is, NaN where it is NaN and "
    "non-finite where it is inf (the out=(o, lse) buffers "
    "are pre-filled with NaN, so elements the kernel never writes fail) and the returned "
    "(o, lse) are those buffers.\n\n"
    "(3) lse: rows whose reference lse is -inf (no visible key) must be exactly -inf; every "
    "row whose reference lse is NaN or +inf (NaN or inf inputs) must be non-finite; every "
    "other row must be finite with |lse - lse_ref| <= max(1e-5, 2u) * max(1, |lse_ref|) "
    "(lse is float32 for every dtype and built from float32-accumulated scores; the 2u lets "
    "16-bit kernels sum probabilities rounded to the dtype).\n\n"
    "Property audits: the recurrence (random chunkings and orders, a max jump of 1000) and the "
    "merge operator (associativity, commutativity, identity) run in float64 and must agree "
    "with SciPy to 1e-12; float16 scores near 12 must overflow exp(s)/sum(exp(s)) while "
    "cuflash stays within the case rule; a max jump of ~150 between key tiles (alpha "
    "underflows) must stay within the case rule; merge_states of two key halves must match "
    "the reference over all keys within the case rule plus 8 * 2^-24 * max(1, |lse_ref|) * "
    "max|o_ref| (the halves' lse are float32); each attention variant (window, softcap, ALiBi, "
    "bias, mask, user hooks) must pass (1), (1b) and (3) forward and the gradient rule below "
    "for dq, dk, dv (and dbias), its row showing the worst error as a fraction of any of "
    "those bars against a limit of 1."
)


# ----------------------------------------------------------------------------------------------
# dtypes and devices
# ----------------------------------------------------------------------------------------------

class AuditError(Exception):
    """A problem with the audit's own inputs (device, dtype, file): reported, exit status 2."""


def numpy_dtype(name: str) -> np.dtype:
    """The NumPy dtype object for ``name``; bfloat16 comes from ml_dtypes (AuditError if absent)."""
    try:
        return np.dtype(name)
    except TypeError:
        if name != "bfloat16":
            raise
    try:
        import ml_dtypes  # noqa: F401  (registers the type with NumPy)
        return np.dtype(ml_dtypes.bfloat16)
    except ImportError:
        raise AuditError("bfloat16 needs the ml_dtypes package, which is not installed") from None


def _bf16_on_gpu() -> bool:
    try:
        import cupy
        try:
            import ml_dtypes  # noqa: F401
        except ImportError:
            pass
        cupy.dtype("bfloat16")
        return True
    except Exception:
        return False


def _bf16_on_cpu() -> bool:
    try:
        numpy_dtype("bfloat16")
        return True
    except AuditError:
        return False


def _driver_loadable() -> bool:
    """Whether the CUDA driver library (libcuda) can be loaded at all."""
    import ctypes

    names = ("nvcuda.dll",) if sys.platform == "win32" else ("libcuda.so.1", "libcuda.so")
    for lib in names:
        try:
            ctypes.CDLL(lib)
            return True
        except OSError:
            continue
    return False


def _no_gpu() -> Tuple[str, str]:
    """Why no GPU is usable (best effort): a short sentence and the underlying detail (the
    exception CuPy raised, or "")."""
    try:
        import cupy
    except Exception as exc:  # ImportError, or a broken CUDA install raising at import
        return "CuPy cannot be imported", f"{type(exc).__name__}: {exc}".replace("\n", " ")
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        detail = f"{type(exc).__name__}: {exc}".replace("\n", " ")
        if "InsufficientDriver" in detail or "NoDevice" in detail or "driver" in detail.lower():
            if not _driver_loadable():
                return "no CUDA driver was found (libcuda cannot be loaded)", detail
            if "InsufficientDriver" in detail:
                return ("the CUDA driver is older than the CUDA runtime of this CuPy needs",
                        detail)
        return "CuPy finds no CUDA device", detail
    if n == 0:
        return "CuPy reports 0 CUDA devices", ""
    return "cuflash.gpu_available() returned False", ""


def _why_no_gpu() -> str:
    """A short reason why no GPU is usable, with the detail in parentheses (for errors)."""
    summary, detail = _no_gpu()
    return f"{summary} ({detail})" if detail else summary


def no_gpu_detail() -> str:
    """The underlying error behind the no-GPU reason, for a second line of the device report."""
    return _no_gpu()[1]


class Device:
    """Where the audited calls run: moves arrays there and back and lists the kernels to audit."""

    name = "cpu"

    def to_device(self, x: np.ndarray):
        return x

    def to_host(self, x) -> np.ndarray:
        return np.asarray(x)

    def same_buffer(self, a, b) -> bool:
        return a is b or (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)
                          and a.shape == b.shape and np.shares_memory(a, b))

    def default_dtypes(self) -> List[str]:
        names = ["float16", "float32", "float64"]
        if _bf16_on_cpu():  # ml_dtypes gives NumPy its bfloat16
            names.insert(1, "bfloat16")
        return names

    def supports(self, dtype: str) -> bool:
        return dtype != "bfloat16" or _bf16_on_cpu()

    def kernels(self, q, k, v, causal) -> List[Tuple[str, str]]:
        """(kernel argument, dispatched kernel name) pairs to audit for these inputs."""
        return [("auto", dispatch_info(q, k, v, causal=causal, kernel="auto"))]

    def info(self) -> Dict[str, Any]:
        return {"kind": "cpu", "processor": platform.processor() or platform.machine(),
                "platform": platform.platform()}


class GpuDevice(Device):
    name = "gpu"

    def __init__(self):
        import cupy
        self._cp = cupy

    def to_device(self, x):
        return self._cp.asarray(x)

    def to_host(self, x):
        return self._cp.asnumpy(x)

    def same_buffer(self, a, b) -> bool:
        if a is b:
            return True
        try:
            return (tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype
                    and a.data.ptr == b.data.ptr)
        except AttributeError:
            return False

    def default_dtypes(self) -> List[str]:
        names = ["float16", "float32", "float64"]
        if _bf16_on_gpu():
            names.insert(1, "bfloat16")
        return names

    def supports(self, dtype: str) -> bool:
        return dtype != "bfloat16" or _bf16_on_gpu()

    def kernels(self, q, k, v, causal):
        """auto (the dispatcher's choice), then every other kernel and float32 precision mode
        that can run these inputs, as (call spec, dispatched kernel name) pairs; a spec is a
        kernel argument, with "/high" for float32's one-pass TF32 mode (see `call_kwargs`)."""
        pairs = [("auto", dispatch_info(q, k, v, causal=causal, kernel="auto"))]
        precisions = ("highest", "high") if q.dtype == np.float32 else ("highest",)
        for precision in precisions:
            for arg in ("auto", "tensorcore", "generic"):
                try:
                    name = dispatch_info(q, k, v, causal=causal, kernel=arg, precision=precision)
                except ValueError:  # these inputs do not qualify for that kernel
                    continue
                if all(name != n for _, n in pairs):
                    pairs.append((arg if precision == "highest" else f"{arg}/{precision}", name))
        return pairs

    def info(self):
        cp = self._cp
        d: Dict[str, Any] = {"kind": "gpu"}
        try:
            dev = cp.cuda.Device()
            props = cp.cuda.runtime.getDeviceProperties(dev.id)
            name = props.get("name", b"")
            d["index"] = dev.id
            d["name"] = name.decode() if isinstance(name, bytes) else str(name)
            d["compute_capability"] = str(dev.compute_capability)
            d["memory_bytes"] = int(props.get("totalGlobalMem", 0))
            d["cuda_runtime"] = cp.cuda.runtime.runtimeGetVersion()
            d["cuda_driver"] = cp.cuda.runtime.driverGetVersion()
        except Exception as exc:  # the audit itself will report real problems
            d["error"] = f"{type(exc).__name__}: {exc}"
        return d


def short_kernel(name: str) -> str:
    """A kernel label's family, with float32's product mode where it has one:
    "tensorcore<float32,3xtf32,D128,...>" -> "tensorcore/3xtf32" (also "3xfp16": the Hopper
    kernel's fp16-split form)."""
    family, _, rest = name.partition("<")
    parts = rest.split(",")
    if len(parts) > 1 and parts[1] in ("3xtf32", "3xfp16", "tf32"):
        return f"{family}/{parts[1]}"
    return family


def call_kwargs(spec: str) -> Dict[str, str]:
    """The `attention` keyword arguments of a call spec from `Device.kernels`: "auto",
    "tensorcore", "generic", optionally followed by "/high" (float32's one-pass TF32 mode)."""
    arg, _, precision = spec.partition("/")
    kw = {} if arg == "auto" else {"kernel": arg}
    if precision:
        kw["precision"] = precision
    return kw


def spec_precision(spec: str) -> Optional[str]:
    """The float32 precision mode of a call spec (None for the default, float32-accurate one)."""
    return spec.partition("/")[2] or None


def select_device(requested: str) -> Tuple[Device, str]:
    """The device for ``--device`` (cpu, gpu or auto) and a sentence saying why."""
    if requested == "cpu":
        return Device(), "requested with --device cpu"
    have = bool(gpu_available())
    if requested == "gpu":
        if not have:
            raise AuditError(f"--device gpu: no usable CUDA GPU ({_why_no_gpu()})")
        return GpuDevice(), "requested with --device gpu"
    if requested != "auto":
        raise AuditError(f"unknown device {requested!r}")
    if have:
        return GpuDevice(), "auto: cuflash.gpu_available() is True"
    return Device(), f"auto: no usable CUDA GPU, so the NumPy path; {_no_gpu()[0]}"


def resolve_dtypes(device: Device, requested: Sequence[str]) -> List[str]:
    if not requested:
        return device.default_dtypes()
    out = []
    for name in requested:
        if name not in ALL_DTYPES:
            raise AuditError(f"unknown dtype {name!r}; expected one of {', '.join(ALL_DTYPES)}")
        if not device.supports(name):
            why = ("CuPy does not accept cupy.dtype('bfloat16') (install ml_dtypes)"
                   if device.name == "gpu" else "ml_dtypes is not installed")
            raise AuditError(f"--dtype {name} is not available on the {device.name}: {why}")
        if name not in out:
            out.append(name)
    return out


def versions() -> Dict[str, str]:
    from importlib import metadata
    import scipy
    import cuflash

    v = {"python": platform.python_version(), "numpy": np.__version__, "scipy": scipy.__version__,
         "cuflash": str(getattr(cuflash, "__version__", "unknown"))}
    try:
        v["click"] = metadata.version("click")
    except metadata.PackageNotFoundError:
        pass
    if "cupy" in sys.modules:
        v["cupy"] = sys.modules["cupy"].__version__
    try:
        import ml_dtypes
        v["ml_dtypes"] = ml_dtypes.__version__
    except ImportError:
        pass
    for peer in ("torch", "jax"):  # the peers, when the audit imported them
        if peer in sys.modules:
            v[peer] = str(getattr(sys.modules[peer], "__version__", "unknown"))
    return v


# ----------------------------------------------------------------------------------------------
# the grid
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Shape:
    batch: Tuple[int, ...]
    sq: int
    sk: int
    d: int
    dv: int
    causal: bool

    @property
    def label(self) -> str:
        return "(" + ",".join(str(x) for x in self.batch + (self.sq, self.sk, self.d, self.dv)) + ")"


#: (Sq, Sk) pairs of the standard audit.
SEQ_PAIRS = [(1, 1), (7, 7), (113, 113), (1000, 1000), (1, 1000), (113, 7), (7, 113),
             (1000, 113), (128, 1000)]
#: (D, Dv) pairs of the standard audit.
HEAD_DIMS = [(16, 16), (64, 64), (128, 128), (256, 256), (64, 32), (1, 1)]
QUICK = [((2, 3), 7, 7, 16, 16, False), ((2, 3), 113, 7, 64, 64, True),
         ((2, 3), 7, 113, 64, 32, True), ((2, 3), 113, 113, 128, 128, False),
         ((2, 3), 1, 113, 1, 1, False)]


def standard_grid(quick: bool = False) -> List[Shape]:
    """The shapes of the standard audit (``quick``: the small subset the tests use)."""
    if quick:
        return [Shape(*c) for c in QUICK]
    shapes = []
    for sq, sk in SEQ_PAIRS:
        batch = (1, 2) if max(sq, sk) >= 1000 else (2, 3)
        for d, dv in HEAD_DIMS:
            for causal in (False, True):
                shapes.append(Shape(batch, sq, sk, d, dv, causal))
    return shapes


# ----------------------------------------------------------------------------------------------
# one case
# ----------------------------------------------------------------------------------------------

@dataclass
class Inputs:
    """float64 values of q, k, v (before rounding to the audited dtype) and the call options."""
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    causal: bool
    scale: Optional[float]
    label: str
    seed: Optional[List[int]] = None
    exact: Optional[str] = None   # dtype whose values these already are (no rounding needed)


def draw_inputs(shape: Shape, seed: int, index: int) -> Inputs:
    """Random q, k, v for a grid shape from ``numpy.random.default_rng([seed, index])``.

    k and v are standard normal; q has standard deviation 2 so the softmax is peaked enough that
    the row maximum moves between key tiles and the rescaling is exercised.
    """
    rng = np.random.default_rng([seed, index])
    b = shape.batch
    q = 2.0 * rng.standard_normal(b + (shape.sq, shape.d))
    k = rng.standard_normal(b + (shape.sk, shape.d))
    v = rng.standard_normal(b + (shape.sk, shape.dv))
    return Inputs(q, k, v, shape.causal, None, shape.label, seed=[seed, index])


@dataclass
class CaseResult:
    dtype: str
    kernel_arg: str
    kernel: str
    shape: str
    causal: bool
    seed: Optional[List[int]] = None
    scale: Optional[float] = None
    max_abs_err: float = math.nan
    rel_err: float = math.nan
    naive_err: float = math.nan
    naive_kind: str = "measured"
    naive_informative: bool = True
    threshold: float = math.nan
    frac_threshold: float = math.nan
    bound: float = math.nan
    frac_bound: float = math.nan
    lse_err: float = math.nan
    lse_tol: float = math.nan
    nonfinite: int = 0
    passed: bool = False
    reasons: List[str] = field(default_factory=list)
    seconds: float = 0.0
    #: max abs error of each peer's SDPA on the same inputs (NaN: it could not run them)
    peer_err: Dict[str, float] = field(default_factory=dict)
    #: the peer with the smallest error, and cuflash's error divided by it
    peer_best: str = ""
    ratio_to_peer: float = math.nan

    @property
    def kernel_short(self) -> str:
        return short_kernel(self.kernel)


def _max(x: np.ndarray) -> float:
    return float(np.max(x)) if x.size else 0.0


def case_rule(q, k, v, causal, scale, dtype: str, o_ref: np.ndarray,
              precision: Optional[str] = None) -> reference.PassRule:
    """The project's pass rule for these inputs (:func:`cuflash.reference.pass_threshold`): the
    2x-naive threshold (the naive error measured for float16, bfloat16 and float32, its
    forward-error bound for float64) and the a-priori bound; ``precision="high"``: float32's
    one-pass TF32 mode, judged against the one-pass TF32 naive implementation."""
    return reference.pass_threshold(q, k, v, causal=causal, scale=scale, dtype=dtype, o_ref=o_ref,
                                    precision=precision)


def lse_check(lse, lse_ref, dtype: str, extra: float = 0.0) -> Tuple[float, float, List[str]]:
    """(max abs error over finite reference entries, allowed bound there, failure reasons);
    ``extra`` is an absolute allowance added to the bound (float32's TF32 mode: `_lse_extra`)."""
    reasons = []
    lse = np.asarray(lse, dtype=np.float64)
    lse_ref = np.asarray(lse_ref, dtype=np.float64)
    if lse.shape != lse_ref.shape:
        return math.inf, math.nan, [f"lse has shape {lse.shape}, expected {lse_ref.shape}"]
    fin = np.isfinite(lse_ref)
    masked = lse_ref == -np.inf
    wrong_masked = int(np.count_nonzero(masked & (lse != -np.inf)))
    if wrong_masked:
        reasons.append(f"{wrong_masked} fully masked rows have lse != -inf")
    bad = int(np.count_nonzero(fin & ~np.isfinite(lse)))
    if bad:
        reasons.append(f"{bad} lse entries are not finite where the reference is")
    missed = int(np.count_nonzero((np.isnan(lse_ref) | (lse_ref == np.inf)) & np.isfinite(lse)))
    if missed:
        reasons.append(f"{missed} lse entries are finite where the reference is NaN or +inf")
    rtol = LSE_RTOL[dtype]
    if fin.any():
        diff = np.abs(lse[fin] - lse_ref[fin])
        allowed = rtol * np.maximum(1.0, np.abs(lse_ref[fin])) + extra
        err = float(np.max(diff)) if not np.isnan(diff).any() else math.nan
        over = int(np.count_nonzero(~(diff <= allowed)))
        if over:
            reasons.append(f"lse error over max({rtol:.0e}*max(1,|lse_ref|)) in {over} rows "
                           f"(max {err:.3g})")
        bound = float(np.max(allowed))
    else:
        err, bound = 0.0, 0.0
    if wrong_masked:
        err = math.inf
    return err, bound, reasons


def _lse_extra(spec: str, q, k, scale) -> float:
    """The lse allowance of float32's one-pass TF32 mode: its scores carry up to
    2 u_tf32 |scale| ||q_i|| ||k_j|| absolute error (each operand rounded to TF32, u_tf32 = 2^-11),
    and the lse moves by at most the largest score error. 0 for the other modes."""
    if spec_precision(spec) != "high":
        return 0.0
    d = q.shape[-1]
    sc = 1.0 / math.sqrt(d) if scale is None else abs(float(scale))
    with np.errstate(invalid="ignore", over="ignore"):
        qn = np.sqrt(np.sum(np.square(q), axis=-1))
        kn = np.sqrt(np.sum(np.square(k), axis=-1))
    qn, kn = qn[np.isfinite(qn)], kn[np.isfinite(kn)]
    return 2.0 * 2.0 ** -11 * sc * _max(qn) * _max(kn)


def score_output(res: CaseResult, o: np.ndarray, lse, lse_ref: np.ndarray,
                 rule: reference.PassRule, extra_tol: float = 0.0,
                 lse_extra: float = 0.0) -> CaseResult:
    """Fill the error columns and the verdict of ``res`` by ``rule`` (``extra_tol`` widens both
    of its bars, ``lse_extra`` the lse bound)."""
    if extra_tol:
        rule = rule.widened(extra_tol)
    o = np.asarray(o).astype(np.float64)
    o_ref = rule.o_ref
    res.naive_err = rule.naive_err
    res.naive_kind = rule.naive_kind
    res.naive_informative = rule.naive_informative
    res.threshold = rule.threshold
    res.bound = rule.bound_max
    verdict = rule.judge(o)
    res.reasons.extend(verdict.reasons)
    res.nonfinite = verdict.nonfinite
    res.max_abs_err = verdict.max_abs_err
    res.frac_threshold = verdict.frac_threshold
    res.frac_bound = verdict.frac_bound
    if o.shape != o_ref.shape:
        res.passed = False
        return res
    fin = np.isfinite(o_ref)
    with np.errstate(invalid="ignore"):
        nref = float(np.linalg.norm(o_ref[fin]))
        ndiff = float(np.linalg.norm((o - o_ref)[fin]))
    res.rel_err = ndiff / nref if nref > 0 else (0.0 if ndiff == 0 else math.inf)
    if lse is None:
        res.reasons.append("no lse returned")
    else:
        res.lse_err, res.lse_tol, why = lse_check(lse, lse_ref, res.dtype, lse_extra)
        res.reasons.extend(why)
    res.passed = not res.reasons
    return res


# ----------------------------------------------------------------------------------------------
# peers: the SDPA of PyTorch and JAX, when importable
# ----------------------------------------------------------------------------------------------

def available_peers() -> List[str]:
    """Names of the peer libraries that can be imported here ("torch", "jax"); never required."""
    import importlib.util

    return [name for name in ("torch", "jax") if importlib.util.find_spec(name) is not None]


def _flat_inputs(q, k, v):
    """q, k, v broadcast to one batch shape and flattened to (B, S, D)."""
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    return batch, [np.array(np.broadcast_to(x, batch + x.shape[-2:]), copy=True)
                   .reshape((-1,) + x.shape[-2:]) for x in (q, k, v)]


def _peer_torch(device: Device, q, k, v, causal, scale, dtype) -> np.ndarray:
    """torch.nn.functional.scaled_dot_product_attention on the device (GPU when the audit runs
    there and PyTorch sees CUDA), the causal mask given explicitly (bottom-right aligned)."""
    import torch
    import torch.nn.functional as F

    dev = "cuda" if device.name == "gpu" and torch.cuda.is_available() else "cpu"
    tdt = getattr(torch, dtype)
    batch, (qf, kf, vf) = _flat_inputs(q, k, v)
    tq, tk, tv = (torch.from_numpy(x).to(device=dev, dtype=tdt) for x in (qf, kf, vf))
    mask = None
    if causal:
        mask = torch.from_numpy(reference._causal_mask(q.shape[-2], k.shape[-2])).to(dev)
    with torch.no_grad():
        o = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask, scale=scale)
    return o.to(torch.float64).cpu().numpy().reshape(batch + (q.shape[-2], v.shape[-1]))


def _peer_jax(device: Device, q, k, v, causal, scale, dtype) -> np.ndarray:
    """jax.nn.dot_product_attention on JAX's default device (heads as (B, T, N=1, H)), its
    matmuls at ``precision="highest"``: JAX's default float32 precision on a GPU is one TF32 pass
    (error ~1e-3 at D = 64), which would compare a TF32 peer with cuflash's float32 path."""
    import os

    # JAX would otherwise take 75% of the GPU's memory at its first use, leaving cuflash's own
    # calls short of it.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax
    import jax.numpy as jnp

    if q.shape[-1] != v.shape[-1]:
        raise ValueError("jax.nn.dot_product_attention needs D == Dv")
    if dtype == "float64" and not jax.config.jax_enable_x64:
        raise ValueError("float64 needs jax_enable_x64")
    batch, (qf, kf, vf) = _flat_inputs(q, k, v)
    jq, jk, jv = (jnp.asarray(x[:, :, None, :], dtype=dtype) for x in (qf, kf, vf))
    mask = None
    if causal:
        mask = jnp.asarray(reference._causal_mask(q.shape[-2], k.shape[-2]))[None, None]
    with jax.default_matmul_precision("highest"):
        o = jax.nn.dot_product_attention(jq, jk, jv, mask=mask, scale=scale)
    return np.asarray(o, dtype=np.float64)[:, :, 0, :].reshape(batch + (q.shape[-2], v.shape[-1]))


#: name -> function(device, q, k, v, causal, scale, dtype) returning the output as float64.
PEERS: Dict[str, Callable] = {"torch": _peer_torch, "jax": _peer_jax}


def peer_errors(device: Device, peers: Sequence[str], q, k, v, causal, scale, dtype,
                o_ref) -> Dict[str, float]:
    """Max abs error of each peer against ``o_ref`` over the rows that see at least one key
    (peers disagree on rows that see none: NaN or 0) and where the reference is finite; NaN for
    a peer that cannot run these inputs."""
    out = {}
    sees = np.ones(o_ref.shape[:-1], dtype=bool)
    if causal:
        sees = np.broadcast_to(np.arange(q.shape[-2]) + (k.shape[-2] - q.shape[-2]) >= 0,
                               o_ref.shape[:-1])
    keep = sees[..., None] & np.isfinite(o_ref)
    for name in peers:
        try:
            o = PEERS[name](device, q, k, v, causal, scale, dtype)
            with np.errstate(invalid="ignore"):
                diff = np.where(keep, np.abs(o - o_ref), 0.0)
            out[name] = float(np.max(np.where(np.isnan(diff), math.inf, diff))) if diff.size \
                else 0.0
        except Exception:  # not installed right, no such dtype or device: not the audit's failure
            out[name] = math.nan
    return out


def attach_peers(res: CaseResult, errs: Dict[str, float]) -> None:
    """Record the peers' errors in ``res`` and cuflash's ratio to the best of them."""
    res.peer_err = dict(errs)
    ok = {n: e for n, e in errs.items() if not math.isnan(e)}
    if ok:
        res.peer_best = min(ok, key=ok.get)
        best = ok[res.peer_best]
        res.ratio_to_peer = (res.max_abs_err / best if best > 0
                             else (0.0 if res.max_abs_err == 0 else math.inf))


class Reference:
    """The float64 reference and the naive error for one set of rounded inputs, computed once
    (per float32 precision mode) and shared by every kernel audited on them."""

    def __init__(self, q, k, v, causal, scale, dtype):
        self._args = (q, k, v, causal, scale, dtype)
        self._ref = None
        self._naive = {}

    def get(self, precision: Optional[str] = None):
        """(o_ref, lse_ref, the pass rule of the float32 mode `precision` or the dtype's own)."""
        q, k, v, causal, scale, dtype = self._args
        if self._ref is None:
            self._ref = reference.attention_ref(q, k, v, causal=causal, scale=scale)
        if precision not in self._naive:
            self._naive[precision] = case_rule(q, k, v, causal, scale, dtype, self._ref[0],
                                               precision)
        return self._ref + (self._naive[precision],)


def _describe_exc(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".replace("\n", " ")


def run_inputs(device: Device, inp: Inputs, dtypes: Sequence[str],
               raise_call_errors: bool = False, peers: Sequence[str] = ()) -> List[CaseResult]:
    """Audit ``inp`` in every dtype and through every kernel the dispatcher may pick.

    With ``raise_call_errors`` a ValueError/TypeError from cuflash's argument checks propagates
    (used for user files: the message is the diagnosis); otherwise it is recorded as a FAIL.
    ``peers``: names from :data:`PEERS` whose SDPA errors on the same inputs are recorded.
    """
    results = []
    try:
        o_shape = np.broadcast_shapes(inp.q.shape[:-2], inp.k.shape[:-2], inp.v.shape[:-2]) \
            + (inp.q.shape[-2], inp.v.shape[-1])
    except (ValueError, IndexError):
        o_shape = None  # malformed: cuflash.attention's checks will say what is wrong
    for dtype in dtypes:
        npdt = numpy_dtype(dtype)
        if inp.exact == dtype:
            rq, rk, rv = inp.q, inp.k, inp.v
        else:
            rq, rk, rv = (reference.round_to(x, dtype) for x in (inp.q, inp.k, inp.v))
        ref = Reference(rq, rk, rv, inp.causal, inp.scale, dtype)
        peer_errs = None
        dq, dk, dv = (device.to_device(x.astype(npdt)) for x in (rq, rk, rv))
        try:
            kernels = device.kernels(dq, dk, dv, inp.causal)
        except (ValueError, TypeError) as exc:
            if raise_call_errors:
                raise
            kernels = [("auto", f"dispatch_info raised {_describe_exc(exc)}")]
        for kernel_arg, kernel_name in kernels:
            t0 = time.perf_counter()
            res = CaseResult(dtype=dtype, kernel_arg=kernel_arg, kernel=kernel_name,
                             shape=inp.label, causal=bool(inp.causal), seed=inp.seed,
                             scale=inp.scale)
            # Output buffers pre-filled with NaN: anything the kernel does not write shows.
            out = None if o_shape is None else (
                device.to_device(np.full(o_shape, np.nan, npdt)),
                device.to_device(np.full(o_shape[:-1], np.nan, np.float32)))
            kwargs = dict(causal=inp.causal, scale=inp.scale, return_lse=True, out=out,
                          **call_kwargs(kernel_arg))
            try:
                o, lse = attention(dq, dk, dv, **kwargs)
                o_host, lse_host = device.to_host(o), device.to_host(lse)
            except (ValueError, TypeError) as exc:
                if raise_call_errors:
                    raise
                res.reasons.append(f"attention raised {_describe_exc(exc)}")
                results.append(res)
                continue
            except Exception as exc:  # a launch or compile failure is a failed case
                res.reasons.append(f"attention raised {_describe_exc(exc)}")
                results.append(res)
                continue
            _, lse_ref, rule = ref.get(spec_precision(kernel_arg))
            score_output(res, o_host, lse_host, lse_ref, rule,
                         lse_extra=_lse_extra(kernel_arg, rq, rk, inp.scale))
            if peers:
                if peer_errs is None:
                    peer_errs = peer_errors(device, peers, rq, rk, rv, inp.causal, inp.scale,
                                            dtype, rule.o_ref)
                attach_peers(res, peer_errs)
            if out is not None and not (device.same_buffer(o, out[0])
                                        and device.same_buffer(lse, out[1])):
                res.reasons.append("the returned (o, lse) are not the out= buffers")
                res.passed = False
            res.seconds = time.perf_counter() - t0
            results.append(res)
    return results


# ----------------------------------------------------------------------------------------------
# property audits
# ----------------------------------------------------------------------------------------------

@dataclass
class PropertyResult:
    name: str
    where: str
    measured: float
    limit: float
    passed: bool
    detail: str = ""


def _prop_chunk_order(rng) -> PropertyResult:
    """Random chunkings and chunk orders of the recurrence against SciPy's softmax (float64)."""
    worst = 0.0
    trials = 0
    for n in (1, 2, 7, 64, 301, 1000):
        s = 3.0 * rng.standard_normal((4, n))
        v = rng.standard_normal((n, 5))
        want = _scipy_softmax(s, axis=-1) @ v
        specs = [n, 1]
        for _ in range(4):
            cuts = np.sort(rng.choice(np.arange(1, n), size=min(n - 1, rng.integers(0, 12)),
                                      replace=False)) if n > 1 else np.array([], dtype=int)
            sizes = [int(x) for x in np.diff(np.concatenate([[0], cuts, [n]]).astype(int))]
            specs.append(sizes)
        perm = rng.permutation(n)  # non-contiguous chunks: every third key of a shuffle
        specs.append([perm[i::3] for i in range(3)] if n >= 3 else [n])
        for spec in specs:
            n_chunks = -(-n // spec) if isinstance(spec, int) else len(spec)
            for order in (None, rng.permutation(n_chunks), list(range(n_chunks))[::-1]):
                o, _ = reference.online_softmax(s, v, spec, order)
                worst = max(worst, float(np.max(np.abs(o - want))))
                trials += 1
    # The worked example of docs/online-softmax.md: s = [1, 2, 3, 10], v = 1, tiles [1,2],[3,10].
    o, lse = reference.online_softmax(np.array([1.0, 2, 3, 10]), np.ones((4, 1)), [2, 2])
    worst = max(worst, abs(float(o[0]) - 1.0))
    ok = worst < EXACT_TOL
    return PropertyResult("chunk-order invariance", "reference, float64", worst, EXACT_TOL, ok,
                          f"{trials} random chunkings/orders vs scipy softmax @ v")


def _parts(rng, sizes, n_rows=6, dv=4):
    """Normalised partial results (o, lse) of attention rows over disjoint key sets, plus the
    full result over their union, all float64 from SciPy."""
    n = sum(sizes)
    s = 4.0 * rng.standard_normal((n_rows, n))
    v = rng.standard_normal((n, dv))
    parts = []
    start = 0
    for m in sizes:
        sl = s[:, start:start + m]
        parts.append((_scipy_softmax(sl, axis=-1) @ v[start:start + m], _lse(sl)))
        start += m
    return parts, (_scipy_softmax(s, axis=-1) @ v, _lse(s))


def _lse(s):
    from scipy.special import logsumexp
    return logsumexp(s, axis=-1)


def _pair_err(x, y) -> float:
    (oa, la), (ob, lb) = x, y
    e_o = float(np.max(np.abs(oa - ob)))
    fin = np.isfinite(la) | np.isfinite(lb)
    e_l = float(np.max(np.abs(la[fin] - lb[fin]))) if fin.any() else 0.0
    same_inf = np.array_equal(la[~fin], lb[~fin])
    return max(e_o, e_l) if same_inf else math.inf


def _prop_merge(rng) -> List[PropertyResult]:
    mg = reference.merge_normalized
    worst_assoc = worst_comm = worst_id = 0.0
    for _ in range(5):
        (a, b, c), full = _parts(rng, [int(x) for x in rng.integers(1, 60, size=3)])
        left = mg(*mg(*a, *b), *c)
        right = mg(*a, *mg(*b, *c))
        worst_assoc = max(worst_assoc, _pair_err(left, right), _pair_err(left, full))
        worst_comm = max(worst_comm, _pair_err(mg(*a, *b), mg(*b, *a)),
                         _pair_err(mg(*mg(*c, *a), *b), full))
        empty = (np.zeros_like(a[0]), np.full_like(a[1], -np.inf))
        worst_id = max(worst_id, _pair_err(mg(*a, *empty), a), _pair_err(mg(*empty, *a), a))
        both = mg(*empty, *empty)
        if not (np.all(both[0] == 0) and np.all(both[1] == -np.inf)):
            worst_id = math.inf
    w = "reference, float64"
    return [
        PropertyResult("merge associativity", w, worst_assoc, EXACT_TOL, worst_assoc < EXACT_TOL,
                       "(a+b)+c vs a+(b+c) vs all keys at once, 5 random splits"),
        PropertyResult("merge commutativity", w, worst_comm, EXACT_TOL, worst_comm < EXACT_TOL,
                       "a+b vs b+a, (c+a)+b vs all keys"),
        PropertyResult("merge identity (-inf, 0)", w, worst_id, EXACT_TOL, worst_id < EXACT_TOL,
                       "a+empty = empty+a = a, empty+empty = (0, -inf), no NaN"),
    ]


def _prop_alpha_underflow_ref(rng) -> PropertyResult:
    """The running max jumps by 1000 between chunks: alpha = exp(-1000) is 0 in float64."""
    low = rng.standard_normal(300)
    high = 1000.0 + rng.standard_normal(50)
    s = np.concatenate([low, high])
    v = rng.standard_normal((s.size, 3))
    want = _scipy_softmax(s) @ v
    o, lse = reference.online_softmax(s, v, [300, 50])
    err = float(np.max(np.abs(o - want)))
    err = max(err, abs(float(lse) - float(_lse(s))) / abs(float(_lse(s))))
    ok = bool(np.all(np.isfinite(o))) and err < EXACT_TOL
    return PropertyResult("alpha underflow (max jumps by 1000)", "reference, float64", err,
                          EXACT_TOL, ok, "exp(m_old - m_new) = 0 exactly; result still exact")


def _device_attention_check(device: Device, dtype: str, q64, k64, v64, *, scale, kernel_arg,
                            extra_ok=True) -> Tuple[float, float, bool, str]:
    """Run attention on the device on q, k, v (float64 values representable in dtype) and judge
    it with the per-case rule. Returns (max abs err, threshold, passed, detail)."""
    npdt = numpy_dtype(dtype)
    res = CaseResult(dtype=dtype, kernel_arg=kernel_arg, kernel="", shape="", causal=False)
    try:
        o, lse = attention(*(device.to_device(x.astype(npdt)) for x in (q64, k64, v64)),
                           scale=scale, return_lse=True, **call_kwargs(kernel_arg))
        o, lse = device.to_host(o), device.to_host(lse)
    except Exception as exc:
        return math.nan, math.nan, False, f"attention raised {_describe_exc(exc)}"
    o_ref, lse_ref = reference.attention_ref(q64, k64, v64, scale=scale)
    score_output(res, o, lse, lse_ref,
                 case_rule(q64, k64, v64, False, scale, dtype, o_ref, spec_precision(kernel_arg)),
                 lse_extra=_lse_extra(kernel_arg, q64, k64, scale))
    return res.max_abs_err, res.threshold, res.passed and extra_ok, "; ".join(res.reasons)


def _device_kernels(device: Device, dtype: str, q, k, v) -> List[Tuple[str, str]]:
    npdt = numpy_dtype(dtype)
    try:
        return device.kernels(*(device.to_device(x.astype(npdt)) for x in (q, k, v)), False)
    except Exception:
        return [("auto", "auto")]


def _prop_fp16_overflow(device: Device, rng) -> List[PropertyResult]:
    """Scores around 12: exp overflows float16 (max 65504 < e^11.1) without the max shift."""
    d, n = 64, 96
    q = np.ones((1, 1, 4, d))
    k = reference.round_to(1.5 + 0.5 * rng.standard_normal((1, 1, n, d)), "float16")
    v = reference.round_to(rng.standard_normal((1, 1, n, 32)), "float16")
    scale = 1.0 / math.sqrt(d)
    s = scale * (q @ np.swapaxes(k, -1, -2))
    unstable = reference.unstable_softmax(s, np.float16)
    n_bad = int(np.count_nonzero(~np.isfinite(unstable)))
    overflowed = n_bad > 0
    # The recurrence on the same scores rounded to float16 (state in float32, as in a kernel).
    s16 = reference.round_to(s, "float16")
    rec, _ = reference.online_softmax(s16.astype(np.float16), v[0, 0], 32)
    rec_err = float(np.max(np.abs(rec - _scipy_softmax(s16, axis=-1) @ v[0, 0])))
    rec_ok = bool(np.all(np.isfinite(rec))) and rec_err < 1e-5
    out = []
    for kernel_arg, kname in _device_kernels(device, "float16", q, k, v):
        err, thr, ok, why = _device_attention_check(device, "float16", q, k, v, scale=scale,
                                                    kernel_arg=kernel_arg)
        ok = ok and overflowed and rec_ok
        detail = (f"s in [{s.min():.1f}, {s.max():.1f}]: unstable fp16 softmax has {n_bad}/"
                  f"{unstable.size} NaN/inf; recurrence with fp16 scores err {rec_err:.1e}")
        if why:
            detail += "; " + why
        out.append(PropertyResult("fp16 overflow of exp(s)/sum(exp(s))",
                                  f"{device.name}, float16, {short_kernel(kname)}",
                                  err, thr, ok, detail))
    return out


def _prop_alpha_underflow_device(device: Device, dtypes, rng) -> List[PropertyResult]:
    """Keys 0..511 score ~0, keys 512..639 score ~150: a kernel walking the keys in order sees its
    running max jump by ~150, so alpha = exp(-150) underflows to 0 in the float32 state."""
    d, n_low, n_high = 64, 512, 128
    scale = 1.0 / math.sqrt(d)
    sc = np.concatenate([rng.standard_normal(n_low), 150.0 + rng.standard_normal(n_high)])
    q = np.ones((1, 2, 3, d))
    # Every component of k_j equals s_j / (scale * d) up to a small perturbation.
    k = (sc / (scale * d))[None, None, :, None] + 0.01 * rng.standard_normal((1, 2, sc.size, d))
    v = rng.standard_normal((1, 2, sc.size, d))  # D == Dv, so tensor-core kernels qualify
    out = []
    for dtype in dtypes:
        rq, rk, rv = (reference.round_to(x, dtype) for x in (q, k, v))
        for kernel_arg, kname in _device_kernels(device, dtype, rq, rk, rv):
            err, thr, ok, why = _device_attention_check(device, dtype, rq, rk, rv, scale=scale,
                                                        kernel_arg=kernel_arg)
            out.append(PropertyResult("alpha underflow (max jumps by ~150)",
                                      f"{device.name}, {dtype}, {short_kernel(kname)}",
                                      err, thr, ok, why or "scores ~0 for 512 keys, then ~150"))
    return out


def _prop_merge_device(device: Device, dtypes, rng) -> List[PropertyResult]:
    """merge_states of attention over two halves of the keys vs the float64 reference over all.

    The threshold is the per-case one plus ``8 * 2^-24 * max(1, max|lse_ref|) * max|o_ref|``:
    the halves' lse are float32 whatever the dtype, so each merge weight exp(lse_half - lse)
    carries a relative error of a few float32 roundoffs of |lse|. That term is negligible
    next to the 16-bit tolerances and dominates the float64 one.
    """
    shape_q, sk, d, dv = (2, 3, 37), 300, 64, 64
    q0 = 2.0 * rng.standard_normal(shape_q + (d,))
    k0 = rng.standard_normal(shape_q[:2] + (sk, d))
    v0 = rng.standard_normal(shape_q[:2] + (sk, dv))
    cut = int(rng.integers(1, sk))
    scale = 1.0 / math.sqrt(d)  # the halves must use the full problem's scale
    out = []
    for dtype in dtypes:
        npdt = numpy_dtype(dtype)
        q, k, v = (reference.round_to(x, dtype) for x in (q0, k0, v0))
        o_ref, lse_ref = reference.attention_ref(q, k, v, scale=scale)
        lse_term = (8.0 * reference.unit_roundoff("float32") * max(1.0, _max(np.abs(lse_ref)))
                    * _max(np.abs(o_ref)))
        for kernel_arg, kname in _device_kernels(device, dtype, q, k, v):
            where = f"{device.name}, {dtype}, {short_kernel(kname)}"
            res = CaseResult(dtype=dtype, kernel_arg=kernel_arg, kernel=kname, shape="",
                             causal=False)
            kw = call_kwargs(kernel_arg)
            try:
                dq = device.to_device(q.astype(npdt))
                halves = []
                for sl in (slice(0, cut), slice(cut, sk)):
                    halves.extend(attention(dq, device.to_device(k[..., sl, :].astype(npdt)),
                                            device.to_device(v[..., sl, :].astype(npdt)),
                                            scale=scale, return_lse=True, **kw))
                o, lse = merge_states(*halves)
                o, lse = device.to_host(o), device.to_host(lse)
            except Exception as exc:
                out.append(PropertyResult("merge_states of two key halves", where, math.nan,
                                          math.nan, False, f"raised {_describe_exc(exc)}"))
                continue
            rule = case_rule(q, k, v, False, scale, dtype, o_ref, spec_precision(kernel_arg))
            score_output(res, o, lse, lse_ref, rule, extra_tol=lse_term,
                         lse_extra=_lse_extra(kernel_arg, q, k, scale))
            out.append(PropertyResult(
                "merge_states of two key halves", where, res.max_abs_err, res.threshold,
                res.passed, "; ".join(res.reasons) or f"keys split at {cut} of {sk}, vs all keys"))
    return out


def property_audits(device: Device, dtypes: Sequence[str], seed: int) -> List[PropertyResult]:
    rng = np.random.default_rng([seed, 999_999])
    results = [_prop_chunk_order(rng)]
    results += _prop_merge(rng)
    results.append(_prop_alpha_underflow_ref(rng))
    results += _prop_fp16_overflow(device, rng)
    results += _prop_alpha_underflow_device(device, dtypes, rng)
    results += _prop_merge_device(device, dtypes, rng)
    from ._audit_inference import inference_audits  # GQA, KV cache, varlen (issue 14)

    results += inference_audits(device, dtypes, rng)
    from ._audit_variants import variant_audits   # window, softcap, alibi, bias, mask
    results += variant_audits(device, dtypes, rng, PropertyResult, numpy_dtype)
    return results


# ----------------------------------------------------------------------------------------------
# user files
# ----------------------------------------------------------------------------------------------

#: The optional arrays of a FILE (.npz): the scalars causal and scale, and the upstream
#: gradient do (read by `cuflash._audit_grad.inputs_from_npz`). Any other name is refused.
NPZ_OPTIONAL = ("causal", "scale", "do")


def load_npz(path: str, dtypes_requested: Sequence[str]) -> Tuple[Inputs, List[str]]:
    """Read q, k, v (and the optional scalars causal, scale) from an .npz file.

    An array of any other name than q, k, v and :data:`NPZ_OPTIONAL` is an AuditError.

    Returns the inputs and the dtypes to audit: the file's dtype, or ``dtypes_requested`` (the
    values are then rounded to each).  Arrays the audit cannot take apart (no common supported
    dtype, fewer than 2 axes) come back with ``exact="raw"`` for :func:`preflight`.
    """
    import zipfile

    try:
        with open(path, "rb") as fh:
            magic = fh.read(6)
    except FileNotFoundError:
        raise AuditError(f"{path}: no such file") from None
    except OSError as exc:
        raise AuditError(f"{path}: cannot read it ({_describe_exc(exc)})") from None
    if magic != b"\x93NUMPY" and not zipfile.is_zipfile(path):
        # np.load would try pickle on anything else; a data file is never unpickled here.
        raise AuditError(f"{path}: not a NumPy archive (an .npz is a zip file of .npy arrays; "
                         "write one with numpy.savez(path, q=q, k=k, v=v))")
    try:
        f = np.load(path, allow_pickle=False)
    except Exception as exc:
        raise AuditError(f"{path}: cannot read it as an .npz archive ({_describe_exc(exc)})") \
            from None
    if not hasattr(f, "files"):
        raise AuditError(f"{path}: this is a single .npy array, not an .npz archive with "
                         "arrays q, k, v (write one with numpy.savez(path, q=q, k=k, v=v))")
    with f:
        missing = [n for n in ("q", "k", "v") if n not in f.files]
        if missing:
            raise AuditError(
                f"{path}: missing array{'s' if len(missing) > 1 else ''} "
                f"{', '.join(repr(m) for m in missing)}; the file has "
                f"{', '.join(repr(n) for n in f.files) or 'no arrays'} "
                f"(expected q, k, v and optionally {', '.join(NPZ_OPTIONAL)})")
        unknown = [n for n in f.files if n not in ("q", "k", "v") + NPZ_OPTIONAL]
        if unknown:
            # A misspelt name ("is_causal", "dO") would otherwise be dropped and another
            # problem than the one meant audited (non-causal, or without its gradients).
            raise AuditError(
                f"{path}: unexpected array{'s' if len(unknown) > 1 else ''} "
                f"{', '.join(repr(n) for n in unknown)}; the file may hold only q, k, v and "
                f"optionally {', '.join(NPZ_OPTIONAL)}")
        q, k, v = (f[n] for n in ("q", "k", "v"))
        causal, scale = False, None
        if "causal" in f.files:
            c = f["causal"]
            if c.shape != () or c.dtype != np.bool_:
                raise AuditError(f"{path}: 'causal' must be a boolean scalar, got dtype "
                                 f"{c.dtype} and shape {c.shape}")
            causal = bool(c)
        if "scale" in f.files:
            sc = f["scale"]
            if sc.shape != () or sc.dtype.kind not in "fiu":
                raise AuditError(f"{path}: 'scale' must be a real scalar, got dtype {sc.dtype} "
                                 f"and shape {sc.shape}")
            scale = float(sc)
    names = [x.dtype.name for x in (q, k, v)]
    raw = Inputs(q, k, v, causal, scale, "", exact="raw")
    if dtypes_requested:
        dtypes, exact = list(dtypes_requested), None
    elif len(set(names)) != 1 or names[0] not in ALL_DTYPES:
        return raw, [names[0]]
    else:
        dtypes, exact = [names[0]], names[0]
    if any(x.ndim < 2 for x in (q, k, v)):
        return raw, dtypes
    try:
        q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    except (TypeError, ValueError) as exc:
        raise AuditError(f"{path}: cannot convert q, k, v to float64 ({exc})") from None
    try:
        batch = tuple(int(b) for b in np.broadcast_shapes(q.shape[:-2], k.shape[:-2],
                                                          v.shape[:-2]))
    except ValueError:
        batch = ()
    dims = batch + (q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1])
    label = "(" + ",".join(str(x) for x in dims) + ")"
    return Inputs(q, k, v, causal, scale, label, exact=exact), dtypes


def nonfinite_note(inp: Inputs) -> str:
    """A sentence about NaN/inf in the inputs ("" when there are none): the audit then compares
    the positions of non-finite outputs with the reference instead of their values."""
    parts = []
    for name in ("q", "k", "v"):
        x = np.asarray(getattr(inp, name))
        if x.dtype.kind != "f" and x.dtype.name != "bfloat16":
            continue
        xf = x.astype(np.float64)
        n_nan, n_inf = int(np.isnan(xf).sum()), int(np.isinf(xf).sum())
        if n_nan or n_inf:
            parts.append(f"{name} holds " + " and ".join(
                t for t in (f"{n_nan} NaN" if n_nan else "", f"{n_inf} inf" if n_inf else "") if t))
    if not parts:
        return ""
    return ("inputs: " + "; ".join(parts) + ". NaN/inf outputs are compared by position with "
            "the float64 reference (NaN where it is NaN, non-finite where it is inf), the other "
            "elements by value.")


def preflight(inp: Inputs, path: str):
    """Let cuflash's own argument checks judge arrays the audit cannot take apart (the NumPy path
    validates exactly like the GPU path), and raise AuditError with its message."""
    try:
        attention(np.asarray(inp.q), np.asarray(inp.k), np.asarray(inp.v),
                  causal=inp.causal, scale=inp.scale)
    except (ValueError, TypeError) as exc:
        raise AuditError(f"{path}: {exc}") from None
    raise AuditError(f"{path}: q, k, v cannot be audited (dtypes {inp.q.dtype}, {inp.k.dtype}, "
                     f"{inp.v.dtype}; shapes {inp.q.shape}, {inp.k.shape}, {inp.v.shape})")


# ----------------------------------------------------------------------------------------------
# formatting and JSON
# ----------------------------------------------------------------------------------------------

def _fmt(x: float) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "nan"
    if math.isinf(x):
        return "inf"
    return f"{x:.2e}"


def _fmt_frac(x: float) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "nan"
    if math.isinf(x):
        return "inf"
    return f"{x:.3f}" if x < 10 else f"{x:.3g}"


class CaseTable:
    """The case table with fixed column widths, so that rows can be printed as they arrive.
    With ``peers`` it has two more columns: the peer with the smallest error and cuflash's error
    divided by it."""

    COLUMNS = [("dtype", 8, False), ("kernel", 17, False), ("shape (B,H,Sq,Sk,D,Dv)", 22, False),
               ("causal", 6, False), ("max abs err", 11, True), ("rel err", 8, True),
               ("naive err", 9, True), ("threshold", 9, True), ("err/thr", 7, True),
               ("err/bound", 9, True), ("lse err", 8, True)]
    PEER_COLUMNS = [("best peer", 12, True), ("err/peer", 8, True)]

    def __init__(self, peers: bool = False):
        self.columns = self.COLUMNS + (self.PEER_COLUMNS if peers else []) + [("result", 6, False)]

    def _line(self, cells) -> str:
        return "  ".join(str(c).rjust(w) if right else str(c).ljust(w)
                         for c, (_, w, right) in zip(cells, self.columns)).rstrip()

    def header(self) -> str:
        return "\n".join([self._line([name for name, _, _ in self.columns]),
                          "  ".join("-" * w for _, w, _ in self.columns)])

    def row(self, r: CaseResult) -> str:
        cells = case_row(r)
        if len(self.columns) > len(self.COLUMNS) + 1:
            best = (f"{r.peer_best} {_fmt(r.peer_err[r.peer_best])}" if r.peer_best
                    else ("n/a" if r.peer_err else ""))
            cells = cells[:-1] + [best, _fmt_frac(r.ratio_to_peer) if r.peer_best else "",
                                  cells[-1]]
        return self._line(cells)


def format_cases(results: Sequence[CaseResult]) -> str:
    table = CaseTable(peers=any(r.peer_err for r in results))
    return "\n".join([table.header()] + [table.row(r) for r in results]) \
        + case_footnotes(results)


def case_row(r: CaseResult) -> List[str]:
    """The cells of one line of the case table (without the peer columns)."""
    mark = "*" if r.naive_kind == "bound" else ("!" if not r.naive_informative else " ")
    return [r.dtype, r.kernel_short, r.shape, "yes" if r.causal else "no", _fmt(r.max_abs_err),
            _fmt(r.rel_err), _fmt(r.naive_err) + mark, _fmt(r.threshold),
            _fmt_frac(r.frac_threshold), _fmt_frac(r.frac_bound), _fmt(r.lse_err),
            "PASS" if r.passed else "FAIL"]


def case_footnotes(results: Sequence[CaseResult]) -> str:
    notes = ""
    if any(r.naive_kind == "bound" for r in results):
        notes += ("\n* float64: the naive float64 implementation is the float64 reference "
                  "itself, so its\n  forward-error bound stands in for its (zero) measured "
                  "error; see --help.")
    if any(r.peer_err for r in results):
        notes += ("\nbest peer: the smallest max abs error of the SDPA of "
                  + ", ".join(sorted({n for r in results for n in r.peer_err}))
                  + " on the same inputs (rows that see a key); err/peer = cuflash's error / it.")
    if any(not r.naive_informative and r.naive_kind != "bound" for r in results):
        notes += (f"\n! the naive error exceeds {reference.NAIVE_INFORMATIVE_FRACTION:g} of "
                  "max|o_ref|: the 2x-naive comparison is uninformative\n  there, and the "
                  "a-priori bound (err/bound) is the bar that counts; see --help.")
    return notes


def format_properties(results: Sequence[PropertyResult]) -> str:
    head = ["property", "where", "measured", "limit", "result"]
    rows = [[p.name, p.where, _fmt(p.measured), _fmt(p.limit), "PASS" if p.passed else "FAIL"]
            for p in results]
    return _table(head, rows, right=(2, 3))


def format_failures(cases: Sequence[CaseResult], props: Sequence[PropertyResult]) -> str:
    lines = []
    for r in cases:
        if not r.passed:
            seed = f" seed {r.seed}" if r.seed else ""
            lines.append(f"FAIL {r.dtype} {r.kernel} {r.shape} causal={r.causal}{seed}: "
                         + "; ".join(r.reasons))
    for p in props:
        if not p.passed:
            lines.append(f"FAIL {p.name} [{p.where}]: {p.detail}")
    return "\n".join(lines)


def _table(head, rows, right=()) -> str:
    right = set(right)
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]

    def line(cells):
        return "  ".join(str(c).rjust(w) if i in right else str(c).ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(head), sep] + [line(r) for r in rows])


def _json_num(x):
    """A JSON-safe copy of x: non-finite floats as strings, through dicts, lists and tuples (the
    peers' errors are a dict per case), NumPy scalars as Python numbers."""
    if isinstance(x, (float, np.floating)):
        x = float(x)
        if math.isnan(x):
            return "NaN"
        if math.isinf(x):
            return "Infinity" if x > 0 else "-Infinity"
        return x
    if isinstance(x, dict):
        return {k: _json_num(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_num(v) for v in x]
    if isinstance(x, np.integer):
        return int(x)
    return x


def to_json(*, device: Device, reason: str, seed: Optional[int], mode: str,
            cases: Sequence[CaseResult], props: Sequence[PropertyResult], dtypes, file=None,
            seconds: float, quick: bool = False, peers: Sequence[str] = ()) -> Dict[str, Any]:
    """Everything the run found, as a JSON-serialisable dict (non-finite floats as strings).

    ``mode`` is "standard" or "file"; ``quick`` whether the standard audit ran its --quick
    subset (always False for a file); ``peers`` the peer libraries measured (empty with
    --no-peers or where none imports)."""
    def case(r: CaseResult):
        d = {k: _json_num(v) for k, v in r.__dict__.items()}
        d["result"] = "PASS" if r.passed else "FAIL"
        return d

    def prop(p: PropertyResult):
        d = {k: _json_num(v) for k, v in p.__dict__.items()}
        d["result"] = "PASS" if p.passed else "FAIL"
        return d

    n_pass = sum(r.passed for r in cases) + sum(p.passed for p in props)
    n_all = len(cases) + len(props)
    return {
        "tool": "cuflash-check",
        "mode": mode,
        "quick": bool(quick) and mode == "standard",
        "file": file,
        "peers": list(peers),
        "device": {"selected": device.name, "reason": reason, **device.info()},
        "versions": versions(),
        "seed": seed,
        "rng": "numpy.random.default_rng([seed, shape_index]) per grid shape; q ~ N(0, 4), "
               "k, v ~ N(0, 1), then reference.round_to(dtype)" if mode == "standard" else None,
        "dtypes": list(dtypes),
        "pass_rule": PASS_RULE,
        "lse_rtol": LSE_RTOL,
        "cases": [case(r) for r in cases],
        "properties": [prop(p) for p in props],
        "summary": {"passed": n_pass, "failed": n_all - n_pass, "cases": len(cases),
                    "properties": len(props)},
        "seconds": round(seconds, 3),
    }


def new_seed() -> int:
    return secrets.randbits(32)


Progress = Callable[[int], None]


def run_grid(device: Device, shapes: Sequence[Shape], dtypes: Sequence[str], seed: int,
             progress: Optional[Progress] = None,
             on_result: Optional[Callable[[CaseResult], None]] = None,
             peers: Sequence[str] = ()) -> List[CaseResult]:
    """Audit every grid shape; ``on_result`` sees each case as soon as it is judged,
    ``progress(1)`` is called after each shape."""
    results = []
    for index, shape in enumerate(shapes):
        inp = draw_inputs(shape, seed, index)
        batch = run_inputs(device, inp, dtypes, peers=peers)
        results.extend(batch)
        if on_result is not None:
            for r in batch:
                on_result(r)
        if progress is not None:
            progress(1)
    return results
