"""Any model jaxaccel trains: where it comes from, what it must offer, and its pure functions.

``--model`` names a preset of ``jaxaccel.model.gpt`` or a factory ``FILE.py:FUNCTION`` or
``package.module:FUNCTION``, ``factory(vocab_size, max_seq_len, *, rngs, **args) -> nnx.Module``
(``args``: ``--model-args``, YAML). The module follows the ``jaxaccel.model.nn`` contract; ``check``
says in one line what it lacks. Training works on pure functions of its ``nnx.State``:
``make_apply`` (the forward pass) and ``parts`` (the model cut at its stack, for pipelining).
"""

import dataclasses
import hashlib
import importlib
import importlib.util
import inspect
import math
import os
import sys
import sysconfig
import traceback
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import yaml
from flax import nnx

from jaxaccel.model import gpt, nn
from jaxaccel.core.errors import ConfigError
from jaxaccel.core.sections import (ModelConfig, describe, factory_file, is_preset,  # without jax
                               unknown_model)


def factory_args(cfg: ModelConfig) -> dict:
    """``--model-args`` as a dict: a YAML mapping, its braces optional on one line; one
    ConfigError line if it is not one."""
    if not cfg.args:
        return {}
    text = cfg.args.strip()
    try:
        args = yaml.safe_load(text if "\n" in text or text.startswith("{") else f"{{{text}}}")
    except yaml.YAMLError as e:
        args = str(e).splitlines()[0]
    if not isinstance(args, dict) or not all(str(k).isidentifier() for k in args):
        raise ConfigError(f"model_args {cfg.args!r} is not a mapping of names to values; write "
                          f"e.g. 'width: 128, depth: 2'", field="model.args")
    bare = [k for k, v in args.items() if v is None]
    if bare:      # `width` or `width:` (YAML's null): a value left out, never meant as None
        raise ConfigError(f"model_args {cfg.args!r} gives {bare[0]} no value; write "
                          f"'{bare[0]}: VALUE', or leave {bare[0]} out for the factory's default",
                          field="model.args")
    return args


def load_factory(name: str) -> Callable:
    """The factory ``--model`` names (a preset's: ``gpt.make``); a ConfigError if none loads."""
    if is_preset(name):
        if name not in gpt.PRESETS:
            raise unknown_model(name)
        return lambda vocab_size, max_seq_len, *, rngs, **args: gpt.make(
            vocab_size, max_seq_len, rngs=rngs, preset_name=name, **args)
    where, _, function = name.rpartition(":")
    if not where or not function:
        raise ConfigError(f"model {name!r} leaves out the {'file or module' if not where else 'function'}"
                          f"; give FILE.py:FUNCTION or package.module:FUNCTION", field="model.name")
    try:
        if where.endswith(".py"):
            if not os.path.isfile(where):
                raise ConfigError(f"model file {where} does not exist; give FILE.py:FUNCTION",
                                  field="model.name")
            module_name = "jaxaccel_model_" + os.path.splitext(os.path.basename(where))[0]
            spec = importlib.util.spec_from_file_location(module_name, os.path.abspath(where))
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except ConfigError:
        raise
    except Exception as e:      # noqa: BLE001 - the user's file: one line with where it failed
        raise ConfigError(f"model {name}: importing {where} failed: {_describe(e)}",
                          field="model.name") from None
    factory = getattr(module, function, None)
    if not callable(factory):
        raise ConfigError(f"model {name}: {where} has no function {function!r}", field="model.name")
    return factory


_STDLIB = sysconfig.get_paths()["stdlib"]


def _describe(error: BaseException) -> str:
    """``TypeError: ... (model.py:12)``: an exception and the last line of the user's code."""
    frames = traceback.extract_tb(error.__traceback__)
    ours = os.path.dirname(os.path.abspath(__file__))
    theirs = [f for f in frames if not os.path.abspath(f.filename).startswith(ours)
              and "site-packages" not in f.filename and not f.filename.startswith("<")
              and not os.path.abspath(f.filename).startswith(_STDLIB)]
    if isinstance(error, SyntaxError) and error.filename:     # raised by the compiler, no frame
        return (f"{type(error).__name__}: {error.msg} "
                f"({os.path.basename(error.filename)}:{error.lineno})")
    where = f" ({os.path.basename(theirs[-1].filename)}:{theirs[-1].lineno})" if theirs else ""
    return f"{type(error).__name__}: {error}{where}"


def build(cfg: ModelConfig, gpt_settings, key) -> nnx.Module:
    """The model of ``cfg`` initialised from ``key`` (``nnx.Rngs``' ``params`` stream; other
    streams, such as ``dropout``, from a key of their own), before any technique."""
    factory = load_factory(cfg.name)
    args = factory_args(cfg)
    if is_preset(cfg.name):
        args = {**{k: v for k, v in dataclasses.asdict(gpt_settings).items() if v is not None},
                **args}
    elif gpt_settings is not None:
        given = [k for k, v in dataclasses.asdict(gpt_settings).items() if v is not None]
        if given:
            raise ConfigError(f"--{given[0].replace('_', '-')} sets a field of jaxaccel's GPT "
                              f"presets, but --model {cfg.name} is a factory of its own; pass "
                              f"its arguments with --model-args", field=f"gpt.{given[0]}")
    rngs = nnx.Rngs(jax.random.fold_in(key, 1), params=key)
    try:
        inspect.signature(factory).bind(cfg.vocab_size, cfg.max_seq_len, rngs=rngs, **args)
    except TypeError as e:
        raise ConfigError(f"model {cfg.name}: the factory does not take (vocab_size, "
                          f"max_seq_len, rngs=..., {', '.join(args) or 'no --model-args'}): {e}",
                          field="model.args" if args else "model.name") from None
    if not is_preset(cfg.name):
        _check_arg_types(factory, args, cfg.name)
    try:
        with nnx.use_eager_sharding(False):
            model = factory(cfg.vocab_size, cfg.max_seq_len, rngs=rngs, **args)
    except ConfigError:
        raise
    except Exception as e:      # noqa: BLE001 - the user's code: one line with where it failed
        if is_preset(cfg.name):
            raise
        culprit = _culprit(factory, cfg, args)
        if culprit is not None and f"keyword argument '{culprit}'" in str(e):
            raise ConfigError(f"model {cfg.name}: model_args names {culprit}, which the factory "
                              f"passes on to what does not take it ({_describe(e)}); check the "
                              f"name, or leave it out", field="model.args") from None
        if culprit is not None:
            raise ConfigError(f"model {cfg.name}: model_args' {culprit}: {args[culprit]!r} is "
                              f"not a value the factory takes (it raised {_describe(e)}, and "
                              f"builds without {culprit}); give {culprit} another value, or "
                              f"leave it out", field="model.args") from None
        raise ConfigError(f"model {cfg.name}: the factory raised {_describe(e)}",
                          field="model.name") from None
    if not isinstance(model, nnx.Module):
        raise ConfigError(f"model {cfg.name}: the factory returned a {type(model).__name__}, "
                          f"not an nnx.Module", field="model.name")
    return model


# The --model-args value types a factory's annotation can be checked against before the call.
PLAIN_TYPES = {int: (int,), float: (int, float), bool: (bool,), str: (str,)}


def _check_arg_types(factory, args: dict, name: str) -> None:
    """A ConfigError for a ``--model-args`` value of another plain type (int, float, bool,
    str) than the factory's own parameter of that name is annotated with."""
    try:
        parameters = inspect.signature(factory, eval_str=True).parameters
    except Exception:       # noqa: BLE001 - an annotation that does not evaluate: unchecked
        return
    for key, value in args.items():
        wanted = getattr(parameters.get(key), "annotation", None)
        if wanted in PLAIN_TYPES and not (isinstance(value, PLAIN_TYPES[wanted])
                                          and not (isinstance(value, bool) and wanted is not bool)):
            raise ConfigError(f"model {name}: model_args gives {key} {value!r}, a "
                              f"{type(value).__name__}, but the factory's {key} is "
                              f"{wanted.__name__}; give {key} a value of that type",
                              field="model.args")


def _culprit(factory, cfg: ModelConfig, args: dict) -> str | None:
    """The ``--model-args`` name without which the factory builds, so the one its failure with
    them comes from (a value of the wrong type, a name a ``**options`` factory passes on to what
    does not take it), or None. Built abstractly: only the error path pays for it."""
    for key in args:
        rest = {k: v for k, v in args.items() if k != key}

        def make(rest=rest):
            with nnx.use_eager_sharding(False):
                return nnx.state(factory(cfg.vocab_size, cfg.max_seq_len,
                                         rngs=nnx.Rngs(0, params=1), **rest))
        try:
            inspect.signature(factory).bind(cfg.vocab_size, cfg.max_seq_len, rngs=None, **rest)
            jax.eval_shape(make)
        except Exception:       # noqa: BLE001 - it fails without this one too: not the cause
            continue
        return key
    return None


def abstract(make) -> nnx.Module:
    """``make()`` with ShapeDtypeStructs for arrays; unlike ``nnx.eval_shape`` it keeps logical
    axes (``out_sharding``) as metadata rather than shardings of the mesh in context."""
    graph = {}

    def state():
        graph["def"], variables = nnx.split(make())
        return variables

    variables = jax.eval_shape(state)
    return nnx.merge(graph["def"], variables)


# ---------------------------------------------------------------------------------------------
# What a run records of its model's code, to find it again and to tell when it changed.

def source_of(name: str) -> dict | None:
    """What a run records of the factory ``name`` (None for a preset): ``file`` (absolute) and
    ``sha256`` of its source; for ``package.module:FUNCTION`` also ``module``, and the file only
    where the module is one."""
    if is_preset(name):
        return None
    record, file = {}, factory_file(name)
    if file is None:
        record["module"] = name.rpartition(":")[0]
        file = _module_file(record["module"])
    if file is not None and os.path.isfile(file):
        with open(file, "rb") as f:
            record.update(file=os.path.abspath(file), sha256=hashlib.sha256(f.read()).hexdigest())
    return record


def _module_file(module: str) -> str | None:
    """The file of an importable module (imported already: the model was built from it)."""
    loaded = sys.modules.get(module)
    if loaded is not None:
        return getattr(loaded, "__file__", None)
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    return spec.origin if spec is not None and spec.has_location else None


def source_changed(recorded: dict | None, name: str) -> bool:
    """Whether the source of factory ``name`` differs from the one ``recorded`` (False when
    either is unknown: a preset, a run recorded before sources were, a module without file)."""
    now = source_of(name) or {}
    return bool(recorded and recorded.get("sha256") and now.get("sha256")
                and recorded["sha256"] != now["sha256"])


def source_warning(recorded: dict | None, name: str, run_dir: str, *,
                   flag: str | None = "--model") -> str | None:
    """One warning line if the model ``name``'s source is not the one ``recorded`` by the run
    in ``run_dir`` (its checkpoint still fits: it reads, but may not compute what it trained);
    ``flag``: the one that points at another file, if any. None if the source is the same."""
    if not source_changed(recorded, name):
        return None
    now = source_of(name)
    moved = f" (it trained {recorded['file']})" if recorded.get("file") != now["file"] else ""
    other = f", or point {flag} at the file the run trained with" if flag else ""
    return (f"warning: model file {now['file']} is not the source run {run_dir} trained "
            f"with{moved}: sha256 {recorded['sha256'][:12]} then, {now['sha256'][:12]} now; its "
            f"checkpoint fits, but the model may not compute what it trained: restore the "
            f"file{other}")


def describe_source(name: str, recorded: dict | None) -> str:
    """``the model NAME`` for a checkpoint's line, with a module's file, and whether the
    source changed since the run ``recorded`` it."""
    now = source_of(name) or {}
    notes = ([f"file {now['file']}"] if "module" in now and "file" in now else []) + (
        ["its source changed since the run trained"] if source_changed(recorded, name) else [])
    return f"the model {name}" + (f" ({', '.join(notes)})" if notes else "")


# ---------------------------------------------------------------------------------------------
# The contract, checked before any work.

def call_arguments(model) -> set[str]:
    """Which of ``positions`` and ``segment_ids`` the model's call takes."""
    try:
        parameters = inspect.signature(type(model).__call__).parameters
    except (TypeError, ValueError):
        return {"positions", "segment_ids"}
    if any(p.kind == p.VAR_KEYWORD for p in parameters.values()):
        return {"positions", "segment_ids"}
    return {"positions", "segment_ids"} & set(parameters)


def check(model, name: str, *, vocab_size: int, packed: bool, pipelined: bool = False) -> None:
    """A ConfigError if ``model`` cannot train as configured: its call must take the ids (packed
    rows: with ``positions`` and ``segment_ids``) and give float logits of the vocabulary's size,
    it must hold weights that train, and call each ``nn.Stack`` it has (once, for pipeline
    stages, which cut the model at its stack)."""
    if not callable(model):
        raise ConfigError(f"model {name}: {type(model).__name__} has no __call__",
                          field="model.name")
    missing = {"positions", "segment_ids"} - call_arguments(model)
    if packed and missing:
        raise ConfigError(f"model {name}: --batching pack puts several documents in a row, so "
                          f"the model's call must take {' and '.join(sorted(missing))}= (and "
                          f"mask attention by segment); add them, or use --batching fixed, "
                          f"dynamic or bucket", field="data.batching")
    graphdef, state = nnx.split(model)
    _check_trainable(state, name)
    batch = probe_batch()
    rows = batch["inputs"].shape[0]
    called = []

    def counted(stack, x, token_args):      # the stack runs as it would, counted
        called.append(stack)
        with nn.step(stack=None):
            return stack(x, **token_args)

    try:
        with nn.step(stack=counted):
            logits = jax.eval_shape(make_apply(graphdef, segment_attention=packed), state, batch)
    except ConfigError:
        raise
    except Exception as e:      # noqa: BLE001 - the user's code: one line with where it failed
        raise ConfigError(f"model {name}: its forward pass on ids [{rows}, 8] failed: "
                          f"{_describe(e)}", field="model.name") from None
    shape = getattr(logits, "shape", None)
    if shape != (rows, 8, vocab_size):
        alone = "; return the logits alone" if isinstance(logits, (tuple, list)) else ""
        raise ConfigError(f"model {name}: ids [{rows}, 8] gave {_what(logits)}, not logits "
                          f"[{rows}, 8, {vocab_size}] (the tokenizer's padded vocabulary, the "
                          f"factory's vocab_size){alone}", field="model.name")
    if not jnp.issubdtype(logits.dtype, jnp.floating):
        raise ConfigError(f"model {name}: its logits are {logits.dtype}, not a float dtype: the "
                          f"loss would have no gradient and nothing would train; return the "
                          f"head's output as it is (no cast to an integer type)",
                          field="model.name")
    _check_stack_calls(model, name, called, pipelined)


def _what(value) -> str:
    """What a forward pass gave instead of logits, in a few words."""
    if isinstance(value, (tuple, list)):
        inner = ", ".join(str(list(v.shape)) if hasattr(v, "shape") else type(v).__name__
                          for v in value)
        return f"a {type(value).__name__} ({inner})"
    shape = getattr(value, "shape", None)
    return str(shape) if shape is not None else type(value).__name__


def _check_trainable(state, name: str) -> None:
    """A ConfigError if nothing in ``state`` would train (``nn.trainable``: no ``nnx.Param``)."""
    if sum(x.size for x in jax.tree.leaves(nnx.filter_state(state, nn.trainable(state)))):
        return
    held = sorted({("nnx." if type(v).__module__.startswith("flax") else "") + type(v).__name__
                   for _, v in nnx.to_flat_state(state) if jnp.issubdtype(v.dtype, jnp.floating)})
    raise ConfigError(f"model {name} has no nnx.Param, so nothing would train"
                      + (f" (its weights are {', '.join(held)})" if held else "")
                      + "; declare its weights as nnx.Param (as nnx.Linear and nnx.Embed do)",
                      field="model.name")


def _check_stack_calls(model, name: str, called: list, pipelined: bool) -> None:
    """Every ``nn.Stack`` runs in the forward pass; pipeline stages need it run once."""
    found = nn.stacks(model)
    if len({id(s) for s in called}) < len(found):
        where = (".".join(map(str, found[0][0])) if len(found) == 1 else
                 f"one of its {len(found)}")
        raise ConfigError(f"model {name} never calls its nn.Stack ({where}) in its forward pass: "
                          f"those blocks would never train and block techniques would act on "
                          f"nothing; call it once in __call__ (x = self.blocks(x, ...))",
                          field="model.name")
    if pipelined and len(called) > 1:
        raise ConfigError(f"model {name} calls its nn.Stack {len(called)} times, but pipeline "
                          f"stages run the stack once, between the model's code before and after "
                          f"it: the staged model would compute another function; call it once, "
                          f"or choose a strategy without pp", field="mesh.strategy")


def probe_batch() -> dict:
    """ShapeDtypeStructs of ids [rows, 8] with positions and segment ids, to trace a model on:
    rows 2, or as many as the mesh in context splits over its batch axes (Explicit axes refuse
    an uneven split)."""
    mesh = jax.sharding.get_abstract_mesh()
    rows = max(2, 1 if mesh.empty else math.prod(mesh.shape.get(a, 1) for a in ("data", "fsdp")))
    return {k: jax.ShapeDtypeStruct((rows, 8), jnp.int32)
            for k in ("inputs", "positions", "segment_ids")}


def forward_jaxpr(model, what: str, field: str):
    """The jaxpr of ``model``'s forward pass on ``probe_batch`` (traced, nothing computed), for
    ``what`` reads it; a ConfigError line naming ``field`` with the user's line if it fails."""
    graphdef, state = nnx.split(model)
    batch = probe_batch()
    try:
        return jax.make_jaxpr(make_apply(graphdef, segment_attention=False))(state, batch)
    except ConfigError:
        raise
    except Exception as e:      # noqa: BLE001 - the user's code: one line with where it failed
        raise ConfigError(f"{what} traces the model's forward pass, which failed on ids "
                          f"{list(batch['inputs'].shape)}: {_describe(e)}", field=field) from None


# ---------------------------------------------------------------------------------------------
# Pure functions of the state.

def make_apply(graphdef, *, segment_attention: bool = True):
    """``apply(state, batch, key=None) -> logits [B, T, V]``; ``key`` (training) reseeds the
    ``nnx.Rngs`` streams and reaches the blocks through ``nn.step``. ``segment_attention=False``
    (a document per row from column 0: every batching but pack) passes no segment ids: causal
    attention alone changes no real token's output. ``apply.graphdef`` is ``graphdef``: what
    ``train.lm_train_step`` finds the model's buffer updates in."""
    takes = None

    def apply(state, batch, key=None):
        nonlocal takes
        model = nn.in_step_dtype(nnx.merge(graphdef, state))     # precision.cast's 16 bits
        if takes is None:
            takes = call_arguments(model)
        if key is not None:
            nn._reseed(model, key)
        kwargs = {"positions": batch.get("positions")}
        if segment_attention:
            kwargs["segment_ids"] = batch.get("segment_ids")
        with nn.step(key=key, batch=batch):
            return model(batch["inputs"], **{k: v for k, v in kwargs.items() if k in takes})

    apply.graphdef = graphdef
    return apply


def eval_graphdef(graphdef, abstract_state):
    """The graph of the model in evaluation mode (``Module.eval``: ``nnx.Dropout`` off)."""
    model = nnx.merge(graphdef, abstract_state)
    model.eval()
    return nnx.graphdef(model)


def sequence_batch(ids_BT):
    """The Batch of whole sequences ``ids_BT``: one segment per row, positions from 0."""
    B, T = ids_BT.shape
    return {"inputs": ids_BT,
            "positions": jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)),
            "segment_ids": jnp.ones((B, T), jnp.int32)}


def count_params(state) -> int:
    """Weights (``nnx.Param``) in a model's state; buffers and RNG state are not counted."""
    return sum(x.size for x in jax.tree.leaves(nnx.filter_state(state, nnx.Param)))


class _Captured(Exception):
    def __init__(self, x, token_args):
        super().__init__("the model's stack was reached")
        self.x, self.token_args = x, token_args


class Parts(NamedTuple):
    """The model cut at its stack: ``embed(state, batch) -> (x, token_args)``, ``blocks(
    stack_state, x, token_args, batch, key, first_layer, total_layers) -> x`` (``stack_of(state)``
    or a stage's slice), ``head(state, batch, x) -> logits``."""

    embed: Callable
    blocks: Callable
    head: Callable
    stack_path: tuple


def parts(graphdef, abstract_state, *, segment_attention: bool = True) -> Parts:
    """The model's ``Parts``: its own forward pass run up to its ``nn.Stack`` (which raises what
    it was given) or from it (which returns the given hidden states), whatever its code."""
    model = nnx.merge(graphdef, abstract_state)
    stack_path, stack = nn.the_stack(model, "pipeline parallelism", "mesh.strategy")
    stack_graphdef = nnx.graphdef(stack)
    apply = make_apply(graphdef, segment_attention=segment_attention)

    def embed(state, batch):
        def capture(stack, x, token_args):
            raise _Captured(x, token_args)
        try:
            with nn.step(stack=capture):
                apply(state, batch)
        except _Captured as reached:
            return reached.x, reached.token_args
        raise ValueError("the model never called its stack")

    def blocks(stack_state, x, token_args, batch, key, first_layer, total_layers):
        with nn.step(key=key, batch=batch, first_layer=first_layer, total_layers=total_layers):
            return nn.in_step_dtype(nnx.merge(stack_graphdef, stack_state))(x, **token_args)

    def head(state, batch, x):
        with nn.step(stack=lambda stack, _, token_args: x):
            return apply(state, batch)

    return Parts(embed, blocks, head, stack_path)


def stack_of(state, stack_path: tuple):
    """The sub-state of the stack at ``stack_path``."""
    for key in stack_path:
        state = state[key]
    return state


def split_at(state, path: tuple):
    """``(rest, sub)``: ``state`` less the variables under ``path``, and those (paths below it)."""
    flat = list(nnx.to_flat_state(state))
    inside = [(p[len(path):], v) for p, v in flat if tuple(p[:len(path)]) == tuple(path)]
    outside = [(p, v) for p, v in flat if tuple(p[:len(path)]) != tuple(path)]
    return nnx.from_flat_state(outside), nnx.from_flat_state(inside)


def join_at(rest, path: tuple, sub):
    """``split_at``'s inverse: ``rest`` with ``sub``'s variables put under ``path``."""
    flat = list(nnx.to_flat_state(rest)) + [((*path, *p), v) for p, v in nnx.to_flat_state(sub)]
    return nnx.from_flat_state(flat)
