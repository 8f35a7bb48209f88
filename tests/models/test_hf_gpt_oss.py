"""gpt-oss beyond the shared family checks (tests/models/families/moe.py): the converted experts (interleaved,
transposed, biased, the clamped SwiGLU) against transformers' own in float64 with the clamps hit, every
parameter's gradient; sliding layers keep to their window and full layers do not; settings selective_ckpt cannot
reproduce are refused by name at convert, changing nothing."""

import copy

import pytest
import torch

import selective_ckpt
from selective_ckpt import ConversionError
from selective_ckpt.models import gpt_oss
from tests.models.families.moe import GPT_OSS

transformers = pytest.importorskip("transformers")


def _model(**kw):
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**{**GPT_OSS, **kw}))
    model.config._attn_implementation = "eager"
    return model


@pytest.mark.parametrize("implementation, dtype, tol",
                         [("eager", torch.float64, 1e-10), ("grouped_mm", torch.float32, 1e-5)])
def test_experts_against_transformers(implementation, dtype, tol):
    """Rows routed to every expert, a limit that clamps gate and up both ways; y and the gradients of x, the four
    expert parameters and the routing weights equal transformers' up to rounding (float64 for its eager loop,
    float32 for its grouped matmuls, which take no float64)."""
    model = _model(swiglu_limit=0.3, experts_implementation=implementation).to(dtype)
    experts = model.model.layers[0].mlp.experts
    with torch.no_grad():
        for p in (experts.gate_up_proj, experts.gate_up_proj_bias, experts.down_proj, experts.down_proj_bias):
            p.normal_(0, 0.3)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(23, 64, generator=g).to(dtype)
    index = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(23)])
    weights = torch.softmax(torch.randn(23, 2, generator=g), -1).to(dtype)
    dy = torch.randn(23, 64, generator=g).to(dtype)

    def run(forward):
        xs, ws = x.clone().requires_grad_(), weights.clone().requires_grad_()
        for p in experts.parameters():
            p.grad = None
        forward(experts, xs, index, ws).backward(dy)
        return [forward(experts, x, index, weights).detach(), xs.grad, ws.grad] + [p.grad for p in experts.parameters()]

    gate_up = torch.einsum("th,tkhi->tki", x, experts.gate_up_proj[index].detach()) + experts.gate_up_proj_bias[index]
    assert (gate_up[..., ::2] > 0.3).any() and (gate_up[..., 1::2].abs() > 0.3).any()  # both clamps bite
    ours, theirs = run(gpt_oss.experts_forward), run(type(experts).forward)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_sliding_layers_keep_their_window_and_full_layers_do_not():
    """Changing token 0 moves a sliding layer's outputs within its window only (past it, only by the rounding of
    other rows in the experts' matmuls, whose rows the routing of token 0 changes), a full layer's everywhere."""
    for layer_type, reaches in (("sliding_attention", False), ("full_attention", True)):
        model = selective_ckpt.convert(_model(num_hidden_layers=1, layer_types=[layer_type]))
        ids = torch.randint(1, GPT_OSS["vocab_size"], (1, 13), generator=torch.Generator().manual_seed(2))
        other = ids.clone()
        other[0, 0] += 1
        with torch.no_grad():
            moved = (model(input_ids=ids).logits - model(input_ids=other).logits).abs().amax(-1)[0]
        assert moved[:5].min() > 1e-3
        assert (moved[5:].min() > 1e-3) if reaches else (moved[5:].max() < 1e-6), layer_type


@pytest.mark.parametrize("setting, value", [("limit", None), ("alpha", float("nan"))])
def test_a_setting_we_cannot_reproduce_is_refused_by_name(setting, value):
    model = _model()
    setattr(model.model.layers[1].mlp.experts, setting, value)
    before = copy.deepcopy(model.state_dict())
    forward = type(model.model.layers[1].mlp.experts).forward
    with pytest.raises(ConversionError, match=f"layers.1.mlp.experts: swiglu_{setting}"):
        selective_ckpt.convert(model)
    assert "forward" not in vars(model.model.layers[1].mlp.experts)
    assert type(model.model.layers[1].mlp.experts).forward is forward
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
