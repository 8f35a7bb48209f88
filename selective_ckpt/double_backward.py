"""Refusing double backward clearly: the ops' backward passes are kernels, not differentiable graphs.

Under `create_graph=True` (gradient penalties, Hessian-vector products) autograd would build the
graph of a gradient from the torch ops inside a backward and silently miss the kernels' share, so
second derivatives would come out incomplete. `first_order_only(name)` wraps a backward so its
gradients carry a node that raises a RuntimeError naming the op if anything differentiates them.
"""

import functools

import torch


class _Refuse(torch.autograd.Function):
    """Identity on the gradients, linked to what they depend on; its backward is the refusal."""

    @staticmethod
    def forward(ctx, message, n, *tensors):
        ctx.message = message
        return tuple(t.detach() for t in tensors[:n])

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(ctx.message)


class _SavedOnce:
    """ctx with its saved tensors unpacked once (checkpointing allows a single unpack per backward)."""

    def __init__(self, ctx):
        self._ctx = ctx
        self.saved_tensors = ctx.saved_tensors

    def __getattr__(self, name):
        return getattr(self._ctx, name)


def _message(name):
    return (f"{name} does not support double backward (create_graph=True / higher-order gradients): its "
            f"backward runs fused kernels whose own gradients are not implemented. Compute gradient "
            f"penalties or Hessian products through eager PyTorch ops instead.")


def first_order_only(name):
    """Decorator for an autograd backward(ctx, *grads): first-order gradients as usual; differentiating
    them again (they depend on the saved inputs and the incoming gradients) raises a RuntimeError
    naming `name`."""

    def wrap(backward):
        @functools.wraps(backward)
        def run(ctx, *grads):
            if not torch.is_grad_enabled():  # plain backward: nothing to guard
                return backward(ctx, *grads)
            ctx = _SavedOnce(ctx)
            with torch.no_grad():
                out = backward(ctx, *grads)
            anchors = [t for t in (*ctx.saved_tensors, *grads) if isinstance(t, torch.Tensor) and t.requires_grad]
            single = not isinstance(out, tuple)
            outs = list((out,) if single else out)
            where = [i for i, g in enumerate(outs) if isinstance(g, torch.Tensor)]
            if not anchors or not where:
                return out
            guarded = _Refuse.apply(_message(name), len(where), *[outs[i] for i in where], *anchors)
            for i, g in zip(where, guarded):
                outs[i] = g
            return outs[0] if single else tuple(outs)

        return run

    return wrap
