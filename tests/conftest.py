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


def _cuda_generator_stuck():
    """True when drawing a random number on the GPU fails the way it does after a CUDA-graph
    capture that did not end (torch's generator then stays registered to that capture)."""
    try:
        torch.randn(1, device="cuda")
    except RuntimeError as err:
        if "graph capture" in str(err):
            return True
        raise
    return False


@pytest.fixture(autouse=True)
def _no_capture_left_behind(request):
    # A GPU test whose CUDA-graph capture fails (a host sync inside it, say) leaves torch's CUDA
    # generator registered to the failed capture, and every later test that draws random numbers
    # on the GPU fails with "Offset increment outside graph capture" (30 did so once). After
    # each GPU test: if that is the state, end it with an empty capture (its prologue and
    # epilogue reset the generator), and fail this test's teardown, naming it, either way.
    yield
    if not HAS_GPU or "gpu" not in request.keywords or not _cuda_generator_stuck():
        return
    torch.cuda.synchronize()
    try:
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            pass
    except RuntimeError:
        pass
    after = "reset for the tests after it" if not _cuda_generator_stuck() else "not reset: later GPU tests fail"
    pytest.fail(f"{request.node.nodeid} left torch's CUDA generator inside a failed graph capture ({after})")
