"""The contract a model meets for jaxaccel, and what its blocks may ask of the running step.

A model is a flax ``nnx.Module``,
``model(inputs_BT, positions=positions_BT, segment_ids=segment_ids_BT) -> logits [B, T, V]``,
that holds its transformer blocks in one ``Stack`` and calls it once:

    self.blocks = nn.Stack([Block(...) for _ in range(n_layers)])
    x_BTD = self.blocks(x_BTD, positions=positions_BT, segment_ids=segment_ids_BT)

The stack calls ``block(x_BTD, **token_args) -> x_BTD`` for each block. Every keyword argument is
None or an array [B, T, ...], so a technique may run a block on some rows (stochastic depth) or
tokens (token dropping) by gathering them; ``segment_ids`` (0 on padding) is the one it reads by
name. Block techniques act on the stack, never on the model's code: ``remat`` scans it,
``stochastic_depth`` and ``token_drop`` add a ``BlockTransform``, ``stacking`` grows it,
``pipeline`` slices it.

The runtime sets ``step(...)`` (the PRNG key, None in evaluation, and the batch) around the model's
call. A block that draws random numbers takes ``layer_key()``, the key folded with its layer index;
``nnx.Dropout`` streams are reseeded from it unasked. ``tag(x, name)`` names a tensor remat
policies may keep (``TAGS``: those ``jaxaccel.techniques.remat``'s use; ``--remat save:NAME,NAME``
takes any). Technique state that is not a trained weight is a ``Buffer``, updated by its module's
``update`` hook (``Updated``).
"""

import contextlib
import contextvars
import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

# The tensors jaxaccel's remat policies name (jaxaccel.techniques.remat), and their shapes in its
# GPT.
QUERY = "query"                   # q after the rotary embedding, [B, T, H, E]
KEY = "key"                       # k after the rotary embedding, [B, T, K, E]
VALUE = "value"                   # v, [B, T, K, E]
ATTENTION_OUT = "attention_out"   # attention's output before the output projection
MLP_IN = "mlp_in"                 # the MLP's first matmul, [B, T, F]
MLP_GATE = "mlp_gate"             # SwiGLU's gate matmul, [B, T, F]
TAGS = (QUERY, KEY, VALUE, ATTENTION_OUT, MLP_IN, MLP_GATE)


def tag(x, name: str):
    """``x`` named ``name`` for remat policies (``jax.ad_checkpoint.checkpoint_name``)."""
    return checkpoint_name(x, name)


class Buffer(nnx.Variable):
    """Technique state checkpointed, sharded and grown with the weights, never trained."""


class Observation(Buffer):
    """A buffer whose cotangent is an observation for ``update`` (FP8's amaxes), not a gradient."""


class Tuned(nnx.Param):
    """A weight a fine-tune adds (adapters): a model holding any trains only those."""


def trainable(state):
    """What trains in ``state``: its ``Tuned`` and ``nnx.LoRAParam`` variables when it holds any
    (a fine-tune), else every ``nnx.Param``; never a buffer."""
    tuned = (Tuned, nnx.LoRAParam)
    leaves = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.Any(*tuned) if any(isinstance(v, tuned) for v in leaves) else nnx.Param


def count_weights(state) -> tuple[int, int]:
    """(trainable, total) weights of a model's state (buffers are neither)."""
    def size(part):
        return sum(x.size for x in jax.tree.leaves(part))
    return size(nnx.filter_state(state, trainable(state))), size(nnx.filter_state(state, nnx.Param))


class Updated:
    """A module whose ``update(step, stats, observed)`` changes its buffers after each step:
    ``stats`` sums its optional ``loss_stats(logits_BTV, batch)`` over microbatches, ``observed``
    is its ``Observation`` buffers' cotangents (a State) or None."""

    def loss_stats(self, logits_BTV, batch):
        return None

    def update(self, step, stats, observed):
        raise NotImplementedError


def updated_modules(model) -> list[tuple[tuple, "Updated"]]:
    return [(p, n) for p, n in nnx.iter_graph(model) if isinstance(n, Updated)]


def loss_stats(model):
    """``stats(state, logits_BTV, batch) -> {path: stats}`` of ``model``'s ``Updated`` modules
    (the loss's ``aux["buffer_stats"]``), or None when none gives any."""
    if not any(type(m).loss_stats is not Updated.loss_stats for _, m in updated_modules(model)):
        return None
    graphdef = nnx.graphdef(model)

    def stats(state, logits_BTV, batch):
        found = {"/".join(map(str, p)): m.loss_stats(logits_BTV, batch)
                 for p, m in updated_modules(nnx.merge(graphdef, state))}
        return {k: v for k, v in found.items() if v is not None}

    return stats


def updater(model):
    """``update(state, step, stats) -> state`` running every ``Updated`` module's ``update``
    (``stats``: ``{"buffer_stats": {path: ...}, "observed_max": ...}``), or None if none."""
    if not updated_modules(model):
        return None
    graphdef = nnx.graphdef(model)

    def update(state, step, stats):
        model = nnx.merge(graphdef, state)
        observed = stats.get("observed_max")
        for path, module in updated_modules(model):
            mine = observed
            for key in path:
                mine = mine.get(key) if mine is not None and hasattr(mine, "get") else None
            module.update(step, stats.get("buffer_stats", {}).get("/".join(map(str, path))), mine)
        return nnx.state(model)

    return update


# ---------------------------------------------------------------------------------------------
# The step's context.

@dataclasses.dataclass(frozen=True)
class Step:
    """What the runtime tells the blocks: the key (None in evaluation), the batch, a pipeline
    stage's layers (``first_layer`` of ``total_layers``), a ``stack(stack, x, token_args)`` to run
    in the stack's place (``jaxaccel.model.contract.parts``), and the ``compute_dtype`` of a 16-bit
    policy (``precision.cast``: the model's flax layers compute in it, ``compute_in``)."""

    key: Any = None
    batch: Any = None
    first_layer: int = 0
    total_layers: int | None = None
    stack: Callable | None = None
    compute_dtype: Any = None


_STEP = contextvars.ContextVar("jaxaccel_step", default=Step())
_LAYER_KEY = contextvars.ContextVar("jaxaccel_layer_key", default=None)


@contextlib.contextmanager
def step(**fields):
    """Run the model inside this context: ``with nn.step(key=key, batch=batch): model(...)``."""
    token = _STEP.set(dataclasses.replace(_STEP.get(), **fields))
    try:
        yield
    finally:
        _STEP.reset(token)


def current() -> Step:
    return _STEP.get()


def layer_key():
    """The running block's PRNG key: the step's folded with its layer index (None in evaluation)."""
    return _LAYER_KEY.get()


def compute_in(model, dtype) -> int:
    """Set ``dtype`` on ``model``'s flax layers whose ``dtype`` is None (infer), in place; how many.
    Such a layer computes in the dtype of its inputs and variables, and a float32 input (flax's
    ``nnx.Embed`` returns its table's float32) would keep every later matmul in float32."""
    changed = 0
    for _, module in nnx.iter_graph(model):
        if isinstance(module, nnx.Module) and hasattr(module, "param_dtype") and \
                getattr(module, "dtype", "missing") is None:
            module.dtype = jnp.dtype(dtype)
            changed += 1
    return changed


def in_step_dtype(model):
    """``model`` (a module just merged from its state) with ``compute_in`` applied for the
    step's ``compute_dtype``, if one is set: what a pure function of the state calls."""
    dtype = current().compute_dtype
    if dtype is not None:
        compute_in(model, dtype)
    return model


# ---------------------------------------------------------------------------------------------
# The stack of blocks.

class BlockTransform(nnx.Module):
    """A block technique on a ``Stack``: per layer a static ``variant`` (stochastic depth's kept
    rows) and ``wrap`` around ``fn(state, x, token_args, index) -> x`` (lower ``order``: closer
    to the block); ``span`` and ``run_span`` run a range of layers differently (token dropping)."""

    order = 0
    # The setting that installs it, when it runs a block on part of x and puts the result back
    # into x (each block must then keep x's shape): checked as the stack runs, one line naming it.
    field = None

    def variant(self, layer: int, total: int, rows: int, training: bool):
        return None

    def wrap(self, fn, variant, scanned: bool):
        return fn

    def span(self, first: int, count: int, total: int, seq_len: int, training: bool):
        """``(lo, hi)``: the local layers lo .. hi - 1 that ``run_span`` runs, or None."""
        return None

    def run_span(self, run, x, token_args: dict):
        """``run(x, token_args)`` (the span's layers) on ``x`` as this technique runs them."""
        return run(x, token_args)


class Stack(nnx.Module):
    """A model's blocks, run in order by ``stack(x, **token_args)``: ``layers`` is an ``nnx.List``,
    or once scanned one block with variables stacked on a leading layer axis."""

    def __init__(self, blocks):
        blocks = list(blocks)
        if not blocks:
            raise ValueError("a Stack needs at least one block")
        self.layers = nnx.List(blocks)
        self.scanned = False
        self.transforms = nnx.List([])

    def __len__(self) -> int:
        if self.scanned:
            return jax.tree.leaves(nnx.state(self.layers))[0].shape[0]
        return len(self.layers)

    def blocks(self) -> list:
        """The blocks as modules (a scanned stack's, sliced out of its stacked variables)."""
        if not self.scanned:
            return list(self.layers)
        graphdef, state = nnx.split(self.layers)
        return [nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state))
                for i in range(len(self))]

    def add(self, transform: BlockTransform):
        """Install a block technique (``BlockTransform``)."""
        self.transforms.append(transform)

    def scan(self):
        """Stack the blocks' variables on a leading layer axis (metadata ``stacked``) so that one
        ``lax.scan`` runs them: XLA compiles one block instead of n."""
        if self.scanned:
            return
        from jaxaccel.core.errors import ConfigError
        splits = [nnx.split(block) for block in self.layers]
        graphdef, first = splits[0]
        for index, (other, state) in enumerate(splits):
            if other == graphdef and _shapes(state) == _shapes(first):
                continue
            why = block_difference(self.layers[0], self.layers[index]) or "its structure differs"
            # scanned, block 0's code would run with this block's weights
            raise ConfigError(
                f"scan_layers runs block 0's code for every block of the nn.Stack (pipeline "
                f"stages too), but block {index} differs from block 0: {why}; scanned, the model "
                f"would compute another function: give the stack blocks of one class and "
                f"structure, or leave scan_layers off", field="remat.scan_layers")
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[state for _, state in splits])
        module = nnx.merge(graphdef, stacked)
        for _, variable in nnx.iter_graph(module):
            if isinstance(variable, nnx.Variable):
                variable.set_metadata("stacked", True)
        self.layers = module
        self.scanned = True

    def unscan(self):
        """The inverse of ``scan``: one module per block again."""
        if not self.scanned:
            return
        blocks = self.blocks()
        for block in blocks:
            for _, variable in nnx.iter_graph(block):
                if isinstance(variable, nnx.Variable) and variable.has_metadata("stacked"):
                    variable.del_metadata("stacked")
        self.layers = nnx.List(blocks)
        self.scanned = False

    def map(self, fn, x, xs):
        """``(x, ys)`` of ``fn(block, x, x_i) -> (x, y_i)`` over the blocks (``xs``, ``ys`` on a
        layer axis), no block technique: for evaluation paths such as a cached decode."""
        if self.scanned:
            graphdef, stacked = nnx.split(self.layers)

            def body(x, layer):
                state, x_i = layer
                return fn(nnx.merge(graphdef, state), x, x_i)

            return jax.lax.scan(body, x, (stacked, xs))
        ys = []
        for i, block in enumerate(self.layers):
            x, y = fn(block, x, jax.tree.map(lambda a, i=i: a[i], xs))
            ys.append(y)
        return x, jax.tree.map(lambda *a: jnp.stack(a), *ys)

    # -- running the blocks -------------------------------------------------------------------

    def __call__(self, x, **token_args):
        step_ = current()
        if step_.stack is not None:
            return step_.stack(self, x, token_args)
        count = len(self)
        total = step_.total_layers or count
        first = step_.first_layer
        training = step_.key is not None
        transforms = sorted(self.transforms, key=lambda t: t.order)
        variants = [tuple(t.variant(first + i, total, x.shape[0], training) for t in transforms)
                    for i in range(count)]

        def run(x, token_args, lo, hi):
            if not self.scanned:
                for i in range(lo, hi):
                    graphdef, state = nnx.split(self.layers[i])
                    fn = self._layer_fn(graphdef, transforms, variants[i], step_.key)
                    x = fn(state, x, token_args, first + i)
                return x
            graphdef, stacked = nnx.split(self.layers)
            start = lo
            while start < hi:                # one scan per run of layers with equal variants
                end = start
                while end < hi and variants[end] == variants[start]:
                    end += 1
                part = stacked if (start, end) == (0, count) else \
                    jax.tree.map(lambda a: a[start:end], stacked)
                fn = self._layer_fn(graphdef, transforms, variants[start], step_.key)

                def body(x, layer, fn=fn):
                    state, index = layer
                    return fn(state, x, token_args, index), None

                x, _ = jax.lax.scan(body, x, (part, first + jnp.arange(start, end)))
                start = end
            return x

        for transform in transforms:
            span = transform.span(first, count, total, x.shape[1], training)
            if span is not None:
                lo, hi = span
                x = run(x, token_args, 0, lo)
                x = transform.run_span(lambda x, args: run(x, args, lo, hi), x, token_args)
                return run(x, token_args, hi, count)
        return run(x, token_args, 0, count)

    def _layer_fn(self, graphdef, transforms, variant, key):
        """One layer as ``fn(state, x, token_args, index) -> x``, wrapped by the transforms."""
        scanned = self.scanned
        field = next((t.field for t in transforms if t.field), None)

        def fn(state, x, token_args, index):
            block = nnx.merge(graphdef, state)
            layer = None if key is None else jax.random.fold_in(key, index)
            if layer is not None:
                _reseed(block, layer)
            reset = _LAYER_KEY.set(layer)
            try:
                out = block(x, **token_args)
            finally:
                _LAYER_KEY.reset(reset)
            if field and getattr(out, "shape", None) != x.shape:
                _refuse_reshaping(block, index, x, out, field)
            return out

        for transform, choice in zip(transforms, variant):
            fn = transform.wrap(fn, choice, scanned)
        return fn


def block_difference(first, other) -> str | None:
    """How block ``other`` differs from ``first`` in what a scanned stack shares with one code
    (the class, the sub-modules, each variable's type, shape and dtype, the static attributes), in
    a few words, or None."""
    if type(other) is not type(first):
        return f"it is a {type(other).__name__}, not a {type(first).__name__}"
    (graphdef, state), (other_graphdef, other_state) = nnx.split(first), nnx.split(other)
    if other_graphdef == graphdef and _shapes(other_state) == _shapes(state):
        return None
    theirs = dict(_parts(other))
    for path, (kind, shape) in _parts(first):
        name = "/".join(map(str, path))
        if path not in theirs:
            return f"it has no {name}"
        if theirs[path] != (kind, shape):
            return f"its {name} is {_part_text(*theirs[path])}, block 0's {_part_text(kind, shape)}"
    extra = [p for p in theirs if p not in dict(_parts(first))]
    if extra:
        return f"it has a {'/'.join(map(str, extra[0]))} that block 0 has not"
    if nnx.graphdef(other) != nnx.graphdef(first):
        return "a setting of its own differs (an attribute that is not an array)"
    return None


def _shapes(state) -> list[tuple]:
    return [(x.shape, x.dtype) for x in jax.tree.leaves(state)]


def _parts(block) -> list[tuple[tuple, tuple]]:
    """``(path, (type, shape and dtype))`` of a block's sub-modules and variables."""
    found = []
    for path, node in nnx.iter_graph(block):
        if isinstance(node, nnx.Variable):
            found.append((path, (type(node), (tuple(node.shape), str(node.dtype)))))
        elif isinstance(node, nnx.Module) and path:
            found.append((path, (type(node), None)))
    return found


def _part_text(kind, shape) -> str:
    return f"a {kind.__name__}" + (f" {shape[0]} {shape[1]}" if shape else "")


def _refuse_reshaping(block, index, x, out, field: str):
    """The ConfigError for a block whose output is not x's shape, under a technique that needs
    it (``BlockTransform.field``)."""
    from jaxaccel.core.errors import ConfigError
    which = f"block {index}" if isinstance(index, int) else "a block"
    technique = field.split(".")[0].replace("_", " ")
    got = getattr(out, "shape", None)
    raise ConfigError(
        f"{technique} runs each block of the nn.Stack on part of x and puts the result back, but "
        f"{which} ({type(block).__name__}) turns x {tuple(x.shape)} into "
        f"{tuple(got) if got is not None else type(out).__name__}; a block must return x's shape "
        f"[B, T, D] (change the width outside the stack), or leave {technique} off", field=field)


def _reseed(module, key):
    """Reseed ``module``'s ``nnx.Rngs`` streams (``nnx.Dropout``'s) from ``key``."""
    streams = sorted({v.get_metadata().get("tag") for _, v in nnx.iter_graph(module)
                      if isinstance(v, nnx.RngKey)} - {None})
    if streams:
        nnx.reseed(module, policy="match_shape",
                   **{name: jax.random.fold_in(key, i) for i, name in enumerate(streams)})


def stacks(model) -> list[tuple[tuple, "Stack"]]:
    """The ``(path, stack)`` of every ``Stack`` in ``model``."""
    return [(path, node) for path, node in nnx.iter_graph(model) if isinstance(node, Stack)]


def the_stack(model, technique: str, field: str | None = None) -> tuple[tuple, "Stack"]:
    """``(path, stack)`` of the model's one ``Stack``, else a ConfigError naming ``field``."""
    from jaxaccel.core.errors import ConfigError
    found = stacks(model)
    if len(found) != 1:
        what = "no jaxaccel.model.nn.Stack" if not found else f"{len(found)} Stacks"
        raise ConfigError(f"{technique} acts on the model's blocks, but {type(model).__name__} "
                          f"has {what}; declare its blocks as one nn.Stack (README, 'Your own "
                          f"model')", field=field)
    return found[0]
