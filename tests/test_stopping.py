"""A signal stops a whole experiment: the cut row saves its checkpoint and is not reported as a
result, no later row runs, the exit code is the signal's, and a row's process is never left
behind."""

import json
import os
import signal
import threading
import time

from jaxaccel.step import metrics


def _signal_at_first_train_record(monkeypatch, signum):
    """Send ``signum`` to this process when the first row writes its first train record."""
    write = metrics.MetricsWriter.write
    sent = []

    def write_then_signal(self, step, kind, values):
        write(self, step, kind, values)
        if kind == "train" and not sent:
            sent.append(step)
            signal.raise_signal(signum)

    monkeypatch.setattr(metrics.MetricsWriter, "write", write_then_signal)
    return sent


def test_sigint_stops_a_multi_row_experiment_after_the_cut_rows_checkpoint(
        corpus_path, tmp_path, capsys, monkeypatch):
    from experiments import optimizers
    sent = _signal_at_first_train_record(monkeypatch, signal.SIGINT)
    out, runs = tmp_path / "optimizers.json", tmp_path / "runs"
    before = signal.getsignal(signal.SIGINT)     # SIG_IGN under nohup: the command's own wins
    code = optimizers.main([
        "--data", corpus_path, "--d-model", "32", "--n-layers", "1", "--n-heads", "2",
        "--max-seq-len", "32", "--seq-len", "32", "--batch-size", "2", "--steps", "6",
        "--log-every", "1", "--warmup-steps", "1", "--optimizers", "adamw,lion",
        "--no-large-batch", "--no-progress", "--run-dir", str(runs),
        "--cache-dir", str(tmp_path / "cache"), "--json", str(out)])
    assert code == 130 and sent == [1]
    result = json.loads(out.read_text())
    assert result["rows"] == [] and result["meta"]["interrupted"] == "SIGINT"
    assert "PARTIAL: stopped by SIGINT; 0 of 2 rows ran" in capsys.readouterr().out
    cut = runs / "defaults-adamw-b2"
    # the cut row's checkpoint: step 1's record is written at the next log step (the loop
    # fetches a window's metrics one log step late), so the signal arrives during step 2
    assert os.listdir(cut / "checkpoints") == ["2"]
    assert not (runs / "defaults-lion-b2").exists()            # no later row
    assert signal.getsignal(signal.SIGINT) is before           # the handler as it was


def test_sigterm_reaches_the_row_process_of_speedup_and_leaves_none_behind(
        corpus_path, tmp_path, capsys):
    from experiments import speedup
    runs = tmp_path / "runs"
    metrics_path = runs / "baseline" / "round-1" / "metrics.jsonl"

    def terminate_when_training():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if metrics_path.exists() and '"train"' in metrics_path.read_text():
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=terminate_when_training, daemon=True)
    watcher.start()
    code = speedup.main([
        "--scale", "cpu", "--cpu-devices", "1", "--rows", "baseline,pack", "--data",
        corpus_path, "--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--max-seq-len",
        "128", "--seq-len", "128", "--batch-size", "4", "--train-tokens", "5000000",
        "--log-every", "1", "--warmup-steps", "1", "--cache-dir", str(tmp_path / "cache"),
        "--run-dir", str(runs)])
    watcher.join()
    assert code == 143
    assert "PARTIAL: stopped by SIGTERM; 0 of 2 rows ran" in capsys.readouterr().out
    log = (runs / "baseline" / "round-1" / "log.txt").read_text()
    assert "stopped by SIGTERM at step" in log                 # the row's process stopped itself
    assert "no checkpoint written" in log         # ... cleanly, its weights not kept (a row's)
    assert not os.listdir(runs / "baseline" / "round-1" / "checkpoints")
    assert not (runs / "pack").exists()


def test_a_row_process_stops_when_its_experiment_is_killed(tmp_path):
    """SIGKILL to the experiment: its row process gets SIGTERM (PR_SET_PDEATHSIG) instead of
    training on detached."""
    import subprocess
    import sys
    child_code = ("import signal, sys; from experiments.common import die_with_parent; "
                  "die_with_parent(); signal.signal(signal.SIGTERM, lambda *a: sys.exit(143)); "
                  "print('ready', flush=True); signal.pause()")
    parent_code = ("import os, subprocess, sys; "
                   "env = {**os.environ, 'JAXACCEL_PARENT_PID': str(os.getpid())}; "
                   f"c = subprocess.Popen([sys.executable, '-c', {child_code!r}], env=env, "
                   "stdout=subprocess.PIPE, text=True); print(c.pid, flush=True); "
                   "c.stdout.readline(); print('child ready', flush=True); "
                   "import time; time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE,
                              text=True, cwd=os.getcwd())
    child_pid = int(parent.stdout.readline())
    assert parent.stdout.readline().strip() == "child ready"
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child_pid, 0)
        except ProcessLookupError:
            break
        try:                                    # reap it if it became our zombie
            os.waitpid(child_pid, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.05)
    else:
        os.kill(child_pid, signal.SIGKILL)
        raise AssertionError("the row process outlived its killed experiment")
