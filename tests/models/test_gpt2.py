"""convert() on Hugging Face GPT-2: GPT2Block -> SelectiveDecoderLayer with the same weights."""

import copy

import pytest
import torch

from selective_ckpt import SelectiveDecoderLayer, convert
from tests.reference import assert_within_rule

transformers = pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402
from transformers.models.gpt2.modeling_gpt2 import GPT2Block  # noqa: E402

# converted parameter name -> (original name, Conv1D transposed)
_GPT2_PARAMS = {"ln1": ("ln_1", False), "qkv": ("attn.c_attn", True), "proj": ("attn.c_proj", True),
                "ln2": ("ln_2", False), "fc1": ("mlp.c_fc", True), "fc2": ("mlp.c_proj", True)}


def gpt2(seed=0, impl="eager", **overrides):
    torch.manual_seed(seed)
    kw = dict(vocab_size=61, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
              attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    kw.update(overrides)
    config = GPT2Config(**kw)
    config._attn_implementation = impl
    return GPT2LMHeadModel(config)


def original_name(name):
    parts = name.split(".")
    if "h" in parts:
        i = parts.index("h") + 2
        if parts[i] in _GPT2_PARAMS:
            orig, transposed = _GPT2_PARAMS[parts[i]]
            return ".".join(parts[:i] + [orig] + parts[i + 1:]), transposed
    return name, False


def loss_and_grads(model, ids, mask):
    model.zero_grad(set_to_none=True)
    out = model(ids, attention_mask=mask, labels=ids, use_cache=False)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_gpt2_logits_loss_and_grads_within_rule(impl):
    model = gpt2(impl=impl)
    ids = torch.randint(0, 61, (2, 13))
    mask = torch.ones(2, 13, dtype=torch.long)
    mask[1, 9:] = 0  # right padding
    reference64 = copy.deepcopy(model).double()
    converted, replaced = convert(copy.deepcopy(model))
    assert replaced == ["transformer.h.0", "transformer.h.1"]
    assert all(isinstance(b, SelectiveDecoderLayer) for b in converted.transformer.h)
    assert [b.activation for b in converted.transformer.h] == ["gelu_tanh"] * 2
    ours, eager, ref = (loss_and_grads(m, ids, mask) for m in (converted, model, reference64))
    assert_within_rule(ours[0], eager[0], ref[0], 2, name="logits")
    assert_within_rule(ours[1], eager[1], ref[1], 2, name="loss")
    for name, grad in ours[2].items():
        orig, transposed = original_name(name)
        e, r = eager[2][orig], ref[2][orig]
        if transposed:
            e, r = e.t(), r.t()
        assert_within_rule(grad, e, r, 3, name=name)
    assert len(ours[2]) == len(eager[2])


def test_gpt2_with_dropout_trains():
    model, _ = convert(gpt2(resid_pdrop=0.1, attn_pdrop=0.1, embd_pdrop=0.1))
    layer = model.transformer.h[0]
    assert (layer.dropout, layer.attn_dropout) == (0.1, 0.1)
    torch.manual_seed(1)
    ids = torch.randint(0, 61, (4, 16))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(15):
        loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3, losses


def test_gpt2_masks_two_and_four_dimensional():
    model, _ = convert(gpt2())
    block = model.transformer.h[0]
    x = torch.randn(2, 6, 32)
    pad = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    four_d = causal & pad[:, None, None, :]
    additive = torch.zeros(2, 1, 6, 6).masked_fill(~four_d, torch.finfo(torch.float32).min)
    expected = SelectiveDecoderLayer.forward(block, x, pad)
    for mask in (pad, pad.long(), four_d, additive):
        assert torch.equal(block(x, None, mask), expected)
    with pytest.raises(ValueError, match=r"transformer\.h\.0.*additive bias"):
        block(x, None, torch.randn(2, 1, 6, 6))
    with pytest.raises(ValueError, match=r"transformer\.h\.0.*not causal"):
        block(x, None, torch.ones(2, 1, 6, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"transformer\.h\.0.*kv-cache"):
        block(x, None, None, use_cache=True)
    with pytest.raises(ValueError, match=r"transformer\.h\.0.*cross-attention"):
        block(x, None, None, torch.randn(2, 3, 32))


def test_gpt2_kv_cache_refused():
    model, _ = convert(gpt2())
    with pytest.raises(ValueError, match="kv-cache"):
        model(torch.randint(0, 61, (1, 4)), use_cache=True)


def test_gpt2_unconvertible_blocks_raise_and_change_nothing():
    with pytest.raises(ValueError, match=r"transformer\.h\.0.*cross-attention"):
        convert(gpt2(add_cross_attention=True))
    with pytest.raises(ValueError, match=r"transformer\.h\.0.*activation 'relu'"):
        convert(gpt2(activation_function="relu"))
    model = gpt2()
    model.transformer.h[1].ln_2.eps = 1e-3  # the second block cannot be converted
    with pytest.raises(ValueError, match=r"transformer\.h\.1.*eps"):
        convert(model)
    assert all(isinstance(b, GPT2Block) for b in model.transformer.h)  # not even block 0 was swapped


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_gpt2_left_padding(impl):
    model = gpt2(impl=impl)
    converted, _ = convert(copy.deepcopy(model))
    ids = torch.randint(0, 61, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :4] = 0  # left padding: the padded queries have nothing to attend
    with torch.no_grad():
        ours = converted(ids, attention_mask=mask).logits
        theirs = model(ids, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(ours[0], theirs[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours[1, 4:], theirs[1, 4:], atol=1e-5, rtol=1e-5)


def test_gpt2_inference_mode_and_mask_reuse():
    model, _ = convert(gpt2())
    model.eval()
    ids = torch.randint(0, 61, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[0, 5:] = 0
    with torch.no_grad():
        a = model(ids, attention_mask=mask).logits
    with torch.inference_mode():
        b = model(ids, attention_mask=mask).logits
    assert torch.equal(a, b)
    block = model.transformer.h[0]
    x = torch.randn(2, 7, 32)
    m4 = torch.ones(2, 1, 7, 7, dtype=torch.bool).tril()
    first = block(x, None, m4)
    m4[1, 0, 5, 2] = False  # edited in place: must be checked again, not served from the cache
    with pytest.raises(ValueError, match="not causal"):
        block(x, None, m4)
    assert torch.equal(first, SelectiveDecoderLayer.forward(block, x))
