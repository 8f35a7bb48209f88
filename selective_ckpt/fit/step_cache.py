"""Simulated steps kept on disk, so a second fit of the same model and form simulates nothing.

A simulated step (simulate.Step) is a function of what built and ran it: the config (with the attention and experts
implementations set on it), the training form, the simulated kinds, the batch, the context, the layer count and
layer types, the selective_ckpt package's own source, the versions of torch, transformers and peft, and the
SELECTIVE_CKPT_* environment variables. An entry is stored under the SHA-256 of all of them, so anything that could
change a step makes a new key; nothing is ever read back under a key that was not written for exactly that run.

The directory is SELECTIVE_CKPT_FIT_CACHE when set ("off" keeps nothing), else $XDG_CACHE_HOME/selective_ckpt/fit
(~/.cache/selective_ckpt/fit). An entry is a small JSON file written whole (a temporary file renamed into place), so
processes may share the directory; one that cannot be read or written is simulated again, never an error.
"""

import functools
import hashlib
import json
import os
import tempfile
from pathlib import Path

from .. import compat
from . import simulate

CACHE_ENV = "SELECTIVE_CKPT_FIT_CACHE"
_OFF = ("off", "0", "false", "no", "none")
_FORMAT = 1  # bumped when an entry's layout changes


def directory():
    """Where entries are kept, or None when the cache is off."""
    value = os.environ.get(CACHE_ENV)
    if value is not None:
        value = value.strip()
        return None if not value or value.lower() in _OFF else Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "selective_ckpt" / "fit"


@functools.cache
def _package_source():
    """SHA-256 of the package's Python source, file by file in name order: a changed line is a new key."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


@functools.cache
def _versions():
    """The installed versions of the libraries whose code runs in a simulated step, read from their metadata without
    importing them (None for one not installed: a full fine-tune needs no peft)."""
    from importlib import metadata

    found = []
    for name in ("torch", "transformers", "peft"):
        try:
            found.append(metadata.version(name))
        except metadata.PackageNotFoundError:
            found.append(None)
    return tuple(found)


def key(config, form, kinds, batch, seq_len, layers, layer_types):
    """The entry's name: the SHA-256 of everything a simulated step depends on (the module doc)."""
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith("SELECTIVE_CKPT_") and k != CACHE_ENV)
    parts = [_FORMAT, _package_source(), _versions(), config.to_json_string(use_diff=False),
             compat.requested_attention_implementation(config),
             compat.requested_experts_implementation(config) if compat.names_experts_implementation(config) else None,
             repr(form), [repr(k) for k in kinds], batch, seq_len, layers, layer_types, env]
    return hashlib.sha256(json.dumps(parts, default=repr).encode()).hexdigest()


def _step_to_json(step):
    phases = [[list(k) if isinstance(k, tuple) else k, *v] for k, v in step.phases.items()]
    return {"weights": step.weights, "state": step.state, "grads": step.grads, "phases": phases,
            "forward_end": step.forward_end}


def _step_from_json(d):
    phases = {(tuple(k) if isinstance(k, list) else k): (start, most) for k, start, most in d["phases"]}
    return simulate.Step(d["weights"], d["state"], d["grads"], phases, d["forward_end"])


def load(name, kinds):
    """({kind: Step} in the order of `kinds`, {mode: class bytes}) stored under `name`, or None."""
    where = directory()
    if where is None:
        return None
    try:
        entry = json.loads((where / f"{name}.json").read_text())
        steps = {k: _step_from_json(entry["steps"][i]) for i, k in enumerate(kinds)}
        return steps, entry["class_bytes"]
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None


def store(name, kinds, steps, class_bytes):
    """Writes the entry `name` (the steps of `kinds`, the class bytes learned with them); a failure keeps nothing."""
    where = directory()
    if where is None:
        return
    text = json.dumps({"steps": [_step_to_json(steps[k]) for k in kinds], "class_bytes": class_bytes})
    tmp = None
    try:
        where.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=where, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, where / f"{name}.json")
    except OSError:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
