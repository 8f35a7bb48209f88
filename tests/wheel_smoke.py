"""Run by tests/test_wheel.py with the python of a fresh venv holding only the built wheel (torch and
numpy reach it through a .pth file, triton does not): every module imports from the installed copy,
each op family's forward and backward on tiny CPU tensors matches float64 eager PyTorch, and the
Triton backend asked for without triton is an ImportError naming the extra.

    python wheel_smoke.py CHECKOUT   # prints "smoke ok" last; exits non-zero on any failure
"""

import importlib
import os
import pkgutil
import sys
from pathlib import Path

import torch
import torch.nn.functional as F


def check_installed_copy(checkout):
    import selective_ckpt

    where = Path(selective_ckpt.__file__).resolve()
    assert not where.is_relative_to(checkout), f"imported the checkout's copy: {where}"
    assert not any(Path(p or ".").resolve() == checkout for p in sys.path), sys.path
    assert importlib.util.find_spec("triton") is None, "triton must not be visible in this venv"
    return where.parent


def import_every_module():
    import selective_ckpt

    imported, need_triton = [], []
    for info in pkgutil.walk_packages(selective_ckpt.__path__, "selective_ckpt."):
        if info.name.startswith("selective_ckpt.triton_kernels."):  # kernel modules: import triton itself
            need_triton.append(info.name)
            try:
                importlib.import_module(info.name)
            except ModuleNotFoundError as err:
                assert err.name == "triton", (info.name, err)
            else:
                raise AssertionError(f"{info.name} imported without triton")
            continue
        if info.name.endswith("__main__"):  # runs the main job when imported
            continue
        importlib.import_module(info.name)
        imported.append(info.name)
    for sub in ("ops", "models", "memory", "bench", "triton_kernels"):
        assert f"selective_ckpt.{sub}" in imported, (sub, imported)
    assert "selective_ckpt._C" in imported and "selective_ckpt.triton_kernels" in imported
    assert len(need_triton) >= 5, need_triton
    return imported


def close(ours, ref, name, tol=2e-5):
    err = (ours.double() - ref).abs().max().item()
    scale = max(1.0, ref.abs().max().item())
    assert err <= tol * scale, f"{name}: max error {err:.3g} against float64 eager"


def run_family(name, ours, reference, inputs):
    """fp32 forward and backward of `ours` against `reference` run in float64 on the same values."""
    xs = [t.clone().requires_grad_() for t in inputs]
    x64 = [t.double().requires_grad_() for t in inputs]
    y, y64 = ours(*xs), reference(*x64)
    close(y, y64, f"{name} output")
    g = torch.randn_like(y64)
    y.backward(g.float())
    y64.backward(g)
    for i, (a, b) in enumerate(zip(xs, x64)):
        close(a.grad, b.grad, f"{name} grad {i}", tol=5e-5)


def check_op_families():
    import selective_ckpt
    from selective_ckpt import rng

    torch.manual_seed(0)
    B, H, Hkv, S, D = 2, 4, 2, 13, 16

    def attn_ref(q, k, v):
        k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
        s = q @ k.transpose(-1, -2) / D**0.5
        s = s.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
        return torch.softmax(s, -1) @ v

    run_family("attention", lambda q, k, v: selective_ckpt.attention(q, k, v, causal=True), attn_ref,
               [torch.randn(B, H, S, D), torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)])

    seed, p = 1234567, 0.25
    keep = rng.elementwise_keep_mask(seed, 3 * 5, 24, p).reshape(3, 5, 24).double()
    run_family("dropout", lambda x: selective_ckpt.dropout(x, p, seed=seed),
               lambda x: x * keep * rng.keep_scale(p), [torch.randn(3, 5, 24)])

    d, f = 24, 40
    x = torch.randn(3, 5, d)
    run_family("gelu_mlp", lambda x, w1, b1, w2, b2: selective_ckpt.gelu_mlp(x, w1, b1, w2, b2),
               lambda x, w1, b1, w2, b2: F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2),
               [x, torch.randn(f, d) / d**0.5, torch.randn(f), torch.randn(d, f) / f**0.5, torch.randn(d)])
    run_family("layer_norm", lambda x, w, b: selective_ckpt.layer_norm(x, w, b),
               lambda x, w, b: F.layer_norm(x, (d,), w, b, 1e-5), [x, torch.randn(d), torch.randn(d)])
    run_family("rms_norm", lambda x, w: selective_ckpt.rms_norm(x, w),
               lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w, [x, torch.randn(d)])
    run_family("swiglu_mlp", lambda x, wg, wu, wd: selective_ckpt.swiglu_mlp(x, wg, wu, wd),
               lambda x, wg, wu, wd: F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd),
               [x, torch.randn(f, d) / d**0.5, torch.randn(f, d) / d**0.5, torch.randn(d, f) / f**0.5])


def check_triton_backend_refused():
    import selective_ckpt

    os.environ["SELECTIVE_CKPT_BACKEND"] = "triton"
    try:
        selective_ckpt.dropout(torch.randn(4, 8), 0.1)
    except ImportError as err:
        assert "selective_ckpt[triton]" in str(err), err
    else:
        raise AssertionError("the Triton backend ran without triton installed")
    finally:
        del os.environ["SELECTIVE_CKPT_BACKEND"]


def check_bundled_configs():
    """selective_ckpt.fit's bundled configs are package data: the wheel must carry every one."""
    from selective_ckpt.fit.configs import BUNDLED, REQUIRED, bundled

    for name in BUNDLED:
        d = bundled(name)
        assert all(k in d for k in REQUIRED), (name, sorted(d))


def main(checkout):
    package = check_installed_copy(Path(checkout).resolve())
    modules = import_every_module()
    check_op_families()
    check_triton_backend_refused()
    check_bundled_configs()
    print(f"package {package}")
    print(f"imported {len(modules)} modules")
    print("smoke ok")


if __name__ == "__main__":
    main(sys.argv[1])
