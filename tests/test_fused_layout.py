"""The fused sm90 kernels' view of the GEMM accumulators, checked without a GPU: compiles
tests/native/fused_layout_check.cu (host code over CUTLASS's own layouts) with nvcc and runs
it. Its epilogue reduces a row's statistics over the columns a thread holds and the four
threads of a quad; a CUTLASS release that laid the accumulators out otherwise would make
those statistics silently wrong, and this test fails first. It needs nvcc and CUTLASS's headers
at the version setup.py pins (the README's commands install them: nvidia-cutlass). Where the
installed extension was built with the fused kernels (CI's FORCE_CUDA=1 build), missing ones are
a failure: the kernels this checks are in the build; elsewhere the test is skipped with the
reason."""

import importlib.util
import os
import re
import shutil
import subprocess

import pytest

import shardkit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pinned_cutlass():
    """setup.py's CUTLASS_VERSION, (major, minor)."""
    with open(os.path.join(ROOT, "setup.py")) as f:
        found = re.search(r"^CUTLASS_VERSION = \((\d+), (\d+)\)", f.read(), re.M)
    return int(found.group(1)), int(found.group(2))


def _cutlass_include():
    """(include dir, None) of CUTLASS's headers at the pinned version, as setup.py finds them
    ($CUTLASS_PATH/include, then the nvidia-cutlass package), or (None, why not)."""
    candidates = []
    if os.environ.get("CUTLASS_PATH"):
        candidates.append(os.path.join(os.environ["CUTLASS_PATH"], "include"))
    spec = importlib.util.find_spec("cutlass_library")
    for loc in (spec.submodule_search_locations or []) if spec else []:
        candidates.append(os.path.join(loc, "source", "include"))
    for inc in candidates:
        version_h = os.path.join(inc, "cutlass", "version.h")
        if not (os.path.isfile(version_h) and os.path.isfile(os.path.join(inc, "cute", "tensor.hpp"))):
            continue
        with open(version_h) as f:
            text = f.read()
        got = tuple(int(re.search(rf"#define CUTLASS_{k} (\d+)", text).group(1)) for k in ("MAJOR", "MINOR"))
        if got != _pinned_cutlass():
            return None, f"CUTLASS {got} at {inc}, not the pinned {_pinned_cutlass()}"
        return inc, None
    return None, "CUTLASS headers not found (pip install --no-deps nvidia-cutlass==4.2.0.0, or set CUTLASS_PATH)"


def _nvcc():
    from torch.utils.cpp_extension import CUDA_HOME

    found = shutil.which("nvcc")
    if found:
        return found
    if CUDA_HOME and os.path.isfile(os.path.join(CUDA_HOME, "bin", "nvcc")):
        return os.path.join(CUDA_HOME, "bin", "nvcc")
    return None


def test_fused_accumulator_layout(tmp_path):
    nvcc, (inc, why) = _nvcc(), _cutlass_include()
    if nvcc is None:
        why = "nvcc not found (the fused kernels are not built without it either)"
    if why:
        # A build with the fused kernels had both: their layout check must run where they are.
        assert not shardkit.build_info()["fused_kernels"], f"the build has the fused kernels, but {why}"
        pytest.skip(why)
    exe = str(tmp_path / "fused_layout_check")
    src = os.path.join(ROOT, "tests", "native", "fused_layout_check.cu")
    cmd = [nvcc, "-std=c++17", "--expt-relaxed-constexpr", "-I", os.path.join(ROOT, "csrc"), "-I", inc, src, "-o", exe]
    build = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stdout + build.stderr
    run = subprocess.run([exe], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("fused layout OK") == 4, run.stdout  # 2 schedules x 2 dtypes
