#!/usr/bin/env bash
# Build the standalone kernel harness for one exported variant: build.sh KERNEL_DIR SYMBOL OUT
# (KERNEL_DIR holds SYMBOL.h/.o from `python -m fa4_jax.aot`). Runs on any x86-64 host with CUDA 13.
set -euo pipefail
dir=$1; sym=$2; out=$3
dsl=$(${PYTHON:-python} -c "import nvidia_cutlass_dsl, os; print(os.path.join(nvidia_cutlass_dsl.__path__[0], 'cu13', 'lib'))")
hd=$(echo "$sym" | sed -E 's/.*_hd([0-9]+)_.*/\1/')
mask=0; [[ $sym == *_causal* ]] && mask=1; [[ $sym == *_local* ]] && mask=2
softcap=0; [[ $sym == *_softcap ]] && softcap=1
g++ -O2 -std=c++17 -I/usr/local/cuda/include -I"$dir" -DVARIANT="$sym" -DVARIANT_HEADER="\"$sym.h\"" \
  -DHEAD_DIM="$hd" -DMASK="$mask" -DSOFTCAP="$softcap" "$(dirname "$0")/fwd_harness.cc" "$dir/$sym.o" \
  "$dsl/libcuda_dialect_runtime_static.a" /usr/local/cuda/lib64/libcudart_static.a -ldl -lrt -lpthread -o "$out"
