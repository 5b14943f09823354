#!/usr/bin/env bash
# Fetches the peer libraries the GPU benchmarks compare against, as wheels (Python 3.12,
# x86-64 Linux), into wheels/ (git-ignored), where benchmarks/gpu_suite.sh installs them
# offline: the GPU machine itself needs no network.
#
#   bash benchmarks/fetch_wheels.sh            # run from anywhere; prints names and sizes
#   PYVER=3.11 bash benchmarks/fetch_wheels.sh # for another Python on the GPU machine
#
# The peers (Cut Cross-Entropy and Liger for the sharded loss, ema-pytorch and torch-ema for
# the EMA) are pure-Python wheels whose only run-time needs are torch and triton (plus
# packaging and tqdm, imported by liger-kernel); the script lists every wheel's
# Requires-Dist (extras left out) so a new version that needs more shows up here, not on
# the GPU machine.
#
# QuACK (quack-kernels, a peer of the sharded loss) is not among them: it cannot come this way.
# quack-kernels 0.6.5 (0.7 MB, pure Python) needs nvidia-cutlass-dsl >= 4.7, whose 4.8.1 pulls
# nvidia-cutlass-dsl-libs-cu13 (or -cu12 without the cu13 extra): one 92 MB wheel (a 193 MB MLIR
# shared library and a 44 MB runtime), alone over this folder's 60 MiB cap (and over the 64 MiB
# a device call carries). With libs-base 3.0 MB, libs-core 1.6 MB, apache-tvm-ffi 3.3 MB,
# torch-c-dlpack-ext 0.9 MB, einops and protobuf, the set is ~101 MB, mostly cp312
# manylinux_2_28 binaries; cuda-bindings (8.4 MB) comes with torch 2.11's CUDA 13 wheels.
# (Measured 2026-11-27 with pip download --no-deps for Python 3.12, x86-64.)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DIR=$ROOT/wheels
PYVER=${PYVER:-3.12}
# Pinned: the versions benchmarked (bump deliberately, then re-run this script).
PKGS=(cut-cross-entropy==25.1.1 liger-kernel==0.8.5 ema-pytorch==0.8.3 torch-ema==0.3)
mkdir -p "$DIR"
rm -f "$DIR"/*.whl  # one version of each: two stop the offline install
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d "$DIR" "${PKGS[@]}"
echo "wheels in $DIR:"
total=0
for w in "$DIR"/*.whl; do
  size=$(stat -c %s "$w"); total=$((total + size))
  printf '  %-50s %9d bytes\n' "$(basename "$w")" "$size"
  unzip -p "$w" '*.dist-info/METADATA' | grep '^Requires-Dist' | grep -v 'extra ==' | sed 's/^/      /' || true
done
# A saved build (shardkit_C_*.tar.gz, from gpu_suite.sh) may live there too.
all=$(du -sb "$DIR" | cut -f1)
printf 'total %d bytes of wheels, %d bytes in wheels/\n' \
  "$total" "$all"
if (( all > 60 * 1024 * 1024 )); then
  echo "wheels/ is over 60 MiB: more than the two peers and one build; remove stale files" >&2
  exit 1
fi
if ! git -C "$ROOT" check-ignore -q "$DIR/x.whl"; then
  echo "wheels/ is not git-ignored: add it to .gitignore" >&2
  exit 1
fi
