"""The floor under the configurations people train: autocast, LoRA with dropout, 4-bit bases.

For each configuration, on Llama, Mistral and Qwen2: the bytes a decoder layer holds after a
training forward (allocator deltas of a 3-layer minus a 1-layer model, the recompute active)
equal models.configuration.layer_estimate; losses and gradients follow the unconverted model
within the 2x / 3x rule against float64; with dropout, every recompute mode gives the same bits
and LoRA's masks are the dropout contract's elementwise stream.
"""

import contextlib
import copy
import warnings

import pytest
import torch
from torch import nn

from selective_ckpt import convert, memory, rng, set_recompute
from selective_ckpt.memory.peak import cpu_allocation_deltas
from selective_ckpt.models.configuration import layer_estimate
from selective_ckpt.registry import recomputable_layers
from tests.reference import assert_within_rule, noisier

VOCAB, H, S, B = 96, 64, 24, 2
FAMILIES = ("llama", "mistral", "qwen2")
CONFIGS = ("bf16", "autocast", "autocast-lora", "bf16-lora-dropout", "qlora", "qlora-dropout", "autocast-qlora-dropout")


def _config(family, layers):
    import transformers

    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
           "qwen2": transformers.Qwen2Config}[family]
    c = cls(vocab_size=VOCAB, hidden_size=H, intermediate_size=176, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, use_cache=False, tie_word_embeddings=False)
    c._attn_implementation = "sdpa"
    return c


def _causal_lm(family):
    import transformers

    return {"llama": transformers.LlamaForCausalLM, "mistral": transformers.MistralForCausalLM,
            "qwen2": transformers.Qwen2ForCausalLM}[family]


# bitsandbytes bases: name -> BitsAndBytesConfig arguments ("nf4-bf16" is the QLoRA recipe)
QUANTS = {
    "nf4-bf16": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16),
    "nf4-fp16": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float16),
    "nf4-fp32": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32),
    "fp4-bf16": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_compute_dtype=torch.bfloat16),
    "fp4-fp16": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_compute_dtype=torch.float16),
    "int8": dict(load_in_8bit=True),
}


def _quantized(model, family, tmp_path, quant="nf4-bf16"):
    from peft import prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig

    path = tmp_path / f"{family}-{model.config.num_hidden_layers}-{quant}"
    model.save_pretrained(path)
    q = BitsAndBytesConfig(**QUANTS[quant])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _causal_lm(family).from_pretrained(path, quantization_config=q, attn_implementation="sdpa")
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def build(family, config, layers, tmp_path, quant="nf4-bf16"):
    """`config` names the training configuration (CONFIGS); `quant` the base of a "qlora" one (QUANTS)."""
    torch.manual_seed(0)
    model = _causal_lm(family)(_config(family, layers))
    if config.startswith("bf16"):
        model = model.to(torch.bfloat16)
    if "qlora" in config:
        model = _quantized(model, family, tmp_path, quant)
    if "lora" in config:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(1)
        drop = 0.05 if "dropout" in config else 0.0
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=drop, target_modules="all-linear",
                                                 init_lora_weights=False))
    return model.train()


def autocast_dtype(config):
    """The dtype a config's forward runs under autocast in ("autocast-fp16..." float16, "autocast..." bfloat16)."""
    if not config.startswith("autocast"):
        return None
    return torch.float16 if config.startswith("autocast-fp16") else torch.bfloat16


def _autocast(config):
    dtype = autocast_dtype(config)
    return contextlib.nullcontext() if dtype is None else torch.autocast("cpu", dtype=dtype)


def _ids(seed=3):
    return torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(seed))


def _held(model, ids, config):
    with _autocast(config):  # first calls change state once (bnb casts biases, lazy buffers): not measured
        model(input_ids=ids, labels=ids)
    out = []

    def forward():
        with _autocast(config):
            out.append(model(input_ids=ids, labels=ids).loss)
    return sum(cpu_allocation_deltas(forward))


def _decoder_layers(model):
    return recomputable_layers(model)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("family", FAMILIES)
def test_kept_bytes_per_layer_equal_the_estimate(family, config, tmp_path):
    ids = _ids()
    held = []
    for layers in (1, 3):
        model = convert(build(family, config, layers, tmp_path))
        held.append(_held(model, ids, config))
    per_layer = (held[1] - held[0]) / 2
    layer = _decoder_layers(model)[1]
    expected = layer_estimate(layer, S, B, autocast_dtype(config))
    assert per_layer == expected, (per_layer, layer_estimate(layer, S, B, None, breakdown=True))


@pytest.mark.parametrize("config", ("autocast", "autocast-lora", "bf16-lora-dropout", "qlora-dropout"))
def test_ledger_sees_what_the_model_keeps(config, tmp_path):
    """memory.ledger on a converted model reports, per decoder layer, what the allocator sees."""
    ids = _ids()
    model = convert(build("llama", config, 3, tmp_path))
    one = convert(build("llama", config, 1, tmp_path))

    def run(m):
        def f(i):
            with _autocast(config):
                return m(input_ids=i, labels=i).loss
        return f

    report = memory.ledger(run(model), ids, model=model)
    per_layer = list(report.by_layer.values())
    names = [n for n in report.by_layer if n != "-"]
    assert len(names) == 3, names
    parts = layer_estimate(_decoder_layers(model)[1], S, B, torch.bfloat16 if "autocast" in config else None,
                           breakdown=True)
    # PEFT's `* scaling` operand is a 0-dim tensor autograd keeps outside the saved-tensor hooks
    unseen = parts.get("lora_scaling", 0)
    assert report.by_layer[names[1]] == sum(parts.values()) - unseen
    held = (_held(model, ids, config) - _held(one, ids, config)) / 2
    assert (report.by_layer[names[1]] + report.by_layer[names[2]]) / 2 + unseen == held, per_layer


def _float64_reference(model):
    """A float64 copy of a (possibly 4- or 8-bit) model: quantized Linears become dense with the dequantized
    weights (8-bit: the int8 rows times their absmax / 127, the weight bitsandbytes' CPU training matmul uses)."""
    import bitsandbytes as bnb

    ref = copy.deepcopy(model)
    for name, m in list(ref.named_modules()):
        if isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)):
            dense = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
            with torch.no_grad():
                if isinstance(m, bnb.nn.Linear4bit):
                    w = bnb.functional.dequantize_4bit(m.weight.data, m.weight.quant_state)
                else:
                    w = m.weight.data.double() * (m.weight.SCB.double().unsqueeze(1) / 127.0)
                dense.weight.copy_(w.float())
                if m.bias is not None:
                    dense.bias.copy_(m.bias)
                    dense.bias.requires_grad_(m.bias.requires_grad)
            dense.weight.requires_grad_(False)
            parent, _, child = name.rpartition(".")
            setattr(ref.get_submodule(parent), child, dense)
    return ref.double()


def _grads(model, ids, config, autocast=True):
    model.zero_grad(set_to_none=True)
    with _autocast(config) if autocast else contextlib.nullcontext():
        out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}
    with torch.no_grad(), _autocast(config) if autocast else contextlib.nullcontext():
        logits = model(input_ids=ids).logits  # a converted causal LM's training loss leaves logits=None
    return out.loss.detach().double(), logits.double(), grads


@pytest.mark.parametrize("config", ("autocast", "autocast-lora", "qlora"))
@pytest.mark.parametrize("family", FAMILIES)
def test_loss_and_gradients_follow_transformers(family, config, tmp_path):
    plain = build(family, config, 2, tmp_path)
    ref = _float64_reference(plain)
    ref.config._attn_implementation = "sdpa"
    ours = convert(copy.deepcopy(plain))
    ids = _ids()
    r_loss, r_logits, r_grads = _grads(ref, ids, config, autocast=False)
    p_loss, p_logits, p_grads = _grads(plain, ids, config)
    o_loss, o_logits, o_grads = _grads(ours, ids, config)
    # transformers' eager attention beside its SDPA: in 16 bits a small gradient's max error differs
    # between the two by rounding luck (qwen2's o_proj lora_A: 1.1e-3 with SDPA, 3.0e-3 eager), so
    # eager PyTorch's error is the larger of the two
    plain.set_attn_implementation("eager")
    _, e_logits, e_grads = _grads(plain, ids, config)
    assert_within_rule(o_logits, noisier(p_logits, e_logits, r_logits), r_logits, 2, name="logits")
    # one scalar's 16-bit error is luck of cancellation: the logits carry the rule, the loss a bf16 floor
    assert_within_rule(o_loss, p_loss, r_loss, 2, floor=1e-3, name="loss")
    assert set(o_grads) == set(p_grads) == set(r_grads) == set(e_grads) and o_grads
    for n in r_grads:
        eager = noisier(p_grads[n], e_grads[n], r_grads[n])
        assert_within_rule(o_grads[n], eager, r_grads[n], 3, floor=1e-5, name=f"grad {n}")


@pytest.mark.parametrize("config", ("bf16-lora-dropout", "qlora-dropout", "autocast-qlora-dropout"))
def test_dropout_configs_bit_identical_across_modes(config, tmp_path):
    model = convert(build("qwen2", config, 2, tmp_path))
    ids = _ids()
    results = []
    for mode in ("none", "selective", "full"):
        set_recompute(model, mode)
        torch.manual_seed(7)
        results.append(_grads(model, ids, config))
    for loss, _, grads in results[1:]:
        assert torch.equal(loss, results[0][0])
        for n, g in grads.items():
            assert torch.equal(g, results[0][2][n]), n


def test_lora_dropout_is_the_elementwise_stream(tmp_path):
    model = convert(build("llama", "bf16-lora-dropout", 1, tmp_path))
    lora = model.base_model.model.model.layers[0].self_attn.q_proj
    drop = lora.lora_dropout["default"]
    x = torch.ones(3, 5, H)
    torch.manual_seed(11)
    seed = rng.seed_from_tensor(rng.draw_seed_tensor())
    torch.manual_seed(11)
    y = drop(x)
    keep = rng.elementwise_keep_mask(seed, 15, H, drop.p).reshape(x.shape)
    assert torch.equal(y, torch.where(keep, torch.full_like(x, rng.keep_scale(drop.p)), torch.zeros_like(x)))
    drop.eval()
    assert drop(x) is x


def test_lora_added_after_convert_gets_seeded_dropout(tmp_path):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(convert(build("llama", "bf16", 3, tmp_path)),
                           LoraConfig(r=4, lora_dropout=0.1, target_modules=["q_proj", "down_proj"]))
    ids = _ids()
    model(input_ids=ids, labels=ids).loss.backward()
    drops = [m for n, m in model.named_modules() if n.endswith("lora_dropout.default")]
    assert drops and all(hasattr(d, "_selective_ckpt_forward") for d in drops)


def test_dora_is_refused_by_name(tmp_path):
    from peft import LoraConfig, get_peft_model

    from selective_ckpt import ConversionError

    model = get_peft_model(build("llama", "bf16", 1, tmp_path), LoraConfig(r=4, use_dora=True,
                                                                          target_modules=["q_proj"]))
    with pytest.raises(ConversionError, match=r"layers\.0\.self_attn\.q_proj.*DoRA"):
        convert(model)


def test_unknown_module_is_named_in_a_warning(tmp_path):
    class Scaled(nn.Module):  # a Linear-like module convert does not know
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x) * 1.0

    model = convert(build("llama", "bf16", 1, tmp_path))
    layer = model.model.layers[0]
    layer.mlp.up_proj = Scaled(layer.mlp.up_proj)
    ids = _ids()
    with pytest.warns(UserWarning, match=r"model\.layers\.0 holds modules it does not know: mlp\.up_proj"):
        model(input_ids=ids, labels=ids)


def test_fp32_norm_weight_on_16bit_input_runs_the_kernel_in_transformers_dtype():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from selective_ckpt.models.patches import rms_norm_forward
    from selective_ckpt.models.patching import patch_forward

    torch.manual_seed(0)
    norm = LlamaRMSNorm(H, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    ours = copy.deepcopy(norm)
    patch_forward(ours, rms_norm_forward)
    x = torch.randn(B, S, H, dtype=torch.bfloat16, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    y, y_ref = ours(x2), norm(x)
    assert y.dtype == y_ref.dtype == torch.float32
    assert torch.equal(y, y_ref)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    ref64 = LlamaRMSNorm(H, eps=1e-6).double()
    ref64.weight.data.copy_(norm.weight)
    x64 = x.detach().double().requires_grad_(True)
    ref64(x64).backward(g.double())
    assert_within_rule(x2.grad, x.grad, x64.grad, 3, floor=1e-3, name="dx")
    assert_within_rule(ours.weight.grad, norm.weight.grad, ref64.weight.grad, 3, floor=1e-4, name="dw")
