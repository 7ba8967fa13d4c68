"""Dispatch: which kernel, with which template arguments, for these inputs on this device.

The rule, in order:

1. ``kernel="generic"`` forces the generic kernel (``kernels_cu/attn_generic.cu``): scalar
   float32 (float64 for float64 inputs) arithmetic with the accurate exp2, every dtype, head dims
   1..256. It is the audit path.
2. ``kernel="tensorcore"`` asks for the tensor-core kernel and raises if the inputs do not qualify.
3. ``kernel="auto"`` takes the tensor-core kernel when the inputs qualify (see
   `tensorcore_reason`), the generic kernel otherwise.

Kernel sources mirror the tile constants below (`GenericConfig` and friends); a mismatch leaves
rows unwritten, which the GPU tests catch by poisoning every output with NaN.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ._compile import Specialisation

_CXX_TYPE = {"float16": "cuflash::fp16_t", "bfloat16": "cuflash::bf16_t", "float32": "float",
             "float64": "double"}
_ACC_TYPE = {"float16": "float", "bfloat16": "float", "float32": "float", "float64": "double"}
_ACC_BYTES = {"float": 4, "double": 8}


@dataclass(frozen=True)
class Plan:
    """A kernel launch plan: what to compile and how to launch it."""

    label: str             # human-readable, e.g. "generic<float16,D64,Dv64,causal>"
    spec: Specialisation
    block_m: int           # query rows per block
    threads: int           # threads per block
    smem_bytes: int        # dynamic shared memory per block


def head_dim_bucket(n: int) -> int:
    """Smallest of 32, 64, 128, 256 that holds a head dim of n."""
    for b in (32, 64, 128, 256):
        if n <= b:
            return b
    raise ValueError(f"head dim {n} exceeds 256")


def generic_plan(dtype_name: str, d: int, dv: int, causal: bool) -> Plan:
    """The generic kernel for (dtype, D, Dv, causal): GenericConfig in attn_generic.cu.

    One bucket serves both head dims (the larger one's), which halves the number of
    specialisations at the price of idle lanes when D and Dv differ a lot.
    """
    db = dvb = head_dim_bucket(max(d, dv))
    t, acc = _CXX_TYPE[dtype_name], _ACC_TYPE[dtype_name]
    nwarps, rows, bc = 4, 4, 32
    block_m = nwarps * rows
    smem_elems = block_m * (db + 1) + bc * (db + 1) + bc * dvb
    name = (f"cuflash::cuflash_fwd_generic<{t}, {acc}, {db}, {dvb}, "
            f"{'true' if causal else 'false'}>")
    label = f"generic<{dtype_name},D{db},{'causal' if causal else 'full'}>"
    return Plan(label=label, spec=Specialisation("attn_generic", name), block_m=block_m,
                threads=nwarps * 32, smem_bytes=smem_elems * _ACC_BYTES[acc])


def tensorcore_reason(prob, compute_capability: Optional[int]) -> Optional[str]:
    """Why the tensor-core kernel cannot run these inputs, or None if it can."""
    return "the tensor-core kernel is not built yet"


def plan_for(prob, compute_capability: Optional[int]) -> Plan:
    """The plan for a validated `Problem` on a device of the given compute capability (e.g. 90)."""
    if prob.kernel == "generic":
        return generic_plan(prob.dtype_name, prob.d, prob.dv, prob.causal)
    why_not = tensorcore_reason(prob, compute_capability)
    if prob.kernel == "tensorcore" and why_not is not None:
        raise ValueError(f"kernel='tensorcore' cannot run these inputs: {why_not}")
    return generic_plan(prob.dtype_name, prob.d, prob.dv, prob.causal)


def all_specialisations():
    """Every plan the dispatcher can return, for the compile check: (label, Specialisation)."""
    plans = []
    for dt in _CXX_TYPE:
        for db in (32, 64, 128, 256):
            for causal in (False, True):
                plans.append(generic_plan(dt, db, db, causal))
    return plans
