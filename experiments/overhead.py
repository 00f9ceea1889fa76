"""The run around the step: our training loop and start-up against a bare JAX script's.

    python -m experiments.overhead                          # the 1 ms shape and the preset
    python -m experiments.overhead --shapes tiny --rounds 5 --json overhead.json

Per shape, two processes a round, the same model, optimizer (AdamW, its schedule) and batches
(the default corpus, fixed batching, the same seed):

- ours: ``python -m experiments.train`` with the shape's flags, no periodic evaluation, its
  compilation cache off (as cold as the bare script), ``--time-step`` timing the step alone on
  its last batches in the same process;
- bare: ``python -m experiments.bare`` (its docstring): the state's initialisation and
  ``lm_train_step`` jitted, the batches put on the device, a plain ``for`` loop.

Columns, each the best of ``--rounds`` (the processes take turns, so a change of the machine's
load meets both): ``loop`` is our loop's steps per second between its first and last metrics
records (the first step's start-up left out, as the bare loop leaves it), ``bare`` the bare
loop's, ``loop/bare`` their ratio; ``alone`` our step timed alone; ``start`` and ``bare start``
the seconds from the command to the first step's result (Linux's /proc), ``start ratio`` ours
over the bare script's. Steps per second times the batch's positions is tokens per second for
both. The shapes: ``tiny`` is issue 49's 1 ms step (``--d-model 32 --n-layers 1 --n-heads 2
--seq-len 32 --batch-size 4``), ``preset`` the default model of ``experiments.train``. The
notes add ``python -m experiments.train --help``'s seconds (the best of three).

Issue 49's targets: loop/bare >= 0.90 at the 1 ms step and >= 0.97 for the preset; start ratio
<= 1.1; ``--help`` <= 1.0 s.
"""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import yaml

from experiments.common import (Experiment, Row, RowRun, check_stop, config_of, main_of,
                                parse_list, passing_signals_to)
from jaxaccel.run.config import setting
from jaxaccel.core.errors import ConfigError

SHAPES = {  # name: (flags, steps, steps timed alone)
    "tiny": (["--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--seq-len", "32",
              "--batch-size", "4"], 3000, 1000),
    "preset": ([], 40, 20),
}
TARGETS = {"tiny": 0.90, "preset": 0.97}
START_RATIO, HELP_SECONDS = 1.1, 1.0


@dataclasses.dataclass
class OverheadSettings:
    shapes: str = setting("tiny,preset", f"comma-separated shapes, of {', '.join(SHAPES)}")
    rounds: int = setting(3, "times each shape is measured, ours and the bare script taking "
                             "turns; the best of each counts", at_least=1)
    steps: int | None = setting(None, "steps of every run (default: 3000 for tiny, 40 for "
                                      "the preset)", at_least=2)
    data: str = setting("stdlib", "the corpus both train on (as experiments.train's --data)")
    cache_dir: str | None = setting(None, "the corpus cache (as experiments.train's "
                                          "--cache-dir)")
    json: str | None = setting(None, "also write the rows as JSON to this path")


OverheadConfig = config_of(OverheadSettings, base=None)

COLUMNS = [("shape", "shape", ""), ("loop", "loop steps/s", ",.4g"),
           ("bare", "bare steps/s", ",.4g"), ("loop_share", "loop/bare", ".3f"),
           ("alone", "alone steps/s", ",.4g"), ("start", "start s", ".2f"),
           ("bare_start", "bare start s", ".2f"), ("start_ratio", "start ratio", ".2f"),
           ("target", "loop target", ".2f")]


def rows(cfg) -> list[Row]:
    return [Row(name, fields={"shape": name})
            for name in parse_list(cfg.experiment.shapes, "experiment.shapes", valid=SHAPES)]


def run(command: list[str], what: str) -> str:
    """``command``'s stdout; a signal to the experiment reaches it; a failure is an error."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with passing_signals_to(proc.send_signal):
        out, err = proc.communicate()
    check_stop()
    if proc.returncode != 0:
        last = (err.strip().splitlines() or ["no output"])[-1]
        raise ConfigError(f"{what} failed (exit code {proc.returncode}): {last}")
    return out


def loop_rate(run_dir: str) -> float:
    """Steps per second between the first and the last train records of a run's metrics."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        train = [r for r in map(json.loads, f) if r["kind"] == "train"]
    first, last = train[0], train[-1]
    return (last["step"] - first["step"]) / (last["train_s"] - first["train_s"])


def measure(row_run: RowRun) -> dict:
    shape = row_run.row.label
    flags, steps, alone = SHAPES[shape]
    steps = row_run.cfg.experiment.steps or steps
    alone = min(alone, steps // 2)
    run_dir = os.path.join(row_run.shared, f"{shape}-{row_run.round}")
    exp = row_run.cfg.experiment
    data = ["--data", exp.data, *(["--cache-dir", exp.cache_dir] if exp.cache_dir else [])]
    run([sys.executable, "-m", "experiments.train", *flags, *data, "--steps", str(steps),
         "--time-step", str(alone), "--eval-every", "0", "--final-eval-batches", "1",
         "--no-loss-plot", "--no-progress", "--compilation-cache", "off", "--run-dir", run_dir],
        f"experiments.train ({shape})")
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(run_dir, "config.yaml")) as f:     # the model the run built
        config = yaml.safe_load(f)
    bare = json.loads(run([sys.executable, "-m", "experiments.bare", *flags, *data,
                           "--steps", str(steps),
                           "--max-seq-len", str(config["model"]["max_seq_len"]),
                           "--warmup-steps", str(config["optimizer"]["warmup_steps"]),
                           "--seq-len", str(config["data"]["seq_len"]
                                            or config["model"]["max_seq_len"]),
                           "--batch-size", str(summary["batch_rows"])],
                          f"experiments.bare ({shape})").strip().splitlines()[-1])
    timed = summary["step_alone"]
    return {"shape": shape, "loop": loop_rate(run_dir), "bare": bare["steps"] / bare["seconds"],
            "alone": timed["steps"] / timed["seconds"],
            "start": summary["startup_s"]["command_to_first_step"],
            "bare_start": bare["command_to_first_step"], "steps": steps,
            "target": TARGETS[shape]}


def combine(cfg, results: list[dict]) -> dict:
    """The best of the rounds: the highest rates, the shortest start-ups."""
    best = {"shape": results[0]["shape"], "rounds": len(results), "steps": results[0]["steps"],
            "target": results[0]["target"], "all": results}
    best.update({k: max(r[k] for r in results) for k in ("loop", "bare", "alone")})
    best.update({k: min(r[k] for r in results) for k in ("start", "bare_start")})
    best["loop_share"] = best["loop"] / best["bare"]
    best["start_ratio"] = best["start"] / best["bare_start"]
    return best


def help_seconds() -> float:
    """The best of three ``python -m experiments.train --help``."""
    times = []
    for _ in range(3):
        began = time.perf_counter()
        subprocess.run([sys.executable, "-m", "experiments.train", "--help"],
                       stdout=subprocess.DEVNULL, check=True)
        times.append(time.perf_counter() - began)
    return min(times)


def meta(cfg, rows_: list[dict]) -> dict:
    return {"help_s": help_seconds()}


def conclude(cfg, rows_: list[dict]) -> list[str]:
    lines = [f"{r['shape']}: loop/bare {r['loop_share']:.3f} (target >= {r['target']:.2f}: "
             f"{'met' if r['loop_share'] >= r['target'] else 'not met'}); start ratio "
             f"{r['start_ratio']:.2f} (target <= {START_RATIO}: "
             f"{'met' if r['start_ratio'] <= START_RATIO else 'not met'})" for r in rows_]
    return lines


def notes(cfg, rows_: list[dict], meta_: dict) -> list[str]:
    seconds = meta_["help_s"]
    return [f"python -m experiments.train --help: {seconds:.2f} s (target <= {HELP_SECONDS} s: "
            f"{'met' if seconds <= HELP_SECONDS else 'not met'})"]


EXPERIMENT = Experiment(
    name="overhead", doc=__doc__, config=OverheadConfig, rows=rows, columns=COLUMNS,
    setup=lambda cfg: "The loop and start-up against a bare JAX script", trains=False,
    shared=lambda cfg: tempfile.mkdtemp(prefix="jaxaccel-overhead-"),
    finish=lambda cfg, folder: shutil.rmtree(folder, ignore_errors=True),
    measure=measure, rounds=lambda cfg: cfg.experiment.rounds, combine=combine,
    conclude=conclude, notes=notes, meta=meta, plot=None)
main = main_of(EXPERIMENT)


if __name__ == "__main__":
    sys.exit(main())
