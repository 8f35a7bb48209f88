"""Fixtures the attention tests share."""

import pytest

from selective_ckpt import backend


@pytest.fixture
def setting(monkeypatch):
    """setting(name): the attention setting (SELECTIVE_CKPT_ATTENTION) for this test only."""
    return lambda name: monkeypatch.setenv(backend.ATTENTION_ENV, name)
