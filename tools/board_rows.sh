#!/usr/bin/env bash
# On a Hopper GPU host: the open issues' board rows in one call, each script's output kept under a
# folder ($OUT on the device machine, else ./board_rows). Every row is measured beside its own
# baseline in the same script (same-run ratios); the board's name comes first, since the issues'
# targets are the H200's and an H100 often comes instead (docs/PERF.md, each session's entry).
#
#   bash tools/board_rows.sh            # every row (~6-7 min on an H100)
#   ROWS="chunks decode generate" bash tools/board_rows.sh
#
# Rows: chunks (issue 15: chunked prefill against the dense kernel), fp8 (issue 17: the FP8 cache
# against the bf16 one, decode and chunks), decode (issue 20: decode device time against cuDNN),
# generate (issue 15: examples/generate.py's decode against cuDNN; ~1 min; run without the tests'
# XLA_FLAGS, whose gemms without autotuning made the whole model 2.4x slower), update (issue 15:
# update_kvcache's two scatters against one variadic scatter, tools/kv_scatter.py), prefill (issue 18:
# every head dim beside cuDNN, with the hd96 / hd192 consistency lines; FlashAttention-4 joins when
# its wheels are on PYTHONPATH).
set -u
cd "$(dirname "$0")/.."
out=${OUT:-board_rows}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_FLAGS=--xla_gpu_autotune_level=0
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee "$out/board.txt"
for row in ${ROWS:-chunks fp8 decode generate update prefill}; do
  case $row in
    chunks) cmd=(python3 tools/chunk_probe.py) ;;
    fp8) cmd=(python3 tools/fp8_decode_bench.py --rounds 2) ;;
    decode) cmd=(python3 examples/benchmark_decode.py --device-time --rounds 3 --no-paged) ;;
    generate) cmd=(env -u XLA_FLAGS python3 examples/generate.py) ;;
    update) cmd=(python3 tools/kv_scatter.py --rounds 3) ;;
    prefill) cmd=(python3 examples/benchmark.py --hd 64,96,128,192,256 --seqlens 1k,4k,16k --dtype bf16) ;;
    *) echo "unknown row $row (chunks, fp8, decode, generate, update, prefill)"; exit 2 ;;
  esac
  echo "== $row: ${cmd[*]}"
  timeout 300 "${cmd[@]}" > "$out/$row.txt" 2>&1
  echo "rc $?"
  tail -14 "$out/$row.txt"
done
