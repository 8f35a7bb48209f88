"""selective_ckpt.fit against the allocator: the predicted peak of one training step (forward, backward,
AdamW step, in steady state) is within 5 % of the CPU allocator's measured peak (memory/peak.py), for
transformers' model and for the converted one, for every Hugging Face family (mixtures of experts included)
and training form; the longest context it reads off two simulated contexts is where a simulated step just
fits; bad input is a clear error."""

import contextlib
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

from selective_ckpt import convert
from selective_ckpt.fit import BUNDLED, TrainingForm, fit, load_config, predict
from selective_ckpt.fit.arithmetic import ALLOCATOR_SHARE
from selective_ckpt.fit.configs import bundled
from selective_ckpt.memory import cpu_allocation_deltas, running_peak
from tests.models.families import Family, by_name, collect

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

LAYERS, BATCH, SEQ = 4, 2, 256  # long sequences: activations are most of the peak

GPT2 = Family("gpt2", transformers.GPT2Config, transformers.GPT2LMHeadModel,
              dict(vocab_size=97, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
              lora_targets=("c_attn", "c_proj", "c_fc"))
FAMILIES = collect() + [GPT2]
# as people train: fp32; fp32 weights under bf16 autocast (Trainer's bf16=True), LoRA with and without PEFT's
# dropout; QLoRA over NF4 bases that compute in bf16. Every family runs every form.
FORMS = {"full fp32": lambda fam: TrainingForm("full"),
         "lora fp32": lambda fam: TrainingForm("lora", rank=8, targets=fam.lora_targets),
         "full bf16 autocast": lambda fam: TrainingForm("full", autocast=torch.bfloat16),
         "lora bf16 autocast": lambda fam: TrainingForm("lora", rank=8, targets=fam.lora_targets,
                                                        autocast=torch.bfloat16),
         "lora dropout bf16 autocast": lambda fam: TrainingForm("lora", rank=8, targets=fam.lora_targets,
                                                                autocast=torch.bfloat16, lora_dropout=0.05),
         "qlora nf4": lambda fam: TrainingForm("qlora", rank=8, targets=fam.lora_targets)}


def _config(family):
    layers = "n_layer" if family.name == "gpt2" else "num_hidden_layers"
    positions = "n_positions" if family.name == "gpt2" else "max_position_embeddings"
    # a sliding window makes transformers pass SDPA a mask, which on CPU takes the math kernel (S x S
    # probabilities kept); the fit model counts the fused kernels' saved set, as on GPU
    extra = {"sliding_window": None} if "sliding_window" in family.tiny else {}
    if "attention_chunk_size" in family.tiny:  # chunked layers (Llama 4) take such a mask as well
        extra["attention_chunk_size"] = None
    if family.name == "llama4_text":
        # the fit extends its 2-layer step by copies of the second layer: Llama 4's dense and MoE layers alternating
        # are not modelled (transformers' own predicted at 1.065 of the measured peak), so every layer is MoE here
        extra["interleave_moe_layer_step"] = 1
    if family.name == "gpt_oss":  # its mask builder asks for a window: one as long as the sequence, every layer full
        extra.update(sliding_window=SEQ, layer_types=["full_attention"] * LAYERS)
    if extra and family.name in ("olmo3", "exaone4", "ministral"):  # their layer_types follow the window unless given
        extra["layer_types"] = ["full_attention"] * LAYERS
    # SDPA refuses soft-capped scores: transformers' side runs SDPA here, which keeps what the capped
    # eager attention's fused counterpart would (the cap changes no kept bytes of ours)
    if family.tiny.get("attn_logit_softcapping") is not None:
        extra["attn_logit_softcapping"] = None
    config = family.config(**{**family.tiny, layers: LAYERS, positions: SEQ, **extra})
    if getattr(config, "layer_types", None) and not family.layer_kinds:  # a hybrid keeps its mix of layers
        # every layer global; the Gemma families, OLMo 3 and Ministral build a sliding mask whatever the layers: a
        # window as long as the sequence that no layer uses
        config.layer_types = ["full_attention"] * LAYERS
        if family.name.startswith("gemma") or family.name in ("olmo3", "ministral"):
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

        from selective_ckpt.fit.simulate import _conv1d_targets

        model = get_peft_model(model, LoraConfig(r=form.rank, lora_alpha=2 * form.rank,
                                                 target_modules=list(form.targets), lora_dropout=form.lora_dropout,
                                                 fan_in_fan_out=_conv1d_targets(model, form.targets)))
    # SDPA's fused kernels, as on GPU (families transformers builds eager only, Gemma2's, run them too: with
    # no attention soft-capping the two compute the same)
    (model.get_base_model() if hasattr(model, "get_base_model") else model).config._attn_implementation = "sdpa"
    return model.train()


def _measured(family, config, form, converted, tmp_path):
    """(weights + AdamW state + the allocator's peak of a second (steady-state) step, weights + AdamW state, the
    experts implementation of a mixture-of-experts model or None)."""
    model = _build(family, config, form, tmp_path)
    root = model.get_base_model() if hasattr(model, "get_base_model") else model
    experts = getattr(root.config, "_experts_implementation_internal", None) if "moe" in family.name or \
        family.name == "mixtral" or "experts_implementation" in family.tiny else None
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
    peak = running_peak(cpu_allocation_deltas(step))
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    weights += sum(b.numel() * b.element_size() for b in _quant_states(model))
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values())
    return weights + state + peak, weights + state, experts


def _quant_states(model):
    """The tensors of the 4-bit weights' quantization states (the absmax per block), which are no parameters."""
    out = []
    for p in model.parameters():
        qs = getattr(p, "quant_state", None)
        if qs is not None:
            out.append(qs.absmax)
    return out


# ours in every form for every family; transformers' own model (whose simulation is the same for every family:
# transformers' code, no conversion) in every form for Llama and in the commonest form for the others
TRANSFORMERS_FORM = "lora dropout bf16 autocast"
CASES = [pytest.param(f, form, variant, marks=f.skips("fit")) for f in FAMILIES for form in FORMS
         for variant in ("transformers", "ours selective")
         if variant != "transformers" or f.name == "llama" or form == TRANSFORMERS_FORM]


@pytest.mark.parametrize("family, form, variant", CASES, ids=lambda x: str(x))
def test_predicted_peak_within_5_percent(family, form, variant, tmp_path, record_property):
    config = _config(family)
    training = FORMS[form](family)
    measured, fixed, experts = _measured(family, _config(family), training, variant != "transformers", tmp_path)
    config._attn_implementation = "sdpa"  # as _build sets it on the model
    if experts is not None:  # the one transformers chose for the model measured (QLoRA's from_pretrained: grouped_mm)
        config._experts_implementation = experts
    got = predict(config, BATCH, SEQ, training, names=(variant,))[variant]
    assert measured - fixed > fixed, "activations must be most of the peak for 5 % to mean something"
    record_property("ratio", f"{got.peak / measured:.3f}")
    assert abs(got.peak - measured) <= 0.05 * measured, (f"{variant}: predicted {got.peak} against measured "
                                                         f"{measured} ({got.peak / measured:.3f}); phases {got.phases}")


def test_bundled_configs_load_and_project():
    for name in BUNDLED:
        assert load_config(name).num_hidden_layers > 0
    r = fit("Llama-3.1-8B", 80e9, batch=1, seq_len=4096, form=TrainingForm("qlora"))  # test_fit_longest's Llama form
    peaks = {k: v.peak for k, v in r.variants.items()}
    assert peaks["ours selective"] < peaks["ours none"] < peaks["transformers"]
    assert peaks["ours full"] < peaks["ours selective"]
    assert r.max_context["ours full"] >= r.max_context["ours selective"] >= r.max_context["transformers"] > 0


# PEFT takes gate_proj, up_proj and down_proj for Qwen3-Next's fused expert weights, which convert refuses by name:
# LoRA on its attention and DeltaNet projections; gpt-oss's experts are parameters, not linear modules: LoRA on its
# attention
_BUNDLED_TARGETS = {"Qwen3-Next-80B-A3B": ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkvz", "out_proj"),
                    "gpt-oss-20b": ("q_proj", "k_proj", "v_proj", "o_proj")}


@pytest.mark.parametrize("name", BUNDLED)
def test_every_bundled_config_simulates(name):
    """Each bundled config (sliding windows, soft-capped Gemma-2, the Mixtral mixture, the hybrids' DeltaNet
    layers) runs both sides of the step: ours keeps less than transformers, and both more than the weights."""
    targets = {"targets": _BUNDLED_TARGETS[name]} if name in _BUNDLED_TARGETS else {}
    form = TrainingForm("lora", autocast=torch.bfloat16, **targets)
    got = predict(name, 1, 512, form, names=("transformers", "ours selective"))
    assert all(v.error is None for v in got.values()), got
    assert got["ours selective"].kept_per_layer < got["transformers"].kept_per_layer
    assert got["ours selective"].peak < got["transformers"].peak


def test_longest_context_fits_and_a_longer_one_does_not():
    """The longest context fit reads off two simulated contexts is where a step simulated at that context
    just fits: at it the peak (with the allocator's share) is within the budget, 5 % further it is over."""
    config = _config(by_name("llama"))
    config.max_position_embeddings = 1 << 16
    form = TrainingForm("lora", rank=8, targets=by_name("llama").lora_targets)
    budget = 12e6
    r = fit(config, budget, batch=1, seq_len=512, form=form)
    for name in ("transformers", "ours selective"):
        longest = r.max_context[name]
        assert 0 < longest < config.max_position_embeddings
        at, over = (predict(config, 1, s, form, names=(name,))[name].peak * (1 + ALLOCATOR_SHARE)
                    for s in (longest, int(longest * 1.05) + 1))
        assert at <= budget < over, (name, longest, at, over)
    assert r.max_context["ours selective"] > r.max_context["transformers"]


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
    with pytest.raises(ValueError, match="targets"):
        fit("Mixtral-8x7B", 400e9, seq_len=1024, form=TrainingForm("lora", targets=("c_attn",)))
    with pytest.raises(ValueError, match="kind"):
        TrainingForm("adapter")
    with pytest.raises(ValueError, match="lora_dropout"):
        TrainingForm("lora", lora_dropout=1.0)


# QLoRA, as every Llama-3.1-8B fit of the tests: a session simulates its steps once (tests/conftest.py)
def test_command_line_prints_every_part(tmp_path):
    """The command line on a config.json file: Llama-3.1-8B's at 512 wide and 4 layers deep (the bundled one takes
    minutes to project on a cold step cache; what is printed is the same set of parts)."""
    config = bundled("Llama-3.1-8B")
    config.update(hidden_size=512, intermediate_size=1792, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    out = subprocess.run([sys.executable, "-m", "selective_ckpt.fit", str(path), "--gpu", "80GB",
                          "--form", "qlora", "--seq-len", "2048"],
                         capture_output=True, text=True, timeout=300, check=True,
                         env={**os.environ, "SELECTIVE_CKPT_FIT_CACHE": "off"}).stdout
    for part in ("weights", "gradients", "optimizer state", "kept per layer", "loss head transient",
                 "layer backward transient",
                 "allocator", "transformers + gradient checkpointing", "ours plan", "not modelled"):
        assert part in out, part


def test_fit_check_measures_a_real_step_and_prints_the_prediction_beside_it(tmp_path, capsys):
    """python -m selective_ckpt.bench.fit_check (what bench/gpu.sh runs at Llama-3.1-8B's full size on a GPU)
    at a small width on CPU: a row per variant, the measured peak within 5 % of the prediction."""
    import json

    from selective_ckpt.bench import fit_check

    out = tmp_path / "rows.json"
    assert fit_check.main(["Llama-3.1-8B", "--layers", "2", "--hidden", "128", "--seq-len", "128", "--form", "lora",
                           "--rank", "4", "--autocast", "bfloat16", "--timed", "0", "--variants",
                           "transformers,ours selective", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["transformers", "ours selective"]
    for r in rows:
        assert abs(r["predicted"] - r["peak"]) <= 0.05 * r["peak"], r
    printed = capsys.readouterr().out
    assert "| transformers |" in printed and "| ours selective |" in printed
    with pytest.raises(SystemExit, match="variants"):
        fit_check.main(["Llama-3.1-8B", "--variants", "ours sometimes"])
    with pytest.raises(SystemExit, match="qlora is not measured here"):
        fit_check.main(["Llama-3.1-8B", "--form", "qlora"])
