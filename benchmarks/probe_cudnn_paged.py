"""cuDNN's SDPA reading our paged K/V pools in place, against cuDNN on contiguous K/V (not a test): the
measurement behind issue #18's next route.

    python3 benchmarks/probe_cudnn_paged.py OUT.json [--iters N]

Needs a CUDA GPU, torch and cuDNN's Python frontend (``pip install nvidia-cudnn-frontend``; the device
carries the wheel: benchmarks/device/README.md). It runs no MLX and none of metal-attn's kernels: it asks
whether cuDNN (the kernel MLX SDPA calls) can run our route's chunks straight from the pools, and at what
cost, before anything is built on it.

For each chunk shape (four of the prefill-gpu suite's and the third mixed batch's chunk: ``n`` sequences,
``q_len`` new rows ending ``seq_len`` tokens, GQA heads, head 128, bf16, 16-token pages), in one process:

- ``paged``: one cuDNN SDPA graph whose K and V are the pools in metal-attn's layout
  (``[num_blocks, block_size, kv_heads, head]``, seen by cuDNN as ``[num_blocks, kv_heads, block_size,
  head]`` with the strides of that layout), a random block table, bottom-right causal mask, queries
  and output in packed rows (``[tokens, heads, head]``, the layout `paged_attention` takes and returns);
- ``paged_hnd``: the same with the pools copied to cuDNN's own page layout (``[num_blocks, kv_heads,
  block_size, head]``, as FlashInfer's HND pools), to tell a layout refusal or cost from a paging one;
- ``contiguous``: the same graph on ``[n, kv_heads, seq_len, head]`` K/V (what MLX SDPA's peer is given);
- ``contiguous_nopad``: that without the padding mask and its sequence lengths (paging needs them; MLX's
  SDPA graph has neither), the output still written straight into packed rows.

Each is checked against torch SDPA on the gathered K/V with an explicit bottom-right mask (float32,
max abs error), then timed with CUDA events (median of ``--iters`` samples of ten queued calls, after a
warmup). TFLOP/s use the suite's formula (4 * heads * head * attended pairs). The JSON holds every figure
and the versions.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys

from metal_attn.bench.shapes import Shape

#: (label, n, q_len, seq_len, heads, kv_heads): the prefill-gpu suite's chunks, and the third mixed
#: batch's chunk.
SHAPES = (
    ("mixed3 chunk: q2048 after 2048", 1, 2048, 4096, 32, 8),
    ("q4096", 1, 4096, 4096, 32, 8),
    ("b4 q2048", 4, 2048, 2048, 32, 8),
    ("q1024 after 7K", 1, 1024, 8192, 32, 8),
    ("q512 after 32K", 1, 512, 33280, 32, 8),
)
HEAD = 128
BLOCK = 16


def build_graph(cudnn, handle, tensors: dict, scale: float, paged: bool, max_kv: int):
    """One SDPA graph over ``tensors`` (torch arrays whose shapes and strides the graph takes)."""
    g = cudnn.pygraph(io_data_type=cudnn.data_type.BFLOAT16, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT, handle=handle)
    t = {name: g.tensor_like(arr) for name, arr in tensors.items() if name != "o"}
    kwargs = dict(name="sdpa", q=t["q"], k=t["k"], v=t["v"], attn_scale=scale, use_causal_mask_bottom_right=True)
    if "seq_len_q" in t:  # the padding mask (paging needs it); without it, the graph MLX SDPA builds
        kwargs.update(use_padding_mask=True, seq_len_q=t["seq_len_q"], seq_len_kv=t["seq_len_kv"])
    if paged:
        kwargs.update(paged_attention_k_table=t["table"], paged_attention_v_table=t["table_v"],
                      paged_attention_max_seq_len_kv=max_kv)
    try:
        o, _ = g.sdpa(generate_stats=False, **kwargs)
    except TypeError:  # older frontends name it is_inference
        o, _ = g.sdpa(is_inference=True, **kwargs)
    out = tensors["o"]
    o.set_output(True).set_dim(list(out.shape)).set_stride(list(out.stride()))
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    t["o"] = o
    return g, t


#: Calls queued between a sample's two CUDA events, so the host's cost per call hides behind the GPU's.
INNER = 10


def time_ms(torch, fn, iters: int) -> float:
    """Median over ``iters`` samples of the CUDA-event time of `INNER` queued calls of ``fn``, per call
    (after three warmup calls)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        fn()  # queued ahead of the first event, so the GPU is busy when the timed calls' host work starts
        a.record()
        for _ in range(INNER):
            fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / INNER)
    return statistics.median(out)


def run_shape(torch, cudnn, handle, label, n, q_len, seq_len, heads, kvh, iters) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    pages = -(-seq_len // BLOCK)
    num_blocks = n * pages + 7
    k_pool = torch.randn(num_blocks, BLOCK, kvh, HEAD, device=dev, dtype=bf, generator=gen)
    v_pool = torch.randn(num_blocks, BLOCK, kvh, HEAD, device=dev, dtype=bf, generator=gen)
    perm = torch.randperm(num_blocks, device=dev, generator=gen)[: n * pages].to(torch.int32)
    table = perm.reshape(n, pages).contiguous()
    q_rows = torch.randn(n * q_len, heads, HEAD, device=dev, dtype=bf, generator=gen)
    scale = HEAD ** -0.5
    # The pools and packed rows as cuDNN's 4-D tensors: views with metal-attn's strides, no copies.
    q4 = q_rows.view(n, q_len, heads, HEAD).permute(0, 2, 1, 3)
    kc = k_pool.permute(0, 2, 1, 3)
    vc = v_pool.permute(0, 2, 1, 3)
    o_paged = torch.empty_like(q_rows)
    o_cont = torch.empty_like(q_rows)
    o_hnd = torch.empty_like(q_rows)
    o_nopad = torch.empty_like(q_rows)
    lens_q = torch.full((n, 1, 1, 1), q_len, device=dev, dtype=torch.int32)
    lens_kv = torch.full((n, 1, 1, 1), seq_len, device=dev, dtype=torch.int32)
    # Contiguous K/V gathered from the pools: [n, kvh, seq_len, head].
    flat = table.long().reshape(-1)
    k_cont = k_pool[flat].reshape(n, pages * BLOCK, kvh, HEAD)[:, :seq_len].permute(0, 2, 1, 3).contiguous()
    v_cont = v_pool[flat].reshape(n, pages * BLOCK, kvh, HEAD)[:, :seq_len].permute(0, 2, 1, 3).contiguous()
    row = {"shape": label, "n": n, "q_len": q_len, "seq_len": seq_len, "heads": heads, "kv_heads": kvh,
           "head": HEAD, "block_size": BLOCK}
    flops = Shape(n, heads, kvh, HEAD, seq_len, "bfloat16", block_size=BLOCK, q_len=q_len).flops  # the suite's

    # Reference: torch SDPA in float32 on the gathered K/V, explicit bottom-right mask.
    qi = torch.arange(q_len, device=dev)[:, None]
    kj = torch.arange(seq_len, device=dev)[None, :]
    mask = kj <= (seq_len - q_len) + qi
    group = heads // kvh
    ref = torch.nn.functional.scaled_dot_product_attention(
        q4.float(), k_cont.float().repeat_interleave(group, 1), v_cont.float().repeat_interleave(group, 1),
        attn_mask=mask, scale=scale)
    ref_rows = ref.permute(0, 2, 1, 3).reshape(n * q_len, heads, HEAD)

    for name, paged, tensors in (
        ("paged", True, {"q": q4, "k": kc, "v": vc, "table": table.view(n, 1, pages, 1),
                         "table_v": table.view(n, 1, pages, 1).clone(), "seq_len_q": lens_q, "seq_len_kv": lens_kv,
                         "o": o_paged.view(n, q_len, heads, HEAD).permute(0, 2, 1, 3)}),
        ("paged_hnd", True, {"q": q4, "k": kc.contiguous(), "v": vc.contiguous(), "table": table.view(n, 1, pages, 1),
                             "table_v": table.view(n, 1, pages, 1).clone(), "seq_len_q": lens_q, "seq_len_kv": lens_kv,
                             "o": o_hnd.view(n, q_len, heads, HEAD).permute(0, 2, 1, 3)}),
        ("contiguous", False, {"q": q4, "k": k_cont, "v": v_cont, "seq_len_q": lens_q, "seq_len_kv": lens_kv,
                               "o": o_cont.view(n, q_len, heads, HEAD).permute(0, 2, 1, 3)}),
        ("contiguous_nopad", False, {"q": q4, "k": k_cont, "v": v_cont,
                                     "o": o_nopad.view(n, q_len, heads, HEAD).permute(0, 2, 1, 3)}),
    ):
        try:
            g, t = build_graph(cudnn, handle, tensors, scale, paged, pages * BLOCK)
        except Exception as exc:  # a probe reports what cuDNN refused
            row[name] = {"error": f"{type(exc).__name__}: {exc}"[:600]}
            print(f"{label:34s} {name:16s} refused: {row[name]['error'][:300]}", flush=True)
            continue
        ws = torch.empty(max(1, g.get_workspace_size()), device=dev, dtype=torch.uint8)
        pack = {t[k]: v for k, v in tensors.items()}

        def call(g=g, pack=pack, ws=ws):
            g.execute(pack, ws, handle=handle)

        call()
        torch.cuda.synchronize()
        out_rows = {"paged": o_paged, "paged_hnd": o_hnd, "contiguous": o_cont, "contiguous_nopad": o_nopad}[name]
        err = (out_rows.float() - ref_rows).abs().max().item()
        ms = time_ms(torch, call, iters)
        row[name] = {"ms": ms, "tflops": flops / ms / 1e9, "max_abs_err": err, "workspace": g.get_workspace_size()}
        print(f"{label:34s} {name:16s} {ms * 1e3:9.1f} us {flops / ms / 1e9:7.1f} TFLOP/s  max|err| {err:.3g}",
              flush=True)
    for name in ("paged", "paged_hnd", "contiguous_nopad"):
        if "ms" in row.get(name, {}) and "ms" in row.get("contiguous", {}):
            row[f"{name}_over_contiguous_time"] = ratio = row[name]["ms"] / row["contiguous"]["ms"]
            print(f"{label:34s} {name} / contiguous time {ratio:.3f}", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args(argv)
    import torch  # first: cuDNN's frontend then finds the cuDNN torch loaded

    cudnn = importlib.import_module("cudnn")

    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)  # torch's events time it
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "torch_cudnn": torch.backends.cudnn.version(), "cudnn_backend": cudnn.backend_version(),
            "frontend": getattr(cudnn, "__version__", "?")}
    print(info, flush=True)
    rows = [run_shape(torch, cudnn, handle, *s, iters=args.iters) for s in SHAPES]
    with open(args.out, "w") as f:
        json.dump({"info": info, "results": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
