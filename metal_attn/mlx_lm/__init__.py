"""Serve unmodified mlx-lm models on the paged cache.

    from metal_attn import mlx_lm as ma_lm
    model, tokenizer = ma_lm.load()                   # the default model (SmolLM2-135M-Instruct)
    paged = ma_lm.PagedModel(model, num_blocks=256)   # installs the attention hook for its modules
    # or, for whole requests: metal_attn.engine.Engine(model, tokenizer)

`install` / `uninstall` / `installed` put the attention hook in place explicitly;
``import metal_attn`` never does. `supported_model_types` lists what is served.
"""

from __future__ import annotations

from metal_attn.mlx_lm.architectures import ARCHITECTURES, resolve, supported_model_types
from metal_attn.mlx_lm.hook import install, installed, is_installed, uninstall
from metal_attn.mlx_lm.layer_cache import PagedLayerCache
from metal_attn.mlx_lm.loading import load
from metal_attn.mlx_lm.runner import ModelShape, PagedModel, inspect_model

__all__ = [
    "ARCHITECTURES",
    "ModelShape",
    "PagedLayerCache",
    "PagedModel",
    "inspect_model",
    "install",
    "installed",
    "is_installed",
    "load",
    "resolve",
    "supported_model_types",
    "uninstall",
]
