"""Experiment trackers (``run.trackers``): the run's metrics mirrored to TensorBoard event files
or to Weights & Biases, besides ``metrics.jsonl`` (always written, ``jaxaccel.step.metrics``).

Both are optional extras: ``pip install 'jaxaccel[tensorboard]'`` (tensorboardX, event files
under ``<run_dir>/tensorboard``) and ``pip install 'jaxaccel[wandb]'``; one asked for and not
installed is one error line before any work (``check``), not a silently missing curve. W&B runs
offline unless ``run.wandb_mode`` says ``online``: the run is kept under ``<run_dir>/wandb`` and
``wandb sync`` uploads it later, so training needs no network. A resumed run continues the same
W&B run (its id is derived from the run directory). Only process 0 of a multi-process run
tracks (every process sees the same global metrics)."""

import hashlib
import importlib.util
import os

from jaxaccel.core.errors import ConfigError

TRACKERS = {"tensorboard": ("tensorboardX", "tensorboard"), "wandb": ("wandb", "wandb")}
WANDB_MODES = ("offline", "online", "disabled")


def parse(text: str | None) -> list[str]:
    """The tracker names of ``run.trackers`` ("none", "tensorboard", "tensorboard,wandb")."""
    names = [n.strip() for n in (text or "none").split(",") if n.strip()]
    if names == ["none"]:
        return []
    if any(n not in TRACKERS for n in names) or not names or len(set(names)) != len(names):
        raise ConfigError(f"trackers must be none or a comma list of {', '.join(TRACKERS)} "
                          f"without repeats, got {text!r}", field="run.trackers")
    return names


def check(text: str | None, wandb_mode: str = "offline") -> list[str]:
    """The trackers asked for, each one importable (ConfigError naming the extra otherwise)."""
    names = parse(text)
    for name in names:
        module, extra = TRACKERS[name]
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"tracker {name!r} needs the {module} package, which is not "
                              f"installed; pip install 'jaxaccel[{extra}]' or drop it from "
                              f"--trackers", field="run.trackers")
    if wandb_mode not in WANDB_MODES:
        raise ConfigError(f"unknown wandb_mode {wandb_mode!r}; choose one of "
                          f"{', '.join(WANDB_MODES)}", field="run.wandb_mode")
    return names


class TensorBoard:
    """Scalars to ``<run_dir>/tensorboard`` as ``<kind>/<name>`` at each record's step."""

    def __init__(self, run_dir: str):
        from tensorboardX import SummaryWriter
        self.writer = SummaryWriter(os.path.join(run_dir, "tensorboard"))

    def log(self, step: int, kind: str, scalars: dict):
        for key, value in scalars.items():
            self.writer.add_scalar(f"{kind}/{key}", value, step)

    def close(self):
        self.writer.close()


class WandB:
    """A W&B run under ``<run_dir>/wandb`` (offline by default), resumed with the run."""

    def __init__(self, run_dir: str, config: dict, project: str, mode: str):
        import wandb
        run_dir = os.path.abspath(run_dir)
        run_id = hashlib.sha1(run_dir.encode()).hexdigest()[:16]
        self.run = wandb.init(project=project, dir=run_dir, name=os.path.basename(run_dir),
                              id=run_id, resume="allow", config=config, mode=mode)

    def log(self, step: int, kind: str, scalars: dict):
        self.run.log({f"{kind}/{key}": value for key, value in scalars.items()}, step=step)

    def close(self):
        self.run.finish()


def open_trackers(names: list[str], run_dir: str, *, config: dict | None = None,
                  project: str = "jaxaccel", wandb_mode: str = "offline") -> list:
    """One tracker object per name (``log(step, kind, scalars)``, ``close()``)."""
    return [TensorBoard(run_dir) if name == "tensorboard"
            else WandB(run_dir, config or {}, project, wandb_mode) for name in names]
