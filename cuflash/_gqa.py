"""Grouped-query heads as a broadcast: the shape rule shared by the checks, the CPU path and the
float64 references.

When q has ``H`` heads on its head axis (axis -3, the axis before the sequence axis) and k or v
has ``Hkv`` heads there, with ``1 < Hkv < H`` and ``H % Hkv == 0``, query head ``h`` attends to
key/value head ``h // (H // Hkv)`` (FlashAttention's and PyTorch's ``enable_gqa`` rule). That is
exactly NumPy broadcasting after splitting the head axis in two, ``H -> (Hkv, g)`` with
``g = H // Hkv``: q becomes ``(..., Hkv, g, Sq, D)`` and k, v ``(..., Hkv, 1, Sk, D)``. Splitting
an axis is always a view (no copy, whatever the strides), so every kernel and the CPU path see a
plain broadcast: k and v are addressed through a batch stride of 0 along the group axis, each
K/V head is shared by the g query heads of its group, and the backward sums dk, dv over the
group exactly as it sums over any broadcast axis.

Nothing here depends on CuPy: the functions work on anything with ``shape`` and ``reshape``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple


@dataclass(frozen=True)
class Grouping:
    """The head split of one call: ``h`` query heads in ``hkv`` groups of ``g``."""

    h: int
    hkv: int

    @property
    def g(self) -> int:
        return self.h // self.hkv

    def split(self, x, axis: int = -3):
        """View ``x`` with its head axis ``axis`` (size h, hkv or 1) split in two:
        h -> (hkv, g), hkv -> (hkv, 1), 1 -> (1, 1). Arrays with fewer dimensions than the head
        axis needs are returned as they are (they broadcast)."""
        if x.ndim < -axis:
            return x
        n = x.shape[axis]
        pair = {self.h: (self.hkv, self.g), self.hkv: (self.hkv, 1), 1: (1, 1)}[n]
        a = x.ndim + axis
        return x.reshape(tuple(x.shape[:a]) + pair + tuple(x.shape[a + 1:]))

    def merge(self, x, axis: int = -3):
        """Undo `split` for an array whose group axes are (axis - 1, axis) after the split:
        ``(..., hkv, g, Sq, Dv) -> (..., h, Sq, Dv)`` with ``axis = -3`` (o), ``-2`` for lse."""
        a = x.ndim + axis - 1
        return x.reshape(tuple(x.shape[:a]) + (x.shape[a] * x.shape[a + 1],)
                         + tuple(x.shape[a + 2:]))

    def public_batch(self, batch: Tuple[int, ...]) -> Tuple[int, ...]:
        """The caller's batch shape for the split (internal) one: the last two axes merged."""
        return tuple(batch[:-2]) + (batch[-2] * batch[-1],)


def grouping(q_shape, k_shape, v_shape) -> Optional[Grouping]:
    """The `Grouping` of q, k, v shapes, or None when their head axes simply broadcast.

    Raises ValueError when k's or v's head count lies strictly between 1 and q's without
    dividing it, or when k and v are grouped differently.
    """
    if len(q_shape) < 3 or q_shape[-3] <= 1:
        return None
    h = int(q_shape[-3])
    hkv = None
    for name, shape in (("k", k_shape), ("v", v_shape)):
        if len(shape) < 3:
            continue
        n = int(shape[-3])
        if n in (1, h):
            continue
        if n > h or h % n:
            raise ValueError(
                f"the head axes (axis -3) of q ({h} heads) and {name} ({n}) do not broadcast "
                f"(one of them 1, or equal) and do not group: grouped-query attention needs the "
                f"query heads to be a multiple of the key/value heads (query head i uses kv "
                f"head i // (H / Hkv))")
        if hkv is not None and n != hkv:
            raise ValueError(f"k and v have different numbers of grouped heads ({hkv} and {n}) "
                             f"on the head axis (axis -3); q has {h}")
        hkv = n
    return None if hkv is None else Grouping(h, hkv)


def split_all(q, k, v):
    """(grouping or None, q, k, v split views): the one call sites use."""
    g = grouping(tuple(q.shape), tuple(k.shape), tuple(v.shape))
    if g is None:
        return None, q, k, v
    return g, g.split(q), g.split(k), g.split(v)
