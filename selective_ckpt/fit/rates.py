"""How fast a device runs each part of a training step: the rates the planner's time model divides by.

A `Rates` holds, for one device kind, the matmul rate per dtype, attention's forward and backward rates, the
memory bandwidth elementwise work moves bytes at, and the pinned host link's rate each way. `RATES` ships one per
GPU the fit knows by name. The H200's are measured (bench/RESULTS.md, "GPU: one NVIDIA H200", 2026-12-04): the
8192^3 bf16 matmul ran at 696 TFLOP/s, 70 % of the 989 TFLOP/s the card is sold with; our Triton attention's
causal forward at S = 8192, D = 128 at 432 TFLOP/s and its backward (2.5x the forward's FLOPs) at 248. The other
cards' are their spec sheets' dense peaks times those measured shares, and say so in `source`. `probe(device)`
measures the device at hand instead (a matmul, attention forward and backward, a pinned copy each way) and caches
the result; `rates_for` picks one by name, device or `Rates`, with any field overridden.
"""

import dataclasses
import json
import os
import time

import torch

TB = 1e12
GB = 1e9

# Shares of the spec sheet's dense bf16 peak measured on the H200 (see the module doc).
MATMUL_SHARE = 696 / 989
ATTENTION_FORWARD_SHARE = 432 / 989
ATTENTION_BACKWARD_SHARE = 248 / 989
BANDWIDTH_SHARE = 0.75  # elementwise kernels' share of the HBM bandwidth (not measured: a common figure)


@dataclasses.dataclass(frozen=True)
class Rates:
    """Rates of one device kind, in FLOP/s and bytes/s.

    matmul_bf16 / matmul_fp32: matmuls in bf16 (and fp16) and in fp32 (TF32 off, PyTorch's default);
    attention_forward / attention_backward: fused attention (bf16) per FLOP of its forward and backward (the
    backward counted as 2.5x the forward's FLOPs); bandwidth: bytes/s elementwise kernels move; host_to_device /
    device_to_host: pinned copies; overlap: the share of a layer's compute a copy on its own stream can hide under;
    layer_overhead: seconds of launches and Python per layer and pass that no rate covers; efficiency: the share
    of these rates a whole step attains (odd-shaped and small matmuls, launches, synchronization), fitted to a
    measured step; source: where the figures come from."""

    device: str
    matmul_bf16: float
    matmul_fp32: float
    attention_forward: float
    attention_backward: float
    bandwidth: float
    host_to_device: float
    device_to_host: float
    overlap: float = 0.9
    layer_overhead: float = 50e-6
    efficiency: float = 0.835
    source: str = ""

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in ("device", "source"):
                if not isinstance(v, str):
                    raise TypeError(f"Rates.{f.name} must be a str, got {type(v).__name__}")
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v < 0:
                raise ValueError(f"Rates.{f.name} must be a non-negative number, got {v!r}")
            if f.name not in ("layer_overhead", "overlap") and v == 0:
                raise ValueError(f"Rates.{f.name} must be positive, got {v!r}")
        if not 0 <= self.overlap <= 1:
            raise ValueError(f"Rates.overlap must be in [0, 1], got {self.overlap!r}")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"Rates.efficiency must be in (0, 1], got {self.efficiency!r}")

    def matmul(self, dtype):
        """The matmul rate for operands of `dtype`."""
        return self.matmul_fp32 if dtype in (torch.float32, torch.float64) else self.matmul_bf16

    def to_dict(self):
        return dataclasses.asdict(self)


def _from_spec(device, bf16_peak, fp32_peak, hbm, link, source=None):
    """Rates from a spec sheet: dense bf16 and fp32 peaks (TFLOP/s), HBM (TB/s), pinned host link (GB/s each way)."""
    return Rates(device, matmul_bf16=bf16_peak * TB * MATMUL_SHARE, matmul_fp32=fp32_peak * TB * MATMUL_SHARE,
                 attention_forward=bf16_peak * TB * ATTENTION_FORWARD_SHARE,
                 attention_backward=bf16_peak * TB * ATTENTION_BACKWARD_SHARE,
                 bandwidth=hbm * TB * BANDWIDTH_SHARE, host_to_device=link * GB, device_to_host=link * GB,
                 source=source or f"spec sheet (dense bf16 {bf16_peak} TFLOP/s, fp32 {fp32_peak}, HBM {hbm} TB/s, "
                                  f"host link {link} GB/s) times the shares measured on an H200")


# PCIe 5.0 x16 moves ~50 GB/s of pinned memory each way in practice, PCIe 4.0 x16 ~25.
RATES = {
    "H200": Rates("H200", matmul_bf16=696 * TB, matmul_fp32=67 * TB * MATMUL_SHARE, attention_forward=432 * TB,
                  attention_backward=248 * TB, bandwidth=4.8 * TB * BANDWIDTH_SHARE, host_to_device=50 * GB,
                  device_to_host=50 * GB,
                  source="measured on an H200 (bench/RESULTS.md, 2026-12-04): bf16 matmul 696 TFLOP/s, attention "
                         "forward 432 and backward 248 TFLOP/s (ours, causal, S 8192, D 128); fp32, HBM share and "
                         "the PCIe 5.0 host link (50 GB/s) from the spec sheet"),
    "H100-80GB": _from_spec("H100-80GB", 989, 67, 3.35, 50),
    "A100-80GB": _from_spec("A100-80GB", 312, 19.5, 2.0, 25),
    "A100-40GB": _from_spec("A100-40GB", 312, 19.5, 1.56, 25),
    "L40S": _from_spec("L40S", 362, 91.6, 0.864, 25),
    "RTX-4090": _from_spec("RTX-4090", 165, 82.6, 1.0, 25),
    "L4": _from_spec("L4", 121, 30.3, 0.3, 25),
    "A10G": _from_spec("A10G", 70, 31.2, 0.6, 25),
}
_ALIASES = {"H100": "H100-80GB"}


def _key(name):
    return name.upper().replace("_", "").replace("-", "").replace(" ", "")


def rates_for(device=None, **overrides):
    """The Rates for `device`: a Rates, a card name of RATES ("H200", "H100-80GB", "RTX-4090", ...), or None for
    the H200's; any Rates field given as a keyword overrides the table's (e.g. device_to_host=25e9)."""
    if isinstance(device, Rates):
        base = device
    elif device is None or isinstance(device, str):
        name = "H200" if device is None else device
        table = {_key(k): v for k, v in RATES.items()}
        table.update({_key(a): RATES[t] for a, t in _ALIASES.items()})
        base = table.get(_key(name))
        if base is None:
            raise ValueError(f"device: no rate table for {name!r}; known: {', '.join(RATES)} (or pass a Rates, or "
                             "measure the device at hand with selective_ckpt.fit.rates.probe())")
    else:
        raise TypeError(f"device must be a card name, a Rates or None, got {type(device).__name__}")
    unknown = set(overrides) - {f.name for f in dataclasses.fields(Rates)}
    if unknown:
        raise TypeError(f"rates_for: unknown rate {sorted(unknown)[0]!r}; fields: "
                        f"{', '.join(f.name for f in dataclasses.fields(Rates))}")
    if overrides:
        base = dataclasses.replace(base, **overrides, source=base.source + " (overridden: " +
                                   ", ".join(sorted(overrides)) + ")")
    return base


def _cache_path(name):
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    return os.path.join(root, "selective_ckpt", f"rates-{safe}-torch{torch.__version__.split('+')[0]}.json")


def probe(device=None, cache=True, seconds=0.2):
    """Measures the rates of `device` (default: the current CUDA device, else the CPU): a square matmul in
    bf16 and fp32, causal scaled_dot_product_attention forward and backward (bf16, D 128), and for a CUDA
    device a pinned copy each way; elementwise bandwidth from a large add. Each figure is the best of repeats
    over about `seconds`. Cached per device name and torch version under ~/.cache/selective_ckpt (cache=False
    measures anew). Takes a few seconds."""
    dev = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu-{os.cpu_count()}"
    path = _cache_path(name)
    if cache and os.path.exists(path):
        with open(path) as f:
            return Rates(**json.load(f))
    small = dev.type == "cpu"
    n = 512 if small else 8192

    def best(fn):
        fn()
        _sync(dev)
        out, spent = float("inf"), 0.0
        while spent < seconds:
            t0 = time.perf_counter()
            fn()
            _sync(dev)
            dt = time.perf_counter() - t0
            out, spent = min(out, dt), spent + dt
        return out

    rates = {}
    for dtype, field in ((torch.bfloat16, "matmul_bf16"), (torch.float32, "matmul_fp32")):
        a = torch.randn(n, n, device=dev, dtype=dtype)
        rates[field] = 2 * n ** 3 / best(lambda a=a: a @ a)
    b, h, s, d = (1, 4, 1024, 128) if small else (2, 16, 4096, 128)
    q = torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    fwd_flops = 4 * b * h * s * s * d / 2
    sdpa = torch.nn.functional.scaled_dot_product_attention
    rates["attention_forward"] = fwd_flops / best(lambda: sdpa(q, q, q, is_causal=True))
    out = sdpa(q, q, q, is_causal=True)
    grad = torch.ones_like(out)
    both = best(lambda: torch.autograd.grad(sdpa(q, q, q, is_causal=True), q, grad))
    rates["attention_backward"] = 2.5 * fwd_flops / max(both - fwd_flops / rates["attention_forward"], 1e-9)
    x = torch.randn(n * n * (1 if small else 4), device=dev)
    rates["bandwidth"] = 3 * x.numel() * x.element_size() / best(lambda: x + x)
    if dev.type == "cuda":
        host = torch.empty(x.numel(), dtype=x.dtype, pin_memory=True)
        rates["device_to_host"] = x.numel() * x.element_size() / best(lambda: host.copy_(x, non_blocking=True))
        rates["host_to_device"] = x.numel() * x.element_size() / best(lambda: x.copy_(host, non_blocking=True))
    else:  # host memory is the device's: a copy costs what moving the bytes once costs
        rates["device_to_host"] = rates["host_to_device"] = rates["bandwidth"] / 2
    result = Rates(name, **rates, source=f"probed on {name} with torch {torch.__version__}")
    if cache:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(result.to_dict(), f, indent=1)
    return result


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
