"""The zigzag split of a sequence over a ring of ranks, and which attention each (query shard,
key/value shard) pair needs.

The sequence of length S is cut into ``2R`` chunks of nearly equal length (the first
``S % 2R`` chunks one row longer: ``numpy.array_split``'s rule). Rank ``r`` holds chunks ``r``
and ``2R - 1 - r``, concatenated in that order (its *lo* and *hi* halves), of queries, keys and
values alike. Under a causal mask an early chunk sees few keys and a late one many; pairing
chunk ``r`` with chunk ``2R - 1 - r`` gives every rank the same amount of work at every ring
step (notes/RING.md).

For one query chunk ``cq`` against one key chunk ``ck`` the causal mask is either absent
(``ck < cq``: every key visible, ``FULL``), the diagonal block (``ck == cq``: causal within the
chunk, ``DIAG``) or total (``ck > cq``: nothing visible, ``SKIP``). For a query half against the
two halves of a visiting key/value shard this always reduces to one attention call on a
contiguous key range, causal or not (bottom-right aligned, as `cuflash.attention`'s mask is), or
to nothing: `pair_calls`.
"""
from __future__ import annotations

from typing import List, NamedTuple, Tuple

FULL, DIAG, SKIP = "full", "diag", "skip"


def chunk_bounds(seq_len: int, world: int) -> List[Tuple[int, int]]:
    """``[(start, stop)]`` of the ``2 * world`` chunks of a sequence of ``seq_len`` rows."""
    n = 2 * world
    base, extra = divmod(seq_len, n)
    out, start = [], 0
    for c in range(n):
        stop = start + base + (1 if c < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def rank_chunks(world: int, rank: int) -> Tuple[int, int]:
    """The chunk indices rank ``rank`` holds: ``(rank, 2 * world - 1 - rank)``."""
    return rank, 2 * world - 1 - rank


class ZigzagLayout:
    """Which global rows every rank of a ring of ``world`` holds, for a sequence of ``seq_len``.

    Attributes
    ----------
    seq_len, world : int
    bounds : list of (start, stop), the ``2 * world`` chunks
    """

    def __init__(self, seq_len: int, world: int):
        world, seq_len = int(world), int(seq_len)
        if world < 1:
            raise ValueError(f"world (the number of ranks) must be >= 1; got {world}")
        if seq_len < 2 * world:
            raise ValueError(
                f"the sequence length ({seq_len}) must be at least 2 * world = {2 * world}: the "
                f"zigzag split gives every rank two non-empty chunks")
        self.seq_len, self.world = seq_len, world
        self.bounds = chunk_bounds(seq_len, world)

    def half_len(self, rank: int, half: int) -> int:
        """Rows of rank ``rank``'s half ``half`` (0: lo, chunk ``rank``; 1: hi)."""
        a, b = self.bounds[rank_chunks(self.world, rank)[half]]
        return b - a

    def shard_len(self, rank: int) -> int:
        return self.half_len(rank, 0) + self.half_len(rank, 1)

    @property
    def max_shard_len(self) -> int:
        return max(self.shard_len(r) for r in range(self.world))

    def shard_slices(self, rank: int) -> Tuple[slice, slice]:
        """The global rows of rank ``rank``'s lo and hi halves."""
        return tuple(slice(*self.bounds[c]) for c in rank_chunks(self.world, rank))

    def shard(self, x, rank: int, xp):
        """Rank ``rank``'s rows of ``x`` (rows on axis -2), lo then hi, as a new array."""
        lo, hi = self.shard_slices(rank)
        return xp.concatenate([x[..., lo, :], x[..., hi, :]], axis=-2)

    def unshard(self, shards, xp):
        """The inverse of `shard`: the full sequence from every rank's shard (a list by rank)."""
        pieces = [None] * (2 * self.world)
        for r, s in enumerate(shards):
            n0 = self.half_len(r, 0)
            c0, c1 = rank_chunks(self.world, r)
            pieces[c0], pieces[c1] = s[..., :n0, :], s[..., n0:, :]
        return xp.concatenate(pieces, axis=-2)

    def unshard_rows(self, shards, xp):
        """`unshard` for arrays whose row axis is the last one (lse: shape (..., rows))."""
        return self.unshard([s[..., None] for s in shards], xp)[..., 0]


def chunk_pair_kind(cq: int, ck: int, causal: bool) -> str:
    """What query chunk ``cq`` sees of key chunk ``ck``: FULL, DIAG or SKIP."""
    if not causal or ck < cq:
        return FULL
    return DIAG if ck == cq else SKIP


class Call(NamedTuple):
    """One attention call of a ring step: query half ``half`` of the local rank against rows
    ``[k0, k1)`` of the visiting key/value shard, causal (bottom-right aligned) or not."""
    half: int
    k0: int
    k1: int
    causal: bool


def pair_calls(layout: ZigzagLayout, q_rank: int, kv_rank: int, causal: bool) -> List[Call]:
    """The attention calls that rank ``q_rank``'s queries need against rank ``kv_rank``'s keys.

    At most one call per query half: the visible key halves are always a contiguous range (lo,
    hi or both), and a diagonal block, when there is one, is the last of them with the query
    half's own length, so a bottom-right aligned causal call on that range is exactly the mask.
    """
    w = layout.world
    qc, kc = rank_chunks(w, q_rank), rank_chunks(w, kv_rank)
    klen = (layout.half_len(kv_rank, 0), layout.half_len(kv_rank, 1))
    calls = []
    for h in (0, 1):
        kinds = [chunk_pair_kind(qc[h], kc[g], causal) for g in (0, 1)]
        seen = [g for g in (0, 1) if kinds[g] != SKIP]
        if not seen:
            continue
        if seen != list(range(seen[0], seen[-1] + 1)) or DIAG in kinds[:seen[-1]]:
            raise AssertionError(f"zigzag invariant broken: kinds {kinds}")  # pragma: no cover
        k0 = 0 if seen[0] == 0 else klen[0]
        k1 = klen[0] if seen[-1] == 0 else klen[0] + klen[1]
        calls.append(Call(h, k0, k1, kinds[seen[-1]] == DIAG))
    return calls


def call_work(nq: int, call: Call) -> int:
    """Score elements (query, key) pairs a call visits: ``nq * nk``, or for a causal call
    (bottom-right aligned, ``nk >= nq``) ``nq * (nk - nq) + nq * (nq + 1) / 2``."""
    nk = call.k1 - call.k0
    if not call.causal:
        return nq * nk
    return nq * (nk - nq) + nq * (nq + 1) // 2


def step_work(layout: ZigzagLayout, causal: bool) -> List[List[int]]:
    """``work[t][r]``: the score elements rank ``r`` visits at ring step ``t`` (it holds rank
    ``(r - t) % world``'s keys then)."""
    w = layout.world
    return [[sum(call_work(layout.half_len(r, c.half), c)
                 for c in pair_calls(layout, r, (r - t) % w, causal)) for r in range(w)]
            for t in range(w)]
