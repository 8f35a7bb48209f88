"""gelu_mlp against eager PyTorch: float64 reference with the contract's dropout mask (rng), the
2x / 3x rule of tests/reference.py, store vs recompute, what autograd keeps, validation, opcheck
and torch.compile. Big sizes run on the C++ path only; Triton runs interpreted on tiny shapes.
"""

import gc

import pytest
import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from selective_ckpt import gelu_mlp, rng
from selective_ckpt.ops.gelu_mlp import gelu_mlp_backward, gelu_mlp_forward, gelu_op, gelu_rebuild_op
from tests.reference import assert_within_rule

NAMES = ("x", "w1", "b1", "w2", "b2")


def make_inputs(lead, d_in, hidden, d_out, dtype, bias=True, seed=0):
    """Inputs in float64 and in dtype (leaf tensors requiring grad), with nn.Linear-like scales."""
    g = torch.Generator().manual_seed(seed)
    f64 = dict(dtype=torch.float64)
    ref = {
        "x": torch.randn(*lead, d_in, generator=g, **f64),
        "w1": torch.randn(hidden, d_in, generator=g, **f64) / d_in**0.5,
        "b1": torch.randn(hidden, generator=g, **f64) if bias else None,
        "w2": torch.randn(d_out, hidden, generator=g, **f64) / hidden**0.5,
        "b2": torch.randn(d_out, generator=g, **f64) if bias else None,
    }
    ref = {k: v.to(dtype).double() if v is not None else None for k, v in ref.items()}  # same values in both
    low = {k: v.to(dtype) if v is not None else None for k, v in ref.items()}
    for group in (ref, low):
        for v in group.values():
            if v is not None:
                v.requires_grad_(True)
    return ref, low


def eager_mlp(t, p, approximate, seed):
    """The plain eager computation, with the contract's mask: Linear, GELU, Linear, dropout."""
    z = F.linear(F.gelu(F.linear(t["x"], t["w1"], t["b1"]), approximate=approximate), t["w2"], t["b2"])
    if p == 0:
        return z
    rows = z.numel() // z.shape[-1]
    keep = rng.elementwise_keep_mask(seed, rows, z.shape[-1], p).reshape(z.shape)
    return torch.where(keep, z * rng.keep_scale(p), 0.0)


def ours(t, p, approximate, seed, **kw):
    return gelu_mlp(t["x"], t["w1"], t["b1"], t["w2"], t["b2"], p, approximate, seed, **kw)


def grads(y, t, dy):
    leaves = [t[n] for n in NAMES if t[n] is not None]
    got = torch.autograd.grad(y, leaves, dy)
    it = iter(got)
    return {n: next(it) for n in NAMES if t[n] is not None}


def check_against_reference(lead, d_in, hidden, d_out, dtype, approximate, p, bias=True, seed=7, dy_kind="randn",
                            input_seed=0):
    ref, low = make_inputs(lead, d_in, hidden, d_out, dtype, bias=bias, seed=input_seed)
    eager_in = {k: v.detach().clone().requires_grad_(True) if v is not None else None for k, v in low.items()}
    y = ours(low, p, approximate, seed)
    y_eager = eager_mlp(eager_in, p, approximate, seed)
    y_ref = eager_mlp(ref, p, approximate, seed)
    assert y.dtype == dtype and y.shape == (*lead, d_out)
    assert_within_rule(y, y_eager, y_ref, 2, name="y")
    if dtype == torch.float32:
        torch.testing.assert_close(y.double(), y_ref, atol=1e-5, rtol=1e-5)

    g = torch.Generator().manual_seed(seed + 1)
    if dy_kind == "sum":  # what .sum().backward() hands over: an expanded (stride-0) ones tensor
        dy64 = torch.ones((), dtype=torch.float64).expand(*lead, d_out)
        dy = torch.ones((), dtype=dtype).expand(*lead, d_out)
        assert dy.stride() == (0,) * dy.dim()
    else:
        dy64 = torch.randn(*lead, d_out, generator=g, dtype=torch.float64).to(dtype).double()
        dy = dy64.to(dtype)
    if dy_kind == "noncontiguous":
        dy = torch.empty(*lead, 2 * d_out, dtype=dtype)[..., ::2].copy_(dy)
        assert not dy.is_contiguous()
    got, want_eager, want_ref = grads(y, low, dy), grads(y_eager, eager_in, dy), grads(y_ref, ref, dy64)
    for name in got:
        assert_within_rule(got[name], want_eager[name], want_ref[name], 3, name=f"d{name}")
        if dtype == torch.float32:
            torch.testing.assert_close(got[name].double(), want_ref[name], atol=2e-5, rtol=1e-5)


CPP_CASES = [
    # lead, in, hidden, out, bias
    ((7,), 1, 1, 1, True),
    ((7,), 1, 17, 3, True),
    ((2, 5), 17, 341, 17, True),
    ((3, 4), 341, 17, 9, False),
    ((2, 3), 17, 33, 5, False),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("case", CPP_CASES, ids=lambda c: f"{c[0]}x{c[1]}-{c[2]}-{c[3]}{'' if c[4] else '-nobias'}")
def test_cpp_matches_float64_reference(case, approximate, dtype, use_backend):
    use_backend("cpp")
    lead, d_in, hidden, d_out, bias = case
    p = 0.0 if d_in == 1 and hidden == 1 else 0.17
    check_against_reference(lead, d_in, hidden, d_out, dtype, approximate, p, bias=bias)


@pytest.mark.parametrize("case", [((5,), 4231, 17, 7, "none", torch.bfloat16), ((2, 3), 17, 4231, 9, "tanh",
                                                                                    torch.float32)])
def test_cpp_large_inner_sizes(case, use_backend):
    use_backend("cpp")
    lead, d_in, hidden, d_out, approximate, dtype = case
    check_against_reference(lead, d_in, hidden, d_out, dtype, approximate, 0.17)


TRITON_CASES = [
    # lead, in, hidden, out, dtype, approximate, p, bias
    ((2, 5), 17, 33, 9, torch.float32, "none", 0.17, True),
    ((7,), 17, 20, 5, torch.bfloat16, "tanh", 0.17, False),
    ((3,), 1, 17, 3, torch.float16, "none", 0.0, True),
    ((2, 3), 9, 40, 6, torch.bfloat16, "none", 0.0, True),
]


@pytest.mark.parametrize("case", TRITON_CASES)
def test_triton_matches_float64_reference(case, use_backend):
    use_backend("triton")
    lead, d_in, hidden, d_out, dtype, approximate, p, bias = case
    check_against_reference(lead, d_in, hidden, d_out, dtype, approximate, p, bias=bias)


@pytest.mark.parametrize("dy_kind", ["sum", "noncontiguous"])
def test_odd_grad_layouts(dy_kind, backend):
    check_against_reference((2, 3), 17, 24, 11, torch.float32, "tanh", 0.17, dy_kind=dy_kind)


def test_sum_backward_matches_explicit_ones():
    ref, low = make_inputs((3, 4), 9, 16, 5, torch.float32)
    ours(low, 0.17, "none", 11).sum().backward()
    by_sum = {n: low[n].grad.clone() for n in NAMES}
    y = ours(low, 0.17, "none", 11)
    explicit = grads(y, low, torch.ones_like(y))
    for n in NAMES:
        assert torch.equal(by_sum[n], explicit[n]), n


def run_all(t, p, approximate, seed, dy, **kw):
    y = ours(t, p, approximate, seed, **kw)
    return y, grads(y, t, dy)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_and_recompute_bit_identical(dtype, backend):
    _, low = make_inputs((2, 5), 17, 40, 9, dtype)
    dy = torch.randn(2, 5, 9).to(dtype)
    for approximate in ("none", "tanh"):
        y_r, g_r = run_all(low, 0.17, approximate, 99, dy)
        y_s, g_s = run_all(low, 0.17, approximate, 99, dy, store_activation=True)
        y_again, g_again = run_all(low, 0.17, approximate, 99, dy)
        assert torch.equal(y_r, y_s) and torch.equal(y_r, y_again)
        for n in NAMES:
            assert torch.equal(g_r[n], g_s[n]), f"d{n} store != recompute"
            assert torch.equal(g_r[n], g_again[n]), f"d{n} differs between identical calls"


def test_seed_controls_the_mask():
    _, low = make_inputs((4, 6), 8, 16, 32, torch.float32)
    a, b = ours(low, 0.5, "none", 1), ours(low, 0.5, "none", 2)
    assert not torch.equal(a == 0, b == 0)
    torch.manual_seed(5)
    c = ours(low, 0.5, "none", None)
    torch.manual_seed(5)
    assert torch.equal(c, ours(low, 0.5, "none", None))


def saved_by_forward(t, **kw):
    packed = []

    def pack(tensor):
        packed.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        y = ours(t, 0.17, "none", 3, **kw)
    return y, packed


def same_storage(a, b):
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@pytest.mark.parametrize("store", [False, True])
def test_saves_only_x_and_fc1_output(store):
    _, t = make_inputs((3, 5), 8, 32, 6, torch.float32)
    y, packed = saved_by_forward(t, store_activation=store)
    params = [t[n] for n in ("w1", "b1", "w2", "b2")]
    seeds = [s for s in packed if s.dtype == torch.int32]
    assert len(seeds) == 1 and rng.seed_from_tensor(seeds[0]) == 3  # the dropout state, 8 bytes
    activations = [s for s in packed if not any(s is p for p in params) and s.dtype != torch.int32]
    assert len(packed) - len(activations) == 5
    with torch.no_grad():
        h = F.linear(t["x"], t["w1"], t["b1"])
        a = F.gelu(h)
    expected = [t["x"], h] + ([a] if store else [])
    assert len(activations) == len(expected)
    for got, want in zip(activations, expected):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want)
    assert same_storage(activations[0], t["x"])  # x itself, no copy
    saved_bytes = sum(s.numel() * s.element_size() for s in activations)
    assert saved_bytes == (t["x"].numel() + h.numel() * (2 if store else 1)) * 4


class _StorageRecorder(TorchDispatchMode):
    """Weak references to the storage of every tensor an op produces while active."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.made.append((StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes()))
        return out


@pytest.mark.parametrize("store", [False, True])
def test_forward_leaves_alive_only_output_and_fc1_output(store, backend):
    """Storages a forward creates and leaves alive while y is held: y and h (and a in store mode),
    plus the 8-byte seed of the output dropout."""
    _, t = make_inputs((6, 5), 8, 40, 3, torch.float32)
    inputs = {StorageWeakRef(v.untyped_storage()).cdata for v in t.values()}
    recorder = _StorageRecorder()
    with recorder:
        y = ours(t, 0.17, "none", 3, store_activation=store)
    gc.collect()
    alive = {ref.cdata: nbytes for ref, nbytes in recorder.made if not ref.expired() and ref.cdata not in inputs}
    y_bytes, h_bytes = 30 * 3 * 4, 30 * 40 * 4
    assert sorted(alive.values()) == sorted([8, y_bytes, h_bytes] + ([h_bytes] if store else []))
    del y


def test_only_needed_grads_are_computed():
    ref, low = make_inputs((3, 4), 9, 16, 5, torch.float32)
    low["x"].requires_grad_(False)
    low["b1"].requires_grad_(False)
    ref["x"].requires_grad_(False)
    ref["b1"].requires_grad_(False)
    y, y_ref = ours(low, 0.17, "tanh", 4), eager_mlp(ref, 0.17, "tanh", 4)
    dy = torch.randn_like(y)
    leaves = [low[n] for n in ("w1", "w2", "b2")]
    got = torch.autograd.grad(y, leaves, dy)
    want = torch.autograd.grad(y_ref, [ref[n] for n in ("w1", "w2", "b2")], dy.double())
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, atol=2e-5, rtol=1e-5)
    args = [low[n].detach() for n in NAMES]
    _, h, _ = gelu_mlp_forward(*args, 0.17, "tanh", rng.seed_arg(4), False)
    only_db2 = gelu_mlp_backward(dy, args[0], h, None, *args[1:], 0.17, "tanh", rng.seed_arg(4),
                            (False, False, False, False, True))
    assert only_db2[:4] == (None,) * 4
    torch.testing.assert_close(only_db2[4], got[2])


def test_plain_functions_match_autograd_op():
    _, t = make_inputs((2, 7), 12, 24, 5, torch.bfloat16)
    args = [t[n].detach() for n in NAMES]
    y, h, a = gelu_mlp_forward(*args, 0.17, "tanh", rng.seed_arg(21), False)
    assert a is None and h.shape == (2, 7, 24)
    y_op = ours(t, 0.17, "tanh", 21)
    assert torch.equal(y, y_op)
    dy = torch.randn(2, 7, 5).to(torch.bfloat16)
    got = gelu_mlp_backward(dy, args[0], h, None, *args[1:], 0.17, "tanh", rng.seed_arg(21), (True,) * 5)
    want = grads(y_op, t, dy)
    for n, g in zip(NAMES, got):
        assert torch.equal(g, want[n]), n


def test_empty_rows():
    _, t = make_inputs((0,), 5, 8, 3, torch.float32)
    y = ours(t, 0.17, "none", 1)
    assert y.shape == (0, 3)
    y.sum().backward()
    assert t["w1"].grad.abs().sum() == 0 and t["x"].grad.shape == (0, 5)


# ---- validation ----

def base_args(**over):
    args = dict(x=torch.randn(2, 3, 4), w1=torch.randn(8, 4), b1=torch.randn(8), w2=torch.randn(5, 8),
                b2=torch.randn(5), dropout_p=0.1, approximate="none", seed=1)
    args.update(over)
    return args


BAD = [
    (dict(w1=torch.randn(8, 5)), ValueError, "w1"),
    (dict(w1=torch.randn(8)), ValueError, "w1"),
    (dict(b1=torch.randn(7)), ValueError, "b1"),
    (dict(w2=torch.randn(5, 7)), ValueError, "w2"),
    (dict(b2=torch.randn(4)), ValueError, "b2"),
    (dict(x=torch.randn(())), ValueError, "x"),
    (dict(w2=torch.randn(5, 8, dtype=torch.float64)), TypeError, "w2"),
    (dict(b1=torch.randn(8).half()), TypeError, "b1"),
    (dict(x=torch.randint(0, 3, (2, 3, 4))), TypeError, "x"),
    (dict(w1=[[1.0]]), TypeError, "w1"),
    (dict(w2=torch.randn(5, 8, device="meta")), ValueError, "w2"),
    (dict(approximate="erf"), ValueError, "approximate"),
    (dict(approximate=None), TypeError, "approximate"),
    (dict(dropout_p=1.0), ValueError, "dropout_p"),
    (dict(dropout_p=-0.1), ValueError, "dropout_p"),
    (dict(dropout_p="0.1"), TypeError, "dropout_p"),
    (dict(seed=-1), ValueError, "seed"),
    (dict(seed=1.5), TypeError, "seed"),
]


@pytest.mark.parametrize("over,err,name", BAD, ids=[f"{b[2]}-{i}" for i, b in enumerate(BAD)])
def test_bad_input_names_the_argument(over, err, name):
    with pytest.raises(err, match=name):
        gelu_mlp(**base_args(**over))


def test_bad_store_flag():
    with pytest.raises(TypeError, match="store_activation"):
        gelu_mlp(**base_args(), store_activation=1)


# ---- torch.compile ----

@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_opcheck(approximate):
    h = torch.randn(3, 17)
    for op in (gelu_op, gelu_rebuild_op):  # the rebuild op is forward's under a name of its own
        torch.library.opcheck(op, (h, approximate))
    assert torch.equal(gelu_op(h, approximate), gelu_rebuild_op(h, approximate))


def test_compiles_fullgraph_on_cpu():
    _, t = make_inputs((2, 6), 8, 16, 4, torch.float32)

    def step(x, w1, b1, w2, b2):
        return gelu_mlp(x, w1, b1, w2, b2, 0.17, "tanh", 1234)

    compiled = torch.compile(step, fullgraph=True)  # inductor: the custom ops stay opaque calls
    args = [t[n] for n in NAMES]
    y_c = compiled(*args)
    dy = torch.randn_like(y_c)
    g_c = torch.autograd.grad(y_c, args, dy)
    y_e = step(*args)
    g_e = torch.autograd.grad(y_e, args, dy)
    torch.testing.assert_close(y_c, y_e, rtol=0, atol=0)
    for a, b in zip(g_c, g_e):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_reference_and_store_is_bit_identical(dtype):
    ref, low = make_inputs((4, 77), 80, 341, 64, dtype)
    ref = {k: v.detach().cuda().requires_grad_(True) if v is not None else None for k, v in ref.items()}
    low = {k: v.detach().cuda().requires_grad_(True) if v is not None else None for k, v in low.items()}
    eager_in = {k: v.detach().clone().requires_grad_(True) for k, v in low.items()}
    y = ours(low, 0.17, "tanh", 5)
    rows = 4 * 77
    keep = rng.elementwise_keep_mask(5, rows, 64, 0.17).reshape(4, 77, 64).cuda()

    def eager(t):
        z = F.linear(F.gelu(F.linear(t["x"], t["w1"], t["b1"]), approximate="tanh"), t["w2"], t["b2"])
        return torch.where(keep, z * rng.keep_scale(0.17), 0.0)

    y_eager, y_ref = eager(eager_in), eager(ref)
    assert_within_rule(y, y_eager, y_ref, 2, name="y")
    dy = torch.randn_like(y)
    got, we, wr = grads(y, low, dy), grads(y_eager, eager_in, dy), grads(y_ref, ref, dy.double())
    for n in NAMES:
        assert_within_rule(got[n], we[n], wr[n], 3, name=f"d{n}")
    y_s, g_s = run_all(low, 0.17, "tanh", 5, dy, store_activation=True)
    assert torch.equal(y, y_s)
    for n in NAMES:
        assert torch.equal(got[n], g_s[n]), n
