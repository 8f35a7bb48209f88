"""Fingerprint of the C++ sources, shared by setup.py (baked into _C) and the import check.

Kept free of imports beyond the standard library so setup.py can load it without torch.
"""

import hashlib
from pathlib import Path

SOURCE_SUFFIXES = (".cpp", ".h")


def source_hash(csrc_dir) -> str:
    """SHA-256 over the names and contents of the kernel sources, in sorted order."""
    digest = hashlib.sha256()
    for path in sorted(Path(csrc_dir).iterdir()):
        if path.suffix in SOURCE_SUFFIXES:
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]
