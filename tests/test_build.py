"""The installed package: the extension loads, refuses a stale or missing build, and the Triton
kernels live under selective_ckpt without claiming the top-level name `triton_kernels`."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

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
    for name in ("SelectiveDecoderLayer", "attention", "gelu_mlp", "dropout", "convert", "memory", "rng",
                 "set_recompute", "recomputable_layers"):
        assert hasattr(selective_ckpt, name), name


def test_inplace_build_for_an_offline_machine(tmp_path):
    """`python setup.py inplace` (bench/gpu.sh's fallback where setuptools < 77 cannot read the
    license field) builds _C beside the sources without setuptools' pyproject reading; with the link
    gpu.sh makes, a plain checkout on PYTHONPATH then imports the package and its Triton kernels."""
    root = Path(__file__).resolve().parent.parent
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in ("setup.py", "pyproject.toml"):
        shutil.copy2(root / name, repo / name)
    for name in ("csrc", "selective_ckpt", "triton_kernels"):
        shutil.copytree(root / name, repo / name, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    cmd = [sys.executable, "setup.py", "inplace"]  # pybind11 and ninja: the [test] extra installs them
    build = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=900)
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-2000:]
    (repo / "selective_ckpt" / "triton_kernels").symlink_to("../triton_kernels")
    probe = (
        "import selective_ckpt, selective_ckpt.triton_kernels.attention as a; "
        "print(selective_ckpt.__file__); print(a.__file__); print(selective_ckpt.backend._C.SOURCE_HASH)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(repo)},
    )
    init, kernels, source_hash = out.stdout.split()
    assert init.startswith(str(repo)) and kernels.startswith(str(repo)), out.stdout
    assert source_hash == selective_ckpt.backend._C.SOURCE_HASH


def test_package_imports_and_runs_on_cpu_without_triton(tmp_path):
    """Triton is the [triton] extra: with it unimportable every module outside triton_kernels imports,
    the C++ kernels run, and asking for the Triton backend is an ImportError naming the extra."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import importlib, os, pkgutil, sys\n"
        "class NoTriton:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'triton':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, NoTriton())\n"
        "import torch, selective_ckpt\n"
        "names = [m.name for m in pkgutil.walk_packages(selective_ckpt.__path__, 'selective_ckpt.')\n"
        "         if not m.name.startswith('selective_ckpt.triton_kernels.') and not m.name.endswith('__main__')]\n"
        "for name in names:\n"
        "    importlib.import_module(name)\n"
        "assert 'triton' not in sys.modules\n"
        "x = torch.randn(4, 8)\n"
        "assert torch.equal(selective_ckpt.dropout(x, 0.0), x)\n"
        "os.environ['SELECTIVE_CKPT_BACKEND'] = 'triton'\n"
        "try:\n"
        "    selective_ckpt.dropout(x, 0.1)\n"
        "except ImportError as err:\n"
        "    print('refused:', err)\n"
        "print(len(names), 'modules')\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("SELECTIVE_CKPT_BACKEND", "TRITON_INTERPRET")}
    out = subprocess.run([sys.executable, str(probe)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "refused:" in out.stdout and "pip install 'selective_ckpt[triton]'" in out.stdout, out.stdout
    assert int(out.stdout.split()[-2]) >= 30, out.stdout
