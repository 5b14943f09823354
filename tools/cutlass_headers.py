"""Where a build finds CUTLASS's headers for the fused sm90 kernels: one search and one
version check, shared by ``setup.py`` and ``tests/test_fused_layout.py``.

The places, in order; the first that has a header tree decides:

1. ``$CUTLASS_PATH/include``: a CUTLASS checkout;
2. ``third_party/nvidia_cutlass-4.2.0.0-py3-none-any.whl``, put there by the README's
   ``pip download --no-deps -d third_party nvidia-cutlass==4.2.0.0``: its SHA-256 is checked
   against the pin below and its header tree extracted once, to
   ``third_party/cutlass-4.2.0.0/include``. Downloaded, not installed: an installed
   nvidia-cutlass would lack its Python dependencies (cuda-python, scipy, ...), which pip
   then reports as an ERROR on every later install, and the build needs only the headers;
3. an installed ``nvidia-cutlass`` package (``cutlass_library/source/include``).

The tree found must be CUTLASS 4.2 (``cutlass/version.h``), the release the fused kernels are
written and tested against; otherwise, or where there is none, the build leaves the fused
kernels out and records why (``python -m shardkit.info`` prints it).
"""

import glob
import hashlib
import importlib.util
import os
import re
import shutil
import tempfile
import zipfile

CUTLASS_VERSION = (4, 2)
WHEEL = "nvidia_cutlass-4.2.0.0-py3-none-any.whl"
WHEEL_SHA256 = "f9599ada45c7bcb6bf53f7d3f0a7d154183e53451c01bfa59eecd37dd4a693f6"
WHEEL_INCLUDE = "cutlass_library/source/include/"  # the header tree inside the wheel
DOWNLOAD = "pip download --no-deps -d third_party nvidia-cutlass==4.2.0.0"


def _sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _extract_headers(wheel, dest):
    """Extracts the wheel's header tree to ``dest`` (through a temporary folder renamed into
    place, so an interrupted extraction leaves nothing half-written behind)."""
    parent = os.path.dirname(dest)
    tmp = tempfile.mkdtemp(prefix=".cutlass-", dir=parent)
    try:
        with zipfile.ZipFile(wheel) as z:
            for member in z.namelist():
                if not member.startswith(WHEEL_INCLUDE) or member.endswith("/"):
                    continue
                rel = member[len(WHEEL_INCLUDE) :]
                if rel.startswith("/") or ".." in rel.split("/"):
                    raise ValueError(f"{wheel}: unexpected member {member!r}")
                target = os.path.join(tmp, "include", *rel.split("/"))
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with z.open(member) as src, open(target, "wb") as out:
                    shutil.copyfileobj(src, out)
        with open(os.path.join(tmp, "SHA256"), "w") as f:
            f.write(WHEEL_SHA256 + "\n")
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _from_wheel(third_party):
    """(include dir, None) from the downloaded wheel, (None, why not) when it is wrong, or
    (None, None) when there is no wheel."""
    wheel = os.path.join(third_party, WHEEL)
    if not os.path.isfile(wheel):
        others = sorted(os.path.basename(p) for p in glob.glob(os.path.join(third_party, "nvidia_cutlass-*.whl")))
        if others:
            return None, f"{third_party} holds {', '.join(others)}, not the pinned {WHEEL} ({DOWNLOAD})"
        return None, None
    digest = _sha256(wheel)
    if digest != WHEEL_SHA256:
        return None, (
            f"{wheel} has SHA-256 {digest}, not the pinned {WHEEL_SHA256}: delete it and download it again ({DOWNLOAD})"
        )
    dest = os.path.join(third_party, WHEEL.split("-py3")[0].replace("nvidia_cutlass", "cutlass"))
    stamp = os.path.join(dest, "SHA256")
    if not (os.path.isfile(stamp) and open(stamp).read().strip() == WHEEL_SHA256):
        _extract_headers(wheel, dest)
    return os.path.join(dest, "include"), None


def _version(include):
    """(major, minor) from include/cutlass/version.h, or None when it is not a header tree."""
    version_h = os.path.join(include, "cutlass", "version.h")
    if not (os.path.isfile(version_h) and os.path.isdir(os.path.join(include, "cute"))):
        return None
    with open(version_h) as f:
        text = f.read()
    found = [re.search(rf"#define CUTLASS_{k} (\d+)", text) for k in ("MAJOR", "MINOR")]
    if not all(found):
        return None
    return tuple(int(m.group(1)) for m in found)


def _candidates(root):
    """(include dir or None, where from, problem or None) for each place, in order, lazily: the
    wheel is hashed and extracted only when CUTLASS_PATH has no header tree."""
    if os.environ.get("CUTLASS_PATH"):
        yield os.path.join(os.environ["CUTLASS_PATH"], "include"), "CUTLASS_PATH", None
    inc, problem = _from_wheel(os.path.join(root, "third_party"))
    yield inc, f"third_party/{WHEEL}", problem
    spec = importlib.util.find_spec("cutlass_library")  # located, not imported
    for loc in (spec.submodule_search_locations or []) if spec else []:
        yield os.path.join(loc, "source", "include"), "the installed nvidia-cutlass package", None


def find_cutlass_include(root):
    """(include dir, reason) for the source tree at ``root``: CUTLASS's headers at the pinned
    version and where they came from, or (None, why there are none, with the fix)."""
    want = f"{CUTLASS_VERSION[0]}.{CUTLASS_VERSION[1]}"
    for inc, origin, problem in _candidates(root):
        if problem:
            return None, problem
        got = _version(inc) if inc else None
        if got is None:
            continue
        if got != CUTLASS_VERSION:
            return None, f"CUTLASS {got[0]}.{got[1]} at {inc} (from {origin}), not the pinned {want}"
        return inc, f"CUTLASS {want} at {inc} (from {origin})"
    return None, f"no CUTLASS {want} headers found: in the source folder run `{DOWNLOAD}`, or set CUTLASS_PATH"
