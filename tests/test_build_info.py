"""The build record: the import-time torch check (a clear ImportError naming both versions
and the rebuild command), shardkit.build_info() and python -m shardkit.info."""

import os
import subprocess
import sys

import pytest
import torch

import shardkit
from shardkit.build import REBUILD, check_torch_version, covers, format_info


def test_torch_mismatch_is_a_clear_import_error(monkeypatch):
    with pytest.raises(ImportError) as err:
        check_torch_version(installed="2.15.0+cu132", built="2.11.0+cu130")
    msg = str(err.value)
    assert "compiled against torch 2.11.0+cu130" in msg and "torch 2.15.0+cu132 is installed" in msg
    assert REBUILD in msg
    check_torch_version(installed="2.11.0+cpu", built="2.11.0+cu130")  # same release: fine
    monkeypatch.setattr(shardkit.build, "recorded", lambda: {})
    check_torch_version(installed="1.0.0")  # no build record: nothing to compare


def test_mismatch_at_import_in_a_fresh_process(tmp_path):
    """A package whose build record names another torch fails at `import shardkit` with the
    message, before the extension is loaded."""
    pkg = os.path.dirname(shardkit.__file__)
    fake = tmp_path / "shardkit"
    fake.mkdir()
    for name in os.listdir(pkg):
        if name != "_build_info.py" and name != "__pycache__":
            os.symlink(os.path.join(pkg, name), fake / name)
    (fake / "_build_info.py").write_text("BUILD = {'torch': '1.99.0'}\n")
    r = subprocess.run([sys.executable, "-c", "import shardkit"], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(tmp_path)))  # fmt: skip
    assert r.returncode != 0
    assert "ImportError: shardkit was compiled against torch 1.99.0" in r.stderr
    assert f"but torch {torch.__version__} is installed" in r.stderr and REBUILD in r.stderr


def test_build_info_on_this_machine():
    info = shardkit.build_info()
    assert info["torch_installed"] == torch.__version__
    assert info["cuda_kernels"] == shardkit.cuda_built()
    assert isinstance(info["reason"], str) and info["reason"]
    if info["torch_built"] is not None:  # built by setup.py (pip install or build_ext)
        assert info["torch_built"].split("+")[0] == torch.__version__.split("+")[0]
    if not torch.cuda.is_available():
        assert info["gpus"] == [] and info["problems"] == []
    text = format_info(info)
    assert f"installed torch {torch.__version__}" in text and "CUDA kernels: " in text
    if info["torch_built"] is not None:  # setup.py records where the fused kernels' headers came from, or why not
        assert isinstance(info["fused_reason"], str) and f"({info['fused_reason']})" in text


def test_info_says_why_the_fused_kernels_are_left_out():
    info = dict(shardkit.build_info(), fused_kernels=False, fused_reason="no CUTLASS 4.2 headers found: ...")
    assert "kernels (CUTLASS): no (no CUTLASS 4.2 headers found: ...)" in format_info(info)
    info.update(fused_kernels=True, fused_reason="CUTLASS 4.2 at /x/include (from CUTLASS_PATH)")
    assert "kernels (CUTLASS): yes (CUTLASS 4.2 at /x/include (from CUTLASS_PATH))" in format_info(info)


def test_architecture_coverage():
    assert covers(["9.0"], 9, 0) and not covers(["9.0"], 8, 0) and not covers(["8.0"], 9, 0)
    assert covers(["8.0"], 8, 6)  # same major, older minor: machine code runs
    assert covers(["8.0+PTX"], 9, 0) and not covers(["9.0+PTX"], 8, 9)
    # an architecture-specific target runs on that compute capability alone; a family one on its family
    assert covers(["9.0a"], 9, 0) and covers(["10.0a"], 10, 0) and not covers(["10.0a"], 10, 3)
    assert covers(["10.0f"], 10, 3) and not covers(["10.0f"], 12, 0)
    assert covers(["7.5", "9.0a"], 9, 0)


def test_info_command():
    r = subprocess.run([sys.executable, "-m", "shardkit.info"], capture_output=True, text=True, timeout=120)
    assert r.returncode == (1 if shardkit.build_info()["problems"] else 0), r.stderr
    assert r.stdout.startswith(f"shardkit {shardkit.__version__}") and "CUDA kernels:" in r.stdout


def test_the_installed_package_requires_the_torch_it_was_built_against():
    # a wheel declared torch>=2.6: pip installed it beside the newest torch, which it cannot load
    from importlib import metadata

    try:
        dist = metadata.distribution("shardkit")
    except metadata.PackageNotFoundError:
        pytest.skip("shardkit is not installed here (the suite runs from the source tree): no metadata to read")
    if os.path.realpath(os.path.dirname(shardkit.__file__)) != os.path.realpath(dist.locate_file("shardkit")):
        pytest.skip("the shardkit imported is the source tree's, not the installed one whose metadata pip wrote")
    built = shardkit.build_info()["torch_built"]
    assert built, "the build record names the torch the extension was compiled against"
    assert f"torch=={built.split('+')[0]}" in (dist.requires or [])
