"""Start one process per GPU for ring attention over NCCL, without torchrun.

    python -m cuflash.ring.launch -n 8 [--devices 0,1,...] script.py [args...]
    python -m cuflash.ring.launch -n 8 -m cuflash.ring.selftest [args...]

The launcher makes an NCCL unique id (``ncclGetUniqueId``; the launcher process hosts NCCL's
bootstrap root, so it stays alive until every child exits) and starts ``n`` children with::

    CUFLASH_RING_RANK=r  CUFLASH_RING_WORLD=n  CUFLASH_RING_NCCL_ID=<the id>
    CUDA_VISIBLE_DEVICES=<the r-th device>       (so each child sees its GPU as device 0;
                                                 the devices: --devices, else the parent's
                                                 CUDA_VISIBLE_DEVICES, else 0 .. n-1)

A child calls `transport_from_env()` to build its `NcclTransport`. If a child fails, the
others are terminated; the exit status is the first non-zero child status (0 when all pass).
Needs CuPy with NCCL (the ``nccl`` extra: ``pip install ".[cuda13,nccl]"``).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

ENV_RANK, ENV_WORLD, ENV_ID = "CUFLASH_RING_RANK", "CUFLASH_RING_WORLD", "CUFLASH_RING_NCCL_ID"


def _nccl():
    from cupy.cuda import nccl

    if not getattr(nccl, "available", False):
        raise RuntimeError("CuPy cannot load NCCL: install the nccl extra "
                           "(pip install 'cuflash[nccl]', i.e. nvidia-nccl-cu13)")
    return nccl


def in_launched_process() -> bool:
    """True in a process that `cuflash.ring.launch` started."""
    return ENV_ID in os.environ


def transport_from_env(stream=None):
    """This child's `NcclTransport` (rank, world and NCCL id from the launcher's environment),
    on device 0 (the launcher leaves each child one visible GPU)."""
    import cupy

    from .transport import NcclTransport

    nccl = _nccl()
    rank, world = int(os.environ[ENV_RANK]), int(os.environ[ENV_WORLD])
    uid = tuple(int(x) for x in os.environ[ENV_ID].split(","))
    cupy.cuda.Device(0).use()
    comm = nccl.NcclCommunicator(world, uid, rank)
    return NcclTransport(comm, rank, world, device=0, stream=stream)


def barrier(transport):
    """All ranks meet (a one-element all-reduce on the compute stream, then a host wait)."""
    import cupy

    nccl = _nccl()
    with transport.compute():
        x = cupy.zeros(1, dtype=cupy.float32)
        transport.comm.allReduce(x.data.ptr, x.data.ptr, 1, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                                 transport.compute_stream.ptr)
        transport.compute_stream.synchronize()


def launch(n, target, args, *, module=False, devices=None, timeout=None, unique_id=None):
    """Run ``target`` (a script path, or a module with ``module=True``) in ``n`` processes;
    returns the exit status (0 when every child exited with 0). ``unique_id``: the NCCL id to
    hand the children (default: a new one from ``ncclGetUniqueId``; the tests pass a dummy)."""
    if devices is None:  # the GPUs this process may use, in order
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = visible.split(",") if visible else list(range(n))
    devices = [str(d).strip() for d in devices]
    if len(devices) < n:
        raise ValueError(f"{n} processes need {n} devices; got {devices}")
    if unique_id is None:
        unique_id = _nccl().get_unique_id()
    uid = ",".join(str(int(b)) for b in unique_id)
    cmd = [sys.executable] + (["-m", target] if module else [target]) + list(args)
    procs = []
    for r in range(n):
        env = dict(os.environ, **{ENV_RANK: str(r), ENV_WORLD: str(n), ENV_ID: uid,
                                  "CUDA_VISIBLE_DEVICES": str(devices[r])})
        procs.append(subprocess.Popen(cmd, env=env))
    status, deadline = 0, None if timeout is None else time.monotonic() + timeout
    try:
        while None in [p.poll() for p in procs]:  # poll every child, every time
            failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
            if failed or (deadline is not None and time.monotonic() > deadline):
                status = failed[0] if failed else 124
                break
            time.sleep(0.05)
        else:
            status = next((p.returncode for p in procs if p.returncode != 0), 0)
    finally:
        for p in procs:  # only the children this call started
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
    return status


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m cuflash.ring.launch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", "--nproc", type=int, required=True, help="processes (one per GPU)")
    ap.add_argument("--devices", default=None, help="comma-separated GPU ids (default 0..n-1)")
    ap.add_argument("--timeout", type=float, default=None, help="seconds before giving up")
    ap.add_argument("-m", dest="module", action="store_true", help="target is a module")
    ap.add_argument("target")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    if a.nproc < 1:
        ap.error("-n must be >= 1")
    devices = None if a.devices is None else [int(x) for x in a.devices.split(",")]
    return launch(a.nproc, a.target, a.args, module=a.module, devices=devices,
                  timeout=a.timeout)


if __name__ == "__main__":
    sys.exit(main())
