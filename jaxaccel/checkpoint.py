"""Orbax checkpoints of the whole TrainState, with the loader position and the run's config.

A checkpoint holds ``state`` (the TrainState) and ``meta`` (JSON: loader position, the config
that shapes the state and the data order, recent losses); restoring checks the config first. An
asynchronous save is written by a background thread that the next ``save``, ``wait`` or
``close`` waits for. A failed write (a full disk, a read-only folder) is one
``CheckpointWriteError`` line naming the step and the checkpoint kept.
"""

import contextlib
import errno
import os

import jax
import orbax.checkpoint as ocp

from jaxaccel.errors import ConfigError


# Version of what a checkpoint holds: 2, any NNX model's TrainState (1: jaxaccel's GPT's dict).
FORMAT = 2


class Checkpointer:
    """Saves and restores checkpoints under ``directory`` (one subdirectory per step)."""

    def __init__(self, directory: str, *, max_to_keep: int = 2, keep_period: int | None = None,
                 asynchronous: bool = False):
        """Keeps the ``max_to_keep`` latest checkpoints and every one whose step is a multiple
        of ``keep_period`` (None: none); ``asynchronous`` writes saves in the background."""
        self.directory = os.path.abspath(directory)
        self._manager = ocp.CheckpointManager(self.directory, options=ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, keep_period=keep_period or None,
            enable_async_checkpointing=asynchronous, create=True))
        self._pending = None            # the step being written in the background
        self.saved_history = []

    def latest_step(self) -> int | None:
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

    def restore(self, target_state, *, config: dict, may_differ: tuple[str, ...] = ()):
        """``(state, loader_position, step)`` of the latest checkpoint, in ``target_state``'s
        structure; ``saved_config`` then holds its settings. ConfigError if there is none, if it
        has another ``config`` (``may_differ``'s keys aside) or cannot be read."""
        step = self.latest_step()
        if step is None:
            raise ConfigError(
                f"no checkpoint in {self.directory}; start without resume or pass the run_dir of "
                f"an earlier run", field="run.run_dir")
        where = os.path.join(self.directory, str(step))
        meta = self._read(step, meta=ocp.args.JsonRestore())["meta"]
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
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target_state)
        state = self._read(step, state=ocp.args.StandardRestore(abstract))["state"]
        return state, meta["loader_position"], step

    def _read(self, step: int, **items):
        """Restore ``items`` of the checkpoint at ``step``; one ConfigError line if unreadable."""
        try:
            return self._manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as e:
            reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
            raise ConfigError(
                f"checkpoint {os.path.join(self.directory, str(step))} is unreadable "
                f"({type(e).__name__}: {reason}); delete that step's directory to fall back to "
                f"an earlier one, or start a new run_dir", field="run.run_dir") from None

    def close(self):
        """Wait for a save in the background (CheckpointWriteError if it failed), then close."""
        try:
            self.wait()
        finally:
            self._manager.close()


class CheckpointWriteError(ConfigError):
    """A checkpoint that could not be written: the step, why, and the checkpoint kept."""


@contextlib.contextmanager
def _write_errors(checkpointer: Checkpointer, step: int):
    """Turns an OSError of a save (anywhere in the exception's chain, as orbax wraps the
    background thread's errors) into one ``CheckpointWriteError`` line."""
    try:
        yield
    except BaseException as error:
        cause = _os_error(error)
        if cause is None:
            raise
        checkpointer._pending = None
        steps = [s for s in checkpointer._manager.all_steps() if s != step]
        kept = (f"the checkpoint of step {max(steps)} is kept" if steps
                else "no earlier checkpoint exists")
        full = cause.errno in (errno.ENOSPC, errno.EDQUOT)
        raise CheckpointWriteError(
            f"the checkpoint of step {step} could not be written in {checkpointer.directory} "
            f"({cause.strerror or cause}); {kept}; "
            + ("free disk space" if full else "make the folder writable")
            + " and continue with --resume, or pass another run_dir", field="run.run_dir") \
            from None


def _os_error(error: BaseException | None) -> OSError | None:
    """The first OSError in ``error``'s chain of causes and contexts (None: none)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None
