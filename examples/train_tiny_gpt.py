"""Train a tiny GPT-2-shaped character model built from SelectiveDecoderLayers, on CPU.

The text is the repository's own README and package sources (falling back to Python's Zen), so
nothing is downloaded. Prints the loss, the bytes one forward keeps for backward (the saved-tensor
ledger) and the peak of live tensor memory over one training step.

Needs the package installed (`pip install .`, no extra).

    python examples/train_tiny_gpt.py                 # 200 steps, recompute="selective"
    python examples/train_tiny_gpt.py --compare       # none / selective / full from the same seeds
"""

import argparse
import codecs
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from selective_ckpt import SelectiveDecoderLayer, memory, set_recompute

ROOT = Path(__file__).resolve().parent.parent  # the text to train on; the package comes from the install


def load_text():
    parts = [p.read_text(errors="ignore") for p in [ROOT / "README.md", *sorted((ROOT / "selective_ckpt").glob("*.py"))]
             if p.is_file()]
    text = "\n".join(parts)
    if len(text) < 10_000:
        import this  # the Zen of Python ships rot13-encoded

        text += codecs.decode(this.s, "rot13") * 20
    return text


class TinyGPT(nn.Module):
    def __init__(self, vocab, hidden, heads, layers, seq, dropout, recompute):
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(seq, hidden)
        self.drop = nn.Dropout(dropout)
        self.layers = nn.ModuleList(SelectiveDecoderLayer(hidden, heads, dropout=dropout, attn_dropout=dropout,
                                                          activation="gelu_tanh", recompute=recompute)
                                    for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        for name, p in self.named_parameters():  # GPT-2's init: N(0, 0.02), residual projections scaled down
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "fc2.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, ids):
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.drop(self.wte(ids) + self.wpe(pos))
        for layer in self.layers:
            x = layer(x)
        return self.ln_f(x) @ self.wte.weight.t()  # tied output embedding


def batches(data, batch, seq, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        start = torch.randint(0, len(data) - seq - 1, (batch,), generator=g)
        chunk = torch.stack([data[s:s + seq + 1] for s in start.tolist()])
        yield chunk[:, :-1], chunk[:, 1:]


def train(args, data, vocab, recompute, log=True):
    torch.manual_seed(args.seed)  # same weights and same dropout seeds for every mode
    model = TinyGPT(vocab, args.hidden, args.heads, args.layers, args.seq, args.dropout, recompute)
    if args.every:
        set_recompute(model, recompute, every=args.every)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sample = next(batches(data, args.batch, args.seq, 1, args.seed + 1))[0]
    saved = memory.ledger(model, sample).total
    losses, peak, t0 = [], None, time.perf_counter()
    for step, (x, y) in enumerate(batches(data, args.batch, args.seq, args.steps, args.seed + 1)):
        tracker = memory.StorageTracker() if step == 0 else None
        if tracker is not None:
            tracker.__enter__()
        loss = F.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if tracker is not None:
            tracker.__exit__(None, None, None)
            peak = tracker.peak
        opt.step()
        losses.append(loss.item())
        if log and (step % 20 == 0 or step == args.steps - 1):
            print(f"  step {step:4d}  loss {loss.item():.4f}")
    seconds = time.perf_counter() - t0
    return losses, saved, peak, seconds


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--recompute", default="selective", choices=["selective", "none", "full"])
    ap.add_argument("--every", type=int, default=None, help="full recompute on every k-th layer")
    ap.add_argument("--compare", action="store_true", help="train with none, selective and full; compare curves")
    args = ap.parse_args(argv)

    text = load_text()
    chars = sorted(set(text))
    lookup = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([lookup[c] for c in text], dtype=torch.long)
    print(f"text: {len(text)} characters, vocabulary {len(chars)}; model: {args.layers} layers, "
          f"hidden {args.hidden}, {args.heads} heads, batch {args.batch} x seq {args.seq}")

    modes = ["none", "selective", "full"] if args.compare else [args.recompute]
    results = {}
    for mode in modes:
        print(f"recompute={mode!r}")
        results[mode] = train(args, data, len(chars), mode)
        losses, saved, peak, seconds = results[mode]
        print(f"  saved for backward {memory.format_bytes(saved)}, peak live tensors in a step "
              f"{memory.format_bytes(peak)}, {seconds:.1f} s ({1000 * seconds / args.steps:.1f} ms/step)")
    if args.compare:
        print("\nmode        saved       peak   final loss   ms/step")
        for mode, (losses, saved, peak, seconds) in results.items():
            print(f"{mode:10s} {memory.format_bytes(saved):>8s} {memory.format_bytes(peak):>10s} "
                  f"{losses[-1]:12.6f} {1000 * seconds / args.steps:9.1f}")
        curves = [r[0] for r in results.values()]
        identical = all(c == curves[0] for c in curves)
        print(f"loss curves identical across modes: {identical}")
        return 0 if identical else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
