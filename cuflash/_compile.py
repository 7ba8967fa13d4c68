"""Compile-and-cache: CUDA C from ``kernels_cu/`` to loaded kernels, through NVRTC.

A *specialisation* is one template instantiation of one kernel family (one ``.cu`` file), for
example ``cuflash::cuflash_fwd_generic<cuflash::fp16_t, float, 64, 64, true>``. It compiles on
first use:

1. `family_source` reads ``kernels_cu/<family>.cu`` and inlines its local ``#include "..."``
   headers (recursively), so the source NVRTC sees, and therefore CuPy's on-disk cache key
   (a hash of source, options, architecture and NVRTC version), changes whenever any kernel file
   it depends on changes;
2. `get_kernel` compiles it with ``cupy.RawModule`` for the architecture of the current device
   (CuPy picks it from the device), and keeps the loaded kernel in memory per device, so each
   specialisation is compiled at most once per process and device (and usually read from CuPy's
   disk cache after the first process).

`compile_report` compiles a specialisation for a named architecture without a GPU (through CuPy's
NVRTC binding directly) and returns ptxas's resource report; the tests use it to compile every
specialisation for sm_80 and sm_90 and to reject local-memory spills.
"""
from __future__ import annotations

import functools
import hashlib
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Tuple

from kernels_cu import SOURCE_DIR

#: Options common to every kernel. `-DNDEBUG` keeps device asserts out of the release build.
NVRTC_OPTIONS: Tuple[str, ...] = ("--std=c++17", "-DNDEBUG")

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)


def _inline(path: Path, seen: set) -> str:
    if path in seen:  # each header once (they all use #pragma once)
        return ""
    seen.add(path)
    text = path.read_text()

    def repl(m):
        inc = (path.parent / m.group(1)).resolve()
        if not inc.is_file():
            raise FileNotFoundError(f"{path.name} includes {m.group(1)}, which does not exist")
        return f"// ---- begin {m.group(1)}\n{_inline(inc, seen)}\n// ---- end {m.group(1)}"

    return _INCLUDE.sub(repl, text)


@functools.lru_cache(maxsize=None)
def family_source(family: str) -> Tuple[str, str]:
    """(source with local headers inlined, its sha256) for ``kernels_cu/<family>.cu``."""
    path = (SOURCE_DIR / f"{family}.cu").resolve()
    if not path.is_file():
        raise FileNotFoundError(f"no kernel family {family!r}: {path} does not exist")
    src = _inline(path, set())
    return src, hashlib.sha256(src.encode()).hexdigest()


@dataclass(frozen=True)
class Specialisation:
    """One template instantiation: `family` is the .cu file's stem, `name` the C++ name expression."""

    family: str
    name: str
    options: Tuple[str, ...] = ()

    def all_options(self):
        return NVRTC_OPTIONS + self.options


_lock = threading.Lock()
_kernels: Dict[Tuple[int, Specialisation], object] = {}
_smem_limit: Dict[Tuple[int, Specialisation], int] = {}


def get_kernel(spec: Specialisation, device_id: int, dynamic_smem: int = 0):
    """The loaded `cupy.RawKernel` for `spec` on `device_id`, compiled on first use.

    ``dynamic_smem`` above 48 KiB raises the kernel's dynamic shared-memory limit (once per device
    and size), as CUDA requires before such a launch.
    """
    key = (device_id, spec)
    kern = _kernels.get(key)
    if kern is not None and (dynamic_smem <= 48 * 1024 or _smem_limit[key] >= dynamic_smem):
        return kern  # the hot path: one dict lookup
    import cupy

    with _lock:
        kern = _kernels.get(key)
        if kern is None:
            src, _ = family_source(spec.family)
            with cupy.cuda.Device(device_id):
                mod = cupy.RawModule(code=src, options=spec.all_options(),
                                     name_expressions=(spec.name,))
                kern = mod.get_function(spec.name)
                kern.compile()  # compile and load now, not inside the first launch
            _kernels[key] = kern
            _smem_limit[key] = 48 * 1024
        if dynamic_smem > _smem_limit[key]:
            with cupy.cuda.Device(device_id):
                kern.max_dynamic_shared_size_bytes = int(dynamic_smem)
            _smem_limit[key] = int(dynamic_smem)
    return kern


@dataclass
class CompileReport:
    """What ptxas said about one specialisation for one architecture."""

    name: str
    arch: str
    registers: int
    shared_bytes: int
    stack_bytes: int
    spill_stores: int
    spill_loads: int
    cubin_size: int
    log: str

    def summary(self) -> str:
        return (f"{self.arch} {self.name}: {self.registers} registers, {self.shared_bytes} B static "
                f"smem, {self.stack_bytes} B stack, spills {self.spill_stores}/{self.spill_loads} B")


def compile_report(spec: Specialisation, arch: str) -> CompileReport:
    """Compile `spec` for `arch` (e.g. "sm_90") without a GPU and parse ptxas's report.

    Raises RuntimeError with the NVRTC log on a compile error.
    """
    from cupy_backends.cuda.libs import nvrtc

    src, _ = family_source(spec.family)
    prog = nvrtc.createProgram(src, f"{spec.family}.cu", [], [])
    try:
        nvrtc.addNameExpression(prog, spec.name)
        opts = list(spec.all_options()) + [f"-arch={arch}", "-Xptxas=-v"]
        try:
            nvrtc.compileProgram(prog, opts)
        except Exception as exc:
            raise RuntimeError(f"NVRTC failed on {spec.name} for {arch}:\n"
                               f"{nvrtc.getProgramLog(prog)}") from exc
        log = nvrtc.getProgramLog(prog)
        mangled = nvrtc.getLoweredName(prog, spec.name)
        cubin = nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)
    return _parse_ptxas(log, mangled, spec.name, arch, len(cubin))


def _parse_ptxas(log: str, mangled: str, name: str, arch: str, cubin_size: int) -> CompileReport:
    # ptxas prints a block per entry: "Compiling entry function '<mangled>'", then the stack/spill
    # line and the registers/smem line. Take the block of our entry.
    start = log.find(f"'{mangled}'")
    if start < 0:
        raise RuntimeError(f"no ptxas report for {name} in the NVRTC log:\n{log}")
    block = log[start:]
    nxt = block.find("Compiling entry function", 1)
    if nxt > 0:
        block = block[:nxt]

    def num(pattern, default=0):
        m = re.search(pattern, block)
        return int(m.group(1)) if m else default

    return CompileReport(
        name=name, arch=arch,
        registers=num(r"Used (\d+) registers"),
        shared_bytes=num(r"(\d+) bytes smem"),
        stack_bytes=num(r"(\d+) bytes stack frame"),
        spill_stores=num(r"(\d+) bytes spill stores"),
        spill_loads=num(r"(\d+) bytes spill loads"),
        cubin_size=cubin_size, log=log)
