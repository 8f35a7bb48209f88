"""How results are judged (docs/DESIGN.md): against float64 eager PyTorch, relative to eager's own error."""

import torch


def max_err(x, ref):
    return (x.detach().double() - ref.detach().double()).abs().max().item() if x.numel() else 0.0


def assert_within_rule(ours, eager, ref64, factor, floor=1e-5, name="output"):
    """|ours - ref64| <= factor * |eager - ref64| + floor, in max norm.

    factor is 2 for outputs and 3 for gradients; eager is plain PyTorch in the same dtype as ours.
    """
    assert ours.shape == ref64.shape, f"{name}: shape {tuple(ours.shape)} != {tuple(ref64.shape)}"
    assert ours.dtype == eager.dtype, f"{name}: dtype {ours.dtype} != eager's {eager.dtype}"
    assert torch.isfinite(ours).all(), f"{name}: non-finite values"
    ours_err, eager_err = max_err(ours, ref64), max_err(eager, ref64)
    bound = factor * eager_err + floor
    assert ours_err <= bound, f"{name}: error {ours_err:.3e} > {factor} x eager's {eager_err:.3e} + {floor:.0e}"


def noisier(a, b, ref64):
    """Of two eager results, the one further from ref64 (max norm): the eager error a rule compares with,
    where eager PyTorch has two ways of computing the same thing whose 16-bit errors differ by luck."""
    return a if max_err(a, ref64) >= max_err(b, ref64) else b


def attention_allowed(B, Sq, Sk, causal=False, window=0, pad=None, cu=None, q_offset=0):
    """Bool [B, 1, Sq, Sk]: which keys each query may attend under the attention semantics of
    docs/kernels/attention.md (causal, sliding window, documents from cu_seqlens, key padding [B, Sk]).
    Query row i stands at key position i + q_offset (the bottom rows of a longer problem)."""
    i = torch.arange(Sq)[:, None] + q_offset
    j = torch.arange(Sk)[None, :]
    ok = torch.ones(Sq, Sk, dtype=torch.bool)
    if causal:
        ok &= j <= i
    if window:
        ok &= j > i - window
    if cu is not None:
        ends = torch.as_tensor(cu)[1:].long()
        qdoc = torch.bucketize(torch.arange(Sq) + q_offset, ends, right=True)
        kdoc = torch.bucketize(torch.arange(Sk), ends, right=True)
        ok &= qdoc[:, None] == kdoc[None, :]
    ok = ok.expand(B, 1, Sq, Sk)
    if pad is not None:
        ok = ok & pad[:, None, None, :]
    return ok
