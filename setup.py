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
* ``CUTLASS_PATH=/path/to/cutlass`` CUTLASS's checkout for the fused Hopper kernels (its
  ``include/``); without it the headers of the ``nvidia-cutlass`` package are used where it
  is installed (``pip install nvidia-cutlass==4.2.0.0``).  Without either, or without 9.0 in
  the architectures, the build leaves the fused kernels out (the unfused ones run everywhere).
  With them, architecture 9.0 is built as ``9.0a`` (the warpgroup-MMA instructions need it).

Without either switch, CUDA kernels are built when torch has CUDA, ``nvcc`` is
found and a GPU is visible.
"""

import glob
import importlib.util
import os
import re
import sys

import torch
from setuptools import find_packages, setup
from setuptools.command.build_py import build_py
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


def _write_build_info(with_cuda, reason):
    """python/shardkit/_build_info.py (generated, not committed): what this build was made
    against, read at import (a torch mismatch is a clear ImportError, not an undefined
    symbol) and by ``python -m shardkit.info``."""
    arch = os.environ.get("TORCH_CUDA_ARCH_LIST") if with_cuda else None
    if with_cuda and not arch and torch.cuda.is_available():  # torch compiles for the visible GPUs
        caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
        arch = ";".join(f"{major}.{minor}" for major, minor in sorted(caps))
    info = {
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_kernels": bool(with_cuda),
        "reason": reason,
        "arch_list": arch if arch else ("(the GPUs visible at build time)" if with_cuda else None),
        "cuda_home": CUDA_HOME if with_cuda else None,
        "compiler_std": "chosen by torch.utils.cpp_extension",
    }
    _BUILD_INFO.update(info)
    _write_record(os.path.join(ROOT, "python", "shardkit", "_build_info.py"))  # in-place builds


_BUILD_INFO = {}

# The CUTLASS release the fused kernels are written and tested against.
CUTLASS_VERSION = (4, 2)


def _cutlass_include():
    """(include dir, reason): CUTLASS's headers from $CUTLASS_PATH/include or the nvidia-cutlass
    package, at the pinned version; (None, why not) when there are none."""
    candidates = []
    if os.environ.get("CUTLASS_PATH"):
        candidates.append(os.path.join(os.environ["CUTLASS_PATH"], "include"))
    spec = importlib.util.find_spec("cutlass_library")  # located, not imported
    for loc in (spec.submodule_search_locations or []) if spec else []:
        candidates.append(os.path.join(loc, "source", "include"))
    for inc in candidates:
        version_h = os.path.join(inc, "cutlass", "version.h")
        if not (os.path.isfile(version_h) and os.path.isdir(os.path.join(inc, "cute"))):
            continue
        with open(version_h) as f:
            text = f.read()
        got = tuple(int(re.search(rf"#define CUTLASS_{k} (\d+)", text).group(1)) for k in ("MAJOR", "MINOR"))
        if got != CUTLASS_VERSION:
            return None, f"CUTLASS {got[0]}.{got[1]} at {inc}, not the pinned {CUTLASS_VERSION[0]}.{CUTLASS_VERSION[1]}"
        return inc, f"CUTLASS {got[0]}.{got[1]} at {inc}"
    return None, "no CUTLASS headers (pip install nvidia-cutlass==4.2.0.0, or set CUTLASS_PATH)"


def _hopper_arch_list(arch):
    """The architecture list with 9.0 as 9.0a (None if it has no 9.0: no fused kernels)."""
    out, hopper = [], False
    for a in arch.replace(" ", ";").split(";"):
        if a in ("9.0", "9.0a"):
            a, hopper = "9.0a", True
        elif a == "9.0+PTX":  # keep the portable PTX, add the sm_90a code
            out.append(a)
            a, hopper = "9.0a", True
        if a and a not in out:
            out.append(a)
    return ";".join(out) if hopper else None


def _write_record(path):
    with open(path, "w") as f:
        f.write("# Generated by setup.py at build time; not committed.\n")
        f.write(f"BUILD = {_BUILD_INFO!r}\n")


class BuildPy(build_py):
    """Also writes the build record into the wheel's package (a file generated in the
    source tree is not reliably picked up by every build frontend)."""

    def run(self):
        super().run()
        if _BUILD_INFO and not self.dry_run:
            target = os.path.join(self.build_lib, "shardkit", "_build_info.py")
            self.mkpath(os.path.dirname(target))
            _write_record(target)


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
    # No -std flag: torch's build helpers add the standard its headers need (C++17 up to
    # torch 2.14, C++20 from 2.15); a hard-coded one breaks the next torch that raises it.
    # -ffp-contract=off: no implicit fused multiply-adds (GCC's default where the target has
    # FMA, e.g. ARM): the softmax's backward must round each logit s * z exactly as the
    # forward did before lse is subtracted from it.
    cxx = opt + ["-fopenmp", "-Wall", "-Wno-unused-function", "-ffp-contract=off"]
    define_macros = []
    extra_link = ["-fopenmp"]
    if with_cuda:
        if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
            if torch.cuda.is_available():  # the visible GPUs, as torch would choose
                caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
                os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(f"{a}.{b}" for a, b in sorted(caps))
            else:
                os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0"
        cutlass_inc, cutlass_why = _cutlass_include()
        hopper = _hopper_arch_list(os.environ["TORCH_CUDA_ARCH_LIST"])
        include_dirs = [os.path.join(ROOT, "csrc")]
        if cutlass_inc and hopper:
            os.environ["TORCH_CUDA_ARCH_LIST"] = hopper
            include_dirs.append(cutlass_inc)
            define_macros.append(("SHARDKIT_WITH_CUTLASS", None))
            print(f"shardkit setup: fused sm90 kernels with {cutlass_why}", flush=True)
        else:
            why = cutlass_why if not cutlass_inc else "no 9.0 in TORCH_CUDA_ARCH_LIST"
            print(f"shardkit setup: fused sm90 kernels left out ({why})", flush=True)
        _BUILD_INFO["fused_kernels"] = bool(cutlass_inc and hopper)
        sources += sorted(
            glob.glob(os.path.join("csrc", "cuda", "*.cu")) + glob.glob(os.path.join("csrc", "cuda", "*.cpp"))
        )
        define_macros.append(("SHARDKIT_WITH_CUDA", None))
        # No --use_fast_math: it flushes float32 subnormals to zero and approximates division
        # and sqrt everywhere (EMA with decay 1 would stop being exact); the one hot
        # transcendental, exp in the softmax statistics, uses the __expf intrinsic explicitly.
        nvcc = opt + ["--expt-relaxed-constexpr", "-lineinfo"]
        _write_build_info(True, reason)
        print(
            f"shardkit setup: building CPU + CUDA kernels ({reason}); "
            f"TORCH_CUDA_ARCH_LIST={os.environ.get('TORCH_CUDA_ARCH_LIST', '(from visible GPUs)')}, "
            f"CUDA_HOME={CUDA_HOME}, torch {torch.__version__}",
            flush=True,
        )
        return CUDAExtension(
            "shardkit._C",
            sources,
            include_dirs=include_dirs,
            define_macros=define_macros,
            extra_compile_args={"cxx": cxx, "nvcc": nvcc},
            extra_link_args=extra_link + ["-lcublas"],
        )
    _write_build_info(False, reason)
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
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True), "build_py": BuildPy},
)
