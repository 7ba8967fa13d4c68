"""The block summary of a boolean mask, and `cuflash.block_mask` (issue 15; notes/VARIANTS.md,
"A block mask").

A mask of shape ``(batch..., R, C)`` (``R`` = Sq or 1, ``C`` = Sk or 1) is summarised per
``BLOCK x BLOCK`` block of its own rows and keys, one byte each (``KEPT``: every entry of the
block is True; ``HIDDEN``: every one is False; ``MIXED``: otherwise), in an array of shape
``(batch..., ceil(R / BLOCK), ceil(C / BLOCK))``. The tensor-core kernels look up the blocks a
tile overlaps (``Variant::tile_kind`` in kernels_cu/variants.cuh): a tile whose blocks are all
KEPT is computed as if there were no mask, without reading it; every other tile reads the mask
per element as before. The summary changes which code computes a tile, never its result: a FULL
tile's masking test would keep every entry anyway.

On the GPU the summary is one pass over the mask (kernels_cu/mask_blocks.cu) on the call's
stream. `attention` and `attention_backward` compute it per call for a plain bool mask (one
read of the mask and a small allocation from CuPy's pool), or take it from a `BlockMask` that
`block_mask` made once. NumPy masks get the NumPy summary (`numpy_summary`, also the tests'
reference); the NumPy path of attention does not read it.
"""
from __future__ import annotations

import numpy as np

#: The block edge (MASK_BLOCK in kernels_cu/variants.cuh) and the byte values (MaskBlockKind).
BLOCK = 64
MIXED, KEPT, HIDDEN = 0, 1, 2

#: False: the launches pass no summary (every masked tile is read per element, as before the
#: summary existed), whatever the caller gave; for the tests' and benchmarks' comparisons.
ENABLED = True

#: Families whose kernels read the summary (the tensor-core ones; the generic kernels test
#: every element through Variant::visible).
READERS = ("attn_mma", "attn_wgmma", "attn_bwd_mma", "attn_bwd_wgmma")


def summary_shape(shape):
    """The summary's shape for a mask of shape ``(batch..., R, C)``."""
    *batch, r, c = (int(n) for n in shape)
    return tuple(batch) + (-(-r // BLOCK), -(-c // BLOCK))


def numpy_summary(mask):
    """The summary of a NumPy bool array ``mask`` (batch..., R, C) (the reference the GPU
    kernel is tested against). Returns uint8 of `summary_shape(mask.shape)`."""
    mask = np.asarray(mask, dtype=bool)
    *batch, r, c = mask.shape
    rb, cb = summary_shape(mask.shape)[-2:]
    # Pad with a neutral value per reduction: True for "all", False for "any".
    pad = [(0, 0)] * len(batch) + [(0, rb * BLOCK - r), (0, cb * BLOCK - c)]
    blocks = tuple(batch) + (rb, BLOCK, cb, BLOCK)
    every = np.pad(mask, pad, constant_values=True).reshape(blocks).all(axis=(-3, -1))
    some = np.pad(mask, pad, constant_values=False).reshape(blocks).any(axis=(-3, -1))
    out = np.full(every.shape, MIXED, dtype=np.uint8)
    out[every] = KEPT
    out[~some] = HIDDEN
    return out


def spec(vec):
    """The summary kernel's specialisation (VEC: 16-byte row loads)."""
    from . import _compile
    return _compile.Specialisation("mask_blocks",
                                   f"cuflash::cuflash_mask_blocks<{'true' if vec else 'false'}>")


RANGE_KERNELS = ("cuflash_hook_ranges", "cuflash_hook_col_ranges")


def ranges_spec(name="cuflash_hook_ranges"):
    """A kernel that turns a mask_mod's summary into ranges (`RANGE_KERNELS`: the row blocks'
    key ranges, the key blocks' row ranges; `hook_ranges`)."""
    from . import _compile
    return _compile.Specialisation("mask_blocks", f"cuflash::{name}")


def compile_specs():
    return [spec(True), spec(False)] + [ranges_spec(n) for n in RANGE_KERNELS]


def hook_compile_specs():
    """The mask_mod summary kernel for the example mask hooks (`cuflash.mods.example_hooks`),
    for the compile check."""
    from .mods import example_hooks
    ex = example_hooks()
    return [hook_spec(ex[name]) for name in ("document", "prefix_lm")]


def _batch_layout(mask):
    """The mask's batch axes collapsed (``_launch.collapse_batch``) and padded to four:
    (sizes, strides in elements), or None when they do not collapse to four."""
    from ._launch import collapse_batch
    sizes, bstr, _ = collapse_batch(tuple(mask.shape[:-2]), mask)
    if len(sizes) > 4:
        return None
    st = bstr[0]
    while len(sizes) < 4:
        sizes.insert(0, 1)
        st.insert(0, 0)
    return sizes, st


def launch(mask, out, device_id, stream=None):
    """Write the summary of the CuPy bool array ``mask`` (batch..., R, C) into the C-contiguous
    uint8 array ``out`` of `summary_shape` on ``stream``."""
    import cupy

    from . import _compile
    from ._launch import MAX_GRID_X, _stream_ptr

    if out.shape != summary_shape(mask.shape) or out.dtype != np.uint8 or \
            not out.flags.c_contiguous:
        raise ValueError(f"the summary must be C-contiguous uint8 of shape "
                         f"{summary_shape(mask.shape)}")
    if out.size == 0:
        return
    layout = _batch_layout(mask)
    if layout is None:   # more than four unmergeable batch axes: summarise a contiguous copy
        mask = cupy.ascontiguousarray(mask)
        layout = _batch_layout(mask)
    sizes, st = layout
    rows, cols = (int(n) for n in mask.shape[-2:])
    sr = 0 if rows == 1 else mask.strides[-2]
    sc = 0 if cols == 1 else mask.strides[-1]
    vec = (sc == 1 and sr % 16 == 0 and mask.data.ptr % 16 == 0
           and all(s % 16 == 0 for s in st))
    nrb, ncb = out.shape[-2:]
    grid = int(out.size)
    if grid > MAX_GRID_X:
        raise ValueError(f"block_mask: {grid} blocks is too many for one launch")
    kern = _compile.get_kernel(spec(vec), device_id)
    kern((grid,), (256,), (mask, out, *(np.int64(x) for x in (
        sizes[1], sizes[2], sizes[3], *st, sr, sc, rows, cols, nrb, ncb))),
        stream=_stream_ptr(stream))


def summarise(mask, device_id, stream=None):
    """The summary of a CuPy bool mask as a new array from CuPy's pool (made on ``stream``)."""
    import cupy

    from ._launch import _stream_ptr
    with cupy.cuda.Device(device_id), _stream_ptr(stream):
        out = cupy.empty(summary_shape(mask.shape), dtype=np.uint8)
    launch(mask, out, device_id, stream)
    return out


class BlockMask:
    """A boolean mask with its block summary, made by `cuflash.block_mask`; pass it as
    ``mask=`` to `cuflash.attention` or `cuflash.attention_backward` (and the references).

    Attributes
    ----------
    mask : array of bool, shape (..., R, C)
        The mask itself (the caller's array, not a copy).
    blocks : array of uint8, shape (..., ceil(R / 64), ceil(C / 64))
        Per 64 x 64 block of ``mask``: 1 = every entry True, 2 = every entry False, 0 = mixed.

    The summary describes ``mask`` as it was when it was made: after writing into ``mask``,
    call `refresh` (a stale summary that calls a block all True where it no longer is gives
    wrong results).
    """

    __slots__ = ("mask", "blocks", "_device")

    def __init__(self, mask, blocks, device):
        self.mask, self.blocks, self._device = mask, blocks, device

    @property
    def shape(self):
        return tuple(self.mask.shape)

    @property
    def ndim(self):
        return self.mask.ndim

    @property
    def dtype(self):
        return self.mask.dtype

    def refresh(self, stream=None):
        """Recompute the summary in place (after the mask was written), on ``stream``."""
        if self._device is None:
            self.blocks[...] = numpy_summary(self.mask)
        else:
            launch(self.mask, self.blocks, self._device, stream)
        return self

    def __repr__(self):
        kinds = "numpy" if self._device is None else f"cupy, device {self._device}"
        return f"BlockMask(shape={self.shape}, blocks={tuple(self.blocks.shape)}, {kinds})"


def block_mask(mask, *, stream=None):
    """A boolean mask with its block summary, to pass as ``mask=`` more than once.

    `cuflash.attention` and `cuflash.attention_backward` summarise a plain bool mask on every
    call (one read of the mask, on the call's stream, and a small array from CuPy's pool) so
    that the tensor-core kernels can compute the tiles where the mask keeps everything without
    reading it (a padding mask: all but the last key blocks). A `BlockMask` carries the summary
    from call to call: no per-call pass or allocation, as a CUDA graph capture needs.

    Parameters
    ----------
    mask : array of bool, shape (..., R, C)
        CuPy (or another DLPack GPU array, viewed without a copy) or NumPy; ``R`` is Sq or 1 and
        ``C`` is Sk or 1 of the calls it is passed to (the rules of ``mask=``).
    stream : cupy.cuda.Stream, int or None
        The stream the summary is computed on (None: CuPy's current stream).

    Returns
    -------
    BlockMask
        ``.mask`` (the array, not a copy) and ``.blocks``, uint8 of shape
        ``(..., ceil(R / 64), ceil(C / 64))``. Writing into the mask afterwards needs
        ``.refresh()``.

    Raises
    ------
    TypeError
        ``mask`` is not a bool array.
    ValueError
        ``mask`` has fewer than two dimensions.
    """
    from . import _interop
    from ._checks import _refuse_subclass, dtype_name

    if isinstance(mask, BlockMask):
        return mask
    _refuse_subclass("mask", mask)
    backend, device = _interop.backend_of(mask, "mask")
    mask = _interop.as_backend_array(mask, backend)
    if dtype_name(mask.dtype) != "bool":
        raise TypeError(f"block_mask: mask has dtype {dtype_name(mask.dtype)}; expected bool "
                        "(True = keep)")
    if mask.ndim < 2:
        raise ValueError(f"block_mask: mask has shape {tuple(mask.shape)}; expected at least two "
                         "dimensions (..., R, C)")
    if backend == "cpu":
        return BlockMask(mask, numpy_summary(mask), None)
    return BlockMask(mask, summarise(mask, device, stream), device)


# ---- the summary of a user mask_mod (cuflash/mods.py: MaskMod) -----------------------------
# The bool mask's byte format over the hook's own (Sq, Sk) grid, one summary per batch entry
# the hook can tell apart: `MaskMod.batch_names` says whether its code names b and h; where it
# names neither, one (Sq, Sk) summary serves the whole batch. The forwards read its key ranges
# per 64-row block (`hook_ranges`; variants.cuh: UserVariant with BLOCKS) while
# _dispatch_variants.HOOK_BLOCKS is on (notes/VARIANTS.md, "The block summary of a mask_mod").

def hook_summary_shape(mask_mod, batch_shape, sq, sk):
    """``(nb, nh, ceil(Sq / 64), ceil(Sk / 64))``: ``nh`` the last batch axis's size (the heads,
    the hook's ``h``) if the hook's code names ``h``, else 1; ``nb`` the product of the batch
    axes before it (the hook's flat ``b``) if it names ``b``, else 1."""
    batch_shape = tuple(int(n) for n in batch_shape)
    names = mask_mod.batch_names
    nh = batch_shape[-1] if batch_shape and "h" in names else 1
    nb = int(np.prod(batch_shape[:-1], dtype=np.int64)) if batch_shape and "b" in names else 1
    return (nb, nh, -(-int(sq) // BLOCK), -(-int(sk) // BLOCK))


def _hook_args(mask_mod, args):
    """``args`` checked: a 1-D float32 array, non-empty where the hook's code reads it."""
    if args is not None and (args.dtype != np.float32 or args.ndim != 1):
        raise TypeError(f"mod_args must be a 1-D float32 array, got {args.dtype} of shape "
                        f"{tuple(args.shape)}")
    if mask_mod.reads_args and (args is None or args.size == 0):
        raise ValueError("the mask_mod's code reads args: give mod_args (a non-empty 1-D "
                         "float32 array)")
    return args


def numpy_hook_summary(mask_mod, batch_shape, sq, sk, args=None):
    """The summary of ``mask_mod`` by its NumPy callable, evaluated over every (b, h, q_idx,
    kv_idx) of `hook_summary_shape` (the definition the GPU kernel is tested against; memory
    ``nb nh Sq Sk`` bytes, for tests). Returns uint8 of that shape."""
    args = _hook_args(mask_mod, None if args is None else np.asarray(args))
    args = np.zeros(0, np.float32) if args is None else args
    nb, nh, _, _ = shape = hook_summary_shape(mask_mod, batch_shape, sq, sk)
    b = np.repeat(np.arange(nb, dtype=np.int64), nh).reshape(-1, 1, 1)
    h = np.tile(np.arange(nh, dtype=np.int64), nb).reshape(-1, 1, 1)
    qi = np.arange(sq, dtype=np.int64).reshape(-1, 1)
    kj = np.arange(sk, dtype=np.int64).reshape(1, -1)
    view = args.view()
    view.flags.writeable = False
    keep = mask_mod.evaluate(b, h, qi, kj, view, (nb * nh, int(sq), int(sk)))
    return numpy_summary(keep).reshape(shape)


def hook_spec(mask_mod):
    """The summary kernel for ``mask_mod`` (mask_blocks.cu: cuflash_hook_blocks), with the hook's
    generated struct appended to the family's source (compiled once per hook code)."""
    from . import _compile
    from .mods import hook_source, hook_type
    return _compile.Specialisation(
        "mask_blocks", f"cuflash::cuflash_hook_blocks<{hook_type(None, mask_mod)}>",
        extra_source=hook_source(None, mask_mod))


def hook_summary(mask_mod, batch_shape, sq, sk, device_id, args=None, stream=None, out=None):
    """The summary of ``mask_mod`` on the GPU (`hook_summary_shape`): ``nb nh Sq Sk`` hook
    evaluations on ``stream``, into ``out`` (C-contiguous uint8 of that shape) or a new array
    from CuPy's pool. ``args``: the call's ``mod_args`` (a CuPy float32 vector) or None."""
    import cupy

    from . import _compile
    from ._launch import MAX_GRID_X, _stream_ptr

    args = _hook_args(mask_mod, args)
    shape = hook_summary_shape(mask_mod, batch_shape, sq, sk)
    if out is None:
        with cupy.cuda.Device(device_id), _stream_ptr(stream):
            out = cupy.empty(shape, dtype=np.uint8)
    elif tuple(out.shape) != shape or out.dtype != np.uint8 or not out.flags.c_contiguous:
        raise ValueError(f"the summary must be C-contiguous uint8 of shape {shape}")
    if out.size == 0:
        return out
    if out.size > MAX_GRID_X:
        raise ValueError(f"hook_summary: {out.size} blocks is too many for one launch")
    kern = _compile.get_kernel(hook_spec(mask_mod), device_id)
    kern((int(out.size),), (256,),
         (np.uint64(0) if args is None else args, out,
          *(np.int64(x) for x in (shape[1], sq, sk, shape[2], shape[3]))),
         stream=_stream_ptr(stream))
    return out


#: The sentinel of a row block the hook hides entirely: (lo, hi) = (EMPTY_LO, 0).
EMPTY_LO = 0x7FFFFFFF
#: int32 per row block of the ranges, (lo, hi, klo, khi) (UserVariant reads them at that stride).
RANGE_INTS = 4


def numpy_hook_ranges(summary, sk):
    """Key ranges from a summary (uint8, (..., RB, CB)): int32 (..., RB, 4), per row block
    (lo, hi, klo, khi): [lo, hi) = [64 c0, min(Sk, 64 (c1 + 1))) with c0 / c1 its first / last
    block that is not HIDDEN, or (EMPTY_LO, 0) where every block is; [klo, khi) the longest run of
    KEPT blocks (the first of equal ones) in the same units, or (0, 0) where none is KEPT (the
    definition cuflash_hook_ranges is tested against)."""
    summary = np.asarray(summary)
    seen = summary != HIDDEN
    cb = summary.shape[-1]
    any_seen = seen.any(axis=-1)
    c0 = np.argmax(seen, axis=-1)
    c1 = cb - 1 - np.argmax(seen[..., ::-1], axis=-1)
    out = np.empty(summary.shape[:-1] + (RANGE_INTS,), dtype=np.int32)
    out[..., 0] = np.where(any_seen, c0 * BLOCK, EMPTY_LO)
    out[..., 1] = np.where(any_seen, np.minimum(int(sk), (c1 + 1) * BLOCK), 0)
    # Runs of KEPT blocks: the length of the run ending at each block, its maximum and where.
    kept = (summary == KEPT).reshape(-1, cb)
    run = np.zeros(kept.shape, dtype=np.int64)
    for c in range(cb):
        run[:, c] = np.where(kept[:, c], (run[:, c - 1] if c else 0) + 1, 0)
    best = run.max(axis=-1, initial=0)
    end = np.argmax(run == best[:, None], axis=-1) + 1   # the first run of the longest length
    klo = np.where(best > 0, (end - best) * BLOCK, 0)
    khi = np.where(best > 0, np.minimum(int(sk), end * BLOCK), 0)
    out[..., 2] = klo.reshape(summary.shape[:-1])
    out[..., 3] = khi.reshape(summary.shape[:-1])
    return out


def numpy_hook_col_ranges(summary, sq):
    """Row ranges from a summary (uint8, (..., RB, CB)): int32 (..., CB, 2), per key block
    [64 r0, min(Sq, 64 (r1 + 1))) with r0 / r1 the first / last row block whose block in that
    column is not HIDDEN, or (EMPTY_LO, 0) where every one is (cuflash_hook_col_ranges'
    definition)."""
    return numpy_hook_ranges(np.swapaxes(np.asarray(summary), -1, -2), sq)[..., :2]


def numpy_hook_record(summary, sq, sk):
    """The ranges the kernels read, one int32 record per summary entry: (..., 4 RB + 2 CB), the
    row blocks' (lo, hi, klo, khi) (`numpy_hook_ranges`) then the key blocks' (rlo, rhi)
    (`numpy_hook_col_ranges`); `hook_ranges` is tested against it."""
    summary = np.asarray(summary)
    lead = summary.shape[:-2]
    return np.concatenate([numpy_hook_ranges(summary, sk).reshape(lead + (-1,)),
                           numpy_hook_col_ranges(summary, sq).reshape(lead + (-1,))], axis=-1)


def hook_ranges(summary, sq, sk, device_id, stream=None, out=None):
    """`numpy_hook_record` on the GPU (cuflash_hook_ranges and cuflash_hook_col_ranges, two
    launches on ``stream``) for the C-contiguous CuPy summary ``summary`` of shape (..., RB, CB):
    into ``out`` (C-contiguous int32 of shape (..., 4 RB + 2 CB)) or a new array from CuPy's
    pool."""
    import cupy

    from . import _compile
    from ._launch import MAX_GRID_X, _stream_ptr

    if summary.dtype != np.uint8 or not summary.flags.c_contiguous or summary.ndim < 2:
        raise ValueError("the summary must be C-contiguous uint8 of shape (..., RB, CB)")
    nrb, ncb = (int(n) for n in summary.shape[-2:])
    stride = RANGE_INTS * nrb + 2 * ncb
    shape = tuple(summary.shape[:-2]) + (stride,)
    if out is None:
        with cupy.cuda.Device(device_id), _stream_ptr(stream):
            out = cupy.empty(shape, dtype=np.int32)
    elif tuple(out.shape) != shape or out.dtype != np.int32 or not out.flags.c_contiguous:
        raise ValueError(f"the ranges must be C-contiguous int32 of shape {shape}")
    entries = int(np.prod(summary.shape[:-2], dtype=np.int64))
    if entries * nrb * ncb == 0:
        return out
    for name, n, args in (
            ("cuflash_hook_ranges", entries * nrb, (np.int64(ncb), np.int64(sk), np.int64(nrb))),
            ("cuflash_hook_col_ranges", entries * ncb, (np.int64(nrb), np.int64(ncb),
                                                         np.int64(sq)))):
        grid = -(-n // 128)
        if grid > MAX_GRID_X:
            raise ValueError(f"hook_ranges: {n} blocks is too many for one launch")
        kern = _compile.get_kernel(ranges_spec(name), device_id)
        kern((grid,), (128,), (summary, out, np.int64(n), *args, np.int64(stride)),
             stream=_stream_ptr(stream))
    return out
