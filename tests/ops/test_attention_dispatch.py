"""Which kernel runs an attention call (ops/attention_dispatch.py): the choice table branch by branch, PyTorch's CPU
flash kernel forced and held to the float64 rule, the fall-back to ours, and the same saved bytes either way."""

import logging
import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import selective_ckpt
from selective_ckpt import backend, memory
from selective_ckpt.ops import attention_dispatch as dispatch
from selective_ckpt.ops.attention import attention_bwd_op, attention_fwd_op
from tests.reference import assert_within_rule, attention_allowed

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
OURS, CPU_FLASH, FLASH, EFFICIENT = dispatch.OURS, dispatch.CPU_FLASH, dispatch.FLASH, dispatch.EFFICIENT


@pytest.fixture
def ran(monkeypatch):
    """The kernels attention_dispatch ran, in order: ("forward" | "backward", name)."""
    log = []
    for step in ("forward", "backward"):
        real = getattr(dispatch, step)
        monkeypatch.setattr(dispatch, step, lambda name, *a, _s=step, _f=real: log.append((_s, name)) or _f(name, *a))
    itself = dispatch.cpu_flash_as_itself
    monkeypatch.setattr(dispatch, "cpu_flash_as_itself", lambda *a: log.append(("itself", CPU_FLASH)) or itself(*a))
    return log


def call(device="cuda", capability=(9, 0), dtype=BF16, D=128, H=8, Hkv=8, Sq=512, Sk=512, causal=True,
         padding=False, documents=False, window=0, dropout=False, softcap=False, q_offset=0, extra=False,
         flash=True, efficient=True):
    return dispatch.Call(device, capability, dtype, D, H, Hkv, Sq, Sk, causal, padding, documents, window, dropout,
                         softcap, q_offset, extra, flash, efficient)


# ---------------------------------------------------------------------------------------------
# The choice, a pure function

CUDA_TABLE = [
    # (call, setting, expected, why)
    (call(), "auto", FLASH, "bf16 causal self-attention, sm90"),
    (call(dtype=F16, capability=(8, 0)), "auto", FLASH, "fp16, sm80"),
    (call(capability=(12, 0), D=64), "auto", FLASH, "a newer GPU"),
    (call(causal=False, Sq=17, Sk=70), "auto", FLASH, "no causal: any lengths"),
    (call(Hkv=2), "auto", FLASH, "GQA is native to FlashAttention"),
    (call(Sq=128, Sk=512, q_offset=384), "auto", FLASH, "a query tile at the end: bottom-right causal"),
    (call(Sq=1, Sk=70, q_offset=69), "auto", FLASH, "one query row at the end"),
    (call(window=64), "auto", FLASH, "sliding window, causal"),
    (call(window=64, causal=False), "auto", FLASH, "sliding window, not causal"),
    (call(documents=True), "auto", FLASH, "packed documents: varlen"),
    (call(documents=True, window=32, Hkv=2), "auto", FLASH, "documents, window and GQA"),
    (call(D=256, capability=(9, 0)), "auto", FLASH, "D 256 on sm90"),
    (call(D=256, capability=(8, 6)), "auto", OURS, "D 256 backward needs sm80 or sm90; too wide for efficient"),
    (call(D=160, capability=(8, 6)), "auto", FLASH, "D 160 on sm86"),
    (call(D=200, capability=(8, 9)), "auto", OURS, "D 200 on sm89: neither kernel"),
    (call(D=192, capability=(8, 9), causal=False), "auto", FLASH, "D 192 on sm89"),
    (call(dtype=F32), "auto", EFFICIENT, "fp32: memory-efficient"),
    (call(dtype=F32, Hkv=2), "auto", OURS, "fp32 GQA: no PyTorch kernel without expanding k, v"),
    (call(dtype=F32, window=64), "auto", OURS, "fp32 window"),
    (call(dtype=F32, documents=True), "auto", OURS, "fp32 documents"),
    (call(padding=True), "auto", EFFICIENT, "padding: an additive bias, memory-efficient"),
    (call(padding=True, Hkv=4), "auto", OURS, "padding with GQA"),
    (call(padding=True, window=16), "auto", OURS, "padding with a window"),
    (call(Sq=256, Sk=512), "auto", EFFICIENT, "top-left causal, Sq < Sk: not FlashAttention's alignment"),
    (call(Sq=256, Sk=512, Hkv=2), "auto", OURS, "top-left causal with GQA"),
    (call(Sq=128, Sk=512, q_offset=128), "auto", OURS, "a query tile in the middle, causal"),
    (call(Sq=128, Sk=512, q_offset=128, causal=False), "auto", FLASH, "q_offset without causal changes nothing"),
    (call(Sq=128, Sk=512, q_offset=384, padding=True), "auto", EFFICIENT, "tile at the end, padded: bottom-right"),
    (call(Sq=256, Sk=512, window=16), "auto", OURS, "a window misaligned for FlashAttention"),
    (call(documents=True, Sq=128, Sk=512, q_offset=384), "auto", OURS, "a document tile"),
    (call(D=70), "auto", OURS, "D not a multiple of 8"),
    (call(D=80, dtype=F32), "auto", EFFICIENT, "D 80 fp32"),
    (call(D=136, dtype=F32), "auto", OURS, "D over 128 in fp32"),
    (call(capability=(7, 5), dtype=F16), "auto", EFFICIENT, "sm75: no FlashAttention"),
    (call(capability=(7, 5), dtype=F16, Hkv=2), "auto", OURS, "sm75 GQA"),
    (call(capability=(3, 7), dtype=F32), "auto", OURS, "too old a GPU"),
    (call(flash=False), "auto", EFFICIENT, "a build without FlashAttention"),
    (call(flash=False, efficient=False), "auto", OURS, "neither kernel in the build"),
    (call(dropout=True), "auto", OURS, "dropout: the contract's mask"),
    (call(softcap=True), "auto", OURS, "soft-capping"),
    (call(extra=True), "auto", OURS, "an argument PyTorch's kernels do not take"),
    (call(Sq=0), "auto", OURS, "an empty problem"),
    (call(), "ours", OURS, "forced ours"),
    (call(), "sdpa", FLASH, "sdpa: the first PyTorch kernel that expresses it"),
    (call(), "sdpa_efficient", EFFICIENT, "forced memory-efficient"),
    (call(Hkv=2), "sdpa_efficient", OURS, "forced memory-efficient where it cannot: ours"),
    (call(dtype=F32), "sdpa_flash", OURS, "forced FlashAttention in fp32: ours"),
    (call(), "sdpa_cpu_flash", OURS, "the CPU kernel on a CUDA call: ours"),
    (call(device="mps", capability=()), "sdpa", OURS, "another device"),
]


@pytest.mark.parametrize("c, name, expected, why", CUDA_TABLE, ids=[row[3] for row in CUDA_TABLE])
def test_cuda_choice(c, name, expected, why):
    assert dispatch.choose(c, name) == expected, why


CPU_TABLE = [
    (call(device="cpu", capability=()), "auto", OURS, "auto: bf16 is ours at every length"),
    (call(device="cpu", capability=(), dtype=F32, Sq=255, Sk=255), "auto", CPU_FLASH, "auto: fp32, few keys"),
    (call(device="cpu", capability=(), dtype=F32, Sq=256, Sk=256), "auto", OURS, "auto: fp32, the crossover"),
    (call(device="cpu", capability=(), dtype=F32, Sq=64, Sk=64, window=8), "auto", OURS, "auto: fp32, a window"),
    (call(device="cpu", capability=(), dtype=F32, Sq=64, Sk=64, dropout=True), "auto", OURS, "auto: fp32, dropout"),
    (call(device="cpu", capability=()), "sdpa", CPU_FLASH, "causal"),
    (call(device="cpu", capability=(), dtype=F32, D=3, Hkv=2, padding=True), "sdpa", CPU_FLASH, "padding, GQA"),
    (call(device="cpu", capability=(), causal=False, Sq=1, Sk=70, q_offset=69), "sdpa_cpu_flash", CPU_FLASH,
     "q_offset without causal"),
    (call(device="cpu", capability=(), Sq=1, Sk=70, q_offset=69), "sdpa", OURS, "q_offset with causal"),
    (call(device="cpu", capability=(), window=8), "sdpa", OURS, "window"),
    (call(device="cpu", capability=(), documents=True), "sdpa", OURS, "documents"),
    (call(device="cpu", capability=(), dropout=True), "sdpa", OURS, "dropout"),
    (call(device="cpu", capability=(), softcap=True), "sdpa", OURS, "soft-capping"),
    (call(device="cpu", capability=(), extra=True), "sdpa", OURS, "a further argument"),
    (call(device="cpu", capability=()), "sdpa_flash", OURS, "a CUDA kernel on a CPU call"),
    (call(device="cpu", capability=()), "ours", OURS, "forced ours"),
]


@pytest.mark.parametrize("c, name, expected, why", CPU_TABLE, ids=[row[3] for row in CPU_TABLE])
def test_cpu_choice(c, name, expected, why):
    assert dispatch.choose(c, name) == expected, why


def heads_apart(t):
    """t laid out [B, S, H, D] in memory, seen as [B, H, S, D]: a projection's output viewed into heads."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


THROUGH_THE_OP = [("forward", CPU_FLASH), ("backward", CPU_FLASH)]
AUTO_CASES = [  # (dtype, S, padding, q laid out [B, S, H, D], what "auto" runs): docs/kernels/attention.md
    (F32, 17, False, True, [("itself", CPU_FLASH)]),  # the kernel under its own autograd node
    (F32, 17, False, False, THROUGH_THE_OP),  # its o would be laid out [B, H, S, D]: the op copies it
    (F32, 17, True, True, THROUGH_THE_OP),  # a padding mask
    (F32, dispatch.CPU_FLASH_BELOW, False, True, []),
    (BF16, 17, False, True, []),
]


@pytest.mark.parametrize("dtype, S, padding, apart, expected", AUTO_CASES, ids=lambda c: str(c).replace("torch.", ""))
def test_cpu_auto_runs_the_measured_kernel_within_the_rule(dtype, S, padding, apart, expected, setting, ran):
    setting("auto")
    q, k, v = (heads_apart(t) if apart else t for t in inputs(1, 4, 2, S, S, 16, dtype))
    kw = dict(causal=True, key_padding_mask=_padding(1, S) if padding else None)
    check_rule(q, k, v, kw)
    assert ran == expected


def test_cpu_auto_keeps_what_the_op_keeps(setting, ran):
    """The kernel as itself keeps the bytes our op keeps, the output laid out as the op's."""
    q, k, v = (heads_apart(t) for t in inputs(2, 4, 2, 33, 33, 16, F32))
    kept = {}
    for name in ("ours", "auto"):
        setting(name)
        saved = []
        x, y, z = (t.detach().clone().requires_grad_() for t in (q, k, v))
        with torch.autograd.graph.saved_tensors_hooks(lambda t, into=saved: into.append(t) or t, lambda t: t):
            o = selective_ckpt.attention(x, y, z, causal=True)
        kept[name] = sorted(t.numel() * t.element_size() for t in saved)
        assert o.permute(0, 2, 1, 3).is_contiguous()  # the out-projection reads the buffer without a copy
    assert ran == [("itself", CPU_FLASH)]
    assert kept["auto"] == kept["ours"]


def test_cpu_auto_names_the_classes_of_what_it_keeps(setting, ran):
    """Where the layer pipeline reads classes (here an observer's, as the memory ledger's), the kernel as itself
    shows it q, k, v as "qkv" and o, lse as "attention", as the op does."""
    from selective_ckpt.keeping import pipeline

    class Recorder:
        def __init__(self):
            self.notes = []

        def pack(self, t):
            return t

        def note(self, t, cls, handle):
            self.notes.append((t.numel() * t.element_size(), cls))

    notes = {}
    for name in ("ours", "auto"):
        setting(name)
        q, k, v = (heads_apart(t).requires_grad_() for t in inputs(1, 4, 2, 33, 33, 16, F32))
        rec = Recorder()
        with pipeline.observe(rec), torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t):
            with pipeline.scope("selective"):
                selective_ckpt.attention(q, k, v, causal=True)
        notes[name] = sorted(rec.notes)
    assert ran == [("itself", CPU_FLASH)]
    assert [cls for _, cls in notes["auto"]].count("attention") == 2
    assert notes["auto"] == notes["ours"]


def test_setting_is_checked_and_names_itself(monkeypatch):
    with pytest.raises(ValueError, match="set_attention_backend's name"):
        selective_ckpt.set_attention_backend("flash2")
    with pytest.raises(TypeError, match="name must be a str"):
        selective_ckpt.set_attention_backend(None)
    monkeypatch.setenv(backend.ATTENTION_ENV, "fastest")
    with pytest.raises(ValueError, match=backend.ATTENTION_ENV):
        backend.attention_setting()
    monkeypatch.setenv(backend.ATTENTION_ENV, " SDPA ")
    assert backend.attention_setting() == "sdpa"
    monkeypatch.delenv(backend.ATTENTION_ENV)
    assert backend.attention_setting() == "auto"
    monkeypatch.setenv(backend.ATTENTION_ENV, "auto")
    selective_ckpt.set_attention_backend("ours")  # writes the variable monkeypatch restores
    assert backend.attention_setting() == "ours"


def test_the_choice_is_logged_once_per_kind(setting, caplog):
    setting("sdpa")
    dispatch._logged.clear()
    q, k, v = inputs(1, 2, 1, 5, 7, 16, F32)
    with caplog.at_level(logging.DEBUG, logger="selective_ckpt"):
        for _ in range(2):
            selective_ckpt.attention(q, k, v)
        selective_ckpt.attention(q, k, v, dropout_p=0.1, seed=3)
    lines = [r.getMessage() for r in caplog.records if "selective_ckpt.attention runs" in r.getMessage()]
    assert len(lines) == 2, lines
    assert "runs sdpa_cpu_flash (setting 'sdpa')" in lines[0] and "runs ours" in lines[1]


# ---------------------------------------------------------------------------------------------
# The CPU flash kernel forced: the float64 rule

def inputs(B, H, Hkv, Sq, Sk, D, dtype, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, S, D, generator=g).to(device=device, dtype=dtype) for h, S in ((H, Sq), (Hkv, Sk),
                                                                                               (Hkv, Sk))]


def reference(q, k, v, causal=False, mask=None, q_offset=0, window=0, cu=None, scale=None, softcap=None):
    """Plain attention in q's dtype with the semantics' mask: the materialised softmax, k and v expanded."""
    B, H, Sq, D = q.shape
    Sk, group = k.shape[2], H // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    allow = attention_allowed(B, Sq, Sk, causal, window, None if mask is None else mask.cpu(),
                              None if cu is None else cu.cpu(), q_offset).to(q.device)
    s = (q @ k.transpose(-1, -2)) * (D**-0.5 if scale is None else scale)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    anything = allow.any(-1, keepdim=True)
    s = torch.where(anything, s.masked_fill(~allow, -math.inf), 0.0)
    return (torch.softmax(s, dim=-1) * anything) @ v


def run(fn, q, k, v, grad):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = fn(q, k, v)
    o.backward(grad.to(o.dtype))
    return o.detach(), q.grad, k.grad, v.grad


def check_rule(q, k, v, kw, f32_abs=2e-5):
    """selective_ckpt.attention(**kw) against plain PyTorch in the same dtype and float64, the rule's factors."""
    grad = torch.randn(q.shape[0], q.shape[1], q.shape[2], q.shape[3], generator=torch.Generator().manual_seed(7))
    grad = grad.to(q.device)
    ref_kw = dict(causal=kw.get("causal", False), mask=kw.get("key_padding_mask"), q_offset=kw.get("q_offset", 0),
                  window=kw.get("sliding_window") or 0, cu=kw.get("cu_seqlens"), scale=kw.get("softmax_scale"),
                  softcap=kw.get("softcap"))
    ours = run(lambda a, b, c: selective_ckpt.attention(a, b, c, **kw), q, k, v, grad)
    eager = run(lambda a, b, c: reference(a, b, c, **ref_kw), q, k, v, grad)
    ref = run(lambda a, b, c: reference(a, b, c, **ref_kw), q.double(), k.double(), v.double(), grad)
    for name, x, e, r, factor in zip(("o", "dq", "dk", "dv"), ours, eager, ref, (2, 3, 3, 3)):
        assert_within_rule(x, e, r, factor, name=name)
        if q.dtype == F32:
            assert (x.double() - r).abs().max() < f32_abs, name
    return ours


def _padding(B, Sk, empty=False):
    mask = torch.rand(B, Sk, generator=torch.Generator().manual_seed(1)) > 0.3
    mask[:, 0] = True
    if empty:
        mask[0] = False  # batch 0 attends nothing: o = 0, lse = +inf, zero gradients
    return mask


# (B, H, Hkv, Sq, Sk, D, causal, padding, empty batch, q_offset)
CPU_FLASH_CASES = [
    (1, 1, 1, 1, 1, 16, False, False, False, 0),
    (2, 2, 2, 17, 17, 64, True, False, False, 0),
    (2, 4, 2, 70, 70, 128, True, False, False, 0),
    (2, 3, 3, 17, 70, 32, False, True, True, 0),
    (1, 4, 1, 70, 17, 80, True, True, False, 0),
    (2, 2, 1, 1, 70, 16, False, True, False, 69),
    (1, 8, 2, 70, 70, 96, False, False, False, 0),
    (2, 2, 2, 70, 17, 48, True, False, False, 0),
]


@pytest.mark.parametrize("dtype", (F32, BF16), ids=str)
@pytest.mark.parametrize("case", CPU_FLASH_CASES, ids=lambda c: "-".join(map(str, c)))
def test_cpu_flash_forced_meets_the_rule(case, dtype, setting, ran):
    setting("sdpa")
    B, H, Hkv, Sq, Sk, D, causal, padding, empty, q_offset = case
    q, k, v = inputs(B, H, Hkv, Sq, Sk, D, dtype)
    kw = dict(causal=causal, key_padding_mask=_padding(B, Sk, empty) if padding else None, q_offset=q_offset)
    o = check_rule(q, k, v, kw)[0]
    assert ran == [("forward", CPU_FLASH), ("backward", CPU_FLASH)]
    if empty:
        assert (o[0] == 0).all()


def test_cpu_flash_empty_rows_keep_the_lse_convention(setting):
    setting("sdpa")
    q, k, v = inputs(2, 2, 1, 5, 9, 16, F32)
    mask = _padding(2, 9, empty=True)
    o, lse = attention_fwd_op(q, k, v, mask, None, False, 0, 0.0, 0.25, None, 0.0, 0)
    setting("ours")
    o2, lse2 = attention_fwd_op(q, k, v, mask, None, False, 0, 0.0, 0.25, None, 0.0, 0)
    assert torch.isinf(lse[0]).all() and (lse[0] > 0).all()
    assert torch.allclose(lse, lse2, atol=1e-5) and torch.allclose(o, o2, atol=1e-5)
    assert o.shape == o2.shape and o.stride() == o2.stride() and lse.stride() == lse2.stride()


FALL_BACK = {
    "dropout": dict(causal=True, dropout_p=0.17, seed=1234),
    "softcap": dict(causal=True, softcap=5.0),
    "window": dict(causal=True, sliding_window=5),
    "documents": dict(causal=True, cu_seqlens=torch.tensor([0, 6, 6, 17], dtype=torch.int32)),
    "causal tile": dict(causal=True, q_offset=10),
}


@pytest.mark.parametrize("what", list(FALL_BACK))
def test_sdpa_falls_back_to_ours_where_it_cannot_express_the_call(what, setting, ran):
    kw = FALL_BACK[what]
    q, k, v = inputs(1, 4, 2, 17 - kw.get("q_offset", 0), 17, 32, F32)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(2))
    got = {}
    for name in ("sdpa", "ours"):
        setting(name)
        got[name] = run(lambda a, b, c: selective_ckpt.attention(a, b, c, **kw), q, k, v, grad)
    assert ran == []
    for a, b in zip(got["sdpa"], got["ours"]):
        assert torch.equal(a, b)
    if what != "dropout":  # the dropout rule is test_attention's; the rest against float64 here
        setting("sdpa")
        check_rule(q, k, v, kw, f32_abs=5e-5)


# ---------------------------------------------------------------------------------------------
# What is kept, and the op's other paths

def _saved(setting_name, setting, q, k, v, mask):
    setting(setting_name)
    saved = []
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        o = selective_ckpt.attention(q, k, v, causal=True, key_padding_mask=mask)
    rep = memory.ledger(lambda a, b, c: selective_ckpt.attention(a, b, c, causal=True, key_padding_mask=mask), q, k, v)
    return [(tuple(t.shape), t.stride(), t.dtype) for t in saved], rep, o


@pytest.mark.parametrize("dtype", (F32, BF16), ids=str)
def test_the_same_bytes_are_kept_whichever_kernel(dtype, setting, ran):
    qkv = torch.randn(2, 70, 8, 32).to(dtype)  # views of one packed projection, H = 4, Hkv = 2
    q, k, v = (qkv[:, :, a:b].permute(0, 2, 1, 3) for a, b in ((0, 4), (4, 6), (6, 8)))
    mask = _padding(2, 70)
    ours_saved, ours_rep, _ = _saved("ours", setting, q, k, v, mask)
    sdpa_saved, sdpa_rep, o = _saved("sdpa", setting, q, k, v, mask)
    assert ("forward", CPU_FLASH) in ran
    assert sdpa_saved == ours_saved
    assert sdpa_rep.total == ours_rep.total > 0
    assert sorted(e.bytes for e in sdpa_rep.entries) == sorted(e.bytes for e in ours_rep.entries)
    assert o.permute(0, 2, 1, 3).is_contiguous()  # the out-projection reads the buffer without a copy


def test_backward_runs_the_forwards_kernel_and_is_deterministic(setting, ran):
    setting("sdpa")
    q, k, v = inputs(2, 4, 2, 33, 33, 64, BF16)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))
    kw = dict(causal=True, key_padding_mask=_padding(2, 33))
    a = run(lambda x, y, z: selective_ckpt.attention(x, y, z, **kw), q, k, v, grad)
    b = run(lambda x, y, z: selective_ckpt.attention(x, y, z, **kw), q, k, v, grad)
    assert ran == [("forward", CPU_FLASH), ("backward", CPU_FLASH)] * 2
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("before", [None, "warn_only", "on"])
def test_cuda_backwards_run_deterministic_and_leave_the_flag_as_it_was(before):
    # PyTorch's CUDA attention backwards are deterministic only under the flag (warn-only is not enough)
    previous = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        torch.use_deterministic_algorithms(before is not None, warn_only=before == "warn_only")
        with dispatch.deterministic():
            assert torch.are_deterministic_algorithms_enabled()
            assert not torch.is_deterministic_algorithms_warn_only_enabled()
        assert torch.are_deterministic_algorithms_enabled() == (before is not None)
        assert torch.is_deterministic_algorithms_warn_only_enabled() == (before == "warn_only")
        with pytest.raises(RuntimeError, match="inside"):
            with dispatch.deterministic():
                raise RuntimeError("inside")
        assert torch.are_deterministic_algorithms_enabled() == (before is not None)
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])


def test_a_setting_changed_between_forward_and_backward_still_gives_right_gradients(setting):
    # The saved o and lse mean the same for every kernel, so either backward reads the other's forward.
    q, k, v = inputs(2, 4, 2, 17, 17, 32, F32)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(4))
    mask = _padding(2, 17, empty=True)
    for first, second in (("sdpa", "ours"), ("ours", "sdpa")):
        x, y, z = (t.detach().clone().requires_grad_() for t in (q, k, v))
        setting(first)
        o = selective_ckpt.attention(x, y, z, causal=True, key_padding_mask=mask)
        setting(second)
        o.backward(grad)
        ref = run(lambda a, b, c: reference(a, b, c, causal=True, mask=mask), q.double(), k.double(), v.double(), grad)
        for got, r in zip((o, x.grad, y.grad, z.grad), ref):
            assert (got.detach().double() - r).abs().max() < 2e-5


def test_opcheck_fake_and_meta_under_sdpa(setting):
    setting("sdpa")
    q, k, v = inputs(2, 4, 2, 17, 23, 16, F32)
    mask = _padding(2, 23)
    args = (q, k, v, mask, None, True, 0, 0.0, 0.25, None, 0.0, 0)
    torch.library.opcheck(attention_fwd_op, args)
    o, lse = attention_fwd_op(*args)
    do = torch.randn(2, 4, 17, 16)
    torch.library.opcheck(attention_bwd_op, (do, q, k, v, o.permute(0, 2, 1, 3), lse) + args[3:])
    with FakeTensorMode() as mode:
        fq, fk, fv, fmask = (mode.from_tensor(t) for t in (q, k, v, mask))
        fo, flse = attention_fwd_op(fq, fk, fv, fmask, None, True, 0, 0.0, 0.25, None, 0.0, 0)
    assert fo.shape == o.shape and fo.stride() == o.stride() and flse.stride() == lse.stride()
    mo, mlse = attention_fwd_op(*(t.to("meta") for t in (q, k, v, mask)), None, True, 0, 0.0, 0.25, None, 0.0, 0)
    assert mo.shape == o.shape and mlse.shape == lse.shape


def test_eager_direct_path_matches_the_dispatcher_under_sdpa(setting, ran):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    setting("sdpa")
    q, k, v = inputs(2, 4, 2, 17, 17, 16, F32)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(5))
    direct = run(lambda a, b, c: selective_ckpt.attention(a, b, c, causal=True), q, k, v, grad)
    with Passthrough():
        dispatched = run(lambda a, b, c: selective_ckpt.attention(a, b, c, causal=True), q, k, v, grad)
    assert ran == [("forward", CPU_FLASH), ("backward", CPU_FLASH)] * 2
    for a, b in zip(direct, dispatched):
        assert torch.equal(a, b)


def test_torch_compile_runs_the_dispatched_kernel(setting, ran):
    setting("sdpa")
    q, k, v = inputs(1, 2, 1, 17, 17, 16, F32)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(6))
    fn = lambda a, b, c: selective_ckpt.attention(a, b, c, causal=True)  # noqa: E731
    eager = run(fn, q, k, v, grad)
    compiled = run(torch.compile(fn, backend="aot_eager", fullgraph=True), q, k, v, grad)
    assert ("forward", CPU_FLASH) in ran and ("backward", CPU_FLASH) in ran
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# On a GPU: each PyTorch kernel forced, against float64

CUDA_CASES = [
    # (kernel, dtype, B, H, Hkv, Sq, Sk, D, kw)
    (FLASH, BF16, 2, 4, 2, 70, 70, 64, dict(causal=True)),
    (FLASH, F16, 1, 4, 4, 17, 70, 128, dict(causal=True, q_offset=53)),
    (FLASH, BF16, 1, 4, 1, 70, 70, 64, dict(causal=True, sliding_window=9)),
    (FLASH, BF16, 1, 2, 2, 70, 70, 32, dict(causal=False, sliding_window=9)),
    (FLASH, BF16, 1, 4, 2, 70, 70, 64, dict(causal=True, cu_seqlens=[0, 17, 17, 50, 70])),
    (EFFICIENT, F32, 2, 4, 4, 70, 70, 64, dict(causal=True)),
    (EFFICIENT, BF16, 2, 2, 2, 17, 70, 80, dict(causal=False, key_padding_mask="empty")),
    (EFFICIENT, F16, 1, 2, 2, 17, 70, 64, dict(causal=True, q_offset=53, key_padding_mask="some")),
    (EFFICIENT, F32, 2, 2, 2, 33, 70, 16, dict(causal=True)),
]


@pytest.mark.cuda
@pytest.mark.parametrize("case", CUDA_CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[-1]}")
def test_cuda_kernel_forced_meets_the_rule(case, setting, ran):
    name, dtype, B, H, Hkv, Sq, Sk, D, kw = case
    setting(name)
    kw = dict(kw)
    if "cu_seqlens" in kw:
        kw["cu_seqlens"] = torch.tensor(kw["cu_seqlens"], dtype=torch.int32, device="cuda")
    if "key_padding_mask" in kw:
        kw["key_padding_mask"] = _padding(B, Sk, kw["key_padding_mask"] == "empty").cuda()
    q, k, v = inputs(B, H, Hkv, Sq, Sk, D, dtype, device="cuda")
    first = check_rule(q, k, v, kw, f32_abs=1e-4)
    assert ran == [("forward", name), ("backward", name)]
    again = check_rule(q, k, v, kw, f32_abs=1e-4)
    for a, b in zip(first, again):  # deterministic: the same bits
        assert torch.equal(a, b)
    setting("ours")
    o_ours, lse_ours = attention_fwd_op(q, k, v, kw.get("key_padding_mask"), kw.get("cu_seqlens"), kw["causal"],
                                        kw.get("sliding_window", 0), 0.0, D**-0.5, None, 0.0, kw.get("q_offset", 0))
    setting(name)
    o2, lse = attention_fwd_op(q, k, v, kw.get("key_padding_mask"), kw.get("cu_seqlens"), kw["causal"],
                               kw.get("sliding_window", 0), 0.0, D**-0.5, None, 0.0, kw.get("q_offset", 0))
    assert o2.stride() == o_ours.stride() and lse.shape == lse_ours.shape and lse.stride() == lse_ours.stride()
    assert torch.allclose(lse, lse_ours, atol=1e-2)  # the same logsumexp, +inf where a row attends nothing
