"""selective_ckpt.fit's long-context variants against the allocator: "ours attention-kept" and the variants whose
layers offload their inputs (as `keeping.policy(mode, offload=["input"])` runs them), predicted within 5 % of the
CPU allocator's measured peak of a real steady-state step. On the CPU the offload engine's host arena is CPU memory
too, allocated once before the measured step (like the weights): the step's own peak is the device side, and the
arena holds the predicted host bytes (each copy's start aligned to the arena's 512 bytes)."""

import contextlib

import pytest
import torch

from selective_ckpt import convert, keeping, set_recompute
from selective_ckpt.fit import TrainingForm, fit, predict
from selective_ckpt.keeping.offload import OffloadEngine
from selective_ckpt.memory import cpu_allocation_deltas, running_peak

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

LAYERS, BATCH, SEQ = 4, 2, 256
POLICIES = {"ours attention-kept": keeping.policy("attention-kept"),
            "ours full, inputs offloaded": keeping.policy("full", offload=["input"]),
            "ours attention-kept, inputs offloaded": keeping.policy("attention-kept", offload=["input"])}
FORMS = {"full fp32": TrainingForm("full"),
         "lora bf16 autocast": TrainingForm("lora", rank=8, autocast=torch.bfloat16, targets=("q_proj", "v_proj",
                                                                                              "down_proj"))}


def _config():
    c = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=112, num_hidden_layers=LAYERS,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                 pad_token_id=0)
    c._attn_implementation = "sdpa"
    return c


def _measured(policy, form):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config())
    if form.kind == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=form.rank, lora_alpha=2 * form.rank,
                                                 target_modules=list(form.targets)))
    model = convert(model.train())
    engine = OffloadEngine() if policy.offloaded else None
    set_recompute(model, policy, engine=engine)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ids = torch.randint(1, 97, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))

    def step():
        with torch.autocast("cpu", dtype=form.autocast) if form.autocast else contextlib.nullcontext():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):  # the second step allocates the engine's arena at the size the first one needed
        step()
    peak = running_peak(cpu_allocation_deltas(step))
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values())
    return weights + state + peak, (engine.stats()["host_capacity"] if engine is not None else 0)


@pytest.mark.parametrize("variant", POLICIES)
@pytest.mark.parametrize("form", FORMS)
def test_long_context_variants_within_5_percent(form, variant):
    measured, arena = _measured(POLICIES[variant], FORMS[form])
    got = predict(_config(), BATCH, SEQ, FORMS[form], names=(variant,))[variant]
    assert got.error is None
    assert abs(got.peak - measured) <= 0.05 * measured, (variant, got.peak, measured, got.peak / measured, got.phases)
    copies = LAYERS - 1  # every layer's input but the last's
    assert got.host == (copies * BATCH * SEQ * 64 * 4 if "offloaded" in variant else 0)
    assert got.host <= arena < got.host + copies * 512


def test_offloading_inputs_lengthens_the_longest_context():
    r = fit("Llama-3.1-8B", 80e9, seq_len=8192, form=TrainingForm("qlora"))  # test_fit_longest's Llama form
    assert r.variants["ours full, inputs offloaded"].peak < r.variants["ours full"].peak
    assert r.variants["ours attention-kept, inputs offloaded"].peak < r.variants["ours attention-kept"].peak
    # the inputs of every layer but the last: 31 x 8192 x 4096 fp32 (QLoRA's residual stream)
    assert r.variants["ours full, inputs offloaded"].host == 31 * 8192 * 4096 * 4
    assert r.max_context["ours full, inputs offloaded"] >= r.max_context["ours full"]
    assert r.max_context["ours attention-kept"] > r.max_context["ours selective"]
