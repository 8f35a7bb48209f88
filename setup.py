"""Builds selective_ckpt._C from csrc/ with ninja and pybind11; everything else is pyproject.toml.

`python setup.py inplace` builds it next to the sources without setuptools reading pyproject.toml:
for a machine whose setuptools predates the license field and cannot fetch a newer one.

The extension includes no torch headers, so it builds under ordinary build isolation and works
with any torch: Python passes data pointers, sizes and strides.
"""

import fcntl
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"


def _load_source_hash():
    spec = importlib.util.spec_from_file_location("_build_info", ROOT / "selective_ckpt" / "_build_info.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.source_hash


def _ninja_executable():
    found = shutil.which("ninja")
    if found:
        return found
    import ninja  # the PyPI package ships the binary

    return os.path.join(ninja.BIN_DIR, "ninja")


def packages():
    """Every package of the wheel, found on disk so that none can be missed: selective_ckpt and its
    subpackages, and triton_kernels/ (with any subpackages of its own) as selective_ckpt.triton_kernels.
    A link selective_ckpt/triton_kernels -> ../triton_kernels (bench/gpu.sh makes one) is the same package."""
    kernels = "selective_ckpt.triton_kernels"
    found = [p for p in find_packages(str(ROOT), include=["selective_ckpt", "selective_ckpt.*"])
             if p != kernels and not p.startswith(kernels + ".")]
    found += [kernels] + [f"{kernels}.{p}" for p in find_packages(str(ROOT / "triton_kernels"))]
    return found, {kernels: "triton_kernels"}  # subpackages follow their parent's directory


SOURCES = sorted(str(p.relative_to(ROOT)) for p in CSRC.glob("*.cpp"))


def build_c(sources, target: Path, build_dir: Path):
    """Compiles each source to an object with ninja (parallel, incremental), then links `target`."""
    import pybind11

    build_dir.mkdir(parents=True, exist_ok=True)
    target.parent.mkdir(parents=True, exist_ok=True)

    cxx = os.environ.get("CXX") or sysconfig.get_config_var("CXX").split()[0] or "c++"
    includes = [sysconfig.get_paths()["include"], pybind11.get_include(), str(CSRC)]
    cflags = ["-O3", "-std=c++17", "-fPIC", "-fopenmp", "-fvisibility=hidden", "-Wall"]
    # Only module.cpp sees the hash, so editing one kernel recompiles that kernel alone.
    hash_flag = f'-DSCKPT_SOURCE_HASH=\\"{_load_source_hash()(CSRC)}\\"'
    cflags += [f"-I{d}" for d in includes]
    ldflags = ["-shared", "-fopenmp"]
    # Link to a temporary name and rename: processes that loaded the old module keep it intact.
    staged = build_dir / (target.name + ".tmp")

    objects = []
    lines = [
        f"cxx = {cxx}",
        f"cflags = {' '.join(cflags)}",
        f"ldflags = {' '.join(ldflags)}",
        "rule cxx",
        "  command = $cxx -MMD -MF $out.d $cflags $extra -c $in -o $out",
        "  depfile = $out.d",
        "  deps = gcc",
        "rule link",
        "  command = $cxx $in -o $out $ldflags",
    ]
    for source in sources:
        src = (ROOT / source).resolve()
        obj = build_dir / (src.stem + ".o")
        objects.append(obj)
        lines.append(f"build {obj}: cxx {src}")
        if src.name == "module.cpp":
            lines.append(f"  extra = {hash_flag}")
    lines.append(f"build {staged}: link {' '.join(map(str, objects))}")
    (build_dir / "build.ninja").write_text("\n".join(lines) + "\n")

    cmd = [_ninja_executable(), "-C", str(build_dir)]
    print("building _C:", shlex.join(cmd))
    with open(build_dir / ".lock", "w") as lock:  # one build of this tree at a time
        fcntl.flock(lock, fcntl.LOCK_EX)
        subprocess.run(cmd, check=True)
        os.replace(shutil.copy2(staged, str(target) + ".new"), target)


class NinjaBuildExt(build_ext):
    def build_extension(self, ext):
        build_c(ext.sources, Path(self.get_ext_fullpath(ext.name)).resolve(), Path(self.build_temp).resolve() / "ninja")


if sys.argv[1:] == ["inplace"]:
    # selective_ckpt/_C next to the sources without setuptools' setup(), which reads pyproject.toml and
    # rejects its license field before setuptools 77 (an offline machine may have no newer one).
    build_c(
        SOURCES, ROOT / "selective_ckpt" / ("_C" + sysconfig.get_config_var("EXT_SUFFIX")), ROOT / "build" / "ninja"
    )
else:
    PACKAGES, PACKAGE_DIRS = packages()
    setup(
        packages=PACKAGES,
        package_dir=PACKAGE_DIRS,
        package_data={"selective_ckpt.fit": ["bundled/*.json"]},  # the fit tool's bundled configs
        ext_modules=[Extension("selective_ckpt._C", sources=SOURCES)],
        cmdclass={"build_ext": NinjaBuildExt},
    )
