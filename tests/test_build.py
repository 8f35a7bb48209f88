"""The installed package: the extension loads, refuses a stale or missing build, and the Triton
kernels live under selective_ckpt without claiming the top-level name `triton_kernels`."""

import subprocess
import sys

import pytest

import selective_ckpt
from selective_ckpt import _extension


def test_extension_loads_and_matches_its_sources():
    c = _extension.load()
    assert c.SOURCE_HASH != "unknown"


def test_stale_build_is_an_import_error_that_says_how_to_rebuild(monkeypatch):
    monkeypatch.setattr(_extension, "source_hash", lambda csrc: "0000000000000000")
    with pytest.raises(ImportError, match=r"stale.*pip install -e \."):
        _extension.load()


def test_missing_build_is_an_import_error_that_says_how_to_rebuild(monkeypatch):
    monkeypatch.setitem(sys.modules, "selective_ckpt._C", None)  # makes `from . import _C` fail
    monkeypatch.delattr(selective_ckpt, "_C")
    with pytest.raises(ImportError, match=r"not built.*pip install -e \."):
        _extension.load()


def test_triton_kernels_are_installed_under_the_package_only(tmp_path):
    import selective_ckpt.triton_kernels as tk

    assert tk.__name__ == "selective_ckpt.triton_kernels"
    probe = "import importlib.util; print(importlib.util.find_spec('triton_kernels') is None)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


def test_public_api():
    for name in ("SelectiveDecoderLayer", "SelectiveAttention", "SelectiveMLP", "attention", "gelu_mlp", "dropout",
                 "convert", "memory", "rng", "set_recompute"):
        assert hasattr(selective_ckpt, name), name
