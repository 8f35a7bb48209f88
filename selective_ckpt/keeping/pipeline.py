"""One pack/unpack pipeline per decoder layer: what its forward saves for backward is rebuilt, else offloaded,
else kept, as the layer's policy (keeping.policy) says for the tensor's class.

Rebuild (docs/DESIGN.md, "Converted models"): saved-tensor hooks keyed on the output's storage. Inside a
layer's pipeline, a patched norm or activation calls `discardable(y, rebuild, *args)`. Whichever module then
saves y (or a view of y) for its backward — a plain Linear, a PEFT LoRA layer, a quantized Linear — gets a small
placeholder instead of the tensor, so nothing keeps y alive once the forward has moved on. The first consumer
whose backward unpacks the placeholder calls `rebuild(*args)` once under no_grad; every other consumer of the
same y (q, k, v projections, LoRA A) shares that result, which dies with the last placeholder.

Consumers often save a *copy* of y rather than y: under autocast each Linear saves its own 16-bit cast, PEFT
casts its input to the adapter's dtype, LoRA dropout makes a new tensor. So that these copies are rebuilt too, a
pipeline can watch dtype casts (`aten._to_copy`, below autograd, so casts by autocast count as well): a cast of
a registered output is registered in turn, rebuilt as the cast of the rebuilt output (the same bits as the cast
the consumer saved), and `source(x)` hands a derived output's producer (LoRA dropout) a handle that rebuilds x
instead of keeping it. A cast of a tensor that is not registered (the attention output, which attention keeps
anyway; autocast's 16-bit copy of an fp32 weight) is rebuilt from that tensor when it is a parameter or no
larger than the copy, so a substitution never costs bytes. Casts carry their source's class. With a per-layer
memo (`scope(memo=)`), later calls follow casts through the autograd graph instead: a cast's node reading a
registered or tagged output, through views, permutes and transposes too, or a parameter; code that makes
autocast's casts itself shows them with `cast` (a frozen weight's cast has no node).

Classes: the code that produces or saves a tensor names its class with `tag(t, cls)` (attention tags q, k, v and
o, lse; the MLP ops their matmul outputs; the norm patches their inputs; the pipeline the layer input), and
`discardable` outputs are "norm_act"; code that runs an aten op under its own autograd node, which saves its outputs
before they can be tagged, names their class beforehand with `saving_as` (attention's CPU flash call). A saved
tensor of a class the policy offloads goes to the layer's offload engine (keeping.offload) and comes back, bit for
bit, before its consumer's backward; an untagged one ("other": statistics, seeds, LoRA's rank-sized outputs) is
kept.

Why hooks and not freeing storage: nothing is mutated, so a consumer that reads y again in forward, a hook that
inspects it or an in-place op that bumps its version stays correct (a saved tensor whose version moved since
registration is saved as usual), and the rebuild happens exactly when a consumer first needs it, whatever order
backward runs in. An edit through `.data` bumps no version and is not seen: y is rebuilt as it was before the
edit.

Pipelines are not entered under torch.compile (AOTAutograd decides what is saved there) nor inside another
saved-tensor hook context (torch.utils.checkpoint, a user's own offloading): the outer mechanism then decides
what is kept, and y is kept as usual. The one outer context a pipeline works under is an observer's (`observe`,
used by memory.ledger): it is shown what the pipeline keeps and where (device or host), and nothing it drops.
"""

import contextlib
import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..ops.eager import TRANSPARENT_MODES
from ..storages import PLAIN_TENSOR_TYPES, storage_id
from .policy import OTHER, resolve

_state = threading.local()
_TO_COPY = torch.ops.aten._to_copy.default
_PARAMETER = torch.nn.Parameter


def _node_types():
    leaf = torch.zeros(1, requires_grad=True)
    cast = leaf.to(torch.float64)
    return type(cast.grad_fn), type(cast.grad_fn.next_functions[0][0])


_TO_COPY_NODE, _ACCUMULATE_GRAD = _node_types()  # the autograd nodes of a dtype cast and of a leaf


def _view_node_types():
    x = torch.zeros(2, 3, 4, requires_grad=True) * 1
    return type(x.view(6, 4).grad_fn), type(x.permute(2, 0, 1).grad_fn), type(x.transpose(0, 1).grad_fn)


_VIEW_NODE, _PERMUTE_NODE, _TRANSPOSE_NODE = _view_node_types()
_VIEW_CHAIN_LIMIT = 8  # view ops followed between a cast and its source


def _viewed_through(node, shape, edges):
    """When `node` (the node of a cast's input, whose output has `shape`) is a view, permute or transpose of a
    tensor whose edge is in `edges`, possibly through more of them: (edges' entry, the ops from that tensor to
    the cast's input in forward order, that tensor's shape); else None. The ops are read from the nodes' saved
    arguments and replayed exactly by _replayed."""
    ops = []
    for _ in range(_VIEW_CHAIN_LIMIT):
        kind = type(node)
        n = len(shape)
        if kind is _VIEW_NODE:
            before = getattr(node, "_saved_self_sym_sizes", None)  # the saved arguments' names: torch's own
            if before is None:
                return None
            ops.append(("view", tuple(shape)))
            shape = tuple(before)
        elif kind is _PERMUTE_NODE:
            dims = getattr(node, "_saved_dims", None)
            if dims is None or len(dims) != n:
                return None
            dims = tuple(dims)
            ops.append(("permute", dims))
            before = [0] * n
            for i, d in enumerate(dims):
                before[d % n] = shape[i]
            shape = tuple(before)
        elif kind is _TRANSPOSE_NODE:
            d0, d1 = getattr(node, "_saved_dim0", None), getattr(node, "_saved_dim1", None)
            if d0 is None or d1 is None or not n:
                return None
            ops.append(("transpose", (d0, d1)))
            before = list(shape)
            before[d0 % n], before[d1 % n] = shape[d1 % n], shape[d0 % n]
            shape = tuple(before)
        else:
            return None
        if len(node.next_functions) != 1:
            return None
        edge = node.next_functions[0]
        found = edges.get(edge)
        if found is not None:
            return found, ops[::-1], shape
        node = edge[0]
    return None


def _replayed(x, ops, dtype):
    """The cast to dtype of the view ops `ops` (from _viewed_through) applied to x."""
    for op, args in ops:
        x = x.view(args) if op == "view" else x.permute(args) if op == "permute" else x.transpose(*args)
    return x.to(dtype)


class _Rebuild:
    """A dropped output: how to rebuild it, and the rebuilt value while consumers still need it.

    `args` may hold sources (`_View`) of other dropped outputs; they are rebuilt first.
    """

    __slots__ = ("fn", "args", "value", "count", "order")

    def __init__(self, fn, args):
        self.fn, self.args, self.value, self.count, self.order = fn, args, None, 0, ()

    def get(self):
        if self.value is None:
            self.count += 1
            if torch.is_grad_enabled():  # a backward that builds a graph (create_graph); else none to leave
                with torch.no_grad():
                    self.value = self._rebuilt()
            else:
                self.value = self._rebuilt()
        return self.value

    def _rebuilt(self):
        args = [a.get() if isinstance(a, _View) else a for a in self.args]
        value = self.fn(*args)
        # laid out as the registered output's storage, which the placeholders' geometry reads
        return (value.permute(self.order) if self.order else value).contiguous()


class _View:
    """What a consumer's graph node keeps instead of y (or a view of y): the view's geometry."""

    __slots__ = ("rebuild", "size", "stride", "offset")

    def __init__(self, rebuild, size, stride, offset):
        self.rebuild, self.size, self.stride, self.offset = rebuild, size, stride, offset

    def get(self):
        return self.rebuild.get().as_strided(self.size, self.stride, self.offset)


class _Offloaded:
    """What a consumer's graph node keeps instead of an offloaded tensor: the engine's handle."""

    __slots__ = ("handle",)

    def __init__(self, handle):
        self.handle = handle

    def get(self):
        return self.handle.get()


def _cast(x, dtype):
    return x.to(dtype)


def _key(t):
    """The storage a plain strided tensor lives in (storages.storage_id); None for subclasses, which are kept."""
    if type(t) not in PLAIN_TENSOR_TYPES or t.layout != torch.strided:
        return None
    return storage_id(t)


class _LayerPipeline:
    def __init__(self, policy, engine, observer, registered=True):
        self.policy = policy
        # rebuild registered outputs (else they are kept, as in "none"); under "full" only the checkpoint's inputs
        # pass through the pipeline (the layer's forward runs under the checkpoint's own hooks)
        self.rebuilds = registered and policy.recompute == "selective"
        self.engine = engine if policy.offloaded else None
        self.outputs = {}  # storage_id -> (y, version at registration, _Rebuild)
        self.casts = {}  # storage_id -> (weakref to the cast, weakref to its root, root version, dtypes)
        self.tags = {}  # storage_id -> (weakref to a tensor of that storage, class)
        self.observer = observer  # the observing context's recorder (memory.ledger), or None
        self.classify = self.engine is not None or observer is not None  # else classes decide nothing
        self.saving = None  # the class of untagged saves while saving_as names one
        # Casts followed through the autograd graph (see _cast_by_graph): the edge (grad_fn, output_nr) of every
        # registered or tagged tensor -> (weakref to it, its version then)
        self.by_graph = False
        self.edges = {}
        self.pending = []  # (weakref, version) of tagged tensors without a node yet (_edge)
        self.learning = False  # watcher and graph both on: note casts the graph alone would miss
        self.cast_keys = set()  # storages of the casts the watcher registered or tagged
        self.shown = set()  # storages of the casts shown by `cast` (seen watched or not)
        self.unexplained = False

    # --- classes

    def tag(self, t, cls, if_untagged=False):
        if not self.classify:
            if self.by_graph:  # a tagged tensor is a source casts are followed to (_cast_by_graph)
                self._edge(t)
            return
        key = _key(t)
        if key is None or (if_untagged and self.class_of(t) != OTHER):
            return
        self.tags[key] = (weakref.ref(t), cls)
        if self.by_graph:
            self._edge(t)

    def class_of(self, t):
        key = _key(t)
        found = self.tags.get(key) if key is not None else None
        if found is None:
            return OTHER
        ref, cls = found
        alive = ref()
        if alive is None or storage_id(alive) != key:  # the tagged tensor died: its storage id may be reused
            del self.tags[key]
            return OTHER
        return cls

    # --- rebuild

    def register(self, y, rebuild):
        key, order = _key(y), _dense_order(y)
        if key is not None and order is not None:  # a subclass is kept as it is (view_of never finds one)
            rebuild.order = order
            self.outputs[key] = (y, y._version, rebuild)
            if self.by_graph:
                self._edge(y)

    def _edge(self, t):
        node = t.grad_fn
        if node is not None:
            self.edges[(node, t.output_nr)] = (weakref.ref(t), t._version)
        elif not t.is_leaf or not t.requires_grad:
            # an output tagged inside its own op (setup_context), before autograd gives it its node: noted when
            # a lookup misses (_settle)
            self.pending.append((weakref.ref(t), t._version))

    def _settle(self):
        """Notes the edges of tagged outputs that had no node yet when tagged."""
        waiting = []
        for ref, version in self.pending:
            t = ref()
            if t is None:
                continue
            if t.grad_fn is None:
                waiting.append((ref, version))
            else:
                self.edges[(t.grad_fn, t.output_nr)] = (ref, version)
        self.pending = waiting

    def _edge_of(self, edge):
        found = self.edges.get(edge)
        if found is None and self.pending:
            self._settle()
            found = self.edges.get(edge)
        return found

    def view_of(self, t):
        """A _View reading t back from a registered output, or None."""
        key = _key(t)
        entry = self.outputs.get(key) if key is not None else None
        if entry is None and self.casts:
            entry = self._promote_cast(t, key)
        if entry is None:
            return None
        y, version, rebuild = entry
        # y is held by the pipeline, so its storage cannot have been reused; the version guards in-place edits.
        if t.dtype != y.dtype or t._version != version or t.storage_offset() < y.storage_offset():
            return None
        return _View(rebuild, t.size(), t.stride(), t.storage_offset() - y.storage_offset())

    def _promote_cast(self, t, key):
        """Registers a cast of a kept tensor (not itself registered) as rebuilt from it, when that is
        no larger than the cast; the root is then held instead of the copy."""
        found = self.casts.get(key) if key is not None else None
        if found is None:
            return None
        cast_ref, root_ref, root_version, dtypes = found
        cast, root = cast_ref(), root_ref()
        if cast is None:
            return None
        if root is None or root._version != root_version:
            return None
        if root.element_size() > cast.element_size() and not isinstance(root, torch.nn.Parameter):
            return None  # holding the root would cost more than the copy; a parameter is held anyway
        rebuild = _Rebuild(_cast_chain, (root, dtypes))
        self.register(cast, rebuild)
        self.cast_keys.add(key)
        del self.casts[key]
        return self.outputs[key]

    def _cast_by_graph(self, t, register=True):
        """A _View rebuilding t when the autograd graph shows t is a dtype cast (aten._to_copy) of a registered
        output, of a tagged tensor no larger than t or of a parameter, the source unchanged since (its version);
        else None. Exact: the cast's node reads exactly that output of that node. Casts of tensors without
        grad_fn (frozen parameters, outputs computed without gradients) are not seen here: the watcher sees them.
        t may be a view of the cast (a matmul saves the transposed weight). With register=False: only whether it
        is such a cast."""
        saved = t
        if t._base is not None:
            t = t._base
        node = t.grad_fn
        if type(node) is not _TO_COPY_NODE:
            return None
        edge = node.next_functions[0]
        if edge[0] is None or _dense_order(t) is None or _key(t) is None:
            return None
        found = self._edge_of(edge)
        ops, shape = None, t.shape
        if found is None and type(edge[0]) in (_VIEW_NODE, _PERMUTE_NODE, _TRANSPOSE_NODE):
            # a cast of a view of a registered or tagged tensor (attention's o reshaped for the out projection)
            viewed = _viewed_through(edge[0], t.shape, self.edges)
            if viewed is not None:
                found, ops, shape = viewed
        if found is not None:
            root = found[0]()
            if root is None or root._version != found[1] or root.dtype == t.dtype or root.shape != shape \
                    or root.device != t.device:
                return None
            root_key = _key(root)
            if self.learning and root_key in self.cast_keys:
                return None  # a cast the watcher registered: the graph alone would not know it
            source = self.view_of(root) if root_key in self.outputs else None
            if source is None and not (root.element_size() <= t.element_size()
                                       or isinstance(root, torch.nn.Parameter)):
                return None
            if source is None and ops is None and not root.is_contiguous():
                return None
            if ops is not None:
                rebuild = _Rebuild(_replayed, (root if source is None else source, ops, t.dtype))
            elif source is not None:
                rebuild = _Rebuild(_cast, (source, t.dtype))
            else:
                rebuild = _Rebuild(_cast_chain, (root, (t.dtype,)))  # held instead of the copy, as _promote_cast
        elif type(edge[0]) is _ACCUMULATE_GRAD:
            root = edge[0].variable
            if not isinstance(root, torch.nn.Parameter) or root.dtype == t.dtype or root.shape != t.shape \
                    or root.device != t.device or not root.is_contiguous():
                return None
            rebuild = _Rebuild(_cast_chain, (root, (t.dtype,)))
        else:
            return None
        if not register:
            return True
        self.register(t, rebuild)
        return self.view_of(saved)

    def _learn(self, t):
        """With watcher and graph both on: notes a cast the watcher registered or classed that the graph alone
        would not have (then this layer keeps its watcher)."""
        self.view_of(t)  # registers a cast the watcher saw that is rebuilt from a kept root (_promote_cast)
        key = _key(t)
        if key not in self.cast_keys or key in self.shown:
            return
        if key in self.outputs and not self._cast_by_graph(t, register=False):
            self.unexplained = True
        elif self.classify and self._class_by_graph(t) != self.class_of(t):
            self.unexplained = True

    def _class_by_graph(self, t):
        """The class of a cast's source found through the graph (OTHER when none)."""
        t = t if t._base is None else t._base
        node = t.grad_fn
        if type(node) is not _TO_COPY_NODE:
            return OTHER
        edge = node.next_functions[0]
        found = self._edge_of(edge)
        if found is None and type(edge[0]) in (_VIEW_NODE, _PERMUTE_NODE, _TRANSPOSE_NODE):
            viewed = _viewed_through(edge[0], t.shape, self.edges)
            found = viewed[0] if viewed is not None else None
        root = found[0]() if found is not None else None
        return OTHER if root is None else self.class_of(root)

    def note_cast(self, src, out):
        """Called for every dtype cast while casts are watched: the cast carries src's class, and is rebuilt from
        src when src is a registered output."""
        if _dense_order(out) is None or _key(out) is None:
            return
        cls = self.class_of(src)
        if cls != OTHER:
            self.tag(out, cls)
            self.cast_keys.add(_key(out))
        view = self.view_of(src) if self.rebuilds else None
        if view is not None:
            self.register(out, _Rebuild(_cast, (view, out.dtype)))
            self.cast_keys.add(_key(out))
            return
        key = _key(src)
        if key is None:
            return
        prior = self.casts.get(key)
        if prior is not None and prior[0]() is None:
            prior = None  # a dead cast's storage reused by src: not a cast of that root
        root_ref, version, dtypes = (weakref.ref(src), src._version, ()) if prior is None else prior[1:]
        self.casts[_key(out)] = (weakref.ref(out), root_ref, version, (*dtypes, out.dtype))

    # --- the hooks

    def lookup(self, t):
        """A _View rebuilding t (a registered output, a view of one, or a cast the watcher or graph shows), or None."""
        if self.learning:
            self._learn(t)
        view = self.view_of(t)
        if view is None and self.by_graph and not self.learning:
            view = self._cast_by_graph(t)
        return view

    def pack(self, t):
        if not self.classify and (type(t) is _PARAMETER or type(t._base) is _PARAMETER):
            # a parameter or a view of one (a Linear saves its weight transposed) is never a registered output nor
            # a cast, and nothing reads its class: kept without a lookup (a third of what a layer saves)
            return t if t.grad_fn is None else t.detach()
        if self.rebuilds:
            view = self.lookup(t)
            if view is not None:
                return view
        elif self.learning:
            self._learn(t)
        if self.classify:  # else nothing reads the class (no engine, no observer)
            cls = self.class_of(t)
            if cls == OTHER and self.by_graph and not self.learning:
                cls = self._class_by_graph(t)
            if cls == OTHER and self.saving is not None:
                cls = self.saving
            if self.engine is not None and self.policy.action(cls) == "offload" and _offloadable(t):
                handle = self.engine.offload(t)
                if self.observer is not None:
                    self.observer.note(t, cls, handle)
                return _Offloaded(handle)
            if self.observer is not None:
                self.observer.note(t, cls, None)
        # A detached alias of a non-leaf, never t itself: a node saving its own output (attention's o and lse,
        # a norm's statistics) would otherwise hold that output, whose grad_fn is the node, in a cycle through
        # C++ that no garbage collector sees: a forward never followed by backward would keep its graph
        # forever. A leaf (a parameter, maybe a subclass whose detach would drop its attributes) has no grad_fn
        # to close a cycle and is kept as it is.
        return t.detach() if t.grad_fn is not None else t

    @staticmethod
    def unpack(packed):
        return packed.get() if isinstance(packed, (_View, _Offloaded)) else packed


def _offloadable(t):
    """A tensor the engine can copy and give back as it was: a plain strided activation, not a parameter."""
    return _key(t) is not None and not isinstance(t, torch.nn.Parameter)


def _cast_chain(root, dtypes):
    for dtype in dtypes:
        root = root.to(dtype)
    return root


class _CastWatcher(TorchDispatchMode):
    """Reports each dtype cast in the layer's forward to its pipeline (below autograd and autocast)."""

    def __init__(self, pipeline):
        super().__init__()
        self.pipeline = pipeline

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is _TO_COPY and type(out) in PLAIN_TENSOR_TYPES and args and isinstance(args[0], torch.Tensor):
            if out.dtype != args[0].dtype:
                self.pipeline.note_cast(args[0], out)
        return out


TRANSPARENT_MODES.add(_CastWatcher)  # it only observes: the ops' direct eager path may run under it


def _top_hooks():
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return None if top is None else top(False)


def autocast_on():
    return any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda"))


def needed(layer_policy, engine=None, registered=True):
    """Whether a layer under `layer_policy` needs its pipeline: it rebuilds registered outputs (`registered`: the
    layer's outputs are registered by discardable, not rebuilt by its own nodes), or its model offloads (every
    layer then marks where its forward begins)."""
    return (registered and resolve(layer_policy).recompute == "selective") or engine is not None


def _cast_signature(layer_input, current):
    """What decides which casts a layer's forward makes of what: autocast, whether gradients reach its input."""
    cast = tuple(torch.get_autocast_dtype(d) if torch.is_autocast_enabled(d) else None for d in ("cpu", "cuda"))
    grad = isinstance(layer_input, torch.Tensor) and layer_input.requires_grad
    return cast, grad, current.rebuilds, current.classify


@contextlib.contextmanager
def scope(policy="selective", engine=None, layer_input=None, watch_casts=None, registered=True, memo=None):
    """Runs one layer's forward inside its pipeline (see the module doc); yields the pipeline or None.

    `policy`: a mode or keeping.LayerPolicy; registered outputs are rebuilt when it rebuilds "norm_act".
    `engine`: the model's offload engine (keeping.offload.OffloadEngine), used for the classes the policy
    offloads. `layer_input`: the layer's input x, of class "input". `watch_casts`: also follow dtype casts
    (default: whenever autocast is on). `memo`: a dict the caller keeps per layer, which lets the pipeline follow
    casts through the autograd graph instead of watching every op (a dispatch mode costs a Python call per op):
    the first call of each kind (autocast, gradients to the input, policy) watches and notes whether the graph
    shows every cast it saw; later calls of that kind watch only if it did not (casts of frozen parameters and
    of outputs without gradients have no graph node). `registered=False`: the layer's own nodes rebuild what the policy
    rebuilds (SelectiveDecoderLayer), so the pipeline only classifies and offloads. A no-op when the policy
    needs no pipeline, when gradients are off,
    under torch.compile and inside another saved-tensor hook context than an observer's. Pipelines do not
    nest: an inner one takes over until it exits.
    """
    layer_policy = resolve(policy)
    if layer_policy.offloaded and engine is None:
        raise RuntimeError(f"the layer's policy ({layer_policy}) offloads but the layer has no offload engine: apply "
                           "the policy with selective_ckpt.set_recompute(model, policy) on this model (an engine "
                           "belongs to one process and model; copies and pickles of a model do not carry it)")
    watching = getattr(_state, "observer", None)  # a ledger classifies what every layer keeps
    wanted = needed(layer_policy, engine, registered) or watching
    if not wanted or not torch.is_grad_enabled() or torch.compiler.is_compiling():
        yield None
        return
    observer = None
    top = _top_hooks()
    if top is not None:
        observer = watching
        if observer is None or top[0] != observer.pack:
            yield None
            return
    current = _LayerPipeline(layer_policy, engine, observer, registered)
    if engine is not None:
        engine.begin_layer()
    if isinstance(layer_input, torch.Tensor):
        current.tag(layer_input, "input")
    previous = getattr(_state, "pipeline", None)
    _state.pipeline = current
    if watch_casts is None:
        watch_casts = autocast_on()
    signature = None
    if watch_casts and memo is not None:
        signature = _cast_signature(layer_input, current)
        known = memo.get(signature)
        if known is None:  # the first call of this kind: watcher and graph both, compared at each save
            current.by_graph = current.learning = True
        elif not known:
            current.by_graph, watch_casts = True, False
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(current.pack, current.unpack))
            if watch_casts:
                stack.enter_context(_CastWatcher(current))
            yield current
        if current.learning:
            memo[signature] = current.unexplained
    finally:
        _state.pipeline = previous
        current.outputs.clear()  # the pipeline's references to the outputs end with the forward
        current.casts.clear()
        current.tags.clear()
        current.edges.clear()
        current.pending.clear()
        current.shown.clear()


@contextlib.contextmanager
def observe(recorder):
    """Lets pipelines run under the saved-tensor hooks whose pack is `recorder.pack` (a measuring tool's): a
    pipeline entered inside then calls `recorder.note(t, cls, handle)` for every tensor it keeps (handle: the
    offload engine's for an offloaded one, else None), and for none that it drops."""
    previous = getattr(_state, "observer", None)
    _state.observer = recorder
    try:
        yield
    finally:
        _state.observer = previous


# While dynamo traces a converted layer's training forward: whether its policy rebuilds norm_act (set by the layer,
# read by the patched norms and activations, which then run in checkpoint regions: compiled_rebuilds)
_COMPILED_REBUILDS = [False]


def compiled_rebuilds():
    """Whether a norm or activation output traced now is one the layer's policy rebuilds: under torch.compile the
    pipeline's hooks stand aside, so the patched forwards put such outputs in checkpoint regions and the compiled
    backward recomputes them (the partitioner alone keeps a custom op's output)."""
    return torch.compiler.is_compiling() and torch.is_grad_enabled() and _COMPILED_REBUILDS[0]


def _current():
    # None while dynamo traces: no pipeline is entered there (scope), and a traced graph must not read one an eager
    # caller entered around it (its storage ids and dicts cannot be traced; the compiled graph decides what it keeps)
    if torch.compiler.is_compiling():
        return None
    return getattr(_state, "pipeline", None)


def discardable(y, rebuild, *args):
    """Registers y as a norm or activation output, rebuilt by `rebuild(*args)` (bit-identical, under no_grad)
    when the layer's policy rebuilds those, if a pipeline is active. Returns y. y is contiguous or a
    permutation of a contiguous tensor (else it is kept).

    `args` should be tensors the producing op keeps for its own backward anyway (its input and
    statistics), or `source(x)` handles, so the placeholder costs nothing.
    """
    current = _current()
    if current is not None and isinstance(y, torch.Tensor) and torch.is_grad_enabled():
        if _dense_order(y) is None:
            return y
        current.tag(y, "norm_act")
        if current.rebuilds:
            current.register(y, _Rebuild(rebuild, args))
    return y


def _dense_order(y):
    """() for a contiguous y; the permutation that makes a dense permuted y contiguous (RoPE's output on a
    transposed q is [B, H, S, D] over [B, S, H, D] memory); None for any other layout."""
    if y.is_contiguous():
        return ()
    order = tuple(sorted(range(y.dim()), key=lambda d: (-y.stride(d), d)))
    return order if y.permute(order).is_contiguous() else None


def cast(t, dtype):
    """`t.to(dtype)`, shown to the active pipeline as the watcher shows a cast (its class; rebuilt from t when t is
    dropped, or from a parameter): for code that makes autocast's casts itself, so that a cast without a graph
    node (of a frozen parameter, or of an output without gradients) needs no watcher. Such a cast is seen at
    every call, watched or not, so a learning call does not count it among the casts only the watcher sees."""
    out = t.to(dtype)
    current = _current()
    if current is not None and out is not t and type(out) in PLAIN_TENSOR_TYPES:
        current.note_cast(t, out)
        if current.learning:
            current.shown.add(_key(out))
    return out


def note_kept(t, cls):
    """Shows an observing ledger a tensor kept outside the saved-tensor hooks (attention's outputs cached by the
    attention-kept checkpoint)."""
    if torch.compiler.is_compiling():
        return
    observer = getattr(_state, "observer", None)
    if observer is not None:
        observer.note(t, cls, None)


def source(x):
    """What a producer should hold to read x in backward: a rebuild handle when x is (a cast of) a
    dropped output, else x itself."""
    current = _current()
    if current is None or not current.rebuilds or not isinstance(x, torch.Tensor):
        return x
    view = current.lookup(x)
    return x if view is None else view


def tag(t, cls, if_untagged=False):
    """Names t's class (keeping.policy.CLASSES) for the active pipeline, if any; `if_untagged`: only when no class
    was named for its storage yet. Returns t."""
    current = _current()
    if current is not None and isinstance(t, torch.Tensor):
        current.tag(t, cls, if_untagged)
    return t


def saving_as(cls):
    """Names the class of the tensors saved from now on that have none (neither tagged nor followed to a source),
    for code that cannot tag what an op saves before it saves it (the outputs of an aten op under its own autograd
    node); `saving_as(previous)` ends it. Returns the previous such class (None: none named, or no pipeline)."""
    current = _current()
    if current is None:
        return None
    previous, current.saving = current.saving, cls
    return previous


def observed():
    """Whether an observer (memory.ledger) is watching what pipelines keep on this thread."""
    return getattr(_state, "observer", None) is not None


def entered():
    """Whether a layer pipeline is entered on this thread (tags and save classes have a reader)."""
    return _current() is not None


def active():
    """Whether outputs registered now would be dropped (a rebuilding pipeline is active on this thread)."""
    current = _current()
    return current is not None and current.rebuilds
