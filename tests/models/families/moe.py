"""Sparse mixture-of-experts families: Llama-shaped attention and norms, a routed-experts MLP in every layer.

The tiny configs run transformers' "eager" experts loop, the one experts implementation that runs in
float64 (the reference); tests/models/test_hf_moe.py covers grouped_mm and batched_mm. The shared packed
check compares logits bit for bit, which no experts implementation gives (changing one document's tokens
changes how many rows each expert's matmul takes, and with it the rounding of the others' rows):
test_hf_moe.py checks packed documents within float rounding instead.
"""

import pytest

from tests.models.families import Family
from tests.models.hf_checks import VOCAB

transformers = pytest.importorskip("transformers")

_BASE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64, pad_token_id=0, experts_implementation="eager")
MIXTRAL = {**_BASE, "intermediate_size": 48, "num_local_experts": 4, "num_experts_per_tok": 2}
QWEN2_MOE = {**_BASE, "intermediate_size": 80, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
             "num_experts": 6, "num_experts_per_tok": 2}
QWEN3_MOE = {**_BASE, "intermediate_size": 80, "moe_intermediate_size": 32, "num_experts": 6,
             "num_experts_per_tok": 2, "norm_topk_prob": True}
# every layer sparse (first_k_dense_replace 0: the estimate check compares a layer of each model); 6 experts in 2
# groups, 1 of them chosen per token; GLM-4.5's routed_scaling_factor
GLM4_MOE = {**_BASE, "head_dim": 16, "intermediate_size": 80, "moe_intermediate_size": 32, "n_routed_experts": 6,
            "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 0, "n_group": 2,
            "topk_group": 1, "routed_scaling_factor": 2.5}
# DeepSeek-V3: multi-head latent attention with q and kv low ranks (40, 24), q and k of 16 + 8 rotary dims, v of 12
# (odd against the query's 24), interleaved RoPE (its default); GLM-4.5's router and shared experts; every layer
# sparse, the dense layers (first_k_dense_replace) and a q_proj without low rank as further layer kinds
DEEPSEEK_V3 = {**_BASE, "num_key_value_heads": 4, "intermediate_size": 80, "moe_intermediate_size": 32,
               "n_routed_experts": 6, "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 0,
               "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5, "q_lora_rank": 40, "kv_lora_rank": 24,
               "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12}

# gpt-oss's own layer pattern (sliding, then full), a window shorter than the sequence; its default yarn RoPE;
# q/k/v/o biases and the attention sinks as gpt-oss has them. The shared window check compares bits past the
# window, which routing changes in other rows' expert matmuls move: tests/models/test_hf_gpt_oss.py checks it
GPT_OSS = {**_BASE, "head_dim": 16, "intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2,
           "sliding_window": 5}
# the estimate check also at a query width other than the hidden size, as the real models have (gpt-oss-20b: 64
# heads x 64 over 2880; GLM-4.5-Air: 96 x 128 over 4096): 4 heads x 24 over 64
_WIDE_QUERY = (("", {}), ("head_dim 24", {"head_dim": 24}))

FAMILIES = [
    Family("mixtral", transformers.MixtralConfig, transformers.MixtralForCausalLM, MIXTRAL,
           packed=False, lora_targets=("q_proj", "v_proj", "o_proj"),
           heads=(transformers.MixtralForSequenceClassification, transformers.MixtralForTokenClassification)),
    Family("qwen2_moe", transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM, QWEN2_MOE,
           packed=False, lora_targets=("q_proj", "v_proj", "down_proj", "shared_expert_gate"),
           heads=(transformers.Qwen2MoeForSequenceClassification, transformers.Qwen2MoeForTokenClassification)),
    Family("qwen3_moe", transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, QWEN3_MOE,
           packed=False, lora_targets=("q_proj", "v_proj", "o_proj"),
           heads=(transformers.Qwen3MoeForSequenceClassification, transformers.Qwen3MoeForTokenClassification)),
    # per-head q/k norms as a variant (use_qk_norm); PEFT takes gate_proj, up_proj and down_proj (even
    # "shared_experts.down_proj") for the experts' fused parameters in this model type, so LoRA targets attention
    Family("glm4_moe", transformers.Glm4MoeConfig, transformers.Glm4MoeForCausalLM, GLM4_MOE,
           packed=False, lora_targets=("q_proj", "v_proj", "o_proj"),
           variants=(("qk-norms", dict(use_qk_norm=True)),), layer_kinds=_WIDE_QUERY,
           skip={"aux_loss": "Glm4MoeForCausalLM computes no load-balancing loss"}),
    # LoRA on the latent attention's projections (PEFT takes the MLP names for the experts' fused parameters)
    Family("deepseek_v3", transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM, DEEPSEEK_V3,
           packed=False, lora_targets=("q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"),
           heads=(transformers.DeepseekV3ForSequenceClassification, transformers.DeepseekV3ForTokenClassification),
           variants=(("q_proj", dict(q_lora_rank=None)), ("half-split-rope", dict(rope_interleave=False)),
                     ("dense-layer", dict(first_k_dense_replace=1))),
           layer_kinds=(("", {}), ("dense", {"first_k_dense_replace": 2}), ("q_proj", {"q_lora_rank": None})),
           dropout=dict(attention_dropout=0.1),
           skip={"aux_loss": "DeepseekV3ForCausalLM computes no load-balancing loss"}),
    # the clamped SwiGLU's limit inside the tiny model's range (its default 7 is never reached there)
    Family("gpt_oss", transformers.GptOssConfig, transformers.GptOssForCausalLM, GPT_OSS,
           packed=False, lora_targets=("q_proj", "v_proj", "o_proj"),
           heads=(transformers.GptOssForSequenceClassification, transformers.GptOssForTokenClassification),
           variants=(("clamped", dict(swiglu_limit=0.05)),), dropout=dict(attention_dropout=0.1),
           layer_kinds=_WIDE_QUERY,
           skip={"packed": "transformers' own gpt-oss does not keep documents packed by position_ids apart (its "
                           "masks ignore them), so neither does the converted model"}),
]
