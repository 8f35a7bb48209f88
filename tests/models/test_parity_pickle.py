"""A converted model pickles, deep-copies and loads as a converted model: same kernels, same bits, same floor."""

import copy
import io
import subprocess
import sys

import pytest
import torch

from selective_ckpt import convert
from selective_ckpt.models.patching import PATCHED, BoundForward
from tests.models import hf_checks, test_gpt2, test_hf_llama
from tests.models.families import by_name
from tests.models.hf_checks import batch, kept_bytes_per_layer
from tests.models.test_parity_attention import KernelCalls

transformers = pytest.importorskip("transformers")

BUILDS = {  # GPT-2 with every dropout site on: the seeded dropout patch must survive too
    "gpt2": lambda n: test_gpt2.build(n_layer=n, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)(),
    "llama": lambda n: test_hf_llama.build(num_hidden_layers=n)(),
    "mistral": lambda n: by_name("mistral").build(num_hidden_layers=n)(),
    "qwen2": lambda n: by_name("qwen2").build(num_hidden_layers=n)(),
    "qwen3": lambda n: by_name("qwen3").build(num_hidden_layers=n)(),
}


def converted(family, n=2):
    torch.manual_seed(0)
    model = BUILDS[family](n).train()
    model.config._attn_implementation = "sdpa"
    return convert(model)


def saved_and_loaded(model):
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _patched(model):
    return [m for m in model.modules() if PATCHED in vars(m)]  # vars: a PeftModel forwards getattr


def _assert_patches_bound_to(model):
    patched = _patched(model)
    assert patched
    for m in patched:
        assert isinstance(m.forward, BoundForward) and m.forward.__self__ is m


def _step(model, ids, mask):
    torch.manual_seed(3)  # the dropout seeds
    return hf_checks._step(model, input_ids=ids, attention_mask=mask)


@pytest.mark.parametrize("how", ["torch.save", "deepcopy"])
@pytest.mark.parametrize("family", BUILDS)
def test_round_trip_is_the_same_converted_model(family, how, monkeypatch):
    ours = converted(family)
    back = saved_and_loaded(ours) if how == "torch.save" else copy.deepcopy(ours)
    assert back.config._attn_implementation == "selective_ckpt"
    assert [type(m).__name__ for m in _patched(back)] == [type(m).__name__ for m in _patched(ours)]
    _assert_patches_bound_to(back)
    assert [layer._selective_ckpt.recompute for layer in hf_checks._layers(back)] == ["selective"] * 2
    hf_checks.assert_same_state(back, ours)
    ids, mask = batch()
    want = _step(ours, ids, mask)
    calls = KernelCalls(monkeypatch)
    got = _step(back, ids, mask)
    assert calls.n == 2, "the loaded model's layers run selective_ckpt's attention"
    assert torch.equal(got[0], want[0])
    assert set(got[1]) == set(want[1])
    for n in want[1]:
        assert torch.equal(got[1][n], want[1][n]), n
    assert _patched(ours)[0].forward.__self__ is _patched(ours)[0], "the original stays bound to itself"


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_loaded_model_keeps_the_floor(family):
    ids, _ = batch(b=2, s=24, pad_rows=False)
    inputs = {"input_ids": ids}
    ours = kept_bytes_per_layer(lambda n: converted(family, n), inputs)
    back = kept_bytes_per_layer(lambda n: saved_and_loaded(converted(family, n)), inputs)
    assert back == ours


def test_fresh_process_loads_and_runs_converted_models(tmp_path):
    """torch.load in a process that never imported selective_ckpt: the patches and the attention come back."""
    ids, mask = batch()
    for family in BUILDS:
        ours = converted(family).eval()
        torch.save(ours, tmp_path / f"{family}.pt")
        with torch.no_grad():
            torch.save(ours(input_ids=ids, attention_mask=mask).logits, tmp_path / f"{family}.logits.pt")
    torch.save((ids, mask), tmp_path / "batch.pt")
    script = f"""
import sys, torch
ids, mask = torch.load({str(tmp_path / 'batch.pt')!r})
for family in {list(BUILDS)!r}:
    model = torch.load({str(tmp_path)!r} + f"/{{family}}.pt", weights_only=False)
    from transformers import AttentionInterface
    assert model.config._attn_implementation == "selective_ckpt"
    assert "selective_ckpt" in AttentionInterface._global_mapping, family
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask).logits
    want = torch.load({str(tmp_path)!r} + f"/{{family}}.logits.pt")
    assert torch.equal(got, want), family
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


def test_foreign_closure_forwards_are_refused_by_name():
    import pickle

    def local_forward(self, x):
        return x

    layer = torch.nn.Linear(2, 2)
    from selective_ckpt.models.patching import patch_forward
    patch_forward(layer, local_forward)
    with pytest.raises(pickle.PicklingError, match="local_forward cannot be pickled"):
        pickle.dumps(layer)


def test_converted_lora_model_round_trips():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = BUILDS["llama"](2).train()
    model = convert(get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                    init_lora_weights=False)))
    back = saved_and_loaded(model)
    assert type(back).__name__ == "PeftModel"
    _assert_patches_bound_to(back)
    ids, mask = batch()
    want, got = _step(model, ids, mask), _step(back, ids, mask)
    assert torch.equal(got[0], want[0])
    assert set(got[1]) == set(want[1]) and all("lora_" in n for n in got[1])
    for n in want[1]:
        assert torch.equal(got[1][n], want[1][n]), n
