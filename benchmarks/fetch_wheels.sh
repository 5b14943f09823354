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
