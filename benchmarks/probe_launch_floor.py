"""Where a tiny MLX CUDA kernel's GPU time goes (not a test): the launch floor, memory latency,
and whether parameter arrays written by the host cost the per-token kernel time.

    python3 benchmarks/probe_launch_floor.py OUT.json [--calls 30]

Each row is one kernel's median GPU time over ``--calls`` traced calls (CUPTI, `kernel_trace`):

- ``copy16 device``: a one-block kernel copying 16 floats from an array the GPU wrote;
- ``copy16 host`` / ``copy2 host``: the same from an array built on the host (``mx.array`` of a
  list; 8 bytes and under come from MLX's small managed pool); ``padded``: a view of a larger
  buffer (`metal_attn.host_arrays`); ``fresh host array per call``: a new host array every call;
  ``derived on the device per call``: the last call's array plus one, computed by the GPU;
- ``six fresh host arrays``: a step's six small inputs built anew every call, as six buffers or
  as six views of one (one upload a step);
- ``chase N``: one thread following N dependent loads through a device array (the memory latency
  a chain of dependent reads pays);
- ``x*1``: MLX's own elementwise kernel on 16 floats;
- the per-token kernel (and reducer) at one decode row as shipped, and with every small input
  (metadata, parameters) replaced by a copy the GPU wrote.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import mlx.core as mx
import numpy as np

COPY = """
    int i = threadIdx.x;
    if (i < n_out) { out[i] = float(inp[i]); }
"""
CHASE = """
    if (threadIdx.x == 0) {
        int at = 0;
        for (int s = 0; s < STEPS; ++s) { at = nxt[at]; }
        out[0] = at;
    }
"""


def _medians(events: list[dict]) -> dict[str, float]:
    by_name: dict[str, list[float]] = {}
    for e in events:
        by_name.setdefault(e["name"][:70], []).append(float(e["dur"]))
    return {n: round(statistics.median(d), 2) for n, d in by_name.items()}


def _device_copy(a: mx.array) -> mx.array:
    """``a`` copied by the GPU (an array of 8 bytes or less lands in MLX's small pool)."""
    out = a + 0
    mx.eval(out)
    return out


def _padded(a: mx.array) -> mx.array:
    """``a`` as the package ships it: `metal_attn.host_arrays.device_array` of its values."""
    from metal_attn.host_arrays import device_array

    out = device_array(np.array(a))
    mx.eval(out)
    return out


def _with_inputs(launch, md, make):
    """The per-token ``launch`` and its metadata ``md`` with every small input replaced by ``make(x)``."""
    reduce = launch.reduce
    if reduce is not None:
        reduce = dataclasses.replace(reduce, params=make(reduce.params), zero_sinks=make(reduce.zero_sinks))
    launch = dataclasses.replace(launch, params=make(launch.params), fparams=make(launch.fparams),
                                 zero_sinks=make(launch.zero_sinks), reduce=reduce)
    md = dataclasses.replace(md, block_tables=make(md.block_tables), seq_lens=make(md.seq_lens),
                             cu_seqlens_q=make(md.cu_seqlens_q))
    return launch, md


def main() -> None:
    from kernel_trace import trace

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--ncu", action="store_true", help="run each kernel a few times untraced (for Nsight Compute)")
    args = ap.parse_args()
    rows: list[dict] = []

    def row(label: str, fn) -> None:
        if args.ncu:
            for _ in range(3):
                mx.eval(fn())
            return
        kernels = _medians(trace(fn, args.calls))
        rows.append({"label": label, "kernel_median_us": kernels})
        print(f"{label:34s} " + "  ".join(f"{n[:48]} {us:.2f}us" for n, us in kernels.items()), flush=True)

    for n in (16, 2):
        copy = mx.fast.cuda_kernel(name=f"ma_probe_copy{n}", input_names=["inp"], output_names=["out"],
                                   source=COPY.replace("n_out", str(n)))
        host = mx.array(list(range(n)), dtype=mx.int32)
        mx.eval(host)
        dev = _device_copy(host)
        for label, arr in (("device", dev), ("host", host), ("padded", _padded(host))):
            row(f"copy{n} {label}", lambda arr=arr, copy=copy, n=n: copy(
                inputs=[arr], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(n,)],
                output_dtypes=[mx.float32])[0])
        # The same values derived on the device from the last call's (a decode step's successor,
        # `metal_attn.cache.next_decode_plan`): no host write between calls.
        state = {"a": _padded(host)}

        def derived(copy=copy, n=n, state=state):
            state["a"] = state["a"] + 1
            return copy(inputs=[state["a"]], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(n,)],
                        output_dtypes=[mx.float32])[0]

        row(f"copy{n} derived on the device per call", derived)
        # A host array built anew for every call (an engine's per-step inputs): the GPU's first touch
        # of a buffer the CPU just wrote.
        row(f"copy{n} fresh host array per call", lambda copy=copy, n=n: copy(
            inputs=[mx.array(list(range(n)), dtype=mx.int32)], grid=(32, 1, 1), threadgroup=(32, 1, 1),
            output_shapes=[(n,)], output_dtypes=[mx.float32])[0])
    # A step's six small host arrays (ids, positions, slots, table, lengths, query starts) built anew
    # every call: six buffers, or one buffer and six views of it (one upload a step).
    names = ["a", "b", "c", "d", "e", "f"]
    six = mx.fast.cuda_kernel(name="ma_probe_six", input_names=names, output_names=["out"],
                              source="    if (threadIdx.x == 0) { out[0] = a[0] + b[0] + c[0] + d[0] + e[0] + f[0]; }")

    def six_inputs(packed: bool) -> list[mx.array]:
        if not packed:
            return [mx.array(np.arange(4, dtype=np.int32) + i) for i in range(6)]
        flat = mx.array(np.arange(24, dtype=np.int32))
        return [flat[4 * i : 4 * i + 4] for i in range(6)]

    for packed in (False, True):
        row(f"six fresh host arrays, {'one buffer' if packed else 'six buffers'}", lambda packed=packed: six(
            inputs=six_inputs(packed), grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(1,)],
            output_dtypes=[mx.int32])[0])
    size = 1 << 16
    perm = np.random.default_rng(0).permutation(size).astype(np.int32)
    nxt = np.empty(size, dtype=np.int32)
    nxt[perm] = np.roll(perm, -1)  # one cycle through every slot
    nxt_dev = _device_copy(mx.array(nxt))
    for steps in (1, 8, 32):
        chase = mx.fast.cuda_kernel(name=f"ma_probe_chase{steps}", input_names=["nxt"], output_names=["out"],
                                    source=CHASE.replace("STEPS", str(steps)))
        row(f"chase {steps}", lambda chase=chase: chase(
            inputs=[nxt_dev], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(1,)],
            output_dtypes=[mx.int32])[0])
    # The same chain, one step a page: 32 loads, each at a random page of a 1 GiB array (a TLB
    # miss per step where the GPU's page is smaller than the stride).
    big = 1 << 28
    for stride in (32, 16 << 10, 512 << 10, 4 << 20):  # int32 elements: 128 B, 64 KiB, 2 MiB, 16 MiB
        slots = np.random.default_rng(stride).choice(big // stride, size=32, replace=False) * stride
        chain = mx.zeros((big,), dtype=mx.int32)
        chain[mx.array(slots.astype(np.int32))] = mx.array(np.roll(slots, -1).astype(np.int32))
        chain = _device_copy(chain)
        start = int(slots[0])
        shifted = mx.fast.cuda_kernel(name=f"ma_probe_pages{stride}", input_names=["nxt"], output_names=["out"],
                                      source=CHASE.replace("STEPS", "32").replace("int at = 0", f"int at = {start}"))
        row(f"chase 32, stride {stride * 4} B", lambda k=shifted, c=chain: k(
            inputs=[c], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(1,)],
            output_dtypes=[mx.int32])[0])
        del chain
    x = _device_copy(mx.ones((16,)))
    row("x*1", lambda: x * 1)

    import metal_attn
    from metal_attn.bench.shapes import Shape, build_case
    from metal_attn.settings import override_settings
    from providers import gpu_common

    for context, psize in ((16, 0), (600, 512)):
        case = build_case(Shape(1, 32, 8, 128, context, "bfloat16"), seed=context)
        md = case.metadata
        with override_settings(partition_size=psize):
            geo = gpu_common.launch_geometry(case.q, case.k_pool, md, partition_size=psize, backend="cuda")
            launch = gpu_common.per_token_launch(
                case.q.shape, case.q.dtype, case.k_pool.shape, md, scale=case.scale, use_sinks=False,
                sliding_window=None, softcap=None, partition_size=psize, backend="cuda", geo=geo,
                prefetch=gpu_common.PREFETCH_NEXT["cuda"], rows=None)
        # As shipped, the small inputs are views of larger buffers; GPU-written copies of them put
        # those of 8 bytes or less back into MLX's small pool.
        variants = (("as shipped", launch, md), ("device inputs", *_with_inputs(launch, md, _device_copy)),
                    ("padded inputs", *_with_inputs(launch, md, _padded)))
        for label, ln, m in variants:
            row(f"per_token L{context} P{psize} {label}",
                lambda ln=ln, m=m, c=case: ln(c.q, c.k_pool, c.v_pool, m, None))
        # The shipped launch at this partition size (the registry's own call would take the rule's).
        ref = launch(case.q, case.k_pool, case.v_pool, md, None)
        np.testing.assert_allclose(
            np.array(ref.astype(mx.float32)),
            np.array(metal_attn.paged_attention(case.q, case.k_pool, case.v_pool, metadata=md, scale=case.scale,
                                                provider="classic").astype(mx.float32)), rtol=2e-2, atol=2e-2)
        for label, ln, m in variants[1:]:
            got = ln(case.q, case.k_pool, case.v_pool, m, None)
            assert mx.array_equal(ref, got).item(), f"the {label} launch must give the same output"
    if args.ncu:
        return
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
