"""Sharding the pure step over a device mesh: data parallel, FSDP (ZeRO-3), tensor parallel and
pipeline parallel.

The mesh always has the axes ``stage``, ``data``, ``fsdp`` and ``tensor`` (unused ones of size
1), so one set of rules serves every strategy (``mesh.strategy`` names the axes it uses,
``mesh_shape`` sizes them). Every variable dimension has a logical name (``embed``, ``heads``,
...: ``variable_axes``); ``PARAM_RULES`` map it to the mesh axis it is stored split over,
``COMPUTE_RULES`` to the one it is laid out over while the model computes (``constrain``). The
model runs under Auto mesh axes (XLA completes the shardings) and Explicit ones (shardings are
part of every array's type, and each op's output sharding must be unambiguous).
"""

import contextlib
import dataclasses
import math
import re
import socket
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from jaxaccel.core.errors import ConfigError
# Which mesh axes each strategy spreads the work over, declared without jax.
from jaxaccel.core.sections import MESH_AXIS_TYPES, SHARDING_STRATEGIES as STRATEGIES

MESH_AXES = ("stage", "data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")
# jax's axis type of each of --mesh-axis-types' names: auto -> AxisType.Auto, ...
AXIS_TYPES = {name: getattr(AxisType, name.capitalize()) for name in MESH_AXIS_TYPES}
# The sizes a strategy gives its secondary axes when the mesh sets none of its axes (each where
# it divides the devices); the remaining devices go to its other axis (a pipeline's stages).
DEFAULT_SIZES = {"fsdp+tp": {"tensor": 2}, "dp+fsdp": {"data": 2}, "dp+pp": {"data": 2},
                 "fsdp+pp": {"fsdp": 2}, "tp+pp": {"tensor": 2},
                 "fsdp+tp+pp": {"tensor": 2, "fsdp": 2}}

# Logical axis -> mesh axis (or None: replicated) for parameters and optimizer state at rest:
# ZeRO-3 over fsdp along embed, Megatron over tensor, the stacked layers over pipeline stages.
PARAM_RULES = {
    "layers": "stage", "vocab": None, "embed": "fsdp", "heads": "tensor", "kv_heads": "tensor",
    "mlp": "tensor", "norm": None, "lora": None, "adapter": None, "fp8": None, "fp8_history": None,
}
# ... and while the model computes: weights gathered over fsdp, the batch split over data x fsdp.
COMPUTE_RULES = {
    "batch": BATCH_AXES, "seq": None, "embed": None, "heads": "tensor", "kv_heads": "tensor",
    "head_dim": None, "mlp": "tensor", "vocab": None, "layers": None, "norm": None,
    "lora": None, "adapter": None, "fp8": None, "fp8_history": None,
}


def pipelined(strategy: str) -> bool:
    """Whether ``strategy`` splits the layers into pipeline stages."""
    return "stage" in STRATEGIES.get(strategy, ())


def refuse_pipeline(strategy: str, technique: str, field: str) -> None:
    """ConfigError naming ``field`` when ``strategy`` pipelines the layers, which ``technique``
    does not run with."""
    if pipelined(strategy):
        raise ConfigError(f"{technique} does not run with the pipeline strategy {strategy}; "
                          f"choose a strategy without pp", field=field)


def parse_mesh(text: str | None) -> dict[str, int]:
    """``"data=2,fsdp=4"`` -> {"data": 2, "fsdp": 4}; ``None`` or ``""`` -> {}."""
    sizes = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        name, _, value = item.partition("=")
        name = name.strip()
        try:
            size = int(value)
        except ValueError:
            size = 0
        if name not in MESH_AXES or size == 0 or size < -1:
            raise ConfigError(
                f"bad mesh item {item.strip()!r}; write the mesh as axis=size pairs, e.g. "
                f"data=2,fsdp=4, with axes from {', '.join(MESH_AXES)} and sizes >= 1 (or -1 "
                f"for the remaining devices)", field="mesh.shape")
        sizes[name] = size
    return sizes


def mesh_shape(strategy: str, device_count: int, sizes: dict[str, int] | None = None,
               process_count: int = 1) -> dict[str, int]:
    """The size of every mesh axis for ``strategy`` on ``device_count`` devices: ``sizes``
    (``mesh.shape``) fix some, one may be -1 (the remaining devices); unused axes must be 1.
    When none of the strategy's axes is set, ``DEFAULT_SIZES`` apply (``dp+fsdp``: ``data`` =
    the process count on several hosts); the axis left takes the remaining devices."""
    if strategy not in STRATEGIES:
        raise ConfigError(f"unknown sharding strategy {strategy!r}; choose one of "
                          f"{', '.join(STRATEGIES)}", field="mesh.strategy")
    used = STRATEGIES[strategy]
    sizes = dict(sizes or {})
    for axis, size in sizes.items():
        if axis not in used and size != 1:
            raise ConfigError(
                f"strategy {strategy} does not use the {axis} axis but the mesh sets "
                f"{axis}={size}; set it to 1 or choose a strategy that uses it "
                f"({', '.join(STRATEGIES)})", field="mesh.shape")
    if not any(a in sizes for a in used):
        defaults = dict(DEFAULT_SIZES.get(strategy, {}))
        if strategy == "dp+fsdp" and process_count > 1:
            defaults["data"] = process_count
        for axis, size in defaults.items():
            rest = device_count // math.prod(sizes.values()) if sizes else device_count
            sizes[axis] = size if rest % size == 0 else 1
    for axis in used:
        sizes.setdefault(axis, -1)
    free = [a for a in MESH_AXES if sizes.get(a) == -1]
    if len(free) > 1:
        raise ConfigError(f"the mesh leaves {' and '.join(free)} both at -1; give all but one a "
                          "size", field="mesh.shape")
    fixed = math.prod(s for a, s in sizes.items() if s != -1)
    if free:
        if device_count % fixed:
            raise ConfigError(
                f"mesh {format_mesh(sizes)} needs a multiple of {fixed} devices but there are "
                f"{device_count}; change the mesh sizes", field="mesh.shape")
        sizes[free[0]] = device_count // fixed
    shape = {a: sizes.get(a, 1) for a in MESH_AXES}
    if math.prod(shape.values()) != device_count:
        raise ConfigError(
            f"mesh {format_mesh(shape)} has {math.prod(shape.values())} devices but "
            f"{device_count} are available; make the mesh sizes multiply to {device_count}",
            field="mesh.shape")
    return shape


def format_mesh(shape: dict[str, int]) -> str:
    return ",".join(f"{a}={shape[a]}" for a in MESH_AXES if a in shape)


def build_mesh(strategy: str, mesh: str | None = None, axis_types: str = "auto",
               num_devices: int | None = None):
    """The run's mesh and its axis sizes, over all devices of all processes (or the first
    ``num_devices`` of a single process)."""
    devices = jax.devices()
    if num_devices is not None and num_devices != len(devices):
        if jax.process_count() > 1 or not 1 <= num_devices <= len(devices):
            raise ConfigError(
                f"num_devices={num_devices} is not available: {len(devices)} devices in "
                f"{jax.process_count()} process(es), and a subset is only possible in one process; "
                f"pass a number from 1 to {len(devices)} or leave num_devices unset",
                field="mesh.num_devices")
        devices = devices[:num_devices]
    shape = mesh_shape(strategy, len(devices), parse_mesh(mesh), jax.process_count())
    if batch_shards(shape) % jax.process_count():
        raise ConfigError(
            f"mesh {format_mesh(shape)} splits the batch into {batch_shards(shape)} parts, fewer "
            f"than (or not a multiple of) the {jax.process_count()} processes that each load "
            f"their own rows; keep the tensor and stage axes within a host", field="mesh.shape")
    return make_mesh(shape, axis_types, devices), shape


def make_mesh(shape: dict[str, int], axis_types: str = "auto", devices=None):
    """A ``jax.sharding.Mesh`` with axes stage, data, fsdp, tensor of these sizes and type."""
    if axis_types not in AXIS_TYPES:
        raise ConfigError(f"unknown mesh axis type {axis_types!r}; choose one of "
                          f"{', '.join(AXIS_TYPES)}", field="mesh.axis_types")
    devices = jax.devices() if devices is None else devices
    sizes = tuple(shape.get(a, 1) for a in MESH_AXES)
    if math.prod(sizes) != len(devices):
        raise ConfigError(
            f"mesh {format_mesh(shape)} has {math.prod(sizes)} devices but {len(devices)} are "
            f"available; make the mesh sizes multiply to {len(devices)}", field="mesh.shape")
    return jax.make_mesh(sizes, MESH_AXES, axis_types=(AXIS_TYPES[axis_types],) * len(MESH_AXES),
                         devices=devices)


def logical_spec(axes, rules: dict) -> PartitionSpec:
    """The PartitionSpec of a tensor whose dimensions have these logical names; a later
    dimension that maps to a mesh axis already taken stays unsplit."""
    taken, spec = set(), []
    for name in axes:
        # a logical name by its rule, a mesh axis's name as itself; other names keep it whole
        mesh_axes = rules[name] if name in rules else (name if name in MESH_AXES else None)
        mesh_axes = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes or ())
        mesh_axes = tuple(a for a in mesh_axes if a not in taken)
        taken.update(mesh_axes)
        spec.append(mesh_axes[0] if len(mesh_axes) == 1 else (mesh_axes or None))
    return PartitionSpec(*spec)


def target_device():
    """The device a program is built for: the abstract mesh's (a program lowered for another
    device, ``jax.sharding.AbstractDevice``), else the first device."""
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    return device if device is not None else jax.devices()[0]


def _laid_out(out_axes, plain, explicit):
    """``plain()`` laid out as the logical ``out_axes`` on the mesh in context: under Explicit
    axes ``explicit(spec)`` (the op told its sharding), else a constraint; without a mesh, as is."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return plain()
    spec = logical_spec(out_axes, COMPUTE_RULES)
    types = [t for t in mesh.axis_types if t != AxisType.Manual]    # not a shard_map's axes
    if types and all(t == AxisType.Explicit for t in types):
        return explicit(spec)
    return jax.lax.with_sharding_constraint(plain(), spec)


def constrain(x, axes):
    """``x`` laid out for computing as its logical ``axes`` say (``_laid_out``). On a weight
    stored split over ``fsdp`` this is the all-gather of FSDP, done where the weight is used."""
    return _laid_out(axes, lambda: x, lambda spec: jax.sharding.reshard(x, spec))


def check_divides(size: int, axis: str, what: str, field: str) -> None:
    """One ConfigError line when ``size`` (a model's count of heads, say) does not split over
    the mesh axis (in context) its logical ``axis`` is computed on."""
    mesh = jax.sharding.get_abstract_mesh()
    names = logical_spec((axis,), COMPUTE_RULES)[0]
    names = (names,) if isinstance(names, str) else names or ()
    parts = 1 if mesh.empty else math.prod(dict(mesh.shape).get(n, 1) for n in names)
    if size % parts:
        raise ConfigError(f"{what}={size} does not split over the {parts} devices its {axis} "
                          f"are computed on; choose {what} divisible by {parts} or a smaller "
                          f"axis in the mesh", field=field)


def matmul(x, w, out_axes):
    """``x @ w`` laid out as ``out_axes``: under Explicit axes this makes contracting a dimension
    split on both sides (a Megatron pair's second matmul) a reduce over ``tensor``."""
    return _laid_out(out_axes, lambda: x @ w, lambda spec: jnp.matmul(x, w, out_sharding=spec))


def einsum(subscripts: str, a, b, out_axes, **kwargs):
    """``jnp.einsum(subscripts, a, b, **kwargs)`` laid out as ``out_axes`` (as ``matmul``)."""
    return _laid_out(out_axes, lambda: jnp.einsum(subscripts, a, b, **kwargs),
                     lambda spec: jnp.einsum(subscripts, a, b, out_sharding=spec, **kwargs))


@dataclasses.dataclass(frozen=True)
class LogicalDot:
    """The ``dot_general`` of an ``nnx.Linear`` whose kernel has the logical ``axes`` (in, out):
    the kernel gathered where used (FSDP's all-gather, a layer at a time), the output's features
    laid out as the output axis. Without a mesh it is ``x @ kernel``."""

    axes: tuple

    def __call__(self, x, kernel, dimension_numbers=None, precision=None, out_sharding=None,
                 preferred_element_type=None):
        kernel = constrain(kernel, self.axes)
        rows = ("batch", "seq")[:x.ndim - 1] if x.ndim <= 3 else (None,) * (x.ndim - 1)
        return matmul(x, kernel, (*rows, self.axes[-1]))


def take_rows(table, ids, out_axes):
    """``table[ids]`` (an embedding lookup) laid out as ``out_axes``; under Explicit axes the
    gather is told its output sharding, which it cannot infer from a batch-split ``ids``."""
    return _laid_out(out_axes, lambda: jnp.take(table, ids, axis=0),
                     lambda spec: table.at[ids].get(out_sharding=spec))


def per_shard(fn, in_axes, out_axes):
    """``fn`` run on each device's shard (``jax.shard_map``), its arguments and result laid out
    by logical axes (None for a None argument); ``fn`` itself without a mesh. For kernels XLA
    cannot split (Pallas calls): each device runs its rows and heads, with no communication."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return fn
    in_specs = tuple(PartitionSpec() if axes is None else logical_spec(axes, COMPUTE_RULES)
                     for axes in in_axes)
    return jax.shard_map(fn, in_specs=in_specs, out_specs=logical_spec(out_axes, COMPUTE_RULES),
                         check_vma=False)


# A logical axis name besides PARAM_RULES' and None (kept whole): one fsdp splits if it divides.
AUTO = "auto"


def variable_axes(abstract_params, rules=None):
    """The logical axes of every variable of a model's state (a tree of tuples shaped like it),
    from, first to last: ``rules`` (``{regex: axes}`` searched in the path, ``parse_axis_rules``),
    the variable's ``out_sharding`` metadata (``nnx.with_partitioning``), else its rank: ``AUTO``
    on each dimension of a parameter of 2 or more, anything else kept whole; never its name. A
    variable of a scanned stack (metadata ``stacked``) has ``layers`` in front."""
    compiled = [(re.compile(k), tuple(v)) for k, v in (rules or {}).items()]

    def axes(path, variable):
        stacked = bool(variable.get_metadata().get("stacked"))
        names = per_layer(path, variable, variable.ndim - stacked)
        return ("layers", *names) if stacked else names

    def per_layer(path, variable, ndim):
        name = path_name(path)
        for pattern, given in compiled:
            if pattern.search(name):
                if len(given) != ndim:
                    raise ConfigError(f"axis rule {pattern.pattern!r} gives {len(given)} axes to "
                                      f"{name}, which has {ndim} dimensions per layer; give one "
                                      f"per dimension", field="mesh.axis_rules")
                return given
        declared = variable.get_metadata().get("out_sharding")
        if declared is not None:
            return tuple(declared)
        if isinstance(variable, nnx.Param) and ndim >= 2:
            return (AUTO,) * ndim
        return (None,) * ndim

    return jax.tree_util.tree_map_with_path(axes, abstract_params,
                                            is_leaf=lambda x: isinstance(x, nnx.Variable))


def path_name(path) -> str:
    """``blocks/layers/0/attn/wq/kernel`` for a key path into a state (``.value`` left out)."""
    return "/".join(str(getattr(key, "key", getattr(key, "idx", getattr(key, "name", key))))
                    for key in path
                    if not (isinstance(key, jax.tree_util.GetAttrKey) and key.name == "value"))


def parse_axis_rules(text: str | None) -> dict:
    """``"qkv/kernel=embed,heads;fc1/kernel=embed,mlp"`` -> {regex: axes}; ``-`` or ``none`` is
    a dimension kept whole."""
    rules = {}
    for item in (text or "").split(";"):
        if not item.strip():
            continue
        pattern, sep, names = item.partition("=")
        axes = tuple(None if n.strip() in ("-", "none") else n.strip() for n in names.split(","))
        unknown = [a for a in axes if a is not None and a not in PARAM_RULES and a != AUTO
                   and a not in MESH_AXES]
        try:
            re.compile(pattern.strip())
        except re.error:
            unknown = [pattern]
        if not sep or unknown:
            raise ConfigError(f"bad axis rule {item.strip()!r}: write PATH_REGEX=axis,axis with "
                              f"axes from {', '.join(PARAM_RULES)} (or - to keep a dimension "
                              f"whole), rules separated by ';'", field="mesh.axis_rules")
        rules[pattern.strip()] = axes
    return rules


def param_shardings(mesh, abstract_params, rules=None):
    """NamedShardings for a model's state by ``variable_axes`` and ``PARAM_RULES`` (the first
    ``AUTO`` dimension that divides takes fsdp). Without pipeline stages the stacked layers stay
    whole: a size-1 ``stage`` would keep Explicit axes from scanning over them. Over a tensor
    axis, the weights that name no logical axes are said in one warning line (``say_whole``)."""
    shape = dict(mesh.shape)
    say_whole(shape, abstract_params, rules)
    param_rules = PARAM_RULES if shape.get("stage", 1) > 1 else {**PARAM_RULES, "layers": None}
    fsdp = shape.get("fsdp", 1)

    def sharding(variable, axes):
        if AUTO in axes:
            dims = [i for i, a in enumerate(axes) if a == AUTO]
            chosen = next((i for i in dims if variable.shape[i] % fsdp == 0), None)
            axes = tuple("embed" if i == chosen else (None if a == AUTO else a)
                         for i, a in enumerate(axes))
        return NamedSharding(mesh, logical_spec(axes, param_rules))

    return jax.tree.map(sharding, abstract_params, variable_axes(abstract_params, rules),
                        is_leaf=lambda x: isinstance(x, (nnx.Variable, tuple)))


def check_split(mesh_shape: dict[str, int], abstract_params, rules=None, strategy: str = ""):
    """ConfigError if a variable's dimension does not divide over its mesh axis, or if ``tensor``
    is split and the model names no dimension for it (it would silently replicate all)."""
    param_rules = {**PARAM_RULES, "layers": "stage"}
    flat_axes = jax.tree.leaves(variable_axes(abstract_params, rules),
                                is_leaf=lambda x: isinstance(x, tuple))
    flat = jax.tree_util.tree_flatten_with_path(
        abstract_params, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    tensor_used = False
    for (path, variable), axes in zip(flat, flat_axes):
        for dim, name in enumerate(axes):
            axis = param_rules.get(name, name if name in MESH_AXES else None)
            size = mesh_shape.get(axis, 1) if axis else 1
            tensor_used |= axis == "tensor"
            if size > 1 and variable.shape[dim] % size:
                raise ConfigError(
                    f"{path_name(path)} {tuple(variable.shape)}: dimension {dim} "
                    f"({variable.shape[dim]}, logical axis {name}) does not split over the "
                    f"{axis} axis ({size} devices); choose a model size divisible by {size} or a "
                    f"smaller {axis} axis in the mesh", field="mesh.shape")
    if mesh_shape.get("tensor", 1) > 1 and not tensor_used:
        raise ConfigError(
            f"strategy {strategy} splits over the tensor axis, but the model names no dimension "
            f"for it (heads, kv_heads or mlp); annotate its kernels with nnx.with_partitioning("
            f"init, ('embed', 'mlp')) or pass --axis-rules", field="mesh.strategy")


# What flax's nnx.Embed names its table: a lookup, which no strategy splits over tensor and no
# optimizer decays (jaxaccel.step.optim), whatever axes it names.
EMBED_TABLE = "embedding"


def whole_over_tensor(abstract_params, rules=None) -> list[str]:
    """The paths of the weights (``nnx.Param`` of two or more dimensions per layer, embedding
    tables aside) that neither ``rules`` nor their ``out_sharding`` metadata give logical axes:
    the tensor axis splits none of their dimensions, so tensor parallelism keeps each whole on
    every tensor device."""
    flat_axes = jax.tree.leaves(variable_axes(abstract_params, rules),
                                is_leaf=lambda x: isinstance(x, tuple))
    flat = jax.tree_util.tree_flatten_with_path(
        abstract_params, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    return [path_name(path) for (path, _), axes in zip(flat, flat_axes)
            if AUTO in axes and getattr(path[-1], "key", None) != EMBED_TABLE]


def whole_warning(mesh_shape: dict[str, int], abstract_params, rules=None) -> str | None:
    """The warning line for ``whole_over_tensor``'s weights when the mesh has a tensor axis of
    more than one device, else None."""
    tensor = mesh_shape.get("tensor", 1)
    whole = whole_over_tensor(abstract_params, rules) if tensor > 1 else []
    if not whole:
        return None
    shown = ", ".join(whole[:3]) + (f" and {len(whole) - 3} more" if len(whole) > 3 else "")
    return (f"warning: tensor parallelism ({tensor} devices) keeps {len(whole)} weights whole on "
            f"every tensor device, for they name no logical axes: {shown}; name their dimensions "
            f"with nnx.with_partitioning(init, ('embed', 'mlp')) in the layer's kernel_init, or "
            f"with --axis-rules 'PATH=embed,mlp' (mesh.axis_rules)")


_SAID = set()       # the warnings this process has printed: a run builds its shardings often


def say_whole(mesh_shape: dict[str, int], abstract_params, rules=None) -> None:
    """Print ``whole_warning`` to stderr (process 0, once per process and message)."""
    warning = whole_warning(mesh_shape, abstract_params, rules)
    if warning and warning not in _SAID and jax.process_index() == 0:
        _SAID.add(warning)
        print(warning, file=sys.stderr)


def state_shardings(mesh, abstract_state, params_sharding):
    """Shardings for a whole TrainState: ``params`` as given; an optimizer-state leaf shaped like
    the parameter whose path it ends with (Adam's moments) like that parameter; everything else
    (step counts, factored statistics, the loss scale, the rng) replicated."""
    whole = replicated(mesh)
    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(abstract_state.params)[0]]
    by_path = {tuple(path): (leaf, sharding) for path, leaf, sharding in zip(
        paths, jax.tree.leaves(abstract_state.params), jax.tree.leaves(params_sharding))}

    def for_leaf(path, leaf):
        for start in range(len(path)):
            match = by_path.get(tuple(path[start:]))
            if match is not None and match[0].shape == leaf.shape:
                return match[1]
        return whole

    return abstract_state.replace(
        params=params_sharding, step=whole, rng=whole,
        opt_state=jax.tree_util.tree_map_with_path(for_leaf, abstract_state.opt_state),
        loss_scale=jax.tree.map(lambda _: whole, abstract_state.loss_scale))


def batch_sharding(mesh):
    """Batch rows split over data x fsdp, the sequence whole."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES, None))


def replicated(mesh):
    """A whole copy on every device (scalars, metrics)."""
    return NamedSharding(mesh, PartitionSpec())


def batch_shards(shape: dict[str, int]) -> int:
    """How many parts the batch's rows are split into."""
    return shape["data"] * shape["fsdp"]


def bytes_per_device(tree) -> int:
    """Bytes of a tree of sharded arrays (or ShapeDtypeStructs) on its fullest device."""
    per_device = {}
    for leaf in jax.tree.leaves(tree):
        size = math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
        for device in leaf.sharding.device_set:
            per_device[device] = per_device.get(device, 0) + size
    return max(per_device.values(), default=0)


def initialize_distributed(coordinator: str | None, num_processes: int | None,
                           process_id: int | None, *, auto: bool = False,
                           timeout_s: int = 300) -> None:
    """Start JAX's multi-controller runtime from explicit settings (the processes meet first:
    ``rendezvous``) or (``auto``) from the cluster's environment (SLURM, Open MPI, ...); CPU
    collectives go through gloo."""
    if coordinator is None and not auto:
        if num_processes not in (None, 1) or process_id not in (None, 0):
            raise ConfigError("num_processes and process_id need a coordinator HOST:PORT "
                              "(or auto=True to detect the cluster)", field="mesh.coordinator")
        return
    if coordinator is not None:
        if num_processes is None or process_id is None:
            raise ConfigError("coordinator needs num_processes N and process_id I as well",
                              field="mesh.num_processes")
        if not 0 <= process_id < num_processes:
            raise ConfigError(f"process_id={process_id} is not in [0, num_processes="
                              f"{num_processes}); number the processes 0 .. N-1",
                              field="mesh.process_id")
        host, _, port = coordinator.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"coordinator {coordinator!r} is not HOST:PORT; pass e.g. "
                              f"10.0.0.1:1234 (the address of process 0)",
                              field="mesh.coordinator")
        if not 0 < int(port) < 65536:
            raise ConfigError(f"coordinator port {port} is not a TCP port; pass one in 1 .. "
                              f"65535", field="mesh.coordinator")
        rendezvous(host, int(port), num_processes, process_id, timeout_s)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(coordinator, num_processes, process_id,
                                   initialization_timeout=timeout_s)
    except ValueError as e:         # auto outside a cluster: nothing to detect
        raise ConfigError(f"jax.distributed could not start ({e}); outside a cluster it "
                          f"detects, pass --coordinator, --num-processes and --process-id",
                          field="mesh.distributed") from None


# The hello a process sends process 0 before JAX starts, and process 0's answers.
HELLO = "jaxaccel-rendezvous/1"


def rendezvous(host: str, port: int, num_processes: int, process_id: int,
               timeout_s: float) -> None:
    """Meet every process on the coordinator's port before JAX starts, whose runtime does not
    raise when the start fails: it aborts (SIGABRT, a C++ stack trace) past its timeout when
    peers never join, something else answers on the port or a process id is given twice, mostly
    dies of SIGSEGV when the port is taken, and starts a process given a larger process count
    than process 0's as if they agreed (jax 0.11; tests/test_distributed.py checks the abort).
    Here each is one ConfigError line. Process 0 waits ``timeout_s`` for each other's hello
    (``HELLO``, id, process count), answers ``go`` and frees the port; misfits are refused."""
    if num_processes == 1:
        return
    if process_id == 0:
        return _gather_peers(port, num_processes, timeout_s)
    wait_for_port(host, port, timeout_s)
    deadline = time.monotonic() + timeout_s
    with socket.create_connection((host, port), timeout=timeout_s) as conn:
        conn.sendall(f"{HELLO} {process_id} {num_processes}\n".encode())
        answer = _read_line(conn, deadline)
    if answer == "go":
        return
    if not answer:
        raise ConfigError(
            f"process 0 at {host}:{port} did not start the run within {timeout_s:g} s of this "
            f"process joining: not every process joined (process 0's error names them) or the "
            f"program there is not a jaxaccel process 0; check --coordinator and "
            f"--num-processes, or raise --distributed-timeout", field="mesh.coordinator")
    if answer.startswith("error: "):
        raise ConfigError(f"process 0 refused this process: {answer[7:]}",
                          field="mesh.num_processes" if "--num-processes" in answer
                          else "mesh.process_id")
    raise ConfigError(
        f"the program on coordinator {host}:{port} is not process 0 of a jaxaccel run (it "
        f"answered {answer[:40]!r}); check --coordinator (process 0's address and a free port)",
        field="mesh.coordinator")


def _gather_peers(port: int, num_processes: int, timeout_s: float) -> None:
    """Process 0's side of ``rendezvous``."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind(("", port))
        except OSError as error:
            raise ConfigError(
                f"process 0 cannot listen on port {port} ({error.strerror or error}): another "
                f"program uses it; pick a free port for --coordinator", field="mesh.coordinator"
            ) from None
        listener.listen(num_processes)
        deadline = time.monotonic() + timeout_s
        peers = {}
        try:
            while len(peers) < num_processes - 1:
                listener.settimeout(max(deadline - time.monotonic(), 0.01))
                try:
                    conn, _ = listener.accept()
                except socket.timeout:
                    missing = sorted(set(range(1, num_processes)) - set(peers))
                    raise ConfigError(
                        f"process(es) {', '.join(map(str, missing))} of {num_processes} did not "
                        f"join within {timeout_s:g} s; start every process with the same "
                        f"--coordinator and --num-processes and its own --process-id, or "
                        f"raise --distributed-timeout", field="mesh.distributed_timeout") from None
                problem, peer_id = _check_hello(conn, deadline, num_processes, peers)
                if problem:
                    with contextlib.suppress(OSError):  # a probe (wait_for_port) has gone
                        conn.sendall(f"error: {problem}\n".encode())
                    conn.close()
                    if peer_id is not None:       # a jaxaccel process with other settings
                        raise ConfigError(f"process {peer_id}: {problem}",
                                          field="mesh.num_processes" if "--num-processes"
                                          in problem else "mesh.process_id")
                    continue                      # a stray connection: not one of ours
                peers[peer_id] = conn
            for conn in peers.values():
                conn.sendall(b"go\n")
            for conn in peers.values():          # the peers close first: the port stays free
                conn.settimeout(5.0)
                with contextlib.suppress(OSError):
                    conn.recv(1)
        finally:
            for conn in peers.values():
                conn.close()


def _check_hello(conn, deadline: float, num_processes: int, peers: dict):
    """``(problem or None, the peer's id or None)`` of a connection's hello."""
    words = _read_line(conn, min(deadline, time.monotonic() + 10.0)).split()
    if len(words) != 3 or words[0] != HELLO or not all(w.isdigit() for w in words[1:]):
        return "not a jaxaccel process", None
    peer_id, count = int(words[1]), int(words[2])
    if count != num_processes:
        return (f"it was started with --num-processes {count}, process 0 with "
                f"{num_processes}; give every process the same count"), peer_id
    if not 0 < peer_id < num_processes or peer_id in peers:
        return (f"process id {peer_id} is " + ("taken" if peer_id in peers else "out of range")
                + f"; give each process its own --process-id in 1 .. {num_processes - 1}"), \
            peer_id
    return None, peer_id


def _read_line(conn, deadline: float) -> str:
    """One line from ``conn`` before ``deadline`` ("" if none comes)."""
    data = b""
    while not data.endswith(b"\n") and len(data) < 256:
        conn.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            chunk = conn.recv(256)
        except (socket.timeout, OSError):
            chunk = b""
        if not chunk:
            break
        data += chunk
    return data.decode("utf-8", "replace").strip()


def wait_for_port(host: str, port: int, timeout_s: float) -> None:
    """Return once ``host:port`` accepts a TCP connection; ConfigError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError as error:
            if time.monotonic() >= deadline:
                raise ConfigError(
                    f"coordinator {host}:{port} did not answer within {timeout_s:g} s "
                    f"({error.strerror or error}); start process 0 first, check the coordinator "
                    f"address and the network, or raise the timeout",
                    field="mesh.distributed_timeout") from None
            time.sleep(0.5)
