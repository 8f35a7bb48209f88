"""selective_ckpt.fit against the allocator: the predicted peak of one training step (forward, backward,
AdamW step, in steady state) is within 5 % of the CPU allocator's measured peak (memory/peak.py), for
transformers' model and for the converted one, for every Hugging Face family and training form; and bad
input is a clear error."""

import contextlib
import gc
import os
import subprocess
import sys
import warnings

import pytest
import torch

from selective_ckpt import convert
from selective_ckpt.fit import BUNDLED, TrainingForm, fit, load_config, predict
from selective_ckpt.fit.configs import bundled
from selective_ckpt.memory import cpu_allocation_deltas, running_peak
from tests.models.families import Family, collect

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

LAYERS, BATCH, SEQ = 4, 2, 256  # long sequences: activations are most of the peak
# families the fit model does not predict (their routing is data-dependent): fit raises for them
NOT_MODELLED = {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "deepseek_v3", "gpt_oss"}

GPT2 = Family("gpt2", transformers.GPT2Config, transformers.GPT2LMHeadModel,
              dict(vocab_size=97, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
              lora_targets=("c_attn", "c_proj", "c_fc"))
FAMILIES = collect() + [GPT2]
# as people train: fp32; fp32 weights under bf16 autocast (Trainer's bf16=True); QLoRA over NF4 bases that
# compute in bf16. Every family runs the fp32 forms; the others run on one family per layer form (pre-norm
# gated, LayerNorm GELU, parallel residual, GPT-2), or on every family with SELECTIVE_CKPT_FIT_ALL=1
FORMS = {"full fp32": lambda fam: TrainingForm("full"),
         "lora fp32": lambda fam: TrainingForm("lora", rank=8, targets=fam.lora_targets),
         "full bf16 autocast": lambda fam: TrainingForm("full", autocast=torch.bfloat16),
         "lora bf16 autocast": lambda fam: TrainingForm("lora", rank=8, targets=fam.lora_targets,
                                                        autocast=torch.bfloat16),
         "qlora nf4": lambda fam: TrainingForm("qlora", rank=8, targets=fam.lora_targets)}


def _config(family):
    layers = "n_layer" if family.name == "gpt2" else "num_hidden_layers"
    positions = "n_positions" if family.name == "gpt2" else "max_position_embeddings"
    # a sliding window makes transformers pass SDPA a mask, which on CPU takes the math kernel (S x S
    # probabilities kept); the fit model counts the fused kernels' saved set, as on GPU
    extra = {"sliding_window": None} if "sliding_window" in family.tiny else {}
    # SDPA refuses soft-capped scores: transformers' side runs SDPA here, which keeps what the capped
    # eager attention's fused counterpart would (the cap changes no kept bytes of ours)
    if family.tiny.get("attn_logit_softcapping") is not None:
        extra["attn_logit_softcapping"] = None
    config = family.config(**{**family.tiny, layers: LAYERS, positions: SEQ, **extra})
    if getattr(config, "layer_types", None):
        # every layer global; the Gemma families build a sliding mask whatever the layers, so they get a
        # window as long as the sequence that no layer uses
        config.layer_types = ["full_attention"] * LAYERS
        if family.name.startswith("gemma"):
            config.sliding_window = SEQ
    return config


def _build(family, config, form, tmp_path):
    """transformers' model of `config` in `form`: LoRA by peft, a QLoRA base loaded 4-bit NF4 (bf16 compute) by
    transformers' BitsAndBytesConfig and prepared by prepare_model_for_kbit_training, as people train them."""
    torch.manual_seed(0)
    model = family.causal_lm(config)
    if form.kind == "qlora":
        from peft import prepare_model_for_kbit_training
        from transformers import BitsAndBytesConfig

        path = tmp_path / "base"
        model.save_pretrained(path)
        q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = family.causal_lm.from_pretrained(path, quantization_config=q)
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    if form.kind != "full":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=form.rank, lora_alpha=2 * form.rank,
                                                 target_modules=list(form.targets)))
    # SDPA's fused kernels, as on GPU (families transformers builds eager only, Gemma2's, run them too: with
    # no attention soft-capping the two compute the same)
    (model.get_base_model() if hasattr(model, "get_base_model") else model).config._attn_implementation = "sdpa"
    return model.train()


def _measured(family, config, form, converted, tmp_path):
    """Weights + AdamW state + the allocator's peak of a second (steady-state) step."""
    model = _build(family, config, form, tmp_path)
    if converted:
        convert(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ids = torch.randint(1, config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))

    def step():
        # as transformers' Trainer runs it: forward and loss under autocast, backward and the step outside
        with torch.autocast("cpu", dtype=form.autocast) if form.autocast else contextlib.nullcontext():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    gc.collect()
    gc.disable()
    try:
        peak = running_peak(cpu_allocation_deltas(step))
    finally:
        gc.enable()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    weights += sum(b.numel() * b.element_size() for b in _quant_states(model))
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values())
    return weights + state + peak, weights + state


def _quant_states(model):
    """The tensors of the 4-bit weights' quantization states (the absmax per block), which are no parameters."""
    out = []
    for p in model.parameters():
        qs = getattr(p, "quant_state", None)
        if qs is not None:
            out.append(qs.absmax)
    return out


FP32 = ("full fp32", "lora fp32")
LAYER_FORMS = {"llama", "starcoder2", "gpt_neox", "gpt2"}
CASES = [(f, form) for f in FAMILIES for form in FORMS
         if form in FP32 or str(f) in LAYER_FORMS or os.environ.get("SELECTIVE_CKPT_FIT_ALL") == "1"]

# known misses, (family, form, variant) -> what the model leaves out there; each xfails strictly, so a fix
# that brings one within 5 % has to take it off this list
_CASTS = "the casts and outputs its post-norms / q-k norms hold until the layer returns are not counted"
_LORA_BWD = "transformers' backward transient under frozen bases is counted as a full fine-tune's"
_GPT2_LORA = "ours' GELU MLP with adapted fc_in holds more in backward than the layer transient counts"
_PARALLEL = "a parallel-residual layer's adapters under autocast hold casts the transient does not count"
KNOWN_MISSES = {
    **{("olmo2", form, "ours selective"): "OLMo2's post-norms and whole-projection q/k norms: ours' transients "
       "are counted as a pre-norm layer's, which is too much" for form in FORMS},
    ("qwen3", "full fp32", "ours selective"): "the per-head q/k norms' backward transient is over-counted",
    ("qwen3", "lora fp32", "ours selective"): "the per-head q/k norms' backward transient is over-counted",
    ("qwen3", "full bf16 autocast", "ours selective"): "the per-head q/k norms' backward transient is over-counted",
    ("gemma3_text", "full fp32", "ours selective"): "the per-head q/k norms' backward transient is over-counted",
    ("gemma3_text", "lora fp32", "ours selective"): "the per-head q/k norms' backward transient is over-counted",
    ("gemma2", "full bf16 autocast", "ours selective"): _CASTS,
    ("gemma2", "lora bf16 autocast", "ours selective"): _CASTS,
    ("gemma3_text", "full bf16 autocast", "ours selective"): _CASTS,
    ("starcoder2", "qlora nf4", "transformers"): _LORA_BWD,
    ("cohere", "lora fp32", "transformers"): _LORA_BWD,
    ("cohere", "lora bf16 autocast", "transformers"): _LORA_BWD,
    ("cohere", "qlora nf4", "transformers"): _LORA_BWD,
    ("gpt_neox", "lora fp32", "transformers"): _LORA_BWD,
    ("gpt_neox", "qlora nf4", "transformers"): _LORA_BWD,
    ("gpt2", "lora bf16 autocast", "transformers"): _LORA_BWD,
    ("gpt_neox", "lora bf16 autocast", "ours selective"): _PARALLEL,
    ("gpt_neox-sequential", "lora bf16 autocast", "ours selective"): _PARALLEL,
    ("gpt2", "full bf16 autocast", "transformers"): "GPT-2's Conv1D under autocast: addmm's casts are not "
                                                    "the meta forward's",
    ("gpt2", "lora fp32", "ours selective"): _GPT2_LORA,
    ("gpt2", "lora bf16 autocast", "ours selective"): _GPT2_LORA,
    ("gpt2", "qlora nf4", "ours selective"): _GPT2_LORA,
}

# misses at the edge, whose side of 5 % depends on the CPU's bf16 kernels: 1.052 in an earlier run (CPU not
# recorded), 1.046 on an AMD EPYC with AVX512_BF16 (transformers 5.25)
BORDERLINE = {("gpt2", "lora bf16 autocast", "transformers")}


@pytest.mark.parametrize("variant", ("transformers", "ours selective"))
@pytest.mark.parametrize("family, form", CASES, ids=lambda x: str(x))
def test_predicted_peak_within_5_percent(family, form, variant, request, tmp_path, record_property):
    miss = KNOWN_MISSES.get((str(family), form, variant))
    if miss:
        request.applymarker(pytest.mark.xfail(strict=(str(family), form, variant) not in BORDERLINE, reason=miss))
    config = _config(family)
    training = FORMS[form](family)
    if family.name in NOT_MODELLED:
        if variant == "transformers":
            with pytest.raises(ValueError, match="not modelled"):
                predict(config, BATCH, SEQ, training)
        return
    got = predict(config, BATCH, SEQ, training, names=(variant,))[variant]
    measured, fixed = _measured(family, _config(family), training, variant != "transformers", tmp_path)
    assert measured - fixed > fixed, "activations must be most of the peak for 5 % to mean something"
    record_property("ratio", f"{got.peak / measured:.3f}")
    assert abs(got.peak - measured) <= 0.05 * measured, (f"{variant}: predicted {got.peak} against measured "
                                                         f"{measured} ({got.peak / measured:.3f}); phases {got.phases}")


def test_bundled_configs_load_and_project():
    for name in BUNDLED:
        assert load_config(name).num_hidden_layers > 0
    r = fit("Llama-3.1-8B", 80e9, batch=1, seq_len=4096,
            form=TrainingForm("lora", autocast=torch.bfloat16, rank=16))
    peaks = {k: v.peak for k, v in r.variants.items()}
    assert peaks["ours selective"] < peaks["ours none"] < peaks["transformers"]
    assert peaks["ours full"] < peaks["ours selective"]
    assert r.max_context["ours full"] >= r.max_context["ours selective"] >= r.max_context["transformers"] > 0


def test_bad_input_names_the_field():
    with pytest.raises(ValueError, match="model_type"):
        load_config({"model_type": "no-such-model", "vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 1,
                     "num_attention_heads": 1})
    cfg = bundled("Llama-3.1-8B")
    del cfg["hidden_size"]
    with pytest.raises(ValueError, match="hidden_size"):
        load_config(cfg)
    with pytest.raises(ValueError, match="gpu_bytes"):
        fit("Llama-3.1-8B", 8e9, seq_len=1024)
    with pytest.raises(ValueError, match="num_local_experts"):
        fit("Mixtral-8x7B", 400e9, seq_len=1024)
    with pytest.raises(ValueError, match="kind"):
        TrainingForm("adapter")


def test_command_line_prints_every_part():
    out = subprocess.run([sys.executable, "-m", "selective_ckpt.fit", "Llama-3.1-8B", "--gpu", "80GB",
                          "--form", "qlora", "--autocast", "bfloat16", "--seq-len", "8192"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    for part in ("weights", "gradients", "optimizer state", "kept/layer", "head tr.", "layer bwd tr.",
                 "allocator", "transformers + gradient checkpointing", "ours plan", "not modelled"):
        assert part in out, part
