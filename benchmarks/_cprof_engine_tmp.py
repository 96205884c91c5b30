import cProfile, pstats, time, sys
import mlx.core as mx
from metal_attn.bench.generate import _NoStopTokenizer, _prompts, load_bench_model
from metal_attn.engine import Engine, EngineConfig
model, label = load_bench_model("cuda")
for c in (1, 64):
    eng = Engine(model, _NoStopTokenizer(), EngineConfig(num_blocks=c*50+64, max_num_seqs=c, max_num_batched_tokens=8192))
    for p in _prompts(c, 512, 1000, c): eng.add_request(p, max_tokens=100)
    for _ in range(10): eng.step()
    pr = cProfile.Profile(); t = time.perf_counter(); pr.enable()
    for _ in range(40): eng.step()
    pr.disable(); print(f"c={c}: {(time.perf_counter()-t)/40*1e3:.2f} ms/step under cProfile")
    pstats.Stats(pr).sort_stats("tottime").print_stats(22)
    eng.synchronize()
