"""Chunked attention (Llama 4's RoPE layers: config.layer_types[i] == "chunked_attention", chunk c =
config.attention_chunk_size): a query attends the keys at or before it in its own chunk of c tokens, chunks counted
from each row's first real token (left padding shifts them, as transformers' mask does) and from each packed
document's start.

The pattern is block-diagonal, so the kernel runs it as packed documents: the B rows laid end to end as one row (a
view of the contiguous [B, S, H, D] q, k and v, no copy) cut at every chunk, row, document and padding boundary
(cu_seqlens). So a chunked layer keeps what an unchunked one keeps: q, k, v, o and the logsumexp once each (plus
the int32 offsets, made once per mask and shared by the model's layers). The boundaries are read off the mask
transformers builds (a query that cannot see its left neighbour starts a segment) and the mask is checked to be
exactly that pattern on every real query's row; any other mask runs transformers' SDPA for that call, warned.

Real tokens' rows are exact. A padded position is a segment of padding of its own, whose rows attend padded keys
only: its output is not transformers' (which attends the chunk's real keys there, or nothing), and nothing real
reads it (real queries never see padded keys), so the logits at padded positions differ from the unconverted
model's. Where no chunk boundary falls inside a row's real tokens (every row's tokens within one chunk) the mask is
causal + key padding and the layer runs as an unchunked one, padded rows included.

Refused by name: attention dropout (its mask is indexed by the row's global query and key positions, which the
packed row renumbers; ConversionError at convert) and layer_tiles (ValueError at the call).
"""

import torch

from ..ops.attention import attention
from .errors import ConversionError

CHUNKED = "chunked_attention"


def chunk_size(module):
    """The attention module's chunk size when its layer is a chunked-attention layer (by its config's layer_types
    and attention_chunk_size), else None."""
    config = getattr(module, "config", None)
    kinds = getattr(config, "layer_types", None)
    index = getattr(module, "layer_idx", None)
    if not kinds or not isinstance(index, int) or index >= len(kinds) or kinds[index] != CHUNKED:
        return None
    return getattr(config, "attention_chunk_size", None)


def check_config(config, name):
    """ConversionError for what a config's chunked layers ask that the converted model does not reproduce."""
    if CHUNKED not in (getattr(config, "layer_types", None) or ()):
        return
    chunk = getattr(config, "attention_chunk_size", None)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ConversionError(f"{name}: chunked attention layers with attention_chunk_size={chunk!r}; selective_ckpt "
                              "runs them with a positive int chunk size")
    dropout = getattr(config, "attention_dropout", 0.0) or 0.0
    if dropout > 0:
        raise ConversionError(f"{name}: attention_dropout={dropout} with chunked attention layers (attention_chunk_size"
                              f"={chunk}) cannot be converted: the dropout mask is indexed by each row's query and key "
                              "positions, which the chunked layers' packed row renumbers; set attention_dropout=0")


def boundaries(allowed):
    """[B, S] bool from the allowed mask [B, S, S]: where a segment starts (a row's first position, a change between
    padding and real tokens, a real query that cannot see its real left neighbour), and the padding [B, S]."""
    pad = allowed.diagonal(dim1=-2, dim2=-1).contiguous()  # every real query attends itself
    starts = torch.ones_like(pad)
    if pad.shape[1] > 1:
        left = torch.arange(1, pad.shape[1], device=pad.device)
        seen = allowed[:, left, left - 1]
        starts[:, 1:] = (pad[:, 1:] != pad[:, :-1]) | (pad[:, 1:] & ~seen)
    return starts, pad


def _chunk_starts(batch, seq, chunk, documents, device):
    """[B, S] segment starts without a mask: each row, each document (cu_seqlens of one row) cut every `chunk`
    tokens from its start."""
    starts = torch.zeros(batch, seq, dtype=torch.bool, device=device)
    firsts = [0] if documents is None else documents.tolist()[:-1]
    ends = [seq] if documents is None else documents.tolist()[1:]
    for first, end in zip(firsts, ends):
        starts[:, first:end:chunk] = True
    return starts


class NotChunked(ValueError):
    """A mask that is not the chunked pattern on every real query's row."""


def segments(allowed, batch, seq, chunk, name, documents=None, device=None):
    """cu_seqlens (int32) of the B rows of length S laid end to end, cut at every segment start, or None for plain
    causal attention (no padding, no document, every row within one chunk: the layer runs unchunked). `allowed`:
    the [B, S, S] bool mask, or None (no padding; documents, cu_seqlens of one row, or none). Raises NotChunked for
    a mask that is not the chunked pattern on every real query's row."""
    if allowed is None:
        starts = _chunk_starts(batch, seq, chunk, documents, device)
        padded = False
    else:
        starts, pad = boundaries(allowed)
        idx = torch.arange(seq, device=allowed.device)
        segment = starts.cumsum(-1)
        expected = (idx[:, None] >= idx[None, :]) & (segment[:, :, None] == segment[:, None, :])
        if not bool(((allowed == expected) | ~pad[:, :, None]).all()):
            raise NotChunked(f"{name}: attention_mask is not chunked causal attention (attention_chunk_size={chunk})"
                             " over key padding or packed documents; selective_ckpt cannot express it")
        if documents is not None and not bool(starts[0, documents[:-1].long()].all()):
            raise ConversionError(f"{name}: cu_seq_lens_q disagrees with the documents of the attention mask")
        padded = not bool(pad.all())
    if not padded and not bool(starts[:, 1:].any()):
        return None
    positions = starts.reshape(-1).nonzero().flatten()
    end = torch.tensor([batch * seq], device=positions.device)
    return torch.cat([positions, end]).to(torch.int32)


def _end_to_end(t):
    """[B, Hx, S, D] -> [1, Hx, B*S, D], the rows laid end to end: a view of a contiguous [B, S, Hx, D]."""
    B, Hx, S, D = t.shape
    return t.transpose(1, 2).reshape(1, B * S, Hx, D).transpose(1, 2)


def attend(query, key, value, cu, scaling):
    """o [B, S, H, D] of chunked causal attention over the segments `cu` of the rows laid end to end."""
    B, H, S, D = query.shape
    o = attention(_end_to_end(query), _end_to_end(key), _end_to_end(value), True, 0.0, scaling, cu_seqlens=cu)
    return o.transpose(1, 2).view(B, S, H, D)
