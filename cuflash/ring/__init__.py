"""Sequence-parallel (ring) attention built on cuflash's merge operator.

A sequence too long for one GPU is split over ``R`` ranks (zigzag: rank ``r`` holds chunks
``r`` and ``2R - 1 - r`` of ``2R``, which balances the causal mask); each rank keeps its
queries and passes its key/value shard around the ring, attending to each visiting shard and
merging the partial ``(o, lse)`` results with `cuflash.merge_states`'s operator. The same
schedule runs over three transports (`transport`): a CPU simulation, every rank on one GPU,
and NCCL across processes (`launch` starts them). notes/RING.md has the schedule, the zigzag
split, the merge order and what has been run.

- `ring_attention_local(q, k, v, world=R, ...)`, `ring_attention_backward_local(...)`: the
  whole sequence in and out, all ranks on this device (NumPy: the simulation; CuPy: one GPU).
- `ring_attention(q, k, v, transport=..., ...)`, `ring_attention_backward(...)`: this
  process's shard(s), any transport.
- `cuflash.ring.jax_ring.ring_attention_jax`: the JAX form (``shard_map`` + ``ppermute``),
  imported on demand so that JAX stays optional.
- `shard`, `unshard`, `ZigzagLayout`, `pair_calls`, `step_work`: the split and the schedule's
  per-step calls and work.
"""
from ._api import (BACKWARD_DTYPES, FORWARD_DTYPES, ring_attention, ring_attention_backward,
                   ring_attention_backward_local, ring_attention_local, shard, unshard)
from . import launch
from ._layout import ZigzagLayout, chunk_bounds, pair_calls, step_work
from .transport import LocalGPUTransport, NcclTransport, NullTransport, SimTransport

__all__ = ["ring_attention", "ring_attention_backward", "ring_attention_local",
           "ring_attention_backward_local", "shard", "unshard", "ZigzagLayout", "chunk_bounds",
           "pair_calls", "step_work", "SimTransport", "LocalGPUTransport", "NcclTransport",
           "NullTransport", "FORWARD_DTYPES", "BACKWARD_DTYPES", "launch"]
