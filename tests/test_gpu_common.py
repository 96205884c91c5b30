"""`metal_attn.providers.gpu_common`, what the GPU providers share: its helpers' values and shapes,
the eager-compile step, the decode-rows request, and the import rule (a provider module imports no
other provider's module; what providers share comes from gpu_common)."""

from __future__ import annotations

import ast
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from metal_attn.providers import gpu_common as gc

from metal_attn.constants import LOG2E
from metal_attn.device import DeviceInfo
from metal_attn.errors import KernelCompileError
from metal_attn.request import AttentionRequest, Phase

PROVIDERS_DIR = Path(__file__).resolve().parent.parent / "providers"
SHARED = "metal_attn.providers.gpu_common"


def _provider_of(module: str) -> str | None:
    """The provider a ``metal_attn.providers.*`` module belongs to (``None``: not a provider module)."""
    parts = module.split(".")
    if parts[:2] != ["metal_attn", "providers"] or len(parts) < 3 or parts[2] == SHARED.rsplit(".", 1)[1]:
        return None
    return parts[2]


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports (module level and inside functions), as absolute names."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names if node.module == "metal_attn.providers")
    return out


@pytest.mark.parametrize("path", sorted(p for p in PROVIDERS_DIR.rglob("*.py") if p.name != "__init__.py"
                                        or p.parent != PROVIDERS_DIR), ids=lambda p: str(p.relative_to(PROVIDERS_DIR)))
def test_no_provider_module_imports_another_providers_module(path):
    own = path.relative_to(PROVIDERS_DIR).parts[0].removesuffix(".py")
    foreign = {m for m in _imports(path) if _provider_of(m) not in (None, own)}
    assert not foreign, f"{path.name} imports {sorted(foreign)}: share through {SHARED} instead"


def test_the_import_rule_sees_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from metal_attn.providers.classic import gpu\n"
                   "    from metal_attn.providers import tiled_prefill, gpu_common\n")
    assert {m for m in _imports(bad) if _provider_of(m)} == {"metal_attn.providers.classic",
                                                              "metal_attn.providers.tiled_prefill"}
    shared = tmp_path / "shared.py"  # the shared package's modules are not a provider's
    shared.write_text("from metal_attn.providers.gpu_common.per_token import plan_per_token\n"
                      "from metal_attn.providers.gpu_common import decode_rows\n")
    assert not {m for m in _imports(shared) if _provider_of(m)}


def test_pack_scale_is_log2_space_unless_a_softcap_applies():
    assert np.allclose(np.array(gc.pack_scale(0.125, None)), [0.125 * LOG2E, 0.0])
    assert np.allclose(np.array(gc.pack_scale(0.125, 30.0)), [0.125, 30.0])
    assert gc.pack_scale(0.125, None) is gc.pack_scale(0.125, None)  # built once per value
    packed = gc.pack_int32((3, 1, 4))
    assert packed.dtype == mx.int32 and np.array(packed).tolist() == [3, 1, 4]


def test_sink_logits_and_split_scratch():
    zeros = gc.sink_logits(None, 6)
    assert zeros.dtype == mx.float32 and np.array(zeros).tolist() == [0.0] * 6 and zeros is gc.zeros_f32(6)
    sinks = mx.array([1.0, 2.0], dtype=mx.float32)
    assert gc.sink_logits(sinks, 2) is sinks
    scratch = gc.split_scratch(5, 4, 3, 64)
    assert scratch == {"output_shapes": [(5, 4, 3), (5, 4, 3), (5, 4, 3, 64)],
                       "output_dtypes": [mx.float32, mx.float32, mx.float32]}


def test_tiny_batch_covers_its_sequence_with_its_own_pages():
    b = gc.tiny_batch("bfloat16", 128, 16, seq_len=513, q_rows=2, num_heads=4, num_kv_heads=2)
    assert b.q.shape == (2, 4, 128) and b.q.dtype == mx.bfloat16
    assert b.cache.shape == (33, 16, 2, 128)  # ceil(513 / 16) pages
    md = b.metadata
    assert md.num_seqs == 1 and md.total_q_tokens == 2 and md.max_seq_len == 513
    assert np.array(md.block_tables).tolist() == [list(range(33))]


def test_compile_eagerly_skips_hypothetical_devices_and_names_a_failure():
    calls = []
    gc.compile_eagerly(DeviceInfo.preset("h200"), "never", lambda b: calls.append(b), dtype="float16",
                       head_size=64, block_size=16)
    assert calls == []  # a hypothetical device runs nothing

    real = DeviceInfo.preset("h200").replace(hypothetical=False)
    seen = []
    gc.compile_eagerly(real, "ok", lambda b: seen.append(b.q.shape) or b.q, dtype="float16", head_size=64,
                       block_size=16, num_heads=2)
    assert seen == [(1, 2, 64)]

    def broken(b):
        raise RuntimeError("unable to build the pipeline")

    with pytest.raises(KernelCompileError, match=r"my kernel \(x\): RuntimeError: unable to build the pipeline"):
        gc.compile_eagerly(real, "my kernel (x)", broken, dtype="float16", head_size=64, block_size=16)


def test_decode_request_is_the_decode_rows_alone():
    mixed = AttentionRequest.from_lengths(q_lens=[1, 1, 300], seq_lens=[8192, 100, 800], num_heads=32, num_kv_heads=8,
                                          head_size=128, block_size=16, dtype="bfloat16", backend="cuda")
    assert mixed.phase is Phase.MIXED
    dec = gc.decode_request(mixed)
    assert (dec.phase, dec.num_seqs, dec.total_q_tokens, dec.max_q_len, dec.max_seq_len) == (
        Phase.DECODE, 2, 2, 1, 8192)
    assert (dec.num_heads, dec.head_size, dec.dtype, dec.backend) == (32, 128, "bfloat16", "cuda")
