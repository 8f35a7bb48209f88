"""The time model: a training step's seconds from its parts' FLOPs and bytes and a device's Rates.

Per decoder layer, forward = its matmuls (base weights active per token, and LoRA's) at the matmul rate of the
compute dtype + attention's forward (4 FLOPs per query, key and head dimension it attends: half the context when
causal, the window when sliding) at the attention rate + its elementwise work (norms, activation, residual adds,
RoPE: (14 h + 3 f) elements per token read or written; LoRA's adds; autocast's weight casts) at the bandwidth + a
QLoRA base's dequantization (2.5 bytes per weight), all of it divided by the share of these rates a whole step
attains (Rates.efficiency), + a fixed overhead per layer and pass. Backward: the input gradients' matmuls (and the
weights' when the base is trained), LoRA's both, attention's backward (2.5x its forward's FLOPs), twice the
elementwise bytes, and the dequantization again. What a policy rebuilds adds: "full" one more forward,
"attention-kept" that forward without attention's, "selective" the norm and activation outputs (elementwise), tiles
one more MLP forward (each tile is run again when backward reaches it). The loss head: three logits-sized matmuls
(two when the head is frozen) and its elementwise passes over the logits; the optimizer: AdamW reads and writes 28
bytes per trained weight.

Offload (`offload_times`): the copies run on their own streams, a layer's copy to the host issued when the next
layer's forward begins and each reload `prefetch` layers ahead of its backward, each at the link's rate slowed
by the share of compute it hides under (Rates.overlap); compute waits where a copy is late: in forward, for the
copy issued two layers earlier (what the memory model allows in flight), in backward for the layer's own reload.
Copies synchronous with compute (transformers' offloaded checkpointing: save_on_cpu on the compute stream) add
their whole time.
"""

import dataclasses

import torch

MLP_CHILDREN = ("mlp", "feed_forward", "block_sparse_moe", "moe")
ADAMW_BYTES = 28  # AdamW per trained fp32 weight: reads weight, gradient and two states, writes three
DEQUANT_BYTES = 2.5  # NF4 to bf16: half a byte read, two written per weight
TILE_OVERHEAD = 20e-6  # seconds of launches per tile (MLP or layer) and pass


@dataclasses.dataclass(frozen=True)
class StepCost:
    """What one training step's work is made of, per token and layer, for a model in a training form.

    hidden, ffn: the layer's widths (ffn: the MLP's intermediate a token runs through, top_k experts' for a MoE);
    heads, head_dim; spans: for each decoder layer, None (full causal attention) or its sliding window;
    layer_weights: base weights a token meets in one decoder layer (MACs per token), of them mlp_weights in the
    MLP and qkv_weights in the q, k, v projections; lora_weights: LoRA's, lora_io: the elements per token PEFT's
    adapters read and write around their matmuls;
    cast_bytes: bytes autocast's weight casts move per layer and pass; head_weights: the output head's;
    trained_base: whether the base weights are
    trained (full fine-tune); quantized_weights: 4-bit base weights per layer (dequantized at each pass);
    trained_weights: every trained weight (AdamW's work); dtype: the compute dtype; elem: bytes per activation
    element."""

    hidden: int
    ffn: int
    heads: int
    head_dim: int
    spans: tuple
    layer_weights: int
    mlp_weights: int
    qkv_weights: int
    lora_weights: int
    lora_io: int
    cast_bytes: int
    head_weights: int
    trained_base: bool
    quantized_weights: int
    trained_weights: int
    dtype: torch.dtype
    elem: int

    @property
    def num_layers(self):
        return len(self.spans)

    def keys_per_query(self, seq_len):
        """Keys a query attends on average over the layers (causal)."""
        total = 0.0
        for w in self.spans:
            if w is None or w >= seq_len:
                total += (seq_len + 1) / 2
            else:  # the first w queries see fewer than w keys
                total += w - w * (w - 1) / (2 * seq_len)
        return total / len(self.spans)


@dataclasses.dataclass
class LayerTimes:
    """Seconds of one decoder layer: forward, backward (without rebuild), attention's own forward (what
    "attention-kept" does not run again), the MLP's forward matmuls, the selective rebuild's elementwise work, the
    q, k, v projections' forward (what layer tiles run again to rebuild k and v)."""

    forward: float
    backward: float
    attention_forward: float
    mlp_forward: float
    selective_rebuild: float
    qkv_forward: float = 0.0


def layer_times(cost, rates, tokens, seq_len):
    """LayerTimes of one average decoder layer at `tokens` = batch x seq_len."""
    mm = rates.matmul(cost.dtype)
    keys = cost.keys_per_query(seq_len)
    attn_fwd = 4 * tokens * keys * cost.heads * cost.head_dim / rates.attention_forward
    attn_bwd = 2.5 * 4 * tokens * keys * cost.heads * cost.head_dim / rates.attention_backward
    elementwise = tokens * (14 * cost.hidden + 3 * cost.ffn) * cost.elem / rates.bandwidth
    dequant = cost.quantized_weights * DEQUANT_BYTES / rates.bandwidth
    elementwise += (tokens * cost.lora_io * cost.elem + cost.cast_bytes) / rates.bandwidth
    base = 2 * tokens * cost.layer_weights / mm
    lora = 2 * tokens * cost.lora_weights / mm
    e = rates.efficiency
    forward = (base + lora + attn_fwd + elementwise + dequant) / e + rates.layer_overhead
    backward = (base * (2 if cost.trained_base else 1) + 2 * lora + attn_bwd + 2 * elementwise + dequant) / e + \
        rates.layer_overhead
    selective = tokens * 3 * (2 * cost.hidden + cost.ffn) * cost.elem / rates.bandwidth / e
    qkv = (base + lora + dequant) * cost.qkv_weights / max(cost.layer_weights, 1) / e
    return LayerTimes(forward, backward, attn_fwd / e, 2 * tokens * cost.mlp_weights / mm / e, selective, qkv)


def forward_time(times, policy):
    """Seconds of a layer's forward under `policy`: layer tiles first run every tile up to attention for K and V."""
    if policy.layer_tiles > 1:
        return times.forward + times.qkv_forward + 2 * policy.layer_tiles * TILE_OVERHEAD
    return times.forward


def rebuild_time(times, policy):
    """Seconds a layer's backward spends rebuilding what `policy` (a keeping.LayerPolicy) does not keep."""
    mode = policy.recompute
    out = {"none": 0.0, "selective": times.selective_rebuild, "full": times.forward,
           "attention-kept": times.forward - times.attention_forward}[mode]
    if policy.mlp_tiles > 1:
        out += times.mlp_forward + 2 * policy.mlp_tiles * TILE_OVERHEAD
    if policy.layer_tiles > 1:
        # K, V again (without gradients), each tile's whole forward, then the q, k, v projections once more with
        # gradients for dK, dV's way back (their backward: about one more such forward)
        out += 3 * times.qkv_forward + 3 * policy.layer_tiles * TILE_OVERHEAD
    return out


def head_time(cost, rates, tokens, vocab):
    """Seconds of the loss head's forward and backward (logits in chunks, their gradient, the hidden's)."""
    mm = rates.matmul(cost.dtype)
    matmuls = (3 if cost.trained_base else 2) * 2 * tokens * cost.head_weights / mm
    return (matmuls + 4 * tokens * vocab * 4 / rates.bandwidth) / rates.efficiency


def optimizer_time(cost, rates):
    return cost.trained_weights * ADAMW_BYTES / rates.bandwidth / rates.efficiency


def offload_times(forward, backward, to_host, rates, prefetch=1):
    """(forward seconds, backward seconds) of L layers whose layer j computes forward[j] and backward[j] seconds
    (its rebuild included) and copies to_host[j] bytes to the host and back (the last layer's copy is never
    issued), with the copies on their own streams (see the module doc)."""
    L = len(forward)
    d2h = [b / (rates.device_to_host * rates.overlap) if rates.overlap else float("inf") for b in to_host]
    h2d = [b / (rates.host_to_device * rates.overlap) if rates.overlap else float("inf") for b in to_host]
    t, stream = 0.0, 0.0
    done = [0.0] * L  # when layer j's copy to the host has finished
    for j in range(L):
        if j >= 2 and to_host[j - 2]:
            t = max(t, done[j - 2])  # at most two layers' copies in flight
        if j >= 1 and to_host[j - 1]:  # the previous layer's copy starts as this layer begins
            stream = max(stream, t) + d2h[j - 1]
            done[j - 1] = stream
        t += forward[j]
    forward_end = t
    t = 0.0  # backward, from its start; copies still in flight carry over
    carry = forward_end
    stream = 0.0
    ready = [0.0] * L
    issued = set()

    def issue(i, now):
        nonlocal stream
        if 0 <= i < L - 1 and to_host[i] and i not in issued:
            issued.add(i)
            stream = max(stream, now, done[i] - carry) + h2d[i]
            ready[i] = stream
    for i in range(L - 2, L - 2 - prefetch, -1):
        issue(i, 0.0)
    for j in range(L - 1, -1, -1):
        if j < L - 1 and to_host[j]:
            issue(j, t)
            t = max(t, ready[j])
        issue(j - prefetch, t)
        t += backward[j]
    return forward_end, t
