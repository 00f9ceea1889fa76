"""Start-up: ``--help`` without jax, the persistent compilation cache (a repeated run compiles
nothing anew), its settings and an unwritable folder, the start-up phases in the summary, the
step timed alone (--time-step), and the initialisation taking its key as an argument."""

import importlib
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from conftest import REPO
from experiments import train as train_cli
from jaxaccel.run import compile_cache
from tests.test_run_files import FAST

finish = importlib.import_module("jaxaccel.run.loop.finish")    # the package's finish() hides it


# The commands whose --help imports no jax, flax nor orbax; the other experiments' modules use
# jax at their top (kernels, arrays, step functions of their own).
LIGHT_COMMANDS = ("train", "speedup", "corpus_scale", "depth", "importance", "init_schemes",
                  "optimizers", "padding", "sparsity", "tokenization")


@pytest.mark.parametrize("name", LIGHT_COMMANDS)
def test_the_help_imports_no_jax(name):
    """``python -m experiments.train --help`` took 1.5 s, most of it importing jax, flax and
    orbax; building the parser needs none of them (``jaxaccel.core.sections``). Checked by the
    modules the command imported (-X importtime), not by its time."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", f"experiments.{name}",
                           "--help"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("usage:"), done.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip().partition(".")[0]
                for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "jaxaccel" in imported       # the listing is there to read
    heavy = imported & {"jax", "flax", "orbax", "optax"}
    assert not heavy, heavy


@pytest.fixture
def restore_cache():
    """The suite's own cache settings back after a test that changes them."""
    yield
    compile_cache.enable(compile_cache.resolve(None, None))


def test_the_cache_folder_each_setting_means(tmp_path, monkeypatch):
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.delenv("JAXACCEL_CACHE_DIR", raising=False)
    assert compile_cache.resolve("off", "c") is None
    assert compile_cache.resolve(str(tmp_path / "x"), "c") == str(tmp_path / "x")
    assert compile_cache.resolve(None, str(tmp_path)) == str(tmp_path / "xla")
    assert compile_cache.resolve(None, None) == os.path.expanduser("~/.cache/jaxaccel/xla")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "env"))
    assert compile_cache.resolve(None, str(tmp_path)) == str(tmp_path / "env")


def test_a_repeated_run_reads_its_compiles_from_the_cache(corpus_path, tmp_path, capsys,
                                                          restore_cache, monkeypatch):
    hits = []
    jax.monitoring.register_event_listener(
        lambda event, **kw: hits.append(event) if event.endswith("cache_hits") else None)
    args = [*FAST, "--data", corpus_path, "--steps", "2", "--cache-dir", str(tmp_path / "c"),
            "--compilation-cache", str(tmp_path / "xla"), "--seed", "12345"]
    assert train_cli.main([*args, "--run-dir", str(tmp_path / "a")]) == 0
    first = len(hits)
    assert os.listdir(tmp_path / "xla")               # the train and eval steps were stored
    # The second run also times its step alone on its last 2 batches (--time-step), which
    # leaves its training and checkpoint as they were. On a GPU it donates the final state, as
    # deleting its arrays does here: nothing after it may read the state (a GPU run failed so).
    timed = finish.step_alone

    def donating_step_alone(steps, state, *args):
        result = timed(steps, state, *args)
        for leaf in jax.tree.leaves(state):
            if isinstance(leaf, jax.Array) and not leaf.is_deleted():
                leaf.delete()
        return result

    monkeypatch.setattr(finish, "step_alone", donating_step_alone)
    assert train_cli.main([*args, "--run-dir", str(tmp_path / "b"), "--time-step", "2"]) == 0
    assert len(hits) - first >= 2, hits               # ... and read back: train and eval steps
    out = capsys.readouterr().out
    assert "start-up" in out and "compile" in out and "step alone" in out
    import json
    summary = json.load(open(tmp_path / "b" / "summary.json"))
    for phase in ("corpus", "init", "compile", "first_step", "to_first_step"):
        assert summary["startup_s"][phase] >= 0, phase
    alone = summary["step_alone"]
    assert alone["steps"] == 2 and alone["real_tokens_per_s"] > 0 and alone["loop_share"] > 0
    assert summary["val_loss"] == json.load(open(tmp_path / "a" / "summary.json"))["val_loss"]


def test_an_unwritable_cache_is_one_warning_and_the_run_goes_on(corpus_path, tmp_path, capsys,
                                                                restore_cache):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert train_cli.main([*FAST, "--data", corpus_path, "--steps", "1", "--cache-dir",
                           str(tmp_path / "c"), "--compilation-cache", str(blocker / "xla"),
                           "--run-dir", str(tmp_path / "r")]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if "compilation cache" in line]
    assert len(err) == 1 and err[0].startswith("warning: compilation cache") and \
        "compiling without it" in err[0], err


def test_a_run_after_one_without_the_cache_uses_it_again(tmp_path, restore_cache):
    """JAX decides at a process's first compile whether its cache is used and keeps the
    answer: a run with the cache on after one with it off (or unwritable) must read and write
    it again, not compile uncached for the rest of the process."""
    events = []
    jax.monitoring.register_event_listener(
        lambda event, **kw: events.append(event.rsplit("/", 1)[-1]) if "cache_" in event
        else None)
    folder = str(tmp_path / "xla")
    compile_cache.enable(folder)
    compile_cache.enable(None)
    jax.jit(lambda x: x * 3 + 1)(jnp.arange(5.0)).block_until_ready()     # decided: off
    compile_cache.enable(folder)
    for _ in range(2):      # a new function each time: only the disk cache can serve it
        events.clear()
        jax.jit(lambda x: x * 3 + 1)(jnp.arange(5.0)).block_until_ready()
    assert events == ["cache_hits"] and os.listdir(tmp_path / "xla")


def test_the_initialisation_takes_its_key_as_an_argument_and_hashes_in_a_gpu_kernel():
    """The sharded initialisation is compiled with the key as a parameter, so the GPU compiler
    has no constant key to fold the random initialisation into (issue 16: 3 min 22 s); lowered
    for a GPU, its threefry hashes are JAX's kernel, not inlined arithmetic (H200: 47.4 s of
    compilation for GPT-2 small without it, 3.8 s with it, the same parameters)."""
    from jaxaccel.techniques import registry as techniques
    from jaxaccel.run.config import TrainConfig, build
    from jaxaccel.step.optim import make_optimizer
    from jaxaccel.core.sharding import make_mesh
    from jaxaccel.step.state import lower_init
    cfg = build(TrainConfig, {"gpt.d_model": 32, "gpt.n_layers": 2, "gpt.n_heads": 4,
                              "model.max_seq_len": 32})
    mesh = make_mesh({"stage": 1, "data": 1, "fsdp": 1, "tensor": 1})
    texts = {}
    for platform in ("cpu", "cuda"):
        lowered, _ = lower_init(techniques.variables(cfg),
                                make_optimizer("adamw", learning_rate=1e-3, total_steps=10), 0,
                                cfg.make_loss_scale(), mesh, platform)
        texts[platform] = lowered.as_text()
    for hlo in texts.values():
        main = next(line for line in hlo.splitlines() if "func.func public @main" in line)
        assert "@main(%arg0: tensor<2xui32>)" in main          # the key, an argument
    assert "threefry" in texts["cpu"] and "cu_threefry2x32" not in texts["cpu"]
    assert "cu_threefry2x32" in texts["cuda"]                  # the GPU's hashing kernel
