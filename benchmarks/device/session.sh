#!/usr/bin/env bash
# The measurements a GPU session of 30 device minutes owes the open issues, in phases that each fit one
# device call (at most 10 minutes). On the GPU machine, from the checkout root, with the bundle and
# the CUDA module carried (benchmarks/device/README.md):
#
#   source .device/setup.sh && bash benchmarks/device/session.sh PHASE [PHASE ...]
#
# Phases (each writes its logs and JSON under $OUT/PHASE/, OUT defaulting to ./device-out):
#   tests    tests/gpu but the fuzz (pytest-xdist when the machine has it: 280 s with -n 14 in the
#            thirteenth session)
#   decode   decode-gpu with the fused-reducer and keys-as-rows A/Bs, the decode-step suite three times, the
#            matrix paths' sweep at the plans' own partitions
#            (issue #17)
#   prefill  the mixed batches three times, where a mixed batch's GPU time goes and its host time, and
#            the mixed batches without MLX's CUDA graphs (issue #18)
#   streams  a mixed batch's decode rows on one GPU stream or two (METAL_ATTN_DECODE_ROWS_STREAM), the A/B behind
#            DECODE_ROWS_STREAM_RULES: both mixed routes blocking and queued, the prefill-gpu suite's mixed batches
#            against MLX SDPA, and the mixed-batch GPU tests with the second stream forced on (issue #18)
#   stalls   our prefill route's multi-millisecond stalls under queued calls (H100, thirty-first session): the
#            probe's samples with host time, Python's collections and MLX's allocator, on b4 q2048 and q4096,
#            then the bench's b4 q2048 four times, then the bench's sampling on b4 q2048 traced (CUPTI, host API
#            calls included: each slow sample's GPU busy time, longest idle gap and the host calls in it) (issue #18)
#   finish   sdpa_prefill's finish in place (METAL_ATTN_CUDA_FINISH_IN_PLACE): the chain and prefill GPU tests, then
#            the prefill-gpu suite's prefill shapes with the copying finish in the same run, queued twice and
#            blocking once (issue #18)
#   idle     chains that launch MLX's encoded graph when the GPU is idle (METAL_ATTN_CUDA_COMMIT_WHEN_IDLE, its rule
#            IDLE_COMMIT_RULE): its GPU tests, the decode-step suite by the rule and with the setting off in one
#            process, then the generate suite (engine and generate_step at 1 and 8 requests) in a process by the
#            rule and one with the setting off (issue #17)
#   direct   chains that start an idle GPU launching straight onto MLX's stream (METAL_ATTN_CUDA_IDLE_DIRECT_CHAINS):
#            the chain GPU tests, the decode-step suite's compiled step with 0, 1 and 32 such chains in one process,
#            twice, blocking; the generate suite at 1 and 8 requests at 0 and 32; the step pipelined at 0 and 32
#            (issue #17, the step boundary)
#   wait     how a blocking step is waited for: benchmarks/probe_step_wait.py (MLX's wait, the driver's and our
#            stream spin, torch's spin and a blocking torch event) and the spin's GPU test (issue #17, the step
#            boundary; on an H100 the three MLX waits read the same, forty-first session)
#   staged   the decode-step suite's compiled step cut into segments queued as each is built (auto_staged,
#            STAGED_SEGMENTS) against the whole compiled step and torch SDPA, three times, blocking; then
#            the three shapes that miss, pipelined (issue #17, the step boundary)
#   engine   the host cost of reading the weights per compiled call, then the generate suite at 1, 8, 32
#            and 64 requests (issue #15)
#   baseline the H200 baselines' candidates, saved with --json for --write-baseline (benchmarks/README.md)
#   queued   the pipelined suites with queued samples of 50 ms (forty-second session), interleaved: single decode
#            calls (the per-call targets), the 32-layer step queued, and the prefill suite, then the compiled
#            step's host time a layer on an idle GPU (benchmarks/probe_step_host.py: #17's 10 µs target) (issues
#            #17 and #18; about 4 minutes on an H100)
#   tiles    the tiled kernel (and its split reducer) as one CUDA chain (METAL_ATTN_CUDA_TILED_CHAINS, on by default
#            since the forty-fourth session): the chain's bitwise GPU test and the tiled GPU suite, then the prefill
#            suite's tiles-routed chunk and mixed batches, chains on and off in one interleaved run, then short
#            chunks after context through the tiles and through sdpa_prefill with its rule opened, queued
#            (benchmarks/probe_tiled_split.py: SDPA_PREFILL_RULES' min_chunk_pairs; measured in the tenth
#            session, confirmed on an H100 in the forty-fifth)
#   inchain  a mixed batch's decode rows inside sdpa_prefill's finish chain (METAL_ATTN_CUDA_DECODE_ROWS_IN_CHAIN, on
#            by default since the forty-sixth session): the chain and sdpa_prefill GPU tests with it on (the same
#            bytes as the rows' own chain, the oracle), the prefill suite's mixed batches with it on and off and MLX
#            SDPA, queued and interleaved, five repeats, then a queued call's host time with it off and on
#            (benchmarks/probe_mixed_host.py) (issue #18)
#   cudnn    cuDNN's SDPA reading our K/V pools in place through page tables, against cuDNN on contiguous K/V, on
#            four of the prefill suite's shapes and the third mixed batch's chunk (benchmarks/probe_cudnn_paged.py; torch and cuDNN's Python frontend, whose
#            wheel travels in .device/extra/) (issue #18: the route without the gather's and the finish's copies)
#   rowswait what a mixed batch's decode rows in the finish chain wait for (METAL_ATTN_CUDA_DECODE_ROWS_WAIT, built in
#            the forty-seventh session, measured on the H200 in the forty-eighth): its chain GPU tests (the same bytes whatever they wait
#            for), the prefill suite's mixed batches waiting for nothing, the gathers and the fused SDPA output
#            against MLX SDPA, queued and interleaved, five repeats, then where the mixed batches' GPU time goes
#            (benchmarks/profile_mixed.py) waiting for nothing and for the gathers (issue #18)
#   mixblock the decode-gpu suite's mixed batches with blocking calls, the baseline's candidates among them (the first
#            batch read 29-39% under the H200 baseline in the forty-eighth session, within its margin): the decode
#            rows in the finish chain and in their own chain, waiting for the gathers, classic, gather + SDPA, torch
#            SDPA, MLX SDPA (also from and to packed rows: mlx_sdpa_packed) and the ceiling, interleaved (the
#            baseline's run was not), three repeats; then
#            benchmarks/profile_mixed.py, whose rows now print each call's timeline (what runs beside what); then
#            whether one masked SDPA call can stand in for the second batch's two runs (benchmarks/probe_sdpa_bias.py:
#            cuDNN's bias path against a causal call per run); then a queued call's host time, building and
#            queueing, for auto and both MLX SDPA peers (benchmarks/probe_mixed_host.py) (issue #18)
#   fuzz     the GPU fuzz (2,000 seeds; MA_TEST_FUZZ_GPU_SEED / _CASES pick a range: 847 seeds took 330 s
#            without xdist on an H100; with -n 14, 751 seeds filled the old 300 s limit in the forty-seventh
#            session, so the fuzz now takes up to 540 s: a range of 1,000 in one call)
#   partition the per-token kernel at forced partition sizes, powers of two and the sizes between them,
#            on the shapes issue #17 misses or nearly misses (single calls, pipelined, torch in the run)
#   ncu      ncu (speed of light, occupancy, warp stalls, memory) of our decode call and torch SDPA's on the
#            four shapes issue #17 still misses, the last of four calls each (benchmarks/ncu_decode_pair.py)
#   kernels  the decode shapes' kernel time against torch SDPA's (CUPTI, benchmarks/probe_kernel_text.py; the reducer's
#            partition slices by the rule and one slice, the A/B), the GPU's
#            idle time between queued calls and whether the host was late (benchmarks/probe_call_gaps.py), then
#            the same shapes' calls (decode-gpu, pipelined) with and without MLX's CUDA graphs: how much of a
#            call is its kernels (issue #17; about 2 minutes)
#
# Each step runs under its own time limit (STEP_LIMIT seconds, default 300; the GPU tests and decode-step 420,
# the fuzz 540), cut to what is left of BUDGET (seconds for the whole command, default 570: a device call
# holds 600), so a slow step leaves the others their time and the command ends before the device tool's
# limit; a step with under 30 s left is skipped. A progress line with the elapsed seconds goes before and after each.
# Steps that fail or are skipped are listed at the end and the script exits 1; the others' files are there.
#
# PACK=1 packs the phases' folders into $OUT/session.tar.gz at the end, whether the steps passed or not, and
# removes them: the device tool brings back at most eight files a call, and a call of two phases can write more
# (the forty-eighth session lost five of rowswait's seven that way). Unpack with `tar -xzf session.tar.gz`.
#
# DRY_RUN=1 checks every step on any machine, in seconds, before device time is spent on it: the bench
# commands run with --dry-run (every flag, suite, shape and candidate name checked), pytest collects
# only, and a script is imported without running its main (its imports and names resolve).
# tests/test_device_session.py runs every phase so in CI.
set -uo pipefail
OUT=${OUT:-$PWD/device-out}
STEP_LIMIT=${STEP_LIMIT:-300}
BUDGET=${BUDGET:-570}
DRY_RUN=${DRY_RUN:-0}
PACK=${PACK:-0}
BENCH=(python3 -m metal_attn.bench.cli)
# The decode-gpu suite's eight decode shapes, as benchmarks/probe_kernel_text.py takes them.
DECODE_SHAPES=b1:32:8:128:32768,b8:32:8:128:4096,b32:32:8:128:4096,b64:32:8:128:8192,b8:32:8:128:32768,\
b1:24:4:256:65536,b16:16:2:128:16384,b128:32:8:128:1024
PHASES=(tests decode prefill streams stalls finish idle direct wait staged engine baseline queued tiles inchain cudnn rowswait mixblock fuzz ncu partition kernels)
start=$(date +%s)
failed=()

say() { echo "==> [$(($(date +%s) - start))s] $*"; }

# A script imported as `python3 SCRIPT` would run it (its folder first on sys.path), but not as __main__.
DRY_IMPORT='import importlib.util as u, os, sys; sys.path.insert(0, os.path.dirname(sys.argv[1])); '\
's = u.spec_from_file_location("dry_run", sys.argv[1]); s.loader.exec_module(u.module_from_spec(s))'

# dry_check COMMAND...: what DRY_RUN=1 runs instead of COMMAND (into the array `check`; `how` says it).
dry_check() {
  if [ "$1" = env ]; then  # env NAME=VALUE... COMMAND: check COMMAND, keeping the variables
    local vars=()
    shift
    while [ $# -gt 0 ] && [ "${1#*=}" != "$1" ]; do vars+=("$1"); shift; done
    dry_check "$@"
    check=(env "${vars[@]}" "${check[@]}")
    return
  fi
  local all="$*"
  if [ "${all#"${BENCH[*]} "}" != "$all" ]; then
    check=("$@" --dry-run) how="--dry-run"
  elif [ "${all#python3 -m pytest }" != "$all" ]; then
    check=("$@" --collect-only -q) how="collected only"
  else  # a script, under ncu or not: imported, its main not run
    local a
    for a in "$@"; do
      case $a in
        *.py) check=(python3 -c "$DRY_IMPORT" "$a") how="$a imported, not run"; return ;;
      esac
    done
    check=(false) how="nothing here knows how to check it"
  fi
}

# step NAME LIMIT COMMAND...: run COMMAND with its output in $dir/NAME.log (its tail on failure).
step() {
  local name=$1 limit=$2
  shift 2
  local shown="$*"
  if [ "$DRY_RUN" = 1 ]; then
    dry_check "$@"
    set -- "${check[@]}"
    shown="$shown  [dry run: $how]"
  fi
  local left=$((BUDGET - ($(date +%s) - start)))
  if [ "$left" -lt 30 ]; then
    say "$phase/$name: skipped (${left}s of BUDGET=${BUDGET}s left)"
    failed+=("$phase/$name (skipped)")
    return
  fi
  [ "$limit" -le "$left" ] || limit=$left
  say "$phase/$name: $shown"
  timeout --signal=INT --kill-after=20 "$limit" "$@" >"$dir/$name.log" 2>&1
  local rc=$?
  if [ "$rc" -eq 0 ]; then
    say "$phase/$name: ok"
  else
    say "$phase/$name: FAILED (exit $rc; 124 is the ${limit}s limit)"
    tail -n 25 "$dir/$name.log"
    failed+=("$phase/$name")
  fi
}

xdist() { python3 -c 'import xdist' 2>/dev/null && echo "-n 14" || true; }
xdist_groups() { python3 -c 'import xdist' 2>/dev/null && echo "--dist loadgroup" || true; }  # the fuzz's compile groups

run_phase() {
  case "$phase" in
    tests)
      # shellcheck disable=SC2046
      step pytest 420 python3 -m pytest -q -rfEx $(xdist) tests/gpu --ignore=tests/gpu/test_fuzz_gpu.py ;;
    fuzz)
      # shellcheck disable=SC2046
      step fuzz 540 python3 -m pytest -q -rfEx $(xdist) $(xdist_groups) tests/gpu/test_fuzz_gpu.py ;;
    decode)
      step decode-gpu "$STEP_LIMIT" "${BENCH[@]}" --suite decode-gpu --pipelined --quiet --markdown \
        --candidates "auto,auto[cuda_fused_reduce=1],auto[mma_key_rows=0],torch_sdpa,mlx_sdpa,ceiling" \
        --json "$dir/decode-gpu.json"
      step decode-step 420 "${BENCH[@]}" --suite decode-step --repeat 3 --quiet --markdown \
        --candidates "auto,torch_sdpa,mlx_sdpa,ceiling" --json "$dir/decode-step.json"
      step sweep-matrix "$STEP_LIMIT" python3 benchmarks/sweep_gpu_tuning.py "$dir/sweep-matrix.json" matrix-auto ;;
    streams)
      step probe-blocking "$STEP_LIMIT" python3 benchmarks/probe_decode_rows_stream.py "$dir/probe-blocking.json"
      step probe-queued "$STEP_LIMIT" python3 benchmarks/probe_decode_rows_stream.py --pipelined \
        "$dir/probe-queued.json"
      step mixed "$STEP_LIMIT" "${BENCH[@]}" --suite prefill-gpu --pipelined --shapes mixed --repeat 3 --quiet \
        --markdown --candidates "auto[decode_rows_stream=0],auto[decode_rows_stream=1],mlx_sdpa" \
        --json "$dir/mixed.json"
      # shellcheck disable=SC2046
      step pytest "$STEP_LIMIT" env METAL_ATTN_DECODE_ROWS_STREAM=1 python3 -m pytest -q -rfEx $(xdist) \
        tests/gpu/test_sdpa_prefill_gpu.py tests/gpu/test_nonfinite_gpu.py tests/gpu/test_tiled_prefill_gpu.py \
        tests/gpu/test_mlx_lm_gpu.py ;;
    stalls)
      step probe-b4 "$STEP_LIMIT" python3 benchmarks/probe_prefill_stalls.py "$dir/probe-b4.json"
      step probe-q4096 "$STEP_LIMIT" python3 benchmarks/probe_prefill_stalls.py --batch 1 --q-len 4096 \
        "$dir/probe-q4096.json"
      step bench-b4 "$STEP_LIMIT" "${BENCH[@]}" --suite prefill-gpu --pipelined --shapes "b4 q2048" --repeat 4 \
        --quiet --markdown --candidates auto,sdpa_prefill,mlx_sdpa --json "$dir/bench-b4.json"
      step trace-b4 "$STEP_LIMIT" python3 benchmarks/probe_prefill_stalls.py --trace "$dir/trace-b4.json"
      # The host-bound mixed batch (#18): GPU busy, idle gaps and the host's calls in them, queued as the bench does.
      step trace-mixed "$STEP_LIMIT" python3 benchmarks/probe_prefill_stalls.py --trace --shape "mixed 32x1" \
        "$dir/trace-mixed.json" ;;
    finish)
      # shellcheck disable=SC2046
      step pytest "$STEP_LIMIT" python3 -m pytest -q -rfEx $(xdist) tests/gpu/test_cuda_chains_gpu.py \
        tests/gpu/test_sdpa_prefill_gpu.py tests/gpu/test_nonfinite_gpu.py
      step suite-queued "$STEP_LIMIT" "${BENCH[@]}" --suite prefill-gpu --pipelined --shapes prefill --repeat 2 \
        --quiet --markdown --candidates "auto,auto[cuda_finish_in_place=0],mlx_sdpa" --json "$dir/suite-queued.json"
      step suite-blocking "$STEP_LIMIT" "${BENCH[@]}" --suite prefill-gpu --shapes prefill --quiet --markdown \
        --candidates "auto,auto[cuda_finish_in_place=0],mlx_sdpa" --json "$dir/suite-blocking.json" ;;
    prefill)
      step mixed "$STEP_LIMIT" "${BENCH[@]}" --suite prefill-gpu --pipelined --shapes mixed --repeat 3 --quiet \
        --markdown --candidates "auto,tiled_prefill,sdpa_prefill,mlx_sdpa" --json "$dir/mixed.json"
      step profile-mixed "$STEP_LIMIT" python3 benchmarks/profile_mixed.py "$dir/profile-mixed.json"
      step mixed-host "$STEP_LIMIT" python3 benchmarks/probe_mixed_host.py "$dir/mixed-host.json"
      # MLX without its CUDA graphs: the kernels in series, each launched alone (twenty-sixth session: both sides
      # slower, the peer most; docs/bench-h200-prefill.md).
      step mixed-no-graphs "$STEP_LIMIT" env MLX_USE_CUDA_GRAPHS=0 "${BENCH[@]}" --suite decode-gpu --pipelined \
        --shapes mixed --repeat 3 --quiet --markdown --candidates auto,mlx_sdpa --json "$dir/mixed-no-graphs.json" ;;
    idle)
      # shellcheck disable=SC2046
      step pytest "$STEP_LIMIT" python3 -m pytest -q -rfEx $(xdist) tests/gpu/test_cuda_chains_gpu.py \
        tests/gpu/test_compiled_decode_gpu.py
      step decode-step 420 "${BENCH[@]}" --suite decode-step --repeat 2 --quiet --markdown --candidates \
        "auto_compiled,auto_compiled[cuda_commit_when_idle=0],torch_sdpa,auto,auto[cuda_commit_when_idle=0],ceiling" \
        --json "$dir/decode-step.json"
      # The generate suite takes no settings variants: one process by the rule, one with the setting off.
      step generate-rule "$STEP_LIMIT" "${BENCH[@]}" --suite generate --quiet --concurrency 1,8 --shared-prefix 0 \
        --gen-tokens 64 --candidates engine,generate_step --json "$dir/generate-rule.json"
      step generate-off "$STEP_LIMIT" env METAL_ATTN_CUDA_COMMIT_WHEN_IDLE=0 "${BENCH[@]}" --suite generate --quiet \
        --concurrency 1,8 --shared-prefix 0 --gen-tokens 64 --candidates engine,generate_step \
        --json "$dir/generate-off.json" ;;
    direct)
      # shellcheck disable=SC2046
      step pytest "$STEP_LIMIT" python3 -m pytest -q -rfEx $(xdist) tests/gpu/test_cuda_chains_gpu.py
      step decode-step 420 "${BENCH[@]}" --suite decode-step --repeat 2 --quiet --markdown --candidates \
        "auto_compiled,auto_compiled[cuda_idle_direct_chains=1],auto_compiled[cuda_idle_direct_chains=32],torch_sdpa,ceiling" \
        --json "$dir/decode-step.json"
      step generate-0 "$STEP_LIMIT" "${BENCH[@]}" --suite generate --quiet --concurrency 1,8 --shared-prefix 0 \
        --gen-tokens 64 --candidates engine,generate_step --json "$dir/generate-0.json"
      step generate-32 "$STEP_LIMIT" env METAL_ATTN_CUDA_IDLE_DIRECT_CHAINS=32 "${BENCH[@]}" --suite generate --quiet \
        --concurrency 1,8 --shared-prefix 0 --gen-tokens 64 --candidates engine,generate_step \
        --json "$dir/generate-32.json"
      step decode-step-pipelined "$STEP_LIMIT" "${BENCH[@]}" --suite decode-step --pipelined --quiet --markdown \
        --candidates "auto_compiled,auto_compiled[cuda_idle_direct_chains=32],torch_sdpa,ceiling" \
        --json "$dir/decode-step-pipelined.json" ;;
    wait)
      step probe "$STEP_LIMIT" python3 benchmarks/probe_step_wait.py "$dir/wait.json" --steps 40
      step pytest "$STEP_LIMIT" python3 -m pytest -q -rfEx tests/gpu/test_cuda_chains_gpu.py -k spin ;;
    staged)
      step decode-step 420 "${BENCH[@]}" --suite decode-step --repeat 3 --quiet --markdown --candidates \
        auto_compiled,auto_staged,torch_sdpa,ceiling --json "$dir/decode-step.json"
      step decode-step-pipelined "$STEP_LIMIT" "${BENCH[@]}" --suite decode-step --pipelined --quiet --markdown \
        --shapes "b8 h32/8 d128 L4096,b16,b1 h32/8 d128 L32768" --candidates auto_compiled,auto_staged,torch_sdpa \
        --json "$dir/decode-step-pipelined.json" ;;
    engine)
      step compiled-inputs 60 python3 benchmarks/host_cost_compiled_inputs.py
      step generate "$STEP_LIMIT" "${BENCH[@]}" --suite generate --quiet \
        --candidates engine,batch_generator --concurrency 1,8,32,64 --json "$dir/generate.json" ;;
    baseline)
      step decode-gpu "$STEP_LIMIT" "${BENCH[@]}" --suite decode-gpu --quiet \
        --candidates auto,classic,torch_sdpa,gather_sdpa,ceiling --json "$dir/decode-gpu.json"
      step decode-step "$STEP_LIMIT" "${BENCH[@]}" --suite decode-step --quiet \
        --candidates auto,auto_compiled,torch_sdpa,ceiling --json "$dir/decode-step.json" ;;
    queued)
      step decode-gpu "$STEP_LIMIT" "${BENCH[@]}" --suite decode-gpu --pipelined --interleave --shapes decode --quiet \
        --markdown --candidates auto,torch_sdpa,mlx_sdpa,ceiling --json "$dir/decode-gpu.json"
      step decode-step "$STEP_LIMIT" "${BENCH[@]}" --suite decode-step --pipelined --interleave --quiet --markdown \
        --candidates auto_compiled,torch_sdpa,mlx_sdpa,ceiling --json "$dir/decode-step.json"
      step prefill-gpu "$STEP_LIMIT" "${BENCH[@]}" --suite prefill-gpu --pipelined --interleave --quiet --markdown \
        --json "$dir/prefill-gpu.json"
      step step-host "$STEP_LIMIT" python3 benchmarks/probe_step_host.py ;;
    tiles)
      # shellcheck disable=SC2046
      step pytest "$STEP_LIMIT" python3 -m pytest -q -rfEx $(xdist) \
        tests/gpu/test_tiled_prefill_gpu.py tests/gpu/test_cuda_chains_gpu.py
      step suite "$STEP_LIMIT" "${BENCH[@]}" --suite prefill-gpu --pipelined --interleave --shapes "q64,mixed" --quiet \
        --markdown --candidates "auto,auto[cuda_tiled_chains=0],tiled_prefill,tiled_prefill[cuda_tiled_chains=0],mlx_sdpa" \
        --json "$dir/tiles.json"
      step split "$STEP_LIMIT" python3 benchmarks/probe_tiled_split.py "$dir/split.json" --pipelined \
        --chunks 32:2048,64:2112,128:4096,256:4096,64:8192 ;;
    inchain)
      # shellcheck disable=SC2046
      step pytest "$STEP_LIMIT" env METAL_ATTN_CUDA_DECODE_ROWS_IN_CHAIN=1 python3 -m pytest -q -rfEx $(xdist) \
        tests/gpu/test_cuda_chains_gpu.py tests/gpu/test_sdpa_prefill_gpu.py
      step suite "$STEP_LIMIT" "${BENCH[@]}" --suite prefill-gpu --pipelined --interleave --shapes mixed --repeat 5 \
        --quiet --markdown --json "$dir/inchain.json" --candidates "auto,auto[cuda_decode_rows_in_chain=0],mlx_sdpa"
      step host-off "$STEP_LIMIT" env METAL_ATTN_CUDA_DECODE_ROWS_IN_CHAIN=0 python3 benchmarks/probe_mixed_host.py \
        "$dir/host-off.json"
      step host-on "$STEP_LIMIT" env METAL_ATTN_CUDA_DECODE_ROWS_IN_CHAIN=1 python3 benchmarks/probe_mixed_host.py \
        "$dir/host-on.json" ;;
    rowswait)
      # shellcheck disable=SC2046
      step pytest "$STEP_LIMIT" python3 -m pytest -q -rfEx $(xdist) tests/gpu/test_cuda_chains_gpu.py \
        -k "finish_chain or refused_when_built or after_an_input"
      step suite "$STEP_LIMIT" "${BENCH[@]}" --suite prefill-gpu --pipelined --interleave --shapes mixed --repeat 5 \
        --quiet --markdown --json "$dir/rowswait.json" \
        --candidates "auto,auto[cuda_decode_rows_wait=gathers],auto[cuda_decode_rows_wait=sdpa],mlx_sdpa"
      step profile-none "$STEP_LIMIT" env METAL_ATTN_CUDA_DECODE_ROWS_WAIT=none python3 benchmarks/profile_mixed.py \
        "$dir/profile-none.json"
      step profile-gathers "$STEP_LIMIT" env METAL_ATTN_CUDA_DECODE_ROWS_WAIT=gathers \
        python3 benchmarks/profile_mixed.py "$dir/profile-gathers.json" ;;
    mixblock)
      step suite "$STEP_LIMIT" "${BENCH[@]}" --suite decode-gpu --interleave --shapes mixed --repeat 3 --quiet \
        --markdown --json "$dir/mixblock.json" \
        --candidates "auto,auto[cuda_decode_rows_in_chain=0],auto[cuda_decode_rows_wait=gathers],classic,gather_sdpa,\
torch_sdpa,mlx_sdpa,mlx_sdpa_packed,ceiling"
      step profile "$STEP_LIMIT" python3 benchmarks/profile_mixed.py "$dir/profile.json"
      step bias "$STEP_LIMIT" python3 benchmarks/probe_sdpa_bias.py "$dir/bias.json"
      step host "$STEP_LIMIT" python3 benchmarks/probe_mixed_host.py "$dir/host.json" ;;
    partition)
      local p cands=auto
      for p in 192 256 384 512 768 1024 1536 2048 3072 4096; do cands+=",auto[partition_size=$p]"; done
      step sizes "$STEP_LIMIT" "${BENCH[@]}" --suite decode-gpu --pipelined --quiet --markdown \
        --shapes "b1 h32/8 d128 L32768,b8 h32/8 d128 L4096,b8 h32/8 d128 L32768,b1 h24,b16" \
        --candidates "$cands,torch_sdpa,ceiling" --json "$dir/sizes.json" ;;
    kernels)
      step kernel-time "$STEP_LIMIT" python3 benchmarks/probe_kernel_text.py "$dir/kernel-time.json" \
        --texts head=-,one-slice=- --set one-slice:reducer_slices=1 --rounds 2 --shapes "$DECODE_SHAPES"
      step call-gaps "$STEP_LIMIT" python3 benchmarks/probe_call_gaps.py "$dir/call-gaps.json" --shapes "$DECODE_SHAPES"
      step calls "$STEP_LIMIT" "${BENCH[@]}" --suite decode-gpu --pipelined --quiet --markdown --shapes "decode b" \
        --candidates auto,torch_sdpa,ceiling --json "$dir/calls.json"
      step calls-no-graphs "$STEP_LIMIT" env MLX_USE_CUDA_GRAPHS=0 "${BENCH[@]}" --suite decode-gpu --pipelined \
        --quiet --markdown --shapes "decode b" --candidates auto,torch_sdpa,ceiling --json "$dir/calls-no-graphs.json" ;;
    cudnn)
      # cuDNN's frontend is not in the bundle: its wheel travels in .device/extra/ (benchmarks/device/README.md).
      local wheel site=$HOME/cudnn-frontend
      wheel=$(ls .device/extra/nvidia_cudnn_frontend-*-cp312-*.whl 2>/dev/null | head -n 1)
      if [ "$DRY_RUN" != 1 ]; then
        if [ -z "$wheel" ] || ! python3 -m pip install -q --no-deps --no-compile --target "$site" "$wheel"; then
          say "cudnn: no .device/extra/nvidia_cudnn_frontend-*-cp312-*.whl installed (benchmarks/device/README.md)"
          failed+=("cudnn (no frontend)")
          return
        fi
      fi
      step probe "$STEP_LIMIT" env PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" python3 benchmarks/probe_cudnn_paged.py \
        "$dir/probe.json" ;;
    ncu)
      local ncu=${NCU:-$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -n 1)}
      [ "$DRY_RUN" != 1 ] || ncu=${ncu:-ncu}  # a dry run checks the profiled script only
      if [ -z "$ncu" ]; then
        say "ncu: no ncu on PATH or under /usr/local/cuda*/bin (set NCU=...)"
        failed+=("ncu (no ncu)")
        return
      fi
      local shape side tag
      for shape in "8 32 8 128 4096" "16 16 2 128 16384" "1 24 4 256 65536" "8 32 8 128 32768"; do
        tag=b$(echo "$shape" | tr ' ' x)
        for side in ours torch; do  # 4 calls of 2 kernels: the last call's two
          step "$side-$tag" "$STEP_LIMIT" "$ncu" --csv --log-file "$dir/$side-$tag.csv" --clock-control none \
            --cache-control none --section SpeedOfLight --section Occupancy --section LaunchStats \
            --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
            --kernel-name "regex:paged_attention|flash|fmha|sdpa|lean_reduction" --launch-skip 6 --launch-count 2 \
            python3 benchmarks/ncu_decode_pair.py "$side" $shape
        done
      done
      [ "$DRY_RUN" = 1 ] || python3 benchmarks/ncu_summary.py "$dir"/*.csv ;;
  esac
}

[ $# -gt 0 ] || { awk 'NR > 1 && !/^#/ {exit} NR > 1' "$0"; exit 2; }
for phase in "$@"; do  # every name checked before any phase runs
  if [[ " ${PHASES[*]} " != *" $phase "* ]]; then
    allowed=$(printf '%s, ' "${PHASES[@]}")
    echo "unknown phase '$phase' (allowed: ${allowed%, })" >&2
    exit 2
  fi
done
python3 -c 'import metal_attn.cuda_ops as c; print("CUDA chains:", "on" if c.enabled() else "off")' \
  || echo "metal_attn.cuda_ops does not import: the chains are off"
for phase in "$@"; do
  dir="$OUT/$phase"
  mkdir -p "$dir"
  say "phase $phase -> $dir"
  run_phase
done
if [ "$PACK" = 1 ] && [ "$DRY_RUN" != 1 ]; then
  packed=()
  for phase in "$@"; do  # each folder once, in order (a phase named twice ran twice into one folder)
    [[ " ${packed[*]} " == *" $phase "* ]] || [ ! -d "$OUT/$phase" ] || packed+=("$phase")
  done
  if tar -czf "$OUT/session.tar.gz" -C "$OUT" "${packed[@]}"; then
    (cd "$OUT" && rm -rf -- "${packed[@]}") || say "packed, but the folders could not all be removed"
    say "packed ${packed[*]} into $OUT/session.tar.gz"
  else
    rm -f "$OUT/session.tar.gz"
    say "packing failed: the phases' folders stay under $OUT"
    failed+=("pack")
  fi
fi
if [ ${#failed[@]} -gt 0 ]; then
  say "failed: ${failed[*]}"
  exit 1
fi
if [ "$DRY_RUN" = 1 ]; then
  say "dry run: every step checked (nothing measured)"
else
  say "all steps passed"
fi
