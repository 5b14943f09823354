"""Build script for shardkit's C++/CUDA extension ``shardkit._C``.

Build with ``pip install --no-build-isolation .`` so the extension is compiled
against the torch that is already installed (an isolated build would fetch a
different torch and break the ABI).

Switches (environment variables):

* ``FORCE_CUDA=1``  build the CUDA kernels even without a visible GPU (CI does
  this, so CUDA code that does not compile or link never lands).  The target
  architectures come from ``TORCH_CUDA_ARCH_LIST``; without a GPU to ask, the
  default is ``9.0`` (Hopper).
* ``FORCE_CPU=1``   build the CPU kernels only, even where CUDA is available.
* ``SHARDKIT_DEBUG=1`` compile with ``-O0 -g``.

Without either switch, CUDA kernels are built when torch has CUDA, ``nvcc`` is
found and a GPU is visible.
"""

import glob
import os
import sys

import torch
from setuptools import find_packages, setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

ROOT = os.path.dirname(os.path.abspath(__file__))


def _flag(name):
    return os.environ.get(name, "0").lower() in ("1", "true", "yes", "on")


def _choose_backend():
    """Returns (with_cuda, reason) and prints the choice."""
    if _flag("FORCE_CPU"):
        return False, "FORCE_CPU=1"
    if _flag("FORCE_CUDA"):
        if CUDA_HOME is None:
            sys.exit("shardkit setup: FORCE_CUDA=1 but no CUDA toolkit (nvcc) was found; set CUDA_HOME")
        if torch.version.cuda is None:
            sys.exit("shardkit setup: FORCE_CUDA=1 but the installed torch is a CPU-only build")
        return True, "FORCE_CUDA=1"
    if torch.version.cuda is None:
        return False, "installed torch has no CUDA"
    if CUDA_HOME is None:
        return False, "no CUDA toolkit (nvcc) found"
    if not torch.cuda.is_available():
        return False, "no GPU visible (set FORCE_CUDA=1 to build the CUDA kernels anyway)"
    return True, "torch has CUDA, nvcc found, GPU visible"


def _extension():
    with_cuda, reason = _choose_backend()
    debug = _flag("SHARDKIT_DEBUG")
    opt = ["-O0", "-g"] if debug else ["-O3"]
    # csrc/*.cpp (schemas), csrc/cpu/ (CPU kernels), csrc/composite/ (device-generic ops
    # written with ATen calls); csrc/cuda/ only in CUDA builds.
    sources = sorted(
        glob.glob(os.path.join("csrc", "*.cpp"))
        + glob.glob(os.path.join("csrc", "cpu", "*.cpp"))
        + glob.glob(os.path.join("csrc", "composite", "*.cpp"))
    )
    cxx = opt + ["-std=c++17", "-fopenmp", "-Wall", "-Wno-unused-function"]
    define_macros = []
    extra_link = ["-fopenmp"]
    if with_cuda:
        if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
            os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0"
        sources += sorted(
            glob.glob(os.path.join("csrc", "cuda", "*.cu")) + glob.glob(os.path.join("csrc", "cuda", "*.cpp"))
        )
        define_macros.append(("SHARDKIT_WITH_CUDA", None))
        # No --use_fast_math: it flushes float32 subnormals to zero and approximates division
        # and sqrt everywhere (EMA with decay 1 would stop being exact); the one hot
        # transcendental, exp in the softmax statistics, uses the __expf intrinsic explicitly.
        nvcc = opt + ["-std=c++17", "--expt-relaxed-constexpr", "-lineinfo"]
        print(
            f"shardkit setup: building CPU + CUDA kernels ({reason}); "
            f"TORCH_CUDA_ARCH_LIST={os.environ.get('TORCH_CUDA_ARCH_LIST', '(from visible GPUs)')}, "
            f"CUDA_HOME={CUDA_HOME}, torch {torch.__version__}",
            flush=True,
        )
        return CUDAExtension(
            "shardkit._C",
            sources,
            include_dirs=[os.path.join(ROOT, "csrc")],
            define_macros=define_macros,
            extra_compile_args={"cxx": cxx, "nvcc": nvcc},
            extra_link_args=extra_link + ["-lcublas"],
        )
    print(f"shardkit setup: building CPU kernels only ({reason}); torch {torch.__version__}", flush=True)
    return CppExtension(
        "shardkit._C",
        sources,
        include_dirs=[os.path.join(ROOT, "csrc")],
        define_macros=define_macros,
        extra_compile_args={"cxx": cxx},
        extra_link_args=extra_link,
    )


setup(
    packages=find_packages("python"),
    package_dir={"": "python"},
    ext_modules=[_extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
