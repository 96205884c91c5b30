"""Host cost of reading a model's weights at every call of a compiled function (``inputs=model.state``).

    python benchmarks/host_cost_compiled_inputs.py [--layers N] [--calls N] [--rounds N]

`metal_attn.mlx_lm.compiled.CompiledDecode` compiles the decode forward with the model's parameter tree as
an implicit input, so that a model updated in place decodes with its new weights. MLX then flattens that
tree on every call. This measures what that costs the host, on whatever backend runs it: the same small
compiled function (``x @ lm_head.weight.T``) called with and without ``inputs=model.state`` of a random
llama of ``--layers`` layers (the tree's size is what matters, not the widths), median thread time of
``--calls`` lazy calls per round (nothing is evaluated inside the timed span).
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import llama


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model = llama.Model(llama.ModelArgs.from_dict(dict(
        model_type="llama", hidden_size=64, num_hidden_layers=args.layers, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=256, tie_word_embeddings=False)))
    mx.eval(model.parameters())

    def head(x: mx.array) -> mx.array:
        return x @ model.lm_head.weight.T  # read through the model: the tree's tracers replace it while tracing

    plain, with_tree = mx.compile(head), mx.compile(head, inputs=model.state)
    x = mx.ones((1, 64))
    mx.eval(plain(x), with_tree(x))

    def median_us(fn) -> float:
        times = []
        for _ in range(args.calls):
            t = time.thread_time_ns()
            out = fn(x)
            times.append(time.thread_time_ns() - t)
        mx.eval(out)
        return statistics.median(times) / 1e3

    arrays = len(tree_flatten(model.state))
    print(f"{mx.default_device()}; llama of {args.layers} layers, {arrays} arrays in its state")
    for r in range(args.rounds):
        print(f"round {r + 1}: compiled call {median_us(plain):.1f} us, with inputs=model.state "
              f"{median_us(with_tree):.1f} us")


if __name__ == "__main__":
    main()
