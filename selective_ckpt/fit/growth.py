"""What grows with the context in one training step, and whose it is.

The fit (simulate.py) runs one step on fake tensors; here the same step runs at two long contexts with every
storage it makes recorded: the op, shape, dtype and bytes, the phase that made it and the one that freed it, the
module running (in backward: the autograd node), the innermost frame outside torch that called the op (in
transformers, PEFT, selective_ckpt or the user's code), and the class a layer's keeping pipeline named when it
kept the storage for backward (keeping.pipeline.observe, as memory.ledger sees it). Each storage is one of:

- "kept": the policy's own, named bytes: a layer's pipeline kept it for backward in a class (keeping.policy);
- "transient": freed before the step turns from forward to backward, or made in backward: the working set of
  one layer or of the loss head, which the fit counts in its transients;
- "shared": held from forward into backward outside the decoder layers (the model's rotary tables and
  positions, the loss head's gradient of its input, the last layer's output the final norm keeps): once per
  step, what the fit counts as kept outside the layers;
- "grows": a finding: held from forward into backward by a decoder layer outside its pipeline's classes
  (bytes per layer that no policy names).

The storages of one origin (op, frame, module with its layer index as "*", forward or backward, dtype and rank)
and kind are compared between the two contexts by the most bytes of them alive at once: those that grow in
neither bytes nor number are left out; those that grow faster than the context (an S x S mask) are "grows"
whatever they are; those more numerous but never more at once (a loop over chunks or tiles) are "bounded".

`python -m selective_ckpt.fit.growth Llama-3.1-8B --form qlora --policy attention-kept` prints the list.
"""

import argparse
import contextlib
import dataclasses
import math
import os
import re
import sys
import time

import torch
from torch import nn

from ..storages import storage_id
from . import simulate

KINDS = ("kept", "bounded", "transient", "shared", "grows")
CONTEXTS = (131072, 524288)
_LINEAR_EXPONENT = 1.25  # bytes growing faster than context ** this between the two contexts are superlinear
_OWN = re.compile(r"[\\/](site-packages[\\/])?(transformers|peft|selective_ckpt)[\\/]")
_HERE = os.path.abspath(__file__)
_SKIPPED = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(os.__file__) + os.sep)
_PLUMBING = tuple(os.path.join(os.path.dirname(os.path.dirname(_HERE)), *p) for p in (("ops", "eager.py"),
                                                                                      ("backend.py",)))


@dataclasses.dataclass
class Allocation:
    """One storage the step made: `op` (the aten op), `shape`, `dtype`, `nbytes`, `phase` (simulate's phase
    that made it: "embedding", ("forward", i), "head", "loss backward", ("backward", i), "optimizer"),
    `freed` (the phase that freed it, None while alive), `module` (the innermost module running, layer
    indices as "*", or the autograd node in backward), `where` (file:function:line of the innermost frame outside
    torch and the standard library), `layer` (the decoder layer running, or None), `kept` (the class a
    layer's pipeline kept it as, or None), `saved_in_layer` / `saved_outside` (kept for backward by autograd,
    outside any pipeline, while a decoder layer ran / while none did), `born` and `died` (the order storages
    were made and freed in)."""

    op: str
    shape: tuple
    dtype: torch.dtype
    nbytes: int
    phase: object
    module: str
    where: str
    layer: int = None
    freed: object = None
    kept: str = None
    saved_in_layer: bool = False
    saved_outside: bool = False
    born: int = 0  # the recorder's clock (one tick per storage made or freed) when made, and when freed
    died: int = None

    @property
    def origin(self):
        return (_stage(self.phase), self.op, self.where, self.module, self.dtype, len(self.shape))

    @property
    def spans(self):
        """Held from the forward into the backward."""
        return _stage(self.phase) == "forward" and _stage(self.freed) != "forward"

    @property
    def kind(self):
        """What this storage is, by itself (KINDS but "bounded", which compares contexts)."""
        if self.kept is not None:
            return "kept"
        if not self.spans:
            return "transient"
        if self.saved_in_layer or (self.layer is not None and not self.saved_outside):
            return "grows"  # held into backward by a decoder layer, outside its pipeline's classes
        return "shared"


def _stage(phase):
    """"forward" for phases before the loss's backward starts, "backward" after (None: not freed in the step)."""
    if phase is None:
        return None
    name = phase[0] if isinstance(phase, tuple) else phase
    return "forward" if name in ("embedding", "forward", "head") else "backward"


class Recorder:
    """simulate.run_step's recorder: every storage of the step as an Allocation (`allocations`, in order)."""

    def __init__(self):
        self.allocations, self.live, self.stack, self.layers, self.names = [], {}, [], {}, {}
        self.clock = 0

    # --- simulate._Held's calls

    def alloc(self, func, t, nbytes, phase, key):
        module, layer = self._module()
        a = Allocation(str(func.overloadpacket.__name__) if hasattr(func, "overloadpacket") else str(func),
                       tuple(t.shape), t.dtype, nbytes, phase, module, _where(), layer, born=self.clock)
        self.clock += 1
        self.allocations.append(a)
        self.live[key] = a

    def free(self, key, phase):
        a = self.live.pop(key, None)
        if a is not None:
            a.freed, a.died = phase, self.clock
            self.clock += 1

    # --- what is kept for backward

    def note(self, t, cls, handle):
        """keeping.pipeline.observe's call: t kept by a layer's pipeline as class `cls`."""
        a = self.live.get(storage_id(t))
        if a is not None:
            a.kept = cls

    def pack(self, t):
        a = self.live.get(storage_id(t))
        if a is not None:
            if self._module()[1] is None:
                a.saved_outside = True
            else:
                a.saved_in_layer = True
        return t.detach() if t.grad_fn is not None else t

    @staticmethod
    def unpack(t):
        return t

    # --- where an op runs

    def _module(self):
        layer = next((self.layers[m] for m in reversed(self.stack) if m in self.layers), None)
        if self.stack:
            return self.names.get(self.stack[-1], type(self.stack[-1]).__name__), layer
        node = torch._C._current_autograd_node()
        return (type(node).__name__ if node is not None else "-"), layer

    def _pre(self, module, args):
        self.stack.append(module)

    def _post(self, module, args, out):
        if self.stack and self.stack[-1] is module:
            self.stack.pop()

    @contextlib.contextmanager
    def watch(self, model):
        from ..keeping import pipeline

        self.layers = {m: i for i, m in enumerate(simulate.decoder_layers(model))}
        self.names = {m: _short(n) for n, m in model.named_modules()}
        handles = [nn.modules.module.register_module_forward_pre_hook(self._pre),
                   nn.modules.module.register_module_forward_hook(self._post, always_call=True)]
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack), pipeline.observe(self):
                yield self
        finally:
            for h in handles:
                h.remove()
            self.stack.clear()


def _short(name):
    """A module name without PEFT's wrapping and with layer indices as "*"."""
    name = re.sub(r"^base_model\.model\.", "", name)
    return re.sub(r"\.\d+(?=\.|$)", ".*", name) or "(model)"


def _where():
    """file:function:line of the innermost frame outside torch, the standard library, this file and the custom
    ops' call plumbing (transformers', PEFT's, selective_ckpt's or the user's code that called the op)."""
    f = sys._getframe(2)
    while f is not None:
        path = f.f_code.co_filename
        if not (path.startswith(_SKIPPED) or path.startswith("<") or os.path.abspath(path) in (_HERE, *_PLUMBING)
                or f.f_code.co_name in ("__torch_dispatch__", "run_step")):
            m = _OWN.search(path)
            short = path[m.start(2):] if m else os.path.join(*path.split(os.sep)[-2:])
            return f"{short.replace(os.sep, '/')}:{f.f_code.co_name}:{f.f_lineno}"
        f = f.f_back
    return "-"


def record_step(config, form, seq_len, policy="attention-kept", batch=1, num_layers=2, plant=None):
    """The Recorder of one step of `config` (fit.configs.load_config's input) with `num_layers` decoder layers
    in `form` (a TrainingForm), converted under `policy` (a recompute mode or keeping.policy; "transformers": not
    converted) at [batch, seq_len]. `plant`: called with the built model before the step (tests plant an
    allocation with it)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..models.moe import even_routing
    from .arithmetic import _quiet
    from .configs import load_config

    config = load_config(config)
    rec = Recorder()
    with FakeTensorMode(allow_non_fake_inputs=True), _quiet(), even_routing(), simulate.grouped_matmuls():
        model = simulate.build(config, num_layers, form)
        if policy == "transformers":
            simulate.even_routing(model)
        else:
            from .. import convert, set_recompute

            convert(model)
            set_recompute(model, policy)
        if plant is not None:
            plant(model)
        simulate.run_step(model, batch, seq_len, form.autocast, recorder=rec)
    return rec


@dataclasses.dataclass
class Origin:
    """The storages of one origin (op, frame, module, forward or backward, dtype and rank) at each context:
    `most` (context -> the most bytes alive at once), `count` (context -> how many were made), `largest` (the
    largest at the longer context), `kind` (KINDS), `classes` (the pipeline's classes it was kept as),
    `exponent` (of the growth of `most` between the two contexts: 1 linear, 2 quadratic)."""

    stage: str
    op: str
    where: str
    module: str
    dtype: torch.dtype
    ndim: int
    most: dict
    count: dict
    largest: Allocation
    kind: str = None
    classes: tuple = ()
    exponent: float = 0.0

    def describe(self):
        a = self.largest
        return (f"{self.op} {list(a.shape)} {str(a.dtype).replace('torch.', '')} in {self.stage}: {self.module} "
                f"at {self.where}")


def _most_at_once(allocations):
    """The most bytes of `allocations` alive at once (each from its birth to its death, or the step's end)."""
    events = sorted([(a.born, a.nbytes) for a in allocations] +
                    [(a.died, -a.nbytes) for a in allocations if a.died is not None])
    now = most = 0
    for _, n in events:
        now += n
        most = max(most, now)
    return most


def _groups(rec):
    """{(origin, kind): [Allocation]} of one recorded step."""
    out = {}
    for a in rec.allocations:
        out.setdefault((a.origin, a.kind), []).append(a)
    return out


def growing_allocations(config, form=None, contexts=CONTEXTS, policy="attention-kept", batch=1, num_layers=2,
                        plant=None):
    """The origins whose storages grow with the context (Origin, with its kind) in one simulated step of `config`
    with `num_layers` decoder layers in `form` (default: full fine-tune, float32) under `policy` (a recompute mode
    or keeping.policy; "transformers": not converted), at the two `contexts` (tokens per sample). The storages of
    one origin are split by what each is (Allocation.kind); each part's most bytes alive at once, and how many
    storages it made, are compared between the contexts: those that grow in neither are left out. Findings
    ("grows") first, then by kind and by bytes at the longer context."""
    from .forms import TrainingForm

    form = form if form is not None else TrainingForm()
    short, long = sorted(contexts)
    if short == long:
        raise ValueError(f"contexts must be two different numbers of tokens, got {contexts!r}")
    groups = {s: _groups(record_step(config, form, s, policy, batch, num_layers, plant)) for s in (short, long)}
    out = []
    for (origin, kind), allocs in groups[long].items():
        most = {s: _most_at_once(groups[s].get((origin, kind), ())) for s in (short, long)}
        count = {s: len(groups[s].get((origin, kind), ())) for s in (short, long)}
        if most[long] <= most[short] and count[long] <= count[short]:
            continue  # neither more bytes nor more storages at the longer context
        o = Origin(*origin, most=most, count=count, largest=max(allocs, key=lambda a: a.nbytes),
                   classes=tuple(sorted({a.kept for a in allocs if a.kept is not None})))
        o.exponent = math.log(most[long] / most[short]) / math.log(long / short) if most[short] else math.inf
        if most[short] and o.exponent > _LINEAR_EXPONENT:
            kind = "grows"  # faster than the context
        elif most[long] <= most[short]:
            kind = "bounded"  # more of them, never more at once
        o.kind = kind
        out.append(o)
    out.sort(key=lambda o: (KINDS.index(o.kind) if o.kind != "grows" else -1, -o.most[long]))
    return out


def _mib(n):
    return f"{n / 2 ** 20:,.1f}"


def format_table(origins, contexts=CONTEXTS, min_bytes=0):
    """The origins as lines: kind, MiB alive at once at each context (and storages made), classes, what."""
    short, long = sorted(contexts)
    lines = [f"{'kind':9} {'MiB @' + str(short):>14} {'MiB @' + str(long):>14} {'made':>9}  what"]
    for o in origins:
        if o.kind in ("transient", "bounded") and o.most[long] < min_bytes:
            continue
        made = f"{o.count[short]}->{o.count[long]}"
        cls = f" [kept as {', '.join(o.classes)}]" if o.classes else ""
        exp = f" (x context^{o.exponent:.2f})" if o.kind == "grows" else ""
        lines.append(f"{o.kind:9} {_mib(o.most[short]):>14} {_mib(o.most[long]):>14} {made:>9}  "
                     f"{o.describe()}{cls}{exp}")
    return "\n".join(lines)


def summary(origins, contexts=CONTEXTS):
    """{kind: (bytes at the shorter context, bytes at the longer)}: the origins' most alive at once, summed for
    what is held into backward ("kept", "shared", "grows"), the largest one for "transient" and "bounded"."""
    short, long = sorted(contexts)
    out = {k: [0, 0] for k in KINDS}
    for o in origins:
        for i, s in enumerate((short, long)):
            if o.kind in ("transient", "bounded"):
                out[o.kind][i] = max(out[o.kind][i], o.most[s])
            else:
                out[o.kind][i] += o.most[s]
    return {k: tuple(v) for k, v in out.items()}


def main(argv=None):
    from .__main__ import _argument, _Parser, add_form_arguments, form_from_arguments, parse_seq_len
    from .configs import BUNDLED, MissingExtra

    p = _Parser(prog="python -m selective_ckpt.fit.growth",
                description="Every storage of one simulated training step whose bytes grow with the context, at "
                            "two contexts, and whose it is (kept by the policy, bounded, a transient, shared "
                            "outside the layers, or a finding that grows).")
    p.add_argument("config", help=f"a config.json path or a bundled config: {', '.join(BUNDLED)}")
    p.add_argument("--policy", default="attention-kept",
                   help="recompute mode: none, selective, full, attention-kept, or transformers (not converted) "
                        "(default: %(default)s)")
    p.add_argument("--mlp-tiles", type=int, default=1, help="the MLP's sequence tiles (full, attention-kept)")
    p.add_argument("--layer-tiles", type=int, default=1, help="the whole layer's query tiles (full)")
    p.add_argument("--contexts", default="128K,512K",
                   help="two contexts, comma-separated (default: %(default)s)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers simulated (default: %(default)s)")
    p.add_argument("--batch", type=int, default=1, help="samples per step (default: %(default)s)")
    p.add_argument("--min-mib", type=float, default=64.0,
                   help="transients and bounded origins under this many MiB at the longer context are left out "
                        "(default: %(default)s)")
    add_form_arguments(p)
    a = p.parse_args(argv)
    try:
        contexts = tuple(_argument(parse_seq_len)(c) for c in a.contexts.split(","))
        if len(contexts) != 2 or "max" in contexts:
            raise ValueError(f"--contexts: two numbers of tokens, got {a.contexts!r}")
        policy = a.policy
        if a.mlp_tiles != 1 or a.layer_tiles != 1:
            from ..keeping import policy as make_policy

            policy = make_policy(a.policy, mlp_tiles=a.mlp_tiles, layer_tiles=a.layer_tiles)
        t0 = time.perf_counter()
        origins = growing_allocations(a.config, form_from_arguments(a), contexts, policy, a.batch, a.layers)
        took = time.perf_counter() - t0
    except MissingExtra as err:  # one line naming the extra, as fit's CLI
        print(f"{p.prog}: error: {err}", file=sys.stderr)
        return 1
    except (ValueError, TypeError, argparse.ArgumentTypeError) as err:
        print(f"{p.prog}: error: {err}", file=sys.stderr)
        return 2
    print(f"{a.config}, {form_from_arguments(a)}, policy {policy}, {a.layers} layers, batch {a.batch}: "
          f"storages growing with the context ({took:.1f} s)")
    print(format_table(origins, contexts, a.min_mib * 2 ** 20))
    totals = summary(origins, contexts)
    print("MiB by kind (kept, shared, grows: summed; transient, bounded: the largest): " +
          "; ".join(f"{k} {_mib(v[0])} -> {_mib(v[1])}" for k, v in totals.items() if v[1]))
    findings = [o for o in origins if o.kind == "grows"]
    print(f"{len(findings)} finding(s)" + ("" if findings else ": nothing grows beyond the policy's named bytes, "
                                           "the transients and what the step keeps once outside the layers"))
    return 1 if findings else 0


if __name__ == "__main__":
    sys.modules.setdefault("bitsandbytes", None)  # as fit's CLI: peft imports it; nothing here needs it
    sys.exit(main())
