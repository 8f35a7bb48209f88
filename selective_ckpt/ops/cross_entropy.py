"""Fused linear cross-entropy: the loss head without its N x V logits (docs/DESIGN.md, "Loss head").

`linear_cross_entropy(hidden [N, h], weight [V, h], labels [N])` is `F.cross_entropy(F.linear(hidden,
weight, bias).float(), labels)` with transformers' ForCausalLMLoss semantics, computed over chunks
of rows: each chunk's logits [rows, V] are one matmul into a reused buffer, one kernel pass
(`cross_entropy_rows_`, C++ on CPU, Triton on GPU) turns them into per-row logsumexp and loss and,
in the same pass, into the gradient of the loss with respect to them, and two more matmuls take
that gradient to dhidden and dweight. Nothing of size N x V exists beyond one chunk.

Reductions "mean" and "sum" (and `num_items_in_batch`) form the gradients during forward: three
matmuls in all, like the unfused head, and what is kept until backward is the gradients backward
returns anyway (dhidden [N, h]; dweight [V, h] and dbias [V] only for what requires grad), scaled
there by the incoming gradient. reduction="none" cannot do that (its gradient per row is not known
in forward): it keeps hidden, weight, bias and labels and recomputes each chunk's logits in backward
(four matmuls).

The chunk holds `chunk_rows(N, V, h, itemsize, chunk_bytes)` rows: `chunk_bytes` (default: the
weight's bytes, clamped to [4 MiB, 256 MiB]) divided by one row of logits, V * itemsize.
"""

import torch

from .. import backend
from ..double_backward import first_order_only
from ..storages import is_fake
from ..validation import check_choice, check_floating, check_linear, check_positive_int
from .eager import eager_ok, fast_eager
from .layer_norm import stat_dtype

__all__ = ["check_labels", "chunk_rows", "cross_entropy_rows_op", "linear_cross_entropy", "logits_cross_entropy",
           "check_cross_entropy_args"]

REDUCTIONS = {"mean": 0, "sum": 1, "none": 2}
MIN_CHUNK_BYTES = 4 << 20
MAX_CHUNK_BYTES = 256 << 20


def chunk_rows(n_tokens, vocab, hidden_dim, itemsize, chunk_bytes=None):
    """Rows per chunk: the byte budget over one row of logits (vocab * itemsize), at least 1, at most
    n_tokens. The default budget is the weight's bytes (vocab * hidden_dim * itemsize) clamped to
    [4 MiB, 256 MiB]: the transient is at most what the weight gradient keeps, and a chunk is
    hidden_dim rows long (up to the cap), enough for the CPU matmuls to run near full speed (on CPU a
    chunk of 128 rows made the head about 1.5x slower than one of 512 at h = 256, V = 32000)."""
    if chunk_bytes is None:
        chunk_bytes = min(MAX_CHUNK_BYTES, max(MIN_CHUNK_BYTES, vocab * hidden_dim * itemsize))
    return max(1, min(n_tokens, chunk_bytes // max(1, vocab * itemsize)))


@torch.library.custom_op("selective_ckpt::cross_entropy_rows_", mutates_args=("logits",))
def cross_entropy_rows_op(logits: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor, ignore_index: int,
                          label_smoothing: float, softcap: float, write_grad: bool
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(lse, loss) per row of logits [rows, V] (float32; float64 for float64 logits), with labels int64
    [rows] in [0, V) or ignore_index. softcap 0 means none. With write_grad, logits are overwritten by
    scale * d(loss)/d(logits), scale being [1] or [rows] in lse's dtype; otherwise they are only read."""
    rows, _ = _check_rows_operands(logits, labels, scale)
    stat = stat_dtype(logits.dtype)
    lse = logits.new_empty(rows, dtype=stat)
    loss = logits.new_empty(rows, dtype=stat)
    _rows_kernel(logits, labels.contiguous(), scale.contiguous(), lse, loss,
                 (ignore_index, label_smoothing, softcap), write_grad)
    return lse, loss


@cross_entropy_rows_op.register_fake
def _(logits, labels, scale, ignore_index, label_smoothing, softcap, write_grad):
    stat = stat_dtype(logits.dtype)
    return logits.new_empty(logits.shape[0], dtype=stat), logits.new_empty(logits.shape[0], dtype=stat)


fast_eager(cross_entropy_rows_op)


def _rows_kernel(logits, labels, scale, lse, loss, cfg, write_grad):
    """The kernel of cross_entropy_rows_op on checked operands: labels, scale, lse and loss contiguous, lse and
    loss [rows] of the statistics dtype; cfg is (ignore_index, label_smoothing, softcap)."""
    rows, vocab = logits.shape
    if rows and vocab:
        ignore_index, label_smoothing, softcap = cfg
        backend.call("cross_entropy", "rows", logits, logits.stride(0), labels, scale, 0 if scale.numel() == 1 else 1,
                     lse, loss, rows, vocab, int(ignore_index), float(label_smoothing), float(softcap),
                     bool(write_grad))


def _check_rows_operands(logits, labels, scale):
    """The kernel reads logits by rows of V contiguous elements, one int64 label and one scale (or one
    for all) per row: anything else would read past them."""
    check_floating(logits, "logits")
    if logits.dim() != 2 or (logits.shape[1] > 1 and logits.stride(1) != 1):
        raise ValueError(f"logits must be [rows, V] with contiguous rows, got shape {list(logits.shape)} "
                         f"strides {list(logits.stride())}")
    rows = logits.shape[0]
    if labels.dtype != torch.int64 or labels.shape != (rows,) or labels.device != logits.device:
        raise ValueError(f"labels must be int64 [{rows}] on {logits.device}, got {labels.dtype} "
                         f"{list(labels.shape)} on {labels.device}")
    stat = stat_dtype(logits.dtype)
    if scale.dtype != stat or scale.numel() not in (1, rows) or scale.dim() != 1 or scale.device != logits.device:
        raise ValueError(f"scale must be {stat} [1] or [{rows}] on {logits.device}, got {scale.dtype} "
                         f"{list(scale.shape)} on {scale.device}")
    return rows, logits.shape[1]


def _head_pass(hidden, weight, bias, labels, scale, cfg, rows_per_chunk, write_grad, needs):
    """One pass over the chunks: per-row loss and, with write_grad, (dhidden, dweight, dbias) for those
    `needs` asks for (each scaled by `scale`, one value or one per row)."""
    need_dx, need_dw, need_db = needs if write_grad else (False, False, False)
    n_tokens, h = hidden.shape
    vocab = weight.shape[0]
    stat = stat_dtype(hidden.dtype)
    labels, scale = labels.contiguous(), scale.contiguous()
    # Plain eager tensors: the kernel writes each chunk's statistics in place, without the op's dispatch, checks
    # and copies (a chunk's logits are this pass's own buffer). Traced or fake: the custom op.
    direct = eager_ok((hidden, weight, labels, scale))
    lse = hidden.new_empty(n_tokens, dtype=stat) if direct else None  # the kernel's, unused here
    loss = hidden.new_empty(n_tokens, dtype=stat)
    db = torch.zeros(vocab, dtype=stat, device=hidden.device) if need_db else None
    if rows_per_chunk >= n_tokens:  # one chunk: no slices, and the gradients are the matmuls' own outputs
        z = _chunk_loss(hidden, weight, bias, labels, scale, lse, loss, cfg, write_grad, direct)
        dx = torch.mm(z, weight) if need_dx else None
        dw = torch.mm(z.t(), hidden) if need_dw else None
        if need_db:
            db.add_(z.sum(0, dtype=stat))
        del z
    else:
        dx = torch.empty_like(hidden) if need_dx else None
        # 16-bit weight gradients accumulate over chunks in float32 and are rounded once at the end.
        dw = torch.zeros(vocab, h, dtype=stat, device=hidden.device) if need_dw else None
        buf = hidden.new_empty(rows_per_chunk, vocab)
        per_row = scale.numel() != 1
        for start in range(0, n_tokens, rows_per_chunk):
            end = min(n_tokens, start + rows_per_chunk)
            xc = hidden[start:end]
            z = _chunk_loss(xc, weight, bias, labels[start:end], scale[start:end] if per_row else scale,
                            None if lse is None else lse[start:end], loss[start:end], cfg, write_grad, direct,
                            out=buf[:end - start])
            if need_dx:
                torch.mm(z, weight, out=dx[start:end])
            if need_dw:
                if dw.dtype == z.dtype:
                    dw.addmm_(z.t(), xc)
                else:
                    dw.add_(torch.mm(z.t(), xc))
            if need_db:
                db.add_(z.sum(0, dtype=stat))
        del buf, z
    if dw is not None and dw.dtype != weight.dtype:
        dw = dw.to(weight.dtype)
    if db is not None and db.dtype != bias.dtype:
        db = db.to(bias.dtype)
    return loss, dx, dw, db


def _chunk_loss(x, weight, bias, labels, scale, lse, loss, cfg, write_grad, direct, out=None):
    """The logits of rows x (into `out` if given) and their per-row loss written into `loss` (and the
    logsumexp into `lse`, direct only); returns the logits, overwritten by their scaled gradient with write_grad."""
    if bias is None:
        z = torch.mm(x, weight.t(), out=out)
    else:
        z = torch.addmm(bias, x, weight.t(), out=out)
    if direct:
        _rows_kernel(z, labels, scale, lse, loss, cfg, write_grad)
    else:
        loss.copy_(cross_entropy_rows_op(z, labels, scale, *cfg, write_grad)[1])
    return z


def _unit_scale(like):
    """1 as a [1] tensor of like's statistics dtype: the gradient scale of a sum."""
    return torch.ones(1, dtype=stat_dtype(like.dtype), device=like.device)


def _stat_scalar(value, like):
    """value (a Python number or a one-element tensor) as a [1] tensor of like's statistics dtype."""
    t = value if isinstance(value, torch.Tensor) else torch.tensor(value, dtype=torch.float64)
    return t.reshape(1).to(device=like.device, dtype=stat_dtype(like.dtype))


def _reciprocal(denom, like):
    """1 / denom as a [1] tensor of like's statistics dtype: the reciprocal of denom rounded to that dtype, with the
    bits of _stat_scalar(denom, like).reciprocal(). An int below 2**24 is exact in float32, and its reciprocal in
    double rounded to float32 is the correctly rounded float32 one (double's 53 bits are more than 2 * 24 + 2): one
    op instead of four."""
    if type(denom) is int and 0 < denom < 1 << 24:
        return torch.full((1,), 1.0 / denom, dtype=stat_dtype(like.dtype), device=like.device)
    return _stat_scalar(denom, like).reciprocal()


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, denom, reduction, cfg, rows_per_chunk, needs):
        ctx.reduction, ctx.cfg, ctx.rows_per_chunk = reduction, cfg, rows_per_chunk
        if reduction == "none":
            loss, *_ = _head_pass(hidden, weight, bias, labels, _unit_scale(hidden), cfg, rows_per_chunk, False, needs)
            ctx.save_for_backward(hidden, weight, bias, labels)
            return loss
        # The gradient of the reduced loss per row is 1 / denom: formed now, scaled by grad_output later.
        scale = _unit_scale(hidden) if denom is None else _reciprocal(denom, hidden)
        loss, dx, dw, db = _head_pass(hidden, weight, bias, labels, scale, cfg, rows_per_chunk, any(needs), needs)
        if torch.compiler.is_compiling():
            # traced: the gradients are saved tensors of the graph (a list on ctx emptied in backward would be a
            # side effect dynamo refuses)
            ctx.kept = None
            ctx.save_for_backward(dx, dw, db)
        else:
            ctx.kept = [dx, dw, db]  # a list, emptied in backward so autograd can take the tensors over
        total = loss.sum()
        return total if denom is None else total / denom

    @staticmethod
    @first_order_only("selective_ckpt.linear_cross_entropy")
    def backward(ctx, grad):
        if ctx.reduction == "none":
            hidden, weight, bias, labels = ctx.saved_tensors
            needs = tuple(ctx.needs_input_grad[:3])
            scale = grad.contiguous().to(stat_dtype(hidden.dtype))
            _, dx, dw, db = _head_pass(hidden, weight, bias, labels, scale, ctx.cfg, ctx.rows_per_chunk, True, needs)
        elif ctx.kept is None:  # traced (forward): no host read of grad, no in-place scaling of saved tensors
            dx, dw, db = (None if g is None else g * grad for g in ctx.saved_tensors)
        else:
            dx, dw, db = ctx.kept
            ctx.kept.clear()
            # skipped on CPU only, where reading grad costs no host sync (a fake grad has no value to read)
            if grad.device.type != "cpu" or is_fake(grad) or grad.item() != 1.0:
                for g in (dx, dw, db):
                    if g is not None:
                        g.mul_(grad)  # a 0-dim float32 factor: applied in float32, rounded once
        return dx, dw, db, None, None, None, None, None, None


def check_cross_entropy_args(hidden, weight, labels, bias, ignore_index, reduction, label_smoothing, softcap,
                             num_items_in_batch, chunk_bytes):
    """Raises TypeError / ValueError naming the argument that does not fit; returns labels as int64."""
    vocab = _check_operands(hidden, weight, labels, bias, ignore_index, reduction, label_smoothing, softcap,
                            num_items_in_batch, chunk_bytes)
    return check_labels(labels, vocab, ignore_index)


def _check_operands(hidden, weight, labels, bias, ignore_index, reduction, label_smoothing, softcap,
                    num_items_in_batch, chunk_bytes):
    """check_cross_entropy_args but for the labels' values; returns the vocabulary size."""
    check_floating(hidden, "hidden")
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [N, h] (tokens, hidden size), got shape {list(hidden.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is None and name == "bias":
            continue
        check_floating(t, name)
        if t.dtype != hidden.dtype:
            raise TypeError(f"{name} has dtype {t.dtype}, expected hidden's dtype {hidden.dtype}")
        if t.device != hidden.device:
            raise ValueError(f"{name} is on {t.device}, expected hidden's device {hidden.device}")
    vocab = check_linear(weight, bias, ("weight", "bias"), ("V", "h"), hidden.shape[1], "hidden's last dim")
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"labels must be a torch.Tensor, got {type(labels).__name__}")
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor, got {labels.dtype}")
    if labels.shape != (hidden.shape[0],):
        raise ValueError(f"labels must have shape [N] = [{hidden.shape[0]}] (hidden's rows), got {list(labels.shape)}")
    if labels.device != hidden.device:
        raise ValueError(f"labels is on {labels.device}, expected hidden's device {hidden.device}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    check_choice(reduction, "reduction", REDUCTIONS)
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)) or \
            not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be a float in [0, 1], got {label_smoothing!r}")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or
                                not softcap > 0):
        raise ValueError(f"softcap must be None or a positive float, got {softcap!r}")
    if num_items_in_batch is not None:
        if reduction == "none":
            raise ValueError("num_items_in_batch divides the summed loss; it cannot go with reduction='none'")
        if isinstance(num_items_in_batch, torch.Tensor):
            if num_items_in_batch.numel() != 1:
                raise ValueError(f"num_items_in_batch must be a number or a one-element tensor, got shape "
                                 f"{list(num_items_in_batch.shape)}")
        elif isinstance(num_items_in_batch, bool) or not isinstance(num_items_in_batch, (int, float)):
            raise TypeError(f"num_items_in_batch must be None, a number or a tensor, got "
                            f"{type(num_items_in_batch).__name__}")
    if chunk_bytes is not None:
        check_positive_int(chunk_bytes, "chunk_bytes")
    return vocab


def check_labels(labels, vocab, ignore_index):
    """labels as int64, each in [0, vocab) or equal to ignore_index (F.cross_entropy fails on others too;
    a kernel would read past the row). One host sync on a GPU."""
    return _checked_labels(labels, vocab, ignore_index)[0]


def _checked_labels(labels, vocab, ignore_index):
    """check_labels, and what the check learned of the labels that count (not ignore_index): their number (an int,
    plain CPU labels: one C++ pass), their mask (a tensor), or None; the mean's denominator is their count."""
    labels = labels.long()
    if labels.is_cpu and eager_ok((labels,)):
        flat = labels.reshape(-1).contiguous()
        count = backend.cpu_label_count(flat, vocab, int(ignore_index))
        if count < 0:
            at = -1 - count
            raise _bad_label(flat[at].item(), at, vocab, ignore_index)
        return labels, count
    if is_fake(labels) and not torch.compiler.is_compiling():  # no values to check (selective_ckpt.fit's step)
        return labels, None
    if torch.compiler.is_compiling():  # a branch on values would break the graph: the check runs inside it
        torch._assert_async(~_bad_labels(labels, vocab, ignore_index).any(),
                            f"labels must be in [0, {vocab}) or ignore_index ({ignore_index})")
        return labels, None
    if not labels.numel():
        return labels, None
    # the range of the counted labels (the ignored ones as 0) proves them all valid in fewer passes than the exact
    # test; only labels it does not clear (or vocab 0) take that test
    counted = labels != ignore_index
    lo, hi = torch.stack(torch.where(counted, labels, 0).aminmax()).tolist()  # one read to the host
    if lo < 0 or hi >= vocab:
        bad = _bad_labels(labels, vocab, ignore_index)
        if bad.any():
            raise _bad_label(labels[bad][0].item(), bad.nonzero()[0].item(), vocab, ignore_index)
    return labels, counted


def _bad_label(value, position, vocab, ignore_index):
    return ValueError(f"labels must be in [0, {vocab}) or ignore_index ({ignore_index}); got {value} at position "
                      f"{position}")


def _bad_labels(labels, vocab, ignore_index):
    return (labels != ignore_index) & ((labels < 0) | (labels >= vocab))


def _autocast_operands(hidden, weight, bias):
    """Under autocast the head computes in the autocast dtype, as F.linear does there."""
    device = hidden.device.type
    if not torch.is_autocast_enabled(device):
        return hidden, weight, bias
    dtype = torch.get_autocast_dtype(device)
    return hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)


def linear_cross_entropy(hidden, weight, labels, bias=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                         softcap=None, num_items_in_batch=None, *, chunk_bytes=None):
    """Cross-entropy of the logits F.linear(hidden, weight, bias) without forming them all at once.

    hidden [N, h], weight [V, h], bias [V] or None (hidden's dtype), labels [N] integers in [0, V) or
    ignore_index. Exactly `F.cross_entropy(logits.float(), labels, ignore_index=..., reduction=...,
    label_smoothing=...)` as transformers' ForCausalLMLoss computes it: softcap (Gemma-2's
    final_logit_softcapping) caps the logits as softcap * tanh(logits / softcap) first;
    num_items_in_batch (a number or a one-element tensor) gives the summed loss divided by it. The
    logsumexp and the loss accumulate in float32 whatever the input dtype; the loss is float32 (a
    scalar, or [N] for reduction="none", 0 at ignored rows). A batch whose labels are all ignored
    gives NaN under "mean" and zero gradients, as transformers does.

    chunk_bytes bounds the transient logits of one chunk (see `chunk_rows`). Under autocast the head
    computes in the autocast dtype. Nothing of size N x V is kept for backward.
    """
    vocab = _check_operands(hidden, weight, labels, bias, ignore_index, reduction, label_smoothing, softcap,
                            num_items_in_batch, chunk_bytes)
    labels, counted = _checked_labels(labels, vocab, ignore_index)
    hidden, weight, bias = _autocast_operands(hidden, weight, bias)
    hidden = hidden.contiguous()  # dhidden is written row block by row block
    n_tokens, h = hidden.shape
    rows = chunk_rows(n_tokens, weight.shape[0], h, hidden.element_size(), chunk_bytes)
    tracked = torch.is_grad_enabled()
    needs = (tracked and hidden.requires_grad, tracked and weight.requires_grad,
             tracked and bias is not None and bias.requires_grad)
    if num_items_in_batch is not None:
        denom = num_items_in_batch
    elif reduction == "mean":
        # a sum of the bools would convert them first: slower
        denom = counted if isinstance(counted, int) else \
            torch.count_nonzero(labels != ignore_index if counted is None else counted)
    else:
        denom = None
    if isinstance(denom, torch.Tensor):
        denom = denom.to(hidden.device)
    cfg = (int(ignore_index), float(label_smoothing), float(softcap or 0.0))
    args = (hidden, weight, bias, labels, denom, "none" if reduction == "none" else "reduced", cfg, rows, needs)
    device = hidden.device.type
    if not torch.is_autocast_enabled(device):
        return _LinearCrossEntropy.apply(*args)
    with torch.autocast(device, enabled=False):  # the head's matmuls stay in the dtype _autocast_operands chose
        return _LinearCrossEntropy.apply(*args)


class _LogitsCrossEntropy(torch.autograd.Function):
    """Per-row loss of one chunk of logits a module produced; keeps the chunk's logits for backward."""

    @staticmethod
    def forward(ctx, logits, labels, cfg):
        _, loss = cross_entropy_rows_op(logits.contiguous(), labels, _unit_scale(logits), *cfg, False)
        ctx.cfg = cfg
        ctx.save_for_backward(logits, labels)
        return loss

    @staticmethod
    @first_order_only("selective_ckpt.logits_cross_entropy")
    def backward(ctx, grad):
        logits, labels = ctx.saved_tensors
        dz = logits.contiguous().clone()
        cross_entropy_rows_op(dz, labels, grad.contiguous().to(stat_dtype(logits.dtype)), *ctx.cfg, True)
        return dz, None, None


def logits_cross_entropy(logits, labels, ignore_index=-100, label_smoothing=0.0, softcap=None):
    """Per-row float32 loss of logits [n, V] (any float dtype) with the kernels of linear_cross_entropy:
    for a chunk of logits some other module computed (a LoRA or quantized head). labels int64 [n],
    checked by the caller (check_cross_entropy_args)."""
    return _LogitsCrossEntropy.apply(logits, labels, (int(ignore_index), float(label_smoothing),
                                                      float(softcap or 0.0)))
