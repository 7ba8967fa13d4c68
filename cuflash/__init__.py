"""cuflash: exact scaled-dot-product attention on NVIDIA GPUs from CuPy, audited against float64.

``cuflash.attention(q, k, v)`` computes ``softmax(scale * q @ k^T) @ v`` with CUDA kernels that run
the tiled online-softmax recurrence (``kernels_cu/``), compiled at first use by NVRTC through CuPy;
``cuflash.attention_backward`` gives its gradients. NumPy inputs take a NumPy implementation of the
same recurrences, so the API works on machines without a GPU. ``cuflash.reference`` holds the
float64 SciPy ground truth; ``cuflash-check`` audits the kernels against it.
"""
from ._api import (attention, attention_backward, attention_backward_workspace_size,
                   attention_workspace_size, backward_dispatch_info, dispatch_info,
                   gpu_available, merge_states)
from ._mask_blocks import BlockMask, block_mask
from ._kvcache import attention_with_kvcache, attention_with_kvcache_workspace_size
from ._varlen import attention_varlen, attention_varlen_workspace_size, varlen_dispatch_info
from ._varlen_backward import (attention_varlen_backward, attention_varlen_backward_workspace_size,
                               varlen_backward_dispatch_info)
from .mods import MaskMod, ScoreMod

__version__ = "0.1.0"

__all__ = ["attention", "attention_backward", "attention_backward_workspace_size", "merge_states",
           "dispatch_info", "backward_dispatch_info", "gpu_available", "attention_with_kvcache",
           "attention_varlen", "attention_workspace_size",
           "attention_with_kvcache_workspace_size", "attention_varlen_workspace_size",
           "attention_varlen_backward", "attention_varlen_backward_workspace_size",
           "varlen_backward_dispatch_info", "varlen_dispatch_info",
           "ScoreMod", "MaskMod", "block_mask", "BlockMask", "__version__"]
