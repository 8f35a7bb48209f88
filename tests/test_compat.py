"""selective_ckpt.compat, the one seam to private names of transformers, bitsandbytes and PEFT: each name still
resolves on the installed versions and does what the package relies on; the supported transformers range is
enforced at convert and matches pyproject's [hf] extra; and no other module of the package reaches a private
name of those libraries (a new one fails here)."""

import ast
import collections
import importlib.util
import re
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM

from selective_ckpt import ConversionError, compat, convert

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "selective_ckpt"


def _llama(**kwargs):
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16, use_cache=False,
                         **kwargs)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _ids():
    return torch.randint(0, 32, (1, 6), generator=torch.Generator().manual_seed(0))


# ---- transformers' names, each read and written where transformers reads it

def test_attention_implementation_is_the_one_transformers_runs_and_collectors_are_seen():
    calls = []

    def recording(module, query, key, value, attention_mask, **kwargs):
        calls.append(compat.active_output_collector())
        return torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True).transpose(1, 2), \
            None

    AttentionInterface.register("compat_recording", recording)
    model = _llama()
    assert compat.requested_attention_implementation(model.config) == compat.attention_implementation(model.config)
    compat.set_requested_attention_implementation(model.config, None)
    assert compat.requested_attention_implementation(model.config) is None
    compat.set_attention_implementation(model.config, "compat_recording")
    assert compat.attention_implementation(model.config) == "compat_recording"
    assert compat.requested_attention_implementation(model.config) == "compat_recording"
    assert compat.active_output_collector() is None  # outside any model forward
    model(_ids())
    assert len(calls) == 2 and all(c is None or "attentions" not in c for c in calls), calls
    calls.clear()
    model(_ids(), output_attentions=True)
    assert len(calls) == 2 and all("attentions" in c for c in calls), calls


def test_experts_implementation_reaches_the_experts():
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2)
    assert compat.names_experts_implementation(config)
    compat.set_requested_experts_implementation(config, "batched_mm")
    assert compat.requested_experts_implementation(config) == "batched_mm"
    model = MixtralForCausalLM(config)
    experts = model.model.layers[0].mlp.experts
    compat.set_experts_implementation(model.config, "eager")
    assert compat.experts_implementation(experts.config) == "eager"
    assert compat.requested_experts_implementation(model.config) == "eager"
    assert compat.is_expert_parallel(experts) is False
    assert compat.has_own_expert_gating(experts) is False
    from transformers.integrations import moe

    assert callable(moe._default_apply_gate)  # has_own_expert_gating compares against it by name


def test_layer_checkpoint_function_is_the_one_transformers_calls():
    model = _llama().train()
    layers = list(model.model.layers)
    assert all(compat.layer_checkpoint_function(layer) is None for layer in layers)
    if hasattr(model, "activation_checkpointing_enable"):  # the name gradient_checkpointing_enable warns there
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert all(compat.layer_checkpoint_function(layer) is not None for layer in layers)
    seen = []

    def recording(fn, *args, **kwargs):
        seen.append(fn)
        return fn(*args, **kwargs)

    for layer in layers:
        compat.set_layer_checkpoint_function(layer, recording)
        assert compat.layer_checkpoint_function(layer) is recording
    model(_ids())
    assert len(seen) == len(layers)


def test_own_loss_function_is_the_one_the_forward_calls():
    model = _llama()
    assert compat.own_loss_function(model) is None
    called = []

    def loss(logits, labels, vocab_size, **kwargs):
        called.append(vocab_size)
        return logits.float().sum() * 0

    compat.set_own_loss_function(model, loss)
    assert compat.own_loss_function(model) is loss
    ids = _ids()
    assert model(ids, labels=ids).loss.item() == 0 and called == [32]
    compat.set_own_loss_function(model, None)
    assert compat.own_loss_function(model) is None and "_loss_function" not in vars(model)
    assert model(ids, labels=ids).loss.item() > 0 and called == [32]


def test_sdpa_support_and_gpt2_upcast_attention_resolve():
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedModel

    assert "_supports_sdpa" in vars(PreTrainedModel)
    assert compat.family_supports_sdpa(LlamaForCausalLM) is True
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_embd=16, n_layer=1, n_head=2, n_positions=16))
    attention = gpt2.transformer.h[0].attn
    upcast = compat.upcast_reordered_attention(attention)
    assert upcast is not None and upcast.__self__ is attention
    assert compat.upcast_reordered_attention(torch.nn.Linear(2, 2)) is None
    assert compat.is_conv1d(attention.c_attn) and not compat.is_conv1d(torch.nn.Linear(2, 2))


def test_bitsandbytes_and_peft_classes_resolve_by_the_names_matched():
    bnb = pytest.importorskip("bitsandbytes")
    from bitsandbytes.autograd import _functions
    from peft.tuners import _buffer_dict
    from peft.tuners.lora import bnb as lora_bnb
    from peft.tuners.lora import layer as lora_layer
    from peft.utils.other import ModulesToSaveWrapper

    for name in compat.QUANTIZED_LINEARS + compat.QUANTIZED_PARAMETERS:
        assert isinstance(getattr(bnb.nn, name), type), name
    for name in compat.PEFT_CONTAINERS:
        assert isinstance(getattr(_buffer_dict, name), type), name
    lora_classes = [lora_layer.Linear, lora_bnb.Linear4bit, lora_bnb.Linear8bitLt]
    assert [c.__name__ for c in lora_classes] == list(compat.PEFT_LORA_LINEARS)
    assert all(compat.is_peft_lora_linear(c) for c in lora_classes)
    assert not compat.is_peft_lora_linear(torch.nn.Linear)
    assert ModulesToSaveWrapper.__name__ == "ModulesToSaveWrapper"
    assert hasattr(_functions, "MatMul8bitFp")
    # the 8-bit Linear's CPU training matmul holds its input on the node; dropping it leaves the output's backward
    linear = bnb.nn.Linear8bitLt(16, 8, has_fp16_weights=False, bias=False).to("cpu")
    assert compat.is_int8_linear(linear) and compat.is_quantized_linear(linear)
    assert compat.is_4bit(bnb.nn.Linear4bit(16, 8)) and not compat.is_4bit(linear)
    x = torch.randn(4, 16, requires_grad=True)
    out = linear(x)
    node = compat.int8_input_holder(out)
    assert node is not None and node.A is x
    compat.drop_int8_input(node)
    assert compat.int8_input_holder(out) is None
    out.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    assert compat.int8_input_holder(torch.nn.Linear(16, 8)(x)) is None


# ---- the supported transformers range

def test_installed_transformers_is_in_the_range():
    assert compat.transformers_version() == transformers.__version__
    version = transformers.__version__
    assert compat.transformers_supported(version), (version, compat.TRANSFORMERS_RANGE)
    assert compat.unsupported_transformers() is None


def test_pyproject_pins_the_same_range():
    text = (ROOT / "pyproject.toml").read_text()
    hf = re.search(r"^hf = \[(.*)\]$", text, re.M)
    assert hf is not None, "pyproject.toml has no hf extra"
    assert f'"transformers{compat.TRANSFORMERS_RANGE}"' in hf.group(1), hf.group(0)


@pytest.mark.parametrize("version, supported", [
    ("5.17.0", True), ("5.21.1", True), ("5.25.0", True), ("5.25.3.post1", True),
    ("5.16.1", False), ("5.26.0", False), ("5.26.0.dev0", False), ("4.57.6", False), ("6.0.0", False),
])
def test_version_check_at_convert(monkeypatch, version, supported):
    model = _llama()
    monkeypatch.setattr(compat, "transformers_version", lambda: version)
    if supported:
        assert compat.unsupported_transformers() is None
        convert(model)
        return
    before = {k: v.clone() for k, v in model.state_dict().items()}
    forwards = {name: "forward" in vars(m) for name, m in model.named_modules()}
    with pytest.raises(ConversionError) as err:
        convert(model)
    message = str(err.value)
    assert f"transformers {version} is installed" in message and compat.TRANSFORMERS_RANGE in message, message
    assert compat.TRANSFORMERS_RANGE == ">=5.17,<5.26"
    # refused before anything changed
    assert compat.attention_implementation(model.config) == "sdpa"
    assert {name: "forward" in vars(m) for name, m in model.named_modules()} == forwards
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_missing_transformers_is_not_a_version_error(monkeypatch):
    monkeypatch.setattr(compat, "transformers_version", lambda: None)
    assert compat.unsupported_transformers() is None


# ---- the guard: private names of transformers, PEFT, bitsandbytes and accelerate only through compat.py

THIRD_PARTY = ("transformers", "peft", "bitsandbytes", "accelerate")
# a private name is defined: assigned as an attribute or a module/class-level name, or a def
DEFINED = re.compile(r"\.(_[a-z]\w*)\s*(?::[^=\n]*)?=(?!=)|\bdef (_[a-z]\w*)|^[ \t]*(_[a-z]\w*)\s*(?::[^=\n]*)?=(?!=)",
                     re.M)
# our own: defined on self or cls, as a def, or at module or class level
OWN = re.compile(r"\b(?:self|cls)\.(_[a-z]\w*)\s*(?::[^=\n]*)?=(?!=)|\bdef (_[a-z]\w*)|"
                 r"^[ \t]*(_[a-z]\w*)\s*(?::[^=\n]*)?=(?!=)", re.M)
# transformers files that hold no module code the package touches (tokenizers, processors, conversion scripts)
NOT_MODULE_CODE = re.compile(r"(modular|convert|image_processing|video_processing|processing|feature_extraction|"
                             r"tokenization)_")
# Call sites in files edited elsewhere, each to be switched to the compat function named: an entry that no longer
# matches fails too, so this list only shrinks.
PENDING = {
    ("models/hf.py", "_attn_implementation"): "set_attention_implementation",
}


def _names(files, pattern):
    names = set()
    for f in files:
        names.update(g for m in pattern.finditer(f.read_text(errors="ignore")) for g in m.groups() if g)
    return names


def _package_root(name):
    return Path(importlib.util.find_spec(name).origin).parent


def _third_party_private_names():
    """Private names the third-party libraries define, less torch's and Python's (the seam is not about them: a
    namedtuple's _replace) and ours."""
    theirs = set()
    for name in THIRD_PARTY:
        theirs |= _names((f for f in _package_root(name).rglob("*.py") if not NOT_MODULE_CODE.match(f.name)), DEFINED)
    torch_root = _package_root("torch")
    torch_files = [*torch_root.glob("*.py")] + [f for d in ("nn", "autograd", "_library", "utils")
                                                for f in (torch_root / d).rglob("*.py")]
    others = _names(torch_files, DEFINED) | {n for o in (torch, torch.Tensor, torch.nn.Module,
                                                         collections.namedtuple("T", "a")) for n in dir(o)}
    return theirs - others - _names(PACKAGE.rglob("*.py"), OWN)


def _of_torch(node):
    """Whether an attribute chain starts at the torch module (torch.ops.aten._x, torch._C._y)."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name) and node.id == "torch"


def _private_uses(path, names):
    """(line, name) of each private third-party name `path` reaches: an attribute (not of self or cls), a string
    (getattr, vars(...).get, hasattr), or an import of a private name from a third-party module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in THIRD_PARTY:
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("_")]
            found += [(node.lineno, part) for part in node.module.split(".") if part in names]
        elif isinstance(node, ast.Attribute) and node.attr in names and not _of_torch(node) and not (
                isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            found.append((node.lineno, node.attr))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
            found.append((node.lineno, node.value))
    return found


def test_private_third_party_names_only_in_compat():
    names = _third_party_private_names()
    # the guard sees the names it is about (else it checks nothing)
    assert {"_attn_implementation", "_gradient_checkpointing_func", "_active_collector", "_loss_function"} <= names
    assert not names & {"_version", "_modules", "_parameters", "_replace"}  # torch's, Python's
    uses = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "compat.py" and path.parent == PACKAGE:
            continue
        rel = path.relative_to(PACKAGE).as_posix()
        for line, name in _private_uses(path, names):
            uses.setdefault((rel, name), []).append(line)
    outside = {f"selective_ckpt/{rel}:{lines[0]} {name}": None for (rel, name), lines in uses.items()
               if (rel, name) not in PENDING}
    assert not outside, f"private names of {', '.join(THIRD_PARTY)} outside selective_ckpt/compat.py: {list(outside)}"
    gone = [key for key in PENDING if key not in uses]
    assert not gone, f"switched to compat: remove from PENDING {gone}"
    # compat.py itself reaches them (so the check above would see one moved back)
    assert {name for _, name in _private_uses(PACKAGE / "compat.py", names)} >= {
        "_attn_implementation", "_attn_implementation_internal", "_gradient_checkpointing_func", "_active_collector",
        "_loss_function", "_supports_sdpa", "_upcast_and_reordered_attn"}


def test_the_guard_sees_each_kind_of_access_and_not_ours_or_torchs(tmp_path):
    names = {"_attn_implementation", "_gradient_checkpointing_func", "_active_collector", "_loss_function"}
    source = tmp_path / "sample.py"
    source.write_text(
        "from transformers.utils.output_capturing import _active_collector\n"
        "config._attn_implementation = 'sdpa'\n"
        "f = getattr(layer, '_gradient_checkpointing_func', None)\n"
        "f = vars(model).get('_loss_function')\n"
        "self._attn_implementation = 1\n"  # our own attribute
        "torch.ops.aten._attn_implementation(x)\n"  # torch's
        "y = t._version\n")
    assert sorted(_private_uses(source, names)) == [
        (1, "_active_collector"), (2, "_attn_implementation"), (3, "_gradient_checkpointing_func"),
        (4, "_loss_function")]


# Third-party classes matched by name outside compat.py (by design the model specs name their families' classes,
# transformers' model classes, which are not in this set)
PENDING_CLASS_NAMES = {}


def test_bitsandbytes_and_peft_classes_matched_by_name_only_in_compat():
    classes = re.compile(r"^class (\w+)", re.M)
    names = set()
    for name in ("peft", "bitsandbytes"):
        for f in _package_root(name).rglob("*.py"):
            names |= set(classes.findall(f.read_text(errors="ignore")))
    names |= set(classes.findall((_package_root("transformers") / "pytorch_utils.py").read_text()))
    names |= {f"{n}Backward" for n in names}  # an autograd Function's node class
    names -= {n for o in (torch, torch.nn, torch.autograd) for n in dir(o)}  # torch's "Linear", "Dropout"
    assert {"Linear4bit", "Linear8bitLt", "Params4bit", "ModulesToSaveWrapper", "Conv1D",
            "MatMul8bitFpBackward"} <= names
    uses = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "compat.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
                uses.setdefault((rel, node.value), node.lineno)
    outside = [f"selective_ckpt/{rel}:{line} {name!r}" for (rel, name), line in uses.items()
               if (rel, name) not in PENDING_CLASS_NAMES]
    assert not outside, f"classes of peft or bitsandbytes matched by name outside selective_ckpt/compat.py: {outside}"
    gone = [key for key in PENDING_CLASS_NAMES if key not in uses]
    assert not gone, f"switched to compat: remove from PENDING_CLASS_NAMES {gone}"
