"""User hooks of the attention variants: `ScoreMod` and `MaskMod` (issue 15).

A hook is given twice, with the same meaning: as CUDA C, compiled by NVRTC into the generic
kernels' policy (kernels_cu/variants.cuh: ``UserVariant``), and as a vectorised NumPy callable,
which the CPU path and the float64 references (`cuflash.reference`) evaluate. They are one more
member of `cuflash.variants.Variant` and compose with the built-in parts.

Semantics (for batch entry ``(b, h)``, query row ``q_idx``, key ``kv_idx``):

- ``score_mod``: ``score' = f(score, b, h, q_idx, kv_idx, args)``, applied to the score the
  built-in parts produce (scaled score -> softcap -> + alibi -> + bias -> **score_mod**), before
  the softmax. A ``-inf`` result acts as a mask; a ``-inf`` *input* (a ``-inf`` bias entry)
  masks only if ``f`` keeps it ``-inf`` (``c tanh(score / c)`` maps it to ``-c``: use
  ``mask=`` or a mask_mod to hide keys under such a hook). NaN from ``f`` at a visible key
  makes the row NaN, as a NaN score does; at a hidden key it touches nothing.
- ``mask_mod``: key ``kv_idx`` is visible to row ``q_idx`` only if
  ``keep(b, h, q_idx, kv_idx, args)`` holds (and causal, window and mask allow it).
- ``h`` is the index along the last batch axis of the broadcast batch of q, k and v (the
  heads of ``(B, H, S, D)``: the query head where k and v broadcast a size-1 head axis),
  ``b`` the flat index over the batch axes before it (0 and 0 without batch axes).
  Grouped-query heads (q with more heads than k and v) are refused with hooks, as with every
  variant.
- ``q_idx`` (``0 .. Sq - 1``) and ``kv_idx`` (``0 .. Sk - 1``) are the row's and the key's own
  indices, not aligned: causal, window and ALiBi align bottom-right (``j <= i + Sk - Sq``),
  a hook sees ``i`` and ``j`` as they are and is not told ``Sq`` or ``Sk``. With ``Sq != Sk``
  a hook that means the bottom-right diagonal adds ``Sk - Sq`` itself (from ``args``, say).
- ``args``: the optional ``mod_args`` of the call, a 1-D float32 array (per-head constants, a
  bias table, document ids, ...), read as ``args[i]`` (the NumPy callables get a read-only
  view). A hook whose CUDA code names ``args`` needs a non-empty ``mod_args`` (ValueError
  otherwise, before anything runs); within it the code must stay inside its length (nothing
  checks that on the GPU; the NumPy callable raises IndexError outside it).

Backward: ``dscore / dscore_in = g(score_in, ...)``, the derivative of ``f`` in its first
argument, given by the user (``grad_cuda=``, ``grad_numpy=``; `ScoreMod.additive` for
``f = score + term``, whose derivative is 1). No derivative is derived from the code; a
backward with a score_mod that has none raises ValueError. Gradients with respect to ``args``
are not computed.

CUDA code: either an expression (``"score + args[h] * (kv_idx - q_idx)"``) or a function body
with ``return`` (``"Acc t = score / 30; return 30 * tanh(t);"``). Inside it ``score`` has the
accumulator type ``Acc`` (float, double for float64 inputs; use the overloaded math functions
``tanh``, ``exp``, ``fabs``, ``fmin``... so the code works in both), ``b``, ``h``, ``q_idx``,
``kv_idx`` are ``long long`` and ``args`` is ``const float*``. The code is placed in a function
of that fixed signature; the text is checked before it reaches NVRTC (balanced brackets, no
preprocessor, comments other than ``//``, literals, control characters, ``asm``, declarations
of types, templates, namespaces or kernels, pointer casts, barriers, warp-synchronous or atomic
primitives), and compile errors come back as `HookCompileError` (a ValueError) showing the
user's line and NVRTC's log. The NumPy callables' signatures are checked at construction
(where Python can read them). The code's hash names the specialisation
(``cuflash_user::Mod_<hash>`` in the kernel's name), so the kernel cache and a profiler see it:
kernels are keyed by the code, not by the object (two hooks with the same CUDA code share
them). A hook is immutable once constructed.

Example
-------
>>> import numpy as np
>>> from cuflash import ScoreMod, MaskMod
>>> cap = ScoreMod("30 * tanh(score / 30)",
...                numpy=lambda score, b, h, q, kv, args: 30 * np.tanh(score / 30),
...                grad_cuda="1 - tanh(score / 30) * tanh(score / 30)",
...                grad_numpy=lambda score, b, h, q, kv, args: 1 - np.tanh(score / 30) ** 2,
...                lipschitz=1.0)
>>> prefix = MaskMod("kv_idx <= q_idx || kv_idx < 16",
...                  numpy=lambda b, h, q, kv, args: (kv <= q) | (kv < 16))
>>> # cuflash.attention(q, k, v, score_mod=cap, mask_mod=prefix)
"""
from __future__ import annotations

import hashlib
import inspect
import math
import numbers
import re
import threading
from typing import Callable, Optional

import numpy as np

__all__ = ["ScoreMod", "MaskMod", "HookCompileError"]

_FORBIDDEN_CHARS = {"#": "preprocessor directives", "\\": "backslashes (line continuations)",
                    '"': "string literals", "'": "character literals"}
_FORBIDDEN_WORDS = ("asm", "__asm__", "__asm", "__global__", "__shared__", "__constant__",
                    "extern", "namespace", "template", "struct", "class", "union", "typedef",
                    "using", "goto", "const_cast", "reinterpret_cast", "operator", "new",
                    "delete", "static", "__syncthreads", "__syncwarp", "__threadfence")
_FORBIDDEN_PATTERNS = ((re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]"),
                        "control characters (NVRTC reads the source up to a NUL)"),
                       (re.compile(r"_sync\b|\b__sync\w*|\b__shfl|\b__ballot|\batomic"),
                        "barriers, warp-synchronous or atomic primitives (the hook runs in "
                        "divergent code)"),
                       (re.compile(r"\*\s*(?:(?:const|volatile|__restrict__)\b\s*)*\)"),
                        "pointer casts (args is read-only; a hook computes a value)"),
                       (re.compile(r"/\*|\*/"), "block comments (use //)"))
_WORD = re.compile(r"[A-Za-z_]\w*")
_RETURN = re.compile(r"\breturn\b")


def _code_only(text: str) -> str:
    """The text without its ``//`` comments (the only comments a hook may hold; no literals can
    contain ``//``)."""
    return "\n".join(line.split("//", 1)[0] for line in text.splitlines())


class HookCompileError(ValueError):
    """NVRTC rejected a hook's CUDA code; the message shows the user's lines and NVRTC's log."""


def _check_code(what: str, code) -> str:
    """The CUDA text of a hook, checked (TypeError / ValueError naming ``what``)."""
    if not isinstance(code, str):
        raise TypeError(f"{what} must be CUDA C code given as a string, got "
                        f"{type(code).__name__}")
    text = code.strip()
    if not text:
        raise ValueError(f"{what} is empty")
    for ch, why in _FORBIDDEN_CHARS.items():
        if ch in text:
            raise ValueError(f"{what}: {why} are not allowed in a hook ({ch!r} in {code!r})")
    for pat, why in _FORBIDDEN_PATTERNS:
        if pat.search(text):
            raise ValueError(f"{what}: {why} are not allowed in a hook ({code!r})")
    bad = sorted({w for w in _WORD.findall(text) if w in _FORBIDDEN_WORDS})
    if bad:
        raise ValueError(f"{what}: {', '.join(bad)} may not appear in a hook: the code is the "
                         f"body of one device function ({code!r})")
    # Brackets balanced and never closed below the function's own level (no escape from it).
    pairs = {")": "(", "]": "[", "}": "{"}
    stack = []
    for line_no, line in enumerate(text.splitlines(), 1):
        code_part = line.split("//", 1)[0]
        for ch in code_part:
            if ch in "([{":
                stack.append(ch)
            elif ch in pairs:
                if not stack or stack[-1] != pairs[ch]:
                    raise ValueError(f"{what}: unbalanced {ch!r} on line {line_no}: {line!r}")
                stack.pop()
    if stack:
        raise ValueError(f"{what}: unclosed {stack[-1]!r} in {code!r}")
    code_part = _code_only(text)
    if not _RETURN.search(code_part):   # an expression
        if ";" in code_part or "{" in code_part:
            raise ValueError(f"{what}: a function body needs a return statement; an expression "
                             f"has no ';' or braces ({code!r})")
        text = f"return ({text}\n);"   # the newline ends a trailing // comment
    return text


def _check_callable(what: str, fn, params: str):
    """A hook's NumPy callable: callable, and (where Python can tell) taking the positional
    arguments ``params`` (a comma-separated list), checked here rather than at the first tile."""
    if not callable(fn):
        raise TypeError(f"{what} must be a callable (the NumPy form of the hook), got "
                        f"{type(fn).__name__}")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):   # no signature to read (some builtins): the call tells
        return fn
    n = len(params.split(","))
    try:
        sig.bind(*range(n))
    except TypeError as exc:
        raise TypeError(f"{what} must take the {n} positional arguments ({params}); its "
                        f"signature is {sig} ({exc})") from None
    return fn


_SCORE_PARAMS = "score, b, h, q_idx, kv_idx, args"
_MASK_PARAMS = "b, h, q_idx, kv_idx, args"


def _body(label: str, text: str) -> str:
    # The #line directive makes NVRTC report the user's own line numbers under the hook's name.
    return f'#line 1 "{label}"\n{text}\n'


class _Hook:
    """What ScoreMod and MaskMod share. A hook is immutable once constructed: its code was
    checked there, and the compile check and the kernels are keyed by that code (by value: two
    hooks with the same CUDA code share their kernels; the object's identity plays no part)."""

    kind = ""

    def __setattr__(self, name, value):
        if getattr(self, "_frozen", False):
            raise AttributeError(f"{type(self).__name__} is immutable (its code was checked when "
                                 f"it was constructed): construct a new one instead of setting "
                                 f"{name!r}")
        object.__setattr__(self, name, value)

    def __delattr__(self, name):
        raise AttributeError(f"{type(self).__name__} is immutable")

    def _freeze(self):
        # (the code is fixed from here on, so what it reads is decided once, not per call)
        words = set()
        for t in self._texts()[1:]:
            words.update(_WORD.findall(_code_only(t)))
        object.__setattr__(self, "_reads_args", "args" in words)
        object.__setattr__(self, "_batch_names", frozenset(words & {"b", "h"}))
        object.__setattr__(self, "_frozen", True)

    @property
    def batch_names(self) -> frozenset:
        """Which of the batch indices ``b`` and ``h`` the CUDA code names. A hook whose code
        names neither has the same value for every batch entry (the code can reach them only
        through those names: no macros, globals or types may be declared in it), so its block
        summary (`cuflash._mask_blocks.hook_summary`) is one for the whole batch. Conservative:
        a local variable called ``b`` counts as naming it."""
        return self._batch_names

    @property
    def reads_args(self) -> bool:
        """Whether the CUDA code (any of its texts) names ``args``: the call must then give a
        non-empty ``mod_args`` (the kernels would read through a null pointer)."""
        return self._reads_args

    def _numpy_result(self, what, res, shape, float_dtype=None):
        """Check a NumPy callable's result: broadcastable to ``shape``; floating of at least
        ``float_dtype``'s precision (score hooks) or bool (mask hooks)."""
        res = np.asarray(res)
        try:
            ok = np.broadcast_shapes(res.shape, shape) == tuple(shape)
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"{what} returned shape {res.shape}, which does not broadcast to the "
                             f"score tile's {tuple(shape)}")
        if float_dtype is None:
            if res.dtype != np.bool_:
                raise TypeError(f"{what} returned dtype {res.dtype}; expected bool (True = keep)")
            return np.broadcast_to(res, shape)
        if res.dtype.kind not in "fiu" or (res.dtype.kind == "f"
                                           and res.dtype.itemsize < np.dtype(float_dtype).itemsize):
            raise TypeError(f"{what} returned dtype {res.dtype} for {np.dtype(float_dtype)} "
                            "scores; it must compute in the scores' dtype (or wider)")
        return np.broadcast_to(res.astype(float_dtype, copy=False), shape)

    @property
    def digest(self) -> str:
        return hashlib.sha256("\0".join(self._texts()).encode()).hexdigest()[:16]


class ScoreMod(_Hook):
    """A user score modification ``score' = f(score, b, h, q_idx, kv_idx, args)``.

    Parameters
    ----------
    cuda : str
        CUDA C: an expression or a function body with ``return`` (see :mod:`cuflash.mods`).
    numpy : callable
        ``numpy(score, b, h, q_idx, kv_idx, args) -> array``, vectorised: ``score`` has shape
        ``(n, rows, cols)`` (or ``batch + (rows, cols)``) in the working dtype (float32 on the
        CPU path for 16/32-bit inputs, float64 in the references), ``b`` and ``h`` int64 of
        shape ``(n, 1, 1)`` (or ``batch + (1, 1)``), ``q_idx`` int64 ``(rows, 1)``, ``kv_idx``
        int64 ``(1, cols)``, ``args`` the float32 ``mod_args`` array (or an empty one). It must
        return an array broadcastable to ``score``'s shape in ``score``'s dtype (or wider).
    grad_cuda, grad_numpy : str, callable, optional
        ``d f / d score`` at the same arguments (``score`` = f's input), for the backward; both
        or neither. Without them the backward raises ValueError.
    lipschitz : float, optional
        A bound ``L >= |d f / d score|`` over the scores that occur. The a-priori error bound of
        `cuflash.reference.error_bound` needs it (the score's error reaches the exponent times
        at most ``L``); without it only the measured 2x-naive rule judges (and float64, which
        has no measured rule, raises). Wrongly declared, the bound is wrong: declare only what
        holds.
    """

    kind = "score_mod"

    def __init__(self, cuda: str, numpy: Callable, *, grad_cuda: Optional[str] = None,
                 grad_numpy: Optional[Callable] = None, lipschitz: Optional[float] = None):
        self.cuda = _check_code("score_mod", cuda)
        self.numpy = _check_callable("score_mod's numpy", numpy, _SCORE_PARAMS)
        if (grad_cuda is None) != (grad_numpy is None):
            raise ValueError("score_mod: give both grad_cuda= and grad_numpy= (the derivative "
                             "d score_mod / d score in CUDA C and NumPy), or neither")
        self.grad_cuda = None if grad_cuda is None else _check_code("score_mod grad_cuda",
                                                                   grad_cuda)
        self.grad_numpy = None if grad_numpy is None else _check_callable(
            "score_mod's grad_numpy", grad_numpy, _SCORE_PARAMS)
        if lipschitz is not None:
            if isinstance(lipschitz, bool) or not isinstance(lipschitz, numbers.Real) or not (
                    math.isfinite(lipschitz) and lipschitz >= 0):
                raise ValueError(f"score_mod: lipschitz must be a finite number >= 0, got "
                                 f"{lipschitz!r}")
            lipschitz = float(lipschitz)
        self.lipschitz = lipschitz
        self._freeze()

    @classmethod
    def additive(cls, cuda: str, numpy: Callable) -> "ScoreMod":
        """``f = score + term(b, h, q_idx, kv_idx, args)``: give the whole expression (with
        ``score``); its derivative is 1 (declared, not derived: the code must be additive) and
        its Lipschitz constant 1."""
        return cls(cuda, numpy, grad_cuda="1", grad_numpy=lambda score, *rest: 1.0,
                   lipschitz=1.0)

    @property
    def has_grad(self) -> bool:
        return self.grad_cuda is not None

    def _texts(self):
        return ("score_mod", self.cuda, self.grad_cuda or "")

    def __repr__(self):
        return f"ScoreMod({self.cuda!r}, grad={self.grad_cuda!r}, lipschitz={self.lipschitz})"

    def evaluate(self, score, b, h, q_idx, kv_idx, args):
        """The NumPy form on a tile, checked; an array of ``score``'s shape and dtype."""
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            res = self.numpy(_read_only(score), b, h, q_idx, kv_idx, args)
        return self._numpy_result("score_mod's numpy callable", res, score.shape, score.dtype)

    def derivative(self, score, b, h, q_idx, kv_idx, args):
        if self.grad_numpy is None:
            raise ValueError(NO_GRAD)
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            res = self.grad_numpy(_read_only(score), b, h, q_idx, kv_idx, args)
        return self._numpy_result("score_mod's grad_numpy callable", res, score.shape,
                                  score.dtype)


def _read_only(x):
    """A view the user's callable cannot write through (the tile is used after it)."""
    view = x.view()
    view.flags.writeable = False
    return view


NO_GRAD = ("the backward needs the derivative of score_mod: construct it with "
           "ScoreMod(..., grad_cuda=..., grad_numpy=...) (d score_mod / d score), or with "
           "ScoreMod.additive for score + term; it is not derived from the code")


class MaskMod(_Hook):
    """A user mask ``keep(b, h, q_idx, kv_idx, args) -> bool`` (True = the key is visible).

    Parameters
    ----------
    cuda : str
        CUDA C: a boolean expression or a function body with ``return`` (:mod:`cuflash.mods`).
    numpy : callable
        ``numpy(b, h, q_idx, kv_idx, args) -> bool array`` broadcastable to ``(n, rows, cols)``
        (argument shapes as in `ScoreMod`).

    Every tile stays partial for the kernels (its mask is tested per element), and no tile is
    skipped on a user mask unless ``_dispatch_variants.HOOK_BLOCKS`` is on (off by default; the
    forwards then narrow their key tiles per 64 rows to the blocks the hook does not hide:
    `cuflash._mask_blocks.hook_summary`), so a sparse mask costs as much as a dense one; a row
    it leaves empty gives ``o = 0``, ``lse = -inf``.
    """

    kind = "mask_mod"

    def __init__(self, cuda: str, numpy: Callable):
        self.cuda = _check_code("mask_mod", cuda)
        self.numpy = _check_callable("mask_mod's numpy", numpy, _MASK_PARAMS)
        self._freeze()

    def _texts(self):
        return ("mask_mod", self.cuda)

    def __repr__(self):
        return f"MaskMod({self.cuda!r})"

    def evaluate(self, b, h, q_idx, kv_idx, args, shape):
        res = self.numpy(b, h, q_idx, kv_idx, args)
        return self._numpy_result("mask_mod's numpy callable", res, shape)


# ---- the generated CUDA source ----------------------------------------------------------

_SIG = "const long long b, const long long h, const long long q_idx, const long long kv_idx, " \
       "const float* __restrict__ args"


def hook_type(score_mod: Optional[ScoreMod], mask_mod: Optional[MaskMod]) -> str:
    """The C++ name of the generated hook struct, from the code's hash."""
    h = hashlib.sha256("\0".join((score_mod.digest if score_mod else "-",
                                  mask_mod.digest if mask_mod else "-")).encode())
    return f"cuflash_user::Mod_{h.hexdigest()[:16]}"


def hook_source(score_mod: Optional[ScoreMod], mask_mod: Optional[MaskMod]) -> str:
    """The struct (appended to the kernel family's source) whose static members hold the user's
    code in functions of fixed signatures; unused members are never instantiated."""
    name = hook_type(score_mod, mask_mod).split("::")[1]
    sm = score_mod.cuda if score_mod else "return score;"
    gr = (score_mod.grad_cuda if score_mod and score_mod.grad_cuda else "return Acc(1);")
    mm = mask_mod.cuda if mask_mod else "return true;"
    return (
        "\n// ---- user hooks (cuflash/mods.py)\nnamespace cuflash_user {\n"
        f"struct {name} {{\n"
        "template <typename Acc>\n"
        f"static __device__ __forceinline__ Acc score_mod(Acc score, {_SIG}) {{\n"
        f"{_body('score_mod', sm)}"
        "}\ntemplate <typename Acc>\n"
        f"static __device__ __forceinline__ Acc score_grad(Acc score, {_SIG}) {{\n"
        f"{_body('score_mod grad_cuda', gr)}"
        "}\n"
        f"static __device__ __forceinline__ bool mask_mod({_SIG}) {{\n"
        f"{_body('mask_mod', mm)}"
        "}\n};\n}  // namespace cuflash_user\n")


_checked = set()
_check_lock = threading.Lock()


def check_compiles(score_mod: Optional[ScoreMod], mask_mod: Optional[MaskMod],
                   options=("--std=c++17", "-DNDEBUG"), arch: str = "compute_80"):
    """Compile the hooks alone (float and double instantiations) with NVRTC, once per code;
    raises `HookCompileError` with the user's lines and NVRTC's log on an error, or on a
    warning about a hook line (a missing return, a narrowing...)."""
    key = (hook_type(score_mod, mask_mod), tuple(options), arch)
    if key in _checked:
        return
    from ._compile import nvrtc_compile_ptx

    name = hook_type(score_mod, mask_mod)
    src = hook_source(score_mod, mask_mod) + (
        "\nextern \"C\" __global__ void cuflash_hook_probe(float* o, double* o2, bool* m, "
        "const float* args, long long i) {\n"
        f"  o[0] = {name}::score_mod<float>(o[1], i, i + 1, i + 2, i + 3, args);\n"
        f"  o[2] = {name}::score_grad<float>(o[3], i, i + 1, i + 2, i + 3, args);\n"
        f"  o2[0] = {name}::score_mod<double>(o2[1], i, i + 1, i + 2, i + 3, args);\n"
        f"  o2[2] = {name}::score_grad<double>(o2[3], i, i + 1, i + 2, i + 3, args);\n"
        f"  m[0] = {name}::mask_mod(i, i + 1, i + 2, i + 3, args);\n}}\n")
    ok, log = nvrtc_compile_ptx(src, "cuflash_hooks.cu", list(options) + [f"-arch={arch}"])
    hook_lines = [ln for ln in log.splitlines()
                  if re.match(r"\s*(score_mod|score_mod grad_cuda|mask_mod)\(\d+\)", ln)]
    if not ok or any("warning" in ln for ln in hook_lines):
        raise HookCompileError(_explain(score_mod, mask_mod, log, hook_lines, ok))
    with _check_lock:
        _checked.add(key)


def _explain(score_mod, mask_mod, log, hook_lines, ok):
    texts = {"score_mod": score_mod.cuda if score_mod else "",
             "score_mod grad_cuda": (score_mod.grad_cuda or "") if score_mod else "",
             "mask_mod": mask_mod.cuda if mask_mod else ""}
    out = ["NVRTC " + ("rejected" if not ok else "warned about") + " the hook code:"]
    for ln in hook_lines:
        m = re.match(r"\s*(score_mod grad_cuda|score_mod|mask_mod)\((\d+)\):\s*(.*)", ln)
        label, no, msg = m.group(1), int(m.group(2)), m.group(3)
        lines = texts[label].splitlines()
        src = lines[no - 1] if 0 < no <= len(lines) else ""
        out.append(f"  {label}, line {no}: {msg}\n      {src}")
    if not hook_lines:
        out.append("  (no message names a hook line)")
    out.append("NVRTC's log:\n" + log)
    return "\n".join(out)


def example_hooks():
    """Hooks used by the tests, the compile check and the audit (and as examples):

    - ``"tanh_cap"``: ``2 tanh(score / 2)`` as a score_mod (the built-in ``softcap=2.0``), with
      its derivative, Lipschitz 1;
    - ``"rel_bias"``: ``score + args[h * 16 + clamp(kv_idx - q_idx + 8, 0, 15)]``, a
      relative-position bias from a per-head table of 16 buckets (additive);
    - ``"document"``: ``args[q_idx] == args[kv_idx]`` as a mask_mod (document ids in args,
      at least max(Sq, Sk) of them);
    - ``"prefix_lm"``: ``kv_idx < 16 || kv_idx <= q_idx`` as a mask_mod (a bidirectional
      prefix of 16 keys, causal after it).
    """
    cap = ScoreMod("Acc t = tanh(score / Acc(2));\nreturn Acc(2) * t;",
                   numpy=lambda s, b, h, q, kv, a: 2 * np.tanh(s / 2),
                   grad_cuda="Acc t = tanh(score / Acc(2));\nreturn Acc(1) - t * t;",
                   grad_numpy=lambda s, b, h, q, kv, a: 1 - np.tanh(s / 2) ** 2, lipschitz=1.0)
    rel = ScoreMod.additive(
        "score + args[h * 16 + min(max(kv_idx - q_idx + 8, 0ll), 15ll)]",
        lambda s, b, h, q, kv, a: s + a[h * 16 + np.clip(kv - q + 8, 0, 15)])
    doc = MaskMod("args[q_idx] == args[kv_idx]", numpy=lambda b, h, q, kv, a: a[q] == a[kv])
    prefix = MaskMod("kv_idx < 16 || kv_idx <= q_idx",
                     numpy=lambda b, h, q, kv, a: (kv < 16) | (kv <= q))
    return {"tanh_cap": cap, "rel_bias": rel, "document": doc, "prefix_lm": prefix}
