"""PEFT LoRA on the fused layout's fast path (lora_fusion.py, models/fused_layer.py): the adapters computed inside the
fused nodes give the generic path's bits and keep its bytes, match the unconverted PEFT model within the rule, and
what they do not express (several active adapters, a bias on lora_B, hooks, the "none" mode) runs PEFT's forward."""

import copy

import pytest
import torch

from selective_ckpt import convert
from selective_ckpt.memory.peak import cpu_allocation_deltas
from selective_ckpt.models.configuration import layer_estimate
from selective_ckpt.registry import recomputable_layers
from tests.models import hf_checks
from tests.models.families.llama_shaped import FAMILIES as LLAMA_SHAPED
from tests.models.test_fused_layer import _generic, _step

peft = pytest.importorskip("peft")
FAMILY = {f.name: f for f in LLAMA_SHAPED}


def _lora(model, **overrides):
    """`model` with PEFT LoRA (all linear layers, dropout 0.1 unless overridden), lora_B drawn non-zero so that every
    adapter weight gets a gradient."""
    config = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.1, "target_modules": "all-linear", **overrides}
    torch.manual_seed(1)
    model = peft.get_peft_model(model, peft.LoraConfig(**config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    return model.train()


def _two_steps(model, ids, mask, autocast):
    out = []
    for seed in (5, 6):
        torch.manual_seed(seed)  # the LoRA dropouts' seeds
        out.append(_step(model, ids, mask, autocast))
    return out


def _assert_same_steps(got, want):
    """Each step's (logits or loss, gradients) equal bit for bit, adapter gradients among them."""
    for (out, grads), (out_g, grads_g) in zip(got, want):
        assert torch.equal(out, out_g)
        assert grads.keys() == grads_g.keys() and any("lora_A" in n for n in grads)
        for n in grads:
            assert torch.equal(grads[n], grads_g[n]), n


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast"])
@pytest.mark.parametrize("lora", [{}, {"target_modules": ["q_proj", "v_proj", "down_proj"], "use_rslora": True},
                                  {"lora_dropout": 0.0}], ids=["all-linear", "some", "no-dropout"])
def test_lora_fused_and_generic_paths_give_the_same_bits(lora, autocast, monkeypatch, fused_calls):
    """LoRA on all or some projections, with or without dropout: the fused layers (the adapters inside their nodes,
    dropout rebuilt from seeds) and the generic path (PEFT's forward, the pipeline rebuilding) give the same logits
    and gradients bit for bit over two steps, fp32 and under bf16 autocast."""
    torch.manual_seed(0)
    base = FAMILY["llama"].build(attention_dropout=0.1)().train()
    ids, mask = hf_checks.batch()
    fused = convert(_lora(copy.deepcopy(base), **lora))
    steps = _two_steps(fused, ids, mask, autocast)
    assert len(fused_calls) == 2 * len(recomputable_layers(fused))
    _generic(monkeypatch)
    generic = convert(_lora(copy.deepcopy(base), **lora))
    calls = len(fused_calls)
    steps_g = _two_steps(generic, ids, mask, autocast)
    assert len(fused_calls) == calls
    _assert_same_steps(steps, steps_g)


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_lora_fused_layers_match_the_unconverted_peft_model(name, fused_calls):
    """Against the unconverted PEFT model (no dropout, whose masks are torch's there): logits and every gradient,
    the adapters' included, within the rule against the float64 PEFT model."""
    torch.manual_seed(0)
    plain = _lora(FAMILY[name].build()(), lora_dropout=0.0)
    plain.config._attn_implementation = hf_checks.unconverted_attention(plain.config)
    ref = copy.deepcopy(plain).double()
    ref.config._attn_implementation = hf_checks.reference_attention(ref.config)
    ours = convert(copy.deepcopy(plain))
    ids, mask = hf_checks.batch()
    hf_checks.assert_matches_reference(ref, plain, ours, input_ids=ids, attention_mask=mask)
    assert len(fused_calls) == len(recomputable_layers(ours))


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast"])
def test_lora_fused_path_keeps_the_generic_paths_bytes_less_the_scaling_operands(autocast, monkeypatch):
    """What one LoRA layer keeps after forward (a 2-layer minus a 1-layer model, after a first step), fused: the
    generic path's bytes (lora_A's rank-wide outputs and the seeds besides the floor) less the 0-dim float64 operand
    autograd keeps for each of PEFT's `* scaling` (8 bytes a projection), and the estimate's."""
    ids, _ = hf_checks.batch(b=2, s=24, pad_rows=False)

    def kept():
        net = []
        for n in (1, 2):
            torch.manual_seed(0)
            model = convert(_lora(FAMILY["llama"].build(num_hidden_layers=n)()))
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                model(input_ids=ids).logits.float().sum().backward()
                held = []
                net.append(sum(cpu_allocation_deltas(lambda m=model, h=held: h.append(m(input_ids=ids).logits))))
            del held
        return net[1] - net[0], recomputable_layers(model)[0]

    fused, layer = kept()
    assert fused == layer_estimate(layer, ids.shape[1], ids.shape[0], torch.bfloat16 if autocast else None)
    _generic(monkeypatch)
    generic, layer = kept()
    assert generic == fused + 8 * 7
    assert generic == layer_estimate(layer, ids.shape[1], ids.shape[0], torch.bfloat16 if autocast else None)


def test_adapter_states_the_fused_path_follows(fused_calls):
    """PEFT's switches read at each call: adapters disabled (the base alone, no adapter gradient; the norms train),
    and a second adapter made the active one (its weights train, the first's get nothing): each fused, each within
    the rule of the unconverted PEFT model in the same state."""
    torch.manual_seed(0)
    plain = _lora(FAMILY["llama"].build()(), lora_dropout=0.0)
    plain.add_adapter("second", peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=["k_proj"]))
    ours = convert(copy.deepcopy(plain))
    ids, mask = hf_checks.batch()

    def check(state):
        logits, grads = _step(ours, ids, mask)
        ref_logits, ref_grads = _step(plain, ids, mask)
        torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-5)
        assert grads.keys() == ref_grads.keys(), state
        for n in grads:
            torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-3, atol=1e-5, msg=f"{state}: {n}")
        return grads

    for model in (plain, ours):
        model.disable_adapter_layers()
        for n, p in model.named_parameters():
            p.requires_grad_(p.requires_grad or "norm" in n)  # something trains while no adapter does
    grads = check("disabled")
    assert grads and not any("lora_" in n for n in grads)
    for model in (plain, ours):
        model.enable_adapter_layers()
        model.set_adapter("second")
    grads = check("second")
    assert any("second" in n for n in grads) and not any("default" in n for n in grads)
    assert len(fused_calls) == 2 * len(recomputable_layers(ours))


def test_what_fused_lora_does_not_express_runs_peft(fused_calls):
    """Two adapters active at once, a bias on lora_B, a hook on an adapter's Linear (it runs) and the "none" mode
    each send the layers through PEFT's forward (the generic path); the adapters still train."""
    ids, mask = hf_checks.batch()
    torch.manual_seed(0)
    model = _lora(FAMILY["llama"].build()())
    model.add_adapter("second", peft.LoraConfig(r=2, target_modules=["q_proj"]))
    model.base_model.set_adapter(["default", "second"])
    ours = convert(model)
    _step(ours, ids, mask)
    assert not fused_calls

    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="lora_bias"):  # PEFT's: the base Linears have no bias to merge into
        ours = convert(_lora(FAMILY["llama"].build()(), lora_bias=True))
    grads = _step(ours, ids, mask)[1]
    assert not fused_calls and any("lora_B" in n and n.endswith("bias") for n in grads)

    torch.manual_seed(0)
    ours = convert(_lora(FAMILY["llama"].build()()))
    seen = []
    a = ours.base_model.model.model.layers[0].mlp.up_proj.lora_A["default"]
    handle = a.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    _step(ours, ids, mask)
    handle.remove()
    assert len(fused_calls) == 1 and len(seen) == 1
    fused_calls.clear()

    torch.manual_seed(0)
    ours = convert(_lora(FAMILY["llama"].build()()), recompute="none")
    _step(ours, ids, mask)
    assert not fused_calls


@pytest.mark.parametrize("config", ["qlora-dropout", "autocast-qlora-dropout"])
def test_qlora_fused_and_generic_paths_give_the_same_bits(config, tmp_path, monkeypatch, fused_calls):
    """QLoRA (NF4 bases computing in bf16, prepared by PEFT, LoRA with dropout on every projection): the fused
    layers (bitsandbytes' 4-bit matmul and its dequantized input gradient inside the nodes) and the generic path
    give the same loss and gradients bit for bit over three steps, without and under bf16 autocast."""
    pytest.importorskip("bitsandbytes")
    from tests.models.test_training_configs import _grads, _ids, build

    def steps(model):
        out = []
        for seed in (5, 6, 7):
            torch.manual_seed(seed)
            loss, _, grads = _grads(model, ids, config)
            out.append((loss, grads))
        return out

    ids = _ids()
    fused = convert(build("llama", config, 2, tmp_path / "fused"))
    got = steps(fused)
    assert len(fused_calls) >= 2 * 2  # the first call settles the bases' compute dtype through PEFT's forward
    _generic(monkeypatch)
    calls = len(fused_calls)
    want = steps(convert(build("llama", config, 2, tmp_path / "generic")))
    assert len(fused_calls) == calls
    _assert_same_steps(got, want)
