"""The README's custom training loop runs as printed and trains."""

import os
import re
import shlex
import subprocess
import sys

import numpy as np

from conftest import xla_flags

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def test_the_readme_custom_loop_composes_the_transformations_and_trains(capsys):
    text = open(README).read()
    code = re.search(r"<!-- custom-loop -->\n```python\n(.*?)```", text, re.S).group(1)
    namespace = {}
    exec(compile(code, "README.md (custom loop)", "exec"), namespace)
    loss, loss_scale = namespace["loss"], namespace["loss_scale"]
    assert np.isfinite(float(loss)) and float(loss) < 4.0          # from ln(320) = 5.77 nats
    assert int(loss_scale.skipped_steps) < 5                       # a few overflows back off
    assert float(loss_scale.loss_scale) < 2.0**16                  # ... from the initial scale
    assert "steps skipped" in capsys.readouterr().out


def block(marker: str, lang: str = "") -> str:
    return re.search(rf"<!-- {marker} -->\n```{lang}\n(.*?)```", open(README).read(), re.S).group(1)


def test_the_readme_own_model_code_trains_it_with_every_technique(monkeypatch, capsys):
    monkeypatch.chdir(os.path.dirname(README))
    namespace = {}
    exec(compile(block("own-model-code", "python"), "README.md (own model)", "exec"), namespace)
    assert float(namespace["metrics"]["loss"]) < np.log(320)          # it learns from ln(320)
    assert "loss" in capsys.readouterr().out


def test_the_readme_own_model_commands_train_sample_and_export_it(tmp_path):
    """The README's commands as printed, in their order, on two CPU devices; only the step
    counts are cut (30 to 4), the training runs' final evaluations to 2 validation batches of
    the default 100 (on 2 CPU cores the 100 took about 55 s of each run's 105 s; the summary's
    validation loss is computed the same way over fewer batches) and the paths moved under the
    test's directory."""
    commands = block("own-model-command").replace("\\\n", " ").strip().splitlines()
    assert [c.split()[2] for c in commands] == ["experiments.train", "experiments.train",
                                                "experiments.sample", "experiments.export"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=2")}
    repo = os.path.dirname(README)
    for command in commands:
        argv = shlex.split(command.replace("--steps 30", "--steps 4 --final-eval-batches 2"))
        argv = [str(tmp_path / a) if a.startswith(("runs/", "exported/")) else a for a in argv]
        result = subprocess.run([sys.executable, *argv[1:]], cwd=repo, env=env,
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, f"{command}\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
    assert any((tmp_path / "exported/tiny-lm").iterdir())
