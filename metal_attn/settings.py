"""Settings: one pydantic-settings model, environment prefix ``METAL_ATTN_``.

Read once per process (`get_settings`), overridable in code with
`override_settings` (a context manager, for tests and A/B runs; context-local, so
threads never see, or undo, each other's overrides). Bad values
fail at load with the variable, the value and the allowed domain; unknown
``METAL_ATTN_*`` names are warned about with the closest valid name.
"""

from __future__ import annotations

import contextlib
import contextvars
import difflib
import os
import sys
import threading
import types
import typing
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, Field, TypeAdapter, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from metal_attn import _epoch
from metal_attn.checks import is_decimal
from metal_attn.errors import SettingsError, SettingsWarning

PREFIX = "METAL_ATTN_"

#: Variables that were removed or renamed, and what replaced them.
RENAMED_VARIABLES: dict[str, str] = {
    "METAL_ATTN_BACKEND": "METAL_ATTN_PROVIDER (force one provider by name)",
    "METAL_ATTN_DISABLE_PROVIDERS": "METAL_ATTN_DISABLED_PROVIDERS",
}

_CommaList = Annotated[tuple[str, ...], NoDecode]
#: An optional comma list: NoDecode must wrap the whole union, or pydantic-settings reads the value as JSON
#: (``null`` was "unset", ``["a","b"]`` a list, ``1`` an error about a tuple).
_OptionalCommaList = Annotated[tuple[str, ...] | None, NoDecode]


def _env(name: str, *aliases: str) -> Any:
    """Field alias: our ``METAL_ATTN_`` name first, then upstream spellings."""
    return AliasChoices(name, PREFIX + name.upper(), *aliases)


#: Per-provider disable switches: provider name -> (settings field, the variable that sets it).
PROVIDER_TOGGLES: dict[str, tuple[str, str]] = {
    "gqa_decode": ("disable_gqa_decode", "METAL_ATTN_DISABLE_GQA_DECODE=1"),
    "nax_prefill": ("disable_nax", "METAL_ATTN_DISABLE_NAX=1"),
    "tiled_prefill": ("disable_tiled_prefill", "METAL_ATTN_DISABLE_TILED_PREFILL=1"),
}


class Settings(BaseSettings):
    """Every ``METAL_ATTN_*`` variable, its default and what it does."""

    model_config = SettingsConfigDict(
        env_prefix=PREFIX, case_sensitive=False, frozen=True, populate_by_name=True, extra="forbid"
    )

    # -- provider toggles (can only disable) -------------------------------------------------
    disable_gqa_decode: bool = Field(
        False,
        validation_alias=_env("disable_gqa_decode", "VLLM_METAL_DISABLE_GQA_DECODE"),
        description="Disable the GQA decode provider (alias VLLM_METAL_DISABLE_GQA_DECODE).",
    )
    disable_nax: bool = Field(
        False,
        validation_alias=_env("disable_nax", "VLLM_METAL_DISABLE_NAX"),
        description="Disable the M5 NAX prefill provider, nax_prefill (alias VLLM_METAL_DISABLE_NAX).",
    )
    disable_tiled_prefill: bool = Field(
        False,
        validation_alias=_env("disable_tiled_prefill"),
        description="Disable the tiled FlashAttention-2 prefill provider.",
    )
    disabled_providers: _CommaList = Field(
        (),
        validation_alias=_env("disabled_providers"),
        description="Comma-separated provider names to disable.",
    )
    provider: str | None = Field(
        None,
        validation_alias=_env("provider"),
        description="Force one provider by name; it is checked alone and never falls back.",
    )

    # -- plugins ---------------------------------------------------------------------------
    plugin_autoload: bool = Field(
        True,
        validation_alias=_env("plugin_autoload"),
        description="Load third-party providers from the 'metal_attn.providers' entry points.",
    )
    plugins_allow: _OptionalCommaList = Field(
        None,
        validation_alias=_env("plugins_allow"),
        description="Only these third-party plugins (entry-point names); empty means none.",
    )
    plugins_deny: _CommaList = Field(
        (),
        validation_alias=_env("plugins_deny"),
        description="Plugins (entry-point names, 'builtin' included) never to load.",
    )

    # -- diagnostics and logging -------------------------------------------------------------
    diagnostics: bool = Field(
        False,
        validation_alias=_env("diagnostics"),
        description="Keep a history of dispatches (the last one is always kept).",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "warning", validation_alias=_env("log_level"), description="Log level the CLI configures."
    )
    log_format: Literal["console", "json"] = Field(
        "console", validation_alias=_env("log_format"), description="Log format the CLI configures."
    )
    validate_metadata: bool = Field(
        True,
        validation_alias=_env("validate_metadata"),
        description=(
            "Value checks against the pool: block ids in range and tables long enough (once per "
            "metadata and pool), slot_mapping range and duplicates (every reshape_and_cache call); "
            "a bad value raises. Off: a sequence with a bad table gives NaN rows, a slot outside the "
            "pool is skipped (duplicates: one row wins); nothing is read or written outside the pool. "
            "Structural checks always run."
        ),
    )

    # -- kernel choices for A/B runs -----------------------------------------------------------
    partition_size: Literal[0, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096] = Field(
        0,
        validation_alias=_env("partition_size"),
        description=(
            "Per-token kernel on a GPU: the partition size of its split launches (0: each backend's measured "
            "rule, providers/gpu_common.PARTITION_RULES). The occupancy gate still decides whether to split."
        ),
    )

    tiled_partition_size: Literal[-1, 0, 128, 256, 512] = Field(
        0,
        validation_alias=_env("tiled_partition_size"),
        description=(
            "Tiled prefill kernel on a GPU: split-KV partitions of a launch (0: each backend's measured rule, "
            "providers/tiled_prefill.TILED_SPLIT_RULES; -1: never split; 128/256/512: split at that size "
            "whenever the longest row spans two partitions). Mixed batches never split."
        ),
    )

    tiled_short_tile: bool = Field(
        True,
        validation_alias=_env("tiled_short_tile"),
        description=(
            "Tiled prefill kernel on a GPU: a split launch whose chunks are short takes the backend's short-chunk "
            "tile (providers/tiled_prefill.TILED_SPLIT_RULES short_tiles; CUDA, head 128: 64 query rows for chunks "
            "of at most 64). 0: the tile of TILE_CONFIGS always."
        ),
    )

    mma_stage_pad: Literal[0, 16, 32, 48, 64] = Field(
        0,
        validation_alias=_env("mma_stage_pad"),
        description=(
            "Per-token kernel's matrix path (GPU, 16-bit, GQA groups of 4 or more): bytes of padding after each "
            "K/V row it stages in threadgroup memory (0: providers/gpu_common.STAGE_PAD, 16). Applies where the rows "
            "are not swizzled (Metal; CUDA with METAL_ATTN_MMA_STAGE_SWIZZLE=0). An A/B toggle: on the H200, 32 "
            "was slower than 16 on 6 of 8 decode shapes (two-way bank conflicts)."
        ),
    )

    mma_stage_swizzle: bool = Field(
        True,
        validation_alias=_env("mma_stage_swizzle"),
        description=(
            "Per-token kernel's matrix path on CUDA (16-bit, GQA groups of 4 or more, head 128 or 256): stage "
            "K/V rows unpadded, each row's 16-byte pieces XOR-swizzled by the row's index mod 8 (32-byte aligned "
            "rows, conflict-free fragment reads; METAL_ATTN_MMA_STAGE_PAD does not apply). Measured on the H200: "
            "1.0x the L2 reads of the bytes against 1.5x with 16-byte padding, 1.03-1.10x faster on the 8 decode "
            "shapes. 0: rows padded by METAL_ATTN_MMA_STAGE_PAD, as on Metal (the A/B toggle)."
        ),
    )

    mma_key_rows: bool = Field(
        True,
        validation_alias=_env("mma_key_rows"),
        description=(
            "Per-token kernel on CUDA (16-bit, GQA groups of 4 or more, head 128), on grids of fewer than 6 "
            "threadgroups per GPU core whose threadgroups walk at most 2,048 KV tokens: the keys-as-rows matrix path "
            "(kernels_v2/pagedattention.metal PA_MMA == 2: 16 keys x the group's heads per tensor-core product, half "
            "the products per token of the heads-as-rows path; 64 threads, chunks of 32). 0: the heads as rows "
            "everywhere (the A/B toggle)."
        ),
    )

    reducer_slices: Literal[0, 1, 2, 4, 8] = Field(
        0,
        validation_alias=_env("reducer_slices"),
        description=(
            "The split-KV reducer (GPU): partition slices of 128 threads per (row, head) threadgroup, each "
            "summing its share of the row's partitions (kernels_v2/split_reduce.h). 0: "
            "providers/gpu_common.REDUCER_SLICE_RULES (CUDA: more slices where the reducer's threadgroups are "
            "few per GPU core and rows have many partitions; Metal: 1, unmeasured). 1, 2, 4 or 8: that many "
            "everywhere (the A/B toggle)."
        ),
    )

    cuda_chains: bool = Field(
        True,
        validation_alias=_env("cuda_chains"),
        description=(
            "CUDA: run a per-token call (the kernel and, when split, the reducer) as one MLX operation through "
            "metal_attn._cuda_ops where that module is built (metal_attn.cuda_ops). 0: one mx.fast.cuda_kernel "
            "call per kernel."
        ),
    )

    cuda_chain_pool: bool = Field(
        True,
        validation_alias=_env("cuda_chain_pool"),
        description=(
            "CUDA chains: their outputs, scratch and input copies in stream-ordered device memory from "
            "metal_attn._cuda_ops's own CUDA memory pool. 0: MLX's allocator, whose unified memory stalls "
            "queued calls for milliseconds when it recycles one of MLX's device buffers for a chain "
            "(docs/cuda-ops.md, 'Where a chain's memory comes from'): for A/B runs."
        ),
    )

    cuda_commit_when_idle: bool | None = Field(
        None,
        validation_alias=_env("cuda_commit_when_idle"),
        description=(
            "CUDA chains: after a chain is encoded, launch the CUDA graph MLX has encoded so far when MLX's "
            "stream has no work left (the GPU waits for the host), instead of waiting for MLX's node count "
            "(MLX_MAX_OPS_PER_BUFFER). Unset: the per-token route's measured rule "
            "(providers/gpu_common.IDLE_COMMIT_RULE: decode calls reading at least 64 MiB of K/V, not a mixed "
            "batch's decode rows; calls of about 18 MB were slower on a host-bound engine, docs/cuda-ops.md, "
            "'Starting an idle GPU'); 1 or 0: every per-token chain or none (the A/B toggle)."
        ),
    )

    cuda_idle_direct_chains: int = Field(
        0,
        ge=0,
        validation_alias=_env("cuda_idle_direct_chains"),
        description=(
            "CUDA chains that start an idle GPU (cuda_commit_when_idle or its rule): the chain that finds the GPU "
            "idle, and the next N - 1 such chains after it, launch their kernels straight onto MLX's stream "
            "(cuLaunchKernel, after launching what MLX has encoded) instead of as nodes of MLX's CUDA graph, so "
            "the GPU starts without a graph update and launch on the host's path. 0: graph nodes always, the "
            "default: measured on an H100, 1 read the same as 0 and 32 was 3-11% slower on the blocking decode "
            "step, and every chain direct 1-8% slower on queued calls and steps (docs/cuda-ops.md, 'Launching "
            "straight onto the stream'); for A/B runs."
        ),
    )

    cuda_finish_in_place: bool = Field(
        True,
        validation_alias=_env("cuda_finish_in_place"),
        description=(
            "CUDA chains, the sdpa_prefill route: a batch of one run of equal chunks and no decode rows applies the "
            "NaN contract in MLX SDPA's output buffer, which the finish chain takes over (it reads the query and "
            "writes only NaN rows). 0: the finish copies the output into a buffer of its own (for A/B runs)."
        ),
    )

    cuda_decode_rows_in_chain: bool = Field(
        True,
        validation_alias=_env("cuda_decode_rows_in_chain"),
        description=(
            "CUDA chains, the sdpa_prefill route: a mixed batch's decode rows run inside the finish chain, straight "
            "into the output's first rows, instead of a chain of their own whose output the finish copies in: the "
            "same kernels and bytes, one MLX operation a batch fewer. On: the suite's two host-bound mixed batches "
            "read 1.02-1.09x and 0.88-1.14x (medians 1.06) the rows' own chain, the GPU-bound one 0.99-1.00x (H100, "
            "seven interleaved readings, docs/cuda-ops.md); 0: the rows' own chain (for A/B runs)."
        ),
    )

    cuda_decode_rows_wait: Literal["none", "gathers", "sdpa"] = Field(
        "none",
        validation_alias=_env("cuda_decode_rows_wait"),
        description=(
            "CUDA chains, the sdpa_prefill route with the decode rows in the finish chain: what the rows' first "
            "launch waits for besides its own inputs. none: nothing, so MLX's graph may start the rows with the "
            "gathers; gathers: the first run's first flagged positions (first_flagged, just after that run's gather, "
            "when its fused SDPA call becomes ready), so that the persistent cuDNN kernel may take the GPU first and "
            "the rows run in its tail; sdpa: the first run's fused SDPA output (the rows after it). The same kernels "
            "and bytes either way. H200, medians of five interleaved readings: gathers 1.03x none on the suite's "
            "GPU-bound mixed batch and 0.98x on its first mixed batch, sdpa 0.93x and 0.97x (docs/cuda-ops.md, "
            "forty-eighth session), so none by default. gathers and sdpa need the CUDA module built since the "
            "forty-seventh session."
        ),
    )

    cuda_tiled_chains: bool = Field(
        True,
        validation_alias=_env("cuda_tiled_chains"),
        description=(
            "CUDA chains, the tiled_prefill route: its kernel and, when split, the reducer as one MLX operation "
            "(as the per-token kernel's). On: its outputs equal the mx.fast launches' bit for bit, and the "
            "64-row chunk after 2K reads 36.9-37.2 TFLOP/s with it, 31.9-37.3 without (H100, three "
            "interleaved readings, docs/cuda-ops.md); 0: the mx.fast launches (for A/B runs)."
        ),
    )

    cuda_fused_reduce: bool = Field(
        False,
        validation_alias=_env("cuda_fused_reduce"),
        description=(
            "CUDA chains: a split per-token call as one launch, the last threadgroup of each (row, head group) "
            "reducing the partials (kernels_v2/pagedattention.metal PA_FUSED). Off by default: on the H200 it "
            "was no faster than the kernel + reducer pair on any peer shape, and slower where rows have many "
            "partitions (docs/bench-h200-decode-step.md, fifteenth session). 1: for A/B runs."
        ),
    )

    decode_rows_stream: bool | None = Field(
        None,
        validation_alias=_env("decode_rows_stream"),
        description=(
            "GPU mixed batches whose decode rows leave the prefill kernel (the per-token kernel): queue those rows "
            "on a second stream of the GPU, so that they can overlap the prefill chunks' kernels. Unset: each "
            "backend's measured rule (providers/gpu_common.DECODE_ROWS_STREAM_RULES: off; on an H100 the second "
            "stream ran mixed batches at 0.26-1.06x the one stream's speed, docs/bench-h200-prefill.md); 1 or 0: "
            "on or off everywhere (the A/B toggle)."
        ),
    )

    # -- hardware probe overrides -------------------------------------------------------------
    backend_override: Literal["metal", "cuda", "cpu"] | None = Field(
        None,
        validation_alias=_env("backend_override"),
        description=("Pretend to run on this backend (routing inspection only; `metal-attn bench` refuses another "
                     "backend than the real one)."),
    )
    gpu_cores: int | None = Field(
        None, ge=1, le=4096, validation_alias=_env("gpu_cores"), description="Override the GPU core count."
    )
    gpu_architecture: str | None = Field(
        None,
        validation_alias=_env("gpu_architecture"),
        description="Override the GPU architecture (e.g. applegpu_g17s, sm_90).",
    )
    gpu_name: str | None = Field(None, validation_alias=_env("gpu_name"), description="Override the GPU name.")
    macos_version: str | None = Field(
        None,
        pattern=r"^\d+(\.\d+)*$",
        validation_alias=_env("macos_version"),
        description="Override the macOS version the probe reports (e.g. 26.2; the NAX provider needs 26.2 or later).",
    )
    max_threadgroup_memory: int | None = Field(
        None,
        ge=1024,
        validation_alias=_env("max_threadgroup_memory"),
        description="Override the per-threadgroup memory limit in bytes.",
    )
    cpu_threads: int | None = Field(
        None,
        ge=1,
        le=1024,
        validation_alias=_env("cpu_threads"),
        description="Threads the CPU kernels may use (default: all CPUs).",
    )

    # -- models -----------------------------------------------------------------------------
    cache_dir: Path | None = Field(
        None,
        validation_alias=_env("cache_dir"),
        description=(
            "Where fetched models are kept (unset: $XDG_CACHE_HOME/metal-attn, else ~/.cache/metal-attn)."
        ),
    )

    # -- CUDA tools ---------------------------------------------------------------------------
    cuda_cache_dir: Path | None = Field(
        None,
        validation_alias=_env("cuda_cache_dir"),
        description="Where the CUDA chains keep their NVRTC-compiled images (unset: a per-user folder in the "
                    "system's temporary directory).",
    )
    nvrtc: Path | None = Field(
        None,
        validation_alias=_env("nvrtc"),
        json_schema_extra={"path": "file"},
        description="The libnvrtc.so file that python -m metal_attn.cuda_check --nvrtc (given without a path) "
                    "loads (unset: the nvidia-cuda-nvrtc wheel's, CUDA 13 then 12).",
    )

    # -- the serving engine (defaults of metal_attn.engine.EngineConfig) ------------------------
    max_num_batched_tokens: int = Field(
        512,
        ge=1,
        validation_alias=_env("max_num_batched_tokens"),
        description="Engine: token budget of one step (decode rows plus prefill-chunk tokens).",
    )
    max_num_seqs: int = Field(
        64, ge=1, validation_alias=_env("max_num_seqs"), description="Engine: cap on running sequences."
    )
    kv_cache_memory: int | None = Field(
        None,
        ge=1,
        validation_alias=_env("kv_cache_memory"),
        description="Engine: KV pool budget in bytes (unset: METAL_ATTN_KV_CACHE_FRACTION of the device's memory).",
    )
    kv_cache_fraction: float = Field(
        0.2,
        gt=0,
        le=1,
        allow_inf_nan=False,
        validation_alias=_env("kv_cache_fraction"),
        description="Engine: share of the device's memory for the KV pool when no byte budget is set.",
    )
    prefix_caching: bool = Field(
        True,
        validation_alias=_env("prefix_caching"),
        description="Engine: reuse cached full blocks of shared prompt prefixes.",
    )
    compile_decode: bool | None = Field(
        None,
        validation_alias=_env("compile_decode"),
        description="Engine: run decode-only steps through a forward traced once under mx.compile "
        "(metal_attn.mlx_lm.compiled); unset: each backend's measured default, on for CUDA, off on "
        "Metal (not measured) and the CPU (metal_attn.engine.config.COMPILE_DECODE_BY_BACKEND).",
    )

    @field_validator("*", mode="before")
    @classmethod
    def _strip(cls, v: Any) -> Any:
        """Spaces around a value are not part of it (``METAL_ATTN_CACHE_DIR=" /tmp/x "`` was a folder
        named with spaces, and a boolean ``" 1 "`` was refused)."""
        return v.strip() if isinstance(v, str) else v

    @field_validator("disabled_providers", "plugins_deny", "plugins_allow", mode="before")
    @classmethod
    def _split_commas(cls, v: Any) -> Any:
        if isinstance(v, str):
            return tuple(x.strip() for x in v.split(",") if x.strip())
        if isinstance(v, (list, set, frozenset)):
            return tuple(v)
        return v

    @field_validator("partition_size", "tiled_partition_size", "mma_stage_pad", "reducer_slices", mode="before")
    @classmethod
    def _digits_are_numbers(cls, v: Any) -> Any:
        return int(v) if isinstance(v, str) and is_decimal(v.strip().removeprefix("-")) else v

    @field_validator("provider", "gpu_architecture", "gpu_name", "macos_version", "cache_dir", "cuda_cache_dir",
                     "nvrtc", "backend_override",
                     "gpu_cores", "max_threadgroup_memory", "cpu_threads", "kv_cache_memory", "compile_decode",
                     "cuda_commit_when_idle", "decode_rows_stream", mode="before")
    @classmethod
    def _blank_is_none(cls, v: Any) -> Any:
        """A blank value of a setting that may be unset is unset (``METAL_ATTN_GPU_CORES=`` in a shell script).
        Not for ``plugins_allow``, where empty means no plugin."""
        return None if isinstance(v, str) and not v.strip() else v

    @field_validator("log_level", "log_format", "backend_override", mode="before")
    @classmethod
    def _any_case(cls, v: Any) -> Any:
        return v.strip().lower() if isinstance(v, str) else v

    def is_disabled(self, provider_name: str) -> str | None:
        """The reason ``provider_name`` is disabled by a toggle, or ``None``."""
        if provider_name in PROVIDER_TOGGLES:
            field, var = PROVIDER_TOGGLES[provider_name]
            if getattr(self, field):
                name = set_by(field)  # the variable the user set (ours or an upstream alias), when it says so
                if name is not None and _as_bool(os.environ.get(name, "")):
                    return f"disabled by {name}={os.environ[name].strip()}"
                # Set in code (`override_settings`, `Settings(...)`), not by the environment
                return f"disabled by the {field} setting (its variable: {var})"
        if provider_name in self.disabled_providers:
            name = set_by("disabled_providers")  # the variable as the user spelled it, when one is set
            if name is not None and provider_name in {n.strip() for n in os.environ[name].split(",")}:
                return f"disabled by {name}={','.join(self.disabled_providers)}"
            return (f"disabled by the disabled_providers setting ({','.join(self.disabled_providers)}; "
                    f"its variable: {PREFIX}DISABLED_PROVIDERS)")
        return None

    def device_overrides(self) -> tuple[tuple[str, object], ...]:
        """Probe overrides as (DeviceInfo field, value) pairs, for `metal_attn.device`."""
        pairs = (
            ("backend", self.backend_override),
            ("gpu_cores", self.gpu_cores),
            ("architecture", self.gpu_architecture),
            ("name", self.gpu_name),
            ("macos_version", self.macos_version),
            ("max_threadgroup_memory", self.max_threadgroup_memory),
            ("cpu_threads", self.cpu_threads),
        )
        return tuple((k, v) for k, v in pairs if v is not None)


def _strip_optional(annotation: Any) -> tuple[Any, bool]:
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0], True
    return annotation, False


def allowed_values(field: Any) -> str:
    """What a settings field (a name or its pydantic ``FieldInfo``) accepts, from its type and bounds:
    ``integer >= 1, <= 4096 (or unset)``, ``1/0, true/false``, ... (the settings table's column and
    every validation error say it)."""
    if isinstance(field, str):
        field = Settings.model_fields[field]
    ann, nullable = _strip_optional(field.annotation)
    if typing.get_origin(ann) is typing.Annotated:
        ann = typing.get_args(ann)[0]
    if ann is bool:
        text = "1/0, true/false"
    elif typing.get_origin(ann) is typing.Literal:
        text = ", ".join(str(a) for a in typing.get_args(ann))
    elif typing.get_origin(ann) is tuple:
        text = "comma-separated names"
    elif ann in (int, float):
        bounds = [(op, getattr(m, attr)) for m in field.metadata for attr, op in
                  (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")) if getattr(m, attr, None) is not None]
        text = ("integer" if ann is int else "number") + (" " if bounds else "") + ", ".join(
            f"{op} {v}" for op, v in bounds)
    elif ann is Path:  # a folder unless the field says file (``json_schema_extra={"path": "file"}``)
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        text = f"a {extra.get('path', 'folder')} path"
    else:
        pattern = next((getattr(m, "pattern", None) for m in field.metadata if getattr(m, "pattern", None)), None)
        text = f"text matching {pattern}" if pattern else "text"
    return text + (" (or unset)" if nullable else "")


def env_names() -> dict[str, str]:
    """Every accepted environment name (ours and aliases) -> field name."""
    out: dict[str, str] = {}
    for name, field in Settings.model_fields.items():
        alias = field.validation_alias
        choices = alias.choices if isinstance(alias, AliasChoices) else [PREFIX + name]
        for c in choices:
            if isinstance(c, str) and c.isupper():
                out[c] = name
    return out


def set_by(field: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The environment variable that sets ``field`` (ours first, then the upstream aliases, as they are
    read), as it is spelled in the environment; ``None`` when none is set."""
    env = os.environ if environ is None else environ
    spelled = {k.upper(): k for k in env}
    names = [PREFIX + field.upper(), *(n for n, f in env_names().items() if f == field and n != PREFIX + field.upper())]
    return next((spelled[n] for n in names if n in spelled), None)


def _as_bool(text: str) -> bool | None:
    """``text`` read as a boolean setting reads it (``1``, ``true``, ``on``, ...), or None when it is not one."""
    try:
        return TypeAdapter(bool).validate_python(text.strip())
    except ValidationError:
        return None


def _check_unknown_env(environ: dict[str, str]) -> list[str]:
    known = env_names()
    messages = []
    for var in sorted(environ):
        if not var.upper().startswith(PREFIX) or var.upper() in known:
            continue
        if var.upper() in RENAMED_VARIABLES:
            messages.append(f"{var} is no longer read; use {RENAMED_VARIABLES[var.upper()]}")
            continue
        ours = [k for k in known if k.startswith(PREFIX)]
        prefixed = sorted(k for k in ours if k.startswith(var.upper()))
        close = prefixed[:1] or difflib.get_close_matches(var.upper(), ours, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        messages.append(f"{var} is not a metal-attn setting and is ignored{hint}")
    return messages


def _check_alias_conflicts(environ: dict[str, str]) -> list[str]:
    """A message for each setting whose names (ours, then upstream aliases) are set to different
    values: the first is read, by design, and the others would be ignored without a word."""
    spelled: dict[str, list[str]] = {}  # names are read in any case: every spelling of each
    for key in environ:
        spelled.setdefault(key.upper(), []).append(key)
    by_field: dict[str, list[str]] = {}
    for var, field in env_names().items():
        for key in spelled.get(var, ()):
            by_field.setdefault(field, []).append(key)
    messages = []
    for field, names in by_field.items():
        if len({_comparable(field, environ[n]) for n in names}) <= 1:
            continue
        twins = [n for n in names if n.upper() == names[0].upper()]
        if len(twins) > 1:  # one name in two cases: the environment's order decides, not ours
            listed = ", ".join(f"{n}={environ[n]!r}" for n in twins)
            messages.append(f"{listed} spell one variable in different cases and disagree: which is read depends "
                            "on the environment's order (set it once)")
        else:
            ignored = ", ".join(f"{n}={environ[n]!r}" for n in names[1:])
            messages.append(f"{names[0]}={environ[names[0]]!r} is used and {ignored} ignored (they disagree)")
    return messages


def _comparable(field: str, text: str) -> Any:
    """``text`` as the setting ``field`` reads it, where that can be told without the rest of the
    environment (``1`` and ``true`` are one boolean), else the text without its spaces."""
    parsed = _as_bool(text) if Settings.model_fields[field].annotation is bool else None
    return text.strip() if parsed is None else parsed


def _format_validation_error(err: ValidationError, source: str) -> str:
    lines = []
    names = env_names()
    for e in err.errors():
        loc = str(e["loc"][0]) if e["loc"] else "?"
        field = names.get(loc.upper(), loc)
        env = field
        if source == "environment":
            env = set_by(field) or f"{PREFIX}{field.upper()}"  # the variable the user set (ours or an alias)
        desc = Settings.model_fields.get(field)
        if e.get("type") == "bool_parsing":
            allowed = "expected a boolean: 1/0, true/false, yes/no, on/off"
            if desc is not None and desc.default is None:  # a three-state switch: unset means "by the rule"
                allowed += ", or unset (empty)"
        else:
            allowed = e.get("ctx", {}).get("expected") or e["msg"]
        if desc is not None and e.get("type") != "bool_parsing":
            allowed += f" (allowed: {allowed_values(desc)})"
        lines.append(f"{env}={e.get('input')!r}: {allowed}" + (f" ({desc.description})" if desc else ""))
    return f"invalid metal-attn settings from {source}:\n  " + "\n  ".join(lines)


#: Settings that are accepted but do nothing yet (a provider they would act on is not shipped):
#: field -> why. Setting one warns, so that no setting does nothing silently.
RESERVED_SETTINGS: dict[str, str] = {}


def _warn(message: str, stacklevel: int, event: str, **fields: Any) -> None:
    """Say a settings problem once: as a `SettingsWarning` (``stacklevel`` counted from here), and as the log
    ``event`` where the application (or the command line) gave logging a handler. With none, Python would
    print the log record too, the same sentence a second time."""
    warnings.warn(message, SettingsWarning, stacklevel=stacklevel)
    import logging

    if logging.getLogger("metal_attn").hasHandlers():
        from metal_attn.log import get_logger

        get_logger().warning(event, **fields)


def _warn_reserved(settings: Settings, changed: Any = None) -> None:
    """Warn about every reserved setting that is on (``changed``: only those among these names)."""
    for field, why in RESERVED_SETTINGS.items():
        if getattr(settings, field) and (changed is None or field in changed):
            msg = f"METAL_ATTN_{field.upper()} is set but has no effect: {why}"
            _warn(msg, 5, "reserved_setting", setting=f"METAL_ATTN_{field.upper()}", reason=why)


def load_settings(**overrides: Any) -> Settings:
    """Read the environment (and ``overrides``), warn about unknown names and reserved settings in
    use, validate."""
    environ = dict(os.environ)
    for event, messages in (("unknown_setting", _check_unknown_env(environ)),
                            ("conflicting_setting", _check_alias_conflicts(environ))):
        for msg in messages:
            _warn(msg, 4, event, reason=msg)
    try:
        loaded = Settings(**overrides)
    except ValidationError as err:
        source = (
            "overrides"
            if overrides and all(str(e["loc"][0]) in overrides for e in err.errors() if e["loc"])
            else "environment"
        )
        raise SettingsError(_format_validation_error(err, source)) from None
    _warn_reserved(loaded)
    return loaded


_lock = threading.RLock()
#: The process-wide settings (from the environment), and this context's override, if any.
_current: Settings | None = None
_override: contextvars.ContextVar[Settings | None] = contextvars.ContextVar("metal_attn_settings", default=None)


def get_settings() -> Settings:
    """The active settings: this context's `override_settings`, else the process-wide ones
    (loaded from the environment on first use)."""
    global _current
    s = _override.get()
    if s is not None:
        return s
    s = _current
    if s is None:
        with _lock:
            if _current is None:
                _current = load_settings()
                _epoch.bump()
            s = _current
    return s


def reload_settings() -> Settings:
    """Re-read the environment (after changing ``os.environ``) into the process-wide settings
    (an `override_settings` block in force still wins in its own context)."""
    global _current
    with _lock:
        _current = load_settings()
        _epoch.bump()
        return _current


@contextlib.contextmanager
def override_settings(**changes: Any) -> Iterator[Settings]:
    """Temporarily replace some settings (field names, e.g. ``gpu_cores=40``), in this context only.

    The override is context-local (`contextvars`): it applies to the code of this thread (or
    asyncio task) inside the block, nests, and is undone on exit whatever other threads do
    meanwhile; other threads keep their own settings, and a thread started inside the block starts
    from the process-wide settings (Python gives a new thread a fresh context). Dispatch caches are
    keyed by the settings scope (`metal_attn._epoch`), so no thread reuses another's decisions.
    """
    unknown = sorted(set(changes) - set(Settings.model_fields))
    if unknown:
        close = {u: difflib.get_close_matches(u, list(Settings.model_fields), n=1) for u in unknown}
        hints = ", ".join(f"{u} (did you mean {c[0]}?)" if c else u for u, c in close.items())
        raise SettingsError(f"unknown setting(s): {hints}; known: {', '.join(Settings.model_fields)}")
    data = get_settings().model_dump()
    data.update(changes)
    try:
        new = Settings.model_validate(data)
    except ValidationError as err:
        raise SettingsError(_format_validation_error(err, "overrides")) from None
    _warn_reserved(new, changes)
    token = _override.set(new)
    scope = _epoch.enter_scope()
    try:
        yield new
    finally:
        _epoch.exit_scope(scope)
        _override.reset(token)


class _CallableModule(types.ModuleType):
    """Lets ``metal_attn.settings()`` return the active settings while
    ``metal_attn.settings`` stays this module (``metal_attn.settings.override_settings``...)."""

    def __call__(self) -> Settings:
        return get_settings()


sys.modules[__name__].__class__ = _CallableModule
