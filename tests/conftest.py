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
# SELECTIVE_CKPT_TEST_ISA=avx512 (or avx2, generic, ...) runs the whole suite on that C++ attention variant, as on
# a CPU that has no better one (bf16 rounding differs between the dot-product and the float paths)
ISA_ENV = "SELECTIVE_CKPT_TEST_ISA"


def pytest_configure(config):
    isa = os.environ.get(ISA_ENV)
    if isa:
        from selective_ckpt import _C

        _C.attention_use_isa(isa)


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
