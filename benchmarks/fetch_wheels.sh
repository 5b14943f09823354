#!/usr/bin/env bash
# Fetches the peer libraries the GPU benchmarks compare against, as wheels for the device
# machine (Python 3.12, x86-64 Linux, no network there), into wheels/ (git-ignored), to be
# named in the device call's `carry` and installed there offline by gpu_session.sh.
#
#   bash benchmarks/fetch_wheels.sh            # run from anywhere; prints names and sizes
#
# Both peers are pure-Python wheels whose only run-time needs are torch and triton (plus
# packaging and tqdm, imported by liger-kernel), all preinstalled on the device image; the
# script lists every wheel's Requires-Dist (extras left out) so a new version that needs
# more shows up here, not on the device.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DIR=$ROOT/wheels
PYVER=${PYVER:-3.12}
# Pinned: the versions benchmarked (bump deliberately, then re-run this script).
PKGS=(cut-cross-entropy==25.1.1 liger-kernel==0.8.5)
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
# Everything else carried lives there too (a shardkit_C_*.tar.gz build, if copied in).
all=$(du -sb "$DIR" | cut -f1)
printf 'total %d bytes of wheels, %d bytes in wheels/ (carry limit: 64 MiB with everything else carried)\n' \
  "$total" "$all"
if (( all > 60 * 1024 * 1024 )); then
  echo "wheels/ is over 60 MiB: too large to carry" >&2
  exit 1
fi
if ! git -C "$ROOT" check-ignore -q "$DIR/x.whl"; then
  echo "wheels/ is not git-ignored: add it to .gitignore" >&2
  exit 1
fi
