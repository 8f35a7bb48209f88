"""Edges of autograd, compile and the kernels' math: each case here once gave a silently wrong
result or an error that did not say what to do."""

import math

import pytest
import torch
import torch.nn.functional as F

import selective_ckpt as sc
from selective_ckpt import norm_fusion
from selective_ckpt.layers import SelectiveDecoderLayer
from selective_ckpt.ops.gelu_mlp import gelu_backward_op, gelu_op

DOUBLE_BACKWARD = "does not support double backward"


# --- double backward: right (float64 gradgradcheck) or refused naming the op -----------------------

def _penalty(fn, inputs):
    """grad(|d out / d inputs[0]|^2, inputs): a gradient penalty, i.e. a second derivative."""
    out = fn(*inputs)
    (g,) = torch.autograd.grad(out.sum(), inputs[0], create_graph=True)
    return torch.autograd.grad(g.pow(2).sum(), inputs, allow_unused=True)


def _leaf(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype).requires_grad_(True)


def test_gelu_mlp_double_backward_is_refused_not_wrong():
    x, w1, w2 = _leaf(3, 8), _leaf(6, 8), _leaf(8, 6)
    with pytest.raises(RuntimeError, match=f"selective_ckpt.gelu_mlp {DOUBLE_BACKWARD}"):
        _penalty(lambda x, w1, w2: sc.gelu_mlp(x, w1, None, w2, None), (x, w1, w2))
    # first-order gradients under create_graph=True are still the right values
    y = sc.gelu_mlp(x, w1, None, w2, None)
    got = torch.autograd.grad(y.pow(2).sum(), (x, w1, w2), create_graph=True)
    xd, w1d, w2d = (t.detach().double().requires_grad_(True) for t in (x, w1, w2))
    want = torch.autograd.grad(F.linear(F.gelu(F.linear(xd, w1d)), w2d).pow(2).sum(), (xd, w1d, w2d))
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, atol=1e-4, rtol=1e-4)


def test_gelu_mlp_weight_only_double_backward_is_refused():
    x, w1, w2 = _leaf(2, 3, 8), _leaf(16, 8), _leaf(8, 16)
    # the penalty on a weight only (x not requiring grad) is refused as well
    y = sc.gelu_mlp(x.detach(), w1, None, w2, None)
    (g,) = torch.autograd.grad(y.sum(), w1, create_graph=True)
    with pytest.raises(RuntimeError, match=DOUBLE_BACKWARD):
        torch.autograd.grad(g.pow(2).sum(), w2)


def test_converted_models_gelu_node_double_backward_is_refused_not_wrong():
    """The GELU activation a converted model's MLP runs (models/patches.gelu, its output rebuilt in backward) refuses
    a second derivative by name, as its siblings do, and its first-order gradient under create_graph is right."""
    from selective_ckpt.models.patches import gelu

    h = _leaf(3, 7, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=f"selective_ckpt.models.patches.gelu {DOUBLE_BACKWARD}"):
        _penalty(lambda h: gelu(h, "tanh"), (h,))
    (got,) = torch.autograd.grad(gelu(h, "tanh").pow(2).sum(), h, create_graph=True)
    (want,) = torch.autograd.grad(F.gelu(h, approximate="tanh").pow(2).sum(), h)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("op", ["layer_norm", "attention", "norm_linear", "norm_mlp", "layer"])
def test_double_backward_refused_naming_the_op(op, backend):
    torch.manual_seed(0)
    lw, lb = _leaf(8), _leaf(8)
    w1, w2 = _leaf(12, 8), _leaf(8, 12)
    cases = {
        "layer_norm": ("selective_ckpt.layer_norm", lambda x: sc.layer_norm(x, lw, lb), _leaf(3, 8)),
        "attention": ("selective_ckpt.attention", lambda q: sc.attention(q, q, q, causal=True), _leaf(1, 2, 5, 4)),
        "norm_linear": ("selective_ckpt.norm_fusion.norm_linear",
                        lambda x: norm_fusion.norm_linear(x, lw, lb, [(w1, None)]), _leaf(3, 8)),
        "norm_mlp": ("selective_ckpt.norm_fusion.norm_mlp",
                     lambda x: norm_fusion.norm_mlp(x, lw, lb, (w1, None, w2, None)), _leaf(3, 8)),
        "layer": (DOUBLE_BACKWARD, SelectiveDecoderLayer(8, 2), _leaf(2, 3, 8)),
    }
    name, fn, x = cases[op]
    with pytest.raises(RuntimeError, match=name):
        _penalty(fn, (x,))


def test_dropout_double_backward_is_right(backend):
    # dropout is linear and its backward is the op itself, so the second derivative is exact
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    seed = sc.rng.seed_arg(1234)
    assert torch.autograd.gradgradcheck(lambda t: sc.dropout(t, 0.3, seed=seed) * t, (x,))


@pytest.mark.parametrize("mode", ["selective", "none", "full"])
def test_layer_double_backward_refused_in_every_mode(mode):
    layer = SelectiveDecoderLayer(8, 2, recompute=mode)
    with pytest.raises(RuntimeError, match=DOUBLE_BACKWARD):
        _penalty(layer, (_leaf(2, 3, 8),))


# --- GELU tails: both forms, both backends, against eager F.gelu ----------------------------------

TAILS = [-math.inf, -1e15, -1e10, -1e3, 1e3, 1e10, 1e15, math.inf, math.nan]


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gelu_tails_match_eager(approximate, dtype, backend):
    x = torch.tensor(TAILS, dtype=dtype)  # fp16 turns +-1e10 and +-1e15 into +-inf
    xe = x.clone().requires_grad_(True)
    ye = F.gelu(xe, approximate=approximate)
    ye.backward(torch.ones_like(ye))
    with _interpreter_ieee_steps():
        a = gelu_op(x, approximate)
        g = torch.ones_like(x)
        gelu_backward_op(g, x, approximate)
    want_a = ye.detach().clone()
    if approximate == "none":
        # eager's erf GELU gives NaN at +inf; its limit (+inf, what the tanh form gives) is kept
        want_a[x == math.inf] = math.inf
    torch.testing.assert_close(a, want_a, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(g, xe.grad, atol=0, rtol=0, equal_nan=True)


def _interpreter_ieee_steps():
    """numpy's reports of the inf and NaN steps these inputs take on purpose (the Triton interpreter computes with
    numpy): silenced around the kernel calls only."""
    import numpy as np

    return np.errstate(invalid="ignore", over="ignore")


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_tanh_gradient_decays_for_large_negative_inputs(approximate, backend):
    # between the moderate range and the tails: gelu'(h) vanishes monotonically, never a huge value
    h = -torch.logspace(0.5, 37, 400)
    g = torch.ones_like(h)
    with _interpreter_ieee_steps():
        gelu_backward_op(g, h, approximate)
    ref = torch.func.grad(lambda t: F.gelu(t, approximate=approximate).sum())(h.double())
    assert ((g.double() - ref).abs() <= 1e-6).all()
    assert (g[h < -30] == 0).all()


# --- torch.compile(fullgraph=True, dynamic=True): dropout rates never meet math.isnan ------------

def _compiles_once(fn, make_inputs, lengths=(5, 9)):
    """Runs the compiled fn on each length (forward and backward); returns the outputs and the number
    of graphs dynamo built."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fn, fullgraph=True, dynamic=True)
    outs = []
    for n in lengths:
        inputs = make_inputs(n)
        out = compiled(*inputs)
        out.float().sum().backward()
        outs.append((inputs, out))
    return outs, counters["stats"]["unique_graphs"]


def test_compile_dynamic_layer_two_lengths_one_graph():
    torch.manual_seed(0)
    layer = torch.nn.Sequential(SelectiveDecoderLayer(16, 2, dropout=0.1, attn_dropout=0.1),
                                SelectiveDecoderLayer(16, 2, dropout=0.1, norm="rmsnorm", activation="swiglu"))
    outs, graphs = _compiles_once(layer, lambda s: (torch.randn(2, s, 16, requires_grad=True),))
    assert graphs == 1
    assert [tuple(o.shape) for _, o in outs] == [(2, 5, 16), (2, 9, 16)]
    # without dropout the compiled layer is the eager one
    layer.eval()
    (((x,), y),), _ = _compiles_once(layer, lambda s: (torch.randn(1, s, 16),), lengths=(7,))
    torch.testing.assert_close(y, layer(x))


def test_compile_dynamic_public_functions_with_dropout():
    torch.manual_seed(0)
    w1, w2, lw = torch.randn(24, 16) * 0.2, torch.randn(16, 24) * 0.2, torch.ones(16)

    def fn(x):
        h = sc.layer_norm(x, lw)
        h = sc.dropout(h, 0.1)
        q = h.view(*h.shape[:2], 2, 8).transpose(1, 2)
        o = sc.attention(q, q, q, causal=True, dropout_p=0.1).transpose(1, 2).reshape(h.shape)
        return sc.gelu_mlp(o, w1, None, w2, None, dropout_p=0.1)

    outs, graphs = _compiles_once(fn, lambda s: (torch.randn(2, s, 16, requires_grad=True),))
    assert graphs == 1
    assert all(x.grad is not None and x.grad.shape == x.shape for (x,), _ in outs)


# --- "full" recompute: in-place changes and mode switches between forward and backward ------------

@pytest.mark.parametrize("mode", ["selective", "none", "full"])
def test_in_place_parameter_change_after_forward_is_an_error_in_every_mode(mode):
    torch.manual_seed(0)
    layer = SelectiveDecoderLayer(16, 2, recompute=mode)
    y = layer(torch.randn(2, 5, 16, requires_grad=True))
    with torch.no_grad():
        layer.fc1.weight.mul_(2)
    match = "fc1.weight" if mode == "full" else "modified by an inplace operation"
    with pytest.raises(RuntimeError, match=match):
        y.sum().backward()


def test_full_mode_in_place_input_change_is_an_error():
    layer = SelectiveDecoderLayer(16, 2, recompute="full")
    x = torch.randn(2, 5, 16)
    w = layer.qkv.weight
    y = layer(x)
    x.add_(1)
    with pytest.raises(RuntimeError, match="x of SelectiveDecoderLayer .* modified|modified by an inplace"):
        torch.autograd.grad(y.sum(), w)


def test_full_mode_recomputes_in_the_forwards_train_mode():
    torch.manual_seed(0)
    layer = SelectiveDecoderLayer(16, 2, dropout=0.2, attn_dropout=0.2, recompute="full")
    x = torch.randn(2, 5, 16, requires_grad=True)
    params = [x, *layer.parameters()]

    def grads(mode, switch):
        layer.recompute = mode
        torch.manual_seed(1)
        layer.train()
        y = layer(x)
        if switch:
            layer.eval()
        return y, torch.autograd.grad(y.pow(2).sum(), params)

    y_sel, g_sel = grads("selective", False)
    y_full, g_full = grads("full", True)
    assert torch.equal(y_sel, y_full)
    for a, b in zip(g_sel, g_full):
        assert torch.equal(a, b)


# --- errors that say what to do, and inputs eager PyTorch accepts ---------------------------------

def test_layer_meta_input_names_the_device():
    with pytest.raises(ValueError, match="device meta.*CPU and CUDA"):
        SelectiveDecoderLayer(8, 2)(torch.randn(1, 2, 8, device="meta"))


def test_layer_dtype_mismatch_names_both_dtypes_and_autocast():
    m = SelectiveDecoderLayer(8, 2)
    with pytest.raises(TypeError, match="x has dtype torch.float16 .* are torch.float32.*autocast"):
        m(torch.randn(1, 2, 8, dtype=torch.float16))


def test_gelu_mlp_zero_width_input_names_x():
    with pytest.raises(ValueError, match=r"x must have shape \[\.\.\., in\] with in >= 1"):
        sc.gelu_mlp(torch.randn(2, 0), torch.randn(4, 0), None, torch.randn(8, 4), None)


def test_attention_accepts_any_stride_on_a_size_one_head_dim(backend):
    torch.manual_seed(0)
    base = torch.randn(3, 1, 2, 7).requires_grad_(True)  # [B, D=1, H, S]
    q = base.permute(0, 2, 3, 1)  # [B, H, S, 1] with last-dim stride 14
    assert q.stride(-1) != 1
    o = sc.attention(q, q, q, causal=True)
    (g,) = torch.autograd.grad(o.pow(2).sum(), base)
    qd = base.detach().double().requires_grad_(True)
    qq = qd.permute(0, 2, 3, 1)
    want = F.scaled_dot_product_attention(qq, qq, qq, is_causal=True)
    torch.testing.assert_close(o.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g.double(), torch.autograd.grad(want.pow(2).sum(), qd)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["selective", "none", "full"])
def test_layer_empty_batch_gives_empty_output_and_zero_gradients(mode, backend):
    layer = SelectiveDecoderLayer(8, 2, dropout=0.1, attn_dropout=0.1, recompute=mode)
    x = torch.randn(0, 5, 8, requires_grad=True)
    y = layer(x)
    assert y.shape == (0, 5, 8)
    y.sum().backward()
    assert x.grad.shape == x.shape
    for name, p in layer.named_parameters():
        assert p.grad is not None and torch.equal(p.grad, torch.zeros_like(p)), name


def test_attention_empty_batch(backend):
    q = torch.randn(0, 2, 5, 4, requires_grad=True)
    o = sc.attention(q, q, q)
    assert o.shape == (0, 2, 5, 4)
    o.sum().backward()
    assert q.grad.shape == q.shape


def test_attention_output_allows_in_place_ops(backend):
    torch.manual_seed(0)
    q = torch.randn(2, 3, 5, 4, requires_grad=True)
    o = sc.attention(q, q, q, causal=True)
    o += 1  # was autograd's "view created inside a custom Function" error; eager outputs allow it
    o.mul_(2)
    qd = q.detach().double()
    want = (F.scaled_dot_product_attention(qd, qd, qd, is_causal=True) + 1) * 2
    torch.testing.assert_close(o.detach().double(), want, atol=1e-5, rtol=1e-5)
    # backward needs o itself (as eager's fused SDPA does): the standard saved-tensor version error
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        o.sum().backward()
    e = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    e += 1
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        e.sum().backward()


# --- dropout of NaN and inf: F.dropout's product semantics ------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dropout_keeps_nan_and_inf_non_finite_like_f_dropout(dtype, backend):
    p, rows, cols = 0.43, 16, 16
    seed = 987654321
    x = torch.full((rows, cols), math.nan, dtype=dtype)
    x[::2] = math.inf
    x[1::4] = -math.inf
    x[:, -3:] = 2.0
    x.requires_grad_(True)
    keep = sc.rng.elementwise_keep_mask(seed, rows, cols, p)
    m = keep.to(torch.float64) * sc.rng.keep_scale(p)
    want = (x.detach().double() * m).to(dtype)  # F.dropout's rule: x times a {0, scale} mask
    with _interpreter_ieee_steps():
        y = sc.dropout(x, p, seed=seed)
    assert 0 < int(keep.sum()) < rows * cols
    torch.testing.assert_close(y, want, equal_nan=True, atol=0, rtol=0)
    assert y[:, :-3].isnan().sum() == (~keep[:, :-3]).sum() + x[:, :-3].isnan().logical_and(keep[:, :-3]).sum()
    # gradients: a NaN upstream gradient stays NaN at dropped positions too
    g = torch.full_like(y, math.nan)
    with _interpreter_ieee_steps():
        (gx,) = torch.autograd.grad(y, x, g)
    assert gx.isnan().all()


def test_dropout_all_nan_input_gives_all_nan_as_f_dropout(backend):
    x = torch.full((256,), math.nan)
    assert F.dropout(x, 0.43).isnan().all()
    assert sc.dropout(x, 0.43, seed=3).isnan().all()
