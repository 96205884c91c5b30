"""Which mlx-lm architectures run on the paged path, and how: explicit data, one row each.

An architecture is served when its attention can be routed to `paged_attention`
without changing what it computes:

- ``"sdpa"``: the model's attention calls mlx-lm's ``scaled_dot_product_attention``
  after a standard ``cache.update_and_fetch``; the hook rebinds that name in the
  architecture's module. Sliding-window layers come from the model's own
  ``make_cache`` (a ``RotatingKVCache(max_size=W)`` layer attends to its last ``W``
  positions), and ``sinks`` are passed through where the model passes them.
- ``"gemma2"``: gemma2 computes attention inline (soft-capped scores); the hook
  routes its ``Attention.__call__`` to `paged_attention` with ``softcap`` when the
  layer's cache is ours and leaves every other call to the original.

Everything else (MLA, state-space layers, models that call ``mx.fast`` directly,
RoPE variants that need an int offset) is refused by `resolve` before any work,
with the model type and the supported list.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

from metal_attn.errors import ModelError

__all__ = ["ARCHITECTURES", "Architecture", "LayerSpec", "ResolvedModel", "resolve", "supported_model_types"]


def _text_model(model: nn.Module) -> nn.Module:
    """The module that holds ``model`` (the transformer body) and the LM head."""
    return model


def _gemma3_text_model(model: nn.Module) -> nn.Module:
    return model.language_model


def _linear_head(lm: nn.Module, h: mx.array) -> mx.array:
    """``lm_head`` where the model has one, else the tied embedding (as the models' own ``__call__`` does)."""
    if "lm_head" in lm:
        return lm.lm_head(h)
    return lm.model.embed_tokens.as_linear(h)


def _gemma2_head(lm: nn.Module, h: mx.array) -> mx.array:
    out = lm.model.embed_tokens.as_linear(h)
    cap = lm.final_logit_softcapping
    return mx.tanh(out / cap) * cap


@dataclasses.dataclass(frozen=True)
class Architecture:
    """How one mlx-lm model module is served on the paged path."""

    #: The ``mlx_lm.models`` module that implements it.
    module: str
    #: ``"sdpa"`` (rebind ``scaled_dot_product_attention``) or ``"gemma2"`` (inline attention override).
    attention: str
    #: Config ``model_type`` values that mlx-lm loads into this module (for messages and docs).
    model_types: tuple[str, ...]
    #: The module holding ``.model`` (body: embeddings, layers, final norm) and the head.
    text_model: Callable[[nn.Module], nn.Module] = _text_model
    #: Normed hidden states ``[N, 1, hidden]`` -> logits ``[N, 1, vocab]``, as the model's ``__call__`` does.
    head: Callable[[nn.Module, mx.array], mx.array] = _linear_head


#: Served architectures, by ``mlx_lm.models`` module name.
ARCHITECTURES: dict[str, Architecture] = {
    a.module.rsplit(".", 1)[-1]: a
    for a in (
        Architecture("mlx_lm.models.llama", "sdpa", ("llama", "mistral", "iquestcoder", "xverse")),
        Architecture("mlx_lm.models.qwen2", "sdpa", ("qwen2",)),
        Architecture("mlx_lm.models.qwen3", "sdpa", ("qwen3",)),
        Architecture("mlx_lm.models.phi3", "sdpa", ("phi3",)),
        Architecture("mlx_lm.models.gemma2", "gemma2", ("gemma2",), head=_gemma2_head),
        Architecture("mlx_lm.models.gemma3_text", "sdpa", ("gemma3_text",)),
        Architecture("mlx_lm.models.gemma3", "sdpa", ("gemma3",), text_model=_gemma3_text_model),
        Architecture("mlx_lm.models.gpt_oss", "sdpa", ("gpt_oss",)),
    )
}

#: For a wrapper architecture, the module whose attention actually runs (gemma3 wraps gemma3_text).
_ATTENTION_MODULES: dict[str, tuple[str, ...]] = {
    "gemma3": ("mlx_lm.models.gemma3_text",),
}


def attention_modules(name: str) -> tuple[str, ...]:
    """The modules whose attention the hook must cover for the architecture ``name``."""
    return _ATTENTION_MODULES.get(name, (ARCHITECTURES[name].module,))


def supported_model_types() -> list[str]:
    """Every config ``model_type`` the paged path serves."""
    return sorted({t for a in ARCHITECTURES.values() for t in a.model_types})


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """What one layer's attention needs from the paged path."""

    sliding_window: int | None = None


@dataclasses.dataclass(frozen=True)
class ResolvedModel:
    """An architecture row plus the per-layer facts read off one model instance."""

    name: str
    arch: Architecture
    model_type: str
    layers: tuple[LayerSpec, ...]
    #: Modules whose attention the hook must cover for this model.
    attention_modules: tuple[str, ...]

    @property
    def num_layers(self) -> int:
        return len(self.layers)


def _model_type(model: nn.Module) -> str:
    args = getattr(model, "args", None)
    return str(getattr(model, "model_type", None) or getattr(args, "model_type", None) or type(model).__name__)


def _unsupported(model_type: str, module: str, why: str) -> ModelError:
    return ModelError(
        f"model_type={model_type!r} (module {module}) is not supported on the paged path: {why} "
        f"(supported model types: {', '.join(supported_model_types())})"
    )


def _layer_specs(model: nn.Module, model_type: str, module: str) -> tuple[LayerSpec, ...]:
    """Per-layer windows from the model's own cache layout (``make_prompt_cache``)."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

    specs = []
    for i, c in enumerate(make_prompt_cache(model)):
        if type(c) is KVCache:
            specs.append(LayerSpec())
        elif type(c) is RotatingKVCache and c.keep == 0:
            if not isinstance(c.max_size, int) or c.max_size < 1:
                raise _unsupported(model_type, module, f"layer {i} is a sliding layer whose window is "
                                   f"{c.max_size!r} (its config names a sliding layer without a sliding_window?)")
            specs.append(LayerSpec(sliding_window=int(c.max_size)))
        else:
            detail = f"keep={c.keep}" if isinstance(c, RotatingKVCache) else "not a KVCache or RotatingKVCache"
            raise _unsupported(model_type, module, f"layer {i} uses a {type(c).__name__} ({detail})")
    return tuple(specs)


def _check_rope(model: nn.Module, model_type: str, module: str) -> None:
    """Refuse RoPE modules that cannot take one offset per token row."""
    from mlx_lm.models.rope_utils import DynamicNTKScalingRoPE

    for name, m in model.named_modules():
        if isinstance(m, DynamicNTKScalingRoPE):
            raise _unsupported(
                model_type, module, f"{name} is a DynamicNTKScalingRoPE, which takes an int offset only "
                "(the packed step gives each token row its own position)"
            )


def resolve(model: nn.Module) -> ResolvedModel:
    """Check that ``model`` can be served and read its per-layer facts; raise `ModelError` otherwise."""
    if not isinstance(model, nn.Module):
        raise ModelError(f"model={type(model).__name__} (allowed: an mlx-lm model, an mlx.nn.Module)")
    module = type(model).__module__
    model_type = _model_type(model)
    short = module.rsplit(".", 1)[-1] if module.startswith("mlx_lm.models.") else None
    arch = ARCHITECTURES.get(short) if short else None
    if arch is None:
        raise _unsupported(model_type, module, "its attention is not known to go through the paged hook")
    _check_rope(model, model_type, module)
    layers = _layer_specs(model, model_type, module)
    if len(layers) != len(model.layers):
        raise _unsupported(model_type, module, f"make_cache gives {len(layers)} caches for {len(model.layers)} layers")
    return ResolvedModel(
        name=short,
        arch=arch,
        model_type=model_type,
        layers=layers,
        attention_modules=attention_modules(short),
    )

