#!/usr/bin/env bash
# shardkit's GPU suite: builds the CUDA extension, runs the GPU tests and the compute-sanitizer
# checks, and produces every GPU figure of benchmarks/RESULTS.md, on any machine with one
# CUDA GPU (written for an H100/H200: TORCH_CUDA_ARCH_LIST defaults to 9.0), python3 with
# torch, triton, pytest and matplotlib, and CUDA's nvcc and compute-sanitizer. No network
# is needed: the peer libraries come from wheels/ (benchmarks/fetch_wheels.sh fetches them).
#
# THE NEXT GPU SESSION runs this one command (one call, under ten minutes):
#
#   bash benchmarks/gpu_suite.sh next 420
#
# and, with what its 15 minutes of device time leave (a machine's start and the transfers took
# ~2.5 minutes on 2026-11-27), at once after it, while the machine is still warm (30 s):
#
#   bash benchmarks/gpu_suite.sh recipe 240     # carry wheels/ and benchmarks/out/arcface_torch
#
# It builds, runs a tiny forward+backward of every fused variant (a hang or fault stops it), then
# the sharded-loss GPU tests FIRST, before any timing (each statistic's gradient and the module's
# loss against float64 on every kernel set, the fused GEMMs named in the trace, the side stream
# captured in a CUDA graph, a first call made under graph capture, the float64 references of the
# mixed-precision and NCCL autocast tests, huge row norms in fp32 and bf16 -- whose CUDA fp32 dW
# fix of 2026-11-27 has not run on a GPU yet --, the host-side layout check), then every other
# GPU test, the sanitizers over the fused variants, and only then the op-level timings of
# programmatic dependent launch and of the backward's second stream, each alone (measured only
# together so far: 7-47% slower), against the three cuBLAS GEMMs timed alternately with each.
# Its follow-up, `next-b`, times the module against its peers under each variant. Failing tests stop the stage before the timings. Build
# the extension beforehand on a CPU machine (`bash benchmarks/prebuild_gpu_ext.sh`, then carry
# wheels/ along): a fresh build on the GPU machine takes ~3 of the ten minutes, and the timings
# that no longer fit are reported SKIPPED.
#
# In the order the GPU work is wanted: `next` (every GPU test, the sharded loss's first; then the
# fused variants' timings), `next-b`, `recipe` and `recipe-b` (the whole recipe on one GPU), then
# `budget` below.
#
# The memory budget's CUDA kept path (SHARDKIT_CUDA_KEEP=1, experimental: never run on a GPU yet)
# has a stage of its own, one call, under ten minutes with the build prebuilt:
#
#   bash benchmarks/gpu_suite.sh budget
#
# It runs the kept path's GPU tests first (tests/test_softmax_budget_cuda.py: against float64 and
# budget 0 at budgets keeping none / some / all chunks, bf16 / fp16 / fp32, margins, smoothing,
# ignore_index, sampling, compile, the bytes held), then memcheck over a small kept-path run, and
# only if both pass times the module with SHARDKIT_CUDA_KEEP=1 at budgets 0, 50% and the full
# logits against Liger, QuACK and Cut Cross-Entropy (exact) where installed, at B=1024 C=1M D=512
# and the large-vocabulary shapes (--llm-shapes), each interleaved with the three cuBLAS GEMMs.
#
#   bash benchmarks/gpu_suite.sh quick     # the most informative 10 minutes (tests, memcheck, CE)
#   bash benchmarks/gpu_suite.sh quick-b   # its follow-up: EMA and normalize bandwidth, CE profiles
#   bash benchmarks/gpu_suite.sh rest      # the CPU tests (-m 'not gpu') on the CUDA machine
#   bash benchmarks/gpu_suite.sh test      # GPU tests, compute-sanitizer, then the rest of the tests
#   bash benchmarks/gpu_suite.sh bench-a   # ce-kernels, ema, normalize, parallel, distributed, pipeline
#   bash benchmarks/gpu_suite.sh bench-b   # the sharded-loss benchmark, then the largest C per method
#   bash benchmarks/gpu_suite.sh fused     # the fused sm90 kernels: tests, timings, sanitizers, peers, profiles
#   bash benchmarks/gpu_suite.sh fused-b   # their follow-up: Nsight Compute, the sharded loss against its peers
#   bash benchmarks/gpu_suite.sh next      # the next session's command (above); next-b its follow-up
#   bash benchmarks/gpu_suite.sh budget    # the memory budget's CUDA kept path (above)
#   bash benchmarks/gpu_suite.sh recipe    # the whole recipe: arcface_torch as it is and with shardkit
#                                          # at 1M classes, the trainer's default run; recipe-b: 10M
#                                          # classes, the trainer's iresnet50 runs with --profile
#                                          # (carry the arcface_torch checkout: benchmarks/out/arcface_torch)
#   bash benchmarks/gpu_suite.sh STAGE BUDGET_S   # another time budget (default 540 s)
#   SKIP_STEPS="bench-maxc profile-fused" bash benchmarks/gpu_suite.sh fused   # leave steps out
#
# Each stage first prints versions and nvidia-smi, installs the wheels and builds (or reuses)
# the extension, then runs its steps in order, most useful first. Each stage ends within its
# budget (540 s by default, so inside ten minutes): a step starts only while the budget has
# room for it, every step is bounded by `timeout` (a hang loses that step, not the others;
# the step's own cap is in $STEP_CAP for the command to size its work), and after EVERY step
# the logs, JSON and PNG files so far are re-packed into $OUT/<stage>.tar.gz and the step
# table into $OUT/<stage>_summary.txt, so a run stopped early keeps what finished. The
# output ends with that table and every `TARGET PASS|FAIL|n/a` line. OUT defaults to
# benchmarks/out/gpu_suite/.
#
# Build: `FORCE_CUDA=1 MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0 python3 setup.py build_ext --inplace`
# (shardkit then imports from python/ through PYTHONPATH). A stage that builds also writes
# $OUT/shardkit_C_<hash>_<pytag>.tar.gz; put that file into wheels/ and a later stage on
# another machine unpacks it instead of rebuilding, if <hash> (over setup.py and csrc/) and
# the Python tag still match. A machine that built it already reuses its build.
# Peer wheels: wheels/*.whl, installed with `pip install --no-index --no-deps --target /tmp/site`.
#
# Measured on one H200 with 16 cores, the build unpacked (2026-11-26): quick 115 s, test 191 s
# (tests-gpu 42 s, memcheck 8 s, racecheck 15 s, tests-rest 100 s), bench-a 88 s, bench-b
# 305 s (bench-maxc 224 s of it); on one H100, the build unpacked: fused 411 s (bench-maxc
# 226 s of it, tests-fused 18 s, sanitize-fused 23 s). The estimates below (made before any run, from bytes and
# FLOPs at ~3.0 TB/s and ~700 TFLOP/s bf16, plus start-up and Triton compilation; caps in
# brackets) were generous: keep them as the caps. Common to every stage: info + wheels + import check ~30 s; the build ~2-3 min
# [300] on a fresh machine (9 sources compile in parallel: 3 .cu files of 150-430 lines,
# each ~1-2 min of nvcc for one architecture with torch's headers, 6 .cpp files ~20-40 s
# each, then the link; ~5 s when unpacked from wheels/ or reused).
#   test     ~6.5-8.5 min fresh, ~4-6 min with the build unpacked:
#     tests-gpu ~1-3 min [240] (largest case: a 2049 x 1M-class chunk, 12 GB);
#     sanitize-memcheck ~1 min [120], sanitize-racecheck ~1-2 min [150] (tiny sizes, but
#       torch's start-up and every kernel run under the tool);
#     tests-rest ~2-4 min with xdist [what is left] (the CPU suite with CUDA visible: last,
#       as CI runs it too; reported SKIPPED when the budget is spent).
#   bench-a  ~6-7 min with the build unpacked (~8.5 fresh: then the last step may be skipped):
#     bench-ce-kernels ~40-70 s [120]: B=1024 C=1M, the default chunk + 4 sizes, 12 fwd + 12
#       fwd+bwd each (~5-20 ms);
#     bench-ema ~45-90 s [150]: 2 models x 2 dtypes x 50 rounds of 5 timings of 1-10 ms;
#     bench-normalize ~20 s per dtype [90]; bench-parallel ~30 s [90]: 318 MB logits, 5 cases;
#     bench-distributed ~45-90 s [150]: NCCL start, two 1M-class heads, 100 steps;
#     bench-pipeline ~30-60 s [120]: ResNet-50 layout, B=128 224x224, unsplit + 4 splits on
#       two streams of one GPU (cuda:0,cuda:0), 7 steps each.
#   bench-b  ~7-8.5 min with the build unpacked:
#     bench-sharded-loss ~2.5-4.5 min [300]: 4 shapes x 6 methods, each <= 10 s of timed
#       steps, plus the Triton compiles of the peers (~20-60 s the first time, cut-cross-
#       entropy twice: its filtered and exact backward are two kernels);
#     bench-maxc ~3-4 min [240, or what is left]: the searches share $STEP_CAP - 30 s (shardkit
#       2 shares, the 4 others 1 each); a search cut short reports its lower bound;
#     bench-maxc-master: the same searches with fp32 master weights and momentum (not yet run;
#       it starts only if the budget has room: SKIP_STEPS="bench-maxc" gives it bench-maxc's).
#   budget   ~7-9 min with the build unpacked (estimated, not yet run):
#     tests-budget ~1.5-3 min [200] (~130 small cases; torch.compile traces the module 3 times);
#     sanitize-budget ~0.5-1 min [90] (8 tiny forward+backward runs under memcheck);
#     bench-budget ~4-5.5 min [330, or what is left]: 5 shapes x 6 methods, 2 s of timed steps
#       each beside the interleaved GEMMs, plus the peers' first compiles (Triton for Liger and
#       Cut Cross-Entropy, QuACK's CuTe-DSL JIT per shape); at 8192 x 256000 the full logits
#       take 4 GiB in bf16.
set -u
STAGE=${1:?usage: gpu_suite.sh next|next-b|budget|quick|quick-b|rest|test|bench-a|bench-b|fused|fused-b [budget_s]}
BUDGET=${2:-540}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
DEST=${OUT:-$ROOT/benchmarks/out/gpu_suite}
WORK=/tmp/shardkit_gpu_suite/$STAGE
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
# output to $WORK/NAME.log, whose tail is printed. COMMAND sees the cap it got as $STEP_CAP.
step() {
  local name=$1 cap=$2; shift 2
  local left=$(( BUDGET - SECONDS - 15 )) min=$(( cap < 45 ? cap : 45 ))
  if [[ " ${SKIP_STEPS:-} " == *" $name "* ]]; then
    note "$name" - 0 "$cap" "SKIPPED: in SKIP_STEPS"
    echo "=== $name SKIPPED (SKIP_STEPS)"; return 3
  fi
  if (( left < min )); then
    note "$name" - 0 "$cap" "SKIPPED: ${left}s left in this stage"
    echo "=== $name SKIPPED (${left}s left)"; pack; return 3
  fi
  (( cap > left )) && cap=$left
  echo "=== $name (cap ${cap}s, t=${SECONDS}s)"
  local t0=$SECONDS rc msg=""
  STEP_CAP=$cap timeout --kill-after=15 "$cap" bash -c "$*" > "$WORK/$name.log" 2>&1
  rc=$?
  (( rc == 124 || rc == 137 )) && msg="TIMED OUT at ${cap}s"
  note "$name" "$rc" "$(( SECONDS - t0 ))" "$cap" "$msg"
  tail -n "${TAIL_LINES:-25}" "$WORK/$name.log"
  pack
  return $rc
}

# The saved build's name: a hash over setup.py and csrc/, and the Python tag (an extension
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
    note wheels - 0 0 "no wheels/*.whl: the peers are reported as not installed"
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
  h=$(build_tag); stamp=/tmp/shardkit_gpu_suite/built_$h; pre=wheels/shardkit_C_$h.tar.gz
  if ls python/shardkit/_C*.so > /dev/null 2>&1 && [ -f "$stamp" ]; then
    note build 0 0 0 "reused this machine's build ($h)"
  elif [ -f "$pre" ]; then
    step build-unpack 60 "tar xzf $pre -C python/shardkit && ls -la python/shardkit/_C*.so" && touch "$stamp"
  fi
  # A saved build made on another machine may not load here (other system libraries): then
  # it is removed and the sources are built here.
  if [ -f "$stamp" ] && ! $PY -c "import sys; sys.path.insert(0, 'python'); import shardkit._C" > "$WORK/unpack_check.log" 2>&1; then
    cat "$WORK/unpack_check.log"; echo "the saved build does not load here: rebuilding"
    rm -f python/shardkit/_C*.so "$stamp"
  fi
  if [ -f "$stamp" ]; then
    :
  else
    ls wheels/shardkit_C_*.tar.gz > /dev/null 2>&1 && echo "the saved build in wheels/ is not of these sources ($h): rebuilding"
    step build 300 'export FORCE_CUDA=1 MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
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

# ---- stages (estimated times: see the header) ---------------------------------------------
PYTEST_OPTS="-rfEs -p no:cacheprovider"
$PY -c "import pytest_timeout" 2>/dev/null && PYTEST_OPTS="$PYTEST_OPTS --timeout=240"
B="$PY benchmarks"
SANITIZER=$(command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")
# Every tensor its own cudaMalloc, so memcheck sees an access past a tensor's end (torch's
# caching allocator would hide it inside a pooled block).
SAN="PYTORCH_NO_CUDA_MEMORY_CACHING=1 $SANITIZER --error-exitcode 2 --print-limit 50"
# racecheck over the smoke run. Hazards inside cuBLAS's own kernels (nvjet_*) are listed but do
# not fail the step: on an H100 (CUDA 13.0, compute-sanitizer 2025.3.1) racecheck reports one in
# nvjet_sm90_tss_64x8_64x16_1x4_h_badd_NNT, the dX GEMM of the smoke run's 256 x 1096 x 64 case,
# whose results are right; excluding those kernels (--kernel-name-exclude kns=nvjet) made the
# tool itself fail ("failed to handle a hardware exception"). A hazard in any other kernel, a
# wrong result or a run that does not finish fails it.
racecheck_smoke() {
  local log rc races ours done_ok
  log=$(mktemp)
  eval "$SAN --tool racecheck $PY benchmarks/sanitize_smoke.py" > "$log" 2>&1
  rc=$?
  cat "$log"
  races=$(grep -c "Race reported" "$log")
  ours=$(grep "Race reported" "$log" | grep -vc "nvjet_")
  done_ok=0
  grep -q "sanitize_smoke: all results match" "$log" && grep -q "RACECHECK SUMMARY" "$log" && done_ok=1
  rm -f "$log"
  if (( done_ok == 0 )); then
    echo "racecheck: the smoke run did not finish with right results (exit code $rc)"; return 1
  fi
  if (( ours > 0 )); then echo "racecheck: $ours hazard(s) outside cuBLAS's kernels"; return 1; fi
  # (--print-limit 50: past 50 reports a hazard of ours could go unprinted)
  if (( races >= 50 )); then echo "racecheck: $races reports reach the print limit"; return 1; fi
  if (( rc != 0 && races == 0 )); then echo "racecheck: exit code $rc without a hazard report"; return 1; fi
  (( rc == 0 )) || echo "racecheck: exit code $rc, from $races hazard(s) inside cuBLAS's nvjet kernels only (above)"
  return 0
}
export -f racecheck_smoke
# The fused variants' switches (tests/test_softmax_fused_gpu.py's VARIANTS): programmatic
# dependent launch, the backward's second stream.
FUSED_VARIANTS="default:0:0 pdl:1:0 overlap:0:1"
FUSED_KERNELS=unfused,fused,fused-pdl,fused-overlap
# memcheck and racecheck over the smoke run, on every fused variant.
sanitize_fused_variants() {
  local v f
  for v in $FUSED_VARIANTS; do
    IFS=: read -r name pdl overlap <<< "$v"
    echo "--- $name"
    export SHARDKIT_FUSED=1 SHARDKIT_FUSED_PDL=$pdl SHARDKIT_FUSED_OVERLAP=$overlap
    eval "$SAN --tool memcheck $PY benchmarks/sanitize_smoke.py" && racecheck_smoke || return 1
  done
}
export -f sanitize_fused_variants
export SAN FUSED_VARIANTS
# A tiny forward+backward of every fused variant, then the peak memory of one fwd+bwd at
# B=1024, C=1M, D=512 bf16 under both kernel sets.
fused_smoke_script() {
  cat > "$WORK/fused_smoke.py" <<'PYEOF'
import os
import torch
import shardkit
print("fused kernels in this build:", shardkit.build_info()["fused_kernels"])
for variant in os.environ["FUSED_VARIANTS"].split():
    name, pdl, overlap = variant.split(":")
    os.environ.update(SHARDKIT_FUSED_PDL=pdl, SHARDKIT_FUSED_OVERLAP=overlap)
    x = torch.randn(300, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(5000, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = torch.randint(0, 5000, (300,), device="cuda")
    lse, t, s, _ = shardkit.ops.ce_shard_stats(x, w, y, chunk_classes=1000, scale=30.0, m2=0.5, normalize=True)
    (lse - t).mean().backward()
    torch.cuda.synchronize()
    print(name, "fused forward+backward ran; loss", float((lse - t).mean()), "finite grads",
          bool(torch.isfinite(x.grad).all() and torch.isfinite(w.grad).all()))
os.environ.update(SHARDKIT_FUSED_PDL="0", SHARDKIT_FUSED_OVERLAP="0")
B, C, D = 1024, 1_000_000, 512
x = torch.randn(B, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w = torch.randn(C, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
y = torch.randint(0, C, (B,), device="cuda")
for flag in ("0", "1"):
    os.environ["SHARDKIT_FUSED"] = flag
    x.grad = w.grad = None
    torch.cuda.synchronize(); torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated() + (x.numel() + w.numel()) * 2  # + the two bf16 gradients
    torch.cuda.reset_peak_memory_stats()
    lse, t, s, _ = shardkit.ops.ce_shard_stats(x, w, y)
    fwd = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
    (lse - t).mean().backward()
    torch.cuda.synchronize()
    print(f"SHARDKIT_FUSED={flag}: extra memory {(torch.cuda.max_memory_allocated() - base) / 2**20:.0f} MiB"
          f" (forward's temporaries {fwd / 2**20:.1f} MiB)")
PYEOF
}
case "$STAGE" in
  test)
    info; wheels; build
    # Every GPU test (tests/test_*_gpu.py and the gpu-marked twins elsewhere, the pipeline's
    # among them), no -x (all failures at once), junit XML next to the log.
    step tests-gpu 240 "$PY -m pytest -m gpu tests $PYTEST_OPTS -v --junitxml=$WORK/out/junit_gpu.xml"
    # compute-sanitizer over one small sharded-loss fwd+bwd, EMA update and normalize call.
    step sanitize-memcheck 120 "$SAN --tool memcheck $PY benchmarks/sanitize_smoke.py"
    step sanitize-racecheck 150 "racecheck_smoke"
    # The rest of the suite, now on a machine where CUDA is visible (xdist if there).
    XDIST=""; $PY -c "import xdist" 2>/dev/null && XDIST="-n 8"
    step tests-rest 400 "$PY -m pytest -m 'not gpu' tests $PYTEST_OPTS -q $XDIST --junitxml=$WORK/out/junit_rest.xml"
    ;;
  quick)
    # The most informative ten minutes: GPU tests, memcheck, the kernel breakdown, then the
    # sharded loss against its peers at B=1024 (the bring-up issue's target shapes).
    info; wheels; build
    step tests-gpu 180 "$PY -m pytest -m gpu tests $PYTEST_OPTS --timeout=60 -q --junitxml=$WORK/out/junit_gpu.xml"
    step sanitize-memcheck 90 "$SAN --tool memcheck $PY benchmarks/sanitize_smoke.py"
    # The unfused kernels of the sharded loss (SHARDKIT_FUSED=0): their sanitizer run, then both
    # kernel sets timed side by side (and compared) in one process.
    step sanitize-racecheck 90 "racecheck_smoke && \
      SHARDKIT_FUSED=0 $SAN --tool memcheck $PY benchmarks/sanitize_smoke.py"
    step bench-ce-kernels 120 "$B/bench_sharded_ce_kernels.py --device cuda --batch 1024 --dim 512 \
      --classes 1000000 --dtype bfloat16 --reps 10 --chunks 16384,65536 --kernels fused,unfused && \
      $B/bench_sharded_ce_kernels.py --device cuda --batch 256 --dim 512 --classes 1000000 \
      --dtype bfloat16 --reps 10 --kernels fused,unfused"
    step bench-sharded-loss 400 "$B/bench_sharded_loss.py --device cuda --batch 1024 --method-budget 3"
    ;;
  quick-b)
    # A short follow-up to quick: the EMA and normalize bandwidth figures (the EMA's device
    # table against its first launcher, shardkit_v1, in the same rounds), the per-kernel
    # profile of a 1M-class step under both kernel sets, the EMA's host and device time,
    # Nsight Compute on normalize, the sharded loss at B=256 and two larger chunk sizes.
    info; wheels; build
    step bench-ema 120 "$B/bench_ema.py --device cuda --reps 20"
    step bench-normalize 60 "$B/bench_normalize.py --device cuda && $B/bench_normalize.py --device cuda --dtype bfloat16"
    step profile-ce 90 "$B/profile_sharded_ce.py && SHARDKIT_FUSED=0 $B/profile_sharded_ce.py"
    # Host against device time of an EMA update (ResNet-50: many small tensors).
    step profile-ema 60 "$B/profile_ema.py"
    # Nsight Compute on the normalize kernel at [256, 224, 224, 3] (fp32, then bf16 output).
    cat > "$WORK/ncu_normalize.py" <<'PYEOF'
import torch
import shardkit
x = torch.randint(0, 256, (256, 224, 224, 3), dtype=torch.uint8, device="cuda")
for dt in (torch.float32, torch.bfloat16):
    shardkit.ops.normalize_images(x, [0.5, 0.4, 0.3], [0.25, 0.2, 0.3], dtype=dt)
torch.cuda.synchronize()
PYEOF
    step ncu-normalize 60 "\$(command -v ncu || echo /usr/local/cuda/bin/ncu) -k regex:nhwc_to_nchw -c 2 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
      --section WarpStateStats $PY $WORK/ncu_normalize.py"
    # The sharded loss at B=256 against its peers, and the chunk size the unfused kernels would
    # need to reach the B=1024 figures of a larger budget.
    step bench-sharded-loss-256 150 "$B/bench_sharded_loss.py --device cuda --batch 256 --method-budget 3"
    step bench-ce-chunks 60 "$B/bench_sharded_ce_kernels.py --device cuda --batch 1024 --dim 512 \
      --classes 1000000 --dtype bfloat16 --reps 10 --chunks 26176,32768 --kernels unfused"
    ;;
  rest)
    # The CPU suite on the CUDA machine (as the test stage's last step, without the rest).
    info; build
    XDIST=""; $PY -c "import xdist" 2>/dev/null && XDIST="-n 8"
    step tests-rest 400 "$PY -m pytest -m 'not gpu' tests $PYTEST_OPTS -q $XDIST --junitxml=$WORK/out/junit_rest.xml"
    ;;
  bench-a)
    info; wheels; build
    # The kernel benchmark first: the default chunk size (always timed) and four others.
    step bench-ce-kernels 120 "$B/bench_sharded_ce_kernels.py --device cuda --batch 1024 --dim 512 \
      --classes 1000000 --dtype bfloat16 --reps 10 --chunks 4096,16384,65536,262144 --kernels fused,unfused"
    step bench-ema 150 "$B/bench_ema.py --device cuda"
    step bench-normalize 90 "$B/bench_normalize.py --device cuda && $B/bench_normalize.py --device cuda --dtype bfloat16"
    step bench-parallel 90 "$B/bench_parallel.py --device cuda"
    step bench-distributed 150 "$B/bench_distributed.py --device cuda --timeout 130"
    # One GPU: the two stages are two streams of cuda:0 (with two GPUs: --devices cuda:0,cuda:1).
    step bench-pipeline 120 "$B/bench_pipeline.py --devices cuda:0,cuda:0"
    ;;
  bench-b)
    info; wheels; build
    step bench-sharded-loss 300 "$B/bench_sharded_loss.py --device cuda --method-budget 10"
    # The largest-C searches share what the step's cap leaves after start-up and saving.
    step bench-maxc 240 "$B/bench_sharded_loss.py --device cuda --max-classes-only --search-total \$((STEP_CAP - 30))"
    # The same with fp32 master weights and momentum beside every method's bf16 weights, and an
    # SGD step in each probe (the fused-kernel issue's setting).
    step bench-maxc-master 240 "$B/bench_sharded_loss.py --device cuda --max-classes-only --master-weights \
      --search-total \$((STEP_CAP - 30))"
    ;;
  fused)
    # The fused sm90 kernels (SHARDKIT_FUSED=1, sharded_ce_fused.cu). A tiny forward+backward
    # first, on every variant: a kernel that hangs or faults stops the stage there. Then their
    # tests (every variant), the kernel benchmark against the unfused kernels at the target
    # shapes, the op-level GPU tests on both kernel sets, the sanitizers on the smoke run (its
    # D = 64 bf16 case takes the fused kernels) on every variant, the sharded loss against Cut
    # Cross-Entropy at every target shape, the per-kernel profiles, and the largest C one GPU
    # trains with each method.
    info; wheels; build
    fused_smoke_script
    if ! step smoke-fused 75 "SHARDKIT_FUSED=1 $PY $WORK/fused_smoke.py"; then
      echo "the fused kernels do not run: the stage stops here"; finish; exit 1
    fi
    # A failure here ends the stage after the kernel benchmark (the rest would measure kernels
    # that are wrong somewhere).
    step tests-fused 150 "$PY -m pytest tests/test_softmax_fused_gpu.py $PYTEST_OPTS --timeout=60 -q"
    fused_ok=$?
    step bench-fused 150 "for c in 1000000 100000; do $B/bench_sharded_ce_kernels.py --device cuda --batch 1024 \
      --dim 512 --classes \$c --dtype bfloat16 --reps 10 --chunks 65536 --kernels $FUSED_KERNELS || exit 1; done && \
      $B/bench_sharded_ce_kernels.py --device cuda --batch 256 --dim 512 --classes 1000000 --dtype bfloat16 \
      --reps 10 --chunks 65536 --kernels $FUSED_KERNELS && \
      $B/bench_sharded_ce_kernels.py --device cuda --batch 1024 --dim 512 --classes 1000000 --dtype bfloat16 \
      --reps 10 --normalize --kernels $FUSED_KERNELS"
    if (( fused_ok != 0 )); then echo "the fused kernels' tests failed: the stage stops here"; finish; exit 1; fi
    step tests-ops-gpu 150 "$PY -m pytest -m gpu tests/test_softmax_ops_gpu.py $PYTEST_OPTS --timeout=60 -q"
    step sanitize-fused 150 "sanitize_fused_variants"
    # The sharded loss (the default kernels) against Cut Cross-Entropy, exact and filtered, at
    # B in {256, 1024} and C in {100k, 1M}.
    step bench-peers 150 "$B/bench_sharded_loss.py --device cuda --methods shardkit cce_exact cce_filtered \
      --method-budget 2"
    step profile-fused 100 "SHARDKIT_FUSED=1 $B/profile_sharded_ce.py && SHARDKIT_FUSED=1 $B/profile_sharded_ce.py --margin arcface \
      && SHARDKIT_FUSED=1 SHARDKIT_FUSED_PDL=1 $B/profile_sharded_ce.py"
    # The largest C one GPU trains, each method (its searches share what the step's cap leaves).
    step bench-maxc 240 "$B/bench_sharded_loss.py --device cuda --max-classes-only --search-total \$((STEP_CAP - 30))"
    # The same with fp32 master weights and momentum beside every method's bf16 weights, and an
    # SGD step in each probe (the fused-kernel issue's setting).
    step bench-maxc-master 240 "$B/bench_sharded_loss.py --device cuda --max-classes-only --master-weights \
      --search-total \$((STEP_CAP - 30))"
    ;;
  next)
    # The next GPU session's command (see the header): the strengthened tests before any timing.
    info; wheels; build
    fused_smoke_script
    if ! step smoke-fused 75 "SHARDKIT_FUSED=1 $PY $WORK/fused_smoke.py"; then
      echo "the fused kernels do not run: the stage stops here"; finish; exit 1
    fi
    # Every sharded-loss GPU test (the fused variants, both kernel sets of the op, mixed
    # precision, the module, NCCL), then the host-side layout check of the fused kernels.
    step tests-sharded-loss 300 "$PY -m pytest -m gpu tests/test_softmax_fused_gpu.py tests/test_softmax_ops_gpu.py \
      tests/test_softmax_mixed.py tests/test_softmax_loss.py tests/test_softmax_distributed_nccl.py $PYTEST_OPTS \
      -q --junitxml=$WORK/out/junit_sharded_loss.xml && $PY -m pytest tests/test_fused_layout.py $PYTEST_OPTS -q"
    tests_ok=$?
    # Every other GPU test (the EMA's CUDA graph, several ranks on one GPU, mixed CPU/GPU
    # pipelines, the kept path...): checked before any timing, without gating the timings.
    step tests-gpu-others 150 "$PY -m pytest -m gpu tests $PYTEST_OPTS -q --junitxml=$WORK/out/junit_gpu_others.xml \
      --ignore=tests/test_softmax_fused_gpu.py --ignore=tests/test_softmax_ops_gpu.py --ignore=tests/test_softmax_mixed.py \
      --ignore=tests/test_softmax_loss.py --ignore=tests/test_softmax_distributed_nccl.py"
    # Issue 38's step 4: is the module's step at 100k classes host-bound? The host's time to issue
    # one step (op, module, module with checks) beside the step's whole time, and its kernel count.
    step host-module 45 "$B/bench_host_overhead.py --device cuda --shape 1024 100000 512 --shape 256 100000 512 \
      --shape 8 64 64 --steps 40 && $B/bench_host_overhead.py --device cuda --shape 1024 100000 512 --steps 40 \
      --margin arcface --json $WORK/out/host_overhead_arcface.json"
    step sanitize-fused 150 "sanitize_fused_variants"
    if (( tests_ok != 0 )); then echo "the sharded-loss GPU tests failed: no timings"; finish; exit 1; fi
    # Issue 38's step 2 at the op level: each launch variant alone against the default and the
    # unfused kernels, each timed alternately with the three cuBLAS GEMMs of the layer (median and
    # spread), at the target shapes (D=512, bf16), the module's 100k-class shard first.
    step bench-variants 400 "for bc in 1024:100000 256:100000 1024:1000000 256:1000000 \
      4096:100000; do $B/bench_sharded_ce_kernels.py --device cuda --batch \${bc%:*} --dim 512 --classes \${bc#*:} \
      --dtype bfloat16 --reps 10 --kernels $FUSED_KERNELS --out $WORK/out/sharded_ce_kernels_\${bc%:*}_\${bc#*:}.json \
      || exit 1; done"
    ;;
  next-b)
    # The follow-up of next: the sharded loss at the module level under each fused variant
    # against Cut Cross-Entropy (exact, filtered) at B in {256, 1024}, C in {100k, 1M}, then the
    # per-kernel profiles of the launches with PDL and with the second stream.
    info; wheels; build
    step bench-module-default 120 "$B/bench_sharded_loss.py --device cuda --methods shardkit cce_exact cce_filtered \
      --method-budget 2"
    # (Each variant's JSON in a folder of its own.)
    step bench-module-pdl 90 "SHARDKIT_BENCH_OUT=$WORK/out/pdl SHARDKIT_FUSED_PDL=1 \
      $B/bench_sharded_loss.py --device cuda --methods shardkit --method-budget 2"
    step bench-module-overlap 90 "SHARDKIT_BENCH_OUT=$WORK/out/overlap SHARDKIT_FUSED_OVERLAP=1 \
      $B/bench_sharded_loss.py --device cuda --methods shardkit --method-budget 2"
    step profile-variants 100 "SHARDKIT_FUSED_PDL=1 $B/profile_sharded_ce.py && SHARDKIT_FUSED_OVERLAP=1 \
      $B/profile_sharded_ce.py"
    ;;
  fused-b)
    # The fused kernels' follow-up: Nsight Compute on the forward and the backward GEMM (one
    # 65,536-class chunk at B=1024, D=512, bf16), then the sharded loss on them against its
    # peers at B=1024, C=1M (speed and extra memory).
    info; wheels; build
    cat > "$WORK/ncu_fused.py" <<'PYEOF'
import torch
import shardkit
x = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w = torch.randn(65536, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
y = torch.randint(0, 65536, (1024,), device="cuda")
lse, t, s, _ = shardkit.ops.ce_shard_stats(x, w, y, chunk_classes=65536)
(lse - t).mean().backward()
torch.cuda.synchronize()
PYEOF
    step ncu-fused 120 "SHARDKIT_FUSED=1 \$(command -v ncu || echo /usr/local/cuda/bin/ncu) -k 'regex:sce_(forward|backward)_gemm' -c 2 \
      --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
      --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats \
      $PY $WORK/ncu_fused.py"
    step bench-sharded-loss-fused 240 "SHARDKIT_FUSED=1 $B/bench_sharded_loss.py --device cuda --batch 1024 \
      --classes 1000000 --method-budget 3"
    ;;
  recipe)
    # The whole recipe on one GPU (the arcface_torch issue): arcface_torch's train_v2.py as it is
    # and with shardkit's drop-in, then the trainer. Needs the user's arcface_torch checkout
    # carried at benchmarks/out/arcface_torch (see benchmarks/arcface_torch_run.py; nothing of it
    # is in this repository). Runs that need much memory write under /tmp, logs come back.
    info; wheels; build
    export SHARDKIT_ARCFACE_TORCH=${SHARDKIT_ARCFACE_TORCH:-$PWD/benchmarks/out/arcface_torch}
    export SHARDKIT_BENCH_OUT=$WORK/out
    # The main job first (the README's first command, never timed on a GPU), then the tests.
    step train-default 80 "$PY -m shardkit.train --no-progress --out $WORK/out/train_default"
    step tests-recipe 150 "$PY -m pytest tests/test_softmax_distributed_one_gpu.py tests/test_partial_fc.py \
      tests/test_arcface_torch_checkout.py tests/test_train_models.py $PYTEST_OPTS -q"
    step arcface-compare 90 "$B/arcface_torch_compare.py --device cuda --dtype float32 --classes 100000 --dim 512 \
      --batch 128 && $B/arcface_torch_compare.py --device cuda --dtype float32 --fp16 --classes 100000 --dim 512 --batch 128"
    step arcface-1m 280 "$B/arcface_torch_run.py --head pfc,shardkit --classes 1000000 --sample-rate 1.0,0.1 \
      --batch 128,512 --steps 30 --warmup 10 --timeout 60 --out $WORK/out/arcface_1m.json"
    ;;
  recipe-b)
    # recipe's follow-up: 10M classes in arcface_torch, the trainer's iresnet50 scale runs with
    # their --profile verdicts.
    info; wheels; build
    export SHARDKIT_ARCFACE_TORCH=${SHARDKIT_ARCFACE_TORCH:-$PWD/benchmarks/out/arcface_torch}
    export SHARDKIT_BENCH_OUT=$WORK/out
    step arcface-10m 240 "$B/arcface_torch_run.py --head pfc,shardkit,shardkit-sparse --classes 10000000 \
      --sample-rate 0.1 --batch 128 --steps 20 --warmup 10 --timeout 110 --out $WORK/out/arcface_10m.json"
    F="--backbone iresnet50 --image-size 112 --dim 512 --batch 128 --amp fp16 --workers 12 --val-classes 100 \
      --val-per-class 4 --no-progress"
    step train-ir50-1m 120 "$PY -m shardkit.train $F --classes 1000000 --per-class 2 --profile 20 \
      --out /tmp/ir50_1m && cp /tmp/ir50_1m/log.txt $WORK/out/ir50_1m_log.txt"
    step train-ir50-10m 180 "$PY -m shardkit.train $F --classes 10000000 --per-class 1 --sample-rate 0.1 --profile 20 \
      --out /tmp/ir50_10m && cp /tmp/ir50_10m/log.txt $WORK/out/ir50_10m_log.txt"
    ;;
  budget)
    # The memory budget's CUDA kept path (see the header): its tests, memcheck, then its timings.
    info; wheels; build
    step tests-budget 200 "$PY -m pytest -m gpu tests/test_softmax_budget_cuda.py $PYTEST_OPTS -q \
      --junitxml=$WORK/out/junit_budget.xml"
    tests_ok=$?
    # A small kept-path forward+backward under memcheck (every tensor its own allocation): bf16 and
    # fp32, plain and ArcFace, kept slots at odd element phases, budgets keeping some and all chunks,
    # each against the CPU kernels in float64.
    cat > "$WORK/budget_smoke.py" <<'PYEOF'
import os
import torch
from shardkit.ops import ce_shard_stats, kept_bytes
os.environ["SHARDKIT_CUDA_KEEP"] = "1"
B, D, C, chunk = 37, 64, 1000, 61  # 17 chunks, the last one 24 classes; 37 * 61 % 4 == 1
for dtype in (torch.bfloat16, torch.float32):
    for margin in ({}, dict(scale=30.0, m2=0.5, normalize=True)):
        x = torch.randn(B, D, dtype=dtype)
        w = torch.randn(C, D, dtype=dtype)
        y = torch.randint(0, C, (B,))
        g = torch.randn(B, dtype=torch.float64)
        ref = None
        for device, budget in (("cpu", 0), ("cuda", kept_bytes(B, C, chunk, 5, dtype, "cuda")),
                               ("cuda", 1 << 40)):
            xx = x.double().to(device).requires_grad_() if device == "cpu" else x.to(device).requires_grad_()
            ww = w.double().to(device).requires_grad_() if device == "cpu" else w.to(device).requires_grad_()
            lse, t, s, _ = ce_shard_stats(xx, ww, y.to(device), chunk_classes=chunk, memory_budget=budget, **margin)
            stats = [v.double().cpu() for v in (lse, t, s)]
            out = (stats[0] * g).sum() - (stats[1] * g).sum() + 0.1 * (stats[2] * g).sum()
            gx, gw = torch.autograd.grad(out, (xx, ww))
            got = [v.detach() for v in stats] + [gx.double().cpu(), gw.double().cpu()]
            if ref is None:
                ref = got
                continue
            torch.cuda.synchronize()
            errs = [float((a - b).norm() / b.norm()) for a, b in zip(got, ref)]
            tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
            print(dtype, "margin" if margin else "plain", budget, "errors vs float64", [f"{e:.1e}" for e in errs])
            assert all(e <= tol for e in errs), errs
print("budget_smoke: all results match")
PYEOF
    step sanitize-budget 90 "$SAN --tool memcheck $PY $WORK/budget_smoke.py"
    smoke_ok=$?
    if (( tests_ok != 0 || smoke_ok != 0 )); then echo "the kept path's tests or memcheck failed: no timings"; finish; exit 1; fi
    step bench-budget 330 "SHARDKIT_CUDA_KEEP=1 $B/bench_sharded_loss.py --device cuda --shape 1024 1000000 512 \
      --llm-shapes --methods shardkit shardkit@50% shardkit@full liger_flce quack_lce cce_exact --method-budget 2"
    ;;
  *) echo "unknown stage $STAGE (next, next-b, recipe, recipe-b, budget, quick, quick-b, rest, test, bench-a, bench-b, fused, fused-b)"; exit 2 ;;
esac
finish
