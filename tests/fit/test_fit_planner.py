"""The planner (selective_ckpt.plan, fit.planner): every plan it emits runs, its predicted GPU peak is within 5 % of
the CPU allocator's measured peak of a real steady-state step (up to 8 % over where much is offloaded) and its host
bytes are what the offload engine's arena holds; it never exceeds its budgets; with a synthetic rate table it keeps
when everything fits, offloads when the host link is fast and rebuilds when it is slow. The time model on its own:
copies hidden under compute up to the overlap share, the excess added; "attention-kept" rebuilds cheaper than "full"
at long context."""

import contextlib

import pytest
import torch

import selective_ckpt
from selective_ckpt import convert, keeping, set_recompute
from selective_ckpt.fit import Plan, PlanError, Rates, TrainingForm, fit, form_of, rates_for, timing
from selective_ckpt.fit.arithmetic import ALLOCATOR_SHARE
from selective_ckpt.keeping.policy import CHECKPOINTED
from selective_ckpt.memory import cpu_allocation_deltas, running_peak
from selective_ckpt.registry import state_of

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

LAYERS, BATCH, SEQ = 4, 2, 256
HIDDEN = 64
FORMS = {"full fp32": TrainingForm("full"),
         "lora bf16 autocast": TrainingForm("lora", rank=8, autocast=torch.bfloat16,
                                            targets=("q_proj", "v_proj", "down_proj"))}
GiB = 2 ** 30


def _rates(link):
    """A synthetic device: every rate 1e12 but the host link's."""
    return Rates("synthetic", matmul_bf16=1e12, matmul_fp32=1e12, attention_forward=1e12, attention_backward=1e12,
                 bandwidth=1e12, host_to_device=link, device_to_host=link, layer_overhead=0.0, efficiency=1.0)


FAST, SLOW = _rates(1e15), _rates(1e3)


def _config():
    c = transformers.LlamaConfig(vocab_size=97, hidden_size=HIDDEN, intermediate_size=112,
                                 num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=SEQ, pad_token_id=0)
    c._attn_implementation = "sdpa"
    return c


def _model(form):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config())
    if form.kind == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=form.rank, lora_alpha=2 * form.rank,
                                                 target_modules=list(form.targets)))
    return model.train()


def _measured(plan, form):
    """(GPU side: weights + AdamW state + the allocator's peak of a steady-state step, the offload engine's arena)."""
    model = convert(_model(form))
    set_recompute(model, plan)
    engine = next((state_of(m).engine for m in selective_ckpt.recomputable_layers(model)
                   if state_of(m).engine is not None), None)
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


def _budgets(form):
    """GPU budgets from roomy to tight: the "ours none" peak, then shares of the way down to the leanest plan's."""
    r = fit(_config(), 1 << 40, batch=BATCH, seq_len=SEQ, form=form, rates=FAST)
    top = r.variants["ours none"].peak * (1 + ALLOCATOR_SHARE)
    with pytest.raises(PlanError) as err:
        selective_ckpt.plan(_config(), gpu=1, host=1 << 40, batch=BATCH, seq_len=SEQ, form=form, rates=FAST)
    low = err.value.min_gpu_bytes
    return [int(low + (top - low) * f) + 1 for f in (1.0, 0.6, 0.3, 0.0)]


@pytest.mark.parametrize("rates", ("fast link", "slow link"))
@pytest.mark.parametrize("form", FORMS)
def test_every_plan_runs_within_5_percent_of_its_prediction(form, rates):
    training = FORMS[form]
    seen = set()
    for gpu in _budgets(training):
        p = selective_ckpt.plan(_config(), gpu=gpu, host=1 << 40, batch=BATCH, seq_len=SEQ, form=training,
                                rates=FAST if rates == "fast link" else SLOW)
        assert p.peak * (1 + ALLOCATOR_SHARE) <= gpu
        key = tuple(p)
        if key in seen:
            continue
        seen.add(key)
        measured, arena = _measured(p, training)
        # never more than 5 % under; over by up to 8 % where much is offloaded: the model holds two layers'
        # copies in flight during a forward, the engine sometimes frees one sooner (a plan that fits still fits)
        over = 0.08 if p.host_bytes else 0.05
        assert -0.05 * measured <= p.peak - measured <= over * measured, \
            (p.describe(), p.peak, measured, p.peak / measured)
        copies = sum(1 for q in p[:-1] if q.offloaded)
        assert p.host_bytes <= arena <= p.host_bytes + 8 * copies * 512, (p.describe(), p.host_bytes, arena)
    assert len(seen) >= 2, "the budgets should give different plans"


def test_layer_tiled_plans_run_within_5_percent(monkeypatch):
    """With 4 tiles a candidate (default_tiles, a few hundred tokens here), the leanest plan runs "full" layers in
    query tiles; its predicted peak against the allocator's, its host bytes against the arena."""
    from selective_ckpt.fit import planner

    monkeypatch.setattr(planner, "default_tiles", lambda tokens, hidden: 4)
    training = FORMS["lora bf16 autocast"]
    with pytest.raises(PlanError) as err:
        selective_ckpt.plan(_config(), gpu=1, host=1 << 40, batch=BATCH, seq_len=SEQ, form=training, rates=SLOW)
    p = selective_ckpt.plan(_config(), gpu=err.value.min_gpu_bytes + 1, host=1 << 40, batch=BATCH, seq_len=SEQ,
                            form=training, rates=SLOW)
    assert any(q.layer_tiles == 4 for q in p), p.describe()
    measured, arena = _measured(p, training)
    over = 0.08 if p.host_bytes else 0.05
    assert -0.05 * measured <= p.peak - measured <= over * measured, (p.describe(), p.peak, measured,
                                                                       p.peak / measured)
    copies = sum(1 for q in p[:-1] if q.offloaded)
    assert p.host_bytes <= arena <= p.host_bytes + 8 * copies * 512, (p.describe(), p.host_bytes, arena)


def test_keeps_when_everything_fits_offloads_on_a_fast_link_rebuilds_on_a_slow_one():
    form = FORMS["full fp32"]
    roomy = selective_ckpt.plan(_config(), gpu=1 << 40, host=1 << 40, batch=BATCH, seq_len=SEQ, form=form,
                                rates=SLOW)
    assert set(roomy) == {keeping.resolve("none")} and roomy.host_bytes == 0
    contrasts = []
    for gpu in _budgets(form)[1:]:
        fast, slow = (selective_ckpt.plan(_config(), gpu=gpu, host=1 << 40, batch=BATCH, seq_len=SEQ, form=form,
                                          rates=r) for r in (FAST, SLOW))
        assert fast.step_seconds <= slow.step_seconds
        contrasts.append((fast.host_bytes > 0 and all(p.recompute in ("none", "selective") for p in fast),
                          slow.host_bytes == 0 and any(p.recompute in CHECKPOINTED for p in slow)))
        # no host memory: the fast link cannot be used
        bare = selective_ckpt.plan(_config(), gpu=gpu, host=0, batch=BATCH, seq_len=SEQ, form=form, rates=FAST)
        assert bare.host_bytes == 0
    assert (True, True) in contrasts, contrasts


def test_a_plan_that_cannot_fit_names_the_least_budget():
    form = FORMS["lora bf16 autocast"]
    with pytest.raises(PlanError, match="the least GPU memory any plan needs is") as err:
        selective_ckpt.plan(_config(), gpu=1000, host=1 << 40, batch=BATCH, seq_len=SEQ, form=form, rates=FAST)
    need = err.value.min_gpu_bytes
    p = selective_ckpt.plan(_config(), gpu=need, host=1 << 40, batch=BATCH, seq_len=SEQ, form=form, rates=FAST)
    assert p.peak * (1 + ALLOCATOR_SHARE) <= need
    assert isinstance(err.value, ValueError)


def test_first_fit_says_whether_the_search_finds_a_plan():
    """search(first_fit=True), which the longest-context search asks at each context, is True exactly where the full
    search returns a plan, over budgets from below the least any plan needs to roomy, with and without host memory."""
    from selective_ckpt.fit.arithmetic import _Model, _Projection
    from selective_ckpt.fit.planner import search

    mixed = 0
    for form in FORMS.values():
        proj = _Projection(_Model(_config(), form), BATCH)
        proj.simulate(SEQ)
        with pytest.raises(PlanError) as err:
            search(proj, SEQ, 1000, 1 << 40, FAST)
        need = err.value.min_gpu_bytes
        copied = search(proj, SEQ, need, 1 << 40, SLOW).host_bytes  # host bytes of the leanest plan
        for gpu in [int(need * f) for f in (0.9, 0.99, 1.0, 1.02, 1.05, 1.1, 1.25, 2.5)]:
            for host in (0, copied // 4, copied // 2, 3 * copied // 4, 1 << 40):
                try:
                    plan = search(proj, SEQ, gpu, host, SLOW)
                    mixed += len(set(plan)) > 1
                except PlanError:
                    plan = None
                assert search(proj, SEQ, gpu, host, SLOW, first_fit=True) is (plan is not None), (form, gpu, host)
    assert mixed  # budgets where the plan runs two policies: the search's pairs are reached


def test_plan_of_a_model_reads_its_form_and_applies():
    form = FORMS["lora bf16 autocast"]
    model = _model(form)
    config, got = form_of(model, autocast=torch.bfloat16)
    assert got.kind == "lora" and got.rank == 8 and set(got.targets) == set(form.targets)
    assert got.autocast == torch.bfloat16 and got.weights == torch.float32
    tight = _budgets(form)[2]
    p = selective_ckpt.plan(model, gpu=tight, host="1TiB", batch=BATCH, seq_len=SEQ, autocast=torch.bfloat16,
                            rates=FAST)
    assert isinstance(p, Plan) and len(p) == LAYERS
    text = str(p)
    assert "layer   0" in text and "tokens/s" in text and p.describe() in text
    convert(model)
    assert set_recompute(model, p) == list(p)
    with pytest.raises(ValueError, match="seq_len"):
        selective_ckpt.plan(model, gpu="80GB", seq_len=0)
    with pytest.raises(ValueError, match="--host"):
        selective_ckpt.plan(model, gpu="80GB", host="lots", seq_len=SEQ)
    with pytest.raises(ValueError, match="form is read from the model"):
        selective_ckpt.plan(model, gpu="80GB", seq_len=SEQ, form=form)


def test_offload_times_hide_copies_up_to_the_overlap():
    r = _rates(1e9)  # 1 GB/s; overlap 0.9
    L = 4
    fwd, bwd = [1.0] * L, [2.0] * L
    # 0.5 GB a layer: 0.5 s / 0.9 < 1 s of forward: hidden
    assert timing.offload_times(fwd, bwd, [int(0.5e9)] * L, r) == pytest.approx((4.0, 8.0))
    # 3 GB a layer: 3.33 s a copy against 1 s windows: forward waits for the copy two layers back, backward reloads
    f, b = timing.offload_times(fwd, bwd, [int(3e9)] * L, r)
    assert f > 4.0 + 2 and b > 8.0 + 2
    # nothing offloaded: the compute alone
    assert timing.offload_times(fwd, bwd, [0] * L, r) == (4.0, 8.0)


def test_attention_kept_rebuilds_cheaper_than_full_at_long_context():
    from selective_ckpt.fit.configs import load_config
    from selective_ckpt.fit.cost import step_cost

    cost = step_cost(load_config("Llama-3.1-8B"), TrainingForm("lora", autocast=torch.bfloat16))
    r = rates_for("H200")
    short, long = (timing.layer_times(cost, r, s, s) for s in (8192, 131072))
    full, kept = keeping.resolve("full"), keeping.resolve("attention-kept")
    share = {s: timing.rebuild_time(t, kept) / timing.rebuild_time(t, full) for s, t in ((8192, short), (131072, long))}
    assert share[131072] < 0.5 < share[8192] < 1.0
    assert long.attention_forward / long.forward > 0.6


def test_rates_table_and_overrides():
    assert rates_for("h100").device == "H100-80GB"
    assert rates_for("H200", device_to_host=25e9).device_to_host == 25e9
    with pytest.raises(ValueError, match="no rate table"):
        rates_for("TPU-v5")
    with pytest.raises(TypeError, match="unknown rate"):
        rates_for("H200", pcie=1)
    with pytest.raises(ValueError, match="overlap"):
        _rates(1e9).__class__(**{**_rates(1e9).to_dict(), "overlap": 2})


def test_convert_applies_a_plan():
    form = FORMS["full fp32"]
    p = selective_ckpt.plan(_config(), gpu=_budgets(form)[2], host=1 << 40, batch=BATCH, seq_len=SEQ, form=form,
                            rates=FAST)
    model = convert(_model(form), plan=p)
    assert [state_of(m).policy for m in selective_ckpt.recomputable_layers(model)] == list(p)
    with pytest.raises(ValueError, match="either recompute or plan"):
        convert(_model(form), recompute="full", plan=p)
