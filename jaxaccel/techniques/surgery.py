"""Module surgery: how a layer technique finds a model's linear layers and wraps them.

A layer technique (LoRA, adapters, N:M sparsity, FP8, init gates) replaces each ``nnx.Linear``
it targets by a ``Wrapper`` holding the layer as ``base`` (as flax's ``nnx.LoRA(base_module=...)``
and Levanter's ``loraize`` do); the model's code is not touched. Wrappers nest; one that changes
the product (FP8, sparsity) hands the innermost layer another ``dot_general`` (``dot``), keeping
its dtype promotion, bias and sharding. ``--<technique>-targets`` is comma-separated: ``blocks``
(every linear layer in the ``nn.Stack``), an alias of the model's class attribute ``aliases``
(GPT's ``q``: paths ending ``attn/wq``), else a regular expression searched in a layer's path
(``blocks/layers/0/attn/wq``; a scanned stack's layers have no index).
"""

import contextlib
import re

from flax import nnx

from jaxaccel.core.errors import ConfigError
from jaxaccel.core.sections import TARGETS_HELP     # what --*-targets take, declared without jax


class Wrapper(nnx.Module):
    """A layer technique around ``base`` (an ``nnx.Linear`` or another wrapper).
    ``changes_product``: it changes the kernel the layer multiplies by (FP8, N:M masks), so a
    LoRA update folded into the kernel under it would not be the update that trained."""

    changes_product = False

    def __init__(self, base):
        self.base = base

    def linear(self) -> nnx.Linear:
        """The innermost ``nnx.Linear``."""
        return innermost(self.base)

    @property
    def kernel(self):
        """The wrapped layer's kernel variable (another technique may read it)."""
        return self.linear().kernel

    def __call__(self, x, *args, **kwargs):
        return self.base(x, *args, **kwargs)

    def fold(self) -> None:
        """Fold this wrapper's effect into the kernel where a plain layer can hold it (LoRA's
        update, N:M masks); nothing for the others, which ``unwrap`` then drops."""


def innermost(layer) -> nnx.Linear:
    while isinstance(layer, Wrapper):
        layer = layer.base
    return layer


@contextlib.contextmanager
def dot(linear: nnx.Linear, make):
    """Within the context ``linear`` multiplies with ``make(its own dot_general)``."""
    inner = linear.dot_general
    linear.dot_general = make(inner)
    try:
        yield
    finally:
        linear.dot_general = inner


def path_text(path) -> str:
    return "/".join(str(p) for p in path)


def linear_layers(model) -> list[tuple[tuple, nnx.Module]]:
    """``(path, layer)`` of every ``nnx.Linear`` of ``model``, or the outermost wrapper of one."""
    nodes = [(p, n) for p, n in nnx.iter_graph(model) if isinstance(n, (nnx.Linear, Wrapper))]
    wrapped = {p for p, n in nodes if isinstance(n, Wrapper)}
    outer = [(p, n) for p, n in nodes
             if not any(p[:len(w)] == w and len(p) > len(w) for w in wrapped)]
    return sorted(outer, key=lambda item: [str(k) for k in item[0]])


def select(model, spec: str, *, field: str) -> list[tuple[tuple, nnx.Module]]:
    """The linear layers ``spec`` names (module docstring), else a ConfigError naming ``field``."""
    from jaxaccel.model import nn
    layers = linear_layers(model)
    aliases = getattr(type(model), "aliases", {}) or {}
    stack_paths = [path for path, _ in nn.stacks(model)]
    chosen = {}
    for item in [t.strip() for t in str(spec).split(",") if t.strip()]:
        if item == "blocks":
            hits = [(p, n) for p, n in layers if any(p[:len(s)] == s for s in stack_paths)]
        else:
            pattern = (f"(^|/){re.escape(aliases[item])}$" if item in aliases else item)
            try:
                regex = re.compile(pattern)
            except re.error as e:
                raise ConfigError(f"{field.rpartition('.')[2]}: {item!r} is not a regular "
                                  f"expression ({e})", field=field) from None
            hits = [(p, n) for p, n in layers if regex.search(path_text(p))]
        if not hits:
            names = ", ".join(path_text(p) for p, _ in layers[:12]) + (
                ", ..." if len(layers) > 12 else "")
            alias_note = (f"; its aliases: {', '.join(aliases)}" if aliases else
                          f"; {type(model).__name__} defines no aliases")
            raise ConfigError(
                f"{field.rpartition('.')[2]}: {item!r} matches none of the model's linear "
                f"layers ({names or 'it has none'}){alias_note}; give a regular expression "
                f"of their paths", field=field)
        chosen.update({p: n for p, n in hits})
    if not chosen:
        raise ConfigError(f"{field.rpartition('.')[2]} names no layer; give at least one",
                          field=field)
    return sorted(chosen.items(), key=lambda item: [str(k) for k in item[0]])


def replace(model, path: tuple, new) -> None:
    """Put ``new`` at ``path`` in ``model`` (an attribute or a list item)."""
    parent = model
    for key in path[:-1]:
        parent = parent[key] if isinstance(key, int) else getattr(parent, key)
    if isinstance(path[-1], int):
        parent[path[-1]] = new
    else:
        setattr(parent, path[-1], new)


def default_targets(model, technique: str, fallback: str | None, field: str) -> str:
    """A technique's targets: the model's ``defaults[technique]``, ``fallback`` or a ConfigError."""
    chosen = (getattr(type(model), "defaults", {}) or {}).get(technique, fallback)
    if chosen is None:
        raise ConfigError(f"{type(model).__name__} declares no default layers for {technique} "
                          f"(its class attribute defaults); name the layers to wrap",
                          field=field)
    return chosen


def wrap(model, spec: str, make, *, field: str) -> int:
    """Replace each linear layer ``spec`` names by ``make(path, layer)``; how many."""
    layers = select(model, spec, field=field)
    for path, layer in layers:
        replace(model, path, make(path, layer))
    return len(layers)


def wrappers(model, kind) -> list[tuple[tuple, Wrapper]]:
    """``(path, wrapper)`` of every wrapper of type ``kind`` in ``model``."""
    return [(p, n) for p, n in nnx.iter_graph(model) if isinstance(n, kind)]


def kernel_axes(layer) -> tuple:
    """The logical axes (in, out) of a linear layer's kernel, ``(None, None)`` if it names none."""
    return tuple(innermost(layer).kernel.get_metadata().get("out_sharding") or (None, None))


def unwrap(model, kind=Wrapper) -> None:
    """Replace every wrapper of type ``kind`` by its ``base``, outermost first, each folded into
    its kernel first (``Wrapper.fold``): N:M masks before the LoRA update under them."""
    while found := wrappers(model, kind):
        path, wrapper = min(found, key=lambda item: len(item[0]))
        wrapper.fold()
        replace(model, path, wrapper.base)
