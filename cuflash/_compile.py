"""Compile-and-cache: CUDA C from ``kernels_cu/`` to loaded kernels, through NVRTC.

A *specialisation* is one template instantiation of one kernel family (one ``.cu`` file), for
example ``cuflash::cuflash_fwd_generic<cuflash::fp16_t, float, 64, 64, true>``. It compiles on
first use:

1. `family_source` reads ``kernels_cu/<family>.cu`` and inlines its local ``#include "..."``
   headers (recursively) (`spec_source` appends a specialisation's generated code), so the source
   NVRTC sees, and therefore the on-disk cache key (3.),
   changes whenever any kernel file it depends on changes;
2. `get_kernel` compiles it for the architecture of the device (``sm_<major><minor>``, or the
   fixed ``arch`` of the spec: the Hopper kernel's ``sm_90a``, whose wgmma and setmaxnreg exist only
   on compute capability 9.0 exactly) through NVRTC's C API (ctypes, on the library CuPy loaded),
   loads the cubin with ``cupy.cuda.function.Module`` and keeps the kernel in memory per device, so
   each specialisation is compiled at most once per process and device.
3. Cubins are cached on disk under ``$CUFLASH_CACHE_DIR`` (default ``~/.cache/cuflash``), keyed
   on the source hash, the name expression, the options (the architecture among them) and the
   NVRTC version, so a later process reads them instead of compiling. ``python -m
   cuflash.precompile`` (``cuflash-precompile``) fills that cache ahead of time, for any
   architecture and without a GPU (a container image, a cluster's shared file system, a machine
   whose GPU time is scarce).

The same NVRTC calls compile every kernel, so what runs is what the compile check inspects (no
CuPy ``RawModule`` and its own option set in between; CuPy's ``RawModule(code=...)`` could not
target ``sm_90a`` anyway: it appends its own ``-arch``). A device newer than the NVRTC knows gets
PTX for the newest architecture NVRTC supports, which the driver compiles at load time. The
environment variable ``CUFLASH_NVRTC_LIBRARY`` (a path to ``libnvrtc.so.*``) picks another NVRTC;
CI uses it to compile every kernel with the oldest supported NVRTC too.

`compile_report` compiles a specialisation for a named architecture without a GPU (through
NVRTC directly) and returns ptxas's resource report; the tests use it to compile every
specialisation for sm_80 and sm_90 (and the sm_90a ones for sm_90a) and to reject local-memory
spills.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Tuple

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
    arch: Optional[str] = None  # a fixed target such as "sm_90a"; None: the device's own
    # Generated code appended to the family's source (user hooks, cuflash/mods.py); part of
    # the source NVRTC sees, so of every cache key.
    extra_source: str = ""

    def all_options(self):
        return NVRTC_OPTIONS + self.options


def spec_source(spec: Specialisation) -> Tuple[str, str]:
    """(the source NVRTC compiles for `spec`, its sha256): the family's, plus any generated
    code of the specialisation."""
    src, digest = family_source(spec.family)
    if not spec.extra_source:
        return src, digest
    src = src + spec.extra_source
    return src, hashlib.sha256(src.encode()).hexdigest()


_lock = threading.Lock()
_kernels: Dict[Tuple[int, Specialisation], object] = {}
_smem_limit: Dict[Tuple[int, Specialisation], int] = {}


def get_kernel(spec: Specialisation, device_id: int, dynamic_smem: int = 0):
    """The loaded kernel (a `cupy.cuda.function.Function`, called like a RawKernel) for `spec` on
    `device_id`, compiled on first use or read from the disk cache.

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
            with cupy.cuda.Device(device_id):
                kern = _load(spec, spec.arch or device_arch(device_id))
            _kernels[key] = kern
            _smem_limit[key] = 48 * 1024
        if dynamic_smem > _smem_limit[key]:
            with cupy.cuda.Device(device_id):
                cupy.cuda.driver.funcSetAttribute(
                    kern.ptr, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, int(dynamic_smem))
            _smem_limit[key] = int(dynamic_smem)
    return kern


_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


def cache_dir() -> Path:
    return Path(os.environ.get("CUFLASH_CACHE_DIR") or Path.home() / ".cache" / "cuflash")


@functools.lru_cache(maxsize=None)
def device_arch(device_id: int) -> str:
    """The NVRTC target for a device: ``sm_<cc>`` when this NVRTC supports it, else
    ``compute_<newest supported below it>`` (PTX; the driver compiles it at load time)."""
    import cupy

    cc = int(cupy.cuda.Device(device_id).compute_capability)
    supported = supported_archs()
    if not supported or cc in supported:
        return f"sm_{cc}"
    older = [a for a in supported if a < cc]
    if not older:
        major, minor = nvrtc_version()
        raise RuntimeError(f"NVRTC {major}.{minor} supports none of the architectures up to "
                           f"compute capability {cc} (it supports {supported})")
    return f"compute_{max(older)}"


def cache_path(spec: Specialisation, arch: str) -> Path:
    """Where the compiled image of `spec` for `arch` is cached (see the module docstring)."""
    _, src_hash = spec_source(spec)
    major, minor = nvrtc_version()
    key = hashlib.sha256("\0".join([src_hash, spec.name, *spec.all_options(), f"-arch={arch}",
                                     f"nvrtc{major}.{minor}"]).encode()).hexdigest()
    return cache_dir() / f"{spec.family}-{arch}-{key[:32]}.cubin"


def compiled_image(spec: Specialisation, arch: str) -> Tuple[bytes, str, bool]:
    """(image, mangled name, compiled now?) of `spec` for `arch`: from the disk cache, else
    compiled through NVRTC and stored there. The image is a cubin for ``sm_*`` targets and PTX for
    ``compute_*`` ones."""
    path = cache_path(spec, arch)
    name_path = path.with_suffix(".name")
    try:
        image, mangled = path.read_bytes(), name_path.read_text()
        if image and mangled:
            return image, mangled, False
    except OSError:
        pass
    src, _ = spec_source(spec)
    image, _, mangled = nvrtc_compile(src, f"{spec.family}.cu", spec.name,
                                      list(spec.all_options()) + [f"-arch={arch}"])
    try:  # the cache is an optimisation: a read-only home directory must not break a call
        path.parent.mkdir(parents=True, exist_ok=True)
        for p, data in ((path, image), (name_path, mangled.encode())):
            tmp = p.with_suffix(f".tmp{os.getpid()}.{threading.get_ident()}")
            tmp.write_bytes(data)
            os.replace(tmp, p)
    except OSError:
        pass
    return image, mangled, True


def _load(spec: Specialisation, arch: str):
    """Load `spec`'s image for `arch` on the current device: a `cupy.cuda.function.Function`
    (called like a RawKernel: ``kern(grid, block, args, shared_mem=..., stream=...)``)."""
    from cupy.cuda import function

    image, mangled, _ = compiled_image(spec, arch)
    mod = function.Module()
    mod.load(image)
    return mod.get_function(mangled)  # the Function holds a reference to its Module


# ---- NVRTC's C API through ctypes (CuPy's binding returns the cubin one byte short in 14.2).

_NVRTC = None


def _nvrtc():
    global _NVRTC
    if _NVRTC is None and os.environ.get("CUFLASH_NVRTC_LIBRARY"):
        # An explicit NVRTC (e.g. the oldest one the project supports, in CI); the directory of
        # its libnvrtc-builtins must be on LD_LIBRARY_PATH.
        path = os.environ["CUFLASH_NVRTC_LIBRARY"]
        try:
            lib = ctypes.CDLL(path)
        except OSError as exc:
            raise RuntimeError(f"CUFLASH_NVRTC_LIBRARY={path!r} cannot be loaded: {exc}") from exc
        _NVRTC = _declare(lib)
    if _NVRTC is None:
        try:  # make CuPy load the library it uses; dlopen then finds it by its soname
            from cupy_backends.cuda.libs import nvrtc as _cupy_nvrtc

            _cupy_nvrtc.getVersion()
        except Exception:
            pass
        errors = []
        for soname in ("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"):
            try:
                lib = ctypes.CDLL(soname)
                break
            except OSError as exc:
                errors.append(str(exc))
        else:
            raise RuntimeError("cannot load the NVRTC library (install cupy and the NVRTC wheel, "
                               "e.g. pip install 'cuflash[cuda13]'): " + "; ".join(errors))
        _NVRTC = _declare(lib)
    return _NVRTC


def _declare(lib):
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    lib.nvrtcGetLoweredName.argtypes = [ctypes.c_void_p, ctypes.c_char_p,
                                        ctypes.POINTER(ctypes.c_char_p)]
    return lib


def _check_nvrtc(lib, status, what):
    if status != 0:
        raise RuntimeError(f"NVRTC {what} failed: {lib.nvrtcGetErrorString(status).decode()}")


def nvrtc_version() -> Tuple[int, int]:
    lib = _nvrtc()
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check_nvrtc(lib, lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "version")
    return major.value, minor.value


@contextlib.contextmanager
def _program(src: str, filename: str, options, name: Optional[str] = None):
    """An NVRTC program compiled with `options` (and the name expression `name`): yields
    (library, program, status, log); destroyed on exit."""
    lib = _nvrtc()
    prog = ctypes.c_void_p()
    _check_nvrtc(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), filename.encode(),
                                             0, None, None), "createProgram")
    try:
        if name is not None:
            _check_nvrtc(lib, lib.nvrtcAddNameExpression(prog, name.encode()),
                         "addNameExpression")
        opts = [o.encode() for o in options]
        status = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        _check_nvrtc(lib, lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)), "getProgramLog")
        buf = ctypes.create_string_buffer(size.value)
        _check_nvrtc(lib, lib.nvrtcGetProgramLog(prog, buf), "getProgramLog")
        yield lib, prog, status, buf.value.decode(errors="replace")
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


@functools.lru_cache(maxsize=None)
def supported_archs() -> Tuple[int, ...]:
    """The compute capabilities this NVRTC can build cubins for (e.g. (75, 80, ..., 120)); empty if
    the library cannot say (then every target is tried)."""
    lib = _nvrtc()
    n = ctypes.c_int()
    try:
        if lib.nvrtcGetNumSupportedArchs(ctypes.byref(n)) != 0:
            return ()
        archs = (ctypes.c_int * n.value)()
        if lib.nvrtcGetSupportedArchs(archs) != 0:
            return ()
    except AttributeError:  # an NVRTC older than 11.2
        return ()
    return tuple(archs)


def nvrtc_compile(src: str, filename: str, name: str, options) -> Tuple[bytes, str, str]:
    """Compile `src` and instantiate the name expression `name`: (cubin, log, mangled name).

    Raises RuntimeError with NVRTC's log on a compile error.
    """
    with _program(src, filename, options, name) as (lib, prog, status, log):
        if status != 0:
            raise RuntimeError(f"NVRTC failed on {name} with {' '.join(options)}:\n{log}")
        lowered = ctypes.c_char_p()
        _check_nvrtc(lib, lib.nvrtcGetLoweredName(prog, name.encode(), ctypes.byref(lowered)),
                     "getLoweredName")
        mangled = lowered.value.decode()
        size = ctypes.c_size_t()
        if any(o.startswith("-arch=compute_") for o in options):  # a virtual target: PTX
            _check_nvrtc(lib, lib.nvrtcGetPTXSize(prog, ctypes.byref(size)), "getPTXSize")
            ptx = ctypes.create_string_buffer(size.value)
            _check_nvrtc(lib, lib.nvrtcGetPTX(prog, ptx), "getPTX")
            return ptx.raw, log, mangled  # NUL-terminated, as cuModuleLoadData wants PTX
        _check_nvrtc(lib, lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "getCUBINSize")
        cubin = ctypes.create_string_buffer(size.value)
        _check_nvrtc(lib, lib.nvrtcGetCUBIN(prog, cubin), "getCUBIN")
        return cubin.raw, log, mangled


def nvrtc_compile_ptx(src: str, filename: str, options) -> Tuple[bool, str]:
    """Compile `src` without a name expression: (success, NVRTC's log). For checking generated
    code (cuflash/mods.py) without a GPU."""
    with _program(src, filename, options) as (_, _, status, log):
        return status == 0, log


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
    cubin: bytes = b""
    notes: Tuple[str, ...] = ()  # other ptxas messages about this function

    def summary(self) -> str:
        text = (f"{self.arch} {self.name}: {self.registers} registers, {self.shared_bytes} B static "
                f"smem, {self.stack_bytes} B stack, spills {self.spill_stores}/{self.spill_loads} B")
        codes = sorted({m.group(0) for n in self.notes for m in [re.search(r"\(C\d+\)", n)] if m})
        return text + (f" (ptxas notes: {' '.join(codes)})" if codes else "")


def compile_report(spec: Specialisation, arch: Optional[str] = None) -> CompileReport:
    """Compile `spec` for `arch` (e.g. "sm_90"; default: the spec's fixed arch) without a GPU and
    parse ptxas's report.

    Raises RuntimeError with the NVRTC log on a compile error.
    """
    arch = arch or spec.arch
    if arch is None:
        raise ValueError(f"{spec.name} has no fixed architecture; name one")
    src, _ = spec_source(spec)
    opts = list(spec.all_options()) + [f"-arch={arch}", "-Xptxas=-v"]
    cubin, log, mangled = nvrtc_compile(src, f"{spec.family}.cu", spec.name, opts)
    return _parse_ptxas(log, mangled, spec.name, arch, cubin)


def _parse_ptxas(log: str, mangled: str, name: str, arch: str, cubin: bytes) -> CompileReport:
    # ptxas prints a block per entry: "Compiling entry function '<mangled>'", then the stack/spill
    # line and the registers/smem line. Take the block of our entry. (Other messages can name the
    # function before that line, e.g. NVRTC 13.0's "(C7519) warpgroup.arrive is injected ...";
    # they are kept as notes.)
    start = log.find(f"Compiling entry function '{mangled}'")
    if start < 0:
        raise RuntimeError(f"no ptxas report for {name} in the NVRTC log:\n{log}")
    block = log[start:]
    nxt = block.find("Compiling entry function", 1)
    if nxt > 0:
        block = block[:nxt]

    def num(pattern, default=0):
        m = re.search(pattern, block)
        return int(m.group(1)) if m else default

    notes = tuple(line.strip() for line in log.splitlines()
                  if mangled in line and "Compiling entry" not in line
                  and "Function properties" not in line)
    return CompileReport(
        name=name, arch=arch, notes=notes,
        registers=num(r"Used (\d+) registers"),
        shared_bytes=num(r"(\d+) bytes smem"),
        stack_bytes=num(r"(\d+) bytes stack frame"),
        spill_stores=num(r"(\d+) bytes spill stores"),
        spill_loads=num(r"(\d+) bytes spill loads"),
        cubin_size=len(cubin), log=log, cubin=cubin)
