"""Every numeric setting is checked before any work (issue 17, classes 2, 7 and 8): a fuzz table
over every numeric field, the issue's examples through the command line, divergence reported as
a failure, strict JSON, and hints that name only real flags."""

import dataclasses
import importlib
import json
import math
import os
import pkgutil
import re

import pytest

import experiments
from experiments.common import command, out_of_memory
from experiments.train import main
from jaxaccel.run import config
from jaxaccel.run.config import (INT_LIMIT, INT_RANGE, FLOAT_RANGE, TrainConfig, build,
                                 build_parser, check_ranges, field_ranges, parse)
from jaxaccel.core.errors import ConfigError
from jaxaccel.run.loop import RunSummary, diverged_at
from jaxaccel.model.contract import ModelConfig
from jaxaccel.core.report import dump_json, finite_json

PARSE_ARGS = {}      # config class -> parse's defaults and fixed, from its module
BAD = ["nan", "inf", "-inf", "-1", "0", "1e39", str(2**63)]


def experiment_configs():
    """Every config class of the experiment modules (TrainConfig subclasses and the others)."""
    classes = {TrainConfig}
    PARSE_ARGS[TrainConfig] = {}
    for info in pkgutil.iter_modules(experiments.__path__):
        module = importlib.import_module(f"experiments.{info.name}")
        for value in vars(module).values():
            if isinstance(value, type) and dataclasses.is_dataclass(value) and \
                    {f.name for f in dataclasses.fields(value)} & {"experiment", "run"} and \
                    value.__module__ == module.__name__:
                classes.add(value)
                declared = getattr(module, "EXPERIMENT", module)    # the harness's, or constants
                defaults = getattr(declared, "defaults", getattr(module, "DEFAULTS", None))
                PARSE_ARGS[value] = {          # defaults that depend on a flag: those of none
                    "defaults": defaults([]) if callable(defaults) else defaults,
                    "fixed": getattr(declared, "fixed", getattr(module, "FIXED", ()))}
    return sorted(classes, key=lambda c: c.__name__)


def numeric_fields(cls):
    """(path, type) of every int and float field of cls's sections."""
    fields = []
    for section in dataclasses.fields(cls):
        section_cls = section.type if dataclasses.is_dataclass(section.type) else ModelConfig
        for f in dataclasses.fields(section_cls):
            kinds = set(config._alternatives(f.type)) or {f.type}
            if kinds & {int, float} and bool not in kinds:
                fields.append((f"{section.name}.{f.name}", float if float in kinds else int))
    return fields


TRAIN_FIELDS = numeric_fields(TrainConfig)


def test_every_train_field_declares_its_range():
    """A new numeric field must say which values it takes (``setting(..., at_least=...)`` or
    a ``Range``); only ints >= 0 may rely on the default."""
    ranges = field_ranges(TrainConfig)
    undeclared = [path for path, kind in TRAIN_FIELDS
                  if ranges[path] in (None, config.Range()) and kind is float]
    assert not undeclared, undeclared
    assert len(TRAIN_FIELDS) > 40


def _accepts(cls, path, text):
    """The value of ``path`` after the override ``path=text``, or None where it is refused (a
    ConfigError naming a field). The override's way through ``parse`` (the experiment's
    defaults, then the text coerced to the field's type, then its range) and a run's
    ``validate``, without building parse's argument parser for each value (milliseconds each,
    hundreds of values a class): ``parse`` itself reads the defaults in the fuzz test."""
    try:
        cfg = build(cls, {**(PARSE_ARGS[cls].get("defaults") or {}), path: text})
        check_ranges(cfg)
        if isinstance(cfg, TrainConfig):
            cfg.validate()
    except ConfigError as e:
        assert e.field is not None and "\n" not in str(e)
        return None
    return config.field_value(cfg, path)


@pytest.mark.parametrize("cls", experiment_configs(), ids=lambda c: c.__name__)
def test_fuzz_numeric_fields_refuse_bad_values(cls):
    """Each numeric field of every config, fed nan, inf, negatives, zero, 1e39 and 2**63:
    either a ConfigError naming a field (the command prints it and exits 2 before any work), or
    a value that is finite and within the field's range."""
    check_ranges(parse([], cls, **PARSE_ARGS[cls]))      # the defaults are in range
    ranges = field_ranges(cls)
    for path, kind in numeric_fields(cls):
        if path in PARSE_ARGS[cls].get("fixed", ()) or path in ("model.vocab_size",):
            continue
        declared = ranges[path]
        if declared in (None, config.Range()):
            declared = INT_RANGE if kind is int else FLOAT_RANGE
        for text in BAD:
            value = _accepts(cls, path, text)
            if value is None or isinstance(value, str):
                continue
            assert math.isfinite(value) and declared.contains(value), (path, text, value)
            if kind is int:
                assert abs(value) <= max(INT_LIMIT, declared.at_most or 0), (path, text)


@pytest.mark.parametrize("args,message", [
    (["--clip-norm", "-1"], "clip_norm must be a finite number >= 0 (0 = off), got -1.0"),
    (["--learning-rate", "nan"], "learning_rate must be a finite number > 0, got nan"),
    (["--learning-rate", "inf"], "learning_rate must be a finite number > 0, got inf"),
    (["--weight-decay", "inf"], "weight_decay must be a finite number >= 0, got inf"),
    (["--clip-norm", "nan"], "clip_norm must be a finite number >= 0"),
    (["--loss-scale-init", "1e39"], "init_scale must be in (0, "),
    (["--dropout", "1"], "dropout must be"),
    (["--warmup-steps", "-1"], "warmup_steps must be at least 0"),
    (["--buckets", "1000000000"], "buckets must be an integer in [1, 1024]"),
    (["--prefetch", "1000000000"], "prefetch must be an integer in [0, 64]"),
    (["--steps", str(2**40)], "steps must be at most 2147483647"),
    (["--batching", "bucket", "--buckets", "100", "--seq-len", "64"], "exceeds seq_len=64"),
    (["--eval-batches", "0"], "eval_batches must be at least 1"),
    (["--data", ""], "path is empty"),
    (["--steps", "nan"], "invalid int value: 'nan'"),
])
def test_bad_values_are_one_line_before_any_work(args, message, tmp_path, capsys):
    run_dir = tmp_path / "run"
    try:
        code = main(["--run-dir", str(run_dir), "--no-progress", *args])
    except SystemExit as e:         # argparse: a value of the wrong type
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert message in err[0], err
    assert not run_dir.exists()


def test_good_edge_values_pass():
    cfg = parse(["--warmup-steps", "100000", "--clip-norm", "0", "--dropout", "0",
                 "--eval-every", "0", "--log-every", "0"])
    cfg.validate()


def test_range_of_experiment_settings():
    from experiments.remat import FIXED, RematConfig, UNUSED
    with pytest.raises(ConfigError, match="timed_steps must be at least 1"):
        check_ranges(parse(["--timed-steps", "0"], RematConfig, fixed=FIXED))
    with pytest.raises(ConfigError, match="not used by this experiment") as info:
        parse(["--data", "x"], RematConfig, fixed=FIXED, unused=UNUSED)
    assert info.value.field == "data.path"


def test_divergence_is_found_and_reported():
    assert diverged_at([(2.0, 1), (1.0, 1)], 0, 1.0, 2) is None
    assert diverged_at([(2.0, 1), (math.nan, 1), (math.inf, 1)], 10, math.nan, 13) == 12
    assert diverged_at([(2.0, 1)], 0, math.inf, 1) == 1
    assert diverged_at([(2.0, 1)], 0, None, 1) is None      # interrupted: no final evaluation
    # a float16 overflow that loss scaling skipped, and the run went on: no failure
    assert diverged_at([(math.inf, 1), (2.0, 1)], 0, 2.0, 2) is None
    assert "diverged_at_step" in {f.name for f in dataclasses.fields(RunSummary)}


def test_json_is_strict(tmp_path):
    path = tmp_path / "s.json"
    dump_json(str(path), {"a": math.nan, "b": [math.inf, 1.5], "c": {"d": -math.inf}})
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text) == {"a": None, "b": [None, 1.5], "c": {"d": None}}
    assert finite_json((1.0, "x")) == [1.0, "x"]


def test_a_json_path_that_is_a_directory_is_refused_before_any_work(tmp_path):
    """--json names a file to write; a folder is one line at parse time, not an
    IsADirectoryError after training."""
    with pytest.raises(ConfigError, match="is a directory; pass the path of a file") as e:
        parse(["--json", str(tmp_path)])
    assert e.value.field == "run.json"


def test_sharding_steps_beyond_one_epoch_are_one_line(corpus_path, tmp_path, capsys):
    """experiments.sharding trains every row on the same first --steps batches of one epoch:
    more than the corpus has is one line naming --steps, not a StopIteration."""
    from experiments import sharding
    code = sharding.main(["--data", corpus_path, "--cache-dir", str(tmp_path / "cache"),
                          "--steps", "100000", "--d-model", "32", "--n-layers", "2",
                          "--n-heads", "2", "--strategies", "dp", "--run-dir",
                          str(tmp_path / "runs")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "pass --steps" in err[0] and "[--steps" in err[0], err


def test_init_from_a_run_without_a_checkpoint_names_init_from(corpus_path, tmp_path, capsys):
    """A fine-tune's --init-from run that saved no checkpoint is that flag's error, not the
    new run's --run-dir."""
    from jaxaccel.run.config import write_config
    source = tmp_path / "source"
    source.mkdir()
    small = ["--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--max-seq-len", "32",
             "--seq-len", "32", "--batch-size", "4", "--data", corpus_path]
    write_config(parse(small), str(source))
    code = main([*small, "--lora-rank", "4", "--init-from", str(source), "--steps", "1",
                 "--run-dir", str(tmp_path / "tune"), "--cache-dir", str(tmp_path / "cache")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "holds no finished checkpoint" in err[0], err
    assert "[--init-from / run.init_from]" in err[0]


def test_allocation_failure_is_one_line(capsys):
    @command()
    def fails(argv):
        raise MemoryError

    assert fails([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "out of memory" in err[0] and "--batch-size" in err[0]
    assert "--remat" in err[0] and "--memory-budget" in err[0]
    assert not out_of_memory(ValueError("RESOURCE_EXHAUSTED"))


def _all_flags() -> set[str]:
    flags = {"--help", "--config"}
    for cls in experiment_configs():
        for action in build_parser(cls, **PARSE_ARGS[cls])._actions:
            flags.update(action.option_strings)
            if any(s.startswith("--") and not s.startswith("--no-")
                   for s in action.option_strings) and action.nargs == 0:
                flags.update("--no-" + s[2:] for s in action.option_strings)
    return flags


def test_hints_name_only_real_flags():
    """Every ``--flag`` that a help text or an error message of the library and the experiments
    names exists (a hint naming a flag that is not one sends the user nowhere)."""
    flags = _all_flags()
    named = {}
    for cls in experiment_configs():
        for action in build_parser(cls, **PARSE_ARGS[cls])._actions:
            for flag in re.findall(r"--[a-z][a-z0-9-]*[a-z0-9]", action.help or ""):
                named.setdefault(flag, f"help of {action.option_strings}")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for folder in ("jaxaccel", "experiments"):
        for dirpath, _, files in os.walk(os.path.join(root, folder)):
            for name in files:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(dirpath, name)
                with open(path) as f:
                    text = f.read()
                for literal in re.findall(r"f?\"(?:[^\"\\\n]|\\.)*\"", text):
                    for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*[a-z0-9]", literal):
                        named.setdefault(flag, os.path.relpath(path, root))
    missing = {flag: where for flag, where in named.items() if flag not in flags}
    assert not missing, missing


def test_speedup_best_is_checked_before_any_row(tmp_path, capsys):
    from experiments import speedup
    code = speedup.main(["--best", "pack,dynamic", "--data", str(tmp_path / "none"),
                         "--run-dir", str(tmp_path / "runs")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "names two padding rows" in err[0], err
    assert not (tmp_path / "runs").exists()


def test_a_diverged_run_fails_with_exit_code_1(corpus_path, tmp_path, capsys):
    """A loss that becomes NaN/inf is a failure: diverged_at_step in the summary (strict JSON),
    one error line, exit code 1 (not 2: the input was valid)."""
    out = tmp_path / "summary.json"
    code = main(["--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--max-seq-len", "32",
                 "--data", corpus_path, "--batch-size", "4", "--steps", "4", "--warmup-steps",
                 "0", "--schedule", "constant", "--optimizer", "sgd", "--learning-rate", "1e30",
                 "--clip-norm", "0", "--eval-every", "0", "--checkpoint-every", "0",
                 "--final-eval-batches", "1", "--no-progress", "--run-dir", str(tmp_path / "r"),
                 "--cache-dir", str(tmp_path / "cache"), "--json", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err[-1].startswith("error: training diverged"), err
    summary = json.loads(out.read_text())
    assert summary["diverged_at_step"] is not None and summary["diverged_at_step"] <= 4
    assert "NaN" not in out.read_text()


def test_library_entry_points_refuse_non_finite_values():
    """The library's own constructors refuse what the config would: for callers without it."""
    from jaxaccel.step.optim import make_optimizer
    from jaxaccel.step.precision import DynamicLossScale, StaticLossScale
    for kwargs, field in (({"learning_rate": math.nan}, "optimizer.learning_rate"),
                          ({"weight_decay": math.inf}, "optimizer.weight_decay"),
                          ({"clip_norm": -1.0}, "optimizer.clip_norm"),
                          ({"clip_norm": math.nan}, "optimizer.clip_norm"),
                          ({"b1": 1.0}, "optimizer.name")):
        with pytest.raises(ConfigError) as info:
            make_optimizer("adamw", total_steps=10, **kwargs)
        assert info.value.field == field
    for create in (lambda: DynamicLossScale.create(initial_scale=1e39),
                   lambda: DynamicLossScale.create(growth_factor=math.inf),
                   lambda: StaticLossScale.create(1e39)):
        with pytest.raises(ConfigError, match="loss scale|loss-scale"):
            create()


def test_an_override_of_null_unsets_an_optional_text_field():
    from jaxaccel.run.config import parse
    assert parse(["run.profile=null"], defaults={"run.profile": "2:4"}).run.profile is None
    assert parse(["run.run_dir=~"]).run.run_dir is None
    assert parse(["run.run_dir=nullish"]).run.run_dir == "nullish"
