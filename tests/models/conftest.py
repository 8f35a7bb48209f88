"""Fixtures shared by the model tests."""

import pytest

from selective_ckpt.models import fused_layer


@pytest.fixture
def fused_calls(monkeypatch):
    """The number of fused forwards run since the test began (a list it appends to)."""
    calls = []
    run = fused_layer.fused_forward

    def counted(*args, **kwargs):
        calls.append(1)
        return run(*args, **kwargs)

    monkeypatch.setattr(fused_layer, "fused_forward", counted)
    return calls
