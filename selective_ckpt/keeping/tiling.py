"""A per-token function run over sequence tiles, each tile rebuilt and differentiated on its own in backward.

At long context an MLP's intermediate (gate, up and their product: 3·f per token) is what a layer's forward and
its rebuild hold at their peak, more than everything the layer keeps. `run_in_tiles(fn, x, tiles)` splits x's
token dimension (dim -2: S of [B, S, h], the rows of [T, h]) into `tiles` contiguous tiles as even as possible,
runs `fn` on each under its own non-reentrant torch.utils.checkpoint and concatenates the outputs, so forward
holds one tile's intermediate at a time, and backward rebuilds each tile and runs its backward before the next
tile's rebuild (autograd reaches the tiles one by one, last first): parameter gradients accumulate tile by tile in
that fixed order.

Exactness: `fn` must compute each token from that token's row alone (norms, MLPs, per-row dropout streams do),
so the tiles' outputs are those rows of fn(x) up to the rounding of a matmul over fewer rows. Each checkpoint
preserves the RNG state: a dropout inside `fn` that draws its seed from torch's generator at each call (LoRA's
dropout by seed) draws the same seed again in the tile's rebuild, so backward applies the forward's mask (a
rebuild that draws afresh would differentiate another mask than the forward applied: silently wrong
gradients). The seeds are a tile's own, so with such a dropout the masks (not their distribution) depend on the
tile count; a dropout that must not depend on it runs on the concatenated output, outside `fn`.

Each tile's checkpoint keeps, with the graph until backward, a copy of the CPU generator's state (5056 bytes; host
memory on a GPU, as the layer's own checkpoint keeps one): n tiles keep n of them per layer, which memory.estimate
does not count. A mixture-of-experts block (models/moe.py) runs router and experts per tile.

Used where the policy rebuilds the MLP anyway (keeping.policy: mlp_tiles under "full" and "attention-kept"), so
the tiles' checkpoints nest inside the layer's: the layer's rebuild in backward runs the tiles' forwards again
to save each tile's input, and each tile is rebuilt once more when backward reaches it.
"""

import functools
import math

import torch
from torch.utils.checkpoint import checkpoint

TOKEN_DIM = -2


def tile_sizes(length, tiles):
    """Sizes of min(tiles, length) contiguous tiles of `length` tokens, as even as possible (the first ones one token
    longer where it does not divide): torch.tensor_split's split."""
    n = max(1, min(int(tiles), int(length)))
    base, extra = divmod(int(length), n)
    return [base + 1] * extra + [base] * (n - extra)


def run_in_tiles(fn, x, tiles):
    """fn(x) computed over `tiles` contiguous tiles of x's token dimension (dim -2), each under its own
    non-reentrant checkpoint that preserves the RNG state; the tiles' outputs concatenated along that dimension.

    fn maps a [..., s, h] tile to a [..., s, h'] output and computes each token from its own row. tiles = 1 (or
    a sequence of one token) calls fn(x) directly; more tiles than tokens gives tiles of one token. Without
    gradients (no_grad, inference) the tiles run one by one with nothing checkpointed.
    """
    if isinstance(tiles, bool) or not isinstance(tiles, int) or tiles < 1:
        raise ValueError(f"tiles must be an int >= 1, got {tiles!r}")
    if x.dim() < 2:
        raise ValueError(f"run_in_tiles: x must have a token dimension (dim -2), got shape {tuple(x.shape)}")
    length = x.shape[TOKEN_DIM]
    if tiles == 1 or length <= 1:
        return fn(x)
    pieces = x.split(tile_sizes(length, tiles), dim=TOKEN_DIM)
    if math.prod(x.shape[:-2]) > 1:
        # with a batch the tiles are strided views (modules may .view them); each is copied inside its checkpoint,
        # so the copy is a tile's transient and the checkpoint keeps the view
        fn = functools.partial(_contiguous_call, fn)
    if torch.is_grad_enabled():
        outs = [checkpoint(fn, piece, use_reentrant=False, preserve_rng_state=True) for piece in pieces]
    else:
        outs = [fn(piece) for piece in pieces]
    return torch.cat(outs, dim=TOKEN_DIM)


def _contiguous_call(fn, piece):
    return fn(piece.contiguous())
