"""A decoder layer run over query tiles, forward and rebuild: "full" whose working set is a tile's, not the context's.

Whole-layer recompute ("full") keeps only a layer's input, but the layer's forward and its rebuild in backward still
hold every transient of the layer at once over the whole sequence: the norm's output, q, k, v and their RoPE'd
copies, attention's output, the out-projection's and LoRA's outputs and, in backward, their gradients. At half a
million tokens that is tens of GiB per layer. Every op of a decoder layer but attention reads one token's row;
attention reads, for a query, the keys before it. So the layer runs in two passes over tiles of its sequence:

1. for each tile, the layer's forward up to attention, which hands back the tile's k and v (after RoPE and any
   k norm, in attention's dtype) and stops there: K, V for the whole sequence (2·Hkv·D per token);
2. for each tile, the whole layer's forward on the tile's rows, its attention reading the tile's queries against
   K, V up to the tile's end (the kernel's `q_offset`: query row i stands at key position start + i).

Forward holds the input, K, V, the output and one tile's transients; backward the input, K, V, their fp32
gradients dK, dV, the output's gradient and one tile's. In backward K, V are rebuilt (pass 1 without gradients),
then each tile, last first, is rebuilt with gradients and differentiated: its rows' input gradient, its share of
dK and dV (accumulated in fp32, in a fixed order), the layer's parameter gradients; last, pass 1 runs again tile by
tile with gradients and takes dK, dV back to the tile's input and the k/v projections' weights. Attention's forward
runs twice per step, as under "full"; the q, k and v projections run three times instead of twice (pass 1 computes
q and drops it: a layer's forward is run as the model family wrote it, so nothing family-specific is restated).

Exactness: each token's row goes through the same ops as untiled, attention over the same keys; what changes is
the rounding of matmuls over fewer rows and the order in which dK, dV and parameter gradients are summed (the 2x/3x
rule). Dropout: each pass of each tile restores the RNG state it started with in forward, so a seed drawn inside
the layer (LoRA's dropout, residual dropouts) is drawn again the same in the rebuild; attention's dropout uses one
seed for all tiles (drawn by the first tile, so a layer takes one draw, as untiled) with the kernel's mask of the
global row, so its mask is the untiled call's. The seeds LoRA's
dropout draws are a tile's own, so its masks (not their distribution) depend on the tile count.

The layer's attention must run `selective_ckpt.attention` (models/attention.py reads the running tile through
`current()`); per-token arguments of the layer's forward (position embeddings, position ids, cache positions)
are sliced to the tile, the attention mask is handed on whole and described once. The mechanism is transformers'
checkpoint hook (`_gradient_checkpointing_func`), so it runs where "full" runs; what the layer keeps is the input
(through the layer's pipeline, so it can be offloaded), plus, for each pass of a tile that drew random numbers
(dropout), the RNG state before it (host memory, ~5 KB each; not in memory.estimate).
"""

import contextlib
import functools
import threading

import torch
from torch.utils.checkpoint import get_device_states, set_device_states

from ..storages import is_fake
from .tiling import tile_sizes

TOKEN_DIM = 1  # hidden states are [B, S, h]
_LOCAL = threading.local()


class Captured(Exception):
    """Raised by the attention function in pass 1, once it holds the tile's k and v: the rest of the layer's forward
    is not needed there."""


class TileCall:
    """What the layer's attention does in this call: pass 1 ("capture": hand back k, v and stop) or pass 2 ("tile":
    attend the tile's queries [start, end) to `keys`, `values` [B, Hkv, end, D] with q_offset = start).
    `length`: the whole sequence's. `run`: the layer's LayerTiles, which holds attention's dropout seed."""

    __slots__ = ("mode", "start", "end", "length", "keys", "values", "captured", "run")

    def __init__(self, mode, start, end, length, run, keys=None, values=None):
        self.mode, self.start, self.end, self.length, self.run = mode, start, end, length, run
        self.keys, self.values, self.captured = keys, values, None

    def attention_seed(self, draw):
        """The seed attention's dropout uses in every tile of this layer call: drawn (`draw()`) by the first tile only,
        in forward and again in its rebuild (which restores the RNG state, so draws the same), so the layer takes one
        draw from the stream, as untiled."""
        if self.start == 0:
            self.run.attention_seed = draw()
        return self.run.attention_seed


def current():
    """The TileCall of the layer tile running now, or None outside layer tiles."""
    return getattr(_LOCAL, "call", None)


@contextlib.contextmanager
def _running(call):
    previous = current()
    _LOCAL.call = call
    try:
        yield call
    finally:
        _LOCAL.call = previous


def _slice_argument(value, start, end, length, name):
    """A per-token argument of the layer's forward cut to the tile's tokens: [B, S, ...] on dim 1, [S] on dim 0;
    a [B, 1, S, S] mask whole (the attention function describes it once for the whole sequence); tuples and lists
    element by element; anything else that has a dimension of the sequence's length is refused by name."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 4 and value.shape[-1] == length and value.shape[-2] == length:
            return value
        if value.dim() >= 2 and value.shape[1] == length:
            return value.narrow(1, start, end - start)
        if value.dim() == 1 and value.shape[0] == length:
            return value.narrow(0, start, end - start)
        if length in value.shape:
            raise ValueError(f"layer tiles: the layer's argument {name} of shape {list(value.shape)} has a dimension "
                             f"of the sequence's length {length} that is not its second; it cannot be cut into tiles")
        return value
    if isinstance(value, (tuple, list)):
        return type(value)(_slice_argument(v, start, end, length, name) for v in value)
    if isinstance(value, dict):
        return {k: _slice_argument(v, start, end, length, f"{name}[{k!r}]") for k, v in value.items()}
    return value


_WHOLE = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")  # describe the keys: handed on whole


class LayerTiles:
    """One call of a layer's forward `fn(x, *rest)` (transformers' checkpointed forward, a partial of the class's
    forward with its keywords) over `tiles` query tiles of x [B, S, h]."""

    def __init__(self, fn, x, rest, tiles):
        self.fn, self.rest = fn, rest
        self.length = x.shape[TOKEN_DIM]
        sizes = tile_sizes(self.length, tiles)
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        self.bounds = [(s, s + n) for s, n in zip(starts, sizes)]
        self.attention_seed = None
        self.device_type = x.device.type
        self.autocast = {d: (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                         for d in dict.fromkeys((self.device_type, "cpu"))}
        self.autocast_cache = torch.is_autocast_cache_enabled()

    def rows(self, x, start, end):
        """x's rows [start, end): a view for one sample; with a batch a copy (modules may .view a tile), a tile's
        transient."""
        t = x.narrow(TOKEN_DIM, start, end - start)
        return t if x.shape[0] == 1 else t.contiguous()

    def _call(self, x, start, end, call):
        keywords = getattr(self.fn, "keywords", {})
        sliced = {k: (v if k in _WHOLE else _slice_argument(v, start, end, self.length, k))
                  for k, v in keywords.items()}
        rest = tuple(_slice_argument(v, start, end, self.length, f"argument {i + 1}") for i, v in enumerate(self.rest))
        with _running(call):
            return self.fn(x, *rest, **sliced)

    def keys_values(self, x, start, end):
        """Pass 1 on the tile's rows: (k, v) [B, Hkv, tile, D] as the layer's attention would read them."""
        call = TileCall("capture", start, end, self.length, self)
        try:
            self._call(x, start, end, call)
        except Captured:
            return call.captured
        raise ValueError("layer tiles: the layer's forward finished without running selective_ckpt's attention "
                         "(its attention is not the converted one, or it ran another attention for this call); "
                         "layer_tiles needs the converted attention")

    def tile(self, x, start, end, keys, values):
        """Pass 2: the layer's output rows [start, end) from the tile's input rows and K, V up to `end`."""
        out = self._call(x, start, end, TileCall("tile", start, end, self.length, self, keys, values))
        if isinstance(out, (tuple, list)):
            if any(o is not None for o in out[1:]):
                raise ValueError("layer tiles: the layer's forward returned more than its hidden states (attention "
                                 "weights or a cache); layer_tiles cannot cut those into tiles")
            out = out[0]
        return out

    def autocast_context(self):
        stack = contextlib.ExitStack()
        for device, (enabled, dtype) in self.autocast.items():
            stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled, cache_enabled=self.autocast_cache))
        return stack


def _into(buffer, part, dim, start, end, length):
    """`part` written into rows [start, end) of `buffer` along `dim` (allocated at the first part, `length` rows):
    the whole is assembled in place, never held twice as by a concatenation of the parts."""
    if buffer is None:
        shape = list(part.shape)
        shape[dim] = length
        buffer = part.new_empty(shape)
    buffer.narrow(dim, start, end - start).copy_(part)
    return buffer


def _rng_state(x):
    return torch.get_rng_state(), get_device_states(x)


def _if_drawn(state, x):
    """`state` (the RNG state before a pass) if the pass drew random numbers since, else None: a pass without
    dropout keeps no copy of the generators' state (5 KB for the CPU's)."""
    cpu, (_, device_states) = state
    if is_fake(x):  # fit's simulated step: no values to compare (and the states are not counted)
        return state
    now_cpu, (_, now_devices) = _rng_state(x)
    if torch.equal(cpu, now_cpu) and all(torch.equal(a, b) for a, b in zip(device_states, now_devices)):
        return None
    return state


@contextlib.contextmanager
def _rng_restored(state, device_type):
    """Runs with the RNG state `state` and puts the state from before back after (the rebuild does not move the
    step's random stream); `state` None: the pass draws nothing, nothing to restore."""
    if state is None:
        yield
        return
    cpu, (devices, device_states) = state
    before = _rng_state_of(devices, device_type)
    torch.set_rng_state(cpu)
    set_device_states(devices, device_states, device_type=device_type)
    try:
        yield
    finally:
        torch.set_rng_state(before[0])
        set_device_states(devices, before[1], device_type=device_type)


def _rng_state_of(devices, device_type):
    if not devices:
        return torch.get_rng_state(), []
    module = getattr(torch, device_type)
    states = []
    for d in devices:
        with module.device(d):
            states.append(module.get_rng_state())
    return torch.get_rng_state(), states


class _TiledLayer(torch.autograd.Function):
    """y = the layer's forward over query tiles; saves only x. `params`: the layer's trainable parameters, inputs so
    that y requires grad when only they do (their gradients are accumulated by the rebuild's own backward calls)."""

    @staticmethod
    def forward(ctx, run, x, *params):
        states_kv, states_tile = [], []
        K = V = y = None
        for start, end in run.bounds:
            state = _rng_state(x)
            k, v = run.keys_values(run.rows(x, start, end), start, end)
            states_kv.append(_if_drawn(state, x))
            K, V = _into(K, k, 2, start, end, run.length), _into(V, v, 2, start, end, run.length)
            del k, v
        for start, end in run.bounds:
            state = _rng_state(x)
            out = run.tile(run.rows(x, start, end), start, end, K[:, :, :end], V[:, :, :end])
            states_tile.append(_if_drawn(state, x))
            y = _into(y, out, TOKEN_DIM, start, end, run.length)
            del out
        del K, V
        ctx.run, ctx.states_kv, ctx.states_tile = run, states_kv, states_tile
        ctx.save_for_backward(x)
        return y

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        run = ctx.run
        dy = dy.contiguous()
        with run.autocast_context():
            K = V = None
            with torch.no_grad():
                for (start, end), state in zip(run.bounds, ctx.states_kv):
                    with _rng_restored(state, run.device_type):
                        k, v = run.keys_values(run.rows(x, start, end), start, end)
                    K, V = _into(K, k, 2, start, end, run.length), _into(V, v, 2, start, end, run.length)
                    del k, v
            dK = torch.zeros(K.shape, dtype=torch.float32, device=K.device)
            dV = torch.zeros(V.shape, dtype=torch.float32, device=V.device)
            dx = torch.zeros_like(x) if x.requires_grad else None
            for (start, end), state in reversed(list(zip(run.bounds, ctx.states_tile))):
                with _rng_restored(state, run.device_type), torch.enable_grad():
                    xt = run.rows(x, start, end).detach().requires_grad_(x.requires_grad)
                    kt = K[:, :, :end].detach().requires_grad_()
                    vt = V[:, :, :end].detach().requires_grad_()
                    y = run.tile(xt, start, end, kt, vt)
                    if y.requires_grad:
                        torch.autograd.backward(y, dy.narrow(TOKEN_DIM, start, end - start))
                if dx is not None and xt.grad is not None:
                    dx.narrow(TOKEN_DIM, start, end - start).copy_(xt.grad)
                for acc, leaf in ((dK, kt), (dV, vt)):
                    if leaf.grad is not None:
                        acc[:, :, :end] += leaf.grad
                del y, xt, kt, vt
            del K, V
            for (start, end), state in reversed(list(zip(run.bounds, ctx.states_kv))):
                with _rng_restored(state, run.device_type), torch.enable_grad():
                    xt = run.rows(x, start, end).detach().requires_grad_(x.requires_grad)
                    k, v = run.keys_values(xt, start, end)
                    pairs = [(t, g.narrow(2, start, end - start).to(t.dtype))
                             for t, g in ((k, dK), (v, dV)) if t.requires_grad]
                    if pairs:
                        torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
                if dx is not None and xt.grad is not None:
                    dx.narrow(TOKEN_DIM, start, end - start).add_(xt.grad)
        return (None, dx, *([None] * (len(ctx.needs_input_grad) - 2)))


def layer_tiles_checkpoint(fn, *args, tiles, **kwargs):
    """transformers' `_gradient_checkpointing_func` signature: the layer's forward `fn(hidden_states, *rest)` run
    over `tiles` query tiles (the module doc), keeping only hidden_states for backward."""
    kwargs.pop("use_reentrant", None)
    if kwargs:
        raise ValueError(f"layer tiles: unexpected checkpoint arguments {sorted(kwargs)}")
    if not args or not isinstance(args[0], torch.Tensor) or args[0].dim() != 3:
        raise ValueError("layer tiles: the layer's hidden states must be its first positional argument, [B, S, h]")
    x, rest = args[0], args[1:]
    run = LayerTiles(fn, x, rest, tiles)
    layer = getattr(fn, "args", (None,))[0] if getattr(fn, "args", None) else None
    params = [p for p in layer.parameters() if p.requires_grad] if isinstance(layer, torch.nn.Module) else []
    return _TiledLayer.apply(run, x, *params)


def checkpoint_for(tiles):
    """The `_gradient_checkpointing_func` running a layer in `tiles` query tiles (marked, so a layer's policy knows
    it for its own)."""
    f = functools.partial(layer_tiles_checkpoint, tiles=tiles)
    f.layer_tiles = tiles
    return f


def is_layer_tiles(func):
    return getattr(func, "layer_tiles", None) is not None
