"""SelectiveDecoderLayer against a float64 eager reference with the contract's dropout masks."""

import pytest
import torch
import torch.nn.functional as F

import selective_ckpt
from selective_ckpt import SelectiveDecoderLayer, rng, set_recompute
from tests.reference import assert_within_rule

NAMES = ["ln1.weight", "ln1.bias", "qkv.weight", "qkv.bias", "proj.weight", "proj.bias", "ln2.weight", "ln2.bias",
         "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]


def reference(P, x, mask, heads, causal, p_attn, p, seeds, approximate="none", eps=1e-5):
    """Eager pre-LN layer from plain torch ops; parameters P by name; masks from selective_ckpt.rng."""
    B, S, E = x.shape
    D = E // heads
    h = F.layer_norm(x, (E,), P["ln1.weight"], P["ln1.bias"], eps)
    q, k, v = F.linear(h, P["qkv.weight"], P["qkv.bias"]).view(B, S, 3, heads, D).permute(2, 0, 3, 1, 4)
    s = (q @ k.transpose(-1, -2)) * D**-0.5
    dev = x.device
    allowed = torch.ones(B, 1, S, S, dtype=torch.bool, device=dev)
    if causal:
        allowed = allowed & torch.ones(S, S, dtype=torch.bool, device=dev).tril()
    if mask is not None:
        allowed = allowed & mask[:, None, None, :]
    prob = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)  # empty rows give 0
    if p_attn:
        prob = prob * rng.attention_keep_mask(seeds[0], B, heads, S, S, p_attn).to(dev) * rng.keep_scale(p_attn)
    o = (prob @ v).transpose(1, 2).reshape(B, S, E)
    a = F.linear(o, P["proj.weight"], P["proj.bias"])
    if p:
        a = a * rng.elementwise_keep_mask(seeds[1], B * S, E, p).view(B, S, E).to(dev) * rng.keep_scale(p)
    x1 = x + a
    f = F.gelu(F.linear(F.layer_norm(x1, (E,), P["ln2.weight"], P["ln2.bias"], eps), P["fc1.weight"],
                        P["fc1.bias"]), approximate=approximate)
    m = F.linear(f, P["fc2.weight"], P["fc2.bias"])
    if p:
        m = m * rng.elementwise_keep_mask(seeds[2], B * S, E, p).view(B, S, E).to(dev) * rng.keep_scale(p)
    return x1 + m


def make_layer(E=32, H=2, dropout=0.0, attn_dropout=0.0, causal=True, dtype=torch.float32, seed=0, **kw):
    torch.manual_seed(seed)
    layer = SelectiveDecoderLayer(E, H, dropout=dropout, attn_dropout=attn_dropout, causal=causal, dtype=dtype, **kw)
    with torch.no_grad():  # non-trivial LayerNorm parameters
        for ln in (layer.ln1, layer.ln2):
            ln.weight.add_(0.2 * torch.randn_like(ln.weight))
            ln.bias.add_(0.1 * torch.randn_like(ln.bias))
    return layer


def run_layer(layer, x, mask, dy, seed=123):
    x = x.detach().clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    y = layer(x, mask)
    y.backward(dy)
    params = dict(getattr(layer, "_orig_mod", layer).named_parameters())  # compiled modules wrap the layer
    return [y.detach(), x.grad] + [params[n].grad for n in NAMES]


def run_reference(layer, x, mask, dy, seeds, dtype):
    P = {n: t.detach().to(dtype).requires_grad_(True) for n, t in layer.named_parameters()}
    xr = x.detach().clone().to(dtype).requires_grad_(True)
    p_attn, p = (layer.attn_dropout, layer.dropout) if layer.training else (0.0, 0.0)
    y = reference(P, xr, mask, layer.num_heads, layer.causal, p_attn, p, seeds,
                  {"gelu": "none", "gelu_tanh": "tanh"}[layer.kernel_activation])
    y.backward(dy.to(y.dtype))
    return [y.detach(), xr.grad] + [P[n].grad for n in NAMES]


def seeds_of(layer, x, seed=123):
    torch.manual_seed(seed)  # seeds the CUDA generators too
    return layer._draw_seeds(x.device)


def check_against_reference(layer, x, mask, dy, floor=1e-5):
    ours = run_layer(layer, x, mask, dy)
    seeds = seeds_of(layer, x)
    eager = run_reference(layer, x, mask, dy, seeds, x.dtype)
    ref = run_reference(layer, x, mask, dy, seeds, torch.float64)
    for i, name in enumerate(["y", "dx"] + NAMES):
        assert_within_rule(ours[i], eager[i], ref[i], 2 if i == 0 else 3, floor=floor, name=name)
    return ours


CASES = [  # B, S, E, H, causal, padded, dropout
    (2, 17, 32, 2, True, False, 0.0),
    (1, 1, 16, 1, True, False, 0.17),
    (2, 13, 48, 3, False, True, 0.17),
    (3, 7, 32, 2, True, True, 0.17),
]


def padding_mask(B, S):
    mask = torch.ones(B, S, dtype=torch.bool)
    for b in range(1, B):  # row 0 unpadded, later rows lose more keys at the end
        mask[b, S - b * max(1, S // 4):] = False
    return mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_layer_matches_float64_reference(case, dtype):
    B, S, E, H, causal, padded, p = case
    layer = make_layer(E, H, dropout=p, attn_dropout=p, causal=causal, dtype=dtype)
    x = torch.randn(B, S, E).to(dtype)
    dy = torch.randn(B, S, E).to(dtype)
    mask = padding_mask(B, S) if padded else None
    check_against_reference(layer, x, mask, dy)


def test_layer_triton_backend_matches_reference(use_backend):
    use_backend("triton")
    layer = make_layer(16, 2, dropout=0.17, attn_dropout=0.17, activation="gelu_tanh")
    x, dy = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
    check_against_reference(layer, x, padding_mask(2, 5), dy)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_modes_bit_identical(dtype):
    layer = make_layer(32, 4, dropout=0.17, attn_dropout=0.17, dtype=dtype)
    x, dy = torch.randn(2, 11, 32).to(dtype), torch.randn(2, 11, 32).to(dtype)
    mask = padding_mask(2, 11)
    results = {}
    for mode in ("selective", "none", "full", "attention-kept"):
        layer.recompute = mode
        results[mode] = run_layer(layer, x, mask, dy)
    for mode in ("none", "full", "attention-kept"):
        for i, (a, b) in enumerate(zip(results["selective"], results[mode])):
            assert torch.equal(a, b), f"{mode} differs from selective in {(['y', 'dx'] + NAMES)[i]}"
    assert not torch.equal(results["selective"][0], run_layer(layer, x, mask, dy, seed=7)[0])  # seeds matter


def saved_storages(layer, x, mask=None):
    """Bytes of distinct storages autograd keeps for backward, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    kept = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            kept[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x, mask)
    return sum(kept.values()), y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["selective", "none", "full"])
def test_saved_bytes_match_the_contract(mode, dtype):
    B, S, E, H = 2, 9, 32, 4
    layer = make_layer(E, H, dropout=0.1, attn_dropout=0.1, dtype=dtype, recompute=mode)
    x = torch.randn(B, S, E, dtype=dtype, requires_grad=True)
    got, y = saved_storages(layer, x)
    es = torch.finfo(dtype).bits // 8
    per_token_hidden = {"selective": 10, "none": 16, "full": 1}[mode]
    expected = B * S * E * es * per_token_hidden
    if mode != "full":
        expected += B * H * S * 4 + 2 * 2 * B * S * 4  # fp32 logsumexp, LN1 and LN2 mean/rstd
        expected += 3 * 8  # dropout state: one 8-byte seed per site (attention, proj, MLP)
    assert got == expected, f"{mode}: kept {got} bytes, contract says {expected}"
    y.sum().backward()  # what was kept suffices


def test_nothing_kept_without_grad_and_eval_is_deterministic():
    layer = make_layer(32, 2, dropout=0.17, attn_dropout=0.17)
    x = torch.randn(2, 6, 32)
    for mode in ("selective", "none", "full", "attention-kept"):
        layer.recompute = mode
        with torch.no_grad():
            got, y = saved_storages(layer, x)
        assert got == 0 and not y.requires_grad
        layer.eval()
        with torch.no_grad():
            got, y_eval = saved_storages(layer, x)
            assert got == 0 and torch.equal(layer(x), y_eval)  # dropout off in eval: no seeds, same bits
        layer.requires_grad_(False)  # frozen layer, grad mode on, input without grad: nothing either
        got, y_frozen = saved_storages(layer, x)
        assert got == 0 and not y_frozen.requires_grad and torch.equal(y_frozen, y_eval)
        layer.requires_grad_(True)
        layer.train()
    layer.eval()
    P = {n: t.detach().double() for n, t in layer.named_parameters()}
    ref = reference(P, x.double(), None, 2, True, 0.0, 0.0, None)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), ref.float(), atol=1e-5, rtol=1e-5)


def test_autocast_cpu_bf16_matches_eager_autocast():
    layer = make_layer(32, 2, dropout=0.17, attn_dropout=0.17)
    x, dy = torch.randn(2, 9, 32), torch.randn(2, 9, 32)
    mask = padding_mask(2, 9)
    seeds = seeds_of(layer, x)
    results = {}
    for mode in ("selective", "full", "attention-kept"):
        layer.recompute = mode
        with torch.autocast("cpu", dtype=torch.bfloat16):
            results[mode] = run_layer(layer, x, mask, dy)
    assert results["selective"][0].dtype == torch.float32  # residual stream stays fp32 like eager
    for mode in ("full", "attention-kept"):
        for a, b in zip(results["selective"], results[mode]):
            assert torch.equal(a, b)  # the re-run replays under the same autocast state
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager = run_reference(layer, x, mask, dy, seeds, torch.float32)
    ref = run_reference(layer, x, mask, dy, seeds, torch.float64)
    for i, name in enumerate(["y", "dx"] + NAMES):
        assert_within_rule(results["selective"][i], eager[i], ref[i], 2 if i == 0 else 3, name=name)
    # and it really computed in bf16: far from the fp32 result
    fp32 = run_layer(layer, x, mask, dy)
    assert (fp32[0] - results["selective"][0]).abs().max() > 1e-4


def test_torch_compile_fullgraph_matches_eager():
    layer = make_layer(32, 2)
    x, dy = torch.randn(2, 7, 32), torch.randn(2, 7, 32)
    mask = padding_mask(2, 7)
    eager = run_layer(layer, x, mask, dy)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)
    x2 = x.clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    y = compiled(x2, mask)
    y.backward(dy)
    got = [y.detach(), x2.grad] + [dict(layer.named_parameters())[n].grad for n in NAMES]
    for i, (a, b) in enumerate(zip(got, eager)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m, i=i: f"{(['y', 'dx'] + NAMES)[i]}: {m}")


@pytest.mark.parametrize("kind", ["gelu", "swiglu"])
def test_torch_compile_keeps_what_eager_keeps(kind):
    """Under torch.compile (inductor) the selective layer keeps exactly its eager bytes: backward's
    rebuild of the MLP activation must not be merged with forward's (the partitioner would then keep
    the activation, 4h more per token for GELU)."""
    kw = dict(norm="rmsnorm", activation="swiglu", bias=False, num_kv_heads=2, ffn_dim=96) if kind == "swiglu" else {}
    torch.manual_seed(0)
    layer = SelectiveDecoderLayer(32, 4, causal=True, recompute="selective", **kw)
    x = torch.randn(2, 24, 32, requires_grad=True)
    eager = selective_ckpt.memory.ledger(layer, x).total
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)
    compiled(x).sum().backward()
    assert selective_ckpt.memory.graph_saved_bytes(compiled(x), exclude=[layer]) == eager


def test_set_recompute():
    stack = torch.nn.Sequential(*[make_layer(16, 2) for _ in range(5)])
    assert set_recompute(stack, "none") == ["none"] * 5
    assert [m.recompute for m in stack] == ["none"] * 5
    assert set_recompute(stack, "selective", every=2) == ["full", "selective", "full", "selective", "full"]
    modes = ["full", "none", "selective", "selective", "full"]
    assert set_recompute(stack, modes) == modes and [m.recompute for m in stack] == modes
    with pytest.raises(ValueError, match="5 SelectiveDecoderLayers"):
        set_recompute(stack, ["full"])
    with pytest.raises(ValueError, match="recompute must be one of"):
        set_recompute(stack, "some")
    with pytest.raises(ValueError, match="every"):
        set_recompute(stack, "selective", every=0)
    with pytest.raises(ValueError, match="no SelectiveDecoderLayer"):
        set_recompute(torch.nn.Linear(2, 2), "full")
    assert selective_ckpt.set_recompute is set_recompute


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="divisible by num_heads"):
        SelectiveDecoderLayer(30, 4)
    with pytest.raises(ValueError, match="activation must be one of"):
        SelectiveDecoderLayer(32, 2, activation="relu")
    with pytest.raises(ValueError, match="recompute must be one of"):
        SelectiveDecoderLayer(32, 2, recompute="partial")
    with pytest.raises(ValueError, match="head dim"):
        SelectiveDecoderLayer(1024, 2)
    with pytest.raises(ValueError, match="dropout"):
        SelectiveDecoderLayer(32, 2, dropout=1.0)
    with pytest.raises(ValueError, match="mlp_ratio"):
        SelectiveDecoderLayer(32, 2, mlp_ratio=0)
    layer = SelectiveDecoderLayer(32, 2)
    with pytest.raises(ValueError, match=r"x must have shape \[B, S, 32\]"):
        layer(torch.randn(2, 3, 16))
    with pytest.raises(TypeError, match="attention_mask must be a bool"):
        layer(torch.randn(2, 3, 32), torch.ones(2, 3))
    with pytest.raises(ValueError, match="recompute must be one of"):
        layer.recompute = "all"


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_layer_matches_reference_and_modes_agree(dtype):
    B, S, E, H = 2, 77, 128, 2  # head dim 64, ragged S
    layer = make_layer(E, H, dropout=0.17, attn_dropout=0.17, dtype=dtype).cuda()
    x, dy = torch.randn(B, S, E, device="cuda").to(dtype), torch.randn(B, S, E, device="cuda").to(dtype)
    mask = padding_mask(B, S).cuda()
    ours = check_against_reference(layer, x, mask, dy, floor=1e-4)
    for mode in ("none", "full"):
        layer.recompute = mode
        for a, b in zip(ours, run_layer(layer, x, mask, dy)):
            assert torch.equal(a, b), mode
        layer.recompute = "selective"
    got, _ = saved_storages(layer, x.clone().requires_grad_(True), mask)
    es = torch.finfo(dtype).bits // 8
    # the contract's bytes (test_saved_bytes_match_the_contract), the three dropout seeds, and the caller's
    # padding mask, which attention keeps by reference
    assert got == B * S * E * es * 10 + B * H * S * 4 + 2 * 2 * B * S * 4 + 3 * 8 + mask.numel() * mask.element_size()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_autocast_matches_eager_autocast(dtype):
    layer = make_layer(64, 2, dropout=0.17, attn_dropout=0.17).cuda()
    x, dy = torch.randn(2, 33, 64, device="cuda"), torch.randn(2, 33, 64, device="cuda")
    seeds = seeds_of(layer, x)
    with torch.autocast("cuda", dtype=dtype):
        ours = run_layer(layer, x, None, dy)
        eager = run_reference(layer, x, None, dy, seeds, torch.float32)
    ref = run_reference(layer, x, None, dy, seeds, torch.float64)
    for i, name in enumerate(["y", "dx"] + NAMES):
        assert_within_rule(ours[i], eager[i], ref[i], 2 if i == 0 else 3, floor=1e-4, name=name)


def test_torch_compile_with_dropout_matches_eager():
    # Seeds are drawn as tensors, so the draw is traced too: no graph break with dropout on.
    layer = make_layer(32, 2, dropout=0.17, attn_dropout=0.17)
    x, dy = torch.randn(2, 7, 32), torch.randn(2, 7, 32)
    eager = run_layer(layer, x, None, dy)
    torch._dynamo.reset()
    with torch._inductor.config.patch(fallback_random=True):  # draw from torch's generator, as eager does
        got = run_layer(torch.compile(layer, fullgraph=True), x, None, dy)
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_without_biases_fp16_and_tanh_gelu():
    layer = SelectiveDecoderLayer(24, 3, mlp_ratio=2.5, dropout=0.17, attn_dropout=0.17, bias=False,
                                  activation="gelu_tanh", dtype=torch.float16)
    assert layer.ln1.bias is None and layer.fc1.bias is None and layer.fc1.out_features == 60
    x, dy = torch.randn(2, 5, 24).half(), torch.randn(2, 5, 24).half()
    names = [n for n in NAMES if not n.endswith("bias")]
    ours = run_layer_named(layer, x, dy, names)
    seeds = seeds_of(layer, x)
    refs = []
    for dtype in (torch.float16, torch.float64):
        P = {n: t.detach().to(dtype).requires_grad_(True) for n, t in layer.named_parameters()}
        P.update({n: None for n in NAMES if n.endswith("bias")})
        xr = x.detach().clone().to(dtype).requires_grad_(True)
        y = reference(P, xr, None, 3, True, 0.17, 0.17, seeds, "tanh")
        y.backward(dy.to(dtype))
        refs.append([y.detach(), xr.grad] + [P[n].grad for n in names])
    for i, name in enumerate(["y", "dx"] + names):
        assert_within_rule(ours[i], refs[0][i], refs[1][i], 2 if i == 0 else 3, name=name)


def run_layer_named(layer, x, dy, names, seed=123):
    x = x.detach().clone().requires_grad_(True)
    torch.manual_seed(seed)
    y = layer(x)
    y.backward(dy)
    params = dict(layer.named_parameters())
    return [y.detach(), x.grad] + [params[n].grad for n in names]
