#!/bin/bash
# FlashAttention-4 (PyTorch) for the benchmarks' comparison columns on a GPU host that lacks its wheels
# and cannot reach an index (docs/BENCHMARKING.md, "FlashAttention-4 beside"). Measurement only.
#
#   tools/flash4_site.sh pack            # here: download the pinned cp312 wheels, extract them into one
#                                        # site folder, xz it, split it into .flash4/part1 and .flash4/part2
#                                        # (each under one device call's 64 MiB carry)
#   tools/flash4_site.sh stage           # GPU host, call 1 (carry .flash4/part1): keep part 1 in ~/flash4
#   eval "$(tools/flash4_site.sh unpack)"  # GPU host, call 2 while the machine is warm (carry
#                                        # .flash4/part2): join, extract to ~/flash4/site, export FLASH4_PATH
#   PYTHONPATH=$PWD:$FLASH4_PATH python3 examples/benchmark.py ...
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
out=$here/.flash4
home=$HOME/flash4
wheels="flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1
  nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 apache-tvm-ffi torch-c-dlpack-ext
  quack-kernels"
case "${1:-}" in
  pack)
    py=${PYTHON:-python3}
    rm -rf "$out" && mkdir -p "$out/wheels" "$out/site" "$out/part1" "$out/part2"
    # shellcheck disable=SC2086
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 -d "$out/wheels" $wheels
    for w in "$out"/wheels/*.whl; do "$py" -m zipfile -e "$w" "$out/site/"; done
    tar -C "$out/site" -cf - . | xz -T2 -6 > "$out/site.tar.xz"
    half=$(( ($(stat -c %s "$out/site.tar.xz") + 1) / 2 ))
    split -b "$half" "$out/site.tar.xz" "$out/part_"
    mv "$out/part_aa" "$out/part1/" && mv "$out/part_ab" "$out/part2/"
    rm -rf "$out/site" "$out/wheels" "$out/site.tar.xz"
    ls -l "$out"/part1 "$out"/part2 ;;
  stage)
    mkdir -p "$home" && cp "$out/part1/part_aa" "$home/" && echo "staged part 1 in $home" >&2 ;;
  unpack)
    if [ ! -d "$home/site" ]; then
      cat "$home/part_aa" "$out/part2/part_ab" | xz -d | { mkdir -p "$home/site" && tar -C "$home/site" -xf -; }
    fi
    s=$home/site
    echo "export FLASH4_PATH=$s/nvidia_cutlass_dsl/python_packages:$s/nvidia_cutlass_dsl/dsl_packages:$s" ;;
  *) sed -n '2,12p' "$0"; exit 2 ;;
esac
