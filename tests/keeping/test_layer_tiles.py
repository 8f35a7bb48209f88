"""Whole decoder layers in query tiles (keeping.layer_tiles, LayerPolicy.layer_tiles) under "full".

Tiled against untiled "full" for tile counts on S = 13 (ragged last tiles, tiles of one token, more tiles than
tokens): outputs and gradients within a few float32 roundings of the untiled run (a matmul over fewer rows rounds
otherwise; dK, dV and weight gradients are summed tile by tile) and within the rule against the unconverted model in
float64 (tests/reference.py), for families with grouped k/v, q/k norms, sliding windows, soft-capping with pre/post
norms, GPT-2's packed c_attn and parallel residuals; the layer input offloaded too. Attention's dropout keeps the
untiled mask (one seed, the kernel's mask of the global row). Seed-drawn LoRA dropout in a tile gives the gradients
of the masks the forward applied (checked against the same passes differentiated by autograd directly), and a rebuild
that does not restore the RNG state is caught; QLoRA; packed documents across tile boundaries. What the layer keeps
is its input (the ledger), and a tiled step's peak is below the untiled one's. Refusals: mixtures of experts,
SelectiveDecoderLayer, policies other than "full", attention weights asked of a tiled layer.
"""

import contextlib

import pytest
import torch

from selective_ckpt import SelectiveDecoderLayer, convert, keeping, set_recompute
from selective_ckpt.keeping import layer_tiles
from selective_ckpt.keeping.offload import OffloadEngine
from selective_ckpt.keeping.streams import SimulatedStreams
from selective_ckpt.keeping.tiling import tile_sizes
from selective_ckpt.memory.peak import cpu_allocation_deltas, running_peak
from tests.keeping.test_tiling import _build, _check, _hf_step, _lora_llama

transformers = pytest.importorskip("transformers")

S = 13
TILES = (3, 13, 20)  # a ragged last tile, tiles of one token, more tiles than tokens


@pytest.fixture
def tile_calls(monkeypatch):
    """(pass, tile length) of every pass-1 and pass-2 call of a tiled layer."""
    calls = []
    kv, tile = layer_tiles.LayerTiles.keys_values, layer_tiles.LayerTiles.tile

    def spy_kv(self, x, start, end):
        calls.append(("kv", end - start))
        return kv(self, x, start, end)

    def spy_tile(self, x, start, end, keys, values):
        assert keys.shape[2] == values.shape[2] == end  # the keys up to the tile's end
        calls.append(("tile", end - start))
        return tile(self, x, start, end, keys, values)

    monkeypatch.setattr(layer_tiles.LayerTiles, "keys_values", spy_kv)
    monkeypatch.setattr(layer_tiles.LayerTiles, "tile", spy_tile)
    return calls


def _expected_calls(length, tiles, layers=2):
    """Per layer: forward's two passes, then backward's pass 1, pass 2 (last tile first) and pass 1 again."""
    sizes = tile_sizes(length, tiles)
    forward = [("kv", n) for n in sizes] + [("tile", n) for n in sizes]
    backward = [("kv", n) for n in sizes] + [("tile", n) for n in reversed(sizes)] + [("kv", n) for n in
                                                                                      reversed(sizes)]
    return sorted((forward + backward) * layers)


def _set(model, tiles, offload=False):
    policy = keeping.policy("full", offload=["input"] if offload else [], layer_tiles=tiles)
    engine = OffloadEngine(streams=SimulatedStreams(delay=2)) if offload else None
    set_recompute(model, policy, engine=engine)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2", "gpt_neox"])  # grouped k/v, q/k norms, c_attn,
def test_tiled_layers_match_untiled(family, tile_calls):  # parallel residual and a packed query_key_value
    from tests.models.hf_checks import batch, triple

    ref, plain_model, ours = triple(_build(family))
    ids, mask = batch(b=2, s=S)  # row 1 left-padded
    inputs = dict(input_ids=ids, attention_mask=mask)
    ref64, plain = _hf_step(ref, **inputs), _hf_step(plain_model, **inputs)
    set_recompute(ours, "full")
    untiled = _hf_step(ours, **inputs)
    assert not tile_calls
    for tiles, offload in [(n, False) for n in TILES] + [(4, True)] * (family == "llama"):
        _set(ours, tiles, offload)
        _check(_hf_step(ours, **inputs), untiled, rel=1e-5, plain=plain, ref64=ref64)
        assert sorted(tile_calls) == _expected_calls(S, tiles), (tiles, offload)
        tile_calls.clear()


def test_soft_capping_and_sliding_windows_in_tiles():
    """Gemma 2: soft-capped scores, sliding-window layers, pre- and post-norms; S longer than its window."""
    from tests.models.families import by_name
    from tests.models.hf_checks import triple

    ref, plain_model, ours = triple(by_name("gemma2").build())
    window = ours.config.sliding_window
    length = 2 * window + 3
    ids = torch.randint(0, ours.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(1))
    ref64, plain = _hf_step(ref, input_ids=ids), _hf_step(plain_model, input_ids=ids)
    set_recompute(ours, "full")
    untiled = _hf_step(ours, input_ids=ids)
    for tiles in (3, length):
        _set(ours, tiles)
        _check(_hf_step(ours, input_ids=ids), untiled, rel=1e-5, plain=plain, ref64=ref64)


def test_attention_dropout_keeps_the_untiled_mask():
    """One seed for all tiles and the kernel's mask of the global row: the untiled run's masks, so its gradients."""
    torch.manual_seed(0)
    model = convert(_build("llama")().train())
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.3
    ids = torch.randint(0, 97, (1, S), generator=torch.Generator().manual_seed(1))
    set_recompute(model, "full")
    untiled = _hf_step(model, input_ids=ids)
    set_recompute(model, "selective")
    assert not torch.equal(_hf_step(model, input_ids=ids, seed=4)[0][1], untiled[0][1])  # dropout is on
    for tiles in (3, S):
        _set(model, tiles)
        _check(_hf_step(model, input_ids=ids), untiled, rel=1e-5)


def test_packed_documents_across_tile_boundaries():
    from tests.models.hf_checks import batch, triple

    ref, plain_model, ours = triple(_build("llama"))
    ids, _ = batch(b=1, s=23)
    pos = torch.tensor([list(range(9)) + list(range(5)) + list(range(9))])  # documents at 0, 9, 14
    inputs = dict(input_ids=ids, position_ids=pos)
    ref64, plain = _hf_step(ref, **inputs), _hf_step(plain_model, **inputs)
    set_recompute(ours, "full")
    untiled = _hf_step(ours, **inputs)
    for tiles in (2, 3, 5):  # tile boundaries at 12; 8, 16; 5, 10, 15, 19: inside documents
        _set(ours, tiles)
        _check(_hf_step(ours, **inputs), untiled, rel=1e-5, plain=plain, ref64=ref64)


# --- dropout by seed inside the tiles: LoRA, QLoRA

def _autograd_tiles(run, x, *params):
    """The same two passes, in the same order, differentiated by autograd directly (nothing rebuilt): the gradients
    of the masks the forward drew."""
    keys, values = zip(*(run.keys_values(run.rows(x, s, e), s, e) for s, e in run.bounds))
    K, V = torch.cat(keys, dim=2), torch.cat(values, dim=2)
    return torch.cat([run.tile(run.rows(x, s, e), s, e, K[:, :, :e], V[:, :, :e]) for s, e in run.bounds], dim=1)


@contextlib.contextmanager
def _not_restoring(state, device_type):
    yield


def _lora_grads_differ(a, b):
    return any(not torch.equal(u, v) for (name, u), (_, v) in zip(a, b) if "lora_" in name)


def test_lora_dropout_in_tiles_is_exact_and_a_redraw_is_caught(monkeypatch):
    model = _lora_llama(0.1)[-1]
    ids = torch.randint(0, 97, (2, S), generator=torch.Generator().manual_seed(1))
    _set(model, 4)
    tiled = _hf_step(model, input_ids=ids)
    with monkeypatch.context() as m:
        m.setattr(layer_tiles._TiledLayer, "apply", _autograd_tiles)
        exact = _hf_step(model, input_ids=ids)
    _check(tiled, exact, rel=1e-5)
    with monkeypatch.context() as m:
        m.setattr(layer_tiles, "_rng_restored", _not_restoring)
        redrawn = _hf_step(model, input_ids=ids)
    assert torch.equal(redrawn[0][1], tiled[0][1])  # the forward is the same ...
    assert _lora_grads_differ(redrawn, tiled)  # ... but backward differentiated other masks


def test_lora_without_dropout_tiled_matches_untiled():
    ref, plain, model = _lora_llama(0.0)
    ids = torch.randint(0, 97, (2, S), generator=torch.Generator().manual_seed(1))
    ref64, plain = _hf_step(ref, input_ids=ids), _hf_step(plain, input_ids=ids)
    set_recompute(model, "full")
    untiled = _hf_step(model, input_ids=ids)
    for tiles in (3, 13):
        _set(model, tiles)
        _check(_hf_step(model, input_ids=ids), untiled, rel=1e-5, plain=plain, ref64=ref64)


def test_qlora_in_tiles(tmp_path, monkeypatch):
    from tests.models.test_training_configs import build

    model = convert(build("llama", "qlora-dropout", 2, tmp_path))
    ids = torch.randint(0, 96, (2, S), generator=torch.Generator().manual_seed(1))
    _set(model, 5)
    tiled = _hf_step(model, input_ids=ids)
    with monkeypatch.context() as m:
        m.setattr(layer_tiles._TiledLayer, "apply", _autograd_tiles)
        # computed in bfloat16 (the 4-bit base's compute dtype), summed in another order: a bfloat16 rounding
        _check(tiled, _hf_step(model, input_ids=ids), rel=2 ** -8)
    with monkeypatch.context() as m:
        m.setattr(layer_tiles, "_rng_restored", _not_restoring)
        assert _lora_grads_differ(_hf_step(model, input_ids=ids), tiled)


# --- what a tiled layer keeps, and its peak

def test_a_tiled_layer_keeps_its_input():
    """The ledger: per layer the input, as untiled "full" keeps it (and as memory.estimate says)."""
    from selective_ckpt import memory

    torch.manual_seed(0)
    model = convert(_build("llama")().train())
    ids = torch.randint(0, 97, (1, 64), generator=torch.Generator().manual_seed(1))
    kept = {}
    for tiles in (1, 4):
        _set(model, tiles)
        report = memory.ledger(model, input_ids=ids)
        kept[tiles] = [report.by_class(layer=name) for name in report.by_layer if name != "-"]
    assert len(kept[4]) == 2 and kept[4] == kept[1]
    assert all(layer["input"] == {"device": 64 * model.config.hidden_size * 4, "host": 0} for layer in kept[4])


def _peak(step):
    step()
    return running_peak(cpu_allocation_deltas(step))


def test_tiles_lower_the_peak():
    """One converted Llama layer at S = 512 (h = 64, f = 112): the step's peak with 8 layer tiles at most 70 % of
    the untiled "full" one's (the layer's transients over the sequence become a tile's)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=112, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=1, vocab_size=32, max_position_embeddings=2048)
    model = convert(LlamaForCausalLM(cfg).train())
    ids = torch.randint(0, 32, (1, 512), generator=torch.Generator().manual_seed(1))

    def step():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()

    peaks = {}
    for tiles in (1, 8):
        _set(model, tiles)
        peaks[tiles] = _peak(step)
    assert peaks[8] <= 0.7 * peaks[1], peaks


# --- refusals

def test_refusals():
    from tests.models.families import by_name

    with pytest.raises(ValueError, match="only \"full\" does"):
        keeping.policy("attention-kept", layer_tiles=2)
    with pytest.raises(ValueError, match="give one of them"):
        keeping.policy("full", mlp_tiles=2, layer_tiles=2)
    with pytest.raises(ValueError, match="layer_tiles must be an int"):
        keeping.policy("full", layer_tiles=0)
    moe = convert(by_name("mixtral").build()().train())
    with pytest.raises(ValueError, match="mixture of experts"):
        set_recompute(moe, keeping.policy("full", layer_tiles=2))
    assert all(layer._selective_ckpt.policy == "selective" for layer in moe.model.layers)  # nothing changed
    plain = by_name("mixtral").build()().train()
    with pytest.raises(ValueError, match="mixture of experts"):
        convert(plain, recompute=keeping.policy("full", layer_tiles=2))
    assert not any(hasattr(m, "_selective_ckpt") for m in plain.modules())
    layer = SelectiveDecoderLayer(32, 4)
    with pytest.raises(ValueError, match="converted Hugging Face decoder layers"):
        layer.policy = keeping.policy("full", layer_tiles=2)


def test_attention_weights_are_refused_in_tiles():
    torch.manual_seed(0)
    model = convert(_build("llama")().train())
    _set(model, 2)
    ids = torch.randint(0, 97, (1, S), generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="cannot return attention weights"):
        model(input_ids=ids, output_attentions=True)
