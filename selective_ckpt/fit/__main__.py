"""python -m selective_ckpt.fit CONFIG --gpu 80GB [--batch 1] [--seq-len N|max] [--form full|lora|qlora] ...

Prints the projection of fit.fit (arithmetic.py) by part and variant, and last the recommendation with the calls
that apply it; a bad argument or a missing extra is one line on stderr (exit 2 and 1)."""

import argparse
import re
import sys

from .arithmetic import BudgetError, fit
from .configs import BUNDLED, HF_EXTRA, MissingExtra
from .forms import ALL_LINEAR, TrainingForm
from .report import report

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


def _card_key(text):
    return re.sub(r"[\s_-]", "", text.upper())


_CARDS = {_card_key(name): mib for name, mib in GPUS.items()}


def parse_bytes(text):
    """Bytes from a size (80GB = 80e9, 24GiB = 24 * 2**30, 141e9, "80 GB") or a card name of GPUS (its memory as
    nvidia-smi reports it). Raises ValueError naming --gpu."""
    if not isinstance(text, str):
        raise TypeError(f"--gpu must be a string such as '80GB', got {type(text).__name__}")
    card = _CARDS.get(_card_key(text))
    if card is not None:
        return card * 2 ** 20
    m = re.fullmatch(rf"\s*({_NUMBER})\s*([a-zA-Z]*)\s*", text, flags=re.IGNORECASE)
    if not m or m.group(2).lower() not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"--gpu: {text!r} is neither a size (80GB = 80e9 bytes, 24GiB, 141e9) nor a card "
                         f"({', '.join(GPUS)})")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


_TOKENS = {"": 1, "k": 2 ** 10, "m": 2 ** 20}


def parse_seq_len(text):
    """Tokens per sample: "max", a number, or a number of K (1024) or M (1024 * 1024) tokens (8k = 8192,
    128K = 131072). Raises ValueError naming --seq-len."""
    if isinstance(text, str) and text.strip().lower() == "max":
        return "max"
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kKmM]?)\s*", text) if isinstance(text, str) else None
    tokens = float(m.group(1)) * _TOKENS[m.group(2).lower()] if m else 0
    if not m or tokens < 1 or tokens != int(tokens):
        raise ValueError(f"--seq-len: {text!r} is not a number of tokens (8192, 8k = 8192, 128K = 131072) or max")
    return int(tokens)


class _Parser(argparse.ArgumentParser):
    """Errors in one line, naming the flag."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (--help lists the options)\n")


def _argument(parse):
    """An argparse type from a parser that raises ValueError: its message, without the flag it names (argparse
    puts it first)."""
    def convert(text):
        try:
            return parse(text)
        except (ValueError, TypeError) as err:
            raise argparse.ArgumentTypeError(str(err).split(": ", 1)[-1]) from None
    return convert


def add_form_arguments(p):
    """The training form's options (also selective_ckpt.bench.fit_check's)."""
    p.add_argument("--form", choices=("full", "lora", "qlora"), default="full",
                   help="what is trained: every weight by AdamW (full), LoRA adapters over a frozen base (lora), LoRA "
                        "over a 4-bit NF4 base (qlora) (default: %(default)s)")
    p.add_argument("--weights", default="float32",
                   help="dtype of the weights: float32, bfloat16, float16 (default: %(default)s)")
    p.add_argument("--autocast", default="none",
                   help="autocast dtype: bfloat16 or float16 (Trainer's bf16=True / fp16=True over float32 weights), "
                        "or none (default: %(default)s)")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank (default: %(default)s)")
    p.add_argument("--targets", default=",".join(ALL_LINEAR),
                   help="comma-separated LoRA target modules (default: every linear layer of a Llama-style model, "
                        + ", ".join(ALL_LINEAR) + ")")
    p.add_argument("--lora-dropout", type=float, default=0.0,
                   help="PEFT's lora_dropout, e.g. 0.05 (default: %(default)s)")


def form_from_arguments(a):
    return TrainingForm(a.form, a.weights, None if a.autocast in (None, "none") else a.autocast, a.rank,
                        tuple(t for t in a.targets.split(",") if t), a.lora_dropout)


_FLAGS = {"gpu_bytes": "--gpu", "batch": "--batch", "seq_len": "--seq-len", "kind": "--form", "weights": "--weights",
          "autocast": "--autocast", "rank": "--rank", "targets": "--targets", "lora_dropout": "--lora-dropout",
          "config": "CONFIG"}


def _flag_named(message):
    """A message that opens with a parameter's name, opened with the flag's instead."""
    m = re.match(r"(\w+)(:| must)", message)
    if m and m.group(1) in _FLAGS:
        return _FLAGS[m.group(1)] + message[len(m.group(1)):]
    return message


_WAY_OUT = {"full": "try --form lora or --form qlora", "lora": "try --form qlora",
            "qlora": "try a GPU with more memory"}


def _budget_message(err, a):
    return (f"--gpu {a.gpu[0]} ({err.gpu_bytes / 2 ** 30:.1f} GiB) holds less than the weights and optimizer state "
            f"alone ({err.fixed / 2 ** 30:.1f} GiB) for --form {a.form}: {_WAY_OUT[a.form]}")


def _merge_gpu_unit(argv):
    """`--gpu 80 GB` as `--gpu 80GB`: a size and its unit given as two words."""
    out = list(argv)
    for i in range(len(out) - 2):
        if out[i] == "--gpu" and re.fullmatch(_NUMBER, out[i + 1], flags=re.IGNORECASE) and \
                out[i + 2].lower() in _UNITS and out[i + 2]:
            return out[:i + 1] + [out[i + 1] + out[i + 2]] + out[i + 3:]
    return out


_DESCRIPTION = """\
Will one training step fit? Projects the peak memory of a step (forward, backward, AdamW) for
transformers' model as it trains by default and with its activation checkpointing, and converted
by selective_ckpt in each recompute mode and with a per-layer plan; the longest context each fits;
and last the calls that apply the recommendation."""

_EPILOG = f"""\
--gpu takes a size or a card name: 80GB is 80e9 bytes, 24GiB is 24 * 2**30 bytes, and a card
name is the memory that card reports (nvidia-smi's total):
  {", ".join(GPUS)}.
--seq-len max reports at the longest context ours fits with every layer "selective"; either way
each variant's longest context is listed (the largest that fits, the next one not).
Needs transformers and peft: {HF_EXTRA}."""


def build_parser():
    p = _Parser(prog="python -m selective_ckpt.fit", formatter_class=argparse.RawDescriptionHelpFormatter,
                description=_DESCRIPTION, epilog=_EPILOG)
    p.add_argument("config", help=f"a config.json path or a bundled config: {', '.join(BUNDLED)}")
    p.add_argument("--gpu", required=True, type=_argument(lambda text: (text, parse_bytes(text))),
                   help="GPU memory: a size (80GB, 80 GB, 24GiB, 141e9) or a card name (H100, A100-40GB, ...)")
    p.add_argument("--batch", type=int, default=1, help="samples per step (default: %(default)s)")
    p.add_argument("--seq-len", default="max", type=_argument(parse_seq_len),
                   help="tokens per sample: a number (8192), K = 1024 tokens (8k, 128K), or max: the longest context "
                        "ours fits with every layer selective (default: %(default)s)")
    add_form_arguments(p)
    p.add_argument("--wide", action="store_true", help="one table on wide lines instead of lines of 100 columns")
    return p


def main(argv=None):
    p = build_parser()
    a = p.parse_args(_merge_gpu_unit(sys.argv[1:] if argv is None else argv))
    try:
        result = fit(a.config, a.gpu[1], a.batch, a.seq_len, form_from_arguments(a))
    except MissingExtra as err:
        print(f"{p.prog}: error: {err}", file=sys.stderr)
        return 1
    except BudgetError as err:
        print(f"{p.prog}: error: {_budget_message(err, a)}", file=sys.stderr)
        return 2
    except (ValueError, TypeError) as err:
        print(f"{p.prog}: error: {_flag_named(str(err))}", file=sys.stderr)
        return 2
    print(report(result, wide=a.wide))
    return 0


if __name__ == "__main__":
    # Nothing a simulated step runs needs bitsandbytes (QLoRA's 4-bit bases are simulate.Linear4bit stand-ins),
    # but peft imports it wherever it is installed, and on a CPU without its optional kernels package that
    # import prints a warning line. This process, which runs the command and exits, takes it as absent.
    sys.modules.setdefault("bitsandbytes", None)
    sys.exit(main())
