"""python -m selective_ckpt.fit CONFIG --gpu 80GB [--batch 1] [--seq-len N|max] [--form full|lora|qlora] ...

Prints the projection of fit.fit (arithmetic.py) by part and variant; a bad argument is one line on stderr, exit 2."""

import argparse
import re
import sys

from .arithmetic import fit
from .configs import BUNDLED
from .forms import ALL_LINEAR, TrainingForm
from .report import report

_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30}


def parse_bytes(text):
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"--gpu: {text!r} is not a size (e.g. 80GB, 24GiB, 141e9)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def add_form_arguments(p):
    """The training form's options (also selective_ckpt.bench.fit_check's)."""
    p.add_argument("--form", choices=("full", "lora", "qlora"), default="full")
    p.add_argument("--weights", default="float32", help="dtype of the weights (float32, bfloat16, float16)")
    p.add_argument("--autocast", default=None, help="autocast dtype (bfloat16, float16), or none")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--targets", default=",".join(ALL_LINEAR), help="comma-separated LoRA target modules")
    p.add_argument("--lora-dropout", type=float, default=0.0, help="PEFT's lora_dropout (e.g. 0.05)")


def form_from_arguments(a):
    return TrainingForm(a.form, a.weights, None if a.autocast in (None, "none") else a.autocast, a.rank,
                        tuple(t for t in a.targets.split(",") if t), a.lora_dropout)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m selective_ckpt.fit", description="Will one training step fit?")
    p.add_argument("config", help=f"a config.json path or a bundled config: {', '.join(BUNDLED)}")
    p.add_argument("--gpu", required=True, help="GPU memory, e.g. 80GB")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq-len", default="max", help='tokens per sample, or "max"')
    add_form_arguments(p)
    a = p.parse_args(argv)
    try:
        seq_len = a.seq_len if a.seq_len == "max" else int(a.seq_len)
        print(report(fit(a.config, parse_bytes(a.gpu), a.batch, seq_len, form_from_arguments(a))))
    except (ValueError, TypeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
