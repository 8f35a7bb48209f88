"""selective_ckpt.dropout: forward and backward equal x * mask * keep_scale(p) on both backends."""

import pytest
import torch

import selective_ckpt
from selective_ckpt import rng

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES)
# (3, 150): 19 column groups of 8, more than one batch of side-by-side draws
@pytest.mark.parametrize("shape", [(7, 45), (3, 5, 17), (1,), (2, 1, 8), (3, 150)])
def test_forward_and_backward_match_contract(backend, dtype, shape):
    seed, p = 0xDEADBEEF_12345678, 0.17
    x = torch.randn(shape, dtype=torch.float64).to(dtype).requires_grad_()
    rows, cols = x.numel() // shape[-1], shape[-1]
    keep = rng.elementwise_keep_mask(seed, rows, cols, p).reshape(shape)
    scale = rng.keep_scale(p)
    y = selective_ckpt.dropout(x, p, seed=seed)
    assert torch.equal(y, x.detach() * keep * scale)
    g = torch.randn(shape, dtype=torch.float64).to(dtype)
    y.backward(g)
    assert torch.equal(x.grad, g * keep * scale)


def test_backends_bit_identical(use_backend):
    x = torch.randn(9, 33, dtype=torch.bfloat16)
    outs = []
    for name in ("cpp", "triton"):
        use_backend(name)
        outs.append(selective_ckpt.dropout(x, 0.5, seed=(1 << 64) - 3))
    assert torch.equal(*outs)


def test_stride_zero_grad_and_noncontiguous_input(backend):
    base = torch.randn(6, 20, requires_grad=True)
    x = base.t()  # non-contiguous view: the mask follows logical indices
    y = selective_ckpt.dropout(x, 0.3, seed=11)
    keep = rng.elementwise_keep_mask(11, 20, 6, 0.3)
    assert torch.equal(y, x.detach() * keep * rng.keep_scale(0.3))
    y.sum().backward()  # grad_output has stride 0
    assert torch.equal(base.grad, (keep * rng.keep_scale(0.3)).t().to(base.dtype))


def test_saves_only_its_seed():
    x = torch.randn(4, 16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        selective_ckpt.dropout(x, 0.4, seed=(1 << 64) - 2).sum().backward()
    assert len(saved) == 1 and saved[0].nbytes == 8  # the seed; the mask is regenerated
    assert rng.seed_from_tensor(saved[0]) == (1 << 64) - 2


def test_seed_none_reproducible_under_manual_seed():
    x = torch.randn(8, 24)
    torch.manual_seed(3)
    a = selective_ckpt.dropout(x, 0.5)
    torch.manual_seed(3)
    b = selective_ckpt.dropout(x, 0.5)
    assert torch.equal(a, b)
    assert not torch.equal(a, selective_ckpt.dropout(x, 0.5))


def test_p_zero_is_identity():
    x = torch.randn(3, 4)
    assert selective_ckpt.dropout(x, 0.0) is x


def test_empty_tensor():
    x = torch.randn(0, 5, requires_grad=True)
    assert selective_ckpt.dropout(x, 0.5, seed=1).shape == (0, 5)


def test_bad_arguments():
    x = torch.randn(3, 4)
    with pytest.raises(ValueError, match="p"):
        selective_ckpt.dropout(x, 1.0)
    with pytest.raises(TypeError, match="p"):
        selective_ckpt.dropout(x, torch.tensor(0.5))
    with pytest.raises(ValueError, match="seed"):
        selective_ckpt.dropout(x, 0.5, seed=-1)
    with pytest.raises(TypeError, match="x"):
        selective_ckpt.dropout(x.long(), 0.5)


def test_unknown_backend_value_is_an_error(monkeypatch):
    monkeypatch.setenv("SELECTIVE_CKPT_BACKEND", "cuda-please")
    with pytest.raises(ValueError, match="SELECTIVE_CKPT_BACKEND"):
        selective_ckpt.dropout(torch.randn(2, 8), 0.5, seed=1)


def test_opcheck():
    x = torch.randn(5, 19, requires_grad=True)
    torch.library.opcheck(torch.ops.selective_ckpt.dropout.default, (x, 0.25, rng.seed_arg((1 << 64) - 1)))


def test_compiles_fullgraph_on_cpu():
    x = torch.randn(4, 40, requires_grad=True)
    f = torch.compile(lambda t: selective_ckpt.dropout(t, 0.3, seed=99) * 2, fullgraph=True)
    y = f(x)
    assert torch.equal(y, selective_ckpt.dropout(x, 0.3, seed=99) * 2)
    y.sum().backward()
    assert torch.equal(x.grad, 2 * rng.elementwise_keep_mask(99, 4, 40, 0.3) * rng.keep_scale(0.3))


def test_seed_none_compiles_fullgraph_and_follows_manual_seed():
    x = torch.randn(4, 40, requires_grad=True)
    f = torch.compile(lambda t: selective_ckpt.dropout(t, 0.3), fullgraph=True)
    with torch._inductor.config.patch(fallback_random=True):  # torch's generator, as in eager
        torch.manual_seed(8)
        y = f(x)
    torch.manual_seed(8)
    assert torch.equal(y, selective_ckpt.dropout(x, 0.3))


@pytest.mark.cuda
def test_cuda_matches_reference():
    x = torch.randn(33, 77, device="cuda", dtype=torch.bfloat16)
    y = selective_ckpt.dropout(x, 0.17, seed=5)
    keep = rng.elementwise_keep_mask(5, 33, 77, 0.17).cuda()
    assert torch.equal(y, x * keep * rng.keep_scale(0.17))
