"""attention with a value head dim Dv other than q and k's D (multi-head latent attention: q and k carry a rotary
part v lacks, 192 against 128 in DeepSeek-V3): o, dO and dV have Dv, q, k, dQ, dK have D. Through the public
function on the C++ kernels and the Triton kernels interpreted, against float64 eager attention with the
project's rule (2x outputs / 3x gradients the error of eager attention in the same dtype), with GQA, causal and
not, windows, padding, packed documents, query tiles (q_offset), soft-capping and dropout; argument checks."""

import pytest
import torch

import selective_ckpt
from selective_ckpt import backend
from tests.ops.test_attention_offset import check_against_reference

interpreted = pytest.mark.skipif(torch.cuda.is_available(), reason="Triton on CPU tensors runs interpreted only")

# (B, H, Hkv, Sq, Sk, D, q_offset, causal, window, padding, documents, softcap, dropout), Dv
CPP_CASES = {
    "mla-shape": ((1, 3, 3, 77, 77, 96, 0, True, 0, False, None, 0.0, 0.0), 64),
    "gqa-padded-dropout": ((2, 4, 2, 45, 45, 40, 0, True, 0, True, None, 0.0, 0.17), 24),
    "wider-value": ((1, 2, 1, 33, 33, 16, 0, False, 0, False, None, 0.0, 0.17), 80),
    "offset-window": ((2, 2, 2, 37, 113, 80, 40, True, 17, False, None, 0.0, 0.17), 48),
    "documents-offset": ((1, 4, 2, 45, 203, 80, 120, True, 0, False, (50, 77, 3, 40, 33), 0.0, 0.17), 33),
    "softcap-value-dim-1": ((1, 2, 1, 50, 130, 24, 60, True, 31, True, None, 30.0, 0.0), 1),
}


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("name", list(CPP_CASES))
def test_cpp_value_head_dim(name, dtype, use_backend):
    use_backend("cpp")
    case, Dv = CPP_CASES[name]
    o, dq, dk, dv = check_against_reference(case, dtype, Dv=Dv)
    assert o.shape[-1] == dv.shape[-1] == Dv and dq.shape[-1] == dk.shape[-1] == case[5]


TRITON_CASES = {
    "mla-like-ragged": ((1, 2, 2, 19, 19, 24, 0, True, 0, False, None, 0.0, 0.0), 16),
    "gqa-padded-dropout": ((2, 4, 2, 17, 23, 16, 0, False, 0, True, None, 0.0, 0.17), 40),
    "documents-offset": ((1, 2, 1, 23, 50, 24, 20, True, 0, False, (13, 17, 1, 19), 0.0, 0.17), 8),
    "window-softcap": ((1, 2, 1, 20, 47, 16, 27, True, 7, False, None, 20.0, 0.0), 24),
}


@interpreted
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("name", list(TRITON_CASES))
def test_triton_value_head_dim(name, dtype, use_backend):
    use_backend("triton")
    case, Dv = TRITON_CASES[name]
    check_against_reference(case, dtype, Dv=Dv)


def test_value_head_dim_runs_ours_whatever_the_setting(monkeypatch):
    """PyTorch's fused kernels are not dispatched to for Dv != D: a forced setting still runs ours (same bits)."""
    q, k = torch.randn(1, 2, 9, 24), torch.randn(1, 2, 9, 24)
    v = torch.randn(1, 2, 9, 8)
    ours = selective_ckpt.attention(q, k, v, causal=True)
    monkeypatch.setenv(backend.ATTENTION_ENV, "sdpa")
    assert torch.equal(selective_ckpt.attention(q, k, v, causal=True), ours)
    assert ours.shape == (1, 2, 9, 8)


def test_value_shape_checks():
    q, k = torch.randn(1, 2, 9, 24), torch.randn(1, 1, 9, 24)
    with pytest.raises(ValueError, match="v must have shape"):
        selective_ckpt.attention(q, k, torch.randn(1, 1, 7, 8))
    with pytest.raises(ValueError, match="value head dim Dv"):
        selective_ckpt.attention(q, k, torch.randn(1, 1, 9, 1000))
