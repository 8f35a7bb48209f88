"""The MLP in sequence tiles (keeping.tiling, LayerPolicy.mlp_tiles) under "full" and "attention-kept".

Tiled against untiled, for every tile count on S = 13 (ragged last tiles, tiles of one token, more tiles than
tokens): outputs and gradients within the rule against float64 (tests/reference.py: 2x / 3x the error of plain
PyTorch in float32) and within a few float32 roundings of the untiled run (a matmul over fewer rows may round
otherwise, so not bit for bit), on SelectiveDecoderLayer stacks and converted Hugging Face models, the layer input
offloaded too. Seed-drawn LoRA dropout inside a tile (a seed per tile and site, so masks depend on the tile count)
gives the gradients of the masks the forward applied (checked against the same tiles without their checkpoints),
and a rebuild that draws afresh is caught; QLoRA; packed documents across tile boundaries; the tile count on the
MLP module through copies and pickles; an MLP forward that does not tile refused (mixtures of experts tile:
tests/models/test_moe_tiles.py); and a tiled layer's peak below the untiled
one's by the tiles' share of the MLP's intermediate.
"""

import copy
import pickle

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from selective_ckpt import SelectiveDecoderLayer, convert, keeping, rng, set_recompute
from selective_ckpt.keeping import tiling
from selective_ckpt.keeping.offload import OffloadEngine
from selective_ckpt.keeping.streams import SimulatedStreams
from selective_ckpt.memory.peak import cpu_allocation_deltas, running_peak
from selective_ckpt.models.patches import MLP_TILES
from tests.reference import assert_within_rule
from tests.test_layer_llama import eager_llama

transformers = pytest.importorskip("transformers")

S = 13
TILES = (2, 3, 5, 13, 20)  # beside 1: ragged last tiles, tiles of one token, more tiles than tokens
# (mode, tile count): every count under both checkpointed modes, and the layer input offloaded beside tiles
CASES = [(mode, tiles) for mode in ("full", "attention-kept") for tiles in TILES] + [
    ("attention-kept, offload input", 5)]
LAYER_SHAPES = {
    "llama": dict(hidden_dim=64, num_heads=4, num_kv_heads=2, ffn_dim=96, norm="rmsnorm", activation="swiglu",
                  rope_theta=10000.0, bias=False),
    "gpt": dict(hidden_dim=48, num_heads=4, ffn_dim=136, norm="layernorm", activation="gelu"),
}


def _policy(mode, tiles):
    if mode.endswith("offload input"):
        return keeping.policy(mode.split(",")[0], offload=["input"], mlp_tiles=tiles)
    return keeping.policy(mode, mlp_tiles=tiles)


def _set(model, mode, tiles):
    policy = _policy(mode, tiles)
    # simulated streams run copies late and poison what was freed early: a missing wait shows as NaN
    engine = OffloadEngine(streams=SimulatedStreams(delay=2)) if policy.offloaded else None
    set_recompute(model, policy, engine=engine)


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


def _assert_close(got, want, name, rel=1e-6):
    """Equal, or within `rel` of the tensor's largest magnitude (summing over tiles rounds otherwise)."""
    assert got.shape == want.shape and got.dtype == want.dtype, name
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    if torch.equal(got, want):
        return
    err, scale = (got - want).abs().max().item(), want.abs().max().item()
    assert err <= rel * scale, f"{name}: {err:.3e} from the untiled run, more than {rel} x its scale {scale:.3e}"


def _check(tiled, untiled, rel=1e-6, plain=None, ref64=None, floor=1e-5):
    """Each of tiled's (name, tensor) close to untiled's, and, given the plain PyTorch run in the same dtype and the
    float64 one, within the rule (2x plain's error for the first, the output; 3x for the gradients)."""
    assert [n for n, _ in tiled] == [n for n, _ in untiled]
    for i, ((name, t), (_, u)) in enumerate(zip(tiled, untiled)):
        _assert_close(t, u, name, rel)
        if ref64 is not None:
            assert_within_rule(t, plain[i][1], ref64[i][1], 2 if i == 0 else 3, floor=floor, name=name)


# --- run_in_tiles itself

def test_tile_sizes_and_calls():
    assert tiling.tile_sizes(13, 1) == [13]
    assert tiling.tile_sizes(13, 2) == [7, 6]
    assert tiling.tile_sizes(13, 5) == [3, 3, 3, 2, 2]
    assert tiling.tile_sizes(13, 13) == tiling.tile_sizes(13, 20) == [1] * 13
    x = torch.randn(2, 13, 8, requires_grad=True)
    seen = []

    def fn(t):
        seen.append(t.shape)
        return t * 2

    assert tiling.run_in_tiles(fn, x, 1) is not None and seen == [x.shape]  # tiles = 1: fn(x) itself
    seen.clear()
    y = tiling.run_in_tiles(fn, x, 5)
    assert [s[-2] for s in seen] == [3, 3, 3, 2, 2] and all(s[0] == 2 for s in seen)  # along S, not B
    assert torch.equal(y, x * 2)
    y.sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 2.0))
    with torch.no_grad():  # nothing to checkpoint: the tiles run one by one
        assert torch.equal(tiling.run_in_tiles(fn, x, 20), x * 2)
    assert torch.equal(tiling.run_in_tiles(fn, torch.ones(5, 3), 2), torch.full((5, 3), 2.0))  # [T, h]: rows
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="tiles must be an int >= 1"):
            tiling.run_in_tiles(fn, x, bad)


# --- SelectiveDecoderLayer: _block reads the policy's tiles, in forward and in "full"'s re-run

def _stack(style, dropout=0.1):
    torch.manual_seed(0)
    stack = nn.Sequential(*[SelectiveDecoderLayer(**LAYER_SHAPES[style], dropout=dropout, attn_dropout=dropout)
                            for _ in range(2)]).train()
    with torch.no_grad():  # norm weights and biases away from 1 and 0
        for name, p in stack.named_parameters():
            if ".ln" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.2 * torch.randn_like(p))
    return stack


def _stack_step(stack, x, dy):
    x = x.detach().clone().requires_grad_()
    stack.zero_grad(set_to_none=True)
    torch.manual_seed(5)
    y = stack(x)
    y.backward(dy)
    return [("y", y.detach()), ("dx", x.grad)] + [(f"d{n}", p.grad) for n, p in stack.named_parameters()]


def _stack_reference(stack, x, dy, dtype):
    """The stack in eager PyTorch in `dtype` with the masks of the seeds its layers draw (tests/test_layer_llama.py):
    the plain run (float32) and the reference (float64)."""
    torch.manual_seed(5)
    seeds = [layer._draw_seeds(x.device) for layer in stack]
    seeds = [tuple(None if s is None else rng.seed_from_tensor(s) for s in layer_seeds) for layer_seeds in seeds]
    xr = x.detach().to(dtype).requires_grad_()
    params = [{n: p.detach().to(dtype).requires_grad_() for n, p in layer.named_parameters()} for layer in stack]
    h = xr
    for layer, p, s in zip(stack, params, seeds):
        h = eager_llama(layer, p, h, seeds=s, p=layer.dropout, p_attn=layer.attn_dropout)
    h.backward(dy.to(dtype))
    return [("y", h.detach()), ("dx", xr.grad)] + [(f"d{i}.{n}", t.grad) for i, p in enumerate(params)
                                                  for n, t in p.items()]


@pytest.mark.parametrize("style", sorted(LAYER_SHAPES))
def test_selective_layer_tiled_matches_untiled(style, tile_calls):
    stack = _stack(style)
    g = torch.Generator().manual_seed(1)
    h = LAYER_SHAPES[style]["hidden_dim"]
    x, dy = torch.randn(2, S, h, generator=g), torch.randn(2, S, h, generator=g)
    plain, ref64 = _stack_reference(stack, x, dy, torch.float32), _stack_reference(stack, x, dy, torch.float64)
    untiled = {}
    for mode, tiles in CASES:
        if mode not in untiled:
            _set(stack, mode, 1)
            untiled[mode] = _stack_step(stack, x, dy)
            assert not tile_calls
            torch.testing.assert_close(untiled[mode][0][1], ref64[0][1].float(), rtol=1e-4, atol=1e-4)  # same masks
        _set(stack, mode, tiles)
        _check(_stack_step(stack, x, dy), untiled[mode], plain=plain, ref64=ref64)
        # each layer's forward and its re-run in backward: the tiles of tile_sizes
        assert tile_calls == tiling.tile_sizes(S, tiles) * 4, (mode, tiles)
        tile_calls.clear()


# --- converted Hugging Face models: the MLP module holds the tile count its patched forward reads

def _gpt2(**kw):
    cfg = dict(vocab_size=97, n_positions=64, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
               attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**cfg, **kw}))


def _build(family):
    from tests.models.families import by_name

    return _gpt2() if family == "gpt2" else by_name(family).build()


def _hf_step(model, seed=3, **inputs):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model(**inputs, use_cache=False)
    mask = inputs.get("attention_mask")
    logits = out.logits if mask is None else out.logits[mask.bool()]
    (logits.double() * torch.linspace(-1, 1, logits.shape[-1], dtype=torch.float64)).sum().backward()
    return [("logits", logits.detach())] + [(f"grad {n}", p.grad.detach().clone())
                                            for n, p in model.named_parameters() if p.grad is not None]


@pytest.mark.parametrize("family", ["llama", "phi3", "gpt2"])  # gated, packed gate_up, plain (Conv1D) MLPs
def test_converted_tiled_matches_untiled(family, tile_calls):
    from tests.models.hf_checks import batch, triple

    ref, plain_model, ours = triple(_build(family))
    ids, mask = batch(b=2, s=S)  # row 1 left-padded
    inputs = dict(input_ids=ids, attention_mask=mask)
    ref64, plain = _hf_step(ref, **inputs), _hf_step(plain_model, **inputs)
    untiled = {}
    for mode, tiles in CASES:
        if mode not in untiled:
            _set(ours, mode, 1)
            untiled[mode] = _hf_step(ours, **inputs)
            assert not tile_calls
        _set(ours, mode, tiles)
        _check(_hf_step(ours, **inputs), untiled[mode], plain=plain, ref64=ref64)
        assert tile_calls == tiling.tile_sizes(S, tiles) * 4, (mode, tiles)
        tile_calls.clear()


def _decoder_layers(model):
    from selective_ckpt.registry import recomputable_layers

    return recomputable_layers(model)


def test_tile_count_lives_on_the_mlp_module(tile_calls):
    """Not in the state dict; kept by deepcopy and pickle, so a copy tiles as its original; reset with the policy."""
    torch.manual_seed(0)
    model = convert(_build("llama")().train())
    keys = list(model.state_dict())
    set_recompute(model, keeping.policy("attention-kept", mlp_tiles=3))
    assert [getattr(layer.mlp, MLP_TILES) for layer in _decoder_layers(model)] == [3, 3]
    assert list(model.state_dict()) == keys
    ids = torch.randint(0, 97, (1, S), generator=torch.Generator().manual_seed(1))
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        tile_calls.clear()
        _hf_step(clone, input_ids=ids)
        assert tile_calls == tiling.tile_sizes(S, 3) * 4
    set_recompute(model, "full")
    assert [getattr(layer.mlp, MLP_TILES) for layer in _decoder_layers(model)] == [1, 1]


def test_gpt2_mlp_dropout_stays_the_untiled_mask(tile_calls):
    """GPT-2's MLP ends in a dropout: it runs on the concatenated output, with one seed and the untiled mask."""
    model = convert(_gpt2(resid_pdrop=0.2)().train())
    ids = torch.randint(0, 97, (2, S), generator=torch.Generator().manual_seed(1))
    for mode in ("full", "attention-kept"):
        _set(model, mode, 1)
        untiled = _hf_step(model, input_ids=ids)
        for tiles in (3, 20):
            _set(model, mode, tiles)
            _check(_hf_step(model, input_ids=ids), untiled)
            assert tile_calls
            tile_calls.clear()


# --- dropout by seed inside the tiles: LoRA, QLoRA

def _eager_tiles(monkeypatch):
    """The tiles without their checkpoints: backward differentiates the forward's own graph and masks."""
    monkeypatch.setattr(tiling, "checkpoint", lambda fn, x, **kwargs: fn(x))


def _redrawn_tiles(monkeypatch):
    """Tile checkpoints whose rebuild draws from the generator afresh (the re-draw of DeepSpeed's and Liger's
    tiled MLPs): LoRA's dropout seeds, and so its masks, differ from the forward's."""
    monkeypatch.setattr(tiling, "checkpoint",
                        lambda fn, x, **kwargs: checkpoint(fn, x, **{**kwargs, "preserve_rng_state": False}))


def _lora_llama(dropout):
    """The PEFT model (unconverted in float64, unconverted and converted in float32)."""
    import copy

    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = _build("llama")().train()
    model.config._attn_implementation = "sdpa"
    torch.manual_seed(1)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules="all-linear",
                                             init_lora_weights=False))
    return copy.deepcopy(model).double(), copy.deepcopy(model), convert(model)


def _assert_identical(a, b):
    assert [n for n, _ in a] == [n for n, _ in b]
    for (name, u), (_, v) in zip(a, b):
        assert torch.equal(u, v), name


def _mlp_lora_grads_differ(a, b):
    return any(not torch.equal(u, v) for (name, u), (_, v) in zip(a, b) if ".mlp." in name and "lora_" in name)


def test_lora_dropout_in_tiles_is_exact_and_a_redraw_is_caught(monkeypatch):
    model = _lora_llama(0.1)[-1]
    ids = torch.randint(0, 97, (2, S), generator=torch.Generator().manual_seed(1))
    for mode in ("full", "attention-kept"):
        set_recompute(model, keeping.policy(mode, mlp_tiles=4))
        tiled = _hf_step(model, input_ids=ids)
        with monkeypatch.context() as m:
            _eager_tiles(m)
            exact = _hf_step(model, input_ids=ids)
        _assert_identical(tiled, exact)
        with monkeypatch.context() as m:
            _redrawn_tiles(m)
            redrawn = _hf_step(model, input_ids=ids)
        assert torch.equal(redrawn[0][1], exact[0][1])  # the forward is the same ...
        assert _mlp_lora_grads_differ(redrawn, exact)  # ... but backward differentiated other masks


def test_lora_without_dropout_tiled_matches_untiled():
    ref, plain, model = _lora_llama(0.0)
    ids = torch.randint(0, 97, (2, S), generator=torch.Generator().manual_seed(1))
    ref64, plain = _hf_step(ref, input_ids=ids), _hf_step(plain, input_ids=ids)
    set_recompute(model, "attention-kept")
    untiled = _hf_step(model, input_ids=ids)
    for tiles in (3, 13):
        set_recompute(model, keeping.policy("attention-kept", mlp_tiles=tiles))
        # an adapter's gradient sums over tokens with cancellation (A's reaches 1e-6 of its scale): 1e-5
        _check(_hf_step(model, input_ids=ids), untiled, rel=1e-5, plain=plain, ref64=ref64)


def test_qlora_tiled(tmp_path, monkeypatch):
    from tests.models.test_training_configs import build

    model = convert(build("llama", "qlora-dropout", 2, tmp_path))
    ids = torch.randint(0, 96, (2, S), generator=torch.Generator().manual_seed(1))
    drops = [m for n, m in model.named_modules() if isinstance(m, nn.Dropout) and "lora_dropout" in n]
    assert drops and all(d.p > 0 for d in drops)
    set_recompute(model, keeping.policy("full", mlp_tiles=5))
    tiled = _hf_step(model, input_ids=ids)
    with monkeypatch.context() as m:
        _eager_tiles(m)
        _assert_identical(tiled, _hf_step(model, input_ids=ids))
    with monkeypatch.context() as m:
        _redrawn_tiles(m)
        assert _mlp_lora_grads_differ(_hf_step(model, input_ids=ids), tiled)
    for d in drops:  # without dropout the tiles' masks do not enter: tiled against untiled
        d.p = 0.0
    set_recompute(model, "attention-kept")
    untiled = _hf_step(model, input_ids=ids)
    for tiles in (2, 13):
        set_recompute(model, keeping.policy("attention-kept", mlp_tiles=tiles))
        # computed in bfloat16 (the 4-bit base's compute dtype; bitsandbytes takes another kernel for a few rows):
        # within a bfloat16 rounding
        _check(_hf_step(model, input_ids=ids), untiled, rel=2 ** -8)


# --- packed documents: tiles cut across documents

def test_packed_documents_across_tile_boundaries(tile_calls):
    from tests.models.hf_checks import batch, triple

    ref, plain_model, ours = triple(_build("llama"))
    ids, _ = batch(b=1, s=23)
    pos = torch.tensor([list(range(9)) + list(range(5)) + list(range(9))])  # documents at 0, 9, 14
    inputs = dict(input_ids=ids, position_ids=pos)
    ref64, plain = _hf_step(ref, **inputs), _hf_step(plain_model, **inputs)
    for mode in ("full", "attention-kept"):
        _set(ours, mode, 1)
        untiled = _hf_step(ours, **inputs)
        for tiles in (2, 3, 5):  # boundaries at 12; 8, 16; 5, 10, 15, 19: inside documents
            _set(ours, mode, tiles)
            _check(_hf_step(ours, **inputs), untiled, plain=plain, ref64=ref64)
            assert tile_calls == tiling.tile_sizes(23, tiles) * 4
            tile_calls.clear()


# --- refusals

def test_untiled_forwards_are_refused():
    """An MLP whose forward does not run in tiles (Starcoder2's); mixtures of experts tile (tests/models/
    test_moe_tiles.py)."""
    from tests.models.families import by_name

    torch.manual_seed(0)
    model = convert(by_name("starcoder2").build()().train())
    with pytest.raises(ValueError, match=r"Starcoder2MLP\) has a forward that does not run in tiles"):
        set_recompute(model, keeping.policy("attention-kept", mlp_tiles=2))
    assert all(layer._selective_ckpt.policy == "selective" for layer in _decoder_layers(model))  # nothing changed
    set_recompute(model, keeping.policy("full", mlp_tiles=1))
    mixed = [keeping.policy("full", mlp_tiles=1), keeping.policy("full", mlp_tiles=2)]
    with pytest.raises(ValueError, match="does not run in tiles"):
        set_recompute(model, mixed)
    assert all(layer._selective_ckpt.policy == "full" for layer in _decoder_layers(model))  # no layer changed
    plain = by_name("starcoder2").build()().train()
    with pytest.raises(ValueError, match="does not run in tiles"):
        convert(plain, recompute=keeping.policy("attention-kept", mlp_tiles=4))
    assert not any(hasattr(m, "_selective_ckpt") for m in plain.modules())  # refused before anything changed


# --- the transient: one tile's intermediate at a time

def _peak(step):
    step()  # first calls change state once
    return running_peak(cpu_allocation_deltas(step))


def test_tiles_lower_the_peak_by_their_share_of_the_intermediate():
    """One Llama-shaped layer, S = 512, h = 64, f = 704: the peak of forward + backward falls by at least
    (n - 1) / n of the MLP intermediate (gate, up, product: 3·S·f float32) less 64 KiB."""
    S_, h, f = 512, 64, 704
    intermediate = 3 * S_ * f * 4
    torch.manual_seed(0)
    layer = SelectiveDecoderLayer(h, 4, num_kv_heads=2, ffn_dim=f, norm="rmsnorm", activation="swiglu",
                                  rope_theta=10000.0, bias=False).train()
    x, dy = torch.randn(1, S_, h), torch.randn(1, S_, h)

    def step():
        layer.zero_grad(set_to_none=True)
        layer(x.clone().requires_grad_()).backward(dy)

    figures = {}
    for mode, tiles in (("full", 1), ("full", 4), ("attention-kept", 1), ("attention-kept", 8)):
        set_recompute(layer, keeping.policy(mode, mlp_tiles=tiles))
        figures[mode, tiles] = _peak(step)
    for (mode, tiles), peak in figures.items():
        saved = figures[mode, 1] - peak
        assert saved >= (tiles - 1) / tiles * intermediate - 64 * 1024, (mode, tiles, figures)

    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=h, intermediate_size=f, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=S_)
    torch.manual_seed(0)
    model = convert(transformers.LlamaForCausalLM(cfg).train())
    ids = torch.randint(0, 97, (1, S_), generator=torch.Generator().manual_seed(1))

    def hf_step():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()

    peaks = []
    for tiles in (1, 4):
        set_recompute(model, keeping.policy("attention-kept", mlp_tiles=tiles))
        peaks.append(_peak(hf_step))
    assert peaks[0] - peaks[1] >= 3 / 4 * intermediate - 64 * 1024, peaks
