"""The experiments' own settings, refused as one true line before any work (issue 51): the
bounds they suggest run, the reports they print are true, and a row is never measured twice,
under another's name, into another's place or after the rows before it when it cannot run.

Every case stops at the experiment's plan and checks (``run_plan``, which measures the rows, is
made to fail here), so nothing trains; the memory cases make the device's memory small."""

import json
import os
import re

import jax.numpy as jnp
import pytest

from experiments import (attention, common, embedding, importance, padding, precision, remat,
                         sharding, sparsity, token_drop, tokenization)
from experiments.common import Row, check_run_root, parse_config
from jaxaccel.core import hardware
from jaxaccel.techniques import planner
from jaxaccel.core.errors import ConfigError

# A model of one's own written before the contract: its call takes the ids alone (no positions,
# no segment ids) and it tags no tensor for remat.
PLAIN_MODEL = '''
from flax import nnx
from jaxaccel.model import nn


class Block(nnx.Module):
    def __init__(self, width, rngs):
        self.fc = nnx.Linear(width, width, rngs=rngs)

    def __call__(self, x):
        return x + self.fc(x)


class PlainLM(nnx.Module):
    def __init__(self, vocab_size, max_seq_len, *, rngs, width=16):
        self.emb = nnx.Embed(vocab_size, width, rngs=rngs)
        self.blocks = nn.Stack([Block(width, rngs)])
        self.head = nnx.Linear(width, vocab_size, rngs=rngs)

    def __call__(self, inputs):
        return self.head(self.blocks(self.emb(inputs)))


def make(vocab_size, max_seq_len, *, rngs, **options):
    return PlainLM(vocab_size, max_seq_len, rngs=rngs, **options)
'''

TINY = ["--d-model", "16", "--n-layers", "1", "--n-heads", "2", "--max-seq-len", "16",
        "--seq-len", "16", "--batch-size", "2", "--steps", "2", "--no-progress"]


@pytest.fixture(scope="module")
def plain_model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("model") / "plain_lm.py"
    path.write_text(PLAIN_MODEL)
    return f"{path}:make"


@pytest.fixture
def no_work(monkeypatch):
    """Measuring a row fails the test: every case here must stop before it."""
    def run_plan(*args, **kwargs):
        raise AssertionError("a row was measured")
    monkeypatch.setattr(common, "run_plan", run_plan)


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def refused(main, args, capsys) -> str:
    """The one line ``main(args)`` prints, exiting with 2."""
    assert main(args) == 2
    return one_line(capsys)


# ---------------------------------------------------------------------------------------------
# The probe's accumulation: a traceback after training before.

def test_probe_accumulate_beyond_the_probes_integers_is_refused_before_training(
        corpus_path, tmp_path, capsys, no_work):
    args = ["--data", corpus_path, *TINY, "--run-dir", str(tmp_path / "runs")]
    line = refused(precision.main, [*args, "--probe-accumulate", "1,2147483648"], capsys)
    assert "K=2,147,483,648" in line and "at most 2,147,483,647" in line
    assert line.endswith("[--probe-accumulate / experiment.probe_accumulate]")
    assert not (tmp_path / "runs").exists()
    # the largest accepted K computes the probe's normalizer, the next one cannot
    cfg = parse_config(precision.EXPERIMENT, [*args, "--probe-accumulate", "2147483647"])
    assert precision.probe_accumulates(cfg.experiment) == [precision.MAX_PROBE_ACCUMULATE]
    tokens = jnp.float32(4096.0)
    assert float(tokens * precision.MAX_PROBE_ACCUMULATE) == pytest.approx(4096.0 * (2**31 - 1))
    with pytest.raises(OverflowError):
        tokens * (precision.MAX_PROBE_ACCUMULATE + 1)


# ---------------------------------------------------------------------------------------------
# Remat's largest batch under accumulation: "batch of 1 rows" whatever the batch before.

def test_the_largest_batch_search_tries_only_batches_that_split_into_microbatches():
    tried = []

    def total_at(b):            # as compiling the accumulated step does at a batch it cannot split
        tried.append(b)
        if b % 4:
            raise ConfigError(f"batch of {b} rows does not split into 4 microbatches")
        return 1000 + 100 * b

    assert planner.largest_batch(total_at, 4000, limit=100, hint=8, multiple=4) == 28
    assert tried and all(b % 4 == 0 for b in tried)
    assert planner.largest_batch(total_at, 500, limit=100, hint=8, multiple=4) == 0


def test_remat_max_batch_limit_below_the_microbatches_is_refused(capsys, no_work):
    line = refused(remat.main, [*TINY, "--accumulate", "2", "--max-batch-limit", "1",
                                "--policies", "none", "--no-scan-rows"], capsys)
    assert "accumulate=2" in line and "--max-batch-limit of at least 2" in line
    assert line.endswith("[--max-batch-limit / experiment.max_batch_limit]")


def test_remat_reports_a_max_batch_of_whole_microbatches(tmp_path, capsys):
    """The row compiles, steps and searches (one compile: the limit 3 holds one batch of two
    microbatches, the row's own): its max batch is a multiple of --accumulate, and the note says
    so. Before, the search compiled batch 1 and stopped on "batch of 1 rows"."""
    out = tmp_path / "remat.json"
    assert remat.main([*TINY, "--accumulate", "2", "--max-batch-limit", "3", "--optimizer",
                       "sgd", "--policies", "none", "--no-scan-rows", "--timed-steps", "1",
                       "--json", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["max_batch"] == 2 and set(row["probed"]) == {"2"}
    assert "among those that split into --accumulate 2 microbatches" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# Attention's bounds: the suggested one runs on this host (here, a host made small).

ATTENTION = ["--head-dims", "16", "--heads", "2", "--impls", "xla", "--layouts", "dense",
             "--causal", "causal", "--warmup", "0", "--iters", "1"]
HAVE = 4_000_000


@pytest.fixture
def small_host(monkeypatch):
    monkeypatch.setattr(hardware, "device_memory_bytes", lambda device=None: HAVE)


def suggested(line: str, flag: str) -> int:
    return int(re.search(rf"pass {flag} of at most ([\d,]+)", line)[1].replace(",", ""))


def accepted(args) -> bool:
    try:
        parse_config(attention.EXPERIMENT, args)
    except ConfigError:
        return False
    return True


def runs_here(T: int, batch: int = 1) -> int:
    """The compiled need of the row's forward+backward (what the check measures)."""
    exp = parse_config(attention.EXPERIMENT, [*ATTENTION, "--seq-lens", "8", "--batch",
                                              "1"]).experiment
    return attention.compiled_need(exp, "xla", batch, T, 16)


@pytest.mark.parametrize("flag, others", [("--seq-lens", []),
                                           ("--max-t-limit", ["--seq-lens", "8"])])
def test_an_attention_length_beyond_memory_suggests_one_that_runs(
        capsys, small_host, no_work, flag, others):
    args = [*ATTENTION, "--batch", "1", *others]
    line = refused(attention.main, [*args, flag, "100000000"], capsys)
    assert "more than this host's available memory (4,000,000)" in line
    assert line.endswith(f"[{flag} / experiment.{flag[2:].replace('-', '_')}]")
    bound = suggested(line, flag)
    assert accepted([*args, flag, str(bound)])                  # the same check takes it
    assert runs_here(bound) <= HAVE < runs_here(bound * 102 // 100)    # and it is the limit
    assert not accepted([*args, flag, str(bound * 102 // 100)])


def test_an_attention_batch_beyond_memory_suggests_the_batch_tokens_that_run(
        capsys, small_host, no_work):
    line = refused(attention.main, [*ATTENTION, "--seq-lens", "128", "--batch-tokens",
                                    "100000"], capsys)
    tokens = suggested(line, "--batch-tokens")
    assert line.endswith("[--batch-tokens / experiment.batch_tokens]")
    rows = tokens // 128
    assert accepted([*ATTENTION, "--seq-lens", "128", "--batch-tokens", str(tokens)])
    assert runs_here(128, rows) <= HAVE < runs_here(128, rows + 1)


def test_attention_memory_bounds_bracket_the_compiled_need():
    """The cheap bounds that spare the compile are honest for XLA's dense attention and the
    kernel; the compiled need is XLA's own memory analysis of the row's program."""
    exp = parse_config(attention.EXPERIMENT, [*ATTENTION, "--seq-lens", "8", "--batch",
                                              "1"]).experiment
    for impl, batch, T in (("xla", 1, 512), ("xla", 2, 96), ("pallas", 1, 256)):
        low, high = attention.need_bounds(exp, impl, batch, T, 16)
        assert low <= attention.compiled_need(exp, impl, batch, T, 16) <= high, (impl, T)


# ---------------------------------------------------------------------------------------------
# Five cases of the experiments' own, each a silent or misleading outcome before.

def test_a_row_listed_twice_is_refused_before_any_work(corpus_path, tmp_path, capsys, no_work):
    """precision --precisions fp32,fp32 trained fp32, then stopped on the second: "run dir
    .../fp32 already holds checkpoints; set resume" (a flag that would resume the wrong run)."""
    args = ["--data", corpus_path, *TINY, "--run-dir", str(tmp_path / "runs")]
    line = refused(precision.main, [*args, "--precisions", "fp32,bf16,fp32"], capsys)
    assert line == ("error: precisions lists fp32 twice; list each once "
                    "[--precisions / experiment.precisions]")
    line = refused(token_drop.main, [*args, "--keeps", "0.5,.5"], capsys)
    assert "keeps lists 0.5 (as '0.5' and '.5') twice" in line and "[--keeps /" in line
    # sparsity's dense row always runs: 'none' would be it again, into its directory
    line = refused(sparsity.main, [*args, "--patterns", "none,2:4"], capsys)
    assert "lists none, the dense row" in line and "[--patterns /" in line
    # and whatever lists them, two rows never share a run directory
    with pytest.raises(ConfigError, match="would train into one directory"):
        check_run_root(str(tmp_path / "runs"), [Row("a:b"), Row("a-b")])


def test_importance_on_packed_batches_names_the_flag_it_has(corpus_path, tmp_path, capsys,
                                                             no_work):
    """The loop's line said "use --batching fixed or --sampling uniform"; this experiment has no
    --sampling (each row sets it)."""
    line = refused(importance.main, ["--data", corpus_path, *TINY, "--run-dir",
                                     str(tmp_path), "--batching", "pack"], capsys)
    assert "use --batching fixed" in line and "--sampling " not in line
    assert line.endswith("[--batching / data.batching]")


def test_padding_refuses_a_pack_row_the_model_cannot_take_before_any_row_trains(
        corpus_path, tmp_path, capsys, no_work, plain_model):
    """Before, fixed, dynamic and bucket trained, then the pack row failed naming --batching,
    a flag this experiment does not have."""
    args = ["--model", plain_model, "--data", corpus_path, "--seq-len", "16", "--batch-size",
            "2", "--steps", "2", "--run-dir", str(tmp_path / "runs")]
    line = refused(padding.main, args, capsys)
    assert "the row 'pack' packs several documents" in line and "positions=" in line
    assert line.endswith("[--strategies / experiment.strategies]")
    assert not (tmp_path / "runs").exists()
    # without the pack row, or planning only (nothing trains), the model is fine
    for more in (["--strategies", "fixed,bucket"], ["--plan-only"]):
        cfg = parse_config(padding.EXPERIMENT, [*args, *more])
        padding.check(cfg, padding.rows(cfg))


def test_a_tokenizer_files_row_trains_inside_the_run_root(corpus_path, tmp_path):
    """Before, the row's directory was the tokenizer's path: absolute, it put the run on the
    file itself, which failed after the rows before it trained, blaming --run-dir."""
    root = str(tmp_path / "runs")
    spec = str(tmp_path / "tok" / "tokenizer.json")
    cfg = parse_config(tokenization.EXPERIMENT, ["--data", corpus_path, *TINY, "--run-dir",
                                                 root, "--tokenizers", f"bytes,{spec},bpe:300"])
    plan = tokenization.rows(cfg)
    for row in plan:
        assert os.path.dirname(os.path.join(root, row.dirname)) == root, row.dirname
    assert [row.dirname for row in plan][::2] == ["bytes", "bpe-300"]    # as before
    check_run_root(root, plan)


def test_remat_refuses_a_policy_whose_tags_the_model_lacks_before_measuring(
        capsys, no_work, plain_model):
    """Before, the attention row of a model that tags nothing measured full under the name
    attention (nothing kept), and said nothing."""
    args = ["--model", plain_model, "--seq-len", "16", "--batch-size", "2", "--no-scan-rows",
            "--timed-steps", "1"]
    line = refused(remat.main, [*args, "--policies", "none,attention"], capsys)
    assert "remat attention keeps the tensors tagged query, key, value" in line
    assert "it tags no tensor" in line and "leave attention out of --policies" in line
    assert line.endswith("[--policies / experiment.policies]")
    cfg = parse_config(remat.EXPERIMENT, [*args, "--policies", "none,full,dots"])
    remat.check(cfg, remat.rows(cfg))       # policies that keep no tags need none


@pytest.mark.parametrize("seq_len, keeps, flag, words", [
    ("16", "0.99", "--keeps", "keep 0.99 keeps all 16 tokens"),      # the row is keep 1's
    ("16", "0.1,0.3", "--keeps", "keeps 0.1 and 0.3 both keep 8 of 16"),
    ("8", "0.5", "--seq-len", "as every keep does")])
def test_token_drop_keeps_that_round_to_another_row_are_refused(
        corpus_path, tmp_path, capsys, no_work, seq_len, keeps, flag, words):
    args = ["--data", corpus_path, *TINY, "--n-layers", "4", "--run-dir", str(tmp_path),
            "--seq-len", seq_len, "--keeps", keeps]
    line = refused(token_drop.main, args, capsys)
    assert words in line and f"[{flag} /" in line


# ---------------------------------------------------------------------------------------------
# The sharding experiment's pipelined rows: their microbatches were blamed on --batch-size as
# "accumulate", a flag the experiment sets itself from --pipeline-microbatches.

def test_pipeline_microbatches_that_do_not_split_the_batch_name_their_flag(
        corpus_path, tmp_path, capsys, no_work):
    args = ["--data", corpus_path, *TINY, "--batch-size", "16", "--run-dir",
            str(tmp_path / "runs"), "--pipeline-microbatches", "3"]
    line = refused(sharding.main, args, capsys)
    assert "pipeline_microbatches=3" in line and "accumulate" not in line, line
    assert line.endswith("[--pipeline-microbatches / experiment.pipeline_microbatches]"), line


# ---------------------------------------------------------------------------------------------
# The embedding experiment's vocabularies: one past int32 was a traceback drawing its ids, and
# no table's size was checked.

@pytest.mark.parametrize("vocab,says", [("3000000000", "more than token ids of int32 can index"),
                                        ("2000000", "take more than half the memory here")])
def test_an_embedding_vocabulary_beyond_the_ids_or_memory_suggests_one_that_fits(
        capsys, no_work, small_host, vocab, says):
    line = refused(embedding.main, ["--vocabs", f"320,{vocab}", "--ids", "uniform"], capsys)
    assert says in line and line.endswith("[--vocabs / experiment.vocabs]"), line
    largest = int(re.search(r"sizes from 1 to ([\d,]+)", line).group(1).replace(",", ""))
    exp = parse_config(embedding.EXPERIMENT, ["--vocabs", str(largest)]).experiment
    embedding.check_vocabs([largest], exp)           # the suggestion is accepted
    with pytest.raises(ConfigError):
        embedding.check_vocabs([largest + 1], exp)
