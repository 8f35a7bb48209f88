"""Packed documents through transformers' flash-attention kwargs (other 4-D masks: test_parity_attention.py)."""

import pytest
import torch

from selective_ckpt import ConversionError, convert
from selective_ckpt.models import attention as hf_attention
from tests.models.hf_checks import VOCAB

transformers = pytest.importorskip("transformers")
from transformers import DataCollatorWithFlattening, LlamaConfig, LlamaForCausalLM  # noqa: E402

LENGTHS = (7, 1, 11, 5)


def model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=88, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
    return convert(LlamaForCausalLM(cfg).train())


def documents():
    g = torch.Generator().manual_seed(2)
    return [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]


def packed_batch(docs):
    """What transformers' DataCollatorWithFlattening gives a flash-attention model: cu_seq_lens_q/k included."""
    collate = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=True)
    batch = collate([{"input_ids": d} for d in docs])
    assert batch["cu_seq_lens_q"].tolist() == [0, 7, 8, 19, 24]
    return batch


def weights(n):
    return torch.linspace(-1, 1, n * VOCAB).reshape(n, VOCAB)


def test_flash_kwargs_reach_attention_and_match_separate_documents(monkeypatch):
    docs = documents()
    batch = packed_batch(docs)
    seen = []
    original = hf_attention._cu_seqlens

    def spy(kwargs, name):
        cu = original(kwargs, name)
        seen.append(None if cu is None else cu.tolist())
        return cu

    monkeypatch.setattr(hf_attention, "_cu_seqlens", spy)
    ours = model()
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = ours(**inputs, use_cache=False).logits[0]
    (logits * weights(len(logits))).sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in ours.named_parameters()}
    assert seen == [[0, 7, 8, 19, 24]] * 2, "cu_seq_lens_q/k must reach the attention function of every layer"

    ours.zero_grad()
    separate, start = [], 0
    for d in docs:
        out = ours(input_ids=torch.tensor([d])).logits[0]
        (out * weights(len(logits))[start:start + len(d)]).sum().backward()
        separate.append(out.detach())
        start += len(d)
    torch.testing.assert_close(logits.detach(), torch.cat(separate), rtol=1e-5, atol=1e-5)
    for n, p in ours.named_parameters():
        torch.testing.assert_close(packed_grads[n], p.grad, rtol=1e-4, atol=1e-5, msg=n)


def test_flash_kwargs_disagreeing_with_the_documents_are_refused():
    batch = packed_batch(documents())
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    wrong = torch.tensor([0, 7, 19, 24], dtype=torch.int32)
    inputs["cu_seq_lens_q"] = inputs["cu_seq_lens_k"] = wrong
    with pytest.raises(ConversionError, match="cu_seq_lens_q disagrees"):
        model()(**inputs, use_cache=False)
    inputs["cu_seq_lens_k"] = batch["cu_seq_lens_k"]
    with pytest.raises(ConversionError, match="both be given and equal"):
        model()(**inputs, use_cache=False)
