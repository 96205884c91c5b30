"""What the source checks check: one kernel instantiation per entry, as plain data.

`Specialization` (the Metal source check, `metal_attn.msl_check`) and `CudaSource` (the CUDA
compile check, `metal_attn.cuda_check`) live here, apart from the checks, so that a provider can
declare its sets (``Provider.msl_specializations`` / ``cuda_sources``) without the provider
contract importing the check machinery, which imports the registry.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Specialization:
    """One kernel instantiation: what to build and how to call it for tracing."""

    label: str
    kernel: str
    source_files: tuple[str, ...]
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    #: (name, value) pairs; dtype values are dtype names ("float16", "int32", ...).
    template: tuple[tuple[str, object], ...]
    #: (shape, dtype name) per input.
    inputs: tuple[tuple[tuple[int, ...], str], ...]
    outputs: tuple[tuple[tuple[int, ...], str], ...]
    defines: tuple[tuple[str, object], ...] = ()
    is_dtype: tuple[str, ...] = ("T", "TT")


@dataclasses.dataclass(frozen=True)
class CudaSource:
    """One kernel instantiation to compile."""

    label: str
    kernel: str
    source_files: tuple[str, ...]
    inputs: tuple[tuple[str, str], ...]  # (name, dtype name)
    outputs: tuple[tuple[str, str], ...]
    template: tuple[tuple[str, object], ...]
    defines: tuple[tuple[str, object], ...] = ()
