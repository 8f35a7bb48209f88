"""Dtype names and byte formatting shared by the memory tools and the benchmark report."""

import torch

_DTYPE_NAMES = {
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp64": torch.float64, "float64": torch.float64, "double": torch.float64,
}


def as_dtype(dtype, name="dtype") -> torch.dtype:
    """A floating torch.dtype from a dtype or a name such as 'bf16' / 'float32'."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPE_NAMES.values():
            raise TypeError(f"{name} must be float32, float16, bfloat16 or float64, got {dtype}")
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _DTYPE_NAMES:
        return _DTYPE_NAMES[dtype.lower()]
    raise TypeError(f"{name} must be a torch floating dtype or one of {sorted(_DTYPE_NAMES)}, got {dtype!r}")


def format_bytes(n) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def columns(head, rows, right=()):
    """Rows of strings as aligned text columns under `head` (column indices in `right` right-aligned)."""
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]

    def fmt(cells):
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return [fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]
