"""Checks every Hugging Face family test runs: the converted model against float64, unconverted in its dtype."""

import copy

import torch

from selective_ckpt import convert
from selective_ckpt.memory.peak import cpu_allocation_deltas
from tests.reference import assert_within_rule

VOCAB = 97


def triple(build):
    """(float64 reference, float32 unconverted on SDPA, float32 converted) with the same weights."""
    torch.manual_seed(0)
    ref = build().double().train()
    ref.config._attn_implementation = "eager"  # float64 eager: the reference
    plain = copy.deepcopy(ref).float()
    plain.config._attn_implementation = "sdpa"
    ours = convert(copy.deepcopy(plain))
    return ref, plain, ours


def batch(b=2, s=19, seed=1, pad_rows=True):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.long)
    if pad_rows and b > 1:
        mask[1, :4] = 0  # left padding
    return ids, mask


def _step(model, **inputs):
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    live = inputs["attention_mask"].bool() if inputs.get("attention_mask") is not None else None
    logits = out.logits if live is None else out.logits[live]
    (logits.double() * torch.linspace(-1, 1, logits.shape[-1], dtype=torch.float64)).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def assert_matches_reference(ref, plain, ours, **inputs):
    """Logits (real positions) and every parameter gradient within the 2x / 3x rule against float64."""
    r, rg = _step(ref, **inputs)
    p, pg = _step(plain, **inputs)
    o, og = _step(ours, **inputs)
    assert_within_rule(o, p, r, 2, name="logits")
    assert set(og) == set(pg) == set(rg), "the same parameters must receive gradients"
    for n in rg:
        assert_within_rule(og[n], pg[n], rg[n], 3, floor=1e-5, name=f"grad {n}")


def assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    assert [n for n, _ in a.named_modules()] == [n for n, _ in b.named_modules()]


def kept_bytes_per_layer(build_layers, inputs):
    """Bytes one decoder layer keeps alive after forward: a 2-layer model minus a 1-layer one."""
    net = []
    for n in (1, 2):
        model = build_layers(n)
        held = []
        deltas = cpu_allocation_deltas(lambda m=model, h=held: h.append(m(**inputs).logits))
        net.append(sum(deltas))
        del held
    return net[1] - net[0]


def greedy(model, ids, n=6):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                              pad_token_id=0)
