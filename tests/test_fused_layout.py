"""The fused sm90 kernels' view of the GEMM accumulators, checked without a GPU: compiles
tests/native/fused_layout_check.cu (host code over CUTLASS's own layouts) with nvcc and runs
it. Its epilogue reduces a row's statistics over the columns a thread holds and the four
threads of a quad; a CUTLASS release that laid the accumulators out otherwise would make
those statistics silently wrong, and this test fails first. It needs nvcc and CUTLASS's headers
at the version setup.py pins (the README's commands download them; tools/cutlass_headers.py
finds them as setup.py does). Where the installed extension was built with the fused kernels
(CI's FORCE_CUDA=1 build), missing ones are a failure: the kernels this checks are in the
build; elsewhere the test is skipped with the reason."""

import importlib.util
import os
import shutil
import subprocess

import pytest

import shardkit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cutlass_include():
    """(include dir or None, reason): the headers setup.py would build with, found by its search."""
    spec = importlib.util.spec_from_file_location("cutlass_headers", os.path.join(ROOT, "tools", "cutlass_headers.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.find_cutlass_include(ROOT)


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
    elif inc is None:
        why = f"CUTLASS headers: {why}"
    if inc is None or nvcc is None:
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
    assert run.stdout.count("fused layout OK") == 2, run.stdout  # bf16 and fp16
