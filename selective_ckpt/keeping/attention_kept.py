"""The "attention-kept" policy's checkpoint: the layer runs again in backward, except attention's forward.

At long context the cheap thing to rebuild flips: a layer's matmuls cost the same per token whatever the context,
causal attention's forward grows with it (2·S·h FLOPs per token; at 128K tokens most of a whole-layer rebuild).
This checkpoint keeps the layer input and what attention produced (its output o and row logsumexp) and rebuilds
the rest in backward from the input: the first norm, the q/k/v projections with RoPE, x1, the second norm and the
MLP's matmuls. Attention's backward then reads the rebuilt q, k, v and the kept o and logsumexp.

Mechanism: torch.utils.checkpoint (non-reentrant) with PyTorch's selective-checkpoint caching, whose policy saves
the outputs of the attention ops (ours and PyTorch's fused SDPA kernels) and recomputes every other op; the
re-run finds attention's outputs in the cache instead of running it. The RNG state is restored before the re-run
(preserve_rng_state), so a dropout seed drawn inside the layer is drawn again the same. The cached outputs pass no
saved-tensor hook; a layer pipeline's observer (memory.ledger) is shown them here.
"""

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from . import pipeline

_SDPA_FORWARDS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                  "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")


@functools.lru_cache(maxsize=1)
def attention_ops():
    """The ops whose outputs the policy keeps: selective_ckpt's attention forward and PyTorch's fused SDPA ones."""
    from ..ops.attention import attention_fwd_op  # noqa: F401  (registers the op)

    aten = torch.ops.aten
    ops = [torch.ops.selective_ckpt.attention_fwd.default]
    ops += [getattr(aten, n).default for n in _SDPA_FORWARDS if hasattr(aten, n)]
    return frozenset(ops)


def _policy(ctx, op, *args, **kwargs):
    if op in attention_ops():
        out = getattr(ctx, "op_output", None)
        if out is not None:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    pipeline.note_kept(t, "attention")
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def context_fn():
    """checkpoint's context_fn: cache attention's outputs, recompute everything else."""
    return create_selective_checkpoint_contexts(_policy)


def attention_kept_checkpoint(fn, *args, **kwargs):
    """torch.utils.checkpoint of `fn(*args, **kwargs)` under the attention-kept policy (the signature of
    transformers' `_gradient_checkpointing_func`)."""
    kwargs.pop("use_reentrant", None)  # selective caching needs the non-reentrant checkpoint
    return checkpoint(fn, *args, use_reentrant=False, context_fn=context_fn, **kwargs)
