#!/usr/bin/env bash
# Builds shardkit's CUDA extension on this machine for the GPU machine's Python (3.12 by
# default) and torch, and saves it as wheels/shardkit_C_<hash>_<pytag>.tar.gz, the file
# benchmarks/gpu_suite.sh unpacks instead of building there (it rebuilds if the file does not
# load). Needs that Python here (python3.12 on the PATH, or PY=/path/to/python3.12), the CUDA
# toolkit (nvcc) and the network for pip; the build takes a few minutes on 2 cores. It installs
# nvidia-cutlass (headers only) into that environment, so the build has the fused sm90 kernels;
# the GPU machine has no network, and a build made there without it leaves them out.
#
#   bash benchmarks/prebuild_gpu_ext.sh                  # torch 2.11.0, Python 3.12, arch 9.0
#   TORCH=2.11.0 PY=~/.pyenv/versions/3.12.1/bin/python bash benchmarks/prebuild_gpu_ext.sh
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PY:-$(command -v python3.12 || true)}
TORCH=${TORCH:-2.11.0}
VENV=${VENV:-/tmp/shardkit_prebuild_venv}
if [ -z "$PY" ] || ! "$PY" -c 'import sys' 2> /dev/null; then
  echo "prebuild_gpu_ext.sh: no Python for the GPU machine found; set PY=/path/to/python3.12" >&2
  exit 2
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q "torch==$TORCH" numpy setuptools wheel ninja
# CUTLASS's headers for the fused sm90 kernels (setup.py finds the package; CUTLASS_PATH wins).
"$VENV/bin/pip" install -q --no-deps nvidia-cutlass==4.2.0.0
# Build in a copy of the tracked sources, so the checkout's own build is left alone.
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
git -C "$ROOT" ls-files -z | (cd "$ROOT" && xargs -0 cp --parents -t "$WORK")
(cd "$WORK" && FORCE_CUDA=1 MAX_JOBS=${MAX_JOBS:-2} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} \
  "$VENV/bin/python" setup.py build_ext --inplace > "$WORK/build.log" 2>&1) || {
  tail -30 "$WORK/build.log"
  exit 1
}
# The same tag gpu_suite.sh computes: a hash over setup.py and csrc/, and the Python tag.
hash=$( (cd "$ROOT" && cat setup.py && find csrc -type f | LC_ALL=C sort | xargs cat) | sha256sum | cut -c1-12)
tag=$("$VENV/bin/python" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
mkdir -p "$ROOT/wheels"
out="$ROOT/wheels/shardkit_C_${hash}_${tag}.tar.gz"
(cd "$WORK/python/shardkit" && tar czf "$out" _C*.so _build_info.py)
ls -la "$out"
