"""What this build of shardkit was made against, and whether it fits the torch and the GPUs
of this machine: the import-time torch check, :func:`build_info`, and ``python -m shardkit.info``.

``setup.py`` writes ``shardkit/_build_info.py`` when it compiles the extension. This module
reads it without loading the compiled ``_C`` (which, built for another torch, would fail
with an unreadable ``undefined symbol``).
"""

from __future__ import annotations

from typing import Any

import torch

REBUILD = "pip install --no-build-isolation --force-reinstall --no-deps ."


def recorded() -> dict[str, Any]:
    """The build's record, or {} when there is none (an extension built by other means)."""
    try:
        from shardkit._build_info import BUILD
    except ImportError:
        return {}
    return dict(BUILD)


def _release(version: str) -> str:
    return version.split("+")[0]


def check_torch_version(installed: str | None = None, built: str | None = None) -> None:
    """ImportError when the extension was built against another torch release than the one
    installed. The local suffix (+cu130, +cpu) is not compared: builds of one release share
    its C++ ABI."""
    installed = torch.__version__ if installed is None else installed
    built = recorded().get("torch") if built is None else built
    if built is None or _release(built) == _release(installed):
        return
    raise ImportError(
        f"shardkit was compiled against torch {built}, but torch {installed} is installed; its compiled "
        f"extension cannot load with another torch. Rebuild it, in the shardkit source folder, with:\n"
        f"    {REBUILD}"
    )


def _arch_list(text: str | None) -> list[str]:
    if not text or text.startswith("("):
        return []
    return [a.strip() for a in text.replace(",", ";").replace(" ", ";").split(";") if a.strip()]


def covers(archs: list[str], major: int, minor: int) -> bool:
    """Whether kernels compiled for ``archs`` (TORCH_CUDA_ARCH_LIST entries such as "8.0",
    "9.0a", "10.0f", "8.6+PTX") run on a GPU of compute capability major.minor: machine code of
    the same major and a minor up to the GPU's (an architecture-specific "a" target: that very
    compute capability only), or PTX of an older architecture."""
    for a in archs:
        ptx = a.endswith("+PTX")
        base = a.removesuffix("+PTX")
        specific = base.endswith("a")
        try:
            amaj, amin = (int(v) for v in base.rstrip("af").split("."))
        except ValueError:
            continue
        if specific:  # (its PTX too: compute_90a code JIT-compiles for 9.0 alone)
            if (amaj, amin) == (major, minor):
                return True
        elif (amaj == major and amin <= minor) or (ptx and (amaj, amin) <= (major, minor)):
            return True
    return False


def build_info() -> dict[str, Any]:
    """What the installed shardkit was built with and how it fits this machine.

    Returns a dict: ``shardkit`` (version), ``torch_built`` / ``torch_installed`` (versions),
    ``torch_cuda_built`` (the CUDA of the torch it was built against), ``cuda_kernels`` (bool)
    and ``reason`` (the build's choice: why the CUDA kernels are in or not), ``fused_kernels``
    (bool: the fused sm90 sharded cross-entropy kernels, built with CUTLASS) and
    ``fused_reason`` (where their CUTLASS headers came from, or why they are left out), ``arch_list``
    (the CUDA architectures compiled), ``gpus`` (one dict per visible GPU: ``index``,
    ``name``, ``capability``, ``supported``: whether its architecture is among those
    compiled) and ``problems`` (one sentence per thing that will not work, with the fix).
    """
    import shardkit
    from shardkit import _C

    rec = recorded()
    archs = _arch_list(rec.get("arch_list"))
    info = {
        "shardkit": shardkit.__version__,
        "torch_built": rec.get("torch"),
        "torch_installed": torch.__version__,
        "torch_cuda_built": rec.get("torch_cuda"),
        "cuda_kernels": bool(_C.cuda_built()),
        "reason": rec.get("reason", "unknown (no build record: the extension was not built by setup.py)"),
        "fused_kernels": bool(rec.get("fused_kernels", False)),
        "fused_reason": rec.get("fused_reason"),
        "arch_list": rec.get("arch_list"),
        "gpus": [],
        "problems": [],
    }
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(i)
            name = torch.cuda.get_device_name(i)
            ok = info["cuda_kernels"] and (not archs or covers(archs, major, minor))
            info["gpus"].append({"index": i, "name": name, "capability": f"{major}.{minor}", "supported": ok})
            if not info["cuda_kernels"]:
                info["problems"].append(
                    f"cuda:{i} is visible but this build has no CUDA kernels ({info['reason']}); rebuild with "
                    f"FORCE_CUDA=1 {REBUILD}"
                )
            elif not ok:
                info["problems"].append(
                    f"cuda:{i} ({name}) has compute capability {major}.{minor}, not among the compiled "
                    f"architectures {rec.get('arch_list')}; rebuild with TORCH_CUDA_ARCH_LIST={major}.{minor} "
                    f"{REBUILD}"
                )
    return info


def format_info(info: dict[str, Any]) -> str:
    """The report ``python -m shardkit.info`` prints."""
    lines = [
        f"shardkit {info['shardkit']}",
        f"  built against torch {info['torch_built']} (CUDA {info['torch_cuda_built']}); "
        f"installed torch {info['torch_installed']}",
        f"  CUDA kernels: {'yes' if info['cuda_kernels'] else 'no'} ({info['reason']})",
        f"  CUDA architectures compiled: {info['arch_list'] or '-'}",
        f"  fused sm90 sharded cross-entropy kernels (CUTLASS): {'yes' if info.get('fused_kernels') else 'no'}"
        + (f" ({info['fused_reason']})" if info.get("fused_reason") else ""),
    ]
    for g in info["gpus"]:
        state = "supported" if g["supported"] else "NOT supported by this build"
        lines.append(f"  cuda:{g['index']}: {g['name']}, compute capability {g['capability']}: {state}")
    if not info["gpus"]:
        lines.append("  GPUs visible now: none (every op runs on the CPU)")
    lines += [f"  problem: {p}" for p in info["problems"]]
    return "\n".join(lines)
