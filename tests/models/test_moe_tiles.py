"""Mixture-of-experts MLPs in sequence tiles (keeping.policy(..., mlp_tiles=n) under "full" and "attention-kept").

Mixtral, Qwen2-MoE (a shared expert beside the routed ones) and Qwen3-MoE, tiled against untiled and against the
unconverted model in float64 (tests/reference.py: 2x / 3x plain PyTorch's float32 error): the loss with the
auxiliary load-balancing loss (output_router_logits), the router logits per layer ([B*S, E], transformers'
order), the gradient of every trained parameter, for 2 and 3 tiles of S = 13 (ragged last tiles) and tiles of
one token; router and experts run inside each tile's checkpoint. LoRA with dropout: on Qwen2-MoE's shared
expert (inside the tiles; PEFT has no adapter for the experts' 3-D parameters) the backward applies the
forward's masks, and a rebuild that draws afresh is caught; on Mixtral's attention (outside the tiles) tiled
follows untiled. Kept bytes per layer are the untiled policy's (and the estimate's), and the fit's growth walk
shows the routed rows' transient divided by the tile count.
"""

import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from selective_ckpt import convert, keeping, set_recompute
from selective_ckpt.keeping import tiling
from selective_ckpt.models.configuration import layer_estimate
from selective_ckpt.models.patches import MLP_TILES
from selective_ckpt.registry import recomputable_layers
from tests.models.families.moe import FAMILIES
from tests.models.hf_checks import batch, triple
from tests.reference import assert_within_rule

transformers = pytest.importorskip("transformers")

S = 13
TILES = (2, 3, S)  # 7+6 and 5+4+4 (ragged last tiles), and tiles of one token
BY_NAME = {f.name: f for f in FAMILIES}
AUX = dict(router_aux_loss_coef=0.05)


@pytest.fixture
def tile_calls(monkeypatch):
    """The token count of every tile checkpointed (forward and the layers' re-runs), with preserve_rng_state."""
    calls = []

    def spy(fn, x, **kwargs):
        assert kwargs == dict(use_reentrant=False, preserve_rng_state=True)
        calls.append(x.shape[-2])
        return checkpoint(fn, x, **kwargs)

    monkeypatch.setattr(tiling, "checkpoint", spy)
    return calls


def _step(model, ids, mask, seed=3):
    """(name, tensor) of the loss (transformers' loss plus its coefficient times the load-balancing loss), the
    load-balancing loss, each layer's router logits and every parameter's gradient."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model(input_ids=ids, attention_mask=mask, labels=ids, output_router_logits=True, use_cache=False)
    out.loss.backward()
    # GLM-4.5's causal LM has no load-balancing loss and returns no router logits
    aux = [] if out.aux_loss is None else [("aux_loss", out.aux_loss.detach())]
    return ([("loss", out.loss.detach())] + aux +
            [(f"router_logits[{i}]", t.detach()) for i, t in enumerate(out.router_logits or ())] +
            [(f"grad {n}", p.grad.detach().clone()) for n, p in model.named_parameters() if p.grad is not None])


def _assert_close(got, want, name, rel):
    assert got.shape == want.shape and got.dtype == want.dtype, name
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    if torch.equal(got, want):
        return
    err, scale = (got - want).abs().max().item(), want.abs().max().item()
    assert err <= rel * scale, f"{name}: {err:.3e} from the untiled run, more than {rel} x its scale {scale:.3e}"


def _check(tiled, untiled, plain=None, ref64=None, rel=1e-5, floor=1e-5):
    """tiled's tensors close to untiled's and, given the unconverted model in float32 and float64, within the rule
    (2x its error for losses and logits, 3x for gradients)."""
    assert [n for n, _ in tiled] == [n for n, _ in untiled]
    for i, ((name, t), (_, u)) in enumerate(zip(tiled, untiled)):
        _assert_close(t, u, name, rel)
        if ref64 is not None:
            assert plain[i][0] == ref64[i][0] == name
            assert_within_rule(t, plain[i][1], ref64[i][1], 3 if name.startswith("grad") else 2, floor=floor,
                               name=name)


def _policy(mode, tiles):
    return keeping.policy(mode, mlp_tiles=tiles)


# the fast tier runs Qwen3-MoE; the others (each 7-20 s on 2 cores) are slow
@pytest.mark.parametrize("family", [pytest.param(f, marks=() if f.name == "qwen3_moe" else pytest.mark.slow, id=f.name)
                                    for f in FAMILIES])
def test_tiled_moe_matches_untiled_and_the_reference(family, tile_calls):
    ref, plain, ours = triple(family.build(**AUX))
    ids, mask = batch(b=2, s=S)  # row 1 left-padded: the load-balancing loss reads the mask per token
    ref64, plain = _step(ref, ids, mask), _step(plain, ids, mask)
    for mode in ("attention-kept", "full"):
        set_recompute(ours, mode)
        untiled = _step(ours, ids, mask)
        assert not tile_calls
        _check(untiled, untiled, plain, ref64)
        for tiles in TILES if mode == "attention-kept" else (3,):
            set_recompute(ours, _policy(mode, tiles))
            assert [getattr(layer.mlp, MLP_TILES) for layer in recomputable_layers(ours)] == [tiles, tiles]
            _check(_step(ours, ids, mask), untiled, plain, ref64)
            # each layer's forward and its re-run in backward: router and experts in the tiles of tile_sizes
            assert tile_calls == tiling.tile_sizes(S, tiles) * 4, (mode, tiles)
            tile_calls.clear()


def test_router_logits_keep_transformers_order_with_a_batch():
    """Each layer's logits are one [B*S, E] tensor, batch-major as transformers' router makes them, whatever the
    tiles: the same rows as the untiled run's (within float rounding), so a padding mask reads the right tokens."""
    torch.manual_seed(0)
    model = convert(BY_NAME["qwen3_moe"].build(**AUX)().train())
    ids, mask = batch(b=3, s=S)
    set_recompute(model, "attention-kept")
    untiled = dict(_step(model, ids, mask))
    set_recompute(model, _policy("attention-kept", 4))
    tiled = dict(_step(model, ids, mask))
    for i in range(2):
        got, want = tiled[f"router_logits[{i}]"], untiled[f"router_logits[{i}]"]
        assert got.shape == (3 * S, 6)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(tiled["aux_loss"], untiled["aux_loss"], rtol=1e-6, atol=0)


def test_no_grad_runs_transformers_own_block(tile_calls):
    torch.manual_seed(0)
    model = convert(BY_NAME["mixtral"].build()().train())
    set_recompute(model, _policy("attention-kept", 3))
    ids, _ = batch(b=1, s=S)
    with torch.no_grad():
        out = model(input_ids=ids, output_router_logits=True)
    assert not tile_calls and [t.shape for t in out.router_logits] == [(S, 4)] * 2


def test_copies_and_pickles_tile_as_their_original(tile_calls):
    """The blocks' patched forwards (Mixtral's and Qwen3-MoE's too, whose untiled forward is transformers') and the
    tile count survive deepcopy and pickle."""
    import pickle

    for family in FAMILIES:
        torch.manual_seed(0)
        model = convert(family.build()().train())
        set_recompute(model, _policy("attention-kept", 3))
        ids, _ = batch(b=1, s=S)
        for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
            tile_calls.clear()
            clone(input_ids=ids).logits.sum().backward()
            assert tile_calls == tiling.tile_sizes(S, 3) * 4, family.name


# --- LoRA with dropout

def _lora(family, targets, dropout):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = BY_NAME[family].build(**AUX)().train()
    model.config._attn_implementation = "sdpa"
    torch.manual_seed(1)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=targets,
                                             init_lora_weights=False))
    return copy.deepcopy(model).double(), copy.deepcopy(model), convert(model)


def _identical(a, b):
    assert [n for n, _ in a] == [n for n, _ in b]
    for (name, u), (_, v) in zip(a, b):
        assert torch.equal(u, v), name


def _shared_expert_lora_grads_differ(a, b):
    return any(not torch.equal(u, v) for (name, u), (_, v) in zip(a, b) if ".shared_expert" in name and "lora_" in name)


@pytest.mark.parametrize("slow", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["attention-kept", "both"])
def test_lora_dropout_on_the_shared_expert_is_the_forwards_mask(monkeypatch, slow):
    """Qwen2-MoE with LoRA (dropout 0.1) on every Linear, the shared expert's and its gate's inside the tiles:
    the tiled step equals the same tiles without their checkpoints (backward differentiates the forward's own
    masks) bit for bit, and tile checkpoints whose rebuild draws the seeds afresh give other gradients."""
    model = _lora("qwen2_moe", "all-linear", 0.1)[-1]
    assert any(".shared_expert." in n and "lora_" in n for n, _ in model.named_parameters())
    ids, mask = batch(b=2, s=S)
    for mode in ("attention-kept",) + (("full",) if slow else ()):
        set_recompute(model, _policy(mode, 3))
        tiled = _step(model, ids, mask)
        with monkeypatch.context() as m:
            m.setattr(tiling, "checkpoint", lambda fn, x, **kwargs: fn(x))
            exact = _step(model, ids, mask)
        _identical(tiled, exact)
        with monkeypatch.context() as m:
            m.setattr(tiling, "checkpoint",
                      lambda fn, x, **kwargs: checkpoint(fn, x, **{**kwargs, "preserve_rng_state": False}))
            redrawn = _step(model, ids, mask)
        assert torch.equal(redrawn[0][1], exact[0][1])  # the same forward ...
        assert _shared_expert_lora_grads_differ(redrawn, exact)  # ... but backward differentiated other masks


@pytest.mark.slow
def test_lora_without_dropout_on_the_shared_expert_follows_the_reference():
    ref, plain, model = _lora("qwen2_moe", "all-linear", 0.0)
    ids, mask = batch(b=2, s=S)
    ref64, plain = _step(ref, ids, mask), _step(plain, ids, mask)
    set_recompute(model, "attention-kept")
    untiled = _step(model, ids, mask)
    for tiles in (2, S):
        set_recompute(model, _policy("attention-kept", tiles))
        _check(_step(model, ids, mask), untiled, plain, ref64)


@pytest.mark.slow
def test_lora_dropout_on_mixtral_attention_tiled_follows_untiled():
    """Mixtral (PEFT adapts its attention, not its experts' 3-D parameters) with attention LoRA dropout 0.1: the
    tiles draw nothing, so the attention's masks and the whole step follow the untiled one."""
    model = _lora("mixtral", ["q_proj", "k_proj", "v_proj", "o_proj"], 0.1)[-1]
    ids, mask = batch(b=2, s=S)
    set_recompute(model, "attention-kept")
    untiled = _step(model, ids, mask)
    for tiles in (3, S):
        set_recompute(model, _policy("attention-kept", tiles))
        _check(_step(model, ids, mask), untiled)


# --- what a layer keeps, and what the fit's walk sees

@pytest.mark.parametrize("family", ["mixtral", pytest.param("qwen2_moe", marks=pytest.mark.slow)])
def test_kept_bytes_per_layer_are_the_untiled_policys(family):
    """Bytes a layer keeps past its forward (3 layers minus 1, halved) under attention-kept: with 4 tiles as without,
    the estimate's, plus the copy of the CPU generator's state that each checkpoint preserving the RNG state keeps
    with the graph (tests/keeping/test_attention_kept.py): the layer's, and with tiles each tile's (host memory on
    a GPU, which the estimate does not count); nothing else."""
    from selective_ckpt.memory.peak import cpu_allocation_deltas

    ids = torch.randint(0, 90, (2, 17), generator=torch.Generator().manual_seed(2))
    rng_state = torch.get_rng_state().numel()
    for tiles in (1, 4):
        held = []
        for n in (1, 3):
            torch.manual_seed(0)
            model = convert(BY_NAME[family].build(num_hidden_layers=n, use_cache=False)().train(),
                            recompute=_policy("attention-kept", tiles))
            model(input_ids=ids, labels=ids)  # first calls change state once
            out = []
            held.append(sum(cpu_allocation_deltas(lambda m=model, o=out: o.append(m(input_ids=ids, labels=ids).loss))))
        per_layer = (held[1] - held[0]) / 2
        checkpoints = 1 + (tiles if tiles > 1 else 0)
        assert per_layer == layer_estimate(recomputable_layers(model)[1], 17, 2, None) + checkpoints * rng_state, tiles


def _routed_rows_transient(config, contexts, tiles, form):
    """The most bytes of the experts' [rows, 2f] grouped-matmul output alive at once, at each context, and the
    bytes the step keeps in the policy's classes."""
    from selective_ckpt.fit import growth

    origins = growth.growing_allocations(config, form, contexts, _policy("attention-kept", tiles))
    rows = [o for o in origins if o.op == "grouped_mm" and "moe.py" in o.where and o.kind == "transient"]
    assert rows, growth.format_table(origins, contexts)
    assert not [o for o in origins if o.kind == "grows"], growth.format_table(origins, contexts)
    widest = max(o.largest.shape[-1] for o in rows)
    most = {s: max(o.most[s] for o in rows if o.largest.shape[-1] == widest) for s in contexts}
    return most, growth.summary(origins, contexts)["kept"]


def _check_growth(contexts):
    from selective_ckpt.fit.forms import TrainingForm

    form = TrainingForm("lora")
    untiled, kept = _routed_rows_transient("Mixtral-8x7B", contexts, 1, form)
    tiled, kept_tiled = _routed_rows_transient("Mixtral-8x7B", contexts, 4, form)
    assert kept_tiled == kept
    for s in contexts:
        assert untiled[s] / tiled[s] == pytest.approx(4, rel=0.01), (s, untiled, tiled)
    return untiled, tiled


def test_growth_walk_divides_the_routed_rows_by_the_tiles():
    """Mixtral-8x7B, LoRA, attention-kept: the routed rows' [S*top_k, 2f] transient falls to a quarter with 4
    tiles (8K and 32K tokens; the 128K/512K walk is in the slow tier), what the layers keep does not change."""
    _check_growth((8192, 32768))


@pytest.mark.slow
def test_growth_walk_divides_the_routed_rows_by_the_tiles_at_long_contexts():
    untiled, tiled = _check_growth((131072, 524288))
    assert untiled[524288] == 1048576 * 28672 * 4  # 112 GiB of float32 routed rows at 512K tokens ...
    assert tiled[524288] == untiled[524288] // 4  # ... 28 GiB in 4 tiles
