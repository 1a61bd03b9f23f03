#!/usr/bin/env bash
# Registers, stack and static shared memory of every model kernel, per dtype and head size,
# from the cubins NVRTC builds (no GPU needed): the kernels test writes them
# (BGS_DUMP_CUBINS) and cuobjdump (the nvidia-cuda-cuobjdump wheel, installed into target/)
# reads them. Blocks per SM follow: 65,536 registers and 228 KB of shared memory an SM on an
# H100/H200.
# Usage: bash bench/gpu/kernel-resources.sh [dtype-head_dim ...]   (default: bf16-64)
set -euo pipefail
cd "$(dirname "$0")/../.."
tools=target/cuobjdump
if [ ! -x "$tools/nvidia/cu13/bin/cuobjdump" ]; then
  python3 -m pip install -q --disable-pip-version-check --target "$tools" 'nvidia-cuda-cuobjdump==13.*'
fi
wheels=target/cuda-wheels
if [ ! -f "$wheels/nvidia/cu13/lib/libnvrtc.so.13" ]; then
  python3 -m pip install -q --disable-pip-version-check --target "$wheels" \
    'nvidia-cuda-nvrtc==13.0.*' 'nvidia-cuda-runtime==13.0.*' 'nvidia-nvjitlink==13.0.*'
fi
out=target/cubins
mkdir -p "$out"
BGS_CUDA_LIB_DIR="$PWD/$wheels/nvidia/cu13/lib" BGS_DUMP_CUBINS="$PWD/$out" \
  cargo test -q -p bgs-model-gpu --test kernels kernels_compile_with_nvrtc >/dev/null
for c in "${@:-bf16-64}"; do
  echo "== $c"
  "$tools/nvidia/cu13/bin/cuobjdump" --dump-resource-usage "$out/$c.cubin" \
    | awk '/Function/ { name = $2 } /REG:/ { print name, $1, $2, $3 }' | sed 's/:$//' | sort
done
