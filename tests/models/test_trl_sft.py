"""TRL's SFTTrainer on a converted model: packed batches follow the unconverted loss curve, and the
recompute mode each layer runs is said at the first training step (SFTConfig turns gradient
checkpointing on by default, which makes every converted layer "full")."""

import copy
import logging
import warnings

import pytest
import torch

from selective_ckpt import convert

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(60)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def _data():
    g = torch.Generator().manual_seed(0)
    texts = [" ".join(f"w{int(i)}" for i in torch.randint(0, 60, (int(n),), generator=g))
             for n in torch.randint(5, 30, (24,), generator=g)]
    return datasets.Dataset.from_dict({"text": texts})


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=88, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         pad_token_id=0, eos_token_id=1, bos_token_id=1)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def _train(model, tmp_path, name, **overrides):
    from trl import SFTConfig, SFTTrainer

    args = dict(output_dir=str(tmp_path / name), max_steps=6, per_device_train_batch_size=2, learning_rate=1e-3,
                packing=True, max_length=64, logging_steps=1, report_to=[], seed=0, data_seed=0,
                dataloader_num_workers=0, save_strategy="no", use_cpu=True, disable_tqdm=True)
    args.update(overrides)
    trainer = SFTTrainer(model=model, args=SFTConfig(**args), train_dataset=_data(), processing_class=_tokenizer())
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_packed_sft_follows_the_unconverted_loss_curve(tmp_path, caplog):
    plain = _model()
    ours = convert(copy.deepcopy(plain))
    ref = _train(plain, tmp_path, "plain", activation_checkpointing=False)
    with caplog.at_level(logging.INFO, logger="selective_ckpt"):
        got = _train(ours, tmp_path, "ours", activation_checkpointing=False)
    assert len(got) == len(ref) == 6
    for a, b in zip(got, ref):
        assert abs(a - b) <= 2e-4 * abs(b), (got, ref)
    assert any('2 "selective"' in r.message for r in caplog.records), [r.message for r in caplog.records]
    assert all(m._selective_ckpt.recompute == "selective" for m in ours.model.layers)


def test_default_sft_config_checkpointing_is_announced(tmp_path, caplog):
    ours = convert(_model())
    with caplog.at_level(logging.WARNING, logger="selective_ckpt"), warnings.catch_warnings():
        # TRL 1.16's SFTConfig defaults gradient_checkpointing=True, the name transformers 5 deprecates for
        # activation_checkpointing: its default as it stands, in this test only (the others pass the current name)
        warnings.filterwarnings("ignore", message="`gradient_checkpointing` is deprecated", category=FutureWarning)
        _train(ours, tmp_path, "default", max_steps=1)  # SFTConfig's default: gradient checkpointing on
    said = [r.message for r in caplog.records if r.levelno >= logging.WARNING]
    assert any('2 "full"' in m and "gradient_checkpointing=False" in m for m in said), said
