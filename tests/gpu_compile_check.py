"""Compiles every Triton kernel for Hopper (sm_90) ahead of time, on a machine without a GPU.

The interpreter runs the kernels' arithmetic but not the compiler, so a kernel that only the GPU
compiler rejects, or one that spills, would pass the CPU tests. Here JITFunction.run is replaced by
a compile-only stand-in that builds the launch exactly as triton's own JITFunction.run does: the
same binder (create_function_from_signature) specialises every argument (16-byte divisibility of
pointers, strides and sizes, ints equal to 1, constexprs) and _pack_args turns that into the
signature, constexprs and "tt.divisibility" attrs handed to the compiler. The triton_kernels entry
points are then called on CPU tensors with the shapes, strides and dtypes a real launch has, for
every configuration they launch; each distinct launch is compiled to a cubin for sm_90. Nothing is
launched.

Per compiled kernel: registers and local (spill) memory from `cuobjdump -res-usage`, spill
instructions (STL/LDL) and instruction counts from `cuobjdump -sass` (the whole kernel and its
main loop: the largest innermost loop), shared memory from the kernel metadata. n_spills is the
number of spill instructions; n_wgmma_serialized counts the wgmma that ptxas made wait for
themselves (its C7515 "Potential Performance Loss"), read from the SASS.

    python tests/gpu_compile_check.py [--json PATH] [--only attention|dropout|layer_norm|gelu_mlp|philox|llama_blocks]
"""

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile, not interpret (read at import of triton code)
os.environ["SELECTIVE_CKPT_BACKEND"] = "triton"  # the public functions in exercise_llama_blocks launch Triton

import torch  # noqa: E402
import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
SHARED_LIMIT = 232448  # bytes of shared memory one block may use on sm_90 (227 KiB)
BACKEND = make_backend(TARGET)
records = []  # one per distinct compiled launch
_seen = set()
_label = {}  # what the exercise is launching now: merged into each record


def _cuobjdump():
    here = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(here) if here.exists() else "cuobjdump"


def analyse(cubin: bytes):
    """Resource usage and SASS counts of a cubin (works for kernels served from triton's cache too).

    Returns registers, local memory bytes per thread (these kernels have no local arrays, so local
    memory is spill space), spill store and load instructions (STL, LDL), the total instruction
    count, the main-loop count (the largest innermost loop: a backward branch with no loop inside)
    and the sizes of all innermost loops. NOPs are not counted.
    """
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([_cuobjdump(), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([_cuobjdump(), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    local = int(re.search(r"LOCAL:(\d+)", usage).group(1)) + int(re.search(r"STACK:(\d+)", usage).group(1))
    addrs, loops, stl, ldl = [], [], 0, 0
    wgmma = []  # (destination, accumulator input, waits for itself) of each HGMMA, in program order
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if not m:
            continue
        addr, text = int(m.group(1), 16), m.group(2)
        op = re.sub(r"^@!?U?P\w+\s+", "", text.strip()).split()[0]
        if op == "NOP":
            continue
        stl += op.startswith("STL")
        ldl += op.startswith("LDL")
        addrs.append(addr)
        if op.startswith("HGMMA"):
            args = [a.strip() for a in re.sub(r"^@!?U?P\w+\s+", "", text.strip()).split(None, 1)[1].split(",")]
            waits = args[-1] == "gsb0"
            wgmma.append((args[0], args[-2] if waits else args[-1], waits))
        b = re.search(r"\bBRA\s+(?:`\(.*?\)\s*)?(0x[0-9a-f]+)", text)
        if b and int(b.group(1), 16) < addr:
            loops.append((int(b.group(1), 16), addr))
    inner = [lp for lp in loops if not any(o != lp and lp[0] <= o[0] and o[1] <= lp[1] for o in loops)]
    sizes = sorted((sum(1 for a in addrs if lo <= a <= hi) for lo, hi in inner), reverse=True)
    # ptxas serialises wgmma (its C7515 "Potential Performance Loss") by closing every HGMMA with its
    # own wait: an HGMMA that waits for itself and whose result the next one accumulates into.
    serial = sum(1 for a, b in zip(wgmma, wgmma[1:]) if a[2] and b[1] == a[0])
    return dict(n_regs=regs, local_bytes=local, spill_stores=stl, spill_loads=ldl, n_instructions_total=len(addrs),
                n_instructions=sizes[0] if sizes else 0, loops=sizes, n_wgmma_serialized=serial)


def _dtype_name(signature):
    """The element type of the first floating pointer argument (the kernel's data type)."""
    for t in signature.values():
        if isinstance(t, str) and t.startswith("*") and t[1:] in ("fp16", "bf16", "fp32", "fp64"):
            return t[1:]
    return "-"


def compile_only_run(self, *args, grid, warmup, **kwargs):
    """JITFunction.run up to the compile, with triton's own binder and _pack_args; never launches.

    The launch is queued (deduplicated like triton's kernel cache) and compiled by compile_all."""
    kwargs["debug"] = kwargs.get("debug", self.debug) or knobs.runtime.debug
    binder = create_function_from_signature(self.signature, self.params, BACKEND)
    bound_args, specialization, options = binder(*args, **kwargs)
    key = (self.__name__, str(specialization), str(sorted(kwargs.items(), key=str)))
    if key in _seen:
        return None
    _seen.add(key)
    options, signature, constexprs, attrs = self._pack_args(BACKEND, kwargs, bound_args, specialization, options)
    consts = {self.arg_names[p[0]]: v for p, v in constexprs.items() if len(p) == 1 and v is not None}
    rec = dict(kernel=self.__name__, dtype=_dtype_name(signature), head_dim=consts.get("D", consts.get("BLOCK_D")),
               num_warps=options.num_warps, num_stages=options.num_stages,
               constexprs={k: v for k, v in consts.items() if isinstance(v, (bool, int, float, str))},
               divisible=sorted(self.arg_names[p[0]] for p, a in attrs.items() if a), **_label)
    _pending.append((ASTSource(self, signature, constexprs, attrs), options.__dict__, rec))
    return None


_pending = []  # (source, options, partial record) per distinct launch, compiled by compile_all


def _compile_one(i):
    src, options, _ = _pending[i]
    try:
        kernel = triton.compile(src, target=TARGET, options=options)
        return dict(shared=kernel.metadata.shared, **analyse(kernel.asm["cubin"])), None
    except Exception as e:  # reported with the launch it belongs to
        return None, f"{type(e).__name__}: {e}"[-3000:]


def compile_all(jobs):
    """Compiles the queued launches (in `jobs` forked workers) into records; raises on any failure."""
    if jobs > 1 and len(_pending) > 1:
        import multiprocessing

        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            results = pool.map(_compile_one, range(len(_pending)), chunksize=1)
    else:
        results = [_compile_one(i) for i in range(len(_pending))]
    errors = []
    for (_, _, rec), (stats, err) in zip(_pending, results):
        if err:
            errors.append(f"{rec['kernel']} [{rec.get('case', '')}] {rec['constexprs']}: {err}")
            continue
        rec.update(stats, n_spills=stats["spill_stores"] + stats["spill_loads"])
        records.append(rec)
        print(f"sm_90 ok  {rec['kernel']}({rec['dtype']}) {_describe(rec)}", flush=True)
        if rec["shared"] > SHARED_LIMIT:  # it would compile, then fail to launch
            errors.append(f"{rec['kernel']} {_describe(rec)} needs more than {SHARED_LIMIT} bytes of shared memory")
    if errors:
        raise RuntimeError("\n".join(errors))


def _describe(r):
    c = r["constexprs"]
    flags = " ".join(k for k in ("CAUSAL", "WINDOW", "VARLEN", "HAS_PAD", "DROPOUT") if c.get(k))
    tile = "x".join(str(c[k]) for k in ("BLOCK_M", "BLOCK_N") if k in c)
    return (f"[{r.get('case', '')}] D={r['head_dim']} {flags} tile={tile} w{r['num_warps']}s{r['num_stages']} "
            f"regs={r['n_regs']} spills={r['n_spills']} serial={r['n_wgmma_serialized']} shared={r['shared']} "
            f"loop={r['n_instructions']} "
            f"total={r['n_instructions_total']}")


@contextlib.contextmanager
def label(**kw):
    _label.clear()
    _label.update(kw)
    try:
        yield
    finally:
        _label.clear()


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def attention_launch(tk, dtype, D, causal=False, p=0.0, B=2, H=4, Hkv=None, S=512, Sk=None, window=0, docs=None,
                     padded=False, packed=False, softcap=0.0, q_offset=0, sinks=False, Dv=None):
    """Forward and backward through the Triton entry points with a real launch's tensors (with q_offset,
    a query tile of S rows at key positions q_offset ... against Sk keys; sinks: fp32 [H] attention sinks;
    Dv: v's head dim where it differs from q and k's)."""
    Hkv, Sk, Dv = Hkv or H, Sk or S, Dv or D
    if packed:
        qkv = torch.empty(B, S, 3, H, D, dtype=dtype)
        q, k, v = (qkv[:, :, i].permute(0, 2, 1, 3) for i in range(3))
        gbuf = torch.empty_like(qkv)
        dq, dk, dv = (gbuf[:, :, i].permute(0, 2, 1, 3) for i in range(3))
    else:
        q = torch.empty(B, H, S, D, dtype=dtype)
        k, v = torch.empty(B, Hkv, Sk, D, dtype=dtype), torch.empty(B, Hkv, Sk, Dv, dtype=dtype)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    o = torch.empty(B, S, H, Dv, dtype=dtype).permute(0, 2, 1, 3)
    lse = torch.empty(B, H, S, dtype=torch.float32)
    pad = torch.ones(B, Sk, dtype=torch.bool) if padded else None
    cu = torch.tensor([0, *torch.tensor(docs).cumsum(0).tolist()], dtype=torch.int32) if docs else None
    seed = torch.zeros(2, dtype=torch.int32) if p > 0 else None
    t16 = round(p * 65536)
    ks = 65536 / (65536 - t16)
    sk = torch.empty(H, dtype=torch.float32) if sinks else None
    tk.forward(q, k, v, o, lse, pad, cu, causal, window, D**-0.5, softcap, seed, t16, ks, q_offset, sk)
    tk.backward(torch.empty(B, H, S, Dv, dtype=dtype), q, k, v, o, lse, pad, cu, causal, window, D**-0.5, softcap, seed,
                t16, ks, dq, dk, dv, q_offset, sk, None if sk is None else torch.empty_like(sk))


def exercise_attention():
    from selective_ckpt.triton_kernels import attention as tk

    for dtype in DTYPES.values():
        for D in (64, 128, 80):
            for causal in (False, True):
                for p in (0.0, 0.1):
                    with label(case="base", causal=causal, dropout=p > 0):
                        attention_launch(tk, dtype, D, causal, p)
    # GQA/MQA, windows, documents, padding, ragged lengths and packed q/k/v at bf16 (fp16 compiles alike)
    variants = dict(gqa=dict(H=8, Hkv=2, causal=True), window=dict(causal=True, window=128),
                    varlen=dict(B=1, docs=(100, 300, 112), causal=True), padded=dict(padded=True),
                    ragged=dict(S=500, Sk=500, causal=True), packed=dict(packed=True),
                    mqa_window=dict(H=4, Hkv=1, window=64), softcap=dict(H=8, Hkv=2, causal=True, softcap=50.0),
                    softcap_lean=dict(softcap=30.0),
                    # query tiles of a decoder layer's rebuild: rows [s, e) against keys [0, e), q_offset = s
                    q_offset=dict(H=8, Hkv=2, S=100, Sk=612, q_offset=512, causal=True),
                    q_offset_varlen=dict(B=1, S=200, Sk=512, q_offset=312, docs=(100, 300, 112), causal=True,
                                         window=128),
                    # gpt-oss: attention sinks on GQA sliding-window layers (forward, delta and dQ take them)
                    sinks=dict(H=8, Hkv=2, causal=True, window=128, sinks=True))
    for D in (128, 64):
        for p in (0.0, 0.1):
            for case, kw in variants.items():
                if D == 64 and case not in ("varlen", "window", "ragged", "gqa", "padded", "softcap", "softcap_lean",
                                            "q_offset", "q_offset_varlen", "sinks"):
                    continue
                kw = dict(kw)
                causal = kw.pop("causal", False)
                with label(case=case, causal=causal, dropout=p > 0):
                    attention_launch(tk, torch.bfloat16, D, causal, p, **kw)
    # head dim 256 (Gemma), capped as Gemma 2 is and not, at bf16
    for causal in (False, True):
        for p in (0.0, 0.1):
            for cap in (0.0, 50.0):
                with label(case="d256", causal=causal, dropout=p > 0):
                    attention_launch(tk, torch.bfloat16, 256, causal, p, H=8, Hkv=2, softcap=cap)
    # multi-head latent attention (DeepSeek-V3): q, k of 192 = 128 + 64 rotary, v of 128; causal, with and without
    # dropout, whole and packed documents, at bf16 and fp32
    for dtype in (torch.bfloat16, torch.float32):
        for p in (0.0, 0.1):
            with label(case="mla", causal=True, dropout=p > 0):
                attention_launch(tk, dtype, 192, True, p, Dv=128)
            with label(case="mla_varlen", causal=True, dropout=p > 0):
                attention_launch(tk, dtype, 192, True, p, B=1, docs=(100, 300, 112), Dv=128)


def exercise_dropout():
    from selective_ckpt.triton_kernels import dropout

    seed = torch.zeros(2, dtype=torch.int32)
    for dtype in DTYPES.values():
        for rows, cols in ((5, 37), (64, 4096)):
            x = torch.empty(rows, cols, dtype=dtype)
            with label(case=f"cols={cols}"):
                dropout.forward(x, torch.empty_like(x), rows, cols, seed, 6554, 65536 / (65536 - 6554))


def exercise_layer_norm():
    from selective_ckpt.triton_kernels import layer_norm as ln

    for dtype in DTYPES.values():
        for n in (64, 4096):
            rows = 8
            x, w, b = torch.empty(rows, n, dtype=dtype), torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
            stat = torch.empty(rows, dtype=torch.float32)
            with label(case=f"n={n}"):
                for bias in (b, None):
                    ln.forward(x, w, bias, torch.empty_like(x), stat, torch.empty_like(stat), rows, n, 1e-5)
                    ln.apply(x, w, bias, torch.empty_like(x), stat, stat, rows, n)
                ln.backward(torch.empty_like(x), x, stat, stat, w, torch.empty_like(x), torch.empty_like(w),
                            torch.empty_like(w), rows, n)


def exercise_gelu_mlp():
    from selective_ckpt.triton_kernels import gelu_mlp

    for dtype in DTYPES.values():
        for approximate in (0, 1):
            h = torch.empty(4096 * 4, dtype=dtype)
            with label(case="tanh" if approximate else "erf"):
                gelu_mlp.forward(h, torch.empty_like(h), h.numel(), approximate)
                gelu_mlp.backward_(torch.empty_like(h), h, h.numel(), approximate)


def exercise_philox():
    from selective_ckpt.triton_kernels import philox

    counters = torch.zeros(8, 4, dtype=torch.int64)
    with label(case="test helpers"):
        philox.philox_words(1, counters, torch.empty_like(counters))
        for trans in (False, True):
            philox.attention_mask(1, 100, torch.empty(1, 2, 9, 17, dtype=torch.int8), trans=trans)
        philox.elementwise_mask(1, 100, torch.empty(9, 17, dtype=torch.int8))


def exercise_llama_blocks():
    """RMSNorm (both forms), the gated MLP and the Llama-style layer through the public functions."""
    import selective_ckpt

    for dtype in DTYPES.values():
        for offset in (0.0, 1.0):
            x = torch.randn(4, 4096, dtype=dtype, requires_grad=True)
            w = torch.ones(4096, dtype=dtype, requires_grad=True)
            with label(case=f"rms_norm offset={offset}"):
                selective_ckpt.rms_norm(x, w, offset=offset).sum().backward()
        for activation in ("silu", "gelu_tanh", "gelu"):
            x = torch.randn(6, 24, dtype=dtype, requires_grad=True)
            wg, wu = (torch.randn(40, 24, dtype=dtype, requires_grad=True) for _ in range(2))
            wd = torch.randn(24, 40, dtype=dtype, requires_grad=True)
            with label(case=f"swiglu_mlp {activation}"):
                selective_ckpt.swiglu_mlp(x, wg, wu, wd, dropout_p=0.1, activation=activation, seed=3).sum().backward()
        layer = selective_ckpt.SelectiveDecoderLayer(64, 4, num_kv_heads=2, norm="rmsnorm", activation="swiglu",
                                                     rope_theta=1e4, sliding_window=5, dropout=0.1, attn_dropout=0.1,
                                                     dtype=dtype)
        with label(case="llama layer"):
            layer(torch.randn(2, 9, 64, dtype=dtype, requires_grad=True)).sum().backward()


FAMILIES = {"attention": exercise_attention, "dropout": exercise_dropout, "layer_norm": exercise_layer_norm,
            "gelu_mlp": exercise_gelu_mlp, "philox": exercise_philox, "llama_blocks": exercise_llama_blocks}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write one record per compiled configuration to this file")
    ap.add_argument("--only", choices=sorted(FAMILIES), action="append", help="compile only these families")
    ap.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1), help="parallel compiles")
    args = ap.parse_args(argv)
    JITFunction.run = compile_only_run
    for name in args.only or FAMILIES:
        FAMILIES[name]()
    compile_all(args.jobs)
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
    print(f"compiled {len(records)} kernels for sm_90")
    return 0 if records else 1


if __name__ == "__main__":
    sys.exit(main())
