"""Loads the compiled CPU kernels and refuses a missing or stale build with a fix that works."""

from pathlib import Path

from ._build_info import source_hash

_REBUILD = "rebuild it from the repository root with `pip install -e .`"


def load():
    try:
        from . import _C
    except ImportError as err:
        raise ImportError(
            f"selective_ckpt._C (the C++ kernels) is not built or cannot load ({err}); {_REBUILD}"
        ) from err
    csrc = Path(__file__).resolve().parent.parent / "csrc"
    if csrc.is_dir():  # an editable checkout: the sources can have moved on since the build
        expected = source_hash(csrc)
        if getattr(_C, "SOURCE_HASH", None) != expected:
            raise ImportError(
                f"selective_ckpt._C is stale: built from sources {getattr(_C, 'SOURCE_HASH', '?')}, "
                f"csrc/ is now {expected}; {_REBUILD}"
            )
    return _C
