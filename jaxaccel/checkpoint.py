"""Orbax checkpoints of the whole TrainState, with the loader position and the run's config.

A checkpoint holds ``state`` (the TrainState pytree) and ``meta`` (JSON: the data loader's
position and the config that shapes the state and the data order). Restoring checks the config
first, so a run resumed with other shapes fails with one clear line instead of a stack trace.
"""

import os

import jax
import orbax.checkpoint as ocp

from jaxaccel.errors import ConfigError


class Checkpointer:
    """Saves and restores checkpoints under ``directory`` (one subdirectory per step)."""

    def __init__(self, directory: str, *, max_to_keep: int = 2, keep_period: int | None = None):
        """``max_to_keep`` latest checkpoints are kept, and besides them every one whose step
        is a multiple of ``keep_period`` (None: none)."""
        self.directory = os.path.abspath(directory)
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep, keep_period=keep_period or None,
                enable_async_checkpointing=False, create=True),
        )

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state, *, loader_position: dict, config: dict):
        """Write the state and metadata at ``step`` (no-op if that step is already saved)."""
        if step in self._manager.all_steps():
            return
        self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            meta=ocp.args.JsonSave({"loader_position": loader_position, "config": config}),
        ))
        self._manager.wait_until_finished()

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
        mismatched = [
            f"{key}={meta['config'].get(key)!r} (now {value!r})"
            for key, value in config.items()
            if key not in may_differ and meta.get("config", {}).get(key) != value
        ]
        self.saved_config = meta.get("config", {})
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
        self._manager.close()


def _unreadable(where: str, error: Exception) -> str:
    reason = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
    return (f"checkpoint {where} is unreadable ({type(error).__name__}: {reason}); delete that "
            f"step's directory to fall back to an earlier one, or start a new run_dir")
