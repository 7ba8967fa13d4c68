"""``cuflash-precompile``: compile cuflash's kernels ahead of time into the on-disk cache.

Every specialisation the dispatcher can pick on a device of a given architecture (the forward
kernels of every dtype, head-dim bucket and mask, the backward's, the decode family's, the
variants', the merge kernel and the mask summary's) is compiled through NVRTC into ``$CUFLASH_CACHE_DIR`` (default
``~/.cache/cuflash``), where `cuflash._compile.get_kernel` finds it on first use instead of
compiling (about a second per specialisation). No GPU is needed: name the architecture. The cache
key holds the NVRTC version, so precompile with the NVRTC the target machine will load (the
``CUFLASH_NVRTC_LIBRARY`` environment variable picks one).

Example::

    cuflash-precompile --arch sm_90 --jobs 8          # an H100/H200 (sm_90a Hopper kernels too)
    CUFLASH_CACHE_DIR=/shared/cuflash cuflash-precompile --arch sm_80 --arch sm_90
"""
from __future__ import annotations

import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import List, Sequence, Tuple

import click

from . import _compile


def specialisations(compute_capability: int) -> List[_compile.Specialisation]:
    """Every kernel specialisation cuflash can launch on a device of this compute capability (the
    set the compile check builds; Hopper ones carry their fixed ``sm_90a`` arch)."""
    from . import _decode, _dispatch
    from ._dispatch_variants import hopper_variant_compile_specs, form_compile_specs
    from ._dispatch_variants import hopper_bwd_variant_compile_specs
    from ._dispatch_variants import (mod_compile_specs, tensorcore_variant_backward_compile_specs,
                                     tensorcore_variant_compile_specs,
                                     variant_backward_compile_specs, variant_compile_specs)

    cc = int(compute_capability)
    specs = [plan.spec for plan in _dispatch.all_specialisations(cc)]
    specs += _dispatch.backward_kernel_specs(cc)
    specs += _dispatch.varlen_backward_kernel_specs(cc)  # attention_varlen_backward
    specs += _dispatch.varlen_forward_kernel_specs(cc)  # attention_varlen's dense path
    if cc == 90:
        specs += _dispatch.varlen_hopper_kernel_specs()  # and its Hopper form (sm_90a)
        specs += _dispatch.presplit_kernel_specs()  # K, V split once (HOPPER_F32_PRESPLIT)
    specs += _decode.all_decode_specialisations()
    if cc == 90:  # the variants' compile set is built for the H200's architecture (VARIANTS.md)
        specs += variant_compile_specs() + variant_backward_compile_specs()
        specs += mod_compile_specs()  # user hooks of the compile check's examples (mods.py)
        from ._mask_blocks import hook_compile_specs
        specs += hook_compile_specs()  # and their mask_mod summaries (mask_blocks.cu)
        specs += tensorcore_variant_compile_specs(cc)  # the mma.sync forward's policies
        specs += hopper_variant_compile_specs()  # the Hopper forward's policies (sm_90a)
        specs += tensorcore_variant_backward_compile_specs(cc)  # and the mma.sync backward's
        specs += hopper_bwd_variant_compile_specs()  # the Hopper backward's (sm_90a)
        specs += form_compile_specs(cc)  # the forms behind flags (off by default)
        from ._dispatch_variants import hook_blocks_compile_specs
        specs += hook_blocks_compile_specs(cc)  # HOOK_BLOCKS' narrowed walks (off)
    for t, acc in (("cuflash::fp16_t", "float"), ("cuflash::bf16_t", "float"),
                   ("float", "float"), ("double", "double")):
        specs.append(_compile.Specialisation("merge", f"cuflash::cuflash_merge_states<{t}, {acc}>"))
    from ._mask_blocks import compile_specs as mask_block_specs
    specs += mask_block_specs()   # cuflash.block_mask and the per-call mask summary
    return list(dict.fromkeys(specs))  # unique, in order


def _target(spec: _compile.Specialisation, arch: str) -> str:
    return spec.arch or arch


def precompile(specs: Sequence[_compile.Specialisation], arch: str, jobs: int = 1,
               on_done=None) -> Tuple[int, int]:
    """Compile `specs` for `arch` (``"sm_90"``; a spec's fixed arch wins) into the disk cache with
    `jobs` threads (NVRTC runs without the GIL). Returns (compiled now, already cached).
    `on_done(spec, compiled_now)` is called after each."""
    def one(spec):
        _, _, now = _compile.compiled_image(spec, _target(spec, arch))
        if on_done is not None:
            on_done(spec, now)
        return now

    with ThreadPoolExecutor(max_workers=max(1, int(jobs))) as pool:
        results = list(pool.map(one, specs))
    return sum(results), len(results) - sum(results)


_ARCH = re.compile(r"^sm_(\d+)$")


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--arch", "archs", multiple=True, metavar="sm_XY",
              help="Target architecture, e.g. sm_80 or sm_90 (repeat for several). Default: the "
                   "current GPU's.")
@click.option("--jobs", "-j", type=click.IntRange(1), default=None,
              help="Parallel NVRTC compilations (default: the CPU count).")
@click.option("--only", metavar="REGEX", default=None,
              help="Only the specialisations whose C++ name matches this regular expression.")
@click.option("--list", "list_only", is_flag=True, help="List the specialisations and exit.")
def main(archs, jobs, only, list_only):
    """Compile cuflash's kernels ahead of time into $CUFLASH_CACHE_DIR (default
    ~/.cache/cuflash), so that no call compiles at first use."""
    if not archs:
        try:
            archs = (_compile.device_arch(0),)
        except Exception as exc:
            raise click.UsageError(f"no --arch given and no GPU to take it from ({exc})")
    pattern = re.compile(only) if only else None
    jobs = jobs or os.cpu_count() or 1
    for arch in archs:
        m = _ARCH.match(arch)
        if not m:
            raise click.BadParameter(f"expected sm_<compute capability>, got {arch!r}",
                                     param_hint="--arch")
        specs = [s for s in specialisations(int(m.group(1)))
                 if pattern is None or pattern.search(s.name)]
        if list_only:
            for s in specs:
                click.echo(f"{_target(s, arch)}  {s.family}  {s.name}")
            continue
        major, minor = _compile.nvrtc_version()
        click.echo(f"{arch}: {len(specs)} specialisations, NVRTC {major}.{minor}, {jobs} jobs, "
                   f"cache {_compile.cache_dir()}")
        t0, done = time.perf_counter(), [0]

        def progress(spec, now, total=len(specs)):
            done[0] += 1
            if now and (done[0] % 25 == 0 or done[0] == total):
                click.echo(f"  {done[0]}/{total} ({time.perf_counter() - t0:.0f} s)")

        try:
            new, cached = precompile(specs, arch, jobs, progress)
        except RuntimeError as exc:
            raise click.ClickException(str(exc))
        click.echo(f"{arch}: {new} compiled, {cached} already cached, "
                   f"{time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":  # pragma: no cover
    main()
