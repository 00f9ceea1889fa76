"""The headline experiment: how much sooner each technique, and all of them together, train
the model to the same quality, here.

    python -m experiments.speedup                    # the preset of this device (CPU: < 10 min)
    python -m experiments.speedup --scale gpu        # GPT-2 small shape, seq_len 1024
    python -m experiments.speedup --rows all         # every technique row
    python -m experiments.speedup --rows pack,bf16,best --json speedup.json

docs/HEADLINE.md describes the measure, the rows, the rounds and their
verdicts, the best combination and the report; docs/DESIGN.md how the experiment is declared on
the experiments' harness (``experiments.common.Experiment``). Besides:

- each round of a row runs what ``python -m experiments.train`` would, and on a GPU in a
  process of its own, so that the device's peak memory and a failure belong to that row alone;
  on a CPU (no peak memory) the rounds run one after another in one warm process
  (``experiments.rows``), so that only its first row pays for the imports and JAX's start,
  and a row that ends it leaves the next a new one (``--fresh-processes``: a process each);
  every process sees ``--cpu-devices`` devices on a CPU (the sharding rows split over them,
  the others use the first), and ``--profile START:STOP`` traces those steps in every row's
  first round;
- the padding rows size their batches (``bucket`` through a token budget) to hold the
  baseline's real tokens per step; the combination re-matches its padding row's batch after
  rounding the rows to the devices x microbatches;
- the stack row trains half the model's depth, doubled (progressive stacking) after
  ``--stack-share`` of the steps the baseline took to the target in the same round;
- this process never holds a device (a GPU's memory stays the rows'): the devices are probed,
  and a factory's models checked (``check_models``), in processes of their own.
"""

import argparse
import dataclasses
import functools
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from typing import TYPE_CHECKING

from experiments.common import (PARENT_PID, Experiment, Row, RowRun, Unmeasurable, check_stop,
                                config_of, first, gpt_shape, main_of, matched_batch, parse_list,
                                passing_signals_to, plot_loss_curves, stack_depth,
                                stop_requested, technique as done)
from jaxaccel.run.config import TrainConfig, build, describe_error, flatten, override, setting, \
    to_dict, write_config
from jaxaccel.data.corpus import corpus_of
from jaxaccel.core.errors import ConfigError
from jaxaccel.core.report import bar_chart
from jaxaccel.core.sections import TECHNIQUES as RECORDS, HeadlineRow, describe, is_preset

if TYPE_CHECKING:       # for the annotations only: jaxaccel.run.loop imports jax
    from jaxaccel.run.loop import RunSummary

SCALES = ("auto", "cpu", "gpu")

# The experiment's defaults, then each preset's (a flag given on the command line wins). The
# target is judged on the same validation batches as the final evaluation (so that is not run
# again), a few batches every few steps. The report draws every row's loss curve in one plot, so
# the rows draw none of their own. A row's weights are not kept, so it writes no checkpoint: at
# the gpu preset (85 M parameters) one would be about 0.9 GB, 3.5 s to write on a 2-core
# machine (a state of that size, 2026-11-27), and --rows all trains about 40 rows.
DEFAULTS = {"run.save_checkpoints": False, "run.progress": False, "run.eval_batches": 4,
            "run.final_eval_batches": 4, "run.loss_plot": False}
# CPU: a 2 x 128 model at seq_len 128 reaches 1 bit/byte below the stdlib corpus's unigram
# entropy (4.70) after 80 steps, 160k real tokens, 5-6 s of training on the faster 2-core
# machine (2026-11-27; 95 steps at the old lr took 15-17 s on the slower one); a row may train
# over twice that. Its AdamW learning rate is the one that got there
# in the fewest steps in a sweep of the baseline (BENCHMARKS.md, 2026-11-27; AdamW's default,
# 3e-3, took 95), so that no row's gain is the baseline's mistuning. GPU: set from the CPU's
# proportions and issue 16's H100 step times, run on an H200 on 2026-11-27 (BENCHMARKS.md);
# the budget for the whole experiment: 9 minutes.
PRESETS = {
    "cpu": {"model.name": "tiny", "gpt.d_model": 128, "gpt.n_layers": 2,
            "model.max_seq_len": 128, "data.seq_len": 128, "data.batch_size": 16,
            "run.train_tokens": 360_000, "optimizer.learning_rate": 1.5e-3,
            "optimizer.warmup_steps": 5, "run.eval_every": 5, "run.log_every": 5,
            "experiment.row_accumulate": 2},
    "gpu": {"model.name": "small", "data.seq_len": 1024, "data.batch_size": 16,
            "run.train_tokens": 3_000_000, "optimizer.warmup_steps": 20, "run.eval_every": 10,
            "run.log_every": 10, "experiment.row_accumulate": 4},
}

# What the baseline fixes; a technique row changes one of these. None of them is a flag here.
# Besides these, every technique with headline rows is off in the baseline (its record's ``off``).
BASELINE = {"data.batching": "fixed", "precision.policy": "fp32", "precision.loss_scale": "auto",
            "gpt.attention": "xla", "optimizer.name": "adamw", "optimizer.accumulate": 1,
            "mesh.strategy": "dp", "mesh.num_devices": 1, "run.memory_budget": None,
            "data.sampling": "uniform", "stacking.at": None,
            **{k: v for t in RECORDS if t.rows for k, v in t.off_values().items()}}
FIXED = (*BASELINE, "run.resume", "run.target_seconds", "run.stop_at")
# Fields of jaxaccel's GPT presets: a factory of one's own has none of them (model.build refuses
# them), so neither its baseline nor a row sets them.
GPT_SECTION = "gpt."

# The rows: the baseline, the rows of the run's own settings (padding, precision, attention,
# sampling, optimizers, accumulation, sharding) with each technique record's rows after the
# precision ones, and the best combination.
TECHNIQUES = [
    HeadlineRow("baseline", "baseline", "fixed padding, fp32, no remat, xla attention, AdamW, "
                "one device", {}),
    HeadlineRow("dynamic", "padding", "dynamic padding (each batch padded to its longest row)",
                {"data.batching": "dynamic"}),
    HeadlineRow("bucket", "padding", "length buckets with a token budget per batch",
                {"data.batching": "bucket"}),
    HeadlineRow("pack", "padding", "sequence packing with segment ids",
                {"data.batching": "pack"}),
    HeadlineRow("bf16", "precision", "bfloat16 compute, float32 master weights",
                {"precision.policy": "bf16"}),
    HeadlineRow("fp16", "precision", "float16 compute with dynamic loss scaling",
                {"precision.policy": "fp16", "precision.loss_scale": "dynamic"}),
    *[row for t in RECORDS for row in t.rows],
    HeadlineRow("flash", "attention", "our Pallas flash attention kernel",
                {"gpt.attention": "pallas"}, needs="gpu"),
    HeadlineRow("importance", "sampling", "importance sampling of documents by their last loss, "
                "the loss reweighted by 1/(N p)", {"data.sampling": "loss"}),
    *[HeadlineRow(name, "optimizer", f"{label} at its defaults (learning rate, weight decay)",
                  {"optimizer.name": name, "optimizer.learning_rate": None,
                   "optimizer.weight_decay": None})
      for name, label in (("lion", "Lion"), ("lamb", "LAMB"))],
    HeadlineRow("accumulate", "accumulation", "gradient accumulation over microbatches", {}),
    HeadlineRow("dp", "sharding", "data parallel over all devices",
                {"mesh.strategy": "dp", "mesh.num_devices": None}, needs="devices"),
    HeadlineRow("fsdp", "sharding", "FSDP (ZeRO-3) over all devices",
                {"mesh.strategy": "fsdp", "mesh.num_devices": None}, needs="devices"),
    HeadlineRow("best", "combination", "the best combination", {}),
]
BY_NAME = {t.name: t for t in TECHNIQUES}
# The groups whose soonest row the best row combines, in the order it names them: the run's
# own groups around the technique records' groups, but for a group whose rows never combine
# (sparsity: with no N:M sparse kernel in jax, its masked weights multiply densely).
GROUPS = ("padding", "precision",
          *dict.fromkeys(r.group for t in RECORDS for r in t.rows
                         if r.combine and r.group not in ("padding", "precision")),
          "attention", "accumulation", "sharding", "optimizer", "sampling")
CORE_ROWS = ("pack", "bf16", "remat-dots", "accumulate", "fsdp", "token-drop", "best")


@dataclasses.dataclass
class SpeedupSettings:
    scale: str = setting("auto", "preset: cpu (a 2-layer, 128-wide model at seq_len 128, batch 16, "
                              "AdamW at lr 1.5e-3, at most 360k real tokens per row: under 10 "
                              "minutes on 2 cores) or "
                              "gpu (GPT-2 small shape, seq_len 1024, batch 16, at most 3M real "
                              "tokens per row); auto: gpu when a GPU is visible", choices=SCALES)
    rows: str = setting("all", "comma-separated rows (the baseline always runs), all (every "
                               "row that can run here) or core (" + ",".join(CORE_ROWS) + "): "
                        + ", ".join(t.name for t in TECHNIQUES))
    best: str | None = setting(None, "comma-separated rows whose settings the best row combines "
                                  "(default: chosen from the measurements)")
    target_gap: float = setting(1.0, "without --target-bpb, the target is this many bits per "
                                     "byte below the corpus's unigram entropy", above=0)
    time_cap: float = setting(1.5, "a row gives up after this many times the baseline's training "
                                   "seconds to the target in the same round", above=1)
    speed_margin: float = setting(0.03, "a row is faster (or slower) only if it reaches the "
                                        "target at least this much sooner (or later) than the "
                                        "baseline in every round, and only a faster row joins "
                                        "the combination", at_least=0)
    row_accumulate: int = setting(2, "microbatches of the accumulate row")
    stack_share: float = setting(0.5, "the stack row doubles its depth after this share of the "
                                      "steps the baseline took to the target in the same round",
                                 above=0, below=1)
    quiet: float = setting(0.005, "the best row is compared with the baseline's rounds, not with "
                                  "the baseline trained again beside it, when the baseline's "
                                  "seconds per step varied by at most this share between its "
                                  "rounds (a quiet machine, as a GPU's is; 0: always train it "
                                  "again)", at_least=0)
    rounds: int = setting(2, "train every row this many times, afresh, the rows taking turns, so "
                             "that a change of the machine's load meets every row; a speedup is "
                             "the median of its rounds' and its spread their half-range; a row "
                             "that gives up is not trained again (1: one run each, no verdict)",
                    at_least=1, at_most=20)
    same_seed: bool = setting(False, "train every round from --seed (default: round k from --seed "
                                     "+ k - 1, every row alike, so that the spread covers the "
                                     "seed's luck in steps as well as the machine's load)")
    cpu_devices: int | None = setting(None, "on a CPU, devices each row's process sees "
                                            "(default: one per core); the sharding rows use "
                                            "them all")
    fresh_processes: bool = setting(False, "on a CPU, train each row's round in a process of "
                                           "its own (default: one after another in one "
                                           "process, so that only the first pays for the "
                                           "imports and JAX's start; on a GPU always a process "
                                           "each, whose peak memory is the row's)")


SpeedupConfig = config_of(SpeedupSettings)


@functools.cache
def probe_devices(cpu_devices: int) -> dict:
    """The platform, kind and count of the devices a row's process sees, asked in a process."""
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
    """A row process's environment: its CPU devices, and this process as its parent."""
    return {**os.environ, "JAX_NUM_CPU_DEVICES": str(cpu_devices),
            PARENT_PID: str(os.getpid())}


def devices_of(cfg: SpeedupConfig) -> dict:
    return probe_devices(cfg.experiment.cpu_devices or os.cpu_count() or 1)


def preset(argv: list[str]) -> dict:
    """The defaults: the experiment's, then the preset of ``--scale``."""
    early = argparse.ArgumentParser(add_help=False)
    early.add_argument("--scale", choices=SCALES, default="auto")
    early.add_argument("--cpu-devices", type=int, default=None)
    known, _ = early.parse_known_args(argv)
    if known.cpu_devices is not None and known.cpu_devices < 1:
        raise ConfigError(f"cpu_devices must be at least 1, got {known.cpu_devices}",
                          field="experiment.cpu_devices")
    return {**DEFAULTS, **PRESETS[scale_of(known.scale, known.cpu_devices)]}


def scale_of(scale: str, cpu_devices: int | None) -> str:
    """``--scale``, auto resolved: gpu when the rows' processes see a GPU."""
    if scale == "auto":
        gpu = probe_devices(cpu_devices or os.cpu_count() or 1)["platform"] == "gpu"
        scale = "gpu" if gpu else "cpu"
    return scale


def prepare(cfg: SpeedupConfig) -> SpeedupConfig:
    """The scale and CPU devices resolved, the flags checked, then the target set."""
    exp = cfg.experiment
    cfg = override(cfg, {"experiment.scale": scale_of(exp.scale, exp.cpu_devices),
                         "experiment.cpu_devices": exp.cpu_devices or os.cpu_count() or 1})
    names = parse_rows(exp.rows)
    if cfg.data.tokens_per_batch is not None:
        raise ConfigError("the baseline's batch is batch_size rows; leave tokens_per_batch unset",
                          field="data.tokens_per_batch")
    if exp.row_accumulate < 1 or (cfg.data.batch_size or 0) % exp.row_accumulate:
        raise ConfigError(f"row_accumulate={exp.row_accumulate} must be >= 1 and divide "
                          f"batch_size={cfg.data.batch_size}", field="experiment.row_accumulate")
    if not cfg.run.eval_every:
        raise ConfigError("the target is judged by the periodic evaluations; pass --eval-every "
                          "N (N >= 1)", field="run.eval_every")
    if best_names(cfg) and "best" not in names:
        raise ConfigError(f"--best {exp.best} names what the best row combines, and --rows "
                          f"{exp.rows} has no best row; add best to --rows or leave --best out",
                          field="experiment.best")
    best_groups(best_names(cfg))        # before any row runs, not when the best row comes
    return resolve_target(cfg, corpus_of(cfg.data))


def parse_rows(text: str) -> list[str]:
    if text.strip() == "all":
        return [t.name for t in TECHNIQUES]
    if text.strip() == "core":
        return list(CORE_ROWS)
    return parse_list(text, "experiment.rows", valid=BY_NAME)


def best_names(cfg: SpeedupConfig) -> list[str]:
    best = cfg.experiment.best
    return parse_list(best, "experiment.best", valid=BY_NAME) if best else []


def train_config(cfg: SpeedupConfig, settings: dict, run_dir: str | None) -> TrainConfig:
    """A row's TrainConfig: the experiment's training settings, the baseline, then ``settings``."""
    base = TrainConfig(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(TrainConfig)})
    baseline = {k: v for k, v in BASELINE.items()
                if is_preset(cfg.model.name) or not k.startswith(GPT_SECTION)}
    return override(base, {**baseline, "run.json": None, "run.run_dir": run_dir,
                           "run.eval_batch_size": cfg.data.batch_size, **settings})


def resolve_target(cfg: SpeedupConfig, corpus) -> SpeedupConfig:
    """The config with its target set: ``--target-bpb``, else the corpus's unigram entropy (of
    the train split's tokens, in bits per byte) minus ``--target-gap``."""
    if cfg.run.target_bpb is not None:
        return cfg
    unigram = corpus.unigram_bits_per_byte()
    target = unigram - cfg.experiment.target_gap
    if target <= 0:
        raise ConfigError(f"target_gap={cfg.experiment.target_gap:g} leaves no target below the "
                          f"corpus's unigram entropy of {unigram:.3f} bits per byte; pass a "
                          f"smaller --target-gap or --target-bpb",
                          field="experiment.target_gap")
    return override(cfg, {"run.target_bpb": round(target, 4)})


def row_settings(cfg: SpeedupConfig, technique: HeadlineRow, documents,
                 depth: int | None = None) -> dict:
    """The settings a row changes from the baseline (batch sizes matched for padding rows)."""
    settings = dict(technique.settings)
    if technique.group == "padding":
        settings.update(matched_batch(documents, cfg, settings["data.batching"]))
    settings = with_depth(technique.name, settings, depth)
    if technique.name == "accumulate":
        settings["optimizer.accumulate"] = cfg.experiment.row_accumulate
    return settings


def depth_reason(settings: dict, depth: int | None) -> str | None:
    """Why a row's progressive stacking cannot halve a preset's ``depth`` (a factory's model is
    checked by ``check_models``)."""
    from jaxaccel.techniques import stacking  # imports jax: not at the top, so that --help is fast
    if settings.get("stacking.stages", 1) > 1 and depth is not None:
        try:
            stacking.depths(depth, settings["stacking.stages"])
        except ConfigError as e:
            return describe_error(e).removeprefix("error: ")
    return None


def with_depth(name: str, settings: dict, depth: int | None) -> dict:
    """A row's settings with what depends on the model's depth: the token-drop row drops in the
    last layer of a model under 3 layers (whose default middle half is empty)."""
    if name == "token-drop" and depth is not None and depth < 3:
        settings = {**settings, "token_drop.layers": f"{depth - 1}:{depth}"}
    return settings


# ---------------------------------------------------------------------------------------------
# A model of one's own: every row's model checked before any row trains, in a CPU process.

CHECK_MODELS = ("import json, sys; from experiments.speedup import check_models; "
                "print(json.dumps(check_models(json.load(sys.stdin))))")


def check_factory_rows(cfg: SpeedupConfig, settings_of: dict[str, dict],
                       devices: dict) -> tuple[dict[str, dict], dict[str, str]]:
    """``(settings, reasons)`` for a factory's rows, from ``check_models``; a ConfigError when
    the baseline cannot train or the factory does not build."""
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
    return ({name: row["settings"] for name, row in rows.items()},
            {name: row["reason"] for name, row in rows.items() if row["reason"]})


def check_models(request: dict) -> dict:
    """In the CPU process of ``check_factory_rows``: the depth of the model's stack and, for
    each row (``request["rows"]``: name -> settings over ``request["config"]``), its settings
    completed and why its model cannot train (None when it can), by the run's own checks
    (``TrainConfig.validate``, ``loop.preflight``)."""
    from jaxaccel.run.loop import preflight
    from jaxaccel.core.sharding import mesh_shape, parse_mesh

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


def skip_reason(technique: HeadlineRow, devices: dict, model_name: str = "tiny") -> str | None:
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


def choose_best(rows: dict[str, dict], margin: float) -> list[tuple[str, str]]:
    """(row, why) per group: the row that reached the target soonest, if faster by ``margin``."""
    ran = [r for r in rows.values() if r["status"] == "ran" and r["name"] != "baseline"]
    picks = []
    for group in GROUPS:
        good = [r for r in ran if r["group"] == group and r.get("verdict") == "faster"
                and r["speedup"] >= 1 + margin]
        if group == "sampling" and any(
                rows[n]["settings"].get("data.batching", "fixed") != "fixed" for n, _ in picks):
            good = []       # importance sampling draws rows of fixed batching only
        if good:
            row = max(good, key=lambda r: r["speedup"])
            picks.append((row["name"], f"soonest {group} row to the target: {_speed(row)}"))
    return picks


def _speed(row: dict) -> str:
    """``1.42x sooner`` with one round, ``1.42x +- 0.03 sooner (faster)`` with several."""
    if row.get("speedup") is None:
        return "did not reach the target"
    rounds = len(row.get("round_speedups") or ())
    return (f"{row['speedup']:.2f}x" + (f" +- {row['spread']:.2f}" if rounds > 1 else "")
            + " sooner" + (f" ({row['verdict']})" if row.get("verdict") else ""))


def best_groups(names: list[str]) -> dict[str, str]:
    """The row of each group the best row combines (``--best``); ConfigError for a name that is
    no technique row or two rows of one group."""
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
    """The settings of the named rows together, the batch rounded up to ``batch_multiple``."""
    groups = best_groups(names)
    settings = {key: value for name in names for key, value in settings_of[name].items()}
    multiple = batch_multiple(settings, groups, device_count)
    if settings.get("data.batch_size"):
        settings["data.batch_size"] = -(-settings["data.batch_size"] // multiple) * multiple
    return settings


def batch_multiple(settings: dict, groups, device_count: int) -> int:
    """The devices (with a sharding row) times the microbatches."""
    return (device_count if "sharding" in groups else 1) * settings.get("optimizer.accumulate", 1)


# ---------------------------------------------------------------------------------------------
# The rows: every row's settings and why a row cannot run here, before any row trains.

def settings_and_reasons(cfg: SpeedupConfig, names: list[str]) -> tuple[dict, dict]:
    """Each named row's settings over the baseline, and why a row cannot run here."""
    devices = devices_of(cfg)
    documents = corpus_of(cfg.data).train
    shape = gpt_shape(cfg)      # None for a factory: check_factory_rows finds its depth
    depth = shape.n_layers if shape else None
    settings_of = {n: row_settings(cfg, BY_NAME[n], documents, depth) for n in names}
    reasons = {n: why for n in names if (why := skip_reason(BY_NAME[n], devices, cfg.model.name)
                                         or depth_reason(settings_of[n], depth))}
    if not is_preset(cfg.model.name):
        checked, unfit = check_factory_rows(
            cfg, {n: v for n, v in settings_of.items() if n not in reasons}, devices)
        settings_of.update(checked)
        reasons.update(unfit)
    return settings_of, reasons


def plan_row(cfg: SpeedupConfig, technique: HeadlineRow, settings: dict,
             reason: str | None = None, **more) -> Row:
    """A technique's row: its record's fields, and ``status`` when it cannot run (``reason``)."""
    fields = {"name": technique.name, "group": technique.group,
              "description": technique.description, "settings": settings, **more}
    if reason:
        fields["status"] = f"skipped: {reason}"
    else:
        config = os.path.join(cfg.run.run_dir, technique.name, "round-1", "config.yaml")
        fields["command"] = f"python -m experiments.train --config {config}"
    return Row(technique.name, settings, fields, directory=technique.name)


def rows(cfg: SpeedupConfig) -> list[Row]:
    """The baseline and the technique rows of ``--rows``; the best row comes in ``followup``."""
    names = parse_rows(cfg.experiment.rows)
    techniques = [t for t in TECHNIQUES if t.name == "baseline"
                  or (t.name in names and t.name != "best")]
    planned = [t.name for t in techniques]
    settings_of, reasons = settings_and_reasons(
        cfg, planned + [n for n in best_names(cfg) if n not in planned])
    for name in best_names(cfg):
        if name in reasons:
            raise ConfigError(f"--best names {name}, which cannot run here: {reasons[name]}",
                              field="experiment.best")
    devices = devices_of(cfg)
    print(f"experiments.speedup: {cfg.experiment.scale} preset on {devices['device_count']} x "
          f"{devices['device_kind']}; {len(techniques) + ('best' in names)} rows into "
          f"{cfg.run.run_dir}; target {cfg.run.target_bpb:g} validation bits per byte",
          flush=True)
    plan = [plan_row(cfg, t, settings_of[t.name], reasons.get(t.name)) for t in techniques]
    PLANNED["rows"] = sum("status" not in row.fields for row in plan) + 2 * ("best" in names)
    return plan


# How many rows train a round (the best row and the baseline's again counted), for the time
# the experiment announces after the baseline's first round.
PLANNED = {"rows": 0}


def announce_duration(cfg: SpeedupConfig, process_s: float, train_s: float):
    """After the baseline's first round (``process_s``, less the warm row process's start): about
    how long every round of every row takes at its pace, and at most (each row capped at
    ``--time-cap`` times its training seconds)."""
    rows, rounds = PLANNED["rows"], cfg.experiment.rounds
    expected = rows * rounds * process_s
    most = rows * rounds * (process_s + (cfg.experiment.time_cap - 1) * train_s)
    print(f"  the baseline's round took {process_s:.0f} s: {rows} rows x {rounds} round(s) "
          f"should take about {expected / 60:.0f} min, at most {most / 60:.0f} min",
          flush=True)


def check(cfg: SpeedupConfig, plan: list[Row]):
    """Every row's training config valid, and the run root no earlier report's."""
    if os.path.exists(os.path.join(cfg.run.run_dir, "report.md")):
        raise ConfigError(f"{cfg.run.run_dir} already holds a speedup report; choose another "
                          f"run_dir", field="run.run_dir")
    for row in plan:
        if "status" not in row.fields:
            train_config(cfg, row.settings, None).validate()


def followup(cfg: SpeedupConfig, done: list[dict]) -> list[Row]:
    """The best row (the rows ``--best`` names, or ``choose_best``'s), and the baseline trained
    again to take turns with it, unless the baseline's rounds showed a quiet machine
    (``--quiet``): then the best row's rounds are set against the baseline's."""
    if "best" not in parse_rows(cfg.experiment.rows):
        return []
    by_name = {r["name"]: r for r in done}
    margin, device_count = cfg.experiment.speed_margin, devices_of(cfg)["device_count"]
    for row in done:
        compare(row, by_name["baseline"], margin)
    picks = [(n, "named by --best") for n in best_names(cfg)] or choose_best(by_name, margin)
    chosen = [n for n, _ in picks]
    unrun = [n for n in chosen if n not in by_name]
    settings_of = {n: by_name[n]["settings"] for n in chosen if n in by_name}
    if unrun:
        settings_of.update(settings_and_reasons(cfg, unrun)[0])
    settings = combine(settings_of, chosen, device_count)
    multiple = batch_multiple(settings, {BY_NAME[n].group for n in chosen}, device_count)
    if multiple > 1 and settings.get("data.batching", "fixed") != "fixed":
        # re-match the padding row's batch to the baseline's real tokens per step
        settings.update(matched_batch(corpus_of(cfg.data).train, cfg, settings["data.batching"],
                                      multiple=multiple))
    best = dataclasses.replace(BY_NAME["best"], description="the best combination: "
                               + (" + ".join(chosen) or "nothing beat the baseline"))
    base = by_name["baseline"]
    variation = load_variation(base)
    if len(base["rounds"]) > 1 and variation is not None and variation <= cfg.experiment.quiet:
        return [plan_row(cfg, best, settings, picks=picks,
                         baseline_train_s=[r["train_s"] for r in base["rounds"]],
                         baseline_steps=[r["steps"] for r in base["rounds"]])]
    again = dataclasses.replace(BY_NAME["baseline"], name="baseline-again")
    return [plan_row(cfg, again, {}), plan_row(cfg, best, settings, picks=picks)]


# ---------------------------------------------------------------------------------------------
# A row's round: a fresh run to the target in a process of its own.

def measure(run: RowRun) -> dict:
    """Round ``run.round`` of a row in ``<row>/round-<k>``, trained to the target or for at
    most ``--time-cap`` times the baseline's seconds: its summary, its record under ``round``."""
    if "status" in run.row.fields:          # skipped
        return {}
    cfg, name, index, rounds = run.cfg, run.row.label, run.round, run.cfg.experiment.rounds
    if run.previous:        # the baseline (or baseline-again) trained just before, this round
        base_s, base_steps = (run.previous[0]["round"][k] for k in ("train_s", "steps"))
    else:                   # the baseline itself (None), or a best row set against its rounds
        base_s, base_steps = (run.row.fields.get(f"baseline_{k}", [None] * rounds)[index]
                              for k in ("train_s", "steps"))
    run_dir = os.path.join(run.run_dir, f"round-{index + 1}")
    changes = {"run.json": os.path.join(run_dir, "summary.json"),
               "run.seed": cfg.run.seed + (0 if cfg.experiment.same_seed else index)}
    if base_s is not None:
        changes["run.target_seconds"] = round(cfg.experiment.time_cap * base_s, 3)
    if run.row.settings.get("stacking.stages", 1) > 1:
        changes["stacking.at"] = str(max(1, round(cfg.experiment.stack_share * base_steps)))
    if index and cfg.run.profile is not None:    # --profile traces its window in round 1
        changes["run.profile"] = None
    train_cfg = override(train_config(cfg, run.row.settings, run_dir), changes)
    os.makedirs(run_dir, exist_ok=True)
    write_config(train_cfg, run_dir)
    argv = ["--config", os.path.join(run_dir, "config.yaml")]
    start = time.perf_counter()
    log_path = os.path.join(run_dir, "log.txt")
    with open(log_path, "w") as log:
        log.write(f"python -m experiments.train {' '.join(argv)}\n")
    env = row_environment(cfg.experiment.cpu_devices)
    warm = not cfg.experiment.fresh_processes and devices_of(cfg)["platform"] == "cpu"
    if not warm:
        with open(log_path, "a") as log:
            returncode, stderr = run_child([sys.executable, "-m", "experiments.train", *argv],
                                           env, log)
    else:
        returncode, stderr = ROWS.run(argv, log_path, env)
    with open(log_path, "a") as log:
        log.write(stderr)
    seconds = time.perf_counter() - start
    label = f"round {index + 1}/{rounds}  " if rounds > 1 else ""
    check_stop()        # the row's process got the signal too and stopped
    if returncode:
        failure = f"failed: {_last_line(stderr)}" + (
            f" (round {index + 1} of {rounds})" if rounds > 1 else "")
        if base_s is None:
            raise Unmeasurable(f"the {name} {failure}; nothing can be measured against it "
                               f"(see {run_dir}/log.txt)")
        print(f"  {label}{name:<16} {failure}", flush=True)
        return {"status": failure}
    from jaxaccel.run.loop import RunSummary    # imports jax: not at the top, for a fast --help
    summary = RunSummary.read(os.path.join(run_dir, "summary.json"))
    reached = bool((summary.target or {}).get("reached"))
    if base_s is None and not reached:
        raise Unmeasurable(
            f"the {name} did not reach the target {cfg.run.target_bpb:g} bits per byte (it got "
            f"to {summary.val_bpb:.3f} in {summary.steps} steps, {summary.real_tokens:,} real "
            f"tokens); nothing can be measured against it: pass a smaller --target-gap, a "
            f"larger --target-bpb or more --train-tokens (see {run_dir}/log.txt)")
    ratio = "" if base_s is None else f"{base_s / summary.train_s:.2f}x sooner"
    where = (f"target at step {summary.steps} in {summary.train_s:.1f} s" if reached
             else f"gave up at step {summary.steps} after {summary.train_s:.1f} s "
                  f"(val {summary.val_bpb:.3f})")
    print(f"  {label}{name:<16} {where:<44} {ratio:>13}  ({seconds:.0f} s)", flush=True)
    if name == "baseline" and index == 0:
        # in the warm row process only this first row pays for the imports and JAX's start
        startup = summary.startup_s or {}
        start = (startup.get("command_to_first_step", 0) - startup.get("to_first_step", 0)
                 if warm else 0)
        announce_duration(cfg, seconds - max(start, 0), summary.train_s)
    memory = summary.step_memory_bytes or {}
    record = {"reached": reached, "train_s": summary.train_s, "compile_s": summary.compile_s,
              "steps": summary.steps, "real_tokens": summary.real_tokens,
              "real_tokens_per_s": summary.real_tokens_per_s, "val_bpb": summary.val_bpb,
              "process_s": seconds, "run_dir": run_dir}
    # a row that gave up cannot reach the target in every round: it is not trained again
    return {**dataclasses.asdict(summary), **technique_fields(summary), "status": "ran",
            "run_dir": os.path.join(run.run_dir, "round-1"), "shapes": len(summary.shapes),
            "memory_bytes": memory.get("total"), "temp_bytes": memory.get("temp"),
            "round": record, "last_round": not reached and index + 1 < rounds}


def combine_rounds(cfg: SpeedupConfig, results: list[dict]) -> dict:
    """A row from its rounds' results: the last one's summary, every round's record under
    ``rounds``, and its time to target over them (medians; ``reached``: in every round)."""
    row = {}
    for result in results:
        row.update(result)
    row.pop("round", None)
    gave_up = row.pop("last_round", False)
    row["rounds"] = rounds = [r["round"] for r in results if "round" in r]
    row["gave_up_in_round"] = len(rounds) if gave_up else None
    if not rounds:
        return row
    reached = [r for r in rounds if r["reached"]]
    row.update(
        reached=bool(reached) and len(reached) == len(rounds),
        time_to_target_s=statistics.median(r["train_s"] for r in reached) if reached else None,
        with_compile_s=(statistics.median(r["train_s"] + r["compile_s"] for r in reached)
                        if reached else None),
        steps_to_target=statistics.median(r["steps"] for r in reached) if reached else None,
        tokens_to_target=(statistics.median(r["real_tokens"] for r in reached)
                          if reached else None),
        real_tokens_per_s=statistics.median(r["real_tokens_per_s"] for r in rounds),
        process_s=sum(r["process_s"] for r in rounds))
    return row


def technique_fields(summary: "RunSummary") -> dict:
    """What a row's run did with each technique (the summary's ``techniques``), as its keys."""
    return {"attention": done(summary, "attention"),
            "remat": done(summary, "remat", "policy", "none"),
            "scan_layers": done(summary, "remat", "scan_layers", False),
            "token_keep": done(summary, "token_drop", "keep", 1.0),
            "stochastic_depth": done(summary, "stochastic_depth", "rate", 0.0),
            "stages": done(summary, "stacking", "stages"),
            "sparsity": done(summary, "sparsity", "pattern", "none"),
            "sparsity_density": done(summary, "sparsity", "density"),
            "fp8": done(summary, "fp8", "note"), "fp8_gemms": done(summary, "fp8", "gemms"),
            "sampling": done(summary, "sampling", default="uniform")}


def run_child(argv: list[str], env: dict, log) -> tuple[int, str]:
    """Run a row's process (stdout to ``log``): ``(exit code, stderr)``. A SIGINT/SIGTERM is
    passed on to it, once (in a process group of its own, a terminal's Ctrl-C reaches it only
    this way), so that it stops cleanly after its step; it dies with this process
    (``PARENT_PID``)."""
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


class RowProcess:
    """The warm process that trains the rows one after another (``experiments.rows``): started
    for the first row, and again for the next one after a row that ended it (a crash, a
    signal) or that needs another environment; ``close``d when the experiment ends. A
    SIGINT/SIGTERM is passed on to it, as ``run_child`` does to a row's own process."""

    def __init__(self):
        self.child, self.env = None, None

    def run(self, argv: list[str], log_path: str, env: dict) -> tuple[int, str]:
        """Train the row ``python -m experiments.train ARGV`` would, its output appended to
        ``log_path``: ``(exit code, stderr)``."""
        if self.child is None or self.child.poll() is not None or env != self.env:
            self.close()
            self.child = subprocess.Popen(
                [sys.executable, "-m", "experiments.rows"], env=env, stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, process_group=0)
            self.env = env
        err_path = log_path + ".stderr"
        request = {"module": "experiments.train", "argv": argv, "stdout": log_path,
                   "stderr": err_path}
        answer = ""
        try:
            with passing_signals_to(self.child.send_signal):
                if stop_requested():        # the signal came while the row was being set up
                    self.child.send_signal(signal.Signals[stop_requested()])
                try:
                    self.child.stdin.write(json.dumps(request) + "\n")
                    self.child.stdin.flush()
                    answer = self.child.stdout.readline()
                except BrokenPipeError:     # it had ended (a signal between rows)
                    pass
        except BaseException:               # a second Ctrl-C: stop it, and do not wait long
            self.close(kill=True)
            raise
        stderr = ""
        if os.path.exists(err_path):
            with open(err_path) as f:
                stderr = f.read()
            os.remove(err_path)
        if answer.strip():
            return int(answer), stderr
        returncode = self.child.wait()      # it died in the row: its code, as run_child's
        self.child = None
        return returncode, stderr

    def close(self, kill: bool = False):
        if self.child is None:
            return
        if not kill and self.child.poll() is None:
            self.child.stdin.close()        # the end of its input: it exits
            try:
                self.child.wait(timeout=60)
            except subprocess.TimeoutExpired:
                kill = True
        if kill and self.child.poll() is None:
            self.child.kill()
        self.child.wait()
        for pipe in (self.child.stdin, self.child.stdout):
            if pipe and not pipe.closed:
                pipe.close()
        self.child = None


ROWS = RowProcess()


def _last_line(text: str) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1] if lines else "no error output"


def compare(row: dict, baseline: dict, margin: float = 0.0):
    """The row's speedup against the baseline, in place: per round, the baseline's seconds to
    the target over the row's (or over those it trained, if it gave up); median, spread, verdict."""
    if row["status"] != "ran" or baseline["status"] != "ran" or not row.get("rounds"):
        row.update(speedup=None, spread=None, verdict=None, round_speedups=None)
        return
    ratios = [base["train_s"] / mine["train_s"]
              for mine, base in zip(row["rounds"], baseline["rounds"])]
    if not any(r["reached"] for r in row["rounds"]):
        row.update(speedup=None, spread=None, round_speedups=ratios, verdict="not reached")
        return
    row.update(round_speedups=ratios, speedup=statistics.median(ratios),
               spread=_half_range(ratios),
               verdict=verdict(ratios, margin) if row is not baseline else None)


def verdict(ratios: list[float], margin: float = 0.0) -> str:
    """``faster`` or ``slower`` only when every round (of two or more) says so by at least
    ``margin``, else ``cannot tell``."""
    if len(ratios) > 1 and min(ratios) >= 1 + margin and min(ratios) > 1:
        return "faster"
    if len(ratios) > 1 and max(ratios) <= 1 / (1 + margin) and max(ratios) < 1:
        return "slower"
    return "cannot tell"


def load_variation(row: dict) -> float | None:
    """How much the machine's speed varied between a row's rounds: the half-range of its
    seconds per step over their median (its steps differ with the round's seed)."""
    per_step = [r["train_s"] / max(r["steps"], 1) for r in row.get("rounds", ())]
    if row["status"] != "ran" or not per_step:
        return None
    return _half_range(per_step) / statistics.median(per_step)


def _half_range(values: list[float]) -> float:
    return (max(values) - min(values)) / 2


def _mb(value) -> str:
    return "n/a" if value is None else f"{value / 2**20:,.0f} MB"


def _change(value, reference) -> str:
    return "n/a" if value is None or not reference else f"{value / reference - 1:+.0%}"


def _per_round(row: dict, key: str) -> str:
    """``80`` when every round took the same, else ``80 / 95`` (a round each)."""
    values = [r[key] for r in row["rounds"]]
    return " / ".join(f"{v:,}" for v in (values[:1] if len(set(values)) == 1 else values))


def explain(row: dict, base: dict) -> str:
    """One line on what the row's technique did, from its measurements."""
    if row["status"] != "ran":
        return f"**{row['name']}** ({row['description']}): not run, {row['status']}."
    if row["reached"]:
        arrival = (f"reached {row['target']['bpb']:g} bits/byte in {row['time_to_target_s']:.1f} s "
                   f"of training ({_per_round(row, 'steps')} steps, "
                   f"{_per_round(row, 'real_tokens')} real tokens)")
    elif row.get("gave_up_in_round"):
        arrival = (f"gave up in round {row['gave_up_in_round']} and was not trained again (it "
                   f"could no longer reach the target in every round)")
    else:
        arrival = "did not reach the target in every round"
    speed = ("" if row["name"] == "baseline" or row.get("speedup") is None
             else f", {_speed(row)} than the baseline")
    rate = (f"; {row['real_tokens_per_s']:,.0f} real tokens/s "
            f"({_change(row['real_tokens_per_s'], base['real_tokens_per_s'])})")
    memory = (f"; compiled step memory {_mb(row['memory_bytes'])} "
              f"({_change(row['memory_bytes'], base['memory_bytes'])})")
    group, detail = row["group"], ""
    if group in ("baseline", "padding"):
        detail = (f"; padding efficiency {row['padding_efficiency']:.1%}, {row['shapes']} batch "
                  f"shape(s), {row['compiles']} compiles ({row['compile_s']:.1f} s)")
    elif group == "precision":
        detail = f"; final loss scale {row['loss_scale']:g}, {row['skipped_steps']} skipped steps"
    elif group == "stacking" and row.get("stages"):
        detail = "; depth " + ", ".join(f"{d} from step {s}" for s, d in row["stages"])
    elif group == "accumulation":
        detail = f"; {row['accumulate']} microbatches per step"
    elif group == "optimizer":
        detail = (f"; optimizer state {row['optimizer_state_bytes']:,} bytes (baseline "
                  f"{base['optimizer_state_bytes']:,})")
    elif group == "sharding":
        detail = (f"; {math.prod(row['mesh'].values())} devices, parameters + optimizer state "
                  f"{row['param_opt_bytes_per_device']:,} bytes per device (baseline "
                  f"{base['param_opt_bytes_per_device']:,})")
    return (f"**{row['name']}** ({row['description']}): {arrival}{speed}{rate}{memory}"
            f"{detail}.")


COLUMNS = [
    ("name", "row", ""), ("time_to_target_s", "to target s", ".1f"),
    ("with_compile_s", "+ compile s", ".1f"), ("steps_to_target", "steps", ".0f"),
    ("tokens_to_target", "real tokens", ",.0f"), ("speedup", "sooner", ".2f"),
    ("spread", "+-", ".2f"), ("verdict", "verdict", ""),
    ("real_tokens_per_s", "real tok/s", ",.0f"), ("padding_efficiency", "padding eff.", ".1%"),
    ("memory_mb", "step MB", ",.0f"), ("peak_mb", "peak MB", ",.0f"), ("mfu", "MFU", ".1%"),
    ("val_bpb", "val bpb", ".3f"), ("note", "note", ""),
]


def table_rows(rows: list[dict]) -> list[dict]:
    """The rows as the table shows them: memory in MB, and a note on what did not run or
    reach the target."""
    return [{**r, "memory_mb": _scaled(r.get("memory_bytes")),
             "peak_mb": _scaled(r.get("peak_memory_bytes")),
             "note": r["status"] if r["status"] != "ran" else (
                 "" if r.get("reached") else "target not reached in every round")} for r in rows]


def _scaled(value):
    return None if value is None else value / 2**20


def conclude(cfg: SpeedupConfig, rows: list[dict]) -> list[str]:
    """The issue's target for the best row: the baseline's quality 2x sooner on a CPU, 5x on a
    GPU."""
    best, scale = first(rows, name="best"), cfg.experiment.scale
    if best is None or best["status"] != "ran":
        return ["no best combination ran: the target is unmeasured"]
    factor = 2 if scale == "cpu" else 5
    ok = best.get("verdict") == "faster" and best["speedup"] >= factor
    where = "CPU" if scale == "cpu" else f"GPU ({devices_of(cfg)['device_kind']})"
    mfu = "" if best.get("mfu") is None else f", MFU {best['mfu']:.1%}"
    return [f"{where} target (best reaches the baseline's quality >= {factor}x sooner): "
            f"{'met' if ok else 'not met'}, {_speed(best)}{mfu}"]


def rounds_line(meta: dict) -> str:
    """How the speedups were measured: rounds, and how much the baseline itself varied."""
    if meta["rounds"] == 1:
        return ("Each row trained once, one after the other; a speedup compares moments of the "
                "machine that may differ in load, and decides nothing (verdict: cannot tell; "
                "--rounds N measures the spread).")
    variation, steps = meta["baseline_load_variation"] or 0.0, meta["baseline_steps"] or []
    seeds = (f"every round from seed {meta['seed']}" if meta["same_seed"] else
             "the rounds from seeds " + ", ".join(str(meta["seed"] + k)
                                                  for k in range(meta["rounds"]))
             + " in turn, every row alike")
    return (f"Each row trained to the target {meta['rounds']} times, afresh, the rows taking "
            f"turns, {seeds}; a speedup is the median over the rounds of the baseline's time to "
            f"target over the row's in the same round, +- half their range; a row is faster or "
            f"slower only when every round says so by at least {meta['speed_margin']:.0%} (else: "
            f"cannot tell)"
            + (". The best row took turns with the baseline trained again"
               if meta["best_rounds"] else
               f". The best row's rounds were set against the baseline's (its seconds per step "
               f"varied by no more than --quiet {meta['quiet']:.1%}, so it was not trained again)"
               if meta["best_quiet"] else "")
            + f". The baseline's seconds per step varied by +-{variation:.1%} between rounds (the "
            f"machine's load); its steps to the target were {' / '.join(map(str, steps))}.")


# ---------------------------------------------------------------------------------------------
# Across the rows: speedups against the baseline in the same round, the report.

def compare_rows(cfg: SpeedupConfig, rows: list[dict], partial) -> dict:
    """Each row's speedup against the baseline, the best row's against the baseline trained
    beside it (kept in the best row as ``baseline_again``, not as a row of its own)."""
    by_name, margin = {r["name"]: r for r in rows}, cfg.experiment.speed_margin
    base, again, best = (by_name.get(n) for n in ("baseline", "baseline-again", "best"))
    for row in rows:
        if base and row is not best:
            compare(row, base, margin)
    if best and base:
        compare(best, again if again and again["status"] == "ran" else base, margin)
        if again:
            best["baseline_again"] = {k: again.get(k) for k in
                                      ("status", "rounds", "time_to_target_s", "run_dir")}
    rows[:] = [r for r in rows if r is not again]
    return {}


def meta(cfg: SpeedupConfig, rows: list[dict]) -> dict:
    devices, exp = devices_of(cfg), cfg.experiment
    base, best = first(rows, name="baseline") or {}, first(rows, name="best")
    return {"scale": exp.scale, "device": devices["device_kind"],
            "platform": devices["platform"], "device_count": devices["device_count"],
            "jax_version": devices["jax_version"], "date": time.strftime("%Y-%m-%d"),
            "params": base.get("params"), "val_tokens": base.get("val_tokens"),
            "target_bpb": cfg.run.target_bpb, "unigram_bpb": base.get("unigram_bpb"),
            "eval_every": cfg.run.eval_every, "time_cap": exp.time_cap,
            "speed_margin": exp.speed_margin,
            "best": [n for n, _ in best["picks"]] if best else [],
            "best_source": "--best" if exp.best else "chosen from the measurements",
            "rounds": exp.rounds, "best_rounds": bool(best and best.get("baseline_again")),
            "best_quiet": bool(best and best.get("baseline_train_s")), "quiet": exp.quiet,
            "baseline_load_variation": load_variation(base) if base else None,
            "baseline_steps": [r["steps"] for r in base.get("rounds", ())],
            "same_seed": exp.same_seed,
            "all_rows_estimate": all_rows_estimate(rows)}


def setup(cfg: SpeedupConfig) -> str:
    return (f"time to quality, {cfg.experiment.scale} preset: {describe(cfg.model, cfg.gpt)} "
            f"model, seq_len {cfg.seq_len}, baseline batch {cfg.data.batch_size} rows, target "
            f"{cfg.run.target_bpb:g} validation bits/byte, {devices_of(cfg)['device_count']} "
            f"devices")


def notes(cfg: SpeedupConfig, rows: list[dict], meta: dict) -> list[str]:
    if not rows:
        return []
    return ["", rounds_line(meta), "",
            f"best = {' + '.join(meta['best']) or 'the baseline (nothing qualified)'} "
            f"({meta['best_source']})",
            f"the experiment took {meta['wall_s'] / 60:.1f} minutes; "
            f"{meta['all_rows_estimate']}",
            f"report, plots and one directory per row: {cfg.run.run_dir}"]


def report(cfg: SpeedupConfig, rows: list[dict], meta: dict) -> list[str]:
    """The report's own sections: the settings, what each technique did, the combination."""
    best = first(rows, name="best")
    picks = best["picks"] if best else []
    settings = (f"Model: {meta['model']} ({meta['params'] or 0:,} parameters); target "
                f"{meta['target_bpb']:g} validation bits per byte"
                + (f" ({meta['unigram_bpb']:.3f} unigram entropy)" if meta["unigram_bpb"]
                   else "")
                + f", judged every {meta['eval_every']} steps on {meta['val_tokens'] or 0:,} "
                f"tokens; a row gives up after {meta['time_cap']:g}x the baseline's seconds or "
                f"{meta['train_tokens']:,} real tokens.")
    base = first(rows, name="baseline") or {}
    return [settings, "", "## What each technique did", "",
            *[f"- {explain(r, base)}" for r in rows], "", "## The combination", "",
            f"Rows combined ({meta['best_source']}): "
            + ("; ".join(f"{n} ({why})" for n, why in picks) if picks else "none"), "",
            "Each row's command is in the JSON (`--json`) and in its rounds' log.txt."]


def plot(path: str, cfg: SpeedupConfig, rows: list[dict]) -> list[str]:
    """Time to target, real tokens/s, memory and the loss curves, beside ``path``."""
    ran = [r for r in rows if r["status"] == "ran"]
    if not ran:
        return []
    root, labels = os.path.dirname(path), [r["name"] for r in ran]
    title = f"{describe(cfg.model, cfg.gpt)} model, seq_len {cfg.seq_len}, " \
            f"{devices_of(cfg)['device_kind']}"
    paths = [os.path.join(root, f"{name}.png") for name in
             ("time_to_target", "tokens_per_s", "memory", "loss_curves")]
    bar_chart(paths[0], labels, [("training seconds to the target (0: not reached)",
                                  [r["time_to_target_s"] or 0 for r in ran])], title=title)
    bar_chart(paths[1], labels, [("real tokens/s", [r["real_tokens_per_s"] for r in ran])],
              title=title)
    panels = [("compiled step memory (MB)", [(r["memory_bytes"] or 0) / 2**20 for r in ran])]
    if any(r["peak_memory_bytes"] for r in ran):
        panels.append(("peak device memory (MB)",
                       [(r["peak_memory_bytes"] or 0) / 2**20 for r in ran]))
    bar_chart(paths[2], labels, panels, title=title)
    plot_loss_curves(paths[3], {r["name"]: r["run_dir"] for r in ran}, title=title)
    return paths


def all_rows_estimate(rows: list[dict]) -> str:
    """What ``--rows all`` would take, at this run's mean seconds of a row's processes; for a
    run of every row, the rows that could not run here."""
    if {r["name"] for r in rows} >= set(BY_NAME):
        unrun = [r["name"] for r in rows if r["status"] != "ran"]
        return "that is --rows all" + (f" ({', '.join(unrun)} did not run here)" if unrun else "")
    ran = [r for r in rows if r["status"] == "ran"]
    if not ran:
        return "no row ran, so there is no estimate for --rows all"
    per_row = statistics.mean(r["process_s"] for r in ran)
    return (f"--rows all ({len(TECHNIQUES)} rows) would take about "
            f"{per_row * (len(TECHNIQUES) + 1) / 60:.0f} minutes at this run's "
            f"{per_row:.0f} s per row (an estimate)")


EXPERIMENT = Experiment(
    name="speedup", doc=__doc__, config=SpeedupConfig, rows=rows, columns=COLUMNS, setup=setup,
    defaults=preset, fixed=FIXED, prepare=prepare, check=check, measure=measure,
    rounds=lambda cfg: cfg.experiment.rounds, combine=combine_rounds, followup=followup,
    compare=compare_rows, conclude=conclude, tables=lambda cfg, rows, meta: [
        (None, table_rows(rows), COLUMNS)], notes=notes, meta=meta, plot=plot, report=report,
    finish=lambda cfg, shared: ROWS.close())
main = main_of(EXPERIMENT)

if __name__ == "__main__":
    sys.exit(main())
