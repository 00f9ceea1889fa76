"""Fixtures shared by the tests that train."""

import json
import os

import numpy as np
import pytest


@pytest.fixture(scope="session")
def corpus_path(tmp_path_factory):
    """About 600 short documents of code-like text, enough for a validation split."""
    rng = np.random.default_rng(0)
    words = ["def", "return", "self", "x", "=", "+", "(", ")", ":", "if", "for", "in", "\n    "]
    path = tmp_path_factory.mktemp("data") / "docs.jsonl"
    with open(path, "w") as f:
        for _ in range(600):
            n = int(rng.integers(3, 40))
            f.write(json.dumps({"text": " ".join(rng.choice(words, n))}) + "\n")
    return str(path)


# tests/multidevice needs 8 simulated devices, set before JAX starts: tests/test_sharding.py runs
# it in a subprocess that sets JAXACCEL_MULTIDEVICE=1 and XLA_FLAGS.
if os.environ.get("JAXACCEL_MULTIDEVICE") != "1":
    collect_ignore = ["multidevice"]
