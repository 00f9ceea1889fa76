"""Two real processes under jax.distributed assemble exactly the batches of one process."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from conftest import xla_flags
from jaxaccel.data.batching import DataStream

sys.path.insert(0, os.path.dirname(__file__))
from multiprocess_loader_worker import documents  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("strategy", ["pack", "dynamic"])
def test_two_processes_build_the_single_process_batches(strategy, tmp_path):
    worker = os.path.join(os.path.dirname(__file__), "multiprocess_loader_worker.py")
    port = str(free_port())
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags()}
    procs = [subprocess.Popen([sys.executable, worker, port, str(i), str(tmp_path / f"{i}.json"),
                               strategy], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    for proc in procs:
        out, _ = proc.communicate(timeout=180)
        assert proc.returncode == 0, out[-3000:]
    reports = [json.load(open(tmp_path / f"{i}.json")) for i in range(2)]
    assert all(r["process_count"] == 2 for r in reports)
    single = DataStream(documents(), strategy=strategy, seq_len=16, batch_size=4, seed=1)
    for step in range(5):
        expected = next(single)
        seen = [r["batches"][step] for r in reports]
        assert seen[0]["global_shape"] == list(expected["inputs"].shape)
        for key, value in expected.items():
            for s in seen:
                np.testing.assert_array_equal(np.asarray(s[key], value.dtype), value)
        half = expected["weights"].shape[0] // 2
        assert [s["local_real_tokens"] for s in seen] == [
            int(expected["weights"][:half].sum()), int(expected["weights"][half:].sum())]
