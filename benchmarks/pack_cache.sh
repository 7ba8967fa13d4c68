#!/usr/bin/env bash
# Compile every kernel specialisation here, without a GPU, with the NVRTC the GPU machine has,
# and pack the cache for run_gpu_suite.sh's CACHE_TAR (a GPU call then spends no time compiling):
#     bash benchmarks/pack_cache.sh devrun/cache.tar.xz [sm_90]
# The cache key holds the kernel source, the options, the target and NVRTC's major.minor, so the
# packed cubins are exactly what the GPU machine would compile; repack after any change to
# kernels_cu/. NVRTC: $CUFLASH_NVRTC_LIBRARY if set, else NVRTC 13.0 installed by pip into
# .nvrtc-13.0 (the version the GPU machine has; 2026-12). About 8 minutes on two cores; the
# archive is ~11 MB (64 MiB may be carried to the GPU machine). ONLY=REGEX: those specialisations
# alone (precompile --only).
set -euo pipefail
out=${1:?usage: pack_cache.sh OUT.tar.xz [ARCH]}
arch=${2:-sm_90}
cd "$(dirname "$0")/.."
if [ -z "${CUFLASH_NVRTC_LIBRARY:-}" ]; then
  [ -d .nvrtc-13.0 ] || python3 -m pip install --target .nvrtc-13.0 "nvidia-cuda-nvrtc==13.0.*" >/dev/null
  export CUFLASH_NVRTC_LIBRARY="$PWD/.nvrtc-13.0/nvidia/cu13/lib/libnvrtc.so.13"
  export LD_LIBRARY_PATH="$PWD/.nvrtc-13.0/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
cache=$(mktemp -d)/cuflash-cache
CUFLASH_CACHE_DIR="$cache" python3 -m cuflash.precompile --arch "$arch" ${ONLY:+--only "$ONLY"} | tail -1
mkdir -p "$(dirname "$out")"
tar cJf "$out" -C "$(dirname "$cache")" "$(basename "$cache")"
echo "packed $(ls "$cache" | wc -l) files into $out ($(du -h "$out" | cut -f1))"
