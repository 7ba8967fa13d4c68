"""CUDA C sources of cuflash's kernels, shipped as package data.

Nothing here is imported for its code: ``cuflash._compile`` reads the ``.cu`` and ``.cuh``
files in this folder, inlines the local headers and hands the result to NVRTC.
"""
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parent
