import dataclasses
import json
import logging
import os
import sys
import types

import chex
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from jaxaccel.run import checkpoint
from jaxaccel.techniques import registry as techniques
from jaxaccel.run.checkpoint import Checkpointer
from jaxaccel.run.config import TrainConfig, build, build_parser
from jaxaccel.core.errors import ConfigError
from jaxaccel.step.optim import make_optimizer
from jaxaccel.step.state import init_state

CFG = build(TrainConfig, {"gpt.d_model": 32, "gpt.n_layers": 1, "gpt.n_heads": 2,
                          "model.max_seq_len": 8})
CFG = dataclasses.replace(CFG, model=dataclasses.replace(CFG.model, vocab_size=64))


def make_state(seed):
    optimizer = make_optimizer(learning_rate=1e-3, total_steps=10)
    params = nnx.state(techniques.build(CFG, jax.random.PRNGKey(seed)))
    return init_state(params, optimizer, seed)


def test_round_trip_restores_state_position_and_step(tmp_path):
    saved = make_state(0).replace(step=jax.numpy.int32(7))
    ckpt = Checkpointer(str(tmp_path))
    ckpt.save(7, saved, loader_position={"epoch": 1, "batch": 3}, config={"d_model": 32})
    state, position, step = Checkpointer(str(tmp_path)).restore(make_state(1), config={"d_model": 32})
    chex.assert_trees_all_equal(state, saved)
    assert isinstance(state.params, nnx.State)      # the model's state, variable types and all
    assert position == {"epoch": 1, "batch": 3} and step == 7
    with open(os.path.join(tmp_path, "7", "meta", "metadata")) as f:
        assert json.load(f)["format"] == checkpoint.FORMAT == 2


def test_restore_checks_the_config_first(tmp_path):
    ckpt = Checkpointer(str(tmp_path))
    ckpt.save(1, make_state(0), loader_position={"epoch": 0, "batch": 1}, config={"seq_len": 8})
    with pytest.raises(ConfigError, match=r"seq_len=8 \(now 16\)"):
        ckpt.restore(make_state(0), config={"seq_len": 16})


def test_a_checkpoint_of_the_old_format_is_refused_with_one_line(tmp_path):
    """A checkpoint written before format 2 (no ``format`` in its meta; the GPT's parameters as
    a plain dict) is refused before its state is read, in one line naming both formats."""
    old_params = {"embed": {"embedding": np.zeros((64, 32), np.float32)},
                  "blocks": [{"attn": {"wq": {"kernel": np.zeros((32, 32), np.float32)}}}]}
    manager = ocp.CheckpointManager(str(tmp_path), options=ocp.CheckpointManagerOptions(
        create=True))
    manager.save(3, args=ocp.args.Composite(
        state=ocp.args.StandardSave({"params": old_params, "step": np.int32(3)}),
        meta=ocp.args.JsonSave({"loader_position": {}, "config": {}, "recent_history": []})))
    manager.wait_until_finished()
    manager.close()
    with pytest.raises(ConfigError) as error:
        Checkpointer(str(tmp_path)).restore(make_state(0), config={})
    message = str(error.value)
    assert "\n" not in message and error.value.field == "run.run_dir"
    assert "format 1" in message and "format 2" in message


def test_help_lists_every_flag_the_issue_names():
    text = build_parser().format_help()
    for flag in ("--model", "--data", "--steps", "--batch-size", "--seq-len", "--seed",
                 "--run-dir", "--checkpoint-every", "--eval-every", "--resume", "--json",
                 "--d-model", "--n-layers", "--n-heads", "--n-kv-heads", "--d-ff"):
        assert flag in text


def test_tensorstores_disk_full_error_is_one_write_error_line(tmp_path, monkeypatch):
    """A full disk reaches orbax from tensorstore as a ValueError with the OS error code in its
    text, not an OSError: it is still the one CheckpointWriteError line (it was a traceback)."""
    from jaxaccel.run.checkpoint import CheckpointWriteError

    def full(self, step, *args, **kwargs):
        raise ValueError(f'RESOURCE_EXHAUSTED: Error writing "rng/0" in OCDBT database at local '
                         f'file "{tmp_path}/2.orbax-checkpoint-tmp/state": Failed to write 81130 '
                         f"bytes to file 7: No space left on device [os_error_code='28']")

    ckpt = Checkpointer(str(tmp_path), asynchronous=True)
    ckpt.save(1, make_state(0), loader_position={}, config={})
    monkeypatch.setattr(ocp.CheckpointManager, "save", full)
    with pytest.raises(CheckpointWriteError) as error:
        ckpt.save(2, make_state(0), loader_position={}, config={})
    assert "checkpoint of step 2 could not be written" in str(error.value)
    assert "(No space left on device); the checkpoint of step 1 is kept; free disk space" \
        in str(error.value)
    monkeypatch.undo()
    ckpt.close()
    ckpt.close()            # closing twice (the loop's error path after finish's) is nothing


def test_orbax_reports_of_a_failed_write_are_dropped_and_nothing_else(tmp_path, monkeypatch):
    """The CheckpointWriteError line replaces orbax's own reports of the failure: its absl log
    records with the error, asyncio's of the write's futures never awaited, tensorstore's
    callbacks finding the write's event loop closed, the write's coroutines collected at exit
    (about 40 tracebacks in all, issue 35); any other log record or unraisable error shows."""
    reached = []
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: reached.append(
        str(unraisable.exc_value)))
    Checkpointer(str(tmp_path))         # wraps the hook it finds
    absl = logging.getLogger("absl")
    orbax_file = os.path.join(os.path.dirname(ocp.__file__), "_src", "futures", "future.py")

    def shown(message, error=None, path=orbax_file):
        info = (type(error), error, None) if error else None
        return absl.filter(absl.makeRecord("absl", logging.ERROR, path, 1, message, (), info))

    full = ValueError("RESOURCE_EXHAUSTED: ... No space left on device [os_error_code='28']")
    assert not shown("_SignalingThread.run() raised an exception", full)
    assert not shown("background save failed", PermissionError(13, "Permission denied"))
    assert shown("a failed write reported from elsewhere", full, path=__file__)
    assert shown("something else went wrong", RuntimeError("not a write"))
    assert shown("no exception")
    gather = logging.getLogger("asyncio")       # tensorstore's future, never awaited: no frames
    tensorstore = ValueError(f"RESOURCE_EXHAUSTED: Error writing in {tmp_path}/9.orbax-"
                             f"checkpoint-tmp/state: No space left on device [os_error_code='28']")
    assert not gather.filter(gather.makeRecord("asyncio", logging.ERROR, "futures.py", 1,
                                               "Future exception was never retrieved", (),
                                               (ValueError, tensorstore, None)))
    assert gather.filter(gather.makeRecord("asyncio", logging.ERROR, "futures.py", 1,
                                           "Future exception was never retrieved", (),
                                           (ValueError, full, None)))

    def unraisable(value, obj=None):
        sys.unraisablehook(types.SimpleNamespace(exc_type=type(value), exc_value=value,
                                                 exc_traceback=None, err_msg=None, object=obj))

    namespace = {}
    exec(compile("async def write_fragment(): pass", orbax_file, "exec"), namespace)
    coroutine = namespace["write_fragment"]()
    unraisable(RuntimeError("Event loop is closed"))
    unraisable(ImportError("sys.meta_path is None, Python is likely shutting down"), coroutine)
    coroutine.close()
    unraisable(RuntimeError("another unraisable error"))
    assert reached == ["another unraisable error"]


def test_making_a_checkpointer_prints_nothing(tmp_path):
    """Its set-up (orbax's array handler replaced, which orbax warns of) leaves stderr clean: a
    run's error output is its one line."""
    import subprocess
    code = ("from jaxaccel.run.checkpoint import Checkpointer; "
            f"Checkpointer({str(tmp_path / 'c')!r}).close()")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stderr == "" and done.stdout == "", done.stderr
