#!/usr/bin/env bash
# Build metal_attn._cuda_ops (the CUDA chains, docs/cuda-ops.md) for the lent H200 machine, on a CPU
# machine without a GPU. Run from the checkout root after ../shared/device/make-bundle.sh:
#
#   bash benchmarks/device/build_cuda_ops.sh            # -> metal_attn/_cuda_ops.cpython-312-x86_64-linux-gnu.so
#
# The GPU machine runs CPython 3.12 and the bundle's MLX CUDA wheel (.device/mlx-cuda.tar.xz), so the
# module is built for exactly those: a CPython 3.12 found with pyenv or on PATH (or PY312=...), nanobind
# 3.x in a throwaway virtual environment, the wheel's headers and libmlx.so, and the CUDA toolkit's
# headers (CUDA_INCLUDE_DIR, default /usr/local/cuda/include; nothing is linked against CUDA). The .so is
# git-ignored: pass it to the device tool with `carry`, next to `.device`. The last line printed is its path.
set -euo pipefail
top=$(git rev-parse --show-toplevel)
cd "$top"
bundle=.device/mlx-cuda.tar.xz
[ -f "$bundle" ] || { echo "no $bundle: run 'bash ../shared/device/make-bundle.sh' first" >&2; exit 1; }

is312() { "$1" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' >/dev/null 2>&1; }
py=${PY312:-}
if [ -n "$py" ]; then
  is312 "$py" || { echo "PY312=$py is not a working CPython 3.12" >&2; exit 1; }
else
  # pyenv's shims may exist without selecting 3.12: try its install folders first, then PATH.
  for c in "$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"/versions/3.12*/bin/python3.12 python3.12; do
    if is312 "$c"; then py=$c; break; fi
  done
  [ -n "$py" ] || { echo "no CPython 3.12 found (the GPU machine's Python): set PY312=/path/to/python3.12" >&2; exit 1; }
fi

work=build/cuda-ops-device
mkdir -p "$work"
# The wheel's MLX, unpacked once per bundle (its checksum names the folder).
sum=$(sha256sum "$bundle" | cut -c1-16)
site="$work/mlx-site-$sum"
if [ ! -f "$site/.ready" ]; then
  rm -rf "$work"/mlx-site-*
  mkdir -p "$site"
  tar -xJf "$bundle" -C "$site"
  touch "$site/.ready"
fi
venv="$work/venv312"
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
"$venv/bin/python" -m pip install -q 'nanobind>=3,<4'

cmake -S csrc/cuda -B "$work/cmake" -DPython_EXECUTABLE="$top/$venv/bin/python" -DMLX_DIR="$top/$site/mlx" \
  ${CUDA_INCLUDE_DIR:+-DCUDA_INCLUDE_DIR="$CUDA_INCLUDE_DIR"} -DMETAL_ATTN_PACKAGE_DIR="$top/metal_attn" >/dev/null
cmake --build "$work/cmake" -j "$(nproc)" >/dev/null
so=$(ls metal_attn/_cuda_ops.cpython-312-*.so)
echo "built $so (carry it with .device)"
echo "$so"
