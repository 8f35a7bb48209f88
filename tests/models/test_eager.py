"""convert() on eager pre-LN layers (selective_ckpt.models.eager.EagerDecoderLayer and look-alikes)."""

import copy

import pytest
import torch

from selective_ckpt import SelectiveDecoderLayer, convert
from selective_ckpt.models.eager import EagerDecoderLayer
from tests.reference import assert_within_rule


def eager_stack(dropout=0.0, causal=True, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[EagerDecoderLayer(32, 4, dropout=dropout, attn_dropout=dropout, causal=causal)
                                 for _ in range(2)])


class _Stack(torch.nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = layers

    def forward(self, x, mask):
        for layer in self.layers:
            x = layer(x, mask)
        return x


@pytest.mark.parametrize("causal", [True, False])
def test_eager_layers_convert_within_rule(causal):
    model = _Stack(eager_stack(causal=causal))
    with torch.no_grad():
        for layer in model.layers:
            layer.ln1.weight.add_(0.3 * torch.randn(32))
            layer.ln2.bias.add_(0.3 * torch.randn(32))
    x, dy = torch.randn(2, 11, 32), torch.randn(2, 11, 32)
    mask = torch.ones(2, 11, dtype=torch.bool)
    mask[1, 8:] = False
    converted = convert(copy.deepcopy(model), recompute="full")
    assert all(isinstance(layer, SelectiveDecoderLayer) and layer.recompute == "full" for layer in converted.layers)

    def run(m, dtype):
        m = m.to(dtype)
        xr = x.detach().clone().to(dtype).requires_grad_(True)
        y = m(xr, mask)
        y.backward(dy.to(dtype))
        return y.detach(), xr.grad

    ours, eager, ref = run(converted, torch.float32), run(copy.deepcopy(model), torch.float32), run(
        copy.deepcopy(model), torch.float64)
    assert_within_rule(ours[0], eager[0], ref[0], 2, name="y")
    assert_within_rule(ours[1], eager[1], ref[1], 3, name="dx")
    m = model.to(torch.float32)
    assert torch.equal(converted.layers[1].qkv.weight, m.layers[1].attn.in_proj_weight)
    assert torch.equal(converted.layers[1].fc2.bias, m.layers[1].mlp[2].bias)


def test_eager_root_and_errors():
    layer = EagerDecoderLayer(32, 2, dropout=0.1, attn_dropout=0.05)
    new = convert(layer)
    assert isinstance(new, SelectiveDecoderLayer)
    assert (new.dropout, new.attn_dropout, new.causal) == (0.1, 0.05, True)
    bad = eager_stack()
    bad[1].mlp[1] = torch.nn.ReLU()
    with pytest.raises(ValueError, match=r"^1: activation ReLU"):
        convert(bad)
    assert isinstance(bad[0], EagerDecoderLayer)
    bad = eager_stack()
    bad[0].mlp[3].p = 0.3
    with pytest.raises(ValueError, match=r"^0: attention and MLP residual dropouts differ"):
        convert(bad)
    with pytest.raises(ValueError, match="recompute must be one of"):
        convert(eager_stack(), recompute="most")
