"""Test set-up: Triton runs interpreted on CPU tensors when no GPU is present.

TRITON_INTERPRET must be set before triton is imported, so it is set here, first.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = torch.cuda.is_available()
BACKEND_ENV = "SELECTIVE_CKPT_BACKEND"


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_cuda)


@pytest.fixture
def use_backend(monkeypatch):
    """use_backend('cpp' | 'triton') routes CPU tensors to that backend for the test."""

    def choose(name):
        monkeypatch.setenv(BACKEND_ENV, "triton" if name == "triton" else "auto")

    return choose


@pytest.fixture(params=["cpp", "triton"])
def backend(request, use_backend):
    """Runs a test once per backend on CPU tensors (Triton through the interpreter)."""
    use_backend(request.param)
    return request.param
