"""The loss head alone: transformers' head, the same under torch.compile, and linear_cross_entropy.

`python -m selective_ckpt.bench.loss_head [--vocab 32000 128256] [--tokens 2048 4096] [--hidden 256]
[--reps 5] [--dtype float32]` prints one row per (vocabulary, tokens, head): bytes kept after forward,
the step's peak (both from the allocator's events, per token per vocabulary entry and in MiB) and
forward+backward time; the three heads are timed interleaved (the order rotating every round) and
each round's ratio to transformers' head is reported as p20 / p50 / p80. transformers' head is what
a causal LM runs: `lm_head` (F.linear) then ForCausalLMLoss (upcast to float32, cross-entropy).
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from ..memory.peak import cpu_allocation_deltas, running_peak
from ..ops.cross_entropy import linear_cross_entropy
from .output import cpu_name

HEADS = ("transformers", "transformers+compile", "ours")


def transformers_head(hidden, weight, labels):
    from transformers.loss.loss_utils import ForCausalLMLoss

    logits = F.linear(hidden, weight)
    return ForCausalLMLoss(logits, None, weight.shape[0], shift_labels=labels)


def ours_head(hidden, weight, labels):
    return linear_cross_entropy(hidden, weight, labels)


def _heads():
    return {"transformers": transformers_head, "transformers+compile": torch.compile(transformers_head, dynamic=False),
            "ours": ours_head}


def _inputs(tokens, vocab, hidden_dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, hidden_dim, generator=g).to(dtype).requires_grad_(True)
    weight = (torch.randn(vocab, hidden_dim, generator=g) * hidden_dim**-0.5).to(dtype).requires_grad_(True)
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    labels[::7] = -100
    return hidden, weight, labels


def _step(fn, hidden, weight, labels):
    hidden.grad = weight.grad = None
    t0 = time.perf_counter()
    fn(hidden, weight, labels).backward()
    return time.perf_counter() - t0


def _memory(fn, hidden, weight, labels):
    """(bytes alive after forward, peak over forward + backward), allocator deltas, grads set to None."""
    hidden.grad = weight.grad = None
    held = []
    fwd = cpu_allocation_deltas(lambda: held.append(fn(hidden, weight, labels)))
    bwd = cpu_allocation_deltas(lambda: held.pop().backward())
    if fwd is None or bwd is None:
        return float("nan"), float("nan")
    return sum(fwd), max(running_peak(fwd), sum(fwd) + running_peak(bwd))


def measure(vocab, tokens, hidden_dim, dtype=torch.float32, reps=5):
    """One dict per head: kept and peak bytes, median time, and the p20/p50/p80 of its time ratio to
    transformers' head over interleaved rounds."""
    heads = _heads()
    hidden, weight, labels = _inputs(tokens, vocab, hidden_dim, dtype)
    rows = {}
    for name, fn in heads.items():
        _step(fn, hidden, weight, labels)  # warm-up (and compilation)
        kept, peak = _memory(fn, hidden, weight, labels)
        rows[name] = {"kept": kept, "peak": peak, "times": []}
    order = list(HEADS)
    for r in range(reps):
        for name in order[r % 3:] + order[:r % 3]:
            rows[name]["times"].append(_step(heads[name], hidden, weight, labels))
    base = rows["transformers"]["times"]
    for row in rows.values():
        ratios = sorted(t / b for t, b in zip(row["times"], base))
        q = statistics.quantiles(ratios, n=5, method="inclusive") if len(ratios) > 1 else ratios * 4
        row.update(time=statistics.median(row["times"]), p20=q[0], p50=statistics.median(ratios), p80=q[-1])
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, nargs="+", default=[32000, 128256])
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    print(f"CPU: {cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}, {args.dtype}, "
          f"h={args.hidden}, {args.reps} interleaved rounds")
    print("| V | N | head | kept B/(N*V) | kept MiB | peak MiB | fwd+bwd s | time / transformers p20-p50-p80 |")
    print("|---|---|---|---|---|---|---|---|")
    for vocab in args.vocab:
        for tokens in args.tokens:
            rows = measure(vocab, tokens, args.hidden, dtype, args.reps)
            for name, r in rows.items():
                print(f"| {vocab} | {tokens} | {name} | {r['kept'] / (tokens * vocab):.2f} | {r['kept'] / 2**20:.1f} | "
                      f"{r['peak'] / 2**20:.1f} | {r['time']:.3f} | {r['p20']:.2f}-{r['p50']:.2f}-{r['p80']:.2f} |",
                      flush=True)


if __name__ == "__main__":
    main()
