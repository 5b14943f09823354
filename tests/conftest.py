import os

import pytest
import torch

HAS_GPU = torch.cuda.is_available()
# (major, minor) of the installed torch, for the few features that need a newer torch than
# the declared minimum (each such test says which version and why in its skip reason).
TORCH_VERSION = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is visible on this machine (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    # Fresh random data every run, but reproducible from the printed seed on failure.
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    print(f"torch seed for this test: {seed}")  # shown by pytest when the test fails
    yield
