"""GPU cards by name and sizes as users write them: what --gpu and --host (and selective_ckpt.plan's gpu= and
host=) take."""

import os
import re

_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2 ** 10, "mib": 2 ** 20,
          "gib": 2 ** 30, "tib": 2 ** 40}
_NUMBER = r"[0-9]+(?:\.[0-9]*)?(?:e[0-9]+)?"

# What each card reports as its memory: nvidia-smi's memory.total, in MiB (the published figures of each card's
# nvidia-smi output). A bare size such as 80GB is 80e9 bytes; a card name is the card's memory.
GPUS = {
    "H100": 81559, "H100-80GB": 81559,
    "H200": 143771,
    "A100-80GB": 81920,
    "A100-40GB": 40960,
    "RTX-4090": 24564,
    "L4": 23034,
    "A10G": 23028,
    "L40S": 46068,
}


def is_card(text):
    """Whether `text` names a card of GPUS."""
    return isinstance(text, str) and _card_key(text) in _CARDS


def _card_key(text):
    return re.sub(r"[\s_-]", "", text.upper())


_CARDS = {_card_key(name): mib for name, mib in GPUS.items()}


def parse_bytes(text, flag="--gpu"):
    """Bytes from a size (80GB = 80e9, 24GiB = 24 * 2**30, 141e9, "80 GB") or, for --gpu, a card name of GPUS (its
    memory as nvidia-smi reports it). Raises ValueError naming the flag."""
    if not isinstance(text, str):
        raise TypeError(f"{flag} must be a string such as '80GB', got {type(text).__name__}")
    card = _CARDS.get(_card_key(text)) if flag == "--gpu" else None
    if card is not None:
        return card * 2 ** 20
    m = re.fullmatch(rf"\s*({_NUMBER})\s*([a-zA-Z]*)\s*", text, flags=re.IGNORECASE)
    if not m or m.group(2).lower() not in _UNITS or float(m.group(1)) <= 0:
        if flag != "--gpu":
            raise ValueError(f"{flag}: {text!r} is not a size (256GB = 256e9 bytes, 128GiB)")
        raise ValueError(f"--gpu: {text!r} is neither a size (80GB = 80e9 bytes, 24GiB, 141e9) nor a card "
                         f"({', '.join(GPUS)})")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def default_host_bytes():
    """Half of this machine's memory: what --host defaults to."""


    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (ValueError, OSError, AttributeError):
        return None
