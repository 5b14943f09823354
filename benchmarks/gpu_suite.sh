#!/usr/bin/env bash
# One stage of shardkit's GPU session on the lent device machine (one H100 or H200, no
# network). Each stage is one `device run` call, built to end inside that call's 10-minute
# limit: it runs its steps in order, starts a step only if the stage budget still has room
# for it, bounds every step with `timeout` (a hang loses that step, not the stage's other
# outputs), and after EVERY step re-packs its logs, JSON and PNG files into
# $OUT/<stage>.tar.gz and rewrites $OUT/<stage>_summary.txt, so a call cut short still
# returns what finished (the device returns at most 8 files from $OUT: hence the tarball).
#
#   bash benchmarks/gpu_session.sh test      # info, wheels, build, GPU tests, the rest of the suite
#   bash benchmarks/gpu_session.sh bench-a   # info, wheels, build, ema/normalize/parallel/distributed/
#                                            #   ce-kernels benchmarks
#   bash benchmarks/gpu_session.sh bench-b   # info, wheels, build, the sharded-loss benchmark, largest C
#   bash benchmarks/gpu_session.sh STAGE BUDGET_S   # another budget (default 540 s)
#
# Build: `FORCE_CUDA=1 MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0 python3 setup.py build_ext --inplace`
# (shardkit then imports from python/ through PYTHONPATH). A stage that built the extension
# also writes $OUT/shardkit_C_<hash>_cp312.tar.gz; copied into wheels/ here and carried, a
# later stage on a fresh machine unpacks it instead of rebuilding (only if <hash>, over
# setup.py and csrc/, and the Python tag still match). On a machine still warm from the last call the build is reused.
# Peer wheels: wheels/*.whl (benchmarks/fetch_wheels.sh gets them), installed with
# `pip install --no-index --no-deps --target /tmp/site`.
# Outside the device (no $OUT) the files go to benchmarks/out/gpu_session/.
set -u
STAGE=${1:?usage: gpu_session.sh test|bench-a|bench-b [budget_s]}
BUDGET=${2:-540}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
DEST=${OUT:-$ROOT/benchmarks/out/gpu_session}
WORK=/tmp/shardkit_gpu_session/$STAGE
rm -rf "$WORK" && mkdir -p "$WORK/out" "$DEST"
SUMMARY=$WORK/summary.txt
export PY=${PYTHON:-python3} WORK
export PYTHONUNBUFFERED=1
export SHARDKIT_BENCH_OUT=$WORK/out
export PYTHONPATH=$ROOT/python${PYTHONPATH:+:$PYTHONPATH}
export MPLBACKEND=Agg
printf '%-20s %5s %5s %5s  %s\n' step rc secs cap note > "$SUMMARY"

note() { printf '%-20s %5s %5s %5s  %s\n' "$@" >> "$SUMMARY"; }

pack() {  # everything so far into $DEST (a call cut short still returns it)
  cp "$SUMMARY" "$DEST/${STAGE}_summary.txt"
  tar czf "$DEST/$STAGE.tar.gz.tmp" -C "$WORK" . && mv "$DEST/$STAGE.tar.gz.tmp" "$DEST/$STAGE.tar.gz"
}

# step NAME CAP_S COMMAND: runs COMMAND (a bash string) under `timeout` for at most CAP_S
# seconds (fewer if the stage budget is short; skipped when under min(CAP_S, 45) s remain),
# output to $WORK/NAME.log, whose tail is printed.
step() {
  local name=$1 cap=$2; shift 2
  local left=$(( BUDGET - SECONDS - 15 )) min=$(( cap < 45 ? cap : 45 ))
  if (( left < min )); then
    note "$name" - 0 "$cap" "SKIPPED: ${left}s left in this stage"
    echo "=== $name SKIPPED (${left}s left)"; pack; return 3
  fi
  (( cap > left )) && cap=$left
  echo "=== $name (cap ${cap}s, t=${SECONDS}s)"
  local t0=$SECONDS rc msg=""
  timeout --kill-after=15 "$cap" bash -c "$*" > "$WORK/$name.log" 2>&1
  rc=$?
  (( rc == 124 || rc == 137 )) && msg="TIMED OUT at ${cap}s"
  note "$name" "$rc" "$(( SECONDS - t0 ))" "$cap" "$msg"
  tail -n "${TAIL_LINES:-25}" "$WORK/$name.log"
  pack
  return $rc
}

# The carried build's name: a hash over setup.py and csrc/, and the Python tag (an extension
# built for another Python, e.g. on the 3.11 development machine, does not load on 3.12).
build_tag() {
  local h py
  h=$( (cat setup.py; find csrc -type f | LC_ALL=C sort | xargs cat) | sha256sum | cut -c1-12)
  py=$($PY -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  echo "${h}_$py"
}

finish() {
  echo; echo "=== $STAGE summary (${SECONDS}s of ${BUDGET}s)"; cat "$SUMMARY"
  echo; echo "=== TARGET lines"; cat "$WORK"/*.log 2>/dev/null | grep -h "^TARGET" || echo "(none)"
  pack; ls -la "$DEST"
}

# ---- steps every stage runs ---------------------------------------------------------------
info() {
  cat > "$WORK/info.py" <<'PYEOF'
import os, sysconfig, torch, triton
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)
print("device", torch.cuda.get_device_name(), torch.cuda.get_device_properties(0))
inc = sysconfig.get_paths()["include"]
print("Python.h present:", os.path.exists(os.path.join(inc, "Python.h")), inc)
from torch.utils.cpp_extension import CUDA_HOME
print("CUDA_HOME", CUDA_HOME)
PYEOF
  step info 60 'date -u; uname -r; nproc; free -g | head -2; df -h /tmp | tail -1
    nvidia-smi
    nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,power.limit --format=csv
    which $PY; $PY -V; which nvcc && nvcc --version | tail -2
    $PY $WORK/info.py
    $PY -m pip list 2>/dev/null | grep -iE "^(torch|triton|timm|torchvision|pytest|pytest-xdist|pytest-timeout|ninja|setuptools|liger|cut)"'
}

wheels() {
  if ! ls wheels/*.whl > /dev/null 2>&1; then
    note wheels - 0 0 "no wheels/*.whl carried: the peers are reported as not installed"
    return 0
  fi
  cat > "$WORK/peers.py" <<'PYEOF'
from cut_cross_entropy import linear_cross_entropy  # noqa: F401
from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss  # noqa: F401
print("peers import OK")
PYEOF
  step wheels 90 '$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site wheels/*.whl && ls /tmp/site && PYTHONPATH=/tmp/site $PY $WORK/peers.py'
  export PYTHONPATH=/tmp/site:$PYTHONPATH
}

build() {
  local h stamp pre
  h=$(build_tag); stamp=/tmp/shardkit_gpu_session/built_$h; pre=wheels/shardkit_C_$h.tar.gz
  if ls python/shardkit/_C*.so > /dev/null 2>&1 && [ -f "$stamp" ]; then
    note build 0 0 0 "reused this machine's build ($h)"
  elif [ -f "$pre" ]; then
    step build-unpack 60 "tar xzf $pre -C python/shardkit && ls -la python/shardkit/_C*.so" && touch "$stamp"
  else
    ls wheels/shardkit_C_*.tar.gz > /dev/null 2>&1 && echo "the carried build is not of these sources ($h): rebuilding"
    step build 420 'export FORCE_CUDA=1 MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
      [ -n "${CUDA_HOME:-}" ] || export CUDA_HOME=$(dirname "$(dirname "$(which nvcc)")")
      $PY setup.py build_ext --inplace' \
      && touch "$stamp" && (cd python/shardkit && tar czf "$DEST/shardkit_C_$h.tar.gz" _C*.so) \
      && ls -la "$DEST/shardkit_C_$h.tar.gz"
  fi
  cat > "$WORK/import_check.py" <<'PYEOF'
import torch
import shardkit
print("shardkit", shardkit.__file__, "cuda_built", shardkit.cuda_built())
assert shardkit.cuda_built(), "the build has no CUDA kernels"
x = torch.randn(3, 5, device="cuda")
e = [torch.zeros_like(x)]
shardkit.ops.ema_update_(e, [x], 0.5)  # e = 0.5 * 0 + 0.5 * x
torch.cuda.synchronize()
print("ema_update_ on cuda, max error:", float((e[0] - 0.5 * x).abs().max()))
PYEOF
  if ! step import-check 60 '$PY $WORK/import_check.py' && [ "$STAGE" != test ]; then
    # (the test stage goes on: its tests say more about what fails)
    echo "shardkit's CUDA build does not import or run: the stage stops here (see build.log, import-check.log)"
    finish; exit 1
  fi
}

# ---- stages -------------------------------------------------------------------------------
# Estimated times on one H100 (nothing has run there yet: from bytes and FLOPs at ~3.0 TB/s
# and ~700 TFLOP/s bf16, plus process start-up and Triton compilation), caps in brackets:
#   info + wheels + import check  ~30 s; build ~1.5-3 min [420 s] (the .cu files took 3.5-5 min
#     each on the 2-core dev machine; here they compile in parallel) or ~5 s unpacked/reused
#   tests-gpu  ~1-3 min [300] (the largest case: a 2049 x 1M-class chunk, 12 GB)
#   tests-rest ~2-4 min with xdist [400, or what is left]
#   bench-ema ~45-90 s [180]: 2 models x 2 dtypes x 50 rounds of 5 timings of 1-10 ms, model set-up
#   bench-normalize ~20 s per dtype [90]; bench-parallel ~30 s [120]: 318 MB logits, 5 cases x 53
#   bench-distributed ~45-90 s [150]: NCCL start, two 1M-class heads initialized on the CPU, 100 steps
#   bench-ce-kernels ~30-60 s [120]: B=1024 C=1M, 5 variants x 12 fwd + 12 fwd+bwd (~5-20 ms each)
#   bench-sharded-loss ~2-4 min [330]: 4 shapes x 5 methods, each <= 12 s of timed steps, plus
#     Triton compiles of the peers (~20-60 s the first time) and liger's ~1 s steps at C=1M
#   bench-maxc ~2.5-4 min [240]: shardkit <= 80 s, 3 other methods <= 40 s each (probes ~1-3 s)
PYTEST_OPTS="-rfEs -p no:cacheprovider"
$PY -c "import pytest_timeout" 2>/dev/null && PYTEST_OPTS="$PYTEST_OPTS --timeout=240"
B="$PY benchmarks"
case "$STAGE" in
  test)
    info; wheels; build
    # Every GPU test, no -x (all failures at once), junit XML next to the log.
    step tests-gpu 300 "$PY -m pytest -m gpu tests $PYTEST_OPTS -v --junitxml=$WORK/out/junit_gpu.xml"
    # The rest of the suite, now on a machine where CUDA is visible (xdist if there).
    XDIST=""; $PY -c "import xdist" 2>/dev/null && XDIST="-n 8"
    step tests-rest 400 "$PY -m pytest -m 'not gpu' tests $PYTEST_OPTS -q $XDIST --junitxml=$WORK/out/junit_rest.xml"
    ;;
  bench-a)
    info; wheels; build
    step bench-ema 180 "$B/bench_ema.py --device cuda"
    step bench-normalize 90 "$B/bench_normalize.py --device cuda && $B/bench_normalize.py --device cuda --dtype bfloat16"
    step bench-parallel 120 "$B/bench_parallel.py --device cuda"
    step bench-distributed 150 "$B/bench_distributed.py --device cuda --timeout 130"
    step bench-ce-kernels 120 "$B/bench_sharded_ce_kernels.py --device cuda --batch 1024 --dim 512 \
      --classes 1000000 --dtype bfloat16 --reps 10 --chunks 4096,16384,65536,262144"
    ;;
  bench-b)
    info; wheels; build
    step bench-sharded-loss 330 "$B/bench_sharded_loss.py --device cuda --method-budget 12"
    step bench-maxc 240 "$B/bench_sharded_loss.py --device cuda --max-classes-only --search-budget 40"
    ;;
  *) echo "unknown stage $STAGE (test, bench-a, bench-b)"; exit 2 ;;
esac
finish
