"""Compiles every Triton kernel for Hopper (sm_90) ahead of time, on a machine without a GPU.

The interpreter runs the kernels' arithmetic but not the compiler, so a kernel that only the GPU
compiler rejects (a type it cannot lower, a layout it cannot convert) would pass the CPU tests.
Here JITFunction.run is replaced by a compile-only stand-in: the public entry points run on CPU
tensors with SELECTIVE_CKPT_BACKEND=triton, and each launch is compiled to a cubin for sm_90 with
the signature, constexprs, num_warps and num_stages it was called with. Nothing is launched, so
the results are meaningless; only compilation is checked. Run as a script; prints one line per
distinct compiled kernel and a total.
"""

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)  # compile, not interpret (read at import of triton code)
os.environ["SELECTIVE_CKPT_BACKEND"] = "triton"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
POINTER_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
                 torch.int8: "i8", torch.uint8: "u8", torch.int32: "i32", torch.int64: "i64", torch.bool: "i1"}
LAUNCH_OPTIONS = ("num_warps", "num_stages")
SHARED_LIMIT = 232448  # bytes of shared memory one block may use on sm_90 (227 KiB)
compiled = {}


def _scalar_type(value):
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        if -(1 << 31) <= value < 1 << 31:
            return "i32"
        return "i64" if -(1 << 63) <= value < 1 << 63 else "u64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


def compile_only_run(self, *args, grid, warmup, **kwargs):
    options = {k: kwargs.pop(k) for k in list(kwargs) if k not in self.arg_names}
    bound = dict(zip(self.arg_names, args), **kwargs)
    signature, constexprs = {}, {}
    for param in self.params:
        value = bound[param.name] if param.name in bound else param.default
        if param.is_constexpr or value is None:
            signature[param.name] = "constexpr"
            constexprs[param.name] = value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = "*" + POINTER_TYPES[value.dtype]
        else:
            signature[param.name] = _scalar_type(value)
    launch = {k: options[k] for k in LAUNCH_OPTIONS if k in options}
    key = (self.__name__, tuple(signature.items()), tuple((k, repr(v)) for k, v in constexprs.items()),
           tuple(launch.items()))
    if key not in compiled:
        kernel = triton.compile(ASTSource(self, signature, constexprs), target=TARGET, options=launch)
        compiled[key] = kernel
        pointers = ",".join(t[1:] for t in signature.values() if t.startswith("*"))
        consts = ", ".join(f"{k}={v}" for k, v in constexprs.items())
        shared = kernel.metadata.shared
        if shared > SHARED_LIMIT:  # it would compile, then fail to launch
            raise RuntimeError(f"{self.__name__} [{consts}] needs {shared} bytes of shared memory, "
                               f"sm_90 has {SHARED_LIMIT}")
        print(f"sm_90 ok  {self.__name__}({pointers}) [{consts}] {launch} shared={shared}", flush=True)
    return None


def exercise():
    from selective_ckpt.triton_kernels import philox

    import selective_ckpt
    from selective_ckpt.ops.layer_norm import layer_norm

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.randn(5, 37, dtype=dtype, requires_grad=True)
        selective_ckpt.dropout(x, 0.1, seed=(1 << 64) - 5).sum().backward()

    for dtype, D, causal, p, padded in [(torch.bfloat16, 128, True, 0.0, False), (torch.bfloat16, 64, False, 0.1, True),
                                        (torch.float16, 80, True, 0.1, False), (torch.float32, 64, False, 0.0, False),
                                        (torch.bfloat16, 256, True, 0.0, False)]:
        q, k, v = (torch.randn(2, 3, 33, D, dtype=dtype, requires_grad=True) for _ in range(3))
        mask = torch.ones(2, 33, dtype=torch.bool) if padded else None
        o = selective_ckpt.attention(q, k, v, causal=causal, dropout_p=p, key_padding_mask=mask, seed=7)
        o.backward(torch.randn_like(o))

    for dtype in (torch.bfloat16, torch.float32):
        for approximate in ("none", "tanh"):
            x = torch.randn(6, 24, dtype=dtype, requires_grad=True)
            w1 = torch.randn(40, 24, dtype=dtype, requires_grad=True)
            w2 = torch.randn(24, 40, dtype=dtype, requires_grad=True)
            b1, b2 = torch.zeros(40, dtype=dtype), torch.zeros(24, dtype=dtype)
            selective_ckpt.gelu_mlp(x, w1, b1, w2, b2, 0.1, approximate, seed=3).sum().backward()

        x = torch.randn(4, 4096, dtype=dtype, requires_grad=True)
        w = torch.ones(4096, dtype=dtype, requires_grad=True)
        b = torch.zeros(4096, dtype=dtype, requires_grad=True)
        layer_norm(x, w, b).sum().backward()

    for dtype in (torch.bfloat16, torch.float32):  # the whole layer: LayerNorm rebuilds in backward too
        layer = selective_ckpt.SelectiveDecoderLayer(64, 4, dropout=0.1, attn_dropout=0.1, dtype=dtype)
        layer(torch.randn(2, 9, 64, dtype=dtype, requires_grad=True)).sum().backward()

    for dtype in (torch.bfloat16, torch.float16, torch.float32):  # RMSNorm (both forms) and the gated MLP
        for offset in (0.0, 1.0):
            x = torch.randn(4, 4096, dtype=dtype, requires_grad=True)
            w = torch.ones(4096, dtype=dtype, requires_grad=True)
            selective_ckpt.rms_norm(x, w, offset=offset).sum().backward()
        for activation in ("silu", "gelu_tanh"):
            x = torch.randn(6, 24, dtype=dtype, requires_grad=True)
            wg, wu = (torch.randn(40, 24, dtype=dtype, requires_grad=True) for _ in range(2))
            wd = torch.randn(24, 40, dtype=dtype, requires_grad=True)
            selective_ckpt.swiglu_mlp(x, wg, wu, wd, dropout_p=0.1, activation=activation, seed=3).sum().backward()
        layer = selective_ckpt.SelectiveDecoderLayer(64, 4, norm="rmsnorm", activation="swiglu", rope_theta=1e4,
                                                     dtype=dtype)
        layer(torch.randn(2, 9, 64, dtype=dtype, requires_grad=True)).sum().backward()

    counters = torch.zeros(8, 4, dtype=torch.int64)
    philox.philox_words(1, counters, torch.empty_like(counters))
    philox.attention_mask(1, 100, torch.empty(1, 2, 9, 17, dtype=torch.int8))
    philox.elementwise_mask(1, 100, torch.empty(9, 17, dtype=torch.int8))


if __name__ == "__main__":
    JITFunction.run = compile_only_run
    exercise()
    print(f"compiled {len(compiled)} kernels for sm_90")
    sys.exit(0 if compiled else 1)
