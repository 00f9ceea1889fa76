"""Ahead-of-time compilation per input shape, with the compiles counted.

In JAX every new input shape is a new XLA compilation. ``CompiledFn`` makes that visible: it
lowers and compiles once per distinct set of argument shapes, counts the compilations and their
seconds, and keeps each compiled executable for XLA's memory and cost analyses."""

import time

import jax


def shape_key(args) -> tuple:
    """A hashable signature of the arguments' tree structure, shapes and dtypes. It runs on
    every call of a step: for GPT-2 small's train state (about 300 leaves) it took 0.09-0.13
    ms on this project's CPU machine, where formatting each dtype as text took 1.1 ms."""
    leaves, treedef = jax.tree.flatten(args)
    return treedef, tuple([(tuple(x.shape), x.dtype) for x in leaves])


class CompiledFn:
    """``jax.jit(fn)`` compiled ahead of time for each new argument signature. With
    ``keyed_by`` (argument positions) only those arguments' shapes choose the executable: a
    step's state keeps its shapes, and flattening it on every call (Flax's variables are Python
    pytree nodes) costs a 1 ms step a tenth of its time; an argument outside ``keyed_by`` whose
    shapes differ from the first compile's is JAX's own error."""

    def __init__(self, fn, *, keyed_by: tuple[int, ...] | None = None, **jit_kwargs):
        self._jitted = jax.jit(fn, **jit_kwargs)
        self._keyed_by = keyed_by
        self._executables = {}
        self.compiles = 0
        self.compile_seconds = 0.0
        self.last = None

    def _lower(self, *args):
        return self._jitted.lower(*args)

    def compile(self, *args):
        """The executable for these arguments' shapes, compiling it on first sight."""
        key = shape_key(args if self._keyed_by is None else [args[i] for i in self._keyed_by])
        executable = self._executables.get(key)
        if executable is None:
            start = time.perf_counter()
            executable = self._lower(*args).compile()
            self.compile_seconds += time.perf_counter() - start
            self.compiles += 1
            self._executables[key] = executable
        self.last = executable
        return executable

    @property
    def executables(self) -> list:
        """Every executable compiled so far, one per input shape."""
        return list(self._executables.values())

    def __call__(self, *args):
        return self.compile(*args)(*args)


class StateStep(CompiledFn):
    """A step ``fn(state, *rest) -> (state, out)`` compiled over the state's leaves, whose shapes
    stay those of the first compile (``rest``'s choose the executable). A loop keeps the leaves
    (``jax.tree.leaves(state)``) and calls ``on_leaves``, and rebuilds the state (``state_of``)
    only when it needs it: Flax's variables are Python pytree nodes, and flattening and
    rebuilding the state on each call took 0.13 ms of a 1 ms step (2026-11-28, the project's
    2-core CPU). Called with the state, it is a ``CompiledFn``. The shardings are
    ``(state's, rest's...)`` and ``(state's, out's)``; ``donate`` donates the state."""

    def __init__(self, fn, *, in_shardings=None, out_shardings=None, donate: bool = False):
        super().__init__(fn, keyed_by=(1,))
        self._fn, self._treedef, self._flat = fn, None, None
        self._shardings, self._donate = (in_shardings, out_shardings), donate

    def _lower(self, state, *rest):
        if self._flat is None:
            treedef = self._treedef = jax.tree.structure(state)

            def step(leaves, *rest):
                new_state, out = self._fn(jax.tree.unflatten(treedef, leaves), *rest)
                return jax.tree.leaves(new_state), out

            step.__name__ = getattr(self._fn, "__name__", "step")
            (ins, outs), kwargs = self._shardings, {}
            if ins is not None:
                kwargs["in_shardings"] = (jax.tree.leaves(ins[0]), *ins[1:])
            if outs is not None:
                kwargs["out_shardings"] = (jax.tree.leaves(outs[0]), *outs[1:])
            self._flat = jax.jit(step, donate_argnums=0 if self._donate else (), **kwargs)
        return self._flat.lower(jax.tree.leaves(state), *rest)

    def on_leaves(self, leaves: list, *rest):
        """``(the new state's leaves, out)`` from the state's ``leaves``."""
        executable = self._executables.get(shape_key(rest))
        if executable is None:
            executable = self.compile(self.state_of(leaves), *rest)
        self.last = executable
        return executable(leaves, *rest)

    def state_of(self, leaves: list):
        return jax.tree.unflatten(self._treedef, leaves)

    def __call__(self, state, *rest):
        leaves, out = self.compile(state, *rest)(jax.tree.leaves(state), *rest)
        return self.state_of(leaves), out


def abstract(tree):
    """``tree`` as ShapeDtypeStructs, to compile for its shapes and shardings without values."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        tree)


def memory_bytes(executable) -> dict:
    """XLA's compiled memory analysis as a dict of byte counts; empty if the backend has none.
    ``total`` is the device memory the step needs at once: inputs, outputs not aliased to
    (donated) inputs, and temporaries. ``host_*`` count pinned host memory (where offloading
    remat policies put saved activations) and ``host_total`` adds them up the same way."""
    analysis = executable.memory_analysis()
    if analysis is None:
        return {}
    fields = ("argument", "output", "temp", "alias", "generated_code", "host_argument",
              "host_output", "host_temp", "host_alias")
    sizes = {f: int(getattr(analysis, f + "_size_in_bytes", 0) or 0) for f in fields}
    sizes["total"] = sizes["argument"] + sizes["output"] - sizes["alias"] + sizes["temp"]
    sizes["host_total"] = (sizes["host_argument"] + sizes["host_output"] - sizes["host_alias"]
                           + sizes["host_temp"])
    return sizes


def flops(executable) -> float | None:
    """FLOPs of one call from XLA's ``cost_analysis()``, None if the backend gives none. XLA
    counts a loop's body once, whatever its trip count: for a ``lax.scan`` over layers this is
    the FLOPs outside the loop plus one layer's."""
    analysis = executable.cost_analysis()
    if isinstance(analysis, (list, tuple)):   # one dict per device program in older versions
        analysis = analysis[0] if analysis else None
    return float(analysis["flops"]) if analysis and "flops" in analysis else None


def largest_memory_bytes(compiled_fn: CompiledFn) -> dict | None:
    """``memory_bytes`` of the executable of ``compiled_fn`` with the most device bytes: what a
    run that compiled several batch shapes needs the device to hold."""
    found = [m for m in (memory_bytes(e) for e in compiled_fn.executables) if m]
    return max(found, key=lambda m: m["total"]) if found else None
