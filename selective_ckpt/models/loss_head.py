"""The loss head of a converted causal LM: its training loss through the fused linear cross-entropy.

`install(root)` patches the instance forward of a causal LM (GPT2LMHeadModel, LlamaForCausalLM,
MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, ...); modules, parameters and state-dict
keys stay. In training mode with labels the patched forward runs transformers' own forward with
two hooks that last for that call: the lm_head module, when the forward calls it, records the final
hidden states and returns a placeholder instead of logits (no N x V matmul), and the model's
`loss_function` (transformers' ForCausalLMLoss) is answered from those hidden states by
`linear_cross_entropy` with its exact semantics: the label shift (or `shift_labels`),
`ignore_index`, `num_items_in_batch`. The returned output then carries `logits=None` (a tuple
output leaves the logits out, as transformers leaves out every None field), said once per process by a
warning naming the switch. Eval mode and `labels=None` run the original forward and return the logits;
`return_logits(model)` makes calls with labels run it too (transformers' own head and loss, the logits
made and kept as in the unconverted model).

The head's weight is read directly when the head is a plain nn.Linear (tied to the embeddings or
not) or PEFT's modules_to_save wrapper around one. Any other head module (a PEFT LoRA adapter on
lm_head, a quantized Linear) is called as a module on chunks of rows, each chunk under activation
checkpointing and its logits fed to the same cross-entropy kernels: every adapter weight gets its
gradient, and no more than one chunk of logits exists at a time (four matmuls instead of three).
A model whose loss_function is not ForCausalLMLoss (a custom loss) keeps its original forward.
"""

import inspect
import warnings
from collections import OrderedDict

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .. import compat
from ..ops.cross_entropy import check_labels, chunk_rows, linear_cross_entropy, logits_cross_entropy
from ..storages import is_fake
from .patching import PATCHED, patch_forward

HEAD_CLASS_SUFFIXES = ("ForCausalLM", "LMHeadModel")


def is_causal_lm(root):
    """A transformers causal LM whose forward takes labels and slices hidden states by logits_to_keep."""
    if not type(root).__name__.endswith(HEAD_CLASS_SUFFIXES) or not isinstance(getattr(root, "lm_head", None),
                                                                               nn.Module):
        return False
    params = inspect.signature(type(root).forward).parameters
    return "labels" in params and "logits_to_keep" in params


def install(root):
    """Patches root's forward when it is a causal LM (is_causal_lm); otherwise leaves it as it is."""
    if is_causal_lm(root):
        patch_forward(root, causal_lm_forward)  # shows the model's own signature (pickling.BoundForward)


_LOGITS = "_selective_ckpt_return_logits"  # instance attribute of a converted causal LM: return_logits' switch


def _converted_heads(model):
    return [m for m in model.modules()
            if getattr(vars(m).get("forward"), "function", None) is causal_lm_forward and is_causal_lm(m)]


def return_logits(model, on=True):
    """Whether the converted causal LM(s) in `model` return logits in training with labels.

    On: such calls run transformers' own lm_head and loss, so `outputs.logits` is the [B, S, vocab] tensor
    and the loss and every gradient are the unconverted head's, at its memory: from forward to backward
    the logits (B*S*vocab elements of the model's dtype, held by the output) and the loss's float32
    log-softmax (B*S*vocab*4 bytes), instead of the fused head's gradients formed in forward (B*S*hidden,
    and vocab*hidden when the head trains; docs/kernels/loss_head.md), and the unfused head's transient peak
    (about 3 x B*S*vocab*4 bytes) in backward. Off (convert's default): the fused loss head, `logits=None`.
    An instance attribute, so deepcopy and pickling keep it and the state dict does not see it. Returns the
    number of heads switched; a ValueError when `model` holds no converted causal LM."""
    heads = _converted_heads(model)
    if not heads:
        raise ValueError(f"{type(model).__name__} holds no causal LM converted by selective_ckpt (convert() installs "
                         "the fused loss head on a *ForCausalLM / *LMHeadModel)")
    for m in heads:
        m.__dict__[_LOGITS] = bool(on)
    return len(heads)


_SAID = set()


def _say_logits_dropped(model):
    if "logits" not in _SAID:
        _SAID.add("logits")
        warnings.warn(f"{type(model).__name__}: in training with labels the fused loss head returns logits=None "
                      "(it computes the loss without making them); to get logits, call "
                      "selective_ckpt.models.loss_head.return_logits(model) (transformers' own head and loss, at "
                      "their memory: the B x S x vocab logits and their float32 log-softmax kept until backward). "
                      "Warned once.", UserWarning, stacklevel=2)


_FOR_CAUSAL_LM_LOSS = []  # transformers' ForCausalLMLoss, imported on first use (transformers is optional)


def _for_causal_lm_loss():
    if not _FOR_CAUSAL_LM_LOSS:
        from transformers.loss.loss_utils import ForCausalLMLoss
        _FOR_CAUSAL_LM_LOSS.append(ForCausalLMLoss)
    return _FOR_CAUSAL_LM_LOSS[0]


def _labels_given(original, args, kwargs):
    if "labels" in kwargs:
        return kwargs["labels"] is not None
    try:
        bound = inspect.signature(original).bind_partial(*args, **kwargs)
    except TypeError:
        return False  # the original forward reports the bad call itself
    return bound.arguments.get("labels") is not None


def causal_lm_forward(self, *args, **kwargs):
    """The causal LM's forward; in training with labels its loss comes from the fused loss head."""
    original = getattr(self, PATCHED)
    if not self.training or vars(self).get(_LOGITS) or not _labels_given(original, args, kwargs) or \
            self.loss_function is not _for_causal_lm_loss():
        return original(*args, **kwargs)
    capture = _HeadCapture(self)
    with capture:
        out = original(*args, **kwargs)
    if not torch.compiler.is_compiling():
        _say_logits_dropped(self)
    return capture.without_logits(out)


def _plain_linear(head):
    """The nn.Linear whose weight the fused op can read for this head module, or None."""
    if compat.is_modules_to_save(head):  # PEFT's modules_to_save: the active copy
        active = getattr(head, "active_adapters", None) or []
        if getattr(head, "disable_adapters", False) or not active:
            head = head.original_module
        elif active[0] in head.modules_to_save:
            head = head.modules_to_save[active[0]]
        else:
            return None
    if type(head) is nn.Linear and "forward" not in vars(head):
        return head
    return None


class _HeadCapture:
    """While active: lm_head records its input and returns a placeholder; loss_function computes the
    loss from that input. Both hooks are instance attributes removed on exit."""

    def __init__(self, model):
        self.model = model
        self.head = model.lm_head
        self.linear = _plain_linear(self.head)  # read before the capture replaces the head's forward
        self.hidden = self.placeholder = None
        self.loss_computed = False

    def __enter__(self):
        head, model = self.head, self.model
        self._saved = {"forward": vars(head).get("forward"), "loss": compat.own_loss_function(model)}
        self.head_forward = head.forward  # the module's own forward (bound), for heads called chunk by chunk
        # the instance dict directly: Module.__setattr__ only adds checks for parameters, buffers and submodules
        vars(head)["forward"] = self._intercept
        compat.set_own_loss_function(model, self._loss)
        return self

    def __exit__(self, *exc):
        saved = self._saved["forward"]
        if saved is None:
            vars(self.head).pop("forward", None)
        else:
            vars(self.head)["forward"] = saved
        compat.set_own_loss_function(self.model, self._saved["loss"])
        # the placeholder refers back to this capture: without this the final hidden states stayed alive in that
        # reference cycle after the step, until the garbage collector ran
        self.hidden = self.placeholder = None
        return False

    def _intercept(self, hidden_states, *args, **kwargs):
        if args or kwargs or self.hidden is not None:
            raise RuntimeError(f"{type(self.model).__name__}: lm_head was called in an unexpected way during a "
                               "training forward with labels; the fused loss head cannot stand in for it")
        self.hidden = hidden_states
        vocab = self.model.config.vocab_size
        self.placeholder = LogitSteps.wrap(_expanded_empty(hidden_states, (*hidden_states.shape[:-1], vocab)), self, ())
        return self.placeholder

    def _loss(self, logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None,
              **kwargs):
        if not isinstance(logits, LogitSteps) or logits.capture is not self:
            raise RuntimeError(f"{type(self.model).__name__}: its forward changes the logits between lm_head and the "
                               "loss, which the fused loss head does not reproduce")
        self.loss_computed = True
        factor, softcap = logits.scale_and_softcap()
        hidden = self.hidden * factor if factor != 1.0 else self.hidden
        if shift_labels is None:  # padded after the shift: contiguous, so the flattening below is a view
            shift_labels = nn.functional.pad(labels[..., 1:], (0, 1), value=ignore_index)
        flat = hidden.reshape(-1, hidden.shape[-1])
        shift_labels = shift_labels.reshape(-1).to(flat.device)
        if flat.shape[0] != shift_labels.shape[0]:
            raise ValueError(f"Expected input batch_size ({flat.shape[0]}) to match target batch_size "
                             f"({shift_labels.shape[0]}): the hidden states kept by logits_to_keep do not line up "
                             "with the labels")
        linear = self.linear
        if linear is not None:
            if linear.out_features != vocab_size:
                raise ValueError(f"lm_head has {linear.out_features} outputs, config.vocab_size is {vocab_size}")
            return linear_cross_entropy(flat, linear.weight, shift_labels, linear.bias, ignore_index=ignore_index,
                                        softcap=softcap, num_items_in_batch=num_items_in_batch)
        return module_cross_entropy(self.head_forward, flat, shift_labels, vocab_size, ignore_index,
                                    num_items_in_batch, softcap=softcap)

    def without_logits(self, out):
        if not self.loss_computed:
            raise RuntimeError(f"{type(self.model).__name__}: its forward did not compute the loss through "
                               "loss_function, so the fused loss head cannot replace its logits")
        if isinstance(out, tuple):
            return tuple(x for x in out if not isinstance(x, LogitSteps))
        # in place (a new output costs more than the rest of the head's Python): the field reads None and its key
        # goes, as for a field left None when a ModelOutput is made
        for key in [k for k, v in out.items() if isinstance(v, LogitSteps)]:
            OrderedDict.__delitem__(out, key)
            setattr(out, key, None)
        return out


def _expanded_empty(t, shape):
    """One element of t's dtype at every index of `shape` (zero strides, no memory), for the placeholder: on t's
    device, or on the meta device for a fake t (a tensor subclass cannot wrap a FakeTensor; selective_ckpt.fit
    simulates steps on fake tensors)."""
    if not is_fake(t):
        return t.new_empty_strided(shape, (0,) * len(shape))  # one op where new_empty(()).expand(shape) is two
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return torch.empty((), dtype=t.dtype, device="meta").expand(*shape)


class LogitSteps(torch.Tensor):
    """What lm_head returns during a captured forward: no logits, only the record of the elementwise steps
    the model's forward applies to them before its loss (Granite's `/ logits_scaling`, Cohere's
    `* logit_scale`, Gemma's final soft-capping `/ cap -> tanh -> * cap`). Scales fold into the hidden
    states the fused head reads; one tanh between scales becomes the head's `softcap`
    (scale_and_softcap); any other operation on the logits is an error naming it, before an N x vocab
    tensor would be made."""

    _SCALES = {torch.Tensor.__mul__: 1, torch.Tensor.__rmul__: 1, torch.Tensor.mul: 1, torch.mul: 1,
               torch.Tensor.__truediv__: -1, torch.Tensor.div: -1, torch.div: -1}

    @staticmethod
    def wrap(empty, capture, steps):
        out = torch.Tensor._make_subclass(LogitSteps, empty)
        out.capture, out.steps = capture, steps
        return out

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in cls._SCALES and len(args) == 2 and not kwargs and isinstance(args[0], LogitSteps) and \
                isinstance(args[1], (int, float)) and not isinstance(args[1], bool):
            factor = float(args[1]) ** cls._SCALES[func]
            return LogitSteps.wrap(args[0].as_subclass(torch.Tensor), args[0].capture,
                                   args[0].steps + (("scale", factor),))
        if func in cls._TANH and len(args) == 1 and not kwargs and isinstance(args[0], LogitSteps):
            return LogitSteps.wrap(args[0].as_subclass(torch.Tensor), args[0].capture, args[0].steps + (("tanh", 1.0),))
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        # attribute reads (.shape, .data: `__get__`) pass; an operation that makes logits is refused
        if isinstance(result, torch.Tensor) and result.dim() > 0 and getattr(func, "__name__", "") != "__get__":
            raise RuntimeError(f"the model's forward applies {getattr(func, '__name__', func)} to the logits before "
                               "its loss; the fused loss head reproduces only scaling by a number (put the model in "
                               "eval mode or call it without labels to get plain logits)")
        return result

    _TANH = (torch.tanh, torch.Tensor.tanh)

    def scale_and_softcap(self):
        """(factor, softcap): the steps as softcap * tanh(factor * z / softcap) of the plain logits z (softcap
        None: factor * z). Scales a before one tanh and c after it give c * tanh(a z), so softcap = c and
        factor = a * c; a non-positive c, or more than one tanh, is an error naming the steps."""
        if not self.steps:
            return 1.0, None
        kinds = [k for k, _ in self.steps]
        if kinds.count("tanh") > 1:
            raise RuntimeError(f"the model's forward applies tanh to the logits {kinds.count('tanh')} times; the "
                               "fused loss head reproduces one soft-capping c * tanh(a * logits) only")
        before, after = 1.0, 1.0
        seen_tanh = False
        for kind, f in self.steps:
            if kind == "tanh":
                seen_tanh = True
            elif seen_tanh:
                after *= f
            else:
                before *= f
        if not seen_tanh:
            return before, None
        if not after > 0:
            raise RuntimeError(f"the model's forward soft-caps the logits as {after} * tanh(...); the fused loss head "
                               "reproduces a positive cap only")
        return before * after, after


def module_cross_entropy(forward, hidden, labels, vocab, ignore_index=-100, num_items_in_batch=None, softcap=None):
    """ForCausalLMLoss of `forward(hidden)` (a head module's forward, [N, h] -> [N, vocab]) computed on
    chunks of rows, each under activation checkpointing: a chunk's logits exist only while it is
    computed and again while its backward runs. Mean over non-ignored labels, or sum / num_items_in_batch.
    `softcap` caps each chunk's logits as softcap * tanh(z / softcap) first (in the cross-entropy kernels)."""
    labels = check_labels(labels, vocab, ignore_index)
    n_tokens, h = hidden.shape
    rows = chunk_rows(n_tokens, vocab, h, max(4, hidden.element_size()))  # logits may come out in float32

    def piece(x, y):
        z = forward(x)
        if z.shape != (x.shape[0], vocab):
            raise ValueError(f"lm_head gave logits of shape {list(z.shape)}, expected [{x.shape[0]}, {vocab}]")
        return logits_cross_entropy(z, y, ignore_index, softcap=softcap).sum()

    total = None
    for start in range(0, n_tokens, rows):
        part = checkpoint(piece, hidden[start:start + rows], labels[start:start + rows], use_reentrant=False)
        total = part if total is None else total + part
    if total is None:
        total = hidden.new_zeros((), dtype=torch.float32)
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(total.device)
        return total / num_items_in_batch
    return total / (labels != ignore_index).sum()


__all__ = ["LogitSteps", "causal_lm_forward", "install", "is_causal_lm", "module_cross_entropy", "return_logits"]
