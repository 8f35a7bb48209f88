"""Where one training step of a SelectiveDecoderLayer spends its time, by op family (torch.profiler).

    python -m selective_ckpt.bench.profile_step                       # B=2, S=2048, h=512, a=8, fp32, causal, selective
    python -m selective_ckpt.bench.profile_step --seq 1024 --mode none --llama

Self CPU time of every op of one forward+backward (after warm-up steps), summed into families:
matmuls (mm/addmm/bmm), attention forward and backward (our custom ops), norms (LayerNorm/RMSNorm
ops), activations (GELU/SwiGLU ops), dropout, copies and casts, elementwise adds and the rest.
"""

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from selective_ckpt import SelectiveDecoderLayer

FAMILIES = [
    ("attention forward", ("selective_ckpt::attention_fwd",)),
    ("attention backward", ("selective_ckpt::attention_bwd",)),
    ("norms", ("selective_ckpt::layer_norm", "selective_ckpt::rms_norm")),
    ("activations", ("selective_ckpt::gelu", "selective_ckpt::gated")),
    ("dropout", ("selective_ckpt::dropout",)),
    ("matmuls", ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")),
    ("copies and casts", ("aten::copy_", "aten::to", "aten::_to_copy", "aten::contiguous", "aten::clone")),
    ("elementwise", ("aten::add", "aten::mul", "aten::sum", "aten::fill_", "aten::zero_")),
]


def family(name):
    # a custom op with autograd runs its kernel under the autograd node's name
    name = name.replace("GeneratedBackwardFor_selective_ckpt_", "selective_ckpt::")
    for fam, prefixes in FAMILIES:
        if name.startswith(prefixes):
            return fam
    return "other"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--mode", default="selective", choices=("none", "selective", "full"))
    ap.add_argument("--llama", action="store_true", help="RMSNorm, SwiGLU (3.5h), RoPE, GQA 4:1")
    ap.add_argument("--steps", type=int, default=3, help="profiled steps (after two warm-up steps)")
    args = ap.parse_args()

    torch.manual_seed(0)
    extra = dict(num_kv_heads=max(1, args.heads // 4), norm="rmsnorm", activation="swiglu",
                 ffn_dim=int(3.5 * args.hidden), rope_theta=1e4, bias=False) if args.llama else {}
    layer = SelectiveDecoderLayer(args.hidden, args.heads, recompute=args.mode, **extra)
    x = torch.randn(args.batch, args.seq, args.hidden, requires_grad=True)
    gy = torch.randn_like(x)

    def step():
        layer.zero_grad(set_to_none=True)
        layer(x).backward(gy)

    for _ in range(2):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            step()
    totals = {}
    for evt in prof.key_averages():
        fam = family(evt.key)
        totals[fam] = totals.get(fam, 0.0) + evt.self_cpu_time_total
    whole = sum(totals.values())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; B={args.batch} S={args.seq} h={args.hidden} "
          f"a={args.heads} {'llama' if args.llama else 'gpt'} recompute={args.mode}, {args.steps} steps")
    print(f"{'family':<20} {'ms/step':>9} {'share':>7}")
    for fam, us in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"{fam:<20} {us / 1e3 / args.steps:>9.1f} {us / whole:>7.1%}")
    print(f"{'total (self CPU)':<20} {whole / 1e3 / args.steps:>9.1f}")


if __name__ == "__main__":
    main()
