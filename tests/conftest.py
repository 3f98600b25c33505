"""Test set-up shared by the whole suite.

Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors; TRITON_INTERPRET must be set
before triton is first imported, so it is set here, before anything imports flashdsa.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="GPU-only size: needs a CUDA device (CI has none)")
    # with a GPU, TRITON_INTERPRET is left unset (the suite runs its kernels compiled), so a launch on CPU
    # tensors cannot run; each such test has a gpu twin on CUDA tensors
    skip_interp = pytest.mark.skip(reason="Triton's interpreter is off where a GPU is (the gpu twin runs instead)")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        if "interpreter" in item.keywords and os.environ.get("TRITON_INTERPRET") != "1":
            item.add_marker(skip_interp)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def device():
    return DEVICE
