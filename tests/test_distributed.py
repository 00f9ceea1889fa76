"""Several processes: the rendezvous before JAX's runtime, two processes training like one, a
stop agreed by every process, a dead peer. (Apart from tests/test_sharding.py and its 8-device
suite so that the two pytest workers share the multi-device work.)"""

import json
import os
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, xla_flags
from jaxaccel.core.errors import ConfigError
from jaxaccel.core.sharding import rendezvous, wait_for_port

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_coordinator_times_out_with_one_line():
    with pytest.raises(ConfigError, match="did not answer within 1 s"):
        wait_for_port("127.0.0.1", free_port(), 1)
    result = subprocess.run(
        [sys.executable, "-m", "experiments.train", "--coordinator", f"127.0.0.1:{free_port()}",
         "--num-processes", "2", "--process-id", "1", "--distributed-timeout", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert result.stderr.startswith("error: coordinator 127.0.0.1:")


def test_the_rendezvous_before_jax_makes_start_up_failures_one_line():
    """Processes meet on the coordinator port before JAX's runtime (which would abort with a
    C++ stack trace): all joined; peers that never join; another program on the port; a
    process count that differs; a process id given twice."""
    import threading

    def in_thread(fn, *args):
        result = {}

        def run():
            try:
                fn(*args)
                result["ok"] = True
            except ConfigError as e:
                result["error"] = str(e)
        thread = threading.Thread(target=run)
        thread.start()
        return thread, result

    port = free_port()
    started = [in_thread(rendezvous, "127.0.0.1", port, 3, i, 10) for i in (0, 1, 2)]
    for thread, result in started:
        thread.join(30)
        assert result == {"ok": True}, result
    with pytest.raises(ConfigError, match=r"process\(es\) 1, 2 of 3 did not join within 1 s"):
        rendezvous("127.0.0.1", free_port(), 3, 0, 1)

    with socket.socket() as other:          # a program that is not ours on the port
        other.bind(("127.0.0.1", 0))
        other.listen()

        def answer_junk():
            for _ in range(2):              # wait_for_port's probe, then the hello
                conn, _ = other.accept()
                conn.sendall(b"SSH-2.0-OpenSSH\r\n")
                conn.close()
        threading.Thread(target=answer_junk).start()
        with pytest.raises(ConfigError, match="is not process 0 of a jaxaccel run"):
            rendezvous("127.0.0.1", other.getsockname()[1], 2, 1, 5)

    port = free_port()
    zero, result = in_thread(rendezvous, "127.0.0.1", port, 2, 0, 10)
    with pytest.raises(ConfigError, match="refused this process: it was started with "
                                          "--num-processes 3, process 0 with 2") as info:
        rendezvous("127.0.0.1", port, 3, 1, 10)
    assert info.value.field == "mesh.num_processes"
    zero.join(30)
    assert "process 1: it was started with --num-processes 3" in result["error"]

    port = free_port()                      # two processes given the same --process-id
    started = [in_thread(rendezvous, "127.0.0.1", port, 3, i, 10) for i in (0, 1, 1)]
    for thread, _ in started:
        thread.join(30)
    errors = [result.get("error", "") for _, result in started]
    assert "process 1: process id 1 is taken" in errors[0], errors
    assert sorted("refused this process: process id 1 is taken" in e for e in errors[1:]) == [
        False, True], errors


# What the rendezvous is for: jax.distributed.initialize alone, as initialize_distributed calls
# it, on a start-up failure: what it prints if it raises, nothing if it dies of a signal.
JAX_ALONE = """
import resource, sys
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))    # an abort leaves no core file
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
try:
    jax.distributed.initialize(sys.argv[1], 2, int(sys.argv[2]), initialization_timeout=1)
except BaseException as e:
    print("caught", type(e).__name__, e, flush=True)
    sys.exit(1)
print("started")
"""


def test_jax_distributed_alone_aborts_where_the_rendezvous_says_one_line():
    """A process 1 whose process 0 never starts: past its timeout, JAX's runtime aborts (SIGABRT)
    with a C++ stack trace instead of raising. (Also measured, jax 0.11 on CPU, 2026-11-28: a
    process 0 whose peer never joins, another program answering on the port and a process id
    given twice abort the same way; a process 0 whose port is taken dies of SIGSEGV in about 2
    runs of 3, else raises JaxRuntimeError "Failed to start RPC server"; a process 1 with a
    larger --num-processes than process 0's starts as if it agreed.) The rendezvous turns each
    into one ConfigError line (the test above)."""
    with socket.socket() as never:          # a port nobody listens on
        never.bind(("127.0.0.1", 0))
        port = never.getsockname()[1]
    result = subprocess.run([sys.executable, "-c", JAX_ALONE, f"127.0.0.1:{port}", "1"],
                            env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == -signal.SIGABRT and result.stdout == "", result
    assert "RegisterTask" in result.stderr and "Check failure stack trace" in result.stderr
    assert result.stderr.strip().count("\n") > 5


# One block 16 wide: what these tests check does not depend on the model's size; one final
# evaluation batch and no loss plot (matplotlib's import is about 1 s a process). A constant
# learning rate after one warmup step: the steps compiled do not depend on --steps, so the
# processes of every test here run the same programs, which the run-wide compilation cache
# then serves.
TINY = ["--d-model", "16", "--n-layers", "1", "--n-heads", "2", "--max-seq-len", "16",
        "--batch-size", "4", "--schedule", "constant", "--warmup-steps", "1", "--log-every",
        "1", "--eval-every", "0", "--final-eval-batches", "1", "--no-loss-plot",
        "--no-progress"]


def test_two_processes_train_together_like_one(corpus_path, tmp_path):
    """Two processes under jax.distributed (gloo), each with one CPU device and its own half of
    every batch, train FSDP over both and report the losses of one process on one device (the
    single-device run, the reference, runs in this process while they start and train: a
    process of its own is not what is checked)."""
    from experiments.train import main as train_main

    common = ["--data", corpus_path, *TINY, "--steps", "4", "--checkpoint-every", "2",
              "--sharding", "fsdp", "--cache-dir", str(tmp_path / "cache")]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags()}
    port = free_port()
    logs = [tmp_path / f"{i}.log" for i in range(2)]    # files: no pipe fills while we train
    procs = [subprocess.Popen(
        [sys.executable, "-m", "experiments.train", *common, "--coordinator", f"127.0.0.1:{port}",
         "--num-processes", "2", "--process-id", str(i), "--distributed-timeout", "60",
         "--run-dir", str(tmp_path / "two"), "--json", str(tmp_path / f"{i}.json")],
        cwd=REPO, env=env, stdout=open(logs[i], "w"), stderr=subprocess.STDOUT, text=True)
        for i in range(2)]
    try:
        assert train_main([*common, "--run-dir", str(tmp_path / "one"),
                           "--json", str(tmp_path / "one.json")]) == 0
        for proc, log in zip(procs, logs):
            proc.wait(timeout=240)
            assert proc.returncode == 0, log.read_text()[-4000:]
    finally:
        for proc in procs:
            proc.kill()

    def losses(name):
        with open(tmp_path / name) as f:
            return [json.loads(line)["loss"] for line in f if '"train"' in line]

    summaries = [json.load(open(tmp_path / f"{i}.json")) for i in range(2)]
    assert [s["process_count"] for s in summaries] == [2, 2]
    assert summaries[0]["mesh"] == {"stage": 1, "data": 1, "fsdp": 2, "tensor": 1}
    assert summaries[0]["compiles"] == 1
    assert sorted(os.listdir(tmp_path / "two" / "checkpoints")) == ["2", "4"]
    two = losses("two/metrics.jsonl")
    assert len(two) == 4 and two == losses("two/metrics.process1.jsonl")
    np.testing.assert_allclose(two, losses("one/metrics.jsonl"), rtol=1e-5)
    assert summaries[0]["val_loss"] == summaries[1]["val_loss"]
    assert summaries[0]["val_loss"] == pytest.approx(json.load(open(tmp_path / "one.json"))[
        "val_loss"], rel=1e-5)


def start_two_processes(corpus_path, tmp_path):
    """Two processes training FSDP together without end (log every step, no checkpoints but
    the last), once both have logged two steps; and their run directory."""
    import time

    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags()}
    port = free_port()
    run_dir = tmp_path / "two"
    procs = [subprocess.Popen(
        [sys.executable, "-m", "experiments.train", "--data", corpus_path, *TINY, "--steps",
         "100000", "--checkpoint-every", "0", "--sharding", "fsdp", "--cache-dir",
         str(tmp_path / "cache"),
         "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i),
         "--distributed-timeout", "60", "--run-dir", str(run_dir)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(2)]
    deadline = time.time() + 180
    metrics = run_dir / "metrics.jsonl"
    while time.time() < deadline and not (metrics.exists() and
                                          metrics.read_text().count("\n") >= 2):
        if any(p.poll() is not None for p in procs):
            for p in procs:
                p.kill()
            raise AssertionError([p.communicate() for p in procs])
        time.sleep(0.2)
    return procs, run_dir


def test_a_signal_to_one_process_stops_every_process_at_the_same_step(corpus_path, tmp_path):
    """SIGTERM to process 1 alone (a preemption notice to one host): both processes agree on
    the stop at a log step, save one checkpoint of that step together and exit 143."""
    import re

    procs, run_dir = start_two_processes(corpus_path, tmp_path)
    try:
        procs[1].send_signal(signal.SIGTERM)
        errs = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [128 + signal.SIGTERM] * 2, errs
    steps = [int(re.search(r"stopped by SIGTERM at step (\d+)", e).group(1)) for e in errs]
    assert steps[0] == steps[1], errs
    assert os.listdir(run_dir / "checkpoints") == [str(steps[0])]


def test_a_process_that_dies_stops_the_others_with_one_line(corpus_path, tmp_path):
    """SIGKILL to process 1: process 0's next collective fails, and it stops at once with one
    error line and exit code 3 (JAX's runtime would abort it after its heartbeat timeout,
    100 s, with a C++ stack trace)."""
    procs, _ = start_two_processes(corpus_path, tmp_path)
    try:
        procs[1].send_signal(signal.SIGKILL)
        _, err = procs[0].communicate(timeout=60)
    finally:
        for p in procs:
            p.kill()
    assert procs[0].returncode == 3, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: another process of this run "
                                                   "stopped") and "--resume" in lines[0], err
