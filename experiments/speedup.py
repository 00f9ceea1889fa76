"""The headline experiment: what each technique buys alone, and all of them together, here.

    python -m experiments.speedup                    # the preset of this device (CPU: < 10 min)
    python -m experiments.speedup --scale gpu        # GPT-2 small shape, seq_len 1024
    python -m experiments.speedup --rows baseline,pack,bf16,best --json speedup.json

Every row trains the same model from the same seed on the same number of real tokens of the
corpus. The baseline is the naive run: fixed padding, float32, no remat, xla attention, AdamW,
one device. Each technique row switches one thing on (dynamic padding, length buckets,
packing, bf16, fp16 with dynamic loss scaling, FP8 matmuls where a GPU has FP8 tensor cores,
each remat policy, our Pallas flash attention where a GPU is present, token dropping, 2:4
sparse weights, importance sampling, Lion, LAMB, gradient accumulation, dp and fsdp sharding
over all devices), and the ``best`` row combines what the measurements recommend (``--best``
names the rows to combine instead):

- padding, precision, remat, attention, token dropping, sharding: the fastest row of the group
  that beats the baseline's real tokens/s by ``--speed-margin`` and ends within
  ``--quality-tolerance`` of its validation bits per byte;
- sparsity is never combined: without an N:M sparse kernel (none in jax) the masked weights
  multiply densely, so the row shows the quality cost and the masking's overhead;
- optimizer and importance sampling: the row with the lowest validation loss, if it is below the
  baseline's and at most ``--optimizer-slowdown`` slower (importance sampling only when no
  padding row is chosen: it draws rows of fixed batching);
- accumulation is a speed group too: it computes the same update from smaller microbatches,
  which some devices (CPU caches) run faster.

The padding rows size their batches to hold as many real tokens as the baseline's
``--batch-size`` rows (``bucket`` through a token budget), so every row takes the same number
of optimizer steps and the validation losses compare the techniques, not step counts; the
combination re-matches its padding row's batch after rounding the rows to the devices x
microbatches. Every row validates on the same batches of the validation split.

Each row runs ``python -m experiments.train --config <row>/config.yaml`` in its own process
(the resolved training config of the row, written first; the command is in the JSON), so the
device's peak memory, the compile counts and a failure belong to that row alone. On a CPU every
process sees ``--cpu-devices`` devices (default: one per core) so that the sharding rows have
devices to split over; the other rows use the first one.

A busy machine must not decide the verdict, so the rows train in ``--rounds`` rounds, taking
turns: round k trains every row's k-th share of its steps (``--stop-at k/N``, then
``--resume``; the compilation cache makes the restart cheap), the baseline first. A row's
speedup is the median over the rounds of its real tokens/s over the baseline's in the same
round, its spread half their range; a speed row joins the combination only when its gain
exceeds its spread. The best row takes turns with the baseline trained again, and is measured
against that. ``--rounds 1`` trains each row in one go. ``--profile START:STOP`` traces those
steps in every row's first round, so they must lie within it.

The model is any model: a GPT preset (the presets' own: ``tiny`` at 2 x 128 on the CPU,
``small`` on a GPU) or a factory of one's own, ``--model FILE.py:FUNCTION`` (``--model-args``
for its arguments; the presets' GPT fields, ``gpt.*``, are then left out, and so are the rows
that set them: ``flash`` is jaxaccel's GPT's attention). Before any row trains, each row's model
is built abstractly in a CPU process of its own and checked as a run checks it (``loop.preflight``:
a block technique needs the blocks in an ``nn.Stack``, a remat policy the tensors it keeps
tagged, packing the ``segment_ids`` argument, ...); a row whose model cannot train so is skipped
with that reason in the table.

The run directory gets ``report.md`` (the table, one line per technique on its measured
effect, the combination and the targets), ``tokens_per_s.png``, ``memory.png``,
``loss_curves.png`` and one directory per row.
"""

import argparse
import dataclasses
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time

from experiments.common import (PARENT_PID, Interrupted, check_stop, command, exit_code,
                                gpt_shape, matched_batch, parse_experiment, parse_list,
                                passing_signals_to, plot_loss_curves, stack_depth,
                                stop_requested, technique as done, write_json)
from jaxaccel.config import TrainConfig, build, describe_error, flatten, override, setting, \
    to_dict, write_config
from jaxaccel.corpus import corpus_of
from jaxaccel.errors import ConfigError
from jaxaccel.loop import RunSummary
from jaxaccel.model import is_preset
from jaxaccel.report import bar_chart, format_table

SCALES = ("auto", "cpu", "gpu")

# The experiment's defaults, then each preset's (a flag given on the command line wins).
DEFAULTS = {"run.eval_every": 0, "run.checkpoint_every": 0, "run.final_eval_batches": 8,
            "run.progress": False}
# The gpu preset's tokens per row are set from an estimate, not yet from a run: with issue 16's
# H100 step times (fp32 + xla attention 113 ms per 16 x 1024 batch, about 106k real tokens/s with
# fixed padding; bf16 + cuDNN 31 ms), 1.5M real tokens take about 14 s in an fp32 row and a few
# in the fast ones: about 4 minutes of training for 20 rows. The processes' start-ups (a cold
# compile took 12-14 s there; the cache serves the second round) come on top; the issue's
# target for the whole experiment is 9 minutes.
PRESETS = {
    "cpu": {"model.name": "tiny", "gpt.d_model": 128, "gpt.n_layers": 2,
            "model.max_seq_len": 1024, "data.seq_len": 1024, "data.batch_size": 8,
            "run.train_tokens": 160_000, "optimizer.warmup_steps": 5,
            "run.final_eval_batches": 8, "run.log_every": 4, "experiment.row_accumulate": 2},
    "gpu": {"model.name": "small", "data.seq_len": 1024, "data.batch_size": 16,
            "run.train_tokens": 1_500_000, "optimizer.warmup_steps": 20,
            "run.final_eval_batches": 16, "run.log_every": 10, "experiment.row_accumulate": 4},
}

# What the baseline fixes; a technique row changes one of these. None of them is a flag here.
BASELINE = {"data.batching": "fixed", "precision.policy": "fp32", "precision.loss_scale": "auto",
            "remat.policy": "none", "gpt.attention": "xla", "optimizer.name": "adamw",
            "optimizer.accumulate": 1, "mesh.strategy": "dp", "mesh.num_devices": 1,
            "run.memory_budget": None, "remat.scan_layers": False, "token_drop.keep": 1.0,
            "sparsity.pattern": "none", "data.sampling": "uniform"}
FIXED = (*BASELINE, "run.resume")
# Fields of jaxaccel's GPT presets: a factory of one's own has none of them (model.build refuses
# them), so neither its baseline nor a row sets them.
GPT_SECTION = "gpt."


@dataclasses.dataclass(frozen=True)
class Technique:
    name: str
    group: str
    description: str
    settings: dict
    needs: str | None = None   # "gpu" or "devices" (more than one)


TECHNIQUES = [
    Technique("baseline", "baseline", "fixed padding, fp32, no remat, xla attention, AdamW, "
              "one device", {}),
    Technique("dynamic", "padding", "dynamic padding (each batch padded to its longest row)",
              {"data.batching": "dynamic"}),
    Technique("bucket", "padding", "length buckets with a token budget per batch",
              {"data.batching": "bucket"}),
    Technique("pack", "padding", "sequence packing with segment ids",
              {"data.batching": "pack"}),
    Technique("bf16", "precision", "bfloat16 compute, float32 master weights",
              {"precision.policy": "bf16"}),
    Technique("fp16", "precision", "float16 compute with dynamic loss scaling",
              {"precision.policy": "fp16", "precision.loss_scale": "dynamic"}),
    *[Technique(f"remat-{policy}", "remat", f"remat policy {policy}", {"remat.policy": policy})
      for policy in ("full", "dots", "attention", "mlp", "offload")],
    Technique("flash", "attention", "our Pallas flash attention kernel",
              {"gpt.attention": "pallas"}, needs="gpu"),
    Technique("fp8", "precision", "FP8 matmuls in the blocks (delayed scaling), bf16 elsewhere",
              {"precision.policy": "fp8"}, needs="fp8"),
    Technique("token-drop", "token dropping", "half of each row's tokens (random) in the middle "
              "layers (the last of a model under 3 layers)", {"token_drop.keep": 0.5}),
    Technique("sparse-2:4", "sparsity", "2:4 structured sparse weights (SR-STE); masked dense "
              "matmuls, no sparse kernel in jax", {"sparsity.pattern": "2:4"}),
    Technique("importance", "sampling", "importance sampling of documents by their last loss, "
              "the loss reweighted by 1/(N p)", {"data.sampling": "loss"}),
    Technique("lion", "optimizer", "Lion at its defaults", {"optimizer.name": "lion"}),
    Technique("lamb", "optimizer", "LAMB at its defaults", {"optimizer.name": "lamb"}),
    Technique("accumulate", "accumulation", "gradient accumulation over microbatches", {}),
    Technique("dp", "sharding", "data parallel over all devices",
              {"mesh.strategy": "dp", "mesh.num_devices": None}, needs="devices"),
    Technique("fsdp", "sharding", "FSDP (ZeRO-3) over all devices",
              {"mesh.strategy": "fsdp", "mesh.num_devices": None}, needs="devices"),
    Technique("best", "combination", "the best combination", {}),
]
BY_NAME = {t.name: t for t in TECHNIQUES}
QUALITY_GROUPS = ("optimizer", "sampling")     # chosen by validation loss, not speed
SPEED_GROUPS = ("padding", "precision", "remat", "attention", "token dropping", "accumulation",
                "sharding")



@dataclasses.dataclass
class SpeedupSettings:
    scale: str = setting("auto", "preset: cpu (a 2-layer, 128-wide model at seq_len 1024, batch "
                              "8, 160k real tokens per row: 10-20 minutes on 2 cores) or gpu "
                              "(GPT-2 small shape, seq_len 1024, batch 16, 1.5M real tokens per "
                              "row); auto: gpu when a GPU is visible", choices=SCALES)
    rows: str = setting(",".join(t.name for t in TECHNIQUES),
                     "comma-separated rows (the baseline always runs): "
                     + ", ".join(t.name for t in TECHNIQUES))
    best: str | None = setting(None, "comma-separated rows whose settings the best row combines "
                                  "(default: chosen from the measurements)")
    speed_margin: float = setting(0.03, "a technique joins the combination only if it is at least "
                                     "this much faster than the baseline")
    quality_tolerance: float = setting(0.02, "... and its validation bits per byte are at most this "
                                          "much (relative) above the baseline's")
    optimizer_slowdown: float = setting(0.10, "an optimizer with a lower validation loss joins if "
                                           "it is at most this much slower than the baseline")
    row_accumulate: int = setting(2, "microbatches of the accumulate row")
    rounds: int = setting(2, "train every row in this many rounds, each a share of its steps "
                             "resumed from the round before, the rows taking turns, so that a "
                             "change of the machine's load meets every row; a speedup is the "
                             "median of its rounds' and its spread their half-range (1: each "
                             "row in one go)", at_least=1, at_most=20)
    cpu_devices: int | None = setting(None, "on a CPU, devices each row's process sees "
                                            "(default: one per core); the sharding rows use "
                                            "them all")


@dataclasses.dataclass
class SpeedupConfig(TrainConfig):
    """The training config of the baseline (defaults from the --scale preset), the rows and the
    combination. The settings in ``BASELINE`` are each row's own: they are no flags here."""

    experiment: SpeedupSettings = dataclasses.field(default_factory=SpeedupSettings)


def probe_devices(cpu_devices: int) -> dict:
    """The platform, kind and count of the devices a row's process sees, asked in a process of
    its own so that this one never holds a device (a GPU's memory stays the rows')."""
    code = ("import json, jax; d = jax.devices(); print(json.dumps({'platform': d[0].platform, "
            "'device_kind': d[0].device_kind, 'device_count': len(d), "
            "'compute_capability': getattr(d[0], 'compute_capability', None), "
            "'jax_version': jax.__version__}))")
    done = subprocess.run([sys.executable, "-c", code], env=row_environment(cpu_devices),
                          capture_output=True, text=True)
    if done.returncode:
        raise ConfigError(f"jax could not start: {_last_line(done.stderr)}; check the jax "
                          f"installation (make setup)")
    return json.loads(done.stdout.strip().splitlines()[-1])


def row_environment(cpu_devices: int) -> dict:
    """A row process's environment: its CPU devices, and this process as the parent it dies
    with (``experiments.common.die_with_parent``)."""
    return {**os.environ, "JAX_NUM_CPU_DEVICES": str(cpu_devices),
            PARENT_PID: str(os.getpid())}


def parse_config(argv=None) -> tuple[SpeedupConfig, dict]:
    """The flags over the preset of ``--scale`` (auto: gpu when the probe sees a GPU)."""
    early = argparse.ArgumentParser(add_help=False)
    early.add_argument("--scale", choices=SCALES, default="auto")
    early.add_argument("--cpu-devices", type=int, default=None)
    known, _ = early.parse_known_args(argv)
    cpu_devices = known.cpu_devices or os.cpu_count() or 1
    if cpu_devices < 1:
        raise ConfigError(f"cpu_devices must be at least 1, got {cpu_devices}",
                          field="experiment.cpu_devices")
    devices = probe_devices(cpu_devices)
    scale = known.scale
    if scale == "auto":
        scale = "gpu" if devices["platform"] == "gpu" else "cpu"
    cfg = parse_experiment(argv, SpeedupConfig, defaults={**DEFAULTS, **PRESETS[scale]},
                           fixed=FIXED, description=__doc__.split("\n\n")[0])
    return override(cfg, {"experiment.scale": scale, "experiment.cpu_devices": cpu_devices}), \
        devices


def train_config(cfg: SpeedupConfig, settings: dict, run_dir: str | None) -> TrainConfig:
    """A row's TrainConfig: the experiment's training settings, the baseline, then ``settings``
    (every row validates on the same batches: the baseline's rows)."""
    base = TrainConfig(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(TrainConfig)})
    baseline = {k: v for k, v in BASELINE.items()
                if is_preset(cfg.model.name) or not k.startswith(GPT_SECTION)}
    return override(base, {**baseline, "run.json": None, "run.run_dir": run_dir,
                           "run.eval_batch_size": cfg.data.batch_size, **settings})


def row_settings(cfg: SpeedupConfig, technique: Technique, documents,
                 depth: int | None = None) -> dict:
    """The settings a row changes from the baseline (batch sizes matched for padding rows);
    ``depth``: the blocks of the model's stack (None: not known yet, ``check_models`` fills in
    what depends on it)."""
    settings = dict(technique.settings)
    if technique.group == "padding":
        settings.update(matched_batch(documents, cfg, settings["data.batching"]))
    settings = with_depth(technique.name, settings, depth)
    if technique.name == "accumulate":
        settings["optimizer.accumulate"] = cfg.experiment.row_accumulate
    return settings


def with_depth(name: str, settings: dict, depth: int | None) -> dict:
    """A row's settings with what depends on the model's depth: the token-drop row drops in the
    last layer of a model under 3 layers (the default middle half of a shallow model is
    empty)."""
    if name == "token-drop" and depth is not None and depth < 3:
        settings = {**settings, "token_drop.layers": f"{depth - 1}:{depth}"}
    return settings


def model_depth(cfg: SpeedupConfig) -> int | None:
    """The depth of a GPT preset's stack (pure Python: this process holds no device); None for
    a factory, whose model only ``check_models`` builds."""
    shape = gpt_shape(cfg)
    return shape.n_layers if shape else None


# ---------------------------------------------------------------------------------------------
# A model of one's own: every row's model checked before any row trains, in a CPU process (this
# one never holds a device: a GPU's memory stays the rows').

CHECK_MODELS = ("import json, sys; from experiments.speedup import check_models; "
                "print(json.dumps(check_models(json.load(sys.stdin))))")


def check_rows(cfg: SpeedupConfig, settings_of: dict[str, dict],
               devices: dict) -> tuple[int | None, dict[str, dict], dict[str, str]]:
    """``(depth, settings, reasons)`` for a factory's rows: the depth of its stack, each row's
    settings completed (``with_depth``), and why each row that cannot train its model so is
    skipped (``check_models``, run in a CPU process of its own). A baseline that cannot train,
    or a factory that does not build, is one ConfigError line before any work."""
    request = {"config": flatten(to_dict(train_config(cfg, {}, run_dir=None))),
               "rows": settings_of, "device_count": devices["device_count"]}
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "1"}
    done = subprocess.run([sys.executable, "-c", CHECK_MODELS], input=json.dumps(request),
                          env=env, capture_output=True, text=True)
    check_stop()
    if done.returncode:
        raise ConfigError(f"checking the rows' models of {cfg.model.name} failed: "
                          f"{_last_line(done.stderr)}", field="model.name")
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    if "error" in answer:
        raise ConfigError(answer["error"]["message"], field=answer["error"]["field"])
    rows = answer["rows"]
    if rows.get("baseline", {}).get("reason"):
        raise ConfigError(f"the baseline cannot train {cfg.model.name}: "
                          f"{rows['baseline']['reason']}", field="model.name")
    return (answer["depth"], {name: row["settings"] for name, row in rows.items()},
            {name: row["reason"] for name, row in rows.items() if row["reason"]})


def check_models(request: dict) -> dict:
    """In the CPU process of ``check_rows``: the depth of the model's stack (None without one)
    and, for each row (``request["rows"]``: name -> settings over the baseline's config,
    ``request["config"]``), its settings completed and why its model cannot train (None when
    it can): the run's own checks before any work (``TrainConfig.validate``,
    ``loop.preflight``: the model built abstractly with every technique, its contract, its
    splits over the row's mesh, the remat policy's tags)."""
    from jaxaccel.loop import preflight
    from jaxaccel.sharding import mesh_shape, parse_mesh

    base = build(TrainConfig, request["config"])
    try:
        depth = stack_depth(base)
    except ConfigError as e:
        return {"error": {"message": str(e), "field": e.field}}
    rows = {}
    for name, settings in request["rows"].items():
        settings = with_depth(name, settings, depth)
        reason = None
        try:
            row_cfg = override(base, settings)
            row_cfg.validate()
            shape = mesh_shape(row_cfg.mesh.strategy,
                               row_cfg.mesh.num_devices or request["device_count"],
                               parse_mesh(row_cfg.mesh.shape))
            preflight(row_cfg, shape)
        except ConfigError as e:
            reason = describe_error(e).removeprefix("error: ")
        rows[name] = {"settings": settings, "reason": reason}
    return {"depth": depth, "rows": rows}


def skip_reason(technique: Technique, devices: dict, model_name: str = "tiny") -> str | None:
    gpt_fields = [k for k in technique.settings if k.startswith(GPT_SECTION)]
    if gpt_fields and not is_preset(model_name):
        return (f"sets {', '.join(gpt_fields)}, a field of jaxaccel's GPT presets; --model "
                f"{model_name} is a model of its own")
    if technique.needs == "gpu" and devices["platform"] != "gpu":
        return "needs a GPU"
    if technique.needs == "fp8" and not (devices["platform"] == "gpu" and float(
            devices.get("compute_capability") or 0) >= 8.9):
        return "needs a GPU with FP8 tensor cores (elsewhere: experiments.precision's fp8 row)"
    if technique.needs == "devices" and devices["device_count"] < 2:
        return "needs more than one device"
    return None


def choose_best(rows: dict[str, dict], margin: float, tolerance: float,
                slowdown: float) -> list[tuple[str, str]]:
    """(row, why) for each technique the measurements recommend combining (module docstring)."""
    ran = [r for r in rows.values() if r["status"] == "ran" and r["name"] != "baseline"]
    picks = []
    for group in SPEED_GROUPS:
        # a gain counts when it clears the margin and the row's spread over its rounds
        good = [r for r in ran if r["group"] == group and r["speedup"] >= 1 + margin
                and r["speedup"] - (r.get("spread") or 0.0) > 1
                and r["quality_diff"] <= tolerance]
        if good:
            row = max(good, key=lambda r: r["speedup"])
            picks.append((row["name"], f"fastest {group} row within the quality tolerance: "
                                       f"{_speed(row)}, val {row['quality_diff']:+.1%}"))
    padded = any(rows[name].get("settings", {}).get("data.batching", "fixed") != "fixed"
                 for name, _ in picks)
    for group in QUALITY_GROUPS:
        better = [r for r in ran if r["group"] == group and r["quality_diff"] < 0
                  and r["speedup"] >= 1 - slowdown]
        if group == "sampling" and padded:
            better = []     # importance sampling draws rows of fixed batching only
        if better:
            row = min(better, key=lambda r: r["val_bpb"])
            picks.append((row["name"], f"lowest validation loss: val {row['quality_diff']:+.1%} "
                                       f"at {_speed(row)}"))
    return picks


def _speed(row: dict) -> str:
    """``1.42x`` with one round, ``1.42x +- 0.03`` (median, half-range) with several, and the
    verdict (``faster``, ``slower``, ``cannot tell``) when it has one."""
    rounds = len(row.get("round_speedups") or ())
    return (f"{row['speedup']:.2f}x" + (f" +- {row['spread']:.2f}" if rounds > 1 else "")
            + (f" ({row['verdict']})" if row.get("verdict") else ""))


def best_groups(names: list[str]) -> dict[str, str]:
    """The group of each row the best row combines (``--best``), by group; ConfigError for a
    name that is no technique row or two rows of one group (checked before any row runs)."""
    groups = {}
    for name in names:
        group = BY_NAME[name].group
        if group in ("baseline", "combination"):
            raise ConfigError(f"--best cannot combine {name!r}; name technique rows",
                              field="experiment.best")
        if group in groups:
            raise ConfigError(f"--best names two {group} rows ({groups[group]} and {name}); "
                              f"keep one", field="experiment.best")
        groups[group] = name
    return groups


def combine(settings_of: dict[str, dict], names: list[str], device_count: int) -> dict:
    """The settings of the named rows together; the batch rounded up to split over the devices
    (when a sharding row is among them) times the microbatches."""
    groups = best_groups(names)
    settings = {}
    for name in names:
        settings.update(settings_of[name])
    multiple = batch_multiple(settings, groups, device_count)
    if settings.get("data.batch_size"):
        settings["data.batch_size"] = -(-settings["data.batch_size"] // multiple) * multiple
    return settings


def batch_multiple(settings: dict, groups, device_count: int) -> int:
    """Rows of every batch must be a multiple of this: the devices (with a sharding row) times
    the microbatches."""
    return (device_count if "sharding" in groups else 1) * settings.get("optimizer.accumulate", 1)


def start_row(cfg: SpeedupConfig, technique: Technique, settings: dict, run_root: str,
              name: str | None = None) -> dict:
    """A row's record, and its run directory holding its resolved training config."""
    run_dir = os.path.join(run_root, name or technique.name)
    train_cfg = train_config(cfg, settings, run_dir)
    train_cfg.validate()
    os.makedirs(run_dir, exist_ok=True)
    write_config(override(train_cfg, {"run.json": os.path.join(run_dir, "summary.json")}),
                 run_dir)
    return {"name": name or technique.name, "group": technique.group,
            "description": technique.description, "settings": settings,
            "command": f"python -m experiments.train --config {run_dir}/config.yaml",
            "run_dir": run_dir, "rounds": [], "status": "running"}


def run_round(cfg: SpeedupConfig, row: dict, index: int, rounds: int):
    """Train round ``index`` (from 0) of ``rounds`` of a row in its own process: the steps up
    to ``(index + 1) / rounds`` of its run (``--stop-at``), resumed from the round before's
    checkpoint. Appends the round's real tokens/s to ``row["rounds"]``; after the last round
    the row holds its summary, with the speed of all its rounds together."""
    run_dir = row["run_dir"]
    argv = ["--config", os.path.join(run_dir, "config.yaml")]
    if index:
        argv.append("--resume")
        if cfg.run.profile is not None:     # --profile traces its window in the first round
            argv.append("run.profile=null")
    if index + 1 < rounds:
        argv += ["--stop-at", f"{index + 1}/{rounds}"]
    start = time.perf_counter()
    with open(os.path.join(run_dir, "log.txt"), "a" if index else "w") as log:
        log.write(f"round {index + 1} of {rounds}: python -m experiments.train "
                  f"{' '.join(argv)}\n")
        log.flush()
        returncode, stderr = run_child([sys.executable, "-m", "experiments.train", *argv],
                                       row_environment(cfg.experiment.cpu_devices), log)
        log.write(stderr)
    seconds = time.perf_counter() - start
    if stop_requested():        # the row's process got the signal too and saved a checkpoint
        row["status"] = f"stopped by {stop_requested()} in round {index + 1} of {rounds}"
        raise Interrupted(stop_requested())
    if returncode:
        row["status"] = f"failed: {_last_line(stderr)}" + (
            f" (round {index + 1} of {rounds})" if rounds > 1 else "")
        return
    summary = RunSummary.read(os.path.join(run_dir, "summary.json"))
    row["rounds"].append({"real_tokens_per_s": summary.real_tokens_per_s,
                          "real_tokens": summary.real_tokens, "train_s": summary.train_s,
                          "padding_efficiency": summary.padding_efficiency,
                          "steps": summary.steps_this_run, "compile_s": summary.compile_s,
                          "process_s": seconds})
    if index + 1 == rounds:
        finish_row(row, summary)


def finish_row(row: dict, summary: RunSummary):
    """The row's record from its last round's summary, its speed from all its rounds."""
    memory = summary.step_memory_bytes or {}
    rounds = row["rounds"]
    real = sum(r["real_tokens"] for r in rounds)
    positions = sum(r["real_tokens"] / r["padding_efficiency"] for r in rounds)
    train_s = sum(r["train_s"] for r in rounds)
    row.update(dataclasses.asdict(summary), **technique_fields(summary), status="ran",
               shapes=len(summary.shapes),
               memory_bytes=memory.get("total"), temp_bytes=memory.get("temp"),
               real_tokens=real, train_s=train_s, real_tokens_per_s=real / train_s,
               padding_efficiency=real / positions,
               achieved_flops_per_s=real / train_s * summary.flops_per_token,
               compile_s=rounds[0]["compile_s"],       # later rounds read the compile cache
               process_s=sum(r["process_s"] for r in rounds))
    if summary.mfu is not None:
        row["mfu"] = summary.mfu * row["real_tokens_per_s"] / summary.real_tokens_per_s


def technique_fields(summary: RunSummary) -> dict:
    """What a row's run did with each technique, as the row's own keys (``remat``,
    ``attention``, ...), read from the summary's ``techniques``."""
    return {"attention": done(summary, "attention"),
            "remat": done(summary, "remat", "policy", "none"),
            "scan_layers": done(summary, "remat", "scan_layers", False),
            "token_keep": done(summary, "token_drop", "keep", 1.0),
            "sparsity": done(summary, "sparsity", "pattern", "none"),
            "sparsity_density": done(summary, "sparsity", "density"),
            "fp8": done(summary, "fp8", "note"), "fp8_gemms": done(summary, "fp8", "gemms"),
            "sampling": done(summary, "sampling", default="uniform")}


def run_child(argv: list[str], env: dict, log) -> tuple[int, str]:
    """Run a row's process (stdout to ``log``) and wait for it: ``(exit code, stderr)``. A
    SIGINT/SIGTERM the experiment receives meanwhile is passed on to it, once (it runs in a
    process group of its own, so a terminal's Ctrl-C reaches it only this way), so that it
    stops after its current step with a checkpoint; and it stops with this process
    (``PARENT_PID`` in its environment: ``common.die_with_parent``), so that no row trains on
    detached if this one is killed."""
    child = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.PIPE, text=True,
                             process_group=0)
    try:
        with passing_signals_to(child.send_signal):
            if stop_requested():        # the signal came while the process was starting
                child.send_signal(signal.Signals[stop_requested()])
            _, stderr = child.communicate()
    finally:
        if child.poll() is None:        # a second Ctrl-C: stop it, and do not wait long
            child.kill()
            child.wait()
    return child.returncode, stderr


def _last_line(text: str) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1] if lines else "no error output"


def compare(row: dict, baseline: dict):
    """Speedup and relative validation difference against the baseline, in place. The speedup
    of each round is the row's real tokens/s over the baseline's in the same round; the row's
    speedup is their median and its spread their half-range (0 with one round)."""
    if row["status"] != "ran" or baseline["status"] != "ran":
        row.setdefault("speedup", None)
        row.setdefault("spread", None)
        row.setdefault("quality_diff", None)
        row.setdefault("verdict", None)
        return
    ratios = [mine["real_tokens_per_s"] / base["real_tokens_per_s"]
              for mine, base in zip(row["rounds"], baseline["rounds"])]
    row["round_speedups"] = ratios
    row["speedup"] = statistics.median(ratios)
    row["spread"] = _half_range(ratios)
    row["verdict"] = verdict(ratios) if row is not baseline else None
    row["quality_diff"] = row["val_bpb"] / baseline["val_bpb"] - 1


def verdict(ratios: list[float]) -> str:
    """``faster`` or ``slower`` only when every round says so (the spread of the rounds' ratios
    excludes 1.0), else ``cannot tell``: a busy machine may then blur a verdict, never flip it.
    One round measures no spread, and decides nothing."""
    if len(ratios) > 1 and min(ratios) > 1:
        return "faster"
    if len(ratios) > 1 and max(ratios) < 1:
        return "slower"
    return "cannot tell"


def load_variation(row: dict) -> float | None:
    """How much a row's own real tokens/s varied between its rounds: the half-range over the
    median (the machine's load, for the baseline), None before it ran."""
    if row["status"] != "ran":
        return None
    speeds = [r["real_tokens_per_s"] for r in row["rounds"]]
    return _half_range(speeds) / statistics.median(speeds)


def _half_range(values: list[float]) -> float:
    return (max(values) - min(values)) / 2


def _mb(value) -> str:
    return "n/a" if value is None else f"{value / 2**20:,.0f} MB"


def _change(value, reference) -> str:
    if value is None or not reference:
        return "n/a"
    return f"{value / reference - 1:+.0%}"


def explain(row: dict, base: dict) -> str:
    """One line on what the row's technique did, from its measurements."""
    if row["status"] != "ran":
        return f"**{row['name']}** ({row['description']}): not run, {row['status']}."
    speed = f"{_speed(row)} the baseline's real tokens/s"
    quality = f"validation {row['val_bpb']:.3f} bits/byte ({row['quality_diff']:+.1%})"
    memory = f"compiled step memory {_mb(row['memory_bytes'])} " \
             f"({_change(row['memory_bytes'], base['memory_bytes'])})"
    group = row["group"]
    if group == "baseline":
        detail = (f"{row['real_tokens_per_s']:,.0f} real tokens/s at padding efficiency "
                  f"{row['padding_efficiency']:.1%}, compiled step memory "
                  f"{_mb(row['memory_bytes'])}, "
                  f"validation {row['val_bpb']:.3f} bits/byte")
        return f"**baseline** ({row['description']}): {detail}."
    if group == "padding":
        detail = (f"padding efficiency {row['padding_efficiency']:.1%} (baseline "
                  f"{base['padding_efficiency']:.1%}) with {row['shapes']} batch shape(s), "
                  f"{row['compiles']} compiles ({row['compile_s']:.1f} s); {speed}; {quality}")
    elif group == "precision":
        detail = (f"{memory}; {speed}; {quality}; final loss scale {row['loss_scale']:g}, "
                  f"{row['skipped_steps']} skipped steps")
    elif group == "accumulation":
        detail = f"{row['accumulate']} microbatches per step: {memory}; {speed}; {quality}"
    elif group == "optimizer":
        detail = (f"optimizer state {row['optimizer_state_bytes']:,} bytes (baseline "
                  f"{base['optimizer_state_bytes']:,}); {quality}; {speed}")
    elif group == "sharding":
        devices = math.prod(row["mesh"].values())
        detail = (f"{devices} devices, parameters + optimizer state "
                  f"{row['param_opt_bytes_per_device']:,} bytes per device (baseline "
                  f"{base['param_opt_bytes_per_device']:,}), {memory} per device; {speed}; "
                  f"{quality}")
    elif group == "combination":
        detail = f"{speed}; {quality}; {memory}"
    else:
        detail = f"{memory}; {speed}; {quality}"
    return f"**{row['name']}** ({row['description']}): {detail}."


COLUMNS = [
    ("name", "row", ""),
    ("real_tokens_per_s", "real tok/s", ",.0f"),
    ("speedup", "speedup", ".2f"),
    ("spread", "+-", ".2f"),
    ("verdict", "verdict", ""),
    ("padding_efficiency", "padding eff.", ".1%"),
    ("shapes", "shapes", "d"),
    ("compiles", "compiles", "d"),
    ("compile_s", "compile s", ".1f"),
    ("memory_mb", "step MB", ",.0f"),
    ("peak_mb", "peak MB", ",.0f"),
    ("mfu", "MFU", ".1%"),
    ("val_bpb", "val bpb", ".3f"),
    ("quality_diff", "vs baseline", "+.1%"),
    ("note", "note", ""),
]


def table(rows: list[dict]) -> str:
    shown = []
    for r in rows:
        shown.append({**r, "memory_mb": _scaled(r.get("memory_bytes")),
                      "peak_mb": _scaled(r.get("peak_memory_bytes")),
                      "note": "" if r["status"] == "ran" else r["status"]})
    return format_table(shown, COLUMNS)


def _scaled(value):
    return None if value is None else value / 2**20


def targets(best: dict | None, base: dict, scale: str, devices: dict) -> list[str]:
    """The issue's targets, checked against the measured best row."""
    if best is None or best["status"] != "ran":
        return ["no best combination ran: the targets are unmeasured"]
    lines = []
    quality_ok = best["val_bpb"] <= base["val_bpb"]
    if scale == "cpu":
        ok = best["speedup"] >= 2 and quality_ok
        lines.append(f"CPU target (best >= 2x the baseline's real tokens/s at equal or better "
                     f"validation loss): {'met' if ok else 'not met'}, {best['speedup']:.2f}x at "
                     f"{best['quality_diff']:+.2%}")
    else:
        mfu = best["mfu"]
        ok = mfu is not None and mfu >= 0.45 and best["speedup"] >= 4
        mfu_text = "unknown (no peak for this device)" if mfu is None else f"{mfu:.1%}"
        lines.append(f"GPU target (best >= 45 % MFU and >= 4x the baseline's real tokens/s; "
                     f"stated for an H100): {'met' if ok else 'not met'}, MFU {mfu_text}, "
                     f"{best['speedup']:.2f}x, validation {best['quality_diff']:+.2%} on "
                     f"{devices['device_kind']}")
    return lines


def rounds_line(meta: dict) -> str:
    """How the speedups were measured: rounds, and how much the baseline itself varied."""
    if meta["rounds"] == 1:
        return ("Each row trained in one go, one after the other; a speedup compares moments "
                "of the machine that may differ in load, and decides nothing (verdict: cannot "
                "tell; --rounds N measures the spread).")
    variation = meta["baseline_load_variation"]
    return (f"Each row trained in {meta['rounds']} rounds, the rows taking turns; a speedup is "
            f"the median of its rounds' (the row's real tokens/s over the baseline's in the same "
            f"round), +- half their range; a row is faster or slower only when every round says "
            f"so (else: cannot tell), and joins the best combination only when its gain "
            f"exceeds that spread"
            + (". The best row took turns with the baseline trained again"
               if meta["best_rounds"] else "")
            + f". The baseline's own real tokens/s varied by +-{variation:.1%} between rounds.")


def write_report(path: str, rows: list[dict], meta: dict, picks: list[tuple[str, str]],
                 target_lines: list[str]):
    base = rows[0]
    lines = [
        f"# experiments.speedup, {meta['scale']} preset",
        "",
        f"Command: `{meta['command']}`  ",
        f"Device: {meta['device_count']} x {meta['device']}, jax {meta['jax_version']}, "
        f"{meta['date']}  ",
        f"Model: {meta['model']} ({meta['params']:,} parameters), seq_len {meta['seq_len']}, "
        f"baseline batch {meta['batch_size']} rows, {meta['train_tokens']:,} real tokens per "
        f"row, final validation on {meta['val_tokens']:,} tokens",
        "",
        table(rows),
        "",
        rounds_line(meta),
        "",
        "## What each technique did",
        "",
        *[f"- {explain(r, base)}" for r in rows],
        "",
        "## The combination",
        "",
        f"Rows combined ({meta['best_source']}): "
        + ("; ".join(f"{n} ({why})" for n, why in picks) if picks else "none"),
        "",
        *[f"- {line}" for line in target_lines],
        "",
        "Each row's command is in the JSON (`--json`) and in its directory's log.txt.",
    ]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def plot(run_root: str, rows: list[dict], title: str):
    ran = [r for r in rows if r["status"] == "ran"]
    if not ran:
        return
    labels = [r["name"] for r in ran]
    bar_chart(os.path.join(run_root, "tokens_per_s.png"), labels,
              [("real tokens/s", [r["real_tokens_per_s"] for r in ran])], title=title)
    panels = [("compiled step memory (MB)", [(r["memory_bytes"] or 0) / 2**20 for r in ran])]
    if any(r["peak_memory_bytes"] for r in ran):
        panels.append(("peak device memory (MB)",
                       [(r["peak_memory_bytes"] or 0) / 2**20 for r in ran]))
    bar_chart(os.path.join(run_root, "memory.png"), labels, panels, title=title)
    plot_loss_curves(os.path.join(run_root, "loss_curves.png"),
                     {r["name"]: r["run_dir"] for r in ran}, title=title)


def train_in_rounds(cfg: SpeedupConfig, plan: list, rows: dict, run_root: str,
                    reference: str):
    """Train the rows of ``plan`` (technique, settings, name) in ``experiment.rounds`` rounds,
    taking turns: round k trains every row's k-th share of its steps (``run_round``), so that
    a change in the machine's load meets every row alike. Each row's record goes into ``rows``
    when its first round starts; the progress line compares each round with ``reference``'s
    (a row of the plan, trained first in every round)."""
    rounds = cfg.experiment.rounds
    for index in range(rounds):
        for technique, settings, name in plan:
            check_stop()
            if index == 0:
                rows[name] = start_row(cfg, technique, settings, run_root, name)
            row = rows[name]
            if row["status"] != "running":      # failed in an earlier round
                continue
            run_round(cfg, row, index, rounds)
            _progress_line(row, index, rounds, rows[reference])


def best_row(cfg: SpeedupConfig, rows: dict, best_names, documents, devices: dict,
             depth: int | None = None):
    """The best combination's technique, settings and picks ((row, why) for each row it
    combines): the rows named by ``--best``, or those the measurements recommend."""
    exp = cfg.experiment
    if best_names:
        picks = [(n, "named by --best") for n in best_names]
    else:
        picks = choose_best(rows, exp.speed_margin, exp.quality_tolerance,
                            exp.optimizer_slowdown)
    chosen = [n for n, _ in picks]
    settings = combine({n: rows[n]["settings"] if n in rows else
                        row_settings(cfg, BY_NAME[n], documents, depth) for n in chosen},
                       chosen, devices["device_count"])
    multiple = batch_multiple(settings, {BY_NAME[n].group for n in chosen},
                              devices["device_count"])
    if multiple > 1 and settings.get("data.batching", "fixed") != "fixed":
        # re-match the padding row's batch to the baseline's real tokens per step under the
        # rounding, so the combination takes the same number of steps
        settings.update(matched_batch(documents, cfg, settings["data.batching"],
                                      multiple=multiple))
    technique = dataclasses.replace(
        BY_NAME["best"], description="the best combination: "
        + (" + ".join(chosen) or "nothing beat the baseline"))
    return technique, settings, picks


@command(SpeedupConfig)
def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    cfg, devices = parse_config(argv)
    exp = cfg.experiment
    names = parse_list(exp.rows, "experiment.rows", valid=BY_NAME)
    if cfg.data.tokens_per_batch is not None:
        raise ConfigError("the baseline's batch is batch_size rows; leave tokens_per_batch unset",
                          field="data.tokens_per_batch")
    if exp.row_accumulate < 1 or (cfg.data.batch_size or 0) % exp.row_accumulate:
        raise ConfigError(f"row_accumulate={exp.row_accumulate} must be >= 1 and divide "
                          f"batch_size={cfg.data.batch_size}", field="experiment.row_accumulate")
    best_names = parse_list(exp.best, "experiment.best", valid=BY_NAME) if exp.best else None
    if best_names and "best" not in names:
        raise ConfigError(f"--best {exp.best} names what the best row combines, and --rows "
                          f"{exp.rows} has no best row; add best to --rows or leave --best out",
                          field="experiment.best")
    if best_names:
        best_groups(best_names)         # before any row runs, not when the best row comes
    techniques = [t for t in TECHNIQUES if t.name == "baseline" or t.name in names]
    run_root = cfg.run.run_dir or os.path.join("runs", time.strftime("speedup-%Y%m%d-%H%M%S"))
    if os.path.exists(os.path.join(run_root, "report.md")):
        raise ConfigError(f"{run_root} already holds a speedup report; choose another run_dir",
                          field="run.run_dir")
    documents = corpus_of(cfg.data).train
    print(f"experiments.speedup: {exp.scale} preset on {devices['device_count']} x "
          f"{devices['device_kind']}; {len(techniques)} rows into {run_root}", flush=True)

    # Every row's settings and why a row cannot run here, before any row trains.
    named = [t for t in TECHNIQUES if t.name != "best"
             and (t in techniques or t.name in (best_names or ()))]
    depth = model_depth(cfg)
    settings_of = {t.name: row_settings(cfg, t, documents, depth) for t in named}
    reasons = {t.name: skip_reason(t, devices, cfg.model.name) for t in named}
    reasons = {name: why for name, why in reasons.items() if why}
    if not is_preset(cfg.model.name):
        depth, checked, unfit = check_rows(
            cfg, {n: v for n, v in settings_of.items() if n not in reasons}, devices)
        settings_of.update(checked)
        reasons.update(unfit)
    for name in best_names or ():
        if name in reasons:
            raise ConfigError(f"--best names {name}, which cannot run here: {reasons[name]}",
                              field="experiment.best")

    rows, picks, partial = {}, [], None
    try:
        plan = []
        for technique in techniques:
            if technique.name == "best":
                continue
            settings = settings_of[technique.name]
            reason = reasons.get(technique.name)
            if reason:
                rows[technique.name] = {"name": technique.name, "group": technique.group,
                                        "description": technique.description,
                                        "settings": settings, "status": f"skipped: {reason}"}
            else:
                plan.append((technique, settings, technique.name))
        train_in_rounds(cfg, plan, rows, run_root, "baseline")
        for row in rows.values():
            compare(row, rows["baseline"])
        if "best" in names and rows["baseline"]["status"] == "ran":
            check_stop()
            technique, settings, picks = best_row(cfg, rows, best_names, documents, devices,
                                                  depth)
            if exp.rounds > 1:      # the baseline again, taking turns with the best row
                train_in_rounds(cfg, [(BY_NAME["baseline"], {}, "baseline-again"),
                                      (technique, settings, "best")], rows, run_root,
                                "baseline-again")
                again = rows.pop("baseline-again")
                # a retrained baseline that failed leaves the first one as the reference
                compare(rows["best"], again if again["status"] == "ran" else rows["baseline"])
                rows["best"]["baseline_again"] = {
                    k: again.get(k) for k in ("status", "rounds", "real_tokens_per_s",
                                              "val_bpb", "run_dir")}
            else:
                train_in_rounds(cfg, [(technique, settings, "best")], rows, run_root,
                                "baseline")
                compare(rows["best"], rows["baseline"])
            if rows["best"]["status"] == "ran":     # the verdict's quality against the baseline's
                rows["best"]["quality_diff"] = (rows["best"]["val_bpb"]
                                                / rows["baseline"]["val_bpb"] - 1)
    except Interrupted as stop:     # a cut row is not a result; later rows do not run
        if rows.get("baseline", {}).get("status") != "ran":
            raise
        partial = stop.signal
        for row in rows.values():
            if row["status"] == "running":
                row["status"] = (f"stopped by {partial} after {len(row['rounds'])} of "
                                 f"{exp.rounds} rounds")
            compare(row, rows["baseline"])
        rows.pop("baseline-again", None)
        print(f"  stopped by {partial}: the rows that finished every round are the results",
              flush=True)

    ordered = [rows[t.name] for t in techniques if t.name in rows]
    base = rows["baseline"]
    if base["status"] != "ran":
        print(f"error: the baseline did not run ({base['status']}); see "
              f"{base['run_dir']}/log.txt", file=sys.stderr)
        return 1
    best = rows.get("best")
    target_lines = targets(best, base, exp.scale, devices)
    meta = {"scale": exp.scale, "command": "python -m experiments.speedup " + " ".join(argv),
            "device": devices["device_kind"], "platform": devices["platform"],
            "device_count": devices["device_count"], "jax_version": devices["jax_version"],
            "date": time.strftime("%Y-%m-%d"), "model": base["model"], "params": base["params"],
            "seq_len": cfg.seq_len, "batch_size": cfg.data.batch_size,
            "train_tokens": cfg.run.train_tokens, "val_tokens": base["val_tokens"],
            "best": [n for n, _ in picks], "best_source": "--best" if best_names else
            "chosen from the measurements", "targets": target_lines, "run_dir": run_root,
            "interrupted": partial, "rounds": exp.rounds,
            "best_rounds": bool(best and best.get("baseline_again")),
            "baseline_load_variation": load_variation(base)}
    report = os.path.join(run_root, "report.md")
    write_report(report, ordered, meta, picks, target_lines)
    title = f"{meta['model']} model, seq_len {cfg.seq_len}, {devices['device_kind']}"
    plot(run_root, ordered, title)
    write_json(cfg.run.json, ordered, meta)
    ran = sum(r["status"] == "ran" for r in ordered)
    print(f"\n{meta['model']} model ({meta['params']:,} parameters), seq_len {cfg.seq_len}, "
          f"{cfg.run.train_tokens:,} real tokens per row, {devices['device_count']} x "
          f"{devices['device_kind']}, jax {devices['jax_version']}"
          + (f" (PARTIAL: stopped by {partial}; {ran} of {len(techniques)} rows)"
             if partial else ""))
    print(table(ordered))
    print(rounds_line(meta))
    print(f"\nbest = {' + '.join(meta['best']) or 'the baseline (nothing qualified)'} "
          f"({meta['best_source']})")
    for line in target_lines:
        print(line)
    print(f"report, plots and one directory per row: {run_root}")
    return exit_code(partial)


def _progress_line(row: dict, index: int, rounds: int, reference: dict):
    """One line per round of a row: its real tokens/s and the ratio to the reference row's in
    the same round; after its last round, its validation bits per byte."""
    label = f"round {index + 1}/{rounds}  " if rounds > 1 else ""
    if row["status"] not in ("running", "ran"):
        print(f"  {label}{row['name']:<16} {row['status']}", flush=True)
        return
    mine = row["rounds"][index]
    ratio = ""
    if len(reference.get("rounds", ())) > index:
        ratio = f"{mine['real_tokens_per_s'] / reference['rounds'][index]['real_tokens_per_s']:.2f}x"
    val = f"  val {row['val_bpb']:.3f} bpb" if row["status"] == "ran" else ""
    print(f"  {label}{row['name']:<16} {mine['real_tokens_per_s']:>12,.0f} real tok/s "
          f"{ratio:>7}{val}  ({mine['process_s']:.0f} s)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
