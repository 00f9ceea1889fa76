"""Orbax checkpoints of the whole TrainState, with the loader position and the run's config.

A checkpoint holds ``state`` (the TrainState) and ``meta`` (JSON: loader position, the config
that shapes the state and the data order, recent losses); restoring checks the config first. An
asynchronous save is written by a background thread that the next ``save``, ``wait`` or
``close`` waits for. A failed write (a full disk, a read-only folder) is one
``CheckpointWriteError`` line naming the step and the checkpoint kept: checked before each save
where it can be (the folder writable, room for the state), else caught from orbax, whose own
reports of that failure (absl log records, tensorstore's callbacks finding their event loop
closed) are dropped, as the line says it all; the directory of a step is made in ``save``
itself, so no background thread is left waiting for one that could not be made. Orbax is
imported when a checkpoint is first read or written, not before: a new run starts without it
(about 0.15 s of a 1 ms step's start-up).
"""

import contextlib
import errno
import functools
import json
import logging
import os
import re
import shutil
import sys
import tempfile

import jax

from jaxaccel.core.errors import ConfigError


# Version of what a checkpoint holds: 2, any NNX model's TrainState (1: jaxaccel's GPT's dict).
FORMAT = 2
# What a checkpoint that does not fit the model says to do, unless the caller knows better.
FIX = "restore the model as it was when the run trained, or start a new run_dir"


class Checkpointer:
    """Saves and restores checkpoints under ``directory`` (one subdirectory per step)."""

    def __init__(self, directory: str, *, max_to_keep: int = 2, keep_period: int | None = None,
                 asynchronous: bool = False):
        """Keeps the ``max_to_keep`` latest checkpoints and every one whose step is a multiple
        of ``keep_period`` (None: none); ``asynchronous`` writes saves in the background."""
        self.directory = os.path.abspath(directory)
        os.makedirs(self.directory, exist_ok=True)
        _quiet_orbax_write_failures()
        self._options = dict(max_to_keep=max_to_keep, keep_period=keep_period or None,
                             enable_async_checkpointing=asynchronous)
        self._pending = None            # the step being written in the background
        self._closed = False
        self.saved_history = []

    @functools.cached_property
    def _manager(self):
        ocp = _orbax()
        return ocp.CheckpointManager(self.directory, options=ocp.CheckpointManagerOptions(
            **self._options, create=True,
            # the step's directory made in save(): a folder that cannot be written fails there,
            # not in a thread that the commit threads would wait for until orbax's timeout
            async_options=ocp.options.AsyncOptions(create_directories_asynchronously=False)))

    def latest_step(self) -> int | None:
        if not any(name.isdigit() for name in os.listdir(self.directory)):
            return None             # no step's directory: orbax need not be asked (nor imported)
        return self._manager.latest_step()

    def save(self, step: int, state, *, loader_position: dict, config: dict,
             history: list | None = None):
        """Write the state and metadata at ``step`` (no-op if that step is already saved);
        ``history``: the recent (loss, real tokens) pairs of the steps before it."""
        self.wait()
        if step in self._manager.all_steps():
            return
        self._pending = step
        with _write_errors(self, step):
            _check_room(self.directory, state)
            ocp = _orbax()
            self._manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                meta=ocp.args.JsonSave({"format": FORMAT, "loader_position": loader_position,
                                        "config": config, "recent_history": history or []})))

    def wait(self):
        """Wait for a save in the background; CheckpointWriteError if it failed."""
        if self._pending is None:
            return
        with _write_errors(self, self._pending):
            self._manager.wait_until_finished()
        self._pending = None

    def restore(self, target_state, *, config: dict, may_differ: tuple[str, ...] = (),
                model: str = "the model given", fix: str = FIX, field: str = "run.run_dir"):
        """``(state, loader_position, step)`` of the latest checkpoint, in ``target_state``'s
        structure; ``saved_config`` then holds its settings. ConfigError if there is none, if it
        has another ``config`` (``may_differ``'s keys aside), if its arrays do not fit
        ``target_state`` (``check_fits``: ``model``, ``fix`` and ``field`` are its words) or it
        cannot be read."""
        step, meta = self.check_settings(config, may_differ)
        self.check_fits(target_state, step, model=model, fix=fix, field=field)
        ocp = _orbax()
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target_state)
        state = self._read(step, state=ocp.args.StandardRestore(abstract))["state"]
        return state, meta["loader_position"], step

    def check_settings(self, config: dict, may_differ: tuple[str, ...] = ()) -> tuple:
        """``(step, meta)`` of the latest checkpoint, after checking that there is one, in this
        format, of the same ``config`` (``may_differ``'s keys aside): one ConfigError line if not.
        ``saved_config`` and ``saved_history`` then hold what it recorded."""
        step = self.latest_step()
        if step is None:
            raise ConfigError(
                f"no checkpoint in {self.directory}; start without resume or pass the run_dir of "
                f"an earlier run", field="run.run_dir")
        where = os.path.join(self.directory, str(step))
        meta = self.check_meta(step)
        if meta.get("format", 1) != FORMAT:
            raise ConfigError(
                f"checkpoint {where} is in format {meta.get('format', 1)} (written before the "
                f"model became any NNX model's state); this version reads format {FORMAT}: "
                f"train a new run_dir, or finish that run with the jaxaccel that wrote it",
                field="run.run_dir")
        mismatched = [f"{key}={meta['config'].get(key)!r} (now {value!r})"
                      for key, value in config.items()
                      if key not in may_differ and meta.get("config", {}).get(key) != value]
        self.saved_config = meta.get("config", {})
        self.saved_history = [tuple(pair) for pair in meta.get("recent_history", [])]
        if mismatched:
            raise ConfigError(
                f"checkpoint {where} was written with other settings: {', '.join(mismatched)}; "
                f"resume with the same settings or start a new run_dir", field="run.run_dir")
        return step, meta

    def check_fits(self, target_state, step: int, *, model: str = "the model given",
                   fix: str = FIX, field: str = "run.run_dir"):
        """One ``CheckpointMisfit`` line, before reading any array, if the checkpoint at
        ``step`` holds arrays of other shapes than ``target_state`` (arrays or
        ShapeDtypeStructs), or other arrays: the first few parameters with both shapes, their
        count, ``model`` (what the state is of: ``"the model m.py:make"``) and ``fix``. Orbax's
        own error for it reads as a damaged checkpoint; this one is readable and intact."""
        saved = self._saved_shapes(step)
        if saved is None or target_state is None:
            return                  # no metadata to compare: the read itself says what fails
        wanted = _shapes(_orbax().tree.serialize_tree(target_state, keep_empty_nodes=True))
        groups = (({k: f"checkpoint {saved[k]}, model {wanted[k]}" for k in wanted
                    if k in saved and saved[k] != wanted[k]}, ("differs", "differ"), "in shape"),
                  ({k: "" for k in saved if k not in wanted}, ("is", "are"),
                   "only in the checkpoint"),
                  ({k: "" for k in wanted if k not in saved}, ("is", "are"), "only in the model"))
        if not any(found for found, _, _ in groups):
            return
        named = [({_parameter(k): v for k, v in found.items() if k[:1] == ("params",)}, verb, what)
                 for found, verb, what in groups]
        noun = ("parameter", "parameters")
        if not any(found for found, _, _ in named):     # the parameters fit, the rest does not
            named = [({"/".join(k): v for k, v in found.items()}, verb, what)
                     for found, verb, what in groups]
            noun = ("array of the state", "arrays of the state")
        parts = [f"{len(found)} {noun[len(found) > 1]} {verb[len(found) > 1]} {what} "
                 f"({_first(found)})" for found, verb, what in named if found]
        raise CheckpointMisfit(
            f"checkpoint {os.path.join(self.directory, str(step))} does not fit {model}: "
            f"{'; '.join(parts)}; it and every other checkpoint in {self.directory} are intact "
            f"(nothing was changed): {fix}", field=field)

    def _saved_shapes(self, step: int) -> dict | None:
        """``{path: shape}`` of the arrays in the checkpoint at ``step`` from its metadata
        (no array is read); None if the metadata cannot be read."""
        ocp = _orbax()
        from etils import epath     # orbax's own path type, a dependency of orbax
        try:
            metadata = ocp.StandardCheckpointHandler().metadata(
                epath.Path(os.path.join(self.directory, str(step), "state")))
        except Exception:           # noqa: BLE001 - damaged: restoring says what and where
            return None
        return _shapes(getattr(metadata, "tree", metadata))

    def check_meta(self, step: int | None = None, *, field: str = "run.run_dir") -> dict | None:
        """The meta of the checkpoint at ``step`` (None: the latest; None if there is none).
        One ConfigError line if it is not JSON or lacks what a restore reads, naming the step
        and the latest earlier checkpoint whose meta is complete; ``field``: where it came from
        (``run.run_dir`` to resume, ``run.init_from`` for the weights)."""
        step = self.latest_step() if step is None else step
        if step is None:
            return None
        meta, problem = self._meta(step)
        if problem is None:
            return meta
        where = os.path.join(self.directory, str(step))
        earlier = next((s for s in sorted(self._manager.all_steps(), reverse=True)
                        if s < step and self._meta(s)[1] is None), None)
        use, other = (("resume from it", "start a new run_dir") if field == "run.run_dir" else
                      ("take its weights", f"pass another run as {field.split('.')[-1]}"))
        then = (f"the checkpoint of step {earlier} is complete: delete {where} to {use}, or {other}"
                if earlier is not None else f"no earlier checkpoint is complete: {other}")
        raise ConfigError(
            f"run dir {os.path.dirname(self.directory)}: the metadata of its checkpoint of step "
            f"{step} is incomplete or damaged ({os.path.join(where, 'meta', 'metadata')} "
            f"{problem}); {then}", field=field)

    def _meta(self, step: int) -> tuple[dict | None, str | None]:
        """``(meta, None)`` of the checkpoint at ``step``, or ``(None, what is wrong)``."""
        ocp = _orbax()
        try:
            meta = self._manager.restore(step, args=ocp.args.Composite(
                meta=ocp.args.JsonRestore()))["meta"]
        except json.JSONDecodeError as e:
            return None, f"is not valid JSON: {e}"
        except Exception as e:      # noqa: BLE001 - a missing file: orbax's own error types
            reason = (str(e).strip().splitlines() or [""])[0][:200]
            return None, f"could not be read: {type(e).__name__}: {reason}"
        if not isinstance(meta, dict):
            return None, f"holds a JSON {type(meta).__name__}, not an object"
        types = {"loader_position": dict, "config": dict, "recent_history": list}
        absent = [key for key in ("loader_position", "config") if key not in meta]
        malformed = [key for key, kind in types.items()
                     if key in meta and not isinstance(meta[key], kind)]
        problems = ([f"lacks {', '.join(absent)}"] if absent else []) + (
            [f"has a malformed {', '.join(malformed)}"] if malformed else [])
        return (None, " and ".join(problems)) if problems else (meta, None)

    def _read(self, step: int, **items):
        """Restore ``items`` of the checkpoint at ``step``; one ConfigError line if unreadable."""
        try:
            return self._manager.restore(step, args=_orbax().args.Composite(**items))
        except Exception as e:
            reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
            raise ConfigError(
                f"checkpoint {os.path.join(self.directory, str(step))} is unreadable "
                f"({type(e).__name__}: {reason}); delete that step's directory to fall back to "
                f"an earlier one, or start a new run_dir", field="run.run_dir") from None

    def close(self):
        """Wait for a save in the background (CheckpointWriteError if it failed), then close;
        closing again does nothing."""
        try:
            self.wait()
        finally:
            if not self._closed:
                self._closed = True
                if "_manager" in self.__dict__:         # made (orbax imported) at first use
                    self._manager.close()


class CheckpointMisfit(ConfigError):
    """A readable checkpoint whose arrays do not fit the model to restore (``check_fits``)."""


def _shapes(tree) -> dict[tuple, tuple]:
    """``{path: shape}`` of the arrays (or their metadata) in a tree of dicts and lists, as a
    checkpoint stores them: a typed PRNG key as its key data (a threefry key: 2 more words)."""
    flat = _orbax().tree.to_flat_dict(tree)
    return {tuple(str(k) for k in key): _stored_shape(leaf) for key, leaf in flat.items()
            if getattr(leaf, "shape", None) is not None}


def _stored_shape(leaf) -> tuple:
    dtype = getattr(leaf, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return tuple(jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(
            leaf.shape, dtype)).shape)
    return tuple(leaf.shape)


def _parameter(key: tuple) -> str:
    """A parameter's path in the model (``blocks/layers/0/fc1/kernel``) from its path in a
    checkpoint's state (``params/blocks/layers/0/fc1/kernel/value``)."""
    return "/".join(key[1:-1] if key[-1] == "value" else key[1:])


def _first(found: dict, count: int = 3) -> str:
    """``path: shapes`` of the first ``count`` entries of ``found``, then how many more."""
    shown = [f"{path}: {shapes}" if shapes else path for path, shapes in found.items()]
    more = f"; and {len(shown) - count} more" if len(shown) > count else ""
    return "; ".join(shown[:count]) + more


class CheckpointWriteError(ConfigError):
    """A checkpoint that could not be written: the step, why, and the checkpoint kept."""


@contextlib.contextmanager
def _write_errors(checkpointer: Checkpointer, step: int):
    """Turns a failed write of a save (an OSError anywhere in the exception's chain, as orbax
    wraps the background thread's errors, or tensorstore's error with an OS error code) into
    one ``CheckpointWriteError`` line."""
    try:
        yield
    except BaseException as error:
        cause = _os_error(error)
        if cause is None:
            raise
        checkpointer._pending = None
        steps = [s for s in checkpointer._manager.all_steps() if s != step]
        full = cause.errno in (errno.ENOSPC, errno.EDQUOT)
        fix = "free disk space" if full else "make the folder writable"
        then = (f"the checkpoint of step {max(steps)} is kept; {fix} and continue with --resume"
                if steps else f"no earlier checkpoint exists; {fix} and run the command again "
                              f"(it starts over)")
        raise CheckpointWriteError(
            f"the checkpoint of step {step} could not be written in {checkpointer.directory} "
            f"({cause.strerror or cause}); {then}, or pass another run_dir",
            field="run.run_dir") from None


def _check_room(directory: str, state):
    """OSError, before orbax starts writing, if ``directory`` cannot take a file or has less
    room than the state's bytes (what a checkpoint holds; orbax does not compress it)."""
    tempfile.TemporaryFile(dir=directory).close()
    needed = sum(getattr(leaf, "nbytes", 0) for leaf in jax.tree.leaves(state))
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)}: {free:,} bytes free, the "
                                    f"checkpoint needs {needed:,}")


_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")


def _os_error(error: BaseException | None) -> OSError | None:
    """The first OSError in ``error``'s chain of causes and contexts, or one made from the OS
    error code tensorstore puts in its messages (``[os_error_code='28']``); None: neither."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError):
            return error
        code = _OS_ERROR_CODE.search(str(error))
        if code:
            return OSError(int(code.group(1)), os.strerror(int(code.group(1))))
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


@functools.cache
def _orbax():
    """orbax.checkpoint, imported at the first checkpoint read or written, with jaxaccel's
    handler of replicated arrays installed."""
    import orbax.checkpoint as ocp
    _whole_replicas(ocp)
    return ocp


def _whole_replicas(ocp):
    """Have orbax write each replicated array from one replica, whole (installed once per
    process, for every orbax save in it). Its default splits a replicated array among the
    replicas, compiling a slicing program per array and replica: saving 40 small arrays on an
    8-device mesh took 53 s that way and 0.3 s this way (2 busy CPU cores), the same files."""
    # orbax's own handler's metadata store comes along: it records what restoring needs
    # beyond shape and dtype (a typed PRNG key is restored as a key, not as its uint32 data)
    store = getattr(ocp.type_handlers.get_type_handler(jax.Array), "_array_metadata_store",
                    None)
    absl_log = logging.getLogger("absl")
    level = absl_log.level
    absl_log.setLevel(logging.ERROR)        # orbax warns of the override it was asked for
    try:
        ocp.type_handlers.register_type_handler(
            jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False,
                                                      array_metadata_store=store),
            override=True)
    finally:
        absl_log.setLevel(level)


def _quiet_orbax_write_failures():
    """Drop (installed once per process) orbax's own reports of a failed write, which the
    ``CheckpointWriteError`` line replaces: its absl log records of it (with their tracebacks),
    asyncio's of the write's futures never awaited, tensorstore's callbacks that find the
    write's event loop closed, and the write's coroutines collected at exit. Everything else
    reaches the log and ``sys.unraisablehook``."""
    for name in ("absl", "asyncio"):    # orbax's log; a gather of the write never awaited
        logger = logging.getLogger(name)
        if _not_a_write_failure not in logger.filters:
            logger.addFilter(_not_a_write_failure)
    if getattr(sys.unraisablehook, "_jaxaccel", False):
        return
    previous = sys.unraisablehook

    def hook(unraisable):
        value, obj = unraisable.exc_value, unraisable.object
        leftover = (isinstance(value, RuntimeError) and str(value) == "Event loop is closed"
                    and obj is None) or "/orbax/" in getattr(
                        getattr(obj, "cr_code", None), "co_filename", "")
        if not leftover:
            previous(unraisable)

    hook._jaxaccel = True
    sys.unraisablehook = hook


def _not_a_write_failure(record: logging.LogRecord) -> bool:
    """False for a log record of a failed write of orbax's: it holds the write's error and
    comes from orbax, or its traceback passes through orbax, or the error names orbax's
    temporary checkpoint directory (tensorstore's, set on a future from outside Python)."""
    error = record.exc_info[1] if record.exc_info else None
    if _os_error(error) is None:
        return True
    frames, tb = [record.pathname], error.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_filename)
        tb = tb.tb_next
    return not (any("/orbax/" in name for name in frames)
                or ".orbax-checkpoint-tmp" in str(error))
