"""python -m selective_ckpt.fit CONFIG --gpu 80GB [--batch 1] [--seq-len N|max] [--form full|lora|qlora] ...

Prints the projection of fit.fit (arithmetic.py) by part and variant, and last the recommendation with the calls
that apply it; a bad argument or a missing extra is one line on stderr (exit 2 and 1)."""

import argparse
import re
import sys

from . import arithmetic
from .arithmetic import BudgetError
from .cards import _NUMBER, _UNITS, GPUS, default_host_bytes, is_card, parse_bytes
from .configs import BUNDLED, HF_EXTRA, MissingExtra
from .fitting import fit
from .forms import ALL_LINEAR, TrainingForm
from .rates import RATES, rates_for
from .report import frontier, report

__all__ = ["GPUS", "build_parser", "main", "parse_bytes", "parse_seq_len"]


def _rates_card(text):
    rates_for(text)  # a ValueError naming the cards when there is no table for it
    return text


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
--seq-len max reports at the longest context the plan fits (per layer: keep, offload to pinned
host memory or rebuild, within --gpu and --host); either way each variant's longest context is
listed (the largest that fits, the next one not).
--host is the pinned host memory offloading may use (default: half of this machine's memory).
--rates names the card whose rates predict step times (default: the --gpu card, else H200).
Simulated steps are kept for the next run of the same config and form in ~/.cache/selective_ckpt/fit
($XDG_CACHE_HOME; SELECTIVE_CKPT_FIT_CACHE=DIR puts them elsewhere, =off keeps none).
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
                        "the plan fits (default: %(default)s)")
    p.add_argument("--context-limit", default=None, type=_argument(parse_seq_len),
                   help="the longest context --seq-len max tries (8k, 1M; default: the config's "
                        "max_position_embeddings; RoPE scaling trains past it)")
    p.add_argument("--host", default=None, type=_argument(lambda text: (text, parse_bytes(text, "--host"))),
                   help="pinned host memory for offloaded activations: a size (256GB, 128GiB) (default: half of "
                        "this machine's memory)")
    p.add_argument("--rates", default=None, type=_argument(_rates_card),
                   help=f"the card whose rates predict step times: {', '.join(RATES)} (default: the --gpu card "
                        "if it is one, else H200)")
    add_form_arguments(p)
    p.add_argument("--frontier", default=None,
                   type=_argument(lambda text: [parse_seq_len(t) for t in text.split(",") if t.strip()]),
                   help="comma-separated contexts (8k,32k,128k): a table of each variant's tokens/s at each, "
                        "'-' where it does not fit, and the plan's peak, host memory and policies")
    p.add_argument("--wide", action="store_true", help="one table on wide lines instead of lines of 100 columns")
    return p


def _progress(line):
    print(f"fit: {line}", file=sys.stderr, flush=True)


def main(argv=None):
    p = build_parser()
    a = p.parse_args(_merge_gpu_unit(sys.argv[1:] if argv is None else argv))
    if sys.stderr.isatty():  # a terminal sees what the minute of simulation is spent on
        arithmetic.PROGRESS = _progress
    try:
        host = a.host[1] if a.host is not None else default_host_bytes()
        rates = a.rates or (a.gpu[0] if is_card(a.gpu[0]) else None)
        limit = a.context_limit if a.context_limit != "max" else None
        result = fit(a.config, a.gpu[1], a.batch, a.seq_len, form_from_arguments(a), host_bytes=host, rates=rates,
                     context_limit=limit)
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
    if a.frontier:
        if "max" in a.frontier:
            print(f"{p.prog}: error: --frontier takes numbers of tokens, not max", file=sys.stderr)
            return 2
        print()
        print(frontier(result, a.frontier))
    return 0


if __name__ == "__main__":
    # Nothing a simulated step runs needs bitsandbytes (QLoRA's 4-bit bases are simulate.Linear4bit stand-ins),
    # but peft imports it wherever it is installed, and on a CPU without its optional kernels package that
    # import prints a warning line. This process, which runs the command and exits, takes it as absent.
    sys.modules.setdefault("bitsandbytes", None)
    sys.exit(main())
