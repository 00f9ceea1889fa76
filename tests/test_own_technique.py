"""A technique of one's own, declared in this file alone and registered (``register``): it gets
its config section and flags, trains, reports, resumes (a resume with other settings of it is
refused) and appears as a headline row of ``experiments.speedup``. The recipe docs/DESIGN.md
shows: a module with the record and its functions, and one line that registers it.

The technique: ``toy.scale`` multiplies the model's initial weights (its ``init`` phase)."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
from flax import nnx

from jaxaccel.core.sections import HeadlineRow, Technique
from jaxaccel.core.settings import setting

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


@dataclasses.dataclass
class ToySettings:
    scale: float = setting(1.0, "multiply the model's initial weights by this (1 = off)",
                           flag="toy_scale", above=0)


TOY = Technique("toy", ToySettings, __name__, "init", {"scale": 1.0}, rows=(HeadlineRow(
    "toy-2", "toy", "initial weights twice as large", {"toy.scale": 2.0}),))


def transform(model, cfg, ctx) -> None:
    if cfg.toy.scale != 1.0:
        params = nnx.state(model, nnx.Param)
        nnx.update(model, jax.tree.map(lambda x: x * cfg.toy.scale, params))


def report(cfg, ctx) -> dict | None:
    if cfg.toy.scale == 1.0:
        return None
    return {"scale": cfg.toy.scale, "weights": len(jax.tree.leaves(ctx.params))}


def describe(report: dict) -> str:
    return f"toy scale {report['scale']:g} ({report['weights']} weights)"


# The run: registered before jaxaccel.run.config is imported, as a program of one's own would.
SCRIPT = """
import test_own_technique as toy
from jaxaccel.core.sections import register
register(toy.TOY)
from experiments import speedup, train
step = [*{args!r}, "--run-dir", {run!r}]
print("CODE", train.main([*step, "--toy-scale", "2", "--stop-at", "4"]))
print("CODE", train.main([*step, "--toy-scale", "2", "--resume"]))
print("CODE", train.main([*step, "--toy-scale", "3", "--resume"]))
print("CODE", speedup.main([*{headline!r}, "--rows", "toy-2"]))
"""
MODEL = ["--d-model", "32", "--n-layers", "2", "--n-heads", "4", "--max-seq-len", "32",
         "--seq-len", "32", "--batch-size", "4"]


def test_a_technique_of_ones_own_trains_reports_resumes_and_has_a_headline_row(
        corpus_path, tmp_path):
    run = str(tmp_path / "run")
    args = [*MODEL, "--data", corpus_path, "--cache-dir", str(tmp_path / "cache"), "--steps", "8",
            "--warmup-steps", "2", "--eval-every", "4", "--eval-batches", "2", "--log-every", "2",
            "--final-eval-batches", "2", "--no-progress", "--no-loss-plot"]
    headline = ["--scale", "cpu", "--cpu-devices", "1", *MODEL, "--d-model", "32",
                "--data", corpus_path, "--cache-dir", str(tmp_path / "cache"),
                "--train-tokens", "1500", "--rounds", "1", "--target-bpb", "7.9",
                "--eval-every", "2", "--final-eval-batches", "2", "--warmup-steps", "2",
                "--schedule", "constant", "--learning-rate", "3e-3", "--log-every", "2",
                "--pad-multiple", "32", "--run-dir", str(tmp_path / "headline"),
                "--json", str(tmp_path / "speedup.json")]
    script = SCRIPT.format(args=args, run=run, headline=headline)
    env = {**os.environ, "JAX_PLATFORMS": "cpu",     # this file importable, as one's own module
           "PYTHONPATH": os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                            text=True, timeout=600, env=env)
    codes = [line.split()[1] for line in result.stdout.splitlines() if line.startswith("CODE")]
    assert codes == ["0", "0", "2", "0"], result.stdout[-3000:] + result.stderr[-3000:]
    # it trained and reported: the summary's techniques and its model line
    summary = json.load(open(os.path.join(run, "summary.json")))
    toy = summary["techniques"]["toy"]
    assert toy["scale"] == 2.0 and toy["weights"] > 0
    assert summary["steps"] == 8 and summary["steps_this_run"] == 4
    assert f"toy scale 2 ({toy['weights']} weights)" in result.stdout
    # it resumed with its settings, and refused other ones in one line naming its field
    assert "toy.scale=2.0 (now 3.0)" in result.stderr
    config = open(os.path.join(run, "config.yaml")).read()
    assert "toy:\n  scale: 2.0" in config
    # its headline row ran with its settings against the baseline, which has it off
    rows = {r["name"]: r for r in json.load(open(tmp_path / "speedup.json"))["rows"]}
    assert rows["toy-2"]["status"] == "ran" and rows["toy-2"]["settings"] == {"toy.scale": 2.0}
    assert rows["baseline"]["val_bpb"] != rows["toy-2"]["val_bpb"]


REFUSALS = """
import dataclasses, sys
from jaxaccel.core.sections import Technique, register
import test_own_technique as toy
for record in (dataclasses.replace(toy.TOY, phase="later"),
               dataclasses.replace(toy.TOY, name="remat"),
               dataclasses.replace(toy.TOY, module="__main__"),
               dataclasses.replace(toy.TOY, name="other")):
    try:
        register(record)
    except ValueError as e:
        print("REFUSED", e)
import jaxaccel.run.config
try:
    register(toy.TOY)
except RuntimeError as e:
    print("REFUSED", e)
"""


def test_a_technique_that_cannot_register_is_one_clear_error():
    """A phase of none, a name taken, a record the run's processes could not import, or a
    registration after the config was made: each refused in one line; a record in
    JAXACCEL_TECHNIQUES that cannot be imported too, before any work."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [HERE, os.environ.get(
        "PYTHONPATH")]))}
    env.pop("JAXACCEL_TECHNIQUES", None)
    result = subprocess.run([sys.executable, "-c", REFUSALS], cwd=REPO, capture_output=True,
                            text=True, timeout=120, env=env)
    refused = [line for line in result.stdout.splitlines() if line.startswith("REFUSED")]
    assert len(refused) == 5, result.stdout + result.stderr
    assert "a new name, and a phase of ('init', 'layers', 'blocks')" in refused[0]
    assert "technique 'remat': a new name" in refused[1]
    assert "not in the script run as __main__" in refused[2]
    assert "its record is not a name of its module 'test_own_technique'" in refused[3]
    assert "before importing jaxaccel.run.config" in refused[4]
    bad = subprocess.run([sys.executable, "-m", "experiments.train", "--help"], cwd=REPO,
                         capture_output=True, text=True, timeout=120,
                         env={**env, "JAXACCEL_TECHNIQUES": "no_such_module:TOY"})
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr
    assert bad.stderr.startswith("error: JAXACCEL_TECHNIQUES=no_such_module:TOY: cannot register "
                                 "it (No module named 'no_such_module'); put its module on "
                                 "PYTHONPATH"), bad.stderr
