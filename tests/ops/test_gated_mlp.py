"""The gated MLP (SwiGLU / GeGLU) and its product kernels against float64 eager PyTorch: the 2x / 3x
rule of tests/reference.py with the contract's dropout mask (rng), store vs recompute, what autograd
keeps, SiLU tails, opcheck, validation. Triton runs interpreted on small shapes.
"""

import pytest
import torch
import torch.nn.functional as F

from selective_ckpt import rng, swiglu_mlp
from selective_ckpt.ops.gated_mlp import (
    gated_product,
    gated_product_backward_op,
    gated_product_op,
    gated_product_rebuild_op,
)
from tests.reference import assert_within_rule

NAMES = ("x", "w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down")
ACT = {"silu": F.silu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "gelu": F.gelu}


def make_inputs(lead, d_in, ffn, d_out, dtype, bias=True, seed=0):
    """Leaves in float64 and in dtype holding the same values, with nn.Linear-like scales."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"x": (*lead, d_in), "w_gate": (ffn, d_in), "w_up": (ffn, d_in), "w_down": (d_out, ffn),
              "b_gate": (ffn,), "b_up": (ffn,), "b_down": (d_out,)}
    fan = {"w_gate": d_in, "w_up": d_in, "w_down": ffn}
    ref = {}
    for name in NAMES:
        if name.startswith("b_") and not bias:
            ref[name] = None
            continue
        v = torch.randn(shapes[name], generator=g, dtype=torch.float64) / fan.get(name, 1) ** 0.5
        ref[name] = v.to(dtype).double()
    low = {k: None if v is None else v.to(dtype) for k, v in ref.items()}
    for group in (ref, low):
        for v in group.values():
            if v is not None:
                v.requires_grad_(True)
    return ref, low


def eager_mlp(t, p, activation, seed):
    """Hugging Face LlamaMLP's arithmetic, then dropout with the contract's mask."""
    z = F.linear(ACT[activation](F.linear(t["x"], t["w_gate"], t["b_gate"])) * F.linear(t["x"], t["w_up"], t["b_up"]),
                 t["w_down"], t["b_down"])
    if p == 0:
        return z
    keep = rng.elementwise_keep_mask(seed, z.numel() // z.shape[-1], z.shape[-1], p).reshape(z.shape)
    return torch.where(keep, z * rng.keep_scale(p), 0.0)


def ours(t, p, activation, seed, **kw):
    return swiglu_mlp(t["x"], t["w_gate"], t["w_up"], t["w_down"], t["b_gate"], t["b_up"], t["b_down"], p,
                      activation, seed, **kw)


def grads(y, t, dy):
    leaves = [n for n in NAMES if t[n] is not None]
    return dict(zip(leaves, torch.autograd.grad(y, [t[n] for n in leaves], dy)))


def check(lead, d_in, ffn, d_out, dtype, activation, p, bias=True, seed=7, sum_grad=False):
    ref, low = make_inputs(lead, d_in, ffn, d_out, dtype, bias)
    eager_in = {k: None if v is None else v.detach().clone().requires_grad_(True) for k, v in low.items()}
    y, y_eager, y_ref = ours(low, p, activation, seed), eager_mlp(eager_in, p, activation, seed), \
        eager_mlp(ref, p, activation, seed)
    assert y.dtype == dtype and y.shape == (*lead, d_out)
    assert_within_rule(y, y_eager, y_ref, 2, name="y")
    if sum_grad:
        dy64, dy = (torch.ones((), dtype=d).expand(*lead, d_out) for d in (torch.float64, dtype))
    else:
        g = torch.Generator().manual_seed(seed + 1)
        dy64 = torch.randn(*lead, d_out, generator=g, dtype=torch.float64).to(dtype).double()
        dy = dy64.to(dtype)
    got, want_eager, want_ref = grads(y, low, dy), grads(y_eager, eager_in, dy), grads(y_ref, ref, dy64)
    for name in got:
        # Floor: one ulp at the gradient's scale. A weight gradient of a 1-wide layer is a single
        # rounded sum, where eager's rounding may land nearer by luck.
        ulp = torch.finfo(dtype).eps * want_ref[name].abs().max().item()
        assert_within_rule(got[name], want_eager[name], want_ref[name], 3, floor=max(1e-5, ulp), name=f"d{name}")
    if dtype == torch.float32:
        torch.testing.assert_close(y.double(), y_ref, atol=1e-5, rtol=1e-5)
        for name in got:
            torch.testing.assert_close(got[name].double(), want_ref[name], atol=2e-5, rtol=1e-5)


CASES = [
    # lead, in, ffn, out, bias
    ((7,), 1, 1, 1, True),
    ((2, 5), 17, 341, 17, True),
    ((3, 4), 341, 17, 9, False),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "gelu"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}-{c[2]}-{c[3]}{'' if c[4] else '-nobias'}")
def test_cpp_matches_float64_reference(case, activation, dtype, use_backend):
    use_backend("cpp")
    lead, d_in, ffn, d_out, bias = case
    check(lead, d_in, ffn, d_out, dtype, activation, 0.0 if d_in == 1 else 0.17, bias=bias)


@pytest.mark.parametrize("case", [((5,), 4231, 17, 7, "silu", torch.bfloat16),
                                  ((2, 3), 17, 4231, 9, "gelu_tanh", torch.float32)])
def test_cpp_large_inner_sizes(case, use_backend):
    use_backend("cpp")
    lead, d_in, ffn, d_out, activation, dtype = case
    check(lead, d_in, ffn, d_out, dtype, activation, 0.17, sum_grad=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "gelu"])
def test_triton_matches_float64_reference(activation, dtype, use_backend):
    use_backend("triton")
    check((2, 3), 17, 33, 5, dtype, activation, 0.17, bias=False)
    check((3,), 9, 17, 7, dtype, activation, 0.0, sum_grad=True)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "gelu"])
def test_store_and_recompute_are_bit_identical(backend, activation):
    _, low = make_inputs((3, 5), 17, 23, 11, torch.bfloat16)
    dy = torch.randn(3, 5, 11).to(torch.bfloat16)
    out = []
    for store in (False, True):
        y = ours(low, 0.17, activation, 123, store_product=store)
        out.append((y, grads(y, low, dy)))
    assert torch.equal(out[0][0], out[1][0])
    for name in out[0][1]:
        assert torch.equal(out[0][1][name], out[1][1][name]), name


def test_keeps_x_gate_up_and_seed_only():
    _, low = make_inputs((4, 6), 8, 20, 8, torch.float32, bias=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        ours(low, 0.1, "silu", 5)
    params = {id(low[n]) for n in NAMES[1:]}
    acts = sorted(tuple(t.shape) for t in saved if id(t) not in params)
    assert acts == sorted([(2,), (4, 6, 8), (4, 6, 20), (4, 6, 20)])  # seed, x, gate, up


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "gelu"])
def test_product_kernels_match_eager_and_tails(backend, activation):
    g = torch.cat([torch.tensor([-1e4, -200.0, -100.0, -88.8, -88.0, -50.0, 50.0, 100.0, 1e4]),
                   torch.linspace(-12, 12, 191)]).to(torch.float64)
    u = torch.linspace(-2, 2, g.numel(), dtype=torch.float64)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        gd, ud = g.to(dtype), u.to(dtype)
        ref_g = gd.double().requires_grad_(True)
        ref = ACT[activation](ref_g) * ud.double()
        ref.backward(torch.ones_like(ref))
        a = gated_product_op(gd, ud, activation)
        torch.testing.assert_close(a.double(), ref.detach(), atol=2e-2 if dtype != torch.float32 else 1e-5,
                                   rtol=1e-2 if dtype != torch.float32 else 1e-5)
        grad = torch.ones_like(gd)
        dup = gated_product_backward_op(grad, gd, ud, activation)
        assert torch.isfinite(grad).all() and torch.isfinite(dup).all()
        if activation == "silu":
            very_negative = gd.double() < -89
            # eager's SiLU and its gradient are exactly 0 there (exp overflows, sigmoid = 0); ours too
            assert (grad[very_negative] == 0).all() and (dup[very_negative] == 0).all()
            assert (a[very_negative] == 0).all()
        torch.testing.assert_close(grad.double(), ref_g.grad, atol=2e-2 if dtype != torch.float32 else 1e-5,
                                   rtol=1e-2 if dtype != torch.float32 else 1e-5)


def test_gated_product_building_block_keeps_gate_and_up(backend):
    g64 = torch.randn(4, 37, dtype=torch.float64)
    u64 = torch.randn(4, 37, dtype=torch.float64)
    for activation in ("silu", "gelu_tanh", "gelu"):
        gate, up = (t.to(torch.bfloat16).requires_grad_(True) for t in (g64, u64))
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t, kept=saved: kept.append(t) or t,
                                                      lambda t: t):
            a = gated_product(gate, up, activation)
        assert len(saved) == 2 and saved[0] is gate and saved[1] is up
        dy = torch.randn(4, 37).to(torch.bfloat16)
        a.backward(dy)
        ge, ue = (t.detach().to(torch.bfloat16).requires_grad_(True) for t in (g64, u64))
        (ACT[activation](ge) * ue).backward(dy)
        gr, ur = (t.to(torch.bfloat16).double().requires_grad_(True) for t in (g64, u64))
        ref = ACT[activation](gr) * ur
        ref.backward(dy.double())
        assert_within_rule(a, ACT[activation](ge.detach()) * ue.detach(), ref, 2, name="a")
        assert_within_rule(gate.grad, ge.grad, gr.grad, 3, name="dgate")
        assert_within_rule(up.grad, ue.grad, ur.grad, 3, name="dup")


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "gelu"])
def test_opcheck(backend, activation):
    g, u = torch.randn(3, 17), torch.randn(3, 17)
    torch.library.opcheck(gated_product_op, (g, u, activation))
    torch.library.opcheck(gated_product_rebuild_op, (g, u, activation))
    torch.library.opcheck(gated_product_backward_op, (torch.randn(3, 17), g, u, activation))


@pytest.mark.parametrize("kwargs,err,match", [
    (dict(w_up=torch.ones(5, 4)), ValueError, "w_up must have w_gate's shape"),
    (dict(w_down=torch.ones(3, 7)), ValueError, "w_down must have shape"),
    (dict(b_gate=torch.ones(4)), ValueError, "b_gate must have shape"),
    (dict(activation="relu"), ValueError, "activation must be"),
    (dict(activation=1), TypeError, "activation must be a str"),
    (dict(dropout_p=1.0), ValueError, "dropout_p"),
    (dict(x=torch.ones(2, 4, dtype=torch.float64)), TypeError, "w_gate has dtype"),
])
def test_rejects_bad_arguments(kwargs, err, match):
    args = dict(x=torch.ones(2, 4), w_gate=torch.ones(6, 4), w_up=torch.ones(6, 4), w_down=torch.ones(3, 6)) | kwargs
    with pytest.raises(err, match=match):
        swiglu_mlp(**args)


def test_step_peak_is_below_eager():
    # forward + backward of the gated MLP alone: ours keeps gate and up (2 ffn per row) and rebuilds the
    # product; eager keeps act(gate) and the product as well and forms dL/da beside them.
    from selective_ckpt import memory

    _, low = make_inputs((64,), 48, 320, 48, torch.float32, bias=False)
    dy = torch.randn(64, 48)
    peaks = {}
    for name, fn in (("ours", lambda: ours(low, 0.0, "silu", 1)), ("eager", lambda: eager_mlp(low, 0.0, "silu", 1))):
        tracker = memory.StorageTracker()
        with tracker:
            y = fn()
            y.backward(dy)
            del y
        peaks[name] = tracker.peak
    assert peaks["ours"] < peaks["eager"], peaks


def test_double_backward_is_a_clear_error():
    _, low = make_inputs((3,), 8, 12, 8, torch.float32, bias=False)
    (gx,) = torch.autograd.grad(ours(low, 0.0, "silu", 1).pow(2).sum(), low["x"], create_graph=True)
    with pytest.raises(RuntimeError, match="selective_ckpt.swiglu_mlp does not support double backward"):
        gx.sum().backward()
