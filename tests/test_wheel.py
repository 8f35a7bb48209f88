"""The package as users install it: `python -m build` makes an sdist and, from that sdist, a wheel;
the wheel goes into a fresh venv that sees torch and numpy (and the bench extras) through a .pth
file but neither triton nor this checkout, and everything runs from a temporary directory.

One build serves the whole session, pytest-xdist workers included (it compiles _C once, a minute or
more): the first worker builds under a lock in the session's shared temporary folder and the others
reuse it. Everything is offline:
the build uses this environment's setuptools, pybind11 and ninja (no isolation), and pip installs
the wheel with --no-index, so a dependency the parent environment does not already have fails.
"""

import os
import re
import subprocess
import sys
import tarfile
import venv
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.wheel

# parent site-packages entries the fresh venv must not see: the GPU kernels' dependency (a CPU
# install must work without it) and this package's own editable install
_HIDDEN = {"triton", "selective_ckpt", "__pycache__"}


def _source_files(folder, suffixes):
    return sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / folder).rglob("*")
                  if p.suffix in suffixes and "__pycache__" not in p.parts and not p.is_symlink())


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "SELECTIVE_CKPT_BACKEND", "TRITON_INTERPRET",
                        "VIRTUAL_ENV")}
    return env | {"PYTHONNOUSERSITE": "1"} | extra


def _shared(tmp_path_factory, name, make):
    """make(folder) once per session: under xdist every worker's basetemp sits in one session folder."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    base = tmp_path_factory.getbasetemp()
    if worker is None:
        folder = base / name
        if not (folder / "done").exists():
            folder.mkdir(exist_ok=True)
            make(folder)
            (folder / "done").touch()
        return folder
    from filelock import FileLock  # a torch dependency

    folder = base.parent / name
    with FileLock(str(base.parent / f"{name}.lock")):
        if not (folder / "done").exists():
            folder.mkdir(exist_ok=True)
            make(folder)
            (folder / "done").touch()
    return folder


def _build(out):
    cmd = [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1500, env=_clean_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    out = _shared(tmp_path_factory, "dist", _build)
    (sdist,), (wheel,) = out.glob("*.tar.gz"), out.glob("*.whl")
    return sdist, wheel


def _parent_site_dirs():
    import numpy

    dirs = []
    for module in (torch, numpy):
        d = Path(module.__file__).resolve().parent.parent
        if d not in dirs:
            dirs.append(d)
    return dirs


@pytest.fixture(scope="module")
def fresh_venv(dist, tmp_path_factory):
    """A venv holding only the wheel (installed by this environment's pip through --python); torch & co.
    through a .pth to a folder of links into the parent's site-packages that leaves out triton and the
    editable selective_ckpt."""

    def make(base):
        env_dir, shared = base / "venv", base / "parent-site"
        venv.EnvBuilder(with_pip=False, symlinks=True).create(env_dir)
        shared.mkdir()
        for site in _parent_site_dirs():
            for entry in site.iterdir():
                stem = re.split(r"[-.]", entry.name, maxsplit=1)[0].lower()
                if (stem in _HIDDEN or entry.name.startswith("__editable__") or entry.suffix == ".pth"
                        or (shared / entry.name).exists()):
                    continue
                (shared / entry.name).symlink_to(entry)
        python = env_dir / "bin" / "python"
        site_dir = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  capture_output=True, text=True, check=True).stdout.strip()
        Path(site_dir, "parent_site.pth").write_text(str(shared) + "\n")
        # no --no-deps: pip resolves torch and numpy against what the venv sees and may download nothing
        cmd = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index", "--no-cache-dir",
               "--disable-pip-version-check", "-q", str(dist[1])]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_clean_env(), cwd=base)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    base = _shared(tmp_path_factory, "venv", make)
    return base / "venv" / "bin" / "python", base


def test_sdist_holds_everything_a_wheel_builds_from(dist):
    sdist, _ = dist
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    wanted = (["setup.py", "pyproject.toml", "README.md", "MANIFEST.in", "selective_ckpt/_build_info.py"]
              + _source_files("csrc", {".cpp", ".h"}) + _source_files("triton_kernels", {".py"})
              + _source_files("selective_ckpt", {".py"}))
    assert len(_source_files("csrc", {".cpp", ".h"})) >= 10 and len(_source_files("triton_kernels", {".py"})) >= 5
    missing = [n for n in wanted if n not in names]
    assert not missing, missing
    assert not [n for n in names if n.endswith((".so", ".o", ".pyc"))], "build outputs in the sdist"


def test_wheel_holds_every_subpackage_and_the_extension(dist):
    _, wheel = dist
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        meta = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    expected = [f"selective_ckpt/{p.relative_to(ROOT / 'selective_ckpt').as_posix()}"
                for p in map(ROOT.joinpath, _source_files("selective_ckpt", {".py"}))]
    expected += [f"selective_ckpt/{p.relative_to(ROOT).as_posix()}"
                 for p in map(ROOT.joinpath, _source_files("triton_kernels", {".py"}))]
    for sub in ("ops", "models", "memory", "bench", "triton_kernels"):
        assert f"selective_ckpt/{sub}/__init__.py" in expected
    expected += [f"selective_ckpt/{p.relative_to(ROOT / 'selective_ckpt').as_posix()}"
                 for p in sorted((ROOT / "selective_ckpt" / "fit" / "bundled").glob("*.json"))]
    missing = [n for n in expected if n not in names]
    assert not missing, missing
    assert any(re.fullmatch(r"selective_ckpt/_C\..*\.so", n) for n in names), sorted(names)
    assert not any(n.startswith(("triton_kernels/", "tests/", "csrc/", "bench/")) for n in names)
    requires = [line for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    base = [r for r in requires if "extra ==" not in r]
    assert sorted(re.split(r"[<>=;\s]", r.split(":", 1)[1].strip())[0] for r in base) == ["numpy", "torch"], base
    extras = {line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Provides-Extra:")}
    assert {"triton", "hf", "bench", "test"} <= extras
    for name in ("transformers", "peft", "accelerate", "bitsandbytes"):
        assert any(r.startswith(f"Requires-Dist: {name}") and 'extra == "hf"' in r for r in requires), name


def test_installed_wheel_imports_and_runs_each_op_family_without_triton(fresh_venv, tmp_path):
    python, base = fresh_venv
    proc = subprocess.run([str(python), str(ROOT / "tests" / "wheel_smoke.py"), str(ROOT)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600, env=_clean_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("smoke ok"), proc.stdout
    package = Path(re.search(r"^package (.+)$", proc.stdout, re.M).group(1))
    assert package.is_relative_to(base.resolve()) and package.parent.name == "site-packages", package


def test_installed_wheel_runs_an_example_outside_the_checkout(fresh_venv, tmp_path):
    python, _ = fresh_venv
    cmd = [str(python), str(ROOT / "examples" / "train_tiny_gpt.py"), "--steps", "3", "--batch", "2", "--seq", "16",
           "--hidden", "32", "--heads", "2", "--layers", "1"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=_clean_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "saved for backward" in proc.stdout and "recompute='selective'" in proc.stdout


def test_installed_wheel_runs_the_main_job_into_its_own_folder(fresh_venv, tmp_path):
    """`python -m selective_ckpt.bench --quick` from the installed wheel (two of its rows, one length, to
    stay short): it writes into a new folder under the current directory and says where."""
    python, _ = fresh_venv
    cmd = [str(python), "-m", "selective_ckpt.bench", "--quick", "--rows", "sdpa,selective", "--seq", "32",
           "--no-progress"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=_clean_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (folder,) = (tmp_path / "bench-runs").iterdir()
    assert folder.name.endswith("-quick") and proc.stdout.strip().splitlines()[-1].endswith(f" to {folder}")
    assert (folder / "results.csv").is_file() and (folder / "tradeoff.png").is_file()
    assert re.search(r"^32 +SelectiveDecoderLayer selective  ", proc.stdout, re.M), proc.stdout
