"""The compiled Triton kernels on a GPU (marked `cuda`, skipped without one; run by bench/gpu.sh):
the interpreter tests' cases against the float64 reference, a grid with B*H > 65535, and a CUDA
graph capturing a whole SelectiveDecoderLayer training step with dropout on (seeds are read by the
kernels from device memory, so nothing in the step synchronises with the host)."""

import pytest
import torch

from selective_ckpt import rng
from tests.reference import assert_within_rule

pytestmark = pytest.mark.cuda


def _helpers():
    from tests import test_attention_triton as t

    return t


def _run_case(name, device="cuda"):
    t = _helpers()
    from selective_ckpt.triton_kernels import attention as tk
    from selective_ckpt.triton_kernels.philox import seed_tensor

    B, H, Hkv, Sq, Sk, D, dtype, causal, window, padding, docs, p, packed = t.CASES[name]
    q, k, v = (x.to(device) for x in t.inputs(B, H, Hkv, Sq, Sk, D, dtype, packed))
    pad = None
    if padding:
        pad = torch.rand(B, Sk, generator=torch.Generator().manual_seed(5)) > 0.3
        pad[:, 0] = True
        pad[0] = False
        pad = pad.to(device)
    cu = torch.tensor([0, *torch.tensor(docs).cumsum(0).tolist()], dtype=torch.int32) if docs else None
    seed, scale = 0xDEAD_BEEF_1234_5678, D**-0.5
    grad = torch.randn(B, H, Sq, D, generator=torch.Generator().manual_seed(7))
    o = torch.empty(B, Sq, H, D, dtype=dtype, device=device).permute(0, 2, 1, 3)
    lse = torch.empty(B, H, Sq, dtype=torch.float32, device=device)
    t16, ks = rng.threshold(p), rng.keep_scale(p)
    sd = seed_tensor(seed, device) if p > 0 else None
    cud = cu.to(device) if cu is not None else None
    tk.forward(q, k, v, o, lse, pad, cud, causal, window, scale, sd, t16, ks)
    dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
    tk.backward(grad.to(device, dtype).contiguous(), q, k, v, o, lse, pad, cud, causal, window, scale, sd, t16, ks,
                dq, dk, dv)
    kw = dict(causal=causal, window=window, pad=pad.cpu() if pad is not None else None, cu=cu, p=p, seed=seed,
              scale=scale)
    cpu = [x.cpu() for x in (q, k, v)]
    plain = t.grads_of(lambda a, b, c: t.eager(a.float(), b.float(), c.float(), **kw).to(dtype), *cpu, grad)
    ref = t.grads_of(lambda a, b, c: t.eager(a, b, c, **kw), *(x.double() for x in cpu), grad.double())
    for nm, x, e, r, factor in zip(("o", "dq", "dk", "dv"), (o, dq, dk, dv), plain, ref, (2, 3, 3, 3)):
        # fp32 eager on the CPU is the comparator for 16-bit too: the GPU kernels accumulate in fp32
        assert_within_rule(x.cpu(), e.to(x.dtype), r, factor, floor=1e-2 if dtype != torch.float32 else 1e-4,
                           name=nm)


@pytest.mark.parametrize("name", ["fp32-causal-pad-drop", "bf16-causal-window-drop-d24", "fp16-gqa-causal-drop-even",
                                  "bf16-varlen-gqa-causal-window-drop", "fp16-packed", "bf16-mqa-drop-empty-row"])
def test_compiled_kernels_against_float64(name):
    _run_case(name)


def test_more_than_65535_batch_heads():
    from selective_ckpt.triton_kernels import attention as tk

    B, H, S, D = 2, 33000, 16, 16
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.float16) for _ in range(3))
    o, lse = torch.empty_like(q), torch.empty(B, H, S, device="cuda")
    tk.forward(q, k, v, o, lse, None, None, True, 0, D**-0.5, None, 0, 1.0)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert (o.float() - want.float()).abs().max() < 1e-2


def test_cuda_graph_replays_a_training_step_with_dropout():
    import selective_ckpt

    torch.manual_seed(0)
    layer = selective_ckpt.SelectiveDecoderLayer(256, 4, dropout=0.1, attn_dropout=0.1, device="cuda",
                                                 dtype=torch.bfloat16)
    x = torch.randn(2, 128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn_like(x)

    def step():
        y = layer(x)
        y.backward(gy)
        return y

    def grads():
        return [p.grad.clone() for p in layer.parameters()] + [x.grad.clone()]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up: compile kernels, settle the allocator
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    for p in [*layer.parameters(), x]:
        p.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_graph = step()

    for s in (1, 2):
        torch.manual_seed(s)
        graph.replay()
        torch.cuda.synchronize()
        got_y, got = y_graph.clone(), grads()
        for p in [*layer.parameters(), x]:
            p.grad = None
        torch.manual_seed(s)
        want_y = step()
        want = grads()
        assert torch.equal(got_y, want_y), f"seed {s}: output differs"
        for a, b in zip(got, want):
            assert torch.equal(a, b), f"seed {s}: a gradient differs"
        for p in [*layer.parameters(), x]:
            p.grad = None
        # the graph's own gradient buffers were overwritten by the replay, not accumulated
