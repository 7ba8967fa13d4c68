"""Attention variants: one description shared by the checks, the references and the CPU path.

A `Variant` holds the keyword arguments ``window``, ``softcap``, ``alibi_slopes``, ``bias`` and
``mask`` of `cuflash.attention` / `cuflash.attention_backward` after validation. Its semantics, for
query row ``i`` and key ``j`` of an ``Sq x Sk`` score matrix with ``off = Sk - Sq`` (bottom-right
alignment, as the causal mask), in this order:

1. ``t = scale * q_i . k_j``                                           (the scaled score)
2. ``softcap=c``: ``t = c * tanh(t / c)``                              (on the scaled score, as
   FlashAttention and Gemma 2 do)
3. ``alibi_slopes``: ``t = t - slope[b, h] * |i + off - j|``          (after the cap, as FlashAttention)
4. ``bias``: ``t = t + bias[..., i, j]``                               (after the cap)
5. visibility: key j is visible to row i iff every one of
   ``causal``: ``j <= i + off``;
   ``window=(left, right)``: ``i + off - left <= j <= i + off + right`` (-1: that side unbounded);
   ``mask``: ``mask[..., i, j]`` is True.
   ``causal=True`` with a window is their intersection, i.e. the window with ``right = 0``.
   Invisible keys get the score ``-inf`` and touch nothing of the row (not even ``0 * NaN``).

6. user hooks (:mod:`cuflash.mods`): ``score_mod`` transforms the score of steps 1-4,
   ``t = f(t, b, h, i, j, args)``; ``mask_mod`` is one more visibility condition of step 5,
   ``keep(b, h, i, j, args)``; ``args`` = ``mod_args`` (1-D float32), ``h`` the index along the
   last batch axis, ``b`` the flat index over the batch axes before it.

A row with no visible key gives ``o = 0``, ``lse = -inf`` and zero gradients. A bias of ``-inf``
acts as a mask (under a score_mod only where the hook keeps it ``-inf``: the bias is part
of its input).

Batch layout. cuflash's inputs are ``(..., S, D)`` with batch axes ``...`` (conventionally
``(B, H)``). ``bias`` and ``mask`` broadcast NumPy-style against ``(..., Sq, Sk)`` and may not
enlarge the batch. ``alibi_slopes`` of shape ``(H,)`` or ``(B, H)`` is aligned with the *trailing*
batch axes, ``slope[..., None, None]`` broadcast against ``(..., Sq, Sk)``: ``(H,)`` needs
``batch[-1] == H`` (or 1 there), ``(B, H)`` needs ``batch[-2:]`` to match.

Backward. With ``dS = P * (dP - delta)`` the gradient of the loss with respect to the final score,
``dbias = dS`` summed over the axes along which ``bias`` broadcasts, and the gradient with respect
to the scaled score is ``dS * (1 - tanh(t / c)^2)`` under softcap (``dS`` otherwise), times the
user's ``d score_mod / d score`` at the score it was given (``ScoreMod(grad_cuda=, grad_numpy=)``).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import numpy as np

__all__ = ["Variant", "VARIANT_ARGS", "variant_from_kwargs", "PLAIN"]

#: The keyword arguments that describe a variant (the same names on every entry point).
VARIANT_ARGS = ("window", "softcap", "alibi_slopes", "bias", "mask", "score_mod", "mask_mod",
                "mod_args")

BIAS_DTYPES = ("float16", "bfloat16", "float32", "float64")


@dataclass(frozen=True)
class Variant:
    """A validated attention variant (see the module docstring for the semantics).

    Attributes
    ----------
    left, right : int
        The window's extent (-1: unbounded). ``causal`` is kept apart (in the problem) and
        intersects: the effective right extent is ``0`` under causal (`right_eff`).
    softcap : float
        0.0 when off.
    alibi_slopes, bias, mask : array or None
        Backend arrays (NumPy or CuPy); slopes float32 ``(H,)`` or ``(B, H)``, bias any float
        dtype broadcastable to ``(..., Sq, Sk)``, mask bool broadcastable to ``(..., Sq, Sk)``.
    score_mod, mask_mod : cuflash.mods.ScoreMod, cuflash.mods.MaskMod or None
        User hooks; ``mod_args`` their float32 1-D array (or None), ``mod_batch`` the inputs'
        batch shape (b and h are counted in it).
    mask_blocks : array or None
        The mask's block summary (uint8, `cuflash._mask_blocks`) when the caller passed a
        `cuflash.BlockMask`; None otherwise (the GPU launch then summarises the mask per call).
        A function of ``mask``: it never changes the result.
    hook_ranges : array or None
        The mask_mod's ranges per summary entry (int32 (nb, nh, 4 RB + 2 CB): the row blocks'
        key ranges and kept runs, the key blocks' row ranges; `cuflash._mask_blocks.hook_ranges`)
        that the GPU launch made for its kernels (`_dispatch_variants.HOOK_BLOCKS`); None
        otherwise. A function of the hook, ``mod_args`` and the shapes: it never changes the
        result.
    """

    left: int = -1
    right: int = -1
    softcap: float = 0.0
    alibi_slopes: Any = None
    bias: Any = None
    mask: Any = None
    score_mod: Any = None
    mask_mod: Any = None
    mod_args: Any = None
    mod_batch: Tuple[int, ...] = ()
    mask_blocks: Any = None
    hook_ranges: Any = None

    @property
    def is_plain(self) -> bool:
        return (self.left < 0 and self.right < 0 and self.softcap == 0.0
                and self.alibi_slopes is None and self.bias is None and self.mask is None
                and not self.has_mods)

    @property
    def has_mods(self) -> bool:
        """Whether a user hook (score_mod, mask_mod) is present."""
        return self.score_mod is not None or self.mask_mod is not None

    def builtin(self) -> "Variant":
        """The same variant without its user hooks."""
        import dataclasses
        return dataclasses.replace(self, score_mod=None, mask_mod=None, mod_args=None)

    def hook_names(self):
        """``["score_mod", "mask_mod"]``, those present (for messages)."""
        return [n for n in ("score_mod", "mask_mod") if getattr(self, n) is not None]

    @property
    def has_window(self) -> bool:
        return self.left >= 0 or self.right >= 0

    def right_eff(self, causal: bool) -> int:
        """The right extent after intersecting with causal (-1: unbounded)."""
        return 0 if causal else self.right

    # -- positional visibility (causal, window): whole tiles --------------------------------

    def key_range(self, i0: int, i1: int, sq: int, sk: int, causal: bool) -> Tuple[int, int]:
        """Keys ``[j0, j1)`` that some row of ``[i0, i1)`` can see by position (causal, window);
        ``j0 >= j1`` when none."""
        off = sk - sq
        j0 = 0 if self.left < 0 else max(0, i0 + off - self.left)
        r = self.right_eff(causal)
        j1 = sk if r < 0 else min(sk, i1 - 1 + off + r + 1)
        return j0, j1

    def row_range(self, j0: int, j1: int, sq: int, sk: int, causal: bool) -> Tuple[int, int]:
        """Rows ``[r0, r1)`` that can see some key of ``[j0, j1)`` by position; empty if r0 >= r1."""
        off = sk - sq
        r = self.right_eff(causal)
        r0 = 0 if r < 0 else max(0, j0 - off - r)
        r1 = sq if self.left < 0 else min(sq, j1 - 1 - off + self.left + 1)
        return r0, r1

    def band(self, r0, r1, j0, j1, sq, sk, causal) -> Optional[np.ndarray]:
        """Bool (rows, cols): positional visibility of the tile, or None when all visible."""
        off = sk - sq
        r = self.right_eff(causal)
        if self.left < 0 and r < 0:
            return None
        i = np.arange(r0, r1)[:, None] + off
        j = np.arange(j0, j1)[None, :]
        vis = np.ones((r1 - r0, j1 - j0), dtype=bool)
        if r >= 0:
            vis &= j <= i + r
        if self.left >= 0:
            vis &= j >= i - self.left
        return None if vis.all() else vis

    # -- per-element parts of a tile -------------------------------------------------------

    def tile(self, batch, heads, r0, r1, j0, j1, sq, sk, causal, dtype):
        """The additive term and the visibility of score tile rows ``[r0, r1)`` x keys
        ``[j0, j1)``.

        ``heads``: None for the whole batch (arrays broadcastable to ``batch + (rows, cols)``)
        or ``(n0, n1)``, a range of the flattened batch (arrays broadcastable to
        ``(n1 - n0, rows, cols)``). Returns ``(add, vis)``, each None when absent; ``add`` in
        ``dtype``. Only the tile's slices of bias and mask are read.
        """
        add = None
        if self.alibi_slopes is not None:
            sl = np.asarray(self.alibi_slopes, dtype=np.float64)
            sl = _take(sl.reshape(sl.shape + (1, 1)), batch, heads)
            dist = np.abs(np.arange(r0, r1)[:, None] + (sk - sq) - np.arange(j0, j1)[None, :])
            add = (-sl * dist).astype(dtype)
        if self.bias is not None:
            b = _take(_slice_tile(self.bias, r0, r1, j0, j1), batch, heads).astype(dtype)
            add = b if add is None else add + b
        vis = self.band(r0, r1, j0, j1, sq, sk, causal)   # causal and window
        if self.mask is not None:
            mk = _take(_slice_tile(self.mask, r0, r1, j0, j1), batch, heads)
            vis = mk if vis is None else (vis & mk)
        if self.mask_mod is not None:
            b, h, qi, kj = self.mod_index(batch, heads, r0, r1, j0, j1)
            shape = np.broadcast_shapes(b.shape, (r1 - r0, j1 - j0))
            mk = self.mask_mod.evaluate(b, h, qi, kj, self._args(), shape)
            vis = mk if vis is None else (vis & mk)
        return add, vis

    def mod_index(self, batch, heads, r0, r1, j0, j1):
        """The hooks' (b, h, q_idx, kv_idx) for a tile: b and h int64 of shape
        ``batch + (1, 1)`` (heads None) or ``(n1 - n0, 1, 1)``, q_idx ``(rows, 1)``, kv_idx
        ``(1, cols)``; ``h`` indexes the last batch axis, ``b`` the axes before it."""
        batch = tuple(batch)
        if heads is None:
            n = np.arange(math.prod(batch), dtype=np.int64).reshape(batch + (1, 1))
        else:
            n = np.arange(heads[0], heads[1], dtype=np.int64).reshape(-1, 1, 1)
        hh = batch[-1] if batch else 1
        qi = np.arange(r0, r1, dtype=np.int64)[:, None]
        kj = np.arange(j0, j1, dtype=np.int64)[None, :]
        return n // hh, n % hh, qi, kj

    def _args(self):
        """``mod_args`` as the NumPy callables see it: a read-only view (empty when absent)."""
        args = np.zeros(0, dtype=np.float32) if self.mod_args is None else np.asarray(
            self.mod_args)
        view = args.view()
        view.flags.writeable = False
        return view

    def apply(self, s, add, vis, where=None, grad=True):
        """Steps 2-6 in place on a tile of scaled scores ``s`` (float array, ``(..., rows,
        cols)``). ``where = (batch, heads, r0, j0)`` locates the tile for the user hooks (as in
        `tile`; needed with a score_mod). Returns the derivative of the final score with respect
        to the scaled score (an array broadcastable to ``s``, 0 on invisible entries when a hook
        is present), or None where it is 1 everywhere: softcap's ``1 - tanh^2(t / c)`` times the
        score_mod's ``grad_numpy`` (absent: the derivative is not available and the array holds
        NaN: `need_grad` refuses the backward before that). ``grad=False``: the forward only,
        returns None (the score_mod's derivative is not evaluated)."""
        dsc = None
        if self.softcap:
            c = s.dtype.type(self.softcap)
            capped = np.tanh(s / c)
            np.multiply(capped, c, out=s)
            dsc = s.dtype.type(1) - capped * capped
        if add is not None:
            s += add
        if self.score_mod is not None:
            if where is None:
                raise ValueError("internal: Variant.apply needs where= with a score_mod")
            batch, heads, r0, j0 = where
            b, h, qi, kj = self.mod_index(batch, heads, r0, r0 + s.shape[-2], j0,
                                          j0 + s.shape[-1])
            args = self._args()
            new = self.score_mod.evaluate(s, b, h, qi, kj, args)
            if not grad:
                dsc = None
            elif self.score_mod.has_grad:
                g = self.score_mod.derivative(s, b, h, qi, kj, args)
                dsc = np.array(g) if dsc is None else dsc * g
            else:
                dsc = np.full(s.shape, np.nan, dtype=s.dtype)
            s[...] = new
        if vis is not None:
            inv = ~np.broadcast_to(vis, s.shape)
            np.copyto(s, s.dtype.type(-np.inf), where=inv)
            if dsc is not None and self.has_mods:
                dsc = np.array(np.broadcast_to(dsc, s.shape))
                dsc[inv] = 0
        return dsc

    def need_grad(self, return_dbias=False):
        """Raise ValueError when the backward cannot run: a score_mod without a derivative, or
        dbias under a score_mod (the bias is part of the hook's input: not supported)."""
        if self.score_mod is not None and not self.score_mod.has_grad:
            from .mods import NO_GRAD
            raise ValueError(NO_GRAD)
        if return_dbias and self.score_mod is not None:
            raise ValueError("return_dbias=True cannot be combined with score_mod yet (the bias "
                             "is part of the score_mod's input, and dbias would need its "
                             "derivative); drop one of them")


def _slice_tile(x, r0, r1, j0, j1):
    """x[..., r0:r1, j0:j1], keeping broadcast (size-1) axes as they are."""
    rs = slice(None) if x.shape[-2] == 1 else slice(r0, r1)
    cs = slice(None) if x.shape[-1] == 1 else slice(j0, j1)
    return np.asarray(x)[..., rs, cs]


def _take(x, batch, heads):
    """``x`` (broadcastable to ``batch + tail``) for the whole batch (heads None: a broadcast
    view) or for flattened batch entries ``[n0, n1)`` (a copy of those entries only)."""
    batch = tuple(batch)
    tail = x.shape[-2:]
    xb = np.broadcast_to(x, batch + tail) if x.ndim - 2 <= len(batch) else x
    if heads is None:
        return xb
    n0, n1 = heads
    if not batch:
        return xb[None]
    return xb[np.unravel_index(np.arange(n0, n1), batch)]


PLAIN = Variant()


def _is_int(x):
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def variant_from_kwargs(*, window=None, softcap=None, alibi_slopes=None, bias=None, mask=None,
                        score_mod=None, mask_mod=None, mod_args=None,
                        backend="cpu", device_id=None, batch=(), sq=1, sk=1) -> Variant:
    """Validate the variant arguments against a problem; return a `Variant` (`PLAIN` when none
    is given). Raises TypeError / ValueError naming the argument."""
    from . import _interop
    from ._checks import _refuse_subclass, dtype_name

    left = right = -1
    if window is not None:
        if not isinstance(window, (tuple, list)) or len(window) != 2:
            raise TypeError(f"window must be a pair (left, right) of ints, got {window!r}")
        if not all(_is_int(w) for w in window):
            raise TypeError(f"window must be a pair (left, right) of ints, got {window!r}")
        left, right = (int(w) for w in window)
        if left < -1 or right < -1:
            raise ValueError(f"window=({left}, {right}): each extent must be >= 0, or -1 for "
                             "unbounded")
    cap = 0.0
    if softcap is not None:
        if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, numbers.Real):
            raise TypeError(f"softcap must be a real number or None, got "
                            f"{type(softcap).__name__}")
        cap = float(softcap)
        if not (math.isfinite(cap) and cap >= 0.0):
            raise ValueError(f"softcap must be a finite number > 0 (or 0 / None: off), got "
                             f"{softcap!r}")

    def array(name, x):
        _refuse_subclass(name, x)
        b = _interop.backend_of(x, name)
        if b != (backend, device_id):
            raise ValueError(f"{name} is on {_interop.describe(*b)} but q, k and v are on "
                             f"{_interop.describe(backend, device_id)}")
        return _interop.as_backend_array(x, backend)

    target = tuple(batch) + (sq, sk)
    slopes = None
    if alibi_slopes is not None:
        slopes = array("alibi_slopes", alibi_slopes)
        if dtype_name(slopes.dtype) != "float32":
            raise TypeError(f"alibi_slopes has dtype {dtype_name(slopes.dtype)}; expected "
                            "float32")
        if slopes.ndim not in (1, 2) or slopes.ndim > len(batch) or not _fits(
                slopes.shape, tuple(batch)):
            raise ValueError(
                f"alibi_slopes has shape {tuple(slopes.shape)}; expected (H,) or (B, H) matching "
                f"the trailing batch axes of the inputs, {tuple(batch)} (H = batch[-1], "
                "B = batch[-2]; size 1 broadcasts)")
    def score_tensor(name, x, dtypes, what):
        if x is None:
            return None
        x = array(name, x)
        n = dtype_name(x.dtype)
        if n not in dtypes:
            raise TypeError(f"{name} has dtype {n}; expected {what}")
        if x.ndim < 2 or not _fits(x.shape, target):
            raise ValueError(f"{name} has shape {tuple(x.shape)}; expected an array "
                             f"broadcastable to (..., Sq, Sk) = {target} (at least 2 dimensions, "
                             "not enlarging the batch)")
        return x

    b_arr = score_tensor("bias", bias, BIAS_DTYPES, "one of " + ", ".join(BIAS_DTYPES))
    from ._mask_blocks import BlockMask, summary_shape
    blocks = None
    if isinstance(mask, BlockMask):
        mask, blocks = mask.mask, mask.blocks
    m_arr = score_tensor("mask", mask, ("bool",), "bool (True = keep)")
    if blocks is not None:
        blocks = array("mask (its block summary)", blocks)
        if tuple(blocks.shape) != summary_shape(m_arr.shape) or dtype_name(blocks.dtype) != \
                "uint8" or not blocks.flags.c_contiguous:
            raise ValueError(f"mask is a BlockMask whose summary has shape "
                             f"{tuple(blocks.shape)} and dtype {dtype_name(blocks.dtype)}; "
                             f"expected C-contiguous uint8 of shape "
                             f"{summary_shape(m_arr.shape)} (make it with cuflash.block_mask)")
    from .mods import MaskMod, ScoreMod
    for name, x, cls in (("score_mod", score_mod, ScoreMod), ("mask_mod", mask_mod, MaskMod)):
        if x is not None and not isinstance(x, cls):
            raise TypeError(f"{name} must be a cuflash.{cls.__name__} (its CUDA C code and NumPy "
                            f"callable), got {type(x).__name__}")
    args = None
    if mod_args is not None:
        if score_mod is None and mask_mod is None:
            raise ValueError("mod_args is given without score_mod or mask_mod")
        args = array("mod_args", mod_args)
        if dtype_name(args.dtype) != "float32" or args.ndim != 1:
            raise TypeError(f"mod_args must be a 1-D float32 array, got {dtype_name(args.dtype)} "
                            f"of shape {tuple(args.shape)}")
        if args.size and args.strides[0] != args.itemsize:
            raise ValueError("mod_args must be contiguous")
    for name, hook in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if hook is not None and hook.reads_args and (args is None or args.size == 0):
            raise ValueError(f"{name}'s CUDA code reads args but mod_args is "
                             f"{'not given' if args is None else 'empty'}: pass mod_args= (a "
                             "1-D float32 array holding every index the code reads; the "
                             "kernels do not check its bounds)")
    v = Variant(left=left, right=right, softcap=cap, alibi_slopes=slopes, bias=b_arr, mask=m_arr,
                score_mod=score_mod, mask_mod=mask_mod, mod_args=args,
                mod_batch=tuple(int(n) for n in batch) if (score_mod or mask_mod) else (),
                mask_blocks=blocks)
    return PLAIN if v.is_plain else v


def _fits(shape, target):
    """True when ``shape`` broadcasts to ``target`` without changing it."""
    shape, target = tuple(int(s) for s in shape), tuple(int(s) for s in target)
    if len(shape) > len(target):
        return False
    return all(a in (1, b) for a, b in zip(shape[::-1], target[::-1]))


def variant_of(kwargs, q=None, k=None, v=None) -> Variant:
    """A `Variant` from a dict of variant keyword arguments (for the references, which take
    ``**variant``); validates names and, with q, k, v, shapes. Unknown names raise TypeError."""
    if isinstance(kwargs, Variant):
        return kwargs
    bad = sorted(set(kwargs) - set(VARIANT_ARGS))
    if bad:
        raise TypeError(f"unexpected keyword argument(s) {', '.join(bad)}; variant arguments "
                        f"are {', '.join(VARIANT_ARGS)}")
    kw = {n: kwargs.get(n) for n in VARIANT_ARGS}
    from ._mask_blocks import BlockMask
    if isinstance(kw["mask"], BlockMask):   # the references read the mask itself
        kw["mask"] = kw["mask"].mask
        if not isinstance(kw["mask"], np.ndarray):
            kw["mask"] = kw["mask"].get()
    for n in ("alibi_slopes", "bias", "mask", "mod_args"):
        if kw[n] is not None:
            kw[n] = np.asarray(kw[n])
    if kw["alibi_slopes"] is not None:
        kw["alibi_slopes"] = kw["alibi_slopes"].astype(np.float32)
    if kw["bias"] is not None and kw["bias"].dtype.kind != "f":
        kw["bias"] = kw["bias"].astype(np.float64)
    if q is not None and all(kw[n] is None for n in VARIANT_ARGS):
        q = None  # plain attention: no shapes to check (grouped-query heads included)
    if q is None:
        return Variant(left=-1 if kw["window"] is None else int(kw["window"][0]),
                       right=-1 if kw["window"] is None else int(kw["window"][1]),
                       softcap=float(kw["softcap"] or 0.0), alibi_slopes=kw["alibi_slopes"],
                       bias=kw["bias"], mask=kw["mask"], score_mod=kw["score_mod"],
                       mask_mod=kw["mask_mod"], mod_args=kw["mod_args"])
    q, k, v = (np.asarray(x) for x in (q, k, v))
    batch = tuple(np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2]))
    return variant_from_kwargs(**kw, backend="cpu", device_id=None, batch=batch,
                               sq=q.shape[-2], sk=k.shape[-2])
