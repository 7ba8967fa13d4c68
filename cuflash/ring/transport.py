"""Transports: how a ring step moves every local rank's buffers to the next rank.

One schedule (:mod:`cuflash.ring._schedule`) runs on all of them; a transport only says which
ranks live in this process (``local_ranks``), on what arrays (``backend``: ``"numpy"`` or
``"cupy"``), and how a *shift* happens: every local rank ``r`` sends a tuple of buffers to rank
``(r + 1) % world`` and receives the same-shaped tuple from rank ``(r - 1) % world``.

``shift(send, recv)`` starts the transfer and returns a handle; ``wait(handle)`` makes the
compute side wait for it (on a GPU: the compute stream waits on an event; the host never blocks).
The schedule never reads a receive buffer before ``wait`` and never writes a send buffer again
before the next shift, which orders itself after the compute issued so far.

- `SimTransport`: every rank in this process as NumPy arrays; a shift is a copy (the CPU
  simulation the tests run).
- `LocalGPUTransport`: every rank on one GPU; a shift is device-to-device copies on a
  communication stream, ordered against the compute stream by events (the single-GPU path).
- `NcclTransport`: one rank per process, one GPU each; a shift is an NCCL send/recv pair, grouped,
  on a communication stream (``cupy.cuda.nccl``; the ``nccl`` extra).
- `NullTransport`: one rank, no communication at all (each step computes on the rank's own
  buffers). Only for timing: the same compute as a ring step, without its transfers.
"""
from __future__ import annotations

import contextlib
from typing import Dict, Sequence, Tuple

__all__ = ["SimTransport", "LocalGPUTransport", "NcclTransport", "NullTransport"]


class _Transport:
    backend = "numpy"
    world = 1
    local_ranks: Tuple[int, ...] = (0,)

    def compute(self):
        """Context manager under which the schedule issues its compute work."""
        return contextlib.nullcontext()

    def shift(self, send: Dict[int, Sequence], recv: Dict[int, Sequence]):
        raise NotImplementedError

    def wait(self, handle) -> None:
        pass


class SimTransport(_Transport):
    """All ``world`` ranks in this process, as NumPy arrays; the ring is a loop of copies."""

    backend = "numpy"

    def __init__(self, world: int):
        self.world = _check_world(world)
        self.local_ranks = tuple(range(self.world))

    def shift(self, send, recv):
        for r in self.local_ranks:
            for src, dst in zip(send[r], recv[(r + 1) % self.world]):
                dst[...] = src
        return None


class _GPUTransport(_Transport):
    backend = "cupy"

    def _setup_streams(self, device, stream):
        import cupy

        self.device = cupy.cuda.Device(device if device is not None else cupy.cuda.Device().id)
        with self.device:
            self.compute_stream = stream if stream is not None else cupy.cuda.get_current_stream()
            self.comm_stream = cupy.cuda.Stream(non_blocking=True)

    @contextlib.contextmanager
    def compute(self):
        with self.device, self.compute_stream:
            yield

    def _ordered(self, issue):
        """Run ``issue()`` on the communication stream after the compute issued so far;
        return the event that marks its end."""
        import cupy

        ready = cupy.cuda.Event(block=False, disable_timing=True, interprocess=False)
        ready.record(self.compute_stream)
        self.comm_stream.wait_event(ready)
        with self.device:
            issue()
        done = cupy.cuda.Event(block=False, disable_timing=True, interprocess=False)
        done.record(self.comm_stream)
        return done

    def wait(self, handle):
        if handle is not None:
            self.compute_stream.wait_event(handle)


class LocalGPUTransport(_GPUTransport):
    """All ``world`` ranks on one GPU (no NCCL): a shift is one device-to-device copy per buffer
    on a communication stream, overlapping the compute stream's work.

    Parameters
    ----------
    world : int
    device : int, optional
        Default: CuPy's current device.
    stream : cupy.cuda.Stream, optional
        The compute stream (default: CuPy's current stream).
    """

    def __init__(self, world: int, *, device=None, stream=None):
        self.world = _check_world(world)
        self.local_ranks = tuple(range(self.world))
        self._setup_streams(device, stream)

    def shift(self, send, recv):
        def issue():
            for r in self.local_ranks:
                for src, dst in zip(send[r], recv[(r + 1) % self.world]):
                    dst.data.copy_from_device_async(src.data, src.nbytes, self.comm_stream)

        return self._ordered(issue)


class NullTransport(_GPUTransport):
    """One rank (``rank`` of ``world``) that never communicates: every step reuses its own
    buffers. The compute is exactly a ring step's (the calls depend only on the ranks), so its
    time is the ring's compute time without any transfer (benchmarks/ring_bench.py)."""

    def __init__(self, world: int, rank: int = 0, *, device=None, stream=None):
        self.world = _check_world(world)
        self.local_ranks = (int(rank),)
        self._setup_streams(device, stream)

    def shift(self, send, recv):
        return None


class NcclTransport(_GPUTransport):
    """One rank of an NCCL communicator, one process per GPU (`cuflash.ring.launch`).

    Parameters
    ----------
    comm : cupy.cuda.nccl.NcclCommunicator
        The communicator over the ring's ``world`` ranks.
    rank, world : int
        This process's rank and the number of ranks (as the communicator was built with).
    device : int, optional
        This rank's GPU (default: CuPy's current device).
    stream : cupy.cuda.Stream, optional
        The compute stream (default: CuPy's current stream).

    A shift is ``ncclSend`` to ``rank + 1`` and ``ncclRecv`` from ``rank - 1`` of every buffer,
    as bytes, in one NCCL group on the communication stream. Every rank must call the schedule
    with the same shapes and dtypes (the ring's buffers are the same size on every rank).
    """

    def __init__(self, comm, rank: int, world: int, *, device=None, stream=None):
        self.world = _check_world(world)
        rank = int(rank)
        if not 0 <= rank < self.world:
            raise ValueError(f"rank must be in [0, {self.world}); got {rank}")
        self.comm, self.local_ranks = comm, (rank,)
        self._setup_streams(device, stream)

    def shift(self, send, recv):
        from cupy.cuda import nccl

        (r,) = self.local_ranks
        nxt, prv = (r + 1) % self.world, (r - 1) % self.world
        s = self.comm_stream.ptr

        def issue():
            if self.world == 1:  # the ring is this rank: a shift is a copy onto itself
                for src, dst in zip(send[r], recv[r]):
                    dst.data.copy_from_device_async(src.data, src.nbytes, self.comm_stream)
                return
            nccl.groupStart()
            for src, dst in zip(send[r], recv[r]):
                self.comm.send(src.data.ptr, src.nbytes, nccl.NCCL_INT8, nxt, s)
                self.comm.recv(dst.data.ptr, dst.nbytes, nccl.NCCL_INT8, prv, s)
            nccl.groupEnd()

        return self._ordered(issue)


def _check_world(world):
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world (the number of ranks) must be an int >= 1; got {world!r}")
    return world
