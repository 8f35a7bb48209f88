"""The fused loss head on converted Hugging Face causal LMs: the training loss and every parameter
gradient against float64 (the 2x / 3x rule against the unconverted model in the same dtype) for each
family, tied and untied embeddings, num_items_in_batch and shift_labels, logits_to_keep, PEFT LoRA on
lm_head and modules_to_save=["lm_head"]; eval mode and labels=None still return logits;
classification heads are untouched; nothing of size tokens x vocabulary is kept after forward."""

import copy
import inspect

import pytest
import torch

from selective_ckpt import convert
from selective_ckpt.memory.peak import cpu_allocation_deltas
from tests.models.hf_checks import VOCAB, assert_same_state, batch
from tests.reference import assert_within_rule

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

LLAMA_SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
FAMILIES = {
    "gpt2": lambda **kw: GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0,
                                                    **kw)),
    "llama": lambda **kw: LlamaForCausalLM(LlamaConfig(**LLAMA_SHAPE, **kw)),
    "mistral": lambda **kw: MistralForCausalLM(MistralConfig(**LLAMA_SHAPE, sliding_window=5, **kw)),
    "qwen2": lambda **kw: Qwen2ForCausalLM(Qwen2Config(**LLAMA_SHAPE, **kw)),
    "qwen3": lambda **kw: Qwen3ForCausalLM(Qwen3Config(**LLAMA_SHAPE, head_dim=16, **kw)),
}


def triple(family, dtype=torch.float32, **kw):
    torch.manual_seed(0)
    ref = FAMILIES[family](**kw).double().train()
    ref.config._attn_implementation = "sdpa"
    plain = copy.deepcopy(ref).to(dtype)
    ours = convert(copy.deepcopy(plain))
    return ref, plain, ours


def labelled(b=2, s=19, seed=1):
    ids, mask = batch(b, s, seed)
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, 3:7] = -100  # an unscored prompt
    return ids, mask, labels


def loss_and_grads(model, **inputs):
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    return out, {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_loss_matches(ref, plain, ours, **inputs):
    r, rg = loss_and_grads(ref, **inputs)
    p, pg = loss_and_grads(plain, **inputs)
    o, og = loss_and_grads(ours, **inputs)
    assert o.logits is None and p.logits is not None
    assert o.loss.dtype == p.loss.dtype == torch.float32
    # Floor for a 16-bit model: one ulp of the loss in the model's dtype (a mean over every token, where
    # eager's rounding errors may cancel by luck; the layers' kernels round differently from transformers').
    dtype = next(plain.parameters()).dtype
    floor = 1e-5 if dtype == torch.float32 else torch.finfo(dtype).eps * r.loss.abs().item()
    assert_within_rule(o.loss, p.loss, r.loss, 2, floor=floor, name="loss")
    assert set(og) == set(pg) == set(rg), "the same parameters must receive gradients"
    for n in rg:
        assert_within_rule(og[n], pg[n], rg[n], 3, floor=1e-5, name=f"grad {n}")
    return o


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_loss_and_gradients(family):
    ref, plain, ours = triple(family)
    ids, mask, labels = labelled()
    assert_loss_matches(ref, plain, ours, input_ids=ids, attention_mask=mask, labels=labels)
    assert_same_state(ours, plain)
    # Trainer picks dataset columns (and num_items_in_batch) from the forward's signature.
    assert inspect.signature(ours.forward) == inspect.signature(plain.forward)
    # Eval mode and labels=None: logits as transformers gives them.
    for model in (ours, plain):
        model.eval()
    with torch.no_grad():
        o, p = ours(input_ids=ids, labels=labels), plain(input_ids=ids, labels=labels)
    assert o.logits is not None and o.logits.shape == p.logits.shape
    torch.testing.assert_close(o.loss, p.loss, rtol=1e-5, atol=1e-6)
    ours.train()
    assert ours(input_ids=ids).logits.shape == (2, 19, VOCAB)


@pytest.mark.parametrize("tied", [True, False])
def test_tied_and_untied_embeddings_bfloat16(tied):
    ref, plain, ours = triple("llama", torch.bfloat16, tie_word_embeddings=tied)
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tied
    ids, mask, labels = labelled(seed=2)
    assert_loss_matches(ref, plain, ours, input_ids=ids, attention_mask=mask, labels=labels)


def test_num_items_in_batch_shift_labels_and_tuple_output():
    ref, plain, ours = triple("qwen2")
    ids, mask, labels = labelled(seed=3)
    shifted = torch.roll(labels, -1, 1)
    shifted[:, -1] = -100
    for extra in (dict(num_items_in_batch=torch.tensor(25)), dict(num_items_in_batch=11), dict(shift_labels=shifted)):
        assert_loss_matches(ref, plain, ours, input_ids=ids, attention_mask=mask, labels=labels, **extra)
    out = ours(input_ids=ids, labels=labels, return_dict=False)
    want = plain(input_ids=ids, labels=labels, return_dict=False)
    assert len(out) == len(want) - 1  # the logits are left out
    torch.testing.assert_close(out[0], want[0], rtol=1e-5, atol=1e-6)


def test_fully_ignored_batch_gives_what_transformers_gives():
    _, plain, ours = triple("llama")
    ids, _ = batch(seed=4)
    labels = torch.full_like(ids, -100)
    o, og = loss_and_grads(ours, input_ids=ids, labels=labels)
    p, pg = loss_and_grads(plain, input_ids=ids, labels=labels)
    assert o.loss.isnan() and p.loss.isnan()
    for n in pg:
        torch.testing.assert_close(og[n], pg[n])


def test_logits_to_keep():
    _, plain, ours = triple("llama")
    ids, _, labels = labelled(seed=5)
    ours.eval()
    plain.eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids, logits_to_keep=3).logits,
                                   plain(input_ids=ids, logits_to_keep=3).logits)
    ours.train()
    # Keeping every position is the whole batch; fewer positions do not line up with the labels, an
    # error in transformers too.
    o = ours(input_ids=ids, labels=labels, logits_to_keep=ids.shape[1])
    torch.testing.assert_close(o.loss, plain.train()(input_ids=ids, labels=labels).loss, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="batch_size"):
        ours(input_ids=ids, labels=labels, logits_to_keep=3)
    with pytest.raises(ValueError):
        plain(input_ids=ids, labels=labels, logits_to_keep=3)


def _peft(model, **cfg):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(5)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **cfg))


@pytest.mark.parametrize("cfg", [dict(target_modules=["lm_head", "q_proj"]),
                                 dict(target_modules=["q_proj"], modules_to_save=["lm_head"])],
                         ids=["lora-on-lm_head", "modules_to_save"])
@pytest.mark.parametrize("order", ["peft-then-convert", "convert-then-peft"])
def test_peft_heads(cfg, order):
    pytest.importorskip("peft")
    ref, plain, _ = triple("llama")
    base = copy.deepcopy(plain)  # get_peft_model changes the model it wraps
    ours = convert(_peft(base, **cfg)) if order == "peft-then-convert" else _peft(convert(base), **cfg)
    ref_p, plain_p = _peft(ref, **cfg), _peft(plain, **cfg)
    ids, mask, labels = labelled(seed=6)
    o = assert_loss_matches(ref_p, plain_p, ours, input_ids=ids, attention_mask=mask, labels=labels)
    assert o is not None
    head_grads = [n for n, p in ours.named_parameters() if "lm_head" in n and p.grad is not None]
    assert head_grads, "the head's adapter / saved copy must receive gradients"
    with ours.disable_adapter():
        off = ours(input_ids=ids, labels=labels).loss
    assert not torch.allclose(off, ours(input_ids=ids, labels=labels).loss), "adapters must be active"


def test_lora_head_with_dropout_replays_its_masks():
    """lora_dropout on lm_head (seeded, models/peft.py): the chunked head under checkpointing replays the
    masks it drew, so two runs from one seed give the same bits, and the masks do change the result."""
    pytest.importorskip("peft")
    _, plain, _ = triple("llama")
    ours = convert(_peft(copy.deepcopy(plain), target_modules=["lm_head"], lora_dropout=0.3))
    ids, mask, labels = labelled(seed=7)
    runs = []
    for _ in range(2):
        torch.manual_seed(11)
        runs.append(loss_and_grads(ours, input_ids=ids, labels=labels))
    (o, og), (o2, og2) = runs
    assert torch.equal(o.loss, o2.loss)
    for n in og:
        assert torch.equal(og[n], og2[n]), n
    assert any("lora_A" in n and og[n].abs().sum() > 0 for n in og)
    torch.manual_seed(12)
    assert not torch.equal(loss_and_grads(ours, input_ids=ids, labels=labels)[0].loss, o.loss)


def test_classification_head_unaffected():
    torch.manual_seed(0)
    plain = LlamaForSequenceClassification(LlamaConfig(**LLAMA_SHAPE, num_labels=3)).train()
    ours = convert(copy.deepcopy(plain))
    assert "forward" not in vars(ours)
    ids, _ = batch(seed=8)
    labels = torch.tensor([0, 2])
    o, p = ours(input_ids=ids, labels=labels), plain(input_ids=ids, labels=labels)
    assert o.logits.shape == p.logits.shape == (2, 3)
    torch.testing.assert_close(o.loss, p.loss, rtol=1e-5, atol=1e-6)


def test_nothing_tokens_by_vocabulary_is_kept():
    """Per token per vocabulary entry, transformers' Llama keeps its fp32 logits after forward (4 B and
    more); the converted model keeps the head's gradients (dhidden, dweight) and its layers' floor."""
    torch.manual_seed(0)
    vocab, b, s = 4096, 2, 64
    plain = LlamaForCausalLM(LlamaConfig(**{**LLAMA_SHAPE, "vocab_size": vocab}, tie_word_embeddings=False)).train()
    ours = convert(copy.deepcopy(plain))
    ids = torch.randint(0, vocab, (b, s))

    def kept(model):
        held = []
        deltas = cpu_allocation_deltas(lambda: held.append(model(input_ids=ids, labels=ids).loss))
        if deltas is None:
            pytest.skip("the profiler's raw allocator events are not available")
        return sum(deltas)

    kp, ko = kept(plain), kept(ours)
    tokens = b * s
    assert kp >= tokens * vocab * 4  # at least the fp32 logits
    head_grads = (tokens * 64 + vocab * 64) * 4
    assert ko - head_grads < kp - tokens * vocab * 4, (ko, kp)
    assert ko <= kp - tokens * vocab * 4 + head_grads


def test_a_step_leaves_nothing_for_the_garbage_collector():
    """With the garbage collector off, a training step whose gradients accumulate in place allocates nothing
    that outlives it: nothing of it (the final hidden states the head read) waits in a reference cycle."""
    torch.manual_seed(0)
    ours = convert(LlamaForCausalLM(LlamaConfig(**LLAMA_SHAPE, use_cache=False)).train())
    ids, _ = batch(seed=8)

    def step():
        ours(input_ids=ids, labels=ids).loss.backward()

    step()  # gradients exist from here on
    deltas = cpu_allocation_deltas(step)  # with the collector off
    if deltas is None:
        pytest.skip("the profiler's raw allocator events are not available")
    assert sum(deltas) == 0
