"""Fixtures shared by the tests that train, and the run-wide compilation cache."""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The process that started the run (pytest's controller): set before any worker or subprocess
# starts, which inherit it.
IS_OWNER = "JAXACCEL_TEST_OWNER" not in os.environ
OWNER = os.environ.setdefault("JAXACCEL_TEST_OWNER", str(os.getpid()))

# Many tests compile the same small programs again (a run, then its resumed half; every row of an
# experiment subprocess), and every run of the suite compiles what the last one did: JAX's
# persistent compilation cache serves the repeats, shared by the test workers and their
# subprocesses and kept in the checkout from one run to the next (.cache/xla-tests, ignored by
# git; a second `make test` compiles only the programs a change made). A hit is the executable
# XLA builds for the same program, options, XLA flags and jax version (the cache's key), so
# nothing a test checks changes, only the time. The folder is emptied when it outgrows
# CACHE_BYTES; `make clean` removes it; JAXACCEL_TEST_XLA_CACHE=DIR puts it elsewhere (an empty
# folder: a cold run, as on a fresh clone).
CACHE_DIR = os.environ.get("JAXACCEL_TEST_XLA_CACHE") or os.path.join(REPO, ".cache", "xla-tests")
CACHE_BYTES = 512 * 2**20
if IS_OWNER and os.path.isdir(CACHE_DIR):
    if sum(e.stat().st_size for e in os.scandir(CACHE_DIR) if e.is_file()) > CACHE_BYTES:
        shutil.rmtree(CACHE_DIR, ignore_errors=True)
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", CACHE_DIR)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

# XLA's CPU code generation at LLVM optimisation level 0: the suite's small programs spend more
# time compiling than running, and compile about a quarter faster so. The HLO each test builds,
# and so what it checks, is the same; the tests' processes and their subprocesses all use it.
FAST_COMPILE = "--xla_backend_optimization_level=0"
if FAST_COMPILE not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()


def xla_flags(*flags: str) -> str:
    """XLA_FLAGS for a test's subprocess: ``flags`` and the suite's fast compilation."""
    return " ".join((*flags, FAST_COMPILE))


# The stdlib corpus's cache, shared by the workers for this run alone: the first load reads the
# standard library (seconds), the others map the cached tokens. Named by the controller's id,
# which the workers inherit, so that the controller removes the folder they used.
CORPUS_CACHE_DIR = os.path.join(tempfile.gettempdir(), f"jaxaccel-test-corpus-{OWNER}")


# The 8-device subprocesses compile with XLA CPU's concurrency-optimized scheduler off. With it
# on, the 1F1B + FSDP + TP program of the pipeline suite, loaded from the compilation cache while
# the other core was busy, deadlocked in its collectives: its devices waited at different
# all-gathers until XLA's 40 s termination timeout aborted the process (3 of 3 runs, 2026-11-28;
# compiled afresh it passed). With it off, 5 of 5 such runs passed. The order in which XLA runs
# independent operations changes, not what they compute.
MULTIDEVICE_FLAGS = ("--xla_force_host_platform_device_count=8",
                     "--xla_cpu_enable_concurrency_optimized_scheduler=false")


def pytest_sessionfinish(session):
    # the run's folder goes when the controller ends (after every worker), not when a pytest of
    # tests/multidevice that it started ends (the same run's folder, by the inherited id)
    if OWNER == str(os.getpid()):
        shutil.rmtree(CORPUS_CACHE_DIR, ignore_errors=True)


def run_multidevice(path: str, part: int = 0, parts: int = 1, *, tests=(), others_than=()):
    """Run the tests in ``path`` (under tests/multidevice) in a subprocess with 8 simulated CPU
    devices, failing (not skipping) if any fails or none runs. A long file runs in parts, each a
    test of its own: ``tests`` (function names) runs only those, ``others_than`` every test but
    those; with ``parts`` > 1, only the ``part``-th of ``parts`` contiguous slices of the
    file's tests (in file order) runs."""
    select = (f"only:{','.join(tests)}" if tests else
              f"except:{','.join(others_than)}" if others_than else f"slice:{part}/{parts}")
    env = {**os.environ, "JAXACCEL_MULTIDEVICE": "1", "JAX_PLATFORMS": "cpu",
           "JAXACCEL_MULTIDEVICE_SELECT": select,
           "XLA_FLAGS": xla_flags(*MULTIDEVICE_FLAGS)}
    result = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-o", "addopts=",
                             "-p", "no:cacheprovider", path], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout


def _multidevice_select(config, items):
    """In a multidevice subprocess, keep the tests ``JAXACCEL_MULTIDEVICE_SELECT`` names."""
    how, _, what = os.environ.get("JAXACCEL_MULTIDEVICE_SELECT", "slice:0/1").partition(":")
    if how == "slice":
        part, parts = map(int, what.split("/"))
        start, stop = len(items) * part // parts, len(items) * (part + 1) // parts
        keep = items[start:stop]
    else:
        names = set(what.split(","))
        keep = [item for item in items if (item.originalname in names) == (how == "only")]
    config.hook.pytest_deselected(items=[item for item in items if item not in keep])
    items[:] = keep


@contextlib.contextmanager
def terminal_signals():
    """SIGINT and SIGTERM handled as in a terminal's foreground process while inside, whatever
    this process was started with (``nohup make test &`` ignores SIGINT from the start, and a
    child process inherits an ignored signal), then as they were before."""
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        yield before
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


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


# The files that take longest run first: pytest-xdist (--dist loadfile) hands files to its two
# workers in collection order, and a long file started last leaves the other worker idle.
LONGEST_FIRST = ("test_sharding.py", "test_speedup.py", "test_any_model.py", "test_experiments.py",
                 "test_pipeline.py", "test_techniques.py", "test_readme.py", "test_remat.py",
                 "test_loop.py", "test_flash_attention.py")


def pytest_collection_modifyitems(session, config, items):
    def rank(item):
        name = os.path.basename(str(item.fspath))
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)
    items.sort(key=rank)      # stable: the order within a file and among the rest is kept
    if os.environ.get("JAXACCEL_MULTIDEVICE") == "1":
        _multidevice_select(config, items)


# tests/multidevice needs 8 simulated devices, set before JAX starts: tests/test_sharding.py runs
# it in a subprocess that sets JAXACCEL_MULTIDEVICE=1 and XLA_FLAGS.
if os.environ.get("JAXACCEL_MULTIDEVICE") != "1":
    collect_ignore = ["multidevice"]
