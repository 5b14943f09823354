"""tools/cutlass_headers.py, the search setup.py runs for CUTLASS's headers: the pinned
version only, the downloaded wheel only with its pinned SHA-256, CUTLASS_PATH first, and a
reason with the fix wherever the fused kernels must be left out. Made-up header trees and
wheels: no network, no nvcc."""

import hashlib
import importlib.util
import os
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def ch(monkeypatch):
    spec = importlib.util.spec_from_file_location("cutlass_headers", os.path.join(ROOT, "tools", "cutlass_headers.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.delenv("CUTLASS_PATH", raising=False)
    # no installed nvidia-cutlass package, whatever this machine has
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        module.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "cutlass_library" else real_find_spec(name, *a),
    )
    return module


def _version_h(major, minor):
    return f"#define CUTLASS_MAJOR {major}\n#define CUTLASS_MINOR {minor}\n#define CUTLASS_PATCH 0\n"


def _header_tree(include, major, minor):
    (include / "cutlass").mkdir(parents=True)
    (include / "cute").mkdir()
    (include / "cutlass" / "version.h").write_text(_version_h(major, minor))
    (include / "cute" / "tensor.hpp").write_text("// made up\n")


def _wheel(path, members):
    with zipfile.ZipFile(path, "w") as z:
        for name, text in members.items():
            z.writestr(name, text)
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_nothing_found_says_how_to_get_it(ch, tmp_path):
    inc, why = ch.find_cutlass_include(str(tmp_path))
    assert inc is None
    assert "no CUTLASS 4.2 headers" in why and ch.DOWNLOAD in why and "CUTLASS_PATH" in why


def test_cutlass_path_at_the_pinned_version(ch, tmp_path, monkeypatch):
    _header_tree(tmp_path / "cutlass" / "include", 4, 2)
    monkeypatch.setenv("CUTLASS_PATH", str(tmp_path / "cutlass"))
    inc, why = ch.find_cutlass_include(str(tmp_path / "src"))
    assert inc == str(tmp_path / "cutlass" / "include")
    assert why.startswith("CUTLASS 4.2 at ") and "CUTLASS_PATH" in why


def test_another_version_is_refused_with_the_reason(ch, tmp_path, monkeypatch):
    _header_tree(tmp_path / "cutlass" / "include", 4, 3)
    monkeypatch.setenv("CUTLASS_PATH", str(tmp_path / "cutlass"))
    inc, why = ch.find_cutlass_include(str(tmp_path / "src"))
    assert inc is None and "CUTLASS 4.3 at " in why and "not the pinned 4.2" in why


def test_wheel_is_hash_checked_then_extracted_once(ch, tmp_path, monkeypatch):
    third_party = tmp_path / "third_party"
    third_party.mkdir()
    prefix = ch.WHEEL_INCLUDE
    members = {
        prefix + "cutlass/version.h": _version_h(4, 2),
        prefix + "cute/tensor.hpp": "// made up\n",
        "cutlass_library/__init__.py": "",  # not a header: left in the wheel
    }
    digest = _wheel(third_party / ch.WHEEL, members)
    inc, why = ch.find_cutlass_include(str(tmp_path))  # the made-up wheel is not the pinned one
    assert inc is None and f"SHA-256 {digest}" in why and ch.WHEEL_SHA256 in why and ch.DOWNLOAD in why
    assert not (third_party / "cutlass-4.2.0.0").exists()

    monkeypatch.setattr(ch, "WHEEL_SHA256", digest)
    inc, why = ch.find_cutlass_include(str(tmp_path))
    assert inc == str(third_party / "cutlass-4.2.0.0" / "include") and ch.WHEEL in why
    assert (third_party / "cutlass-4.2.0.0" / "include" / "cute" / "tensor.hpp").read_text() == "// made up\n"
    assert not (third_party / "cutlass-4.2.0.0" / "include" / "cutlass_library").exists()
    assert [p.name for p in third_party.iterdir() if p.name.startswith(".cutlass-")] == []  # no temporary left
    marker = third_party / "cutlass-4.2.0.0" / "include" / "marker"
    marker.write_text("kept")
    assert ch.find_cutlass_include(str(tmp_path))[0] == inc and marker.exists()  # not extracted again


def test_cutlass_path_wins_over_a_bad_wheel(ch, tmp_path, monkeypatch):
    (tmp_path / "third_party").mkdir()
    _wheel(tmp_path / "third_party" / ch.WHEEL, {"x": "y"})
    _header_tree(tmp_path / "cutlass" / "include", 4, 2)
    monkeypatch.setenv("CUTLASS_PATH", str(tmp_path / "cutlass"))
    assert ch.find_cutlass_include(str(tmp_path))[0] == str(tmp_path / "cutlass" / "include")


def test_another_wheel_version_is_named(ch, tmp_path):
    (tmp_path / "third_party").mkdir()
    _wheel(tmp_path / "third_party" / "nvidia_cutlass-4.3.0.0-py3-none-any.whl", {"x": "y"})
    inc, why = ch.find_cutlass_include(str(tmp_path))
    assert inc is None and "nvidia_cutlass-4.3.0.0-py3-none-any.whl" in why and f"not the pinned {ch.WHEEL}" in why


def test_a_wheel_member_outside_the_tree_is_refused(ch, tmp_path, monkeypatch):
    (tmp_path / "third_party").mkdir()
    digest = _wheel(tmp_path / "third_party" / ch.WHEEL, {ch.WHEEL_INCLUDE + "../../evil.h": "x"})
    monkeypatch.setattr(ch, "WHEEL_SHA256", digest)
    with pytest.raises(ValueError, match="unexpected member"):
        ch.find_cutlass_include(str(tmp_path))
    assert not (tmp_path / "evil.h").exists() and not (tmp_path / "third_party" / "cutlass-4.2.0.0").exists()
