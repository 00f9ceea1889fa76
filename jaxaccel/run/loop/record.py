"""The run record: what every run directory holds about its run, and reading a trained run back.

A run directory gets ``config.yaml``, ``command.txt``, ``environment.json``, ``metrics.jsonl``,
``checkpoints/``, ``run.lock`` (held while a run writes it), ``loss.png`` and, at the end,
``summary.json`` (the ``RunSummary``).
``read_trained_run`` rebuilds a run's model from its latest checkpoint (``--init-from``,
``experiments.sample``, ``export``): its factory where the run recorded it (or where it is
now), the checkpoint checked against the model's shapes, a changed source said.
"""

import dataclasses
import json
import os
import sys
import time

import jax
from flax import nnx

from jaxaccel.core import hardware
from jaxaccel.techniques import registry as techniques
from jaxaccel.model import contract as model_lib, nn
from jaxaccel.run.checkpoint import Checkpointer
from jaxaccel.run.config import TrainConfig, build, override, read_config_file
from jaxaccel.core.errors import ConfigError
from jaxaccel.step.optim import build_optimizer
from jaxaccel.core.sections import factory_file, is_preset
from jaxaccel.core.sharding import format_mesh
from jaxaccel.step.state import init_state


@dataclasses.dataclass
class RunSummary:
    """What one run did and measured (``experiments.train`` prints it; ``--json`` writes it)."""

    steps: int
    steps_this_run: int
    interrupted: str | None
    run_dir: str
    # data
    batching: str
    shapes: list
    real_tokens: int
    padding_efficiency: float
    epoch_padding_efficiency: float
    split_documents: int
    empty_documents_skipped: int
    data_wait_s: float
    # quality
    train_bpb: float
    val_loss: float
    val_bpb: float
    val_tokens: int
    unigram_bpb: float
    # speed and memory
    real_tokens_per_s: float
    flops_per_token: float
    achieved_flops_per_s: float
    mfu: float | None
    compiles: int
    compiles_after_warmup: int
    compile_s: float
    eval_compiles: int
    step_memory_bytes: dict | None
    peak_memory_bytes: int | None
    param_opt_bytes_per_device: int
    optimizer_state_bytes: int
    wall_s: float
    train_s: float
    # the run
    model: str
    params: int
    trainable_params: int
    precision: str
    matmul_precision: str
    loss_scale: float
    skipped_steps: int
    optimizer: str
    learning_rate: float
    weight_decay: float
    batch_rows: int
    accumulate: int
    sharding: str
    mesh: dict
    mesh_axis_types: str
    process_count: int
    device: str
    jax_version: str
    techniques: dict = dataclasses.field(default_factory=dict)  # what each technique did
    diverged_at_step: int | None = None  # the first step whose loss was NaN or inf (a failure)
    inputs_skipped: dict | None = None  # what the corpus source left out, by reason
    extended_from_steps: int | None = None  # resumed with another length: the earlier one
    profile: dict | None = None         # --profile: the steps traced and the top operations
    startup_s: dict | None = None       # seconds of each start-up phase (STARTUP_PHASES)
    step_alone: dict | None = None      # run.time_step: the step timed alone on the last batches
    stopped_at: int | None = None       # run.stop_at paused the run at this step (resumable)
    total_steps: int | None = None      # the run's length in steps (steps: how far it got)
    target: dict | None = None          # run.target_bpb: reached, and at which step, tokens, s

    @classmethod
    def read(cls, path: str) -> "RunSummary":
        with open(path) as f:
            return cls(**json.load(f))


def run_environment(mesh_shape: dict) -> dict:
    """The run record's software and hardware: package versions, devices, processes, host."""
    import importlib.metadata
    versions = {}
    for package in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return {"versions": versions, "python": sys.version.split()[0],
            "device": hardware.describe(), "platform": jax.default_backend(),
            "device_count": jax.device_count(), "process_count": jax.process_count(),
            "mesh": format_mesh(mesh_shape), "host": os.uname().nodename,
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def read_config(run_dir: str, field: str = "run.init_from") -> TrainConfig:
    """A run directory's ``config.yaml``; a ConfigError line naming ``field`` if unreadable."""
    try:
        return build(TrainConfig, read_config_file(os.path.join(run_dir, "config.yaml")))
    except ConfigError as e:
        raise ConfigError(f"{run_dir} is not a readable run directory ({e}); pass the run_dir "
                          f"of a trained run", field=field) from None


def read_trained_run(run_dir: str, field: str = "run.init_from", *, model: str | None = None,
                     model_field: str | None = None, fallback: str | None = None):
    """``(config, model, step)`` of a run directory: its config and its model (every technique
    applied, at its final depth) with the variables of its latest checkpoint. ``model``: the
    run's own factory where it is now (``--model`` of sample and export, ``model_field``),
    instead of where the run recorded it; ``fallback``: the factory to use if the recorded
    file is gone (a fine-tune's own). A checkpoint that does not fit the model is one line
    naming the parameters that differ; a model whose source changed since, a warning line."""
    trained = model_now(read_config(run_dir, field), run_dir, model, fallback,
                        model_field, field)
    optimizer, _, _ = build_optimizer(trained.optimizer, batch_rows=trained.batch_rows(),
                                      total_steps=trained.run.steps)
    graphdef, variables = nnx.split(techniques.abstract(trained))
    template = jax.eval_shape(lambda v: init_state(
        v, optimizer, 0, trained.make_loss_scale(), trained.policy(), nn.trainable(v)),
        variables)
    name, checkpointer = trained.model.name, Checkpointer(os.path.join(run_dir, "checkpoints"))
    try:
        if checkpointer.latest_step() is None:      # its own line: not the run's --run-dir
            raise ConfigError(f"{run_dir} holds no finished checkpoint to take the weights "
                              f"from; pass a run that saved one (or finish it with --resume)",
                              field=field)
        recorded = checkpointer.check_meta(field=field)["config"].get("model.source")
        file = (model_lib.source_of(name) or {}).get("file")
        fix = (f"restore {file or 'the model'} as it was when the run trained, or "
               + ("point --model at the file it trained with" if model_field else
                  f"pass another run as {field.rpartition('.')[2]}"))
        state, _, step = checkpointer.restore(template, config={},
                                              model=model_lib.describe_source(name, recorded),
                                              fix=fix, field=model_field or field)
    finally:
        checkpointer.close()
    warning = model_lib.source_warning(recorded, name, run_dir,
                                       flag="--model" if model_field else None)
    if warning and jax.process_index() == 0:
        print(warning, file=sys.stderr)
    return trained, nnx.merge(graphdef, state.params), step


def model_now(trained: TrainConfig, run_dir: str, given: str | None, fallback: str | None,
              model_field: str | None, field: str) -> TrainConfig:
    """The trained run's config with its model where it is now: ``given`` (a factory, the
    ``--model`` of ``model_field``) if any; else the recorded one, or ``fallback`` (said) if
    its file is gone. One ConfigError line for a ``given`` preset or a run of a preset, or for
    a recorded file that is gone (naming ``--model`` where the caller takes it, else ``field``)."""
    name = trained.model.name
    if given is not None:
        if is_preset(name) or is_preset(given):
            raise ConfigError(
                f"run {run_dir} trained the model {name}; --model {given} points at where a "
                f"run's own factory FILE.py:FUNCTION is now, " + (
                    "which a preset does not need: leave it out" if is_preset(name) else
                    "not at a preset: give the file"), field=model_field)
        return override(trained, {"model.name": given})
    file, function = factory_file(name), name.rpartition(":")[2]
    if file is None or os.path.isfile(file):
        return trained
    if fallback is not None and not is_preset(fallback):
        if jax.process_index() == 0:
            print(f"note: run {run_dir} trained the model {name}, whose file is gone; its "
                  f"checkpoint is read with this run's model {fallback}", file=sys.stderr)
        return override(trained, {"model.name": fallback})
    where = (f"pass --model FILE.py:{function} with where it is now" if model_field else
             "put it back there")
    raise ConfigError(f"run {run_dir} trained the model {name}, whose file {file} no longer "
                      f"exists; {where}", field=model_field or field)


def base_weights(run_dir: str, cfg: TrainConfig):
    """The weights a fine-tune of ``cfg`` starts from: the model of the run in ``run_dir``, its
    layer techniques merged or folded away (an ``nnx.State``); one clear line if shapes differ."""
    trained_cfg, trained, _ = read_trained_run(run_dir, fallback=cfg.model.name)
    techniques.strip_model(trained)
    for _, stack in nn.stacks(trained):
        stack.unscan()
        stack.transforms = nnx.List([])
    base = techniques.abstract(override(cfg, techniques.stripped()))   # without the techniques
    want = jax.tree.map(lambda x: (x.shape, str(x.dtype)), nnx.state(base))
    have = nnx.state(trained)
    got = jax.tree.map(lambda x: (x.shape, str(x.dtype)), have)
    if jax.tree.structure(want) != jax.tree.structure(got) or \
            jax.tree.leaves(want) != jax.tree.leaves(got):
        raise ConfigError(f"init_from={run_dir} trained another model shape (its model "
                          f"{trained_cfg.model.name}); use the same model settings as that run",
                          field="run.init_from")
    return have
