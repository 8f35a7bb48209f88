"""Mixture-of-experts families beyond the shared checks: the auxiliary loss, every experts implementation,
experts that receive no token, dense layers among MoE layers, and the refusals."""

import copy

import pytest
import torch

from selective_ckpt import ConversionError, convert
from selective_ckpt.memory import LayerShape, MoE
from selective_ckpt.models.configuration import layer_estimate
from selective_ckpt.registry import recomputable_layers
from tests.models.families.moe import FAMILIES
from tests.models.hf_checks import (
    VOCAB,
    assert_matches_reference,
    batch,
    kept_bytes_per_layer,
    triple,
    unconverted_attention,
)

transformers = pytest.importorskip("transformers")

BY_NAME = {f.name: f for f in FAMILIES}
every_family = pytest.mark.parametrize("family", FAMILIES, ids=str)


def _pair(family, dtype=torch.float32, **kw):
    torch.manual_seed(0)
    plain = family.build(**kw)().to(dtype).train()
    plain.config._attn_implementation = unconverted_attention(plain.config)
    return plain, convert(copy.deepcopy(plain))


def _grads(model, **inputs):
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    (out.loss + (out.aux_loss if out.aux_loss is not None else 0)).backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", [pytest.param(f, marks=f.skips("aux_loss"), id=f.name) for f in FAMILIES])
def test_aux_loss_and_loss_are_transformers(family):
    """output_router_logits=True: the load-balancing loss (the routers are transformers' own) and the total loss."""
    plain, ours = _pair(family, router_aux_loss_coef=0.05)
    ids, mask = batch()
    p, pg = _grads(plain, input_ids=ids, attention_mask=mask, labels=ids, output_router_logits=True)
    o, og = _grads(ours, input_ids=ids, attention_mask=mask, labels=ids, output_router_logits=True)
    assert torch.equal(o.aux_loss, p.aux_loss)
    torch.testing.assert_close(o.loss, p.loss, rtol=1e-6, atol=1e-6)
    assert set(og) == set(pg)
    for n in pg:
        torch.testing.assert_close(og[n], pg[n], rtol=1e-4, atol=1e-6, msg=n)


@every_family
@pytest.mark.parametrize("impl", ["eager", "grouped_mm", "batched_mm"])
def test_every_experts_implementation_converts(family, impl):
    """Each implementation transformers selects is followed (fp32 gradients as its own, within float
    rounding) and keeps the floor of memory.estimate."""
    plain, ours = _pair(family, experts_implementation=impl)
    assert ours.config._experts_implementation == impl
    ids, mask = batch()
    p, pg = _grads(plain, input_ids=ids, attention_mask=mask, labels=ids)
    o, og = _grads(ours, input_ids=ids, attention_mask=mask, labels=ids)
    torch.testing.assert_close(o.loss, p.loss, rtol=1e-6, atol=1e-6)
    for n in pg:
        torch.testing.assert_close(og[n], pg[n], rtol=1e-4, atol=1e-6, msg=n)
    ids, _ = batch(b=2, s=24, pad_rows=False)

    def layers(n):
        torch.manual_seed(0)
        model = family.build(num_hidden_layers=n, experts_implementation=impl)().train()
        model.config._attn_implementation = unconverted_attention(model.config)
        return convert(model)

    kept = kept_bytes_per_layer(layers, {"input_ids": ids})
    assert kept == layer_estimate(recomputable_layers(layers(1))[0], 24, 2)


def _router(model):
    mlp = model.model.layers[0].mlp
    return mlp.router if hasattr(mlp, "router") else mlp.gate  # gpt-oss names it router


@every_family
def test_experts_without_tokens(family):
    """A router that sends every token to the same top-k experts: the others get no row and zero gradients,
    and the rule against float64 holds."""
    def build():
        model = family.build(num_hidden_layers=1)()
        with torch.no_grad():
            _router(model).weight.normal_(0.0, 0.3)
        return model

    ref, plain, ours = triple(build)
    ids = torch.full((2, 9), 3)  # one token everywhere: the same hidden state, the same routing
    assert_matches_reference(ref, plain, ours, input_ids=ids)
    top_k = _router(ours).top_k
    grad = ours.model.layers[0].mlp.experts.down_proj.grad
    used = grad.flatten(1).abs().sum(1) > 0
    assert int(used.sum()) == top_k < grad.shape[0]


@pytest.mark.parametrize("name", ["qwen2_moe", "qwen3_moe"])
def test_dense_layers_among_moe_layers(name):
    """mlp_only_layers and decoder_sparse_step place dense MLPs among the MoE blocks: both convert, each
    layer keeps its own estimate's bytes."""
    family = BY_NAME[name]
    build = family.build(num_hidden_layers=4, mlp_only_layers=[0], decoder_sparse_step=2)
    ref, plain, ours = triple(build)
    kinds = [type(layer.mlp).__name__ for layer in ours.model.layers]
    assert kinds[0].endswith("MLP") and kinds[1].endswith("SparseMoeBlock") and kinds[2].endswith("MLP")
    ids, mask = batch()
    assert_matches_reference(ref, plain, ours, input_ids=ids, attention_mask=mask)
    for layer in recomputable_layers(ours):
        moe = LayerShape(**layer._selective_ckpt.shape()).part(MoE)
        assert (moe is not None) == type(layer.mlp).__name__.endswith("SparseMoeBlock")


def test_unsupported_experts_implementation_is_refused_by_name():
    torch.manual_seed(0)
    model = BY_NAME["mixtral"].build()()
    model.config._experts_implementation = "sonicmoe"
    before = {n: type(m.forward) for n, m in model.named_modules()}
    with pytest.raises(ConversionError, match="sonicmoe"):
        convert(model)
    assert {n: type(m.forward) for n, m in model.named_modules()} == before, "a refusal changes nothing"


def test_switching_to_unsupported_implementation_after_convert_is_an_error():
    _, ours = _pair(BY_NAME["qwen3_moe"])
    ours.config._experts_implementation = "deepgemm"
    ids, _ = batch()
    with pytest.raises(ValueError, match="deepgemm"):
        ours(input_ids=ids)


def test_router_jitter_is_refused_by_name():
    model = BY_NAME["mixtral"].build(router_jitter_noise=0.1)()
    with pytest.raises(ConversionError, match="router_jitter_noise"):
        convert(model)


def test_expert_parallel_and_other_layouts_are_refused():
    model = BY_NAME["qwen2_moe"].build()()
    model.model.layers[1].mlp.experts._is_expert_parallel = True
    with pytest.raises(ConversionError, match="experts with expert parallelism cannot be converted"):
        convert(model)


def test_unknown_experts_activation_is_refused():
    model = BY_NAME["qwen3_moe"].build()()
    model.model.layers[0].mlp.experts.act_fn = torch.nn.Tanh()
    with pytest.raises(ConversionError, match="act_fn"):
        convert(model)


def test_estimate_counts_experts_not_the_dense_width():
    """The kept bytes grow with top_k (routed rows), not with the number of experts beyond the router's softmax."""
    family = BY_NAME["mixtral"]
    ids, _ = batch(b=1, s=16, pad_rows=False)
    assert VOCAB > int(ids.max())
    figures = {}
    for top_k in (1, 2):
        torch.manual_seed(0)
        model = convert(family.build(num_hidden_layers=1, num_experts_per_tok=top_k)().train())
        figures[top_k] = layer_estimate(recomputable_layers(model)[0], 16, 1, breakdown=True)
    assert figures[2]["expert_gate_up"] == 2 * figures[1]["expert_gate_up"] == 2 * 16 * 2 * 48 * 4


@pytest.mark.parametrize("family", [pytest.param(f, marks=f.skips("packed"), id=f.name) for f in FAMILIES])
def test_packed_documents_stay_apart(family):
    """position_ids restarting per document: another document's tokens change a document's logits only by
    the rounding of the experts' row blocks, and the rule against float64 holds."""
    ref, plain, ours = triple(family.build())
    ids, _ = batch(b=1, s=23)
    pos = torch.tensor([list(range(9)) + list(range(5)) + list(range(9))])
    assert_matches_reference(ref, plain, ours, input_ids=ids, position_ids=pos, use_cache=False)
    other = ids.clone()
    other[:, :9] = (other[:, :9] + 1) % VOCAB
    with torch.no_grad():
        whole = ours(input_ids=ids, position_ids=pos, use_cache=False).logits
        changed = ours(input_ids=other, position_ids=pos, use_cache=False).logits
    torch.testing.assert_close(whole[:, 9:], changed[:, 9:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kwargs, name", [(dict(num_experts=0, top_k=1, expert_dim=8), "num_experts"),
                                          (dict(num_experts=2, top_k=3, expert_dim=8), "top_k"),
                                          (dict(num_experts=2, top_k=1, expert_dim=8, shared_dim=-1), "shared_dim")])
def test_moe_estimate_refuses_bad_shapes(kwargs, name):
    from selective_ckpt.memory import MoE

    with pytest.raises(ValueError, match=name):
        MoE(**kwargs)


def test_qlora_qwen2_moe_converts_with_its_shared_expert_gate_quantized(tmp_path):
    """QLoRA quantizes every Linear but the head, Qwen2-MoE's shared_expert_gate among them: the converted
    model runs its 4-bit gate as a module and follows transformers' QLoRA model (the same 4-bit layers)."""
    pytest.importorskip("bitsandbytes")
    import warnings

    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig

    torch.manual_seed(0)
    BY_NAME["qwen2_moe"].build()().save_pretrained(tmp_path)
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = BY_NAME["qwen2_moe"].causal_lm.from_pretrained(tmp_path, quantization_config=q,
                                                               attn_implementation="sdpa")
    base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)
    assert type(base.model.layers[0].mlp.shared_expert_gate).__name__ == "Linear4bit"
    torch.manual_seed(1)
    plain = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            init_lora_weights=False)).train()
    ours = convert(copy.deepcopy(plain))
    ids, mask = batch()
    p, pg = _grads(plain, input_ids=ids, attention_mask=mask, labels=ids)
    o, og = _grads(ours, input_ids=ids, attention_mask=mask, labels=ids)
    torch.testing.assert_close(o.loss, p.loss, rtol=1e-5, atol=1e-6)
    assert set(og) == set(pg) and og
    for n in pg:  # the 4-bit layers compute in bf16 on inputs that differ in fp32 rounding: 1e-2 of the largest
        assert (og[n] - pg[n]).abs().max() <= 1e-2 * pg[n].abs().max(), n
