"""The fused layout's fast path (models/fused_layer.py): which converted layers take it, that it gives the generic
path's bits and keeps its bytes, and that anything it does not express (hooks, attention weights, another attention
implementation, a transformers whose forwards were not read) runs the generic path instead (LoRA:
test_fused_lora.py)."""

import copy

import pytest
import torch

from selective_ckpt import convert, set_recompute
from selective_ckpt.memory.peak import cpu_allocation_deltas
from selective_ckpt.models import fused_layer
from selective_ckpt.models.configuration import layer_estimate
from selective_ckpt.registry import recomputable_layers
from tests.models import hf_checks
from tests.models.families.gemma import FAMILIES as GEMMA
from tests.models.families.llama_shaped import FAMILIES as LLAMA_SHAPED
from tests.models.families.recent import FAMILIES as RECENT

transformers = pytest.importorskip("transformers")
FAMILY = {f.name: f for f in (*LLAMA_SHAPED, *GEMMA, *RECENT)}
FUSED = ("llama", "mistral", "qwen2", "gemma", "ministral")


def _generic(monkeypatch):
    """From now on converted layers see no fused layout (new models and layers whose modules change)."""
    monkeypatch.setattr(fused_layer, "layout_of", lambda layer: None)


def _step(model, ids, mask, autocast=False):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        return hf_checks._step(model, input_ids=ids, attention_mask=mask)


def test_the_installed_transformers_llama_forwards_were_read():
    """Every transformers the package supports (pyproject's range) has its Llama forwards in the verified tables: a
    release that changes them must be read before the range takes it in, or its Llama models lose the fast path."""
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaDecoderLayer

    assert fused_layer._verified_form(LlamaDecoderLayer, LlamaAttention) is not None, transformers.__version__


@pytest.mark.parametrize("name", FUSED)
def test_verified_families_take_the_fast_path_within_the_rule(name, fused_calls):
    """Each verified family's converted layers run fused, padded rows included; logits and every gradient within
    the rule against float64 (the family's sliding window, if any, applied as the unconverted model does)."""
    ref, plain, ours = hf_checks.triple(FAMILY[name].build())
    ids, mask = hf_checks.batch()
    hf_checks.assert_matches_reference(ref, plain, ours, input_ids=ids, attention_mask=mask)
    assert len(fused_calls) == len(recomputable_layers(ours))


@pytest.mark.parametrize("name", ["qwen3", "granite"])
def test_families_with_other_forwards_are_not_fused(name, fused_calls):
    """Qwen3 (q and k norms) and Granite (residual multipliers): their layers or attention compute more than the
    fused layout, so their forwards' fingerprints are not verified and they run the generic path."""
    _, _, ours = hf_checks.triple(FAMILY[name].build())
    layer = recomputable_layers(ours)[0]
    ids, mask = hf_checks.batch()
    ours(input_ids=ids, attention_mask=mask).logits.sum().backward()
    assert fused_layer.layout_of(layer) is None and not fused_calls


@pytest.mark.parametrize("call", ["padded-dropout", "plain"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast"])
@pytest.mark.parametrize("mode", ["selective", "none"])
def test_fused_and_generic_paths_give_the_same_bits(mode, autocast, call, monkeypatch, fused_calls):
    """The same model, fused and through the generic path (models/converted_layer.py): the same logits and
    gradients bit for bit, in fp32 and under bf16 autocast; with padding and attention dropout (one seed each), and
    without either, where the fused path makes its plain attention call (fused_layer._plain_attention)."""
    plain_calls = []
    plain = fused_layer._plain_attention
    monkeypatch.setattr(fused_layer, "_plain_attention", lambda *a: plain_calls.append(1) or plain(*a))
    torch.manual_seed(0)
    base = FAMILY["llama"].build(attention_dropout=0.1 if call == "padded-dropout" else 0.0)().train()
    ids, mask = hf_checks.batch(pad_rows=call == "padded-dropout")
    fused = convert(copy.deepcopy(base), recompute=mode)
    torch.manual_seed(5)
    logits, grads = _step(fused, ids, mask, autocast)
    assert fused_calls and len(plain_calls) == (len(fused_calls) if call == "plain" else 0)
    _generic(monkeypatch)
    generic = convert(copy.deepcopy(base), recompute=mode)
    calls = len(fused_calls)
    torch.manual_seed(5)
    logits_g, grads_g = _step(generic, ids, mask, autocast)
    assert len(fused_calls) == calls
    assert torch.equal(logits, logits_g)
    assert grads.keys() == grads_g.keys()
    for n in grads:
        assert torch.equal(grads[n], grads_g[n]), n


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast"])
def test_fused_path_keeps_the_generic_paths_bytes(autocast, monkeypatch):
    """What one layer keeps after forward (a 2-layer minus a 1-layer model, each after a first step: the generic
    path's first autocast call watches its casts), fused and generic: the same bytes, under autocast too (no
    16-bit copy of a weight is kept by either), and the estimate's."""
    ids, _ = hf_checks.batch(b=2, s=24, pad_rows=False)

    def kept():
        net = []
        for n in (1, 2):
            torch.manual_seed(0)
            model = convert(FAMILY["llama"].build(num_hidden_layers=n)().train())
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                model(input_ids=ids).logits.float().sum().backward()
                held = []
                net.append(sum(cpu_allocation_deltas(lambda m=model, h=held: h.append(m(input_ids=ids).logits))))
            del held
        return net[1] - net[0], model

    fused, model = kept()
    layer = recomputable_layers(model)[0]
    assert fused == layer_estimate(layer, ids.shape[1], ids.shape[0], autocast_dtype=torch.bfloat16 if autocast
                                   else None)
    _generic(monkeypatch)
    assert kept()[0] == fused


def test_what_the_fast_path_does_not_express_runs_the_generic_path(fused_calls):
    """A forward hook on a projection (it runs, and sees the projection's output), attention weights asked for (the
    next call without them is fused again) and another attention implementation each send the layer through the
    generic path (LoRA's cases: test_fused_lora.py)."""
    _, _, ours = hf_checks.triple(FAMILY["llama"].build())
    ids, mask = hf_checks.batch()
    seen = []
    handle = ours.model.layers[1].self_attn.q_proj.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    ours(input_ids=ids, attention_mask=mask).logits.sum().backward()
    handle.remove()
    assert len(fused_calls) == 1 and seen == [torch.Size([*ids.shape, 64])]

    fused_calls.clear()
    with pytest.warns(UserWarning, match="asks for the attention weights"):
        out = ours(input_ids=ids, attention_mask=mask, output_attentions=True)
    assert not fused_calls and len(out.attentions) == 2
    # transformers' capturing hooks stay on the attention modules, inert when nothing asks: fused again
    ours(input_ids=ids, attention_mask=mask).logits.sum().backward()
    assert len(fused_calls) == 2
    fused_calls.clear()

    ours.config._attn_implementation = "sdpa"
    ours(input_ids=ids, attention_mask=mask).logits.sum().backward()
    assert not fused_calls
    ours.config._attn_implementation = "selective_ckpt"


def test_checkpointed_modes_and_a_changed_forward_are_not_fused(fused_calls):
    """"full" and "attention-kept" run transformers' checkpoint of the class's forward (nothing fused), and so does
    a layer one of whose bypassed modules got a forward of its own after convert (it runs)."""
    _, _, ours = hf_checks.triple(FAMILY["llama"].build())
    ids, mask = hf_checks.batch()
    for mode in ("full", "attention-kept"):
        set_recompute(ours, mode)
        ours(input_ids=ids, attention_mask=mask).logits.sum().backward()
    assert not fused_calls
    set_recompute(ours, "selective")
    ours(input_ids=ids, attention_mask=mask).logits.sum().backward()
    assert len(fused_calls) == 2
    fused_calls.clear()
    # forwards set on a module after its layer's layout was read (its modules unchanged): they run
    attn = ours.model.layers[0].self_attn
    attn.forward = type(attn).forward.__get__(attn)
    seen = []
    up = ours.model.layers[1].mlp.up_proj
    up.forward = lambda x, up=up: seen.append(1) or torch.nn.functional.linear(x, up.weight, up.bias)
    ours(input_ids=ids, attention_mask=mask).logits.sum().backward()
    assert not fused_calls and seen == [1]


def test_fingerprint_ignores_layout_comments_decorators_and_the_docstring():
    """Forwards differing only in comments, blank lines, line breaks, decorators and docstring have one fingerprint;
    a changed operator or a string that is not the docstring gives another."""
    plain = "def f(self, x):\n    y = x * 2\n    return (y + 1)\n"
    dressed = ("@wraps(g)\ndef f(self, x):\n    \"\"\"Doc.\"\"\"\n    # note\n    y = x * 2  # why\n\n    return (y +\n"
               "            1)\n")
    fp = fused_layer.fingerprint_source
    assert fp(dressed) == fp(plain)
    assert fp(plain.replace("y + 1", "y - 1")) != fp(plain)
    assert fp(plain.replace("(y + 1)", "y + 1")) != fp(plain)  # tokens, not a syntax tree: parentheses count
    assert fp(plain.replace("    y = x * 2", "    'not a docstring'\n    y = x * 2")) == fp(plain)  # the first one is
    assert fp(plain.replace("return (y + 1)", "print('x')\n    return (y + 1)")) != fp(plain)


def test_offloading_and_the_ledger_see_the_fused_nodes_saves(fused_calls):
    """Under a policy that offloads every class the fused layers run (their saves classified by the pipeline), the
    engine copies bytes out and back, and the gradients are those of the policy keeping them, bit for bit; the
    ledger, observing, sees the fused path too, the mlp class at the estimate's bytes."""
    from selective_ckpt import keeping, memory
    from selective_ckpt.keeping.offload import OffloadEngine
    from selective_ckpt.keeping.streams import SimulatedStreams

    _, _, ours = hf_checks.triple(FAMILY["llama"].build(num_hidden_layers=3))
    ids, _ = hf_checks.batch(pad_rows=False)
    _, kept = _step(ours, ids, None)
    assert len(fused_calls) == 3
    engine = OffloadEngine(streams=SimulatedStreams(delay=2))
    set_recompute(ours, keeping.policy("selective", offload=["input", "qkv", "attention", "residual", "mlp"]),
                  engine=engine)
    _, offloaded = _step(ours, ids, None)
    assert len(fused_calls) == 6 and engine.stats()["d2h_bytes"] > 0
    assert offloaded.keys() == kept.keys() and all(torch.equal(offloaded[n], kept[n]) for n in kept)
    set_recompute(ours, "selective")
    report = memory.ledger(ours, input_ids=ids)
    assert len(fused_calls) == 9
    layer = recomputable_layers(ours)[0]
    name = next(n for n in report.by_layer if n != "-")
    parts = layer_estimate(layer, ids.shape[1], ids.shape[0], breakdown=True)
    assert report.by_class(layer=name)["mlp"] == {"device": parts["gate_out"] + parts["up_out"], "host": 0}


@pytest.mark.parametrize("head_dim", [16, 6, 5], ids=["D16", "D6", "odd-D5"])
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)],
                         ids=["fp32", "bf16-fp32-tables"])
def test_rope_node_gives_transformers_bits(head_dim, dtypes):
    """_Rope (a roll and a signed sin for even head dims, the halves' form for odd ones) against transformers'
    apply_rotary_pos_emb and its autograd: outputs and input gradients bit for bit, k with fewer heads than q."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(3)
    x_dtype, table_dtype = dtypes
    q = torch.randn(2, 7, 4, head_dim, generator=g).to(x_dtype)
    k = torch.randn(2, 7, 2, head_dim, generator=g).to(x_dtype)
    cos, sin = (torch.randn(2, 7, head_dim, generator=g).to(table_dtype) for _ in range(2))
    dq, dk = (torch.randn(2, 7, n, head_dim, generator=g).to(torch.promote_types(x_dtype, table_dtype))
              for n in (4, 2))
    results = []
    for run in ("ours", "transformers"):
        qs, ks = q.clone().requires_grad_(), k.clone().requires_grad_()
        if run == "ours":
            qo, ko = fused_layer._Rope.apply(qs, ks, cos, sin)
        else:  # transformers' layout: [B, heads, S, D], tables unsqueezed at dim 1
            qo, ko = (t.transpose(1, 2) for t in apply_rotary_pos_emb(qs.transpose(1, 2), ks.transpose(1, 2), cos,
                                                                      sin))
        torch.autograd.backward((qo, ko), (dq, dk))
        results.append((qo, ko, qs.grad, ks.grad))
    for a, b in zip(*results, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
