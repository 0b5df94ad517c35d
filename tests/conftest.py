import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
if not torch.cuda.is_available():
    # Triton decides at decoration time whether a @triton.jit function is interpreted: set this before any test
    # module imports a kernel module (a kernel decorated without it cannot run on the CPU)
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: intra-op threads only add overhead (and stall badly on a loaded 2-core machine).
    Test modules opt in with pytestmark = pytest.mark.usefixtures("one_thread")."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

