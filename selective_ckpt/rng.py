"""Seeds and the dropout-mask contract of docs/kernels/dropout.md.

Masks are a pure function of (seed, indices): Philox4x32-10 keyed by the seed, one call per group
of 8 columns, 16-bit values compared against t16 = round(p * 65536). The Philox words come from
the C++ implementation (csrc/philox.h); the mask assembly below is independent Python, so the
reference masks the tests use do not share code with the kernels' mask logic.
"""


import torch

from ._extension import load as _load_extension

_C = _load_extension()

U16_RANGE = 65536
SEED_RANGE = 1 << 64


def threshold(p, name="p") -> int:
    """t16 = round(p * 65536) for a dropout probability p in [0, 1); the kernels' integer threshold."""
    if isinstance(p, bool) or not isinstance(p, (int, float)):
        raise TypeError(f"{name} must be a Python float in [0, 1), got {type(p).__name__}")
    p = float(p)
    # `not 0 <= p < 1` rather than math.isnan: NaN fails it too, and under torch.compile(dynamic=True)
    # p can be a SymFloat, which math.isnan cannot take but a comparison can (a guard).
    if not 0.0 <= p < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {p}")
    t16 = round(p * U16_RANGE)
    if t16 > U16_RANGE - 1:
        raise ValueError(f"{name}={p} is too close to 1: round({name} * 65536) must be at most 65535")
    return t16


def keep_scale(p) -> float:
    """Scale for kept values, 65536 / (65536 - t16): makes the expectation of dropout exact."""
    return U16_RANGE / (U16_RANGE - threshold(p))


def kernel_constants(p: float):
    """(t16, keep scale) of a dropout rate the public entry has already checked with `threshold`.

    Computed once per call on the host and handed to every kernel of that call.
    """
    t16 = round(p * U16_RANGE)
    return t16, U16_RANGE / (U16_RANGE - t16)


def check_seed(seed, name="seed") -> int:
    """The seed as a Python int in [0, 2**64); a seed tensor (see seed_arg) is read back."""
    if isinstance(seed, torch.Tensor):
        return seed_from_tensor(check_seed_tensor(seed, name))
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"{name} must be a Python int in [0, 2**64) or a seed tensor, got {type(seed).__name__}")
    if not 0 <= seed < SEED_RANGE:
        raise ValueError(f"{name} must be in [0, 2**64), got {seed}")
    return seed


def check_seed_tensor(seed, name="seed"):
    if seed.dtype != torch.int32 or tuple(seed.shape) != (2,):
        raise TypeError(f"{name} as a tensor must be int32 of shape [2] (the seed's low and high words, "
                        f"see rng.seed_arg), got {seed.dtype} {list(seed.shape)}")
    return seed


def draw_seed(device=None, generator=None) -> int:
    """A fresh 64-bit seed as a Python int, from torch's generator for `device` (or `generator`).

    `torch.manual_seed` therefore reproduces every mask. On CUDA this reads the draw back to the
    host (one small synchronisation); the seed is returned as an int, not a device tensor.
    """
    if generator is not None:
        device = generator.device
    halves = torch.randint(0, 1 << 32, (2,), dtype=torch.int64, device=device, generator=generator).tolist()
    return halves[0] | (halves[1] << 32)


# Seeds cross the custom ops as tensors: int32 [2] holding the seed's low and high 32-bit words
# (as int32 bit patterns). Drawing one is then an ordinary tensor op that torch.compile traces
# without a graph break, and autograd keeps the 8 bytes of docs/DESIGN.md's "dropout" row.

def draw_seed_tensor(device=None, generator=None) -> torch.Tensor:
    """A fresh seed as a seed tensor: the same draw as draw_seed (same generator use and value)."""
    if generator is not None:
        device = generator.device
    halves = torch.randint(0, 1 << 32, (2,), dtype=torch.int64, device=device, generator=generator)
    return halves.to(torch.int32)  # keeps the low 32 bits of each word


def seed_arg(seed, device=None) -> torch.Tensor:
    """The seed tensor for an op on `device`: None draws one there, an int is validated and packed,
    a seed tensor is checked and moved there if it lives elsewhere. Called once, at the public entry.
    """
    if seed is None:
        return draw_seed_tensor(device)
    if isinstance(seed, torch.Tensor):
        seed = check_seed_tensor(seed)
        return seed if device is None else seed.to(device)
    seed = check_seed(seed)
    lo, hi = seed & 0xFFFFFFFF, seed >> 32
    return torch.tensor([lo - (1 << 32) if lo >> 31 else lo, hi - (1 << 32) if hi >> 31 else hi], dtype=torch.int32,
                        device=device)


def site_seed(dropout_p, seed, device):
    """The seed tensor of one dropout site at a public entry: drawn or packed on `device` when
    dropout_p > 0; with dropout off None, after checking a seed that was given all the same (no
    generator is touched, so turning dropout off does not shift later draws)."""
    if dropout_p > 0:
        return seed_arg(seed, device)
    if seed is not None:
        seed_arg(seed)
    return None


def seed_from_tensor(seed: torch.Tensor) -> int:
    """The Python int in [0, 2**64) a seed tensor holds (reads it back from its device)."""
    lo, hi = (w & 0xFFFFFFFF for w in seed.tolist())
    return lo | (hi << 32)


def philox4x32(seed: int, counters: torch.Tensor) -> torch.Tensor:
    """Philox4x32-10 of `counters` (int64 [..., 4], values in [0, 2**32)) with key (seed lo, seed hi)."""
    seed = check_seed(seed)
    if not isinstance(counters, torch.Tensor) or counters.dtype != torch.int64:
        raise TypeError("counters must be an int64 tensor")
    if counters.dim() == 0 or counters.shape[-1] != 4:
        raise ValueError(f"counters must have shape [..., 4], got {list(counters.shape)}")
    flat = counters.detach().to("cpu").contiguous().reshape(-1, 4)
    if flat.numel() and (flat.min() < 0 or flat.max() >= 1 << 32):
        raise ValueError("counters must lie in [0, 2**32)")
    out = torch.empty_like(flat)
    _C.philox_words(seed, flat.data_ptr(), out.data_ptr(), flat.shape[0])
    return out.reshape(counters.shape).to(counters.device)


def _keep_from_counters(seed, counters, cols, t16):
    """counters [..., G, 4] -> keep mask [..., cols] with u[t] = (w[t & 3] >> 16*(t >> 2)) & 0xffff."""
    words = philox4x32(seed, counters)
    t = torch.arange(8)
    u = (words[..., t & 3] >> (16 * (t >> 2))) & 0xFFFF  # [..., G, 8]
    u = u.reshape(*u.shape[:-2], -1)[..., :cols]
    return u >= t16


def attention_keep_mask(seed: int, B: int, H: int, Sq: int, Sk: int, p: float) -> torch.Tensor:
    """Keep mask of P[b, h, i, j], counter (j >> 3, i, b*H + h, 0): BoolTensor [B, H, Sq, Sk]."""
    t16 = threshold(p)
    groups = (Sk + 7) // 8
    c = torch.zeros(B * H, Sq, groups, 4, dtype=torch.int64)
    c[..., 0] = torch.arange(groups)
    c[..., 1] = torch.arange(Sq)[:, None]
    c[..., 2] = torch.arange(B * H)[:, None, None]
    return _keep_from_counters(seed, c, Sk, t16).reshape(B, H, Sq, Sk)


def elementwise_keep_mask(seed: int, rows: int, cols: int, p: float) -> torch.Tensor:
    """Keep mask of x viewed as [rows, cols], counter (j >> 3, row lo, row hi, 1): BoolTensor."""
    t16 = threshold(p)
    groups = (cols + 7) // 8
    r = torch.arange(rows, dtype=torch.int64)
    c = torch.zeros(rows, groups, 4, dtype=torch.int64)
    c[..., 0] = torch.arange(groups)
    c[..., 1] = (r & 0xFFFFFFFF)[:, None]
    c[..., 2] = (r >> 32)[:, None]
    c[..., 3] = 1
    return _keep_from_counters(seed, c, cols, t16)
