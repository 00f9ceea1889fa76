"""Orbax checkpoints of the whole TrainState, with the loader position and the run's config.

A checkpoint holds ``state`` (the TrainState pytree) and ``meta`` (JSON: the data loader's
position, the config that shapes the state and the data order, and the recent per-step training
losses the summary's train bits per byte is taken over). Restoring checks the config first, so a
run resumed with other shapes fails with one clear line instead of a stack trace.

Saving is asynchronous by default (orbax's async checkpointing): ``save`` returns once the state
is copied to the host, and the files are written in a background thread into a temporary
directory that orbax renames when complete; the next ``save``, ``wait`` or ``close`` waits for
it. A write that fails (a full disk, a read-only or vanished folder) is one ConfigError line
naming the step and the checkpoint that is kept (``CheckpointWriteError``); the unfinished
temporary directory is removed by the next start (``loop.remove_unfinished_checkpoints``).
"""

import errno
import os

import jax
import orbax.checkpoint as ocp

from jaxaccel.errors import ConfigError


# Version of what a checkpoint holds: 2 is the TrainState of any NNX model (``nnx.State``
# parameters, technique state as variables of their own types); 1 was jaxaccel's GPT's dict.
FORMAT = 2


class Checkpointer:
    """Saves and restores checkpoints under ``directory`` (one subdirectory per step)."""

    def __init__(self, directory: str, *, max_to_keep: int = 2, keep_period: int | None = None,
                 asynchronous: bool = False):
        """``max_to_keep`` latest checkpoints are kept, and besides them every one whose step
        is a multiple of ``keep_period`` (None: none); ``asynchronous``: saves are written in
        the background."""
        self.directory = os.path.abspath(directory)
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep, keep_period=keep_period or None,
                enable_async_checkpointing=asynchronous, create=True),
        )
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
        with self._writing(step):
            self._manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                meta=ocp.args.JsonSave({"format": FORMAT, "loader_position": loader_position,
                                        "config": config, "recent_history": history or []}),
            ))

    def wait(self):
        """Wait for a save in the background; CheckpointWriteError if it failed."""
        if self._pending is None:
            return
        with self._writing(self._pending):
            self._manager.wait_until_finished()
        self._pending = None

    def _writing(self, step: int):
        return _WriteErrors(self, step)

    def restore(self, target_state, *, config: dict, may_differ: tuple[str, ...] = ()):
        """Restore the latest checkpoint into the structure of ``target_state``.

        Returns ``(state, loader_position, step)``; ``saved_config`` then holds the settings it
        was written with. Raises ConfigError if there is no checkpoint, if it was written with
        another config (the keys of ``may_differ`` aside), or if it cannot be read.
        """
        step = self.latest_step()
        if step is None:
            raise ConfigError(
                f"no checkpoint in {self.directory}; start without resume or pass the run_dir of "
                f"an earlier run", field="run.run_dir")
        where = os.path.join(self.directory, str(step))
        try:
            meta = self._manager.restore(step, args=ocp.args.Composite(
                meta=ocp.args.JsonRestore()))["meta"]
        except Exception as e:
            raise ConfigError(_unreadable(where, e), field="run.run_dir") from None
        if meta.get("format", 1) != FORMAT:
            raise ConfigError(
                f"checkpoint {where} is in format {meta.get('format', 1)} (written before the "
                f"model became any NNX model's state); this version reads format {FORMAT}: "
                f"train a new run_dir, or finish that run with the jaxaccel that wrote it",
                field="run.run_dir")
        mismatched = [
            f"{key}={meta['config'].get(key)!r} (now {value!r})"
            for key, value in config.items()
            if key not in may_differ and meta.get("config", {}).get(key) != value
        ]
        self.saved_config = meta.get("config", {})
        self.saved_history = [tuple(pair) for pair in meta.get("recent_history", [])]
        if mismatched:
            raise ConfigError(
                f"checkpoint {where} was written with other settings: {', '.join(mismatched)}; "
                f"resume with the same settings or start a new run_dir", field="run.run_dir")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target_state)
        try:
            state = self._manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract)))["state"]
        except Exception as e:
            raise ConfigError(_unreadable(where, e), field="run.run_dir") from None
        return state, meta["loader_position"], step

    def close(self):
        """Wait for a save in the background (CheckpointWriteError if it failed), then close."""
        try:
            self.wait()
        finally:
            self._manager.close()


class CheckpointWriteError(ConfigError):
    """A checkpoint that could not be written: the step, why, and the checkpoint kept."""


class _WriteErrors:
    """Turns an OSError of a save (anywhere in the exception's chain, as orbax wraps the
    background thread's errors) into one ``CheckpointWriteError`` line."""

    def __init__(self, checkpointer: Checkpointer, step: int):
        self.checkpointer, self.step = checkpointer, step

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        cause = _os_error(error)
        if cause is None:
            return False
        self.checkpointer._pending = None
        steps = [s for s in self.checkpointer._manager.all_steps() if s != self.step]
        kept = (f"the checkpoint of step {max(steps)} is kept" if steps
                else "no earlier checkpoint exists")
        full = cause.errno in (errno.ENOSPC, errno.EDQUOT)
        raise CheckpointWriteError(
            f"the checkpoint of step {self.step} could not be written in "
            f"{self.checkpointer.directory} ({cause.strerror or cause}); {kept}; "
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


def _unreadable(where: str, error: Exception) -> str:
    reason = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
    return (f"checkpoint {where} is unreadable ({type(error).__name__}: {reason}); delete that "
            f"step's directory to fall back to an earlier one, or start a new run_dir")
