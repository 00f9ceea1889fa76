"""The README's custom training loop, its own-model code and its own-model commands run as
printed and train; only step counts, the own model's depth and the commands' final evaluation
batches are cut."""

import os
import re
import shlex
import subprocess
import sys

import numpy as np
import pytest

from conftest import xla_flags

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def block(marker: str, lang: str = "") -> str:
    return re.search(rf"<!-- {marker} -->\n```{lang}\n(.*?)```", open(README).read(), re.S).group(1)


def cut(code: str, printed: str, cut_to: str) -> str:
    """``code`` with ``printed`` (which it must contain) replaced by ``cut_to``."""
    assert printed in code, printed
    return code.replace(printed, cut_to)


def test_the_readme_custom_loop_composes_the_transformations_and_trains(capsys):
    """The loop as printed, over 10 of its 30 steps: its loss is below 4.0 from the 8th step on
    (3.25 at the 10th, 3.05 at the 30th), so the check that it learns is the same."""
    code = cut(block("custom-loop", "python"), "zip(range(30), ", "zip(range(10), ")
    namespace = {}
    exec(compile(code, "README.md (custom loop)", "exec"), namespace)
    loss, loss_scale = namespace["loss"], namespace["loss_scale"]
    assert np.isfinite(float(loss)) and float(loss) < 4.0          # from ln(320) = 5.77 nats
    assert int(loss_scale.skipped_steps) < 5                       # a few overflows back off
    assert float(loss_scale.loss_scale) < 2.0**16                  # ... from the initial scale
    assert "steps skipped" in capsys.readouterr().out


def test_the_readme_own_model_code_trains_it_with_every_technique(monkeypatch, capsys):
    """The code as printed, over 5 of its 20 steps and with 2 of its 4 blocks, as the commands
    below (the same blocks and techniques; compiling the unrolled blocks is most of its time).
    With 2 blocks the loss, 6.4 at the first step, is 5.1 at the fifth; with the printed 4 it
    is 5.9 at the first and 4.7 at the twentieth (2026-11-28, this suite's XLA flags)."""
    monkeypatch.chdir(os.path.dirname(README))
    code = cut(block("own-model-code", "python"), "zip(range(20), ", "zip(range(5), ")
    code = cut(code, "width=64, depth=4)", "width=64, depth=2)")
    namespace = {}
    exec(compile(code, "README.md (own model)", "exec"), namespace)
    assert float(namespace["metrics"]["loss"]) < np.log(320)          # it learns from ln(320)
    assert "loss" in capsys.readouterr().out


class OwnModelCommands:
    """The README's own-model commands as printed, in their order, each in a process of its own
    on two CPU devices (as a user runs them: the README's XLA_FLAGS, ``python -m``), run once
    for the tests below, each test's command after the ones before it. Cut: the step counts
    (30 to 2), the training runs' final evaluations (to 1 validation batch of the default 100;
    the summary's validation loss is computed the same way over fewer batches) and the model's
    depth (4 blocks to 2: the same blocks and techniques; compiling the unrolled blocks is most
    of each command's time); the paths go under the test's directory."""

    CUTS = (("--steps 30", "--steps 2 --final-eval-batches 1"), ("depth: 4", "depth: 2"))

    def __init__(self, tmp_path):
        self.tmp_path = tmp_path
        self.commands = block("own-model-command").replace("\\\n", " ").strip().splitlines()
        self.ran = 0

    def run(self, index: int) -> str:
        """Run the commands up to the ``index``-th (those not run yet); its argv's module."""
        env = {**os.environ, "JAX_PLATFORMS": "cpu",
               "XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=2")}
        while self.ran <= index:
            command = self.commands[self.ran]
            for printed, cut_to in self.CUTS:
                command = command.replace(printed, cut_to)
            argv = shlex.split(command)
            argv = [str(self.tmp_path / a) if a.startswith(("runs/", "exported/")) else a
                    for a in argv]
            result = subprocess.run([sys.executable, *argv[1:]], cwd=os.path.dirname(README),
                                    env=env, capture_output=True, text=True, timeout=600)
            assert result.returncode == 0, \
                f"{command}\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
            self.ran += 1
        return self.commands[index].split()[2]


@pytest.fixture(scope="module")
def own_model_commands(tmp_path_factory):
    commands = OwnModelCommands(tmp_path_factory.mktemp("readme"))
    assert [c.split()[2] for c in commands.commands] == [
        "experiments.train", "experiments.train", "experiments.sample", "experiments.export"]
    for printed, _ in OwnModelCommands.CUTS:        # every cut applies to the printed commands
        assert printed in " ".join(commands.commands), printed
    return commands


def test_the_readme_own_model_command_trains_it_with_every_technique(own_model_commands):
    assert own_model_commands.run(0) == "experiments.train"
    assert (own_model_commands.tmp_path / "runs/tiny-lm/summary.json").is_file()


def test_the_readme_own_model_command_fine_tunes_it_with_lora(own_model_commands):
    assert own_model_commands.run(1) == "experiments.train"
    assert (own_model_commands.tmp_path / "runs/tiny-lm-lora/summary.json").is_file()


def test_the_readme_own_model_command_samples_it(own_model_commands):
    assert own_model_commands.run(2) == "experiments.sample"


def test_the_readme_own_model_command_exports_it(own_model_commands):
    assert own_model_commands.run(3) == "experiments.export"
    assert any((own_model_commands.tmp_path / "exported/tiny-lm").iterdir())
