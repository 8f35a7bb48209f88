"""A converted model keeps its patched forwards through transformers' hub-kernel kernelization.

transformers kernelizes a model loaded by from_pretrained when the `kernels` package is installed, and
again at every change of training mode (model.train(), model.eval()); kernelize drops the instance
forward of each hub-kernel-named module (RMSNorm). The norms of a converted model must still run
their patched forwards, and the layer must keep its floor, after any number of mode changes, after
deepcopy and pickling, and after kernelize called directly on the converted model.
"""

import copy
import io
import warnings

import pytest
import torch

from selective_ckpt import convert
from selective_ckpt.models.configuration import layer_estimate
from selective_ckpt.models.patching import PATCH
from selective_ckpt.registry import recomputable_layers
from tests.models.families import by_name
from tests.models.hf_checks import batch, kept_bytes_per_layer

transformers = pytest.importorskip("transformers")
kernels = pytest.importorskip("kernels")

LLAMA = by_name("llama")


def _loaded(tmp_path, layers=2):
    """A tiny Llama saved and loaded back by from_pretrained (which kernelizes it), then converted."""
    torch.manual_seed(0)
    path = tmp_path / f"llama-{layers}"
    LLAMA.build(num_hidden_layers=layers)().save_pretrained(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = LLAMA.causal_lm.from_pretrained(path, attn_implementation="sdpa")
    return convert(model)


def _patched(model):
    """(patched modules, those whose forward is no longer their patch)."""
    mods = [(n, m) for n, m in model.named_modules() if PATCH in vars(m)]
    return mods, [n for n, m in mods if vars(m).get("forward") is not vars(m)[PATCH]]


def _norm_ops(model):
    """The ops that one training forward of the first decoder layer's input norm runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    norm = model.model.layers[0].input_layernorm
    with Ops():
        norm(torch.randn(2, 3, model.config.hidden_size))
    return seen


def test_mode_changes_keep_the_patched_norms(tmp_path):
    model = _loaded(tmp_path)
    if not model.use_kernels:
        pytest.skip("this transformers does not kernelize models it loads")
    for mode in (True, False, True):
        model.train(mode)
        mods, lost = _patched(model)
        assert len(mods) > 0 and not lost, lost
    assert any("rms_norm_fwd" in op for op in _norm_ops(model))
    ids, _ = batch(pad_rows=False)
    layer = recomputable_layers(model)[0]
    kept = kept_bytes_per_layer(lambda n: _loaded(tmp_path, n).train(), dict(input_ids=ids))
    assert kept == layer_estimate(layer, ids.shape[1], ids.shape[0], None)


def test_copies_keep_their_patches_through_mode_changes(tmp_path):
    model = _loaded(tmp_path)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    for other in (copy.deepcopy(model), torch.load(buf, weights_only=False)):
        other.eval()
        other.train()
        mods, lost = _patched(other)
        assert len(mods) > 0 and not lost, lost
        assert all(m.__dict__["forward"].module is m for _, m in mods)  # bound to the copy, not the original


def test_kernelize_called_directly_is_undone_at_the_next_training_call(tmp_path):
    model = _loaded(tmp_path).train()
    kernels.kernelize(model, mode=kernels.Mode.TRAINING, device="cpu")
    _, lost = _patched(model)
    assert lost, "kernelize left every patched forward in place: nothing is tested"
    ids, _ = batch(pad_rows=False)
    with pytest.warns(UserWarning, match="replaced after convert"):
        model(input_ids=ids, labels=ids).loss.backward()
    _, lost = _patched(model)
    assert not [n for n in lost if ".layers." in n]  # each decoder layer put its own back; the final norm
    model.eval()  # comes back at the next change of mode (transformers' kernelization)
    model.train()
    assert not _patched(model)[1]
