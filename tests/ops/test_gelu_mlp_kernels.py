"""The GELU kernels themselves (both forms, both backends): opcheck, agreement with torch in float64,
float32 accuracy in ulps, 16-bit rounding (the float kernel rounded once)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from selective_ckpt.ops.gelu_mlp import gelu_backward_op, gelu_op


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_opcheck(approximate, backend):
    h = torch.randn(3, 17)
    torch.library.opcheck(gelu_op, (h, approximate))
    torch.library.opcheck(gelu_backward_op, (torch.randn(3, 17), h, approximate))


def test_gelu_kernels_match_torch(backend):
    h = torch.linspace(-9, 9, 301, dtype=torch.float64).reshape(7, 43)
    for approximate in ("none", "tanh"):
        torch.testing.assert_close(gelu_op(h, approximate), F.gelu(h, approximate=approximate),
                                   rtol=1e-12, atol=1e-13)
        hr = h.clone().requires_grad_(True)
        (want,) = torch.autograd.grad(F.gelu(hr, approximate=approximate), hr, torch.ones_like(h))
        g = torch.ones_like(h)
        gelu_backward_op(g, h, approximate)
        torch.testing.assert_close(g, want, rtol=1e-12, atol=1e-13)


def test_float32_gelu_accuracy(backend):
    """The float kernels (C++: own exp / erfc polynomials) stay within a few float32 ulps."""
    x = torch.cat([torch.linspace(-12, 12, 24001), torch.tensor([0.0, -0.0, 1e-30, -1e-30, 30.0, -30.0])])
    x64 = x.double()
    tol = 4 * torch.finfo(torch.float32).eps
    for approximate in ("none", "tanh"):
        ref = F.gelu(x64, approximate=approximate)
        xr = x64.clone().requires_grad_(True)
        (dref,) = torch.autograd.grad(F.gelu(xr, approximate=approximate), xr, torch.ones_like(xr))
        a = gelu_op(x, approximate).double()
        g = torch.ones_like(x)
        gelu_backward_op(g, x, approximate)
        assert ((a - ref).abs() <= tol * ref.abs().clamp_min(1)).all(), approximate
        assert ((g.double() - dref).abs() <= tol * dref.abs().clamp_min(1)).all(), approximate


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16bit_gelu_rounding(dtype, backend):
    """16-bit kernels (staged through float, F16C on CPU) give the float64 result rounded, +-1 ulp."""
    x = torch.linspace(-9, 9, 4099, dtype=torch.float64).to(dtype)  # odd length: vector tails
    x64 = x.double()
    u = (x64 + 0.044715 * x64**3) * (2 / torch.pi) ** 0.5
    # Tail-accurate float64 references (1 + erf(x) cancels to 0 in F.gelu's float64 for x < -8).
    exact = {"none": x64 * 0.5 * torch.special.erfc(-x64 / 2**0.5), "tanh": x64 * torch.sigmoid(2 * u)}
    for approximate in ("none", "tanh"):
        want = exact[approximate]
        a = gelu_op(x, approximate).double()
        # eps * |a| plus the subnormal spacing; Triton's 0.5 (1 + erf) in float32 (the eager formula)
        # also carries float32's absolute error in the left tail, where the C++ erfc form does not.
        info = torch.finfo(dtype)
        ulp = info.eps * want.abs() + info.eps * info.tiny
        if backend == "triton":
            ulp = ulp + 2 * torch.finfo(torch.float32).eps * x64.abs()
        assert ((a - want).abs() <= ulp).all(), approximate
        g = torch.full_like(x, 0.75)
        gelu_backward_op(g, x, approximate)
        xr = x.double().requires_grad_(True)
        (dwant,) = torch.autograd.grad(F.gelu(xr, approximate=approximate), xr, torch.full_like(xr, 0.75))
        assert ((g.double() - dwant).abs() <= torch.finfo(dtype).eps * dwant.abs().clamp_min(1e-3)).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16bit_kernels_round_the_float_kernel(dtype, backend):
    """A 16-bit call is the float32 kernel on the widened input, rounded once by torch: bit for bit."""
    x = (torch.randn(3, 1001, generator=torch.Generator().manual_seed(3)) * 4).to(dtype)
    x[0, :4] = torch.tensor([float("inf"), -0.0, 0.0, 70000.0 if dtype == torch.bfloat16 else 65504.0])
    for approximate in ("none", "tanh"):
        exact = dict(rtol=0, atol=0, equal_nan=True)  # gelu'(inf) may be inf * 0
        torch.testing.assert_close(gelu_op(x, approximate), gelu_op(x.float(), approximate).to(dtype),
                                   **exact)
        g16 = (torch.randn(3, 1001) * 2).to(dtype)
        g32 = g16.float()
        # that inf * 0 is NaN, silently on a GPU and in C++; the Triton interpreter's numpy reports it
        with np.errstate(invalid="ignore"):
            gelu_backward_op(g16, x, approximate)
            gelu_backward_op(g32, x.float(), approximate)
        torch.testing.assert_close(g16, g32.to(dtype), **exact)
