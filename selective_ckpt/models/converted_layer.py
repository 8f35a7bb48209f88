"""The converted Hugging Face decoder layer's runtime: its policy, its forward, its patches kept current.

`convert_decoder_layer` gives a transformers decoder layer a ConvertedLayerState (what set_recompute
sets) and wraps its forward in its pipeline (keeping.pipeline); a layer under transformers' checkpointing
stays "full". Making a converted model's patches current after convert happens here only: a layer at
every training call (`ConvertedLayerState.make_current`: an adapter added, removed or swapped since, a
forward replaced), and so a loaded or copied layer at its first call (whose loading registers our
attention again); transformers' kernelization through `make_patches_current` (models/hub_kernels.py).
"""

import contextlib
import functools
import logging
import warnings
import weakref

import torch
from torch.utils.checkpoint import checkpoint

from .. import compat
from ..keeping import layer_tiles, pipeline
from ..keeping.attention_kept import attention_kept_checkpoint
from ..keeping.policy import CHECKPOINTED, NAMED, resolve
from ..memory.estimate import KEPT_MIXER
from ..registry import STATE
from . import attention, fused_layer
from .errors import ConversionError
from .patches import MLP_TILES, runs_in_tiles
from .patching import PATCH, PATCHED, patch_forward, replaced, restore_patches
from .peft import plan_adapters, unknown_modules


class ConvertedLayerState:
    """The policy of a converted Hugging Face decoder layer (what set_recompute sets): what it keeps, offloads
    and rebuilds (keeping.policy), and the model's offload engine when the policy offloads.

    "selective": norm and activation outputs are dropped and rebuilt (the layer's keeping.pipeline);
    "none": they are kept; "full": transformers' own gradient checkpointing of the layer (so
    `model.gradient_checkpointing_enable()` reads as "full" on every layer), its input offloaded when the
    policy says so.
    """

    def __init__(self, layer, mode, shape_of=None, name=None, mlp=None):
        self.layer = layer
        self.engine = None  # the model's keeping.offload.OffloadEngine while a policy offloads
        self.name = name or type(layer).__name__
        self.mlp_child = mlp  # the name of the layer's MLP child, which runs in the policy's mlp_tiles tiles
        self.recompute = mode
        self._shape_of = shape_of
        self.seen = None  # weak references to the layer's modules when make_current last looked (None: never)
        self.patched = ()  # weak references to the patched modules among them, whose forwards make_current checks
        self.warned = False  # the warning about modules selective_ckpt does not know was given
        self.modes = None  # the model's ModeAnnouncement, shared by its layers
        # keeping.pipeline.scope's memo: which kinds of call show every dtype cast in the autograd graph. The
        # layer's modules and its parameters' dtypes and requires_grad decide it: cleared when they change
        self.cast_memo = {}
        self.cast_key = None  # the parameters' (dtype, requires_grad) the memo was learned under
        self.layout = None  # the fused layout's modules (models/fused_layer.py) when make_current last looked

    def watch_casts(self, params=None):
        """Whether the layer's forward casts between dtypes (autocast, or floating parameters of several
        dtypes: fp32 adapters or norms beside a 16-bit base), so casts of dropped outputs are watched and
        rebuilt too (keeping.pipeline). A quantized base's integer weights do not count: its matmul keeps
        nothing of its input (4-bit), or convert drops what it keeps (8-bit), and watching costs a Python
        dispatch per op (6 of the 14 ms of CPU time a small QLoRA step added). Its bias does: bitsandbytes
        casts it to the compute dtype in place at the first forward. `params`: the layer's parameters when
        the caller has just listed them."""
        if pipeline.autocast_on():
            return True
        if params is None:
            params = _parameters_of(_modules_of(self.layer))
        dtypes = {p.dtype for p in params if p.is_floating_point()}
        return len(dtypes) > 1

    def memo_for(self, params):
        """The cast memo (keeping.pipeline.scope) for the layer's parameters as they are now: a new one when a
        parameter's dtype or requires_grad changed since the memo was learned (a cast of a frozen parameter has
        no graph node; freezing or unfreezing changes which casts the graph shows)."""
        key = [(p.dtype, p.requires_grad) for p in params]
        if key != self.cast_key:
            self.cast_memo, self.cast_key = {}, key
        return self.cast_memo

    def shape(self):
        """The layer's LayerShape fields (memory.planner), its parameters' dtype included."""
        if self._shape_of is None:
            raise ValueError(f"{type(self.layer).__name__}: the shape of this converted layer is not known")
        return {**self._shape_of(self.layer), "dtype": next(self.layer.parameters()).dtype}

    @property
    def policy(self):
        """The layer's keeping.LayerPolicy; "full" whenever transformers' checkpointing is on for the layer (and
        not the attention-kept checkpoint this policy installed)."""
        layer, mode = self.layer, self._policy.recompute
        if getattr(layer, "gradient_checkpointing", False):
            func = compat.layer_checkpoint_function(layer)
            ours = (mode == "full" and (self._policy.layer_tiles == 1 or layer_tiles.is_layer_tiles(func))) or (
                mode == "attention-kept" and func is attention_kept_checkpoint)
            return self._policy if ours else NAMED["full"]
        return self._policy if mode not in CHECKPOINTED else NAMED["selective"]

    @policy.setter
    def policy(self, value):
        value = resolve(value)
        mlp = self._mlp_running_in(value.mlp_tiles)  # refused before anything changes
        self._check_layer_tiles(value.layer_tiles)
        if mlp is not None:
            # on the MLP module itself: the layer's re-run in backward (transformers' checkpoint of the class's
            # forward) calls it without passing through this layer's wrapper
            setattr(mlp, MLP_TILES, value.mlp_tiles)
        self.full_asked = value.recompute in CHECKPOINTED  # not transformers' checkpointing switched on around us
        layer = self.layer
        current = compat.layer_checkpoint_function(layer)
        ours = current is attention_kept_checkpoint or layer_tiles.is_layer_tiles(current)
        if ours:  # the user's checkpoint function is back when the policy no longer installs ours
            current = getattr(self, "replaced_checkpoint", None)
            compat.set_layer_checkpoint_function(layer, current)
        if value.recompute == "attention-kept" or value.layer_tiles > 1:
            self.replaced_checkpoint = current
            installed = (attention_kept_checkpoint if value.recompute == "attention-kept"
                         else layer_tiles.checkpoint_for(value.layer_tiles))
            compat.set_layer_checkpoint_function(layer, installed)
        elif value.recompute == "full" and current is None:
            compat.set_layer_checkpoint_function(layer, functools.partial(checkpoint, use_reentrant=False))
        layer.gradient_checkpointing = self.full_asked
        self._policy = value

    def _mlp_running_in(self, tiles):
        """The layer's MLP module (None where convert did not name it), or the ValueError naming the layer when
        `tiles` > 1 and its MLP's forward does not run in tiles."""
        name = getattr(self, "mlp_child", None)
        mlp = getattr(self.layer, name, None) if name else None
        if tiles == 1 or (mlp is not None and runs_in_tiles(vars(mlp).get(PATCH))):
            return mlp
        asked = f"{self.name}: the policy's mlp_tiles={tiles}"
        if mlp is None:
            raise ValueError(f"{asked} cannot apply: this layer's MLP is not known (convert the model again)")
        if hasattr(mlp, "experts"):
            raise ValueError(f"{asked} cannot apply: its MLP {self.mlp_child} ({type(mlp).__name__}) is a mixture of "
                             "experts, and mixture-of-experts MLPs are not run in tiles; give this layer a policy "
                             "with mlp_tiles=1")
        raise ValueError(f"{asked} cannot apply: its MLP {self.mlp_child} ({type(mlp).__name__}) has a forward that "
                         "does not run in tiles; give this layer a policy with mlp_tiles=1")

    def _check_layer_tiles(self, tiles):
        """The ValueError naming the layer when `tiles` > 1 and the layer cannot run in query tiles: a mixture of
        experts (transformers collects its router logits once per call of the router, which tiles would split)."""
        if tiles == 1:
            return
        mixer = next((m for m in self.layer.children() if getattr(m, KEPT_MIXER, None)), None)
        if mixer is not None:  # a hybrid's recurrent mixer (models/hybrid.py): a tile would start it anew
            raise ValueError(f"{self.name}: the policy's layer_tiles={tiles} cannot apply: its token mixer "
                             f"{type(mixer).__name__} is recurrent and kept as transformers' own; give this layer "
                             "layer_tiles=1")
        name = getattr(self, "mlp_child", None)
        mlp = getattr(self.layer, name, None) if name else None
        if mlp is not None and hasattr(mlp, "experts"):
            raise ValueError(f"{self.name}: the policy's layer_tiles={tiles} cannot apply: its MLP {name} "
                             f"({type(mlp).__name__}) is a mixture of experts, whose router logits transformers "
                             "collects per call; give this layer mlp_tiles instead")

    @property
    def recompute(self):
        return self.policy.recompute

    @recompute.setter
    def recompute(self, mode):
        self.policy = mode

    def make_current(self):
        """Makes the layer's patches current when its modules changed since it last looked, or a patched forward
        was replaced (`kernels.kernelize` called on the model after convert): puts the patched forwards back
        (warned), patches the LoRA dropouts and 8-bit Linears that are new (models/peft.py), and warns once
        about modules selective_ckpt does not know. Modules are compared by identity, so an adapter deleted
        and another of the same size added is seen too; held weakly, so a deleted adapter is freed. A change of
        modules clears the cast memo. Returns the layer's modules."""
        modules = _modules_of(self.layer)
        seen = self.seen
        if seen is not None and list(map(weakref.ref, modules)) == seen and not self._patch_replaced():
            return modules
        restored = restore_patches(self.layer)
        if restored:
            warnings.warn(f"selective_ckpt: {self.name}: the forwards of {', '.join(restored)} were replaced after "
                          "convert (hub kernels' kernelize?); the converted forwards are put back", stacklevel=3)
        for module, forward in plan_adapters(self.layer, self.name):
            if getattr(module, PATCHED, None) is None:
                patch_forward(module, forward)
        unknown = unknown_modules(self.layer)
        if unknown and not self.warned:
            warnings.warn(f"selective_ckpt: {self.name} holds modules it does not know: {', '.join(unknown)}; what "
                          "they save for backward is kept as they save it (their inputs may not be rebuilt)",
                          stacklevel=3)
            self.warned = True
        self.cast_memo, self.cast_key = {}, None
        self.layout = fused_layer.layout_of(self.layer)
        # weak references compare equal while both referents live and are the same object; a dead one only to
        # itself (weakref.ref hands back the one plain reference an object has, so the next call's list matches)
        self.seen = [weakref.ref(m) for m in modules]
        self.patched = tuple(weakref.ref(m) for m in modules if PATCH in m.__dict__)
        return modules

    def _patch_replaced(self):
        """Whether a module patched at the last look is gone or its patched forward replaced (a loop, not generators:
        this runs at every training call)."""
        for ref in self.patched:
            m = ref()
            if m is None or replaced(m):
                return True
        return False

    def __getstate__(self):
        state = dict(self.__dict__)
        state["engine"] = None  # streams and pinned host memory belong to a process: set_recompute makes anew
        # weak references do not travel: the copy looks again at its first call
        state["seen"], state["patched"] = None, ()
        state["cast_memo"], state["cast_key"] = {}, None
        state["layout"] = None
        return state

    def __setstate__(self, state):
        """A loaded (or copied) layer: the model's config names our attention function, which a fresh process
        has not registered yet."""
        self.__dict__.update({"patched": (), "cast_memo": {}, "cast_key": None, "layout": None, **state})
        attention.register()


def _modules_of(layer):
    """The layer's modules, the layer first, breadth first (a module held twice is listed twice): a walk cheap
    enough for every training call (`modules()` names each module on the way)."""
    out, i = [layer], 0
    while i < len(out):
        m = out[i]
        if m is not None:
            out.extend(m._modules.values())
        i += 1
    return [m for m in out if m is not None] if None in out else out


def _parameters_of(modules):
    return [p for m in modules for p in m._parameters.values() if p is not None]


@contextlib.contextmanager
def _attention_reads_own_kv(caches):
    """While active, a cache update that holds nothing but this call's k, v hands back k, v themselves.

    A training forward with use_cache=True (transformers' default) fills a kv cache; its update
    returns concatenated copies, and attention would save those for backward on top of the
    layer's own k, v (GPT-2's are views of c_attn's output, which q keeps alive anyway: 2h
    elements per token more). When the result has the input's shape the cache held nothing
    before, so the copies equal k, v bit for bit: attention gets the originals, the cache keeps
    its copies, and what a layer keeps is the floor again.
    """
    patched = []
    for cache in caches:
        update = cache.update

        def own(key_states, value_states, *a, _update=update, **kw):
            k, v = _update(key_states, value_states, *a, **kw)
            if k.shape == key_states.shape and v.shape == value_states.shape:
                return key_states, value_states
            return k, v

        cache.update = own
        patched.append(cache)
    try:
        yield
    finally:
        for cache in patched:
            del cache.update  # the instance attribute; the class's method shows again


def _without_caches(args, kwargs):
    """The layer's arguments with every kv cache replaced by None and use_cache=False."""
    from transformers.cache_utils import Cache

    args = tuple(None if isinstance(a, Cache) else a for a in args)
    kwargs = {k: (None if isinstance(v, Cache) else v) for k, v in kwargs.items()}
    kwargs["use_cache"] = False
    return args, kwargs


# The modes whose forward the fused layout's fast path runs (fused_layer.py): what they keep is what its nodes keep.
# "full" and "attention-kept" run transformers' checkpoint of the class's forward instead.
_FUSED_MODES = ("selective", "none")


def _decoder_layer_forward(self, *args, **kwargs):
    state = getattr(self, STATE)
    policy = state.policy
    mode = policy.recompute
    grad = torch.is_grad_enabled()
    if torch.compiler.is_compiling():
        # Traced by dynamo: AOTAutograd decides what the graph keeps (the pipeline stands aside there), and the
        # eager bookkeeping (modules compared by weak reference, the announcement's logger, the kv cache's update
        # swapped per call) would break the graph at every layer. Patches are made current by eager calls.
        if mode in CHECKPOINTED and self.training and grad:
            args, kwargs = _without_caches(args, kwargs)
        rebuilds = pipeline._COMPILED_REBUILDS
        previous, rebuilds[0] = rebuilds[0], policy.recompute == "selective" and self.training and grad
        try:
            return getattr(self, PATCHED)(*args, **kwargs)
        finally:
            rebuilds[0] = previous
    modules = None
    if grad and self.training:
        modules = state.make_current()
        if state.modes is not None:
            state.modes.announce()
        if state.layout is not None and mode in _FUSED_MODES and len(args) <= 1:
            x = args[0] if args else kwargs.get("hidden_states")
            store = mode == "none"
            lora = fused_layer.applies(state.layout, x, kwargs, store)
            if lora is not None:
                kwargs.pop("hidden_states", None)
                if state.engine is None and not pipeline.observed():
                    return fused_layer.fused_forward(state.layout, store, lora, x, **kwargs)
                # the pipeline only classifies here (for the offload engine or an observing ledger): the fused nodes
                # rebuild what the policy rebuilds themselves
                with pipeline.scope(policy, state.engine, layer_input=x, watch_casts=False, registered=False):
                    return fused_layer.fused_forward(state.layout, store, lora, x, **kwargs)
    caches = []
    if grad:
        from transformers.cache_utils import Cache
        caches = [c for c in (*args, *kwargs.values()) if isinstance(c, Cache) and "update" not in vars(c)]
    if mode in CHECKPOINTED and self.training and grad:
        # The checkpointed re-run would append to a kv cache twice (transformers drops only a
        # keyword `cache`; GPT-2 passes it by position): a checkpointed layer fills none.
        args, kwargs = _without_caches(args, kwargs)
        caches = []
    # Under "full" the layer's forward is checkpointed inside (transformers wraps the class's forward), and the
    # pipeline sees only the checkpoint's saved inputs: the layer input, offloaded when the policy says so.
    x = args[0] if args else kwargs.get("hidden_states")
    watch, memo = False, None
    # "none" keeps everything where it is made, so the casts consumers make of norm outputs (autocast's, PEFT's) are
    # what it keeps of them: watched when the policy offloads by class, so they carry their source's class
    if (mode == "selective" or (mode == "none" and policy.offloaded)) and grad:
        params = None
        if not pipeline.autocast_on():
            params = _parameters_of(modules or _modules_of(self))
        watch = state.watch_casts(params)
        if watch:
            memo = state.memo_for(params or _parameters_of(modules or _modules_of(self)))
    keeping = pipeline.scope(policy, state.engine, layer_input=x, watch_casts=watch, memo=memo)
    with keeping, _attention_reads_own_kv(caches):
        return getattr(self, PATCHED)(*args, **kwargs)


class ModeAnnouncement:
    """Says once, at a model's first training step, which recompute mode its layers run.

    Gradient checkpointing switched on after convert (TRL's SFTConfig does so by default, as does
    Trainer with gradient_checkpointing=True) turns converted layers "full", which costs a second
    forward; that is a warning naming the way back. Modes asked of us (convert's recompute, set_recompute, a
    plan; "full" included) are one info line on the selective_ckpt logger.
    """

    def __init__(self, states):
        self.states, self.done = states, False

    def announce(self):
        if self.done:
            return
        self.done = True
        counts = {}
        for s in self.states:
            counts[s.recompute] = counts.get(s.recompute, 0) + 1
        said = ", ".join(f'{n} "{m}"' for m, n in sorted(counts.items()))
        log = logging.getLogger("selective_ckpt")
        # "full" asked of us (convert's recompute, set_recompute, a plan) is the user's choice: said, not warned
        if any(s.recompute in CHECKPOINTED and not s.full_asked for s in self.states):
            log.warning(f"selective_ckpt: decoder layers run {said}: \"full\" re-runs a layer's forward in "
                        "backward (gradient checkpointing is on). For selective recompute at no such cost, train "
                        "with activation_checkpointing=False (gradient_checkpointing=False on older transformers; "
                        "TRL's SFTConfig turns it on by default); for a budget, "
                        "selective_ckpt.set_recompute(model, plan) or transformers' "
                        "activation_checkpointing_kwargs={'every_n_layers': k}")
        else:
            log.info(f"selective_ckpt: decoder layers run {said}")


def announce_modes(layers):
    """Gives the converted `layers` of one model one shared ModeAnnouncement."""
    modes = ModeAnnouncement([getattr(layer, STATE) for layer in layers])
    for state in modes.states:
        state.modes = modes


def convert_decoder_layer(layer, mode, shape_of=None, name=None, mlp=None):
    """Wraps the layer's forward in its pipeline (keeping.pipeline) under its policy; modules and parameters stay.
    `mlp`: the name of the layer's MLP child, given the policy's tile count (keeping.tiling).

    A layer under transformers' checkpointing before convert (`gradient_checkpointing_enable()`,
    `activation_checkpointing_enable(every_n_layers=k)`, peft's `prepare_model_for_kbit_training`) stays
    "full" with the checkpoint function the user chose (reentrant or not, offloaded or not): giving it `mode`
    clears the flag, so it is set back, and warned of as checkpointing switched on after convert is."""
    if not hasattr(type(layer), "gradient_checkpointing"):
        raise ConversionError(f"{type(layer).__name__} is not a transformers GradientCheckpointingLayer")
    checkpointed = getattr(layer, "gradient_checkpointing", False)
    state = ConvertedLayerState(layer, mode, shape_of, name, mlp)
    if checkpointed:
        state.recompute = "full"
        state.full_asked = False  # transformers' checkpointing, as one switched on after convert: warned of
    setattr(layer, STATE, state)
    patch_forward(layer, _decoder_layer_forward)


def make_patches_current(root):
    """Makes every patch under `root` current after transformers' kernelization (models/hub_kernels.py), silently:
    puts back the patched forwards it replaced or dropped, in converted decoder layers and outside them (the
    final norm). Each converted layer checks its adapters itself at its next training call
    (ConvertedLayerState.make_current). Returns the names of the modules whose forwards were put back."""
    return restore_patches(root)
