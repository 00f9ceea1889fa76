"""The four batching strategies: every pair once per epoch, known shapes, order, resume, several
processes, the bucket dynamic programme, best-fit packing, padding on the stdlib, bad input."""

import itertools
import json

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from conftest import CORPUS_CACHE_DIR

from jaxaccel.data import batching as data
from jaxaccel.data.corpus import load_corpus
from jaxaccel.data.batching import (BATCH_KEYS, DataStream, batches, best_fit_decreasing,
                                    bucket_lengths, fixed_rows)
from jaxaccel.core.errors import ConfigError

STRATEGY_NAMES = ("fixed", "dynamic", "bucket", "pack")
EACH_STRATEGY = pytest.mark.parametrize("strategy", STRATEGY_NAMES)
FUZZ = settings(max_examples=60, deadline=None)
DTYPES = {"inputs": np.int32, "targets": np.int32, "weights": np.float32,
          "segment_ids": np.int32, "positions": np.int32}


def make_documents(lengths):
    """Documents of these token counts whose tokens are all distinct: document d holds
    first_token[d], first_token[d] + 1, ..., so an input token names its pair."""
    first_token = np.cumsum([1, *lengths])
    return [np.arange(t, t + n, dtype=np.int32) for t, n in zip(first_token, lengths)]


@st.composite
def cases(draw, *, multiple=None):
    """Documents (empty, 1-token, 2-token, longer than seq_len, many) and batching settings.

    With ``multiple``, batch sizes are multiples of it (data_parallel=multiple), as needed to
    split each batch between that many processes.
    """
    lengths = draw(st.lists(st.one_of(st.integers(0, 3), st.integers(2, 60)), min_size=1,
                            max_size=50))
    assume(max(lengths) >= 2)
    seq_len = draw(st.sampled_from([4, 8, 16]))
    data_parallel = multiple or draw(st.sampled_from([1, 2]))
    settings_ = {
        "seq_len": seq_len, "seed": draw(st.integers(0, 3)), "data_parallel": data_parallel,
        "pad_multiple": draw(st.sampled_from([1, 3, 4, 64])),
        "num_buckets": draw(st.integers(1, 4)),
        "pack_window": draw(st.sampled_from([1, 3, 2048])),
    }
    if draw(st.booleans()):
        settings_["tokens_per_batch"] = seq_len * data_parallel * draw(st.integers(1, 5))
    else:
        settings_["batch_size"] = data_parallel * draw(st.integers(1, 3))
    return make_documents(lengths), settings_


def for_strategy(strategy, case_settings):
    """The settings with a batch size instead of a token budget for dynamic, which has none."""
    case_settings = dict(case_settings, strategy=strategy)
    if strategy == "dynamic" and "tokens_per_batch" in case_settings:
        case_settings["batch_size"] = case_settings.pop("tokens_per_batch") // (
            case_settings["seq_len"])
    return case_settings


def check_epoch(documents, batch_list, shapes, seq_len):
    """The Batch contract for every batch, and every pair of every document exactly once."""
    first_token = np.cumsum([1, *(len(doc) for doc in documents)])  # [N + 1]
    inputs = []
    for batch in batch_list:
        assert tuple(batch) == BATCH_KEYS
        assert all(batch[key].dtype == DTYPES[key] for key in BATCH_KEYS)
        assert len({batch[key].shape for key in BATCH_KEYS}) == 1
        assert batch["inputs"].shape in shapes
        x, y, segment, position = (batch[k] for k in ("inputs", "targets", "segment_ids",
                                                       "positions"))
        real = segment > 0
        np.testing.assert_array_equal(batch["weights"], real.astype(np.float32))
        # Real pairs fill each row from the left; the rest is all zero.
        np.testing.assert_array_equal(real, np.arange(x.shape[1]) < real.sum(1, keepdims=True))
        assert not any(np.any(batch[key][~real]) for key in BATCH_KEYS)
        # Segments are numbered 1, 2, ... and each starts where positions restart at 0.
        starts = real & (position == 0)
        np.testing.assert_array_equal(segment, np.cumsum(starts, axis=1) * real)
        inside = real[:, 1:] & ~starts[:, 1:]
        np.testing.assert_array_equal(position[:, 1:][inside], position[:, :-1][inside] + 1)
        np.testing.assert_array_equal(x[:, 1:][inside], x[:, :-1][inside] + 1)
        # A target is the next token of the input's own document; a piece starts at a
        # multiple of seq_len in its document, so positions are the pair index mod seq_len.
        doc = np.searchsorted(first_token, x[real], side="right") - 1
        np.testing.assert_array_equal(y[real], x[real] + 1)
        assert np.all(y[real] < first_token[doc + 1])
        np.testing.assert_array_equal(position[real], (x[real] - first_token[doc]) % seq_len)
        inputs.append(x[real])
    expected = np.concatenate([doc[:-1] for doc in documents])
    np.testing.assert_array_equal(np.sort(np.concatenate(inputs)), expected)


def assert_same_batches(got, expected):
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        for key in BATCH_KEYS:
            np.testing.assert_array_equal(a[key], b[key])


@EACH_STRATEGY
@FUZZ
@given(case=cases(), shuffle=st.booleans())
def test_every_pair_exactly_once_in_known_shapes(strategy, case, shuffle):
    documents, settings_ = case
    settings_ = for_strategy(strategy, settings_)
    stream = DataStream(documents, **settings_, shuffle=shuffle)
    batch_list = list(batches(documents, **settings_, shuffle=shuffle))
    check_epoch(documents, batch_list, stream.shapes, settings_["seq_len"])
    stats = stream.stats
    real = sum(len(doc) - 1 for doc in documents if len(doc) > 1)
    computed = sum(batch["inputs"].size for batch in batch_list)
    assert stats["batches_per_epoch"] == stream.batches_per_epoch == len(batch_list)
    assert stats["real_tokens_per_epoch"] == real
    assert stats["padding_efficiency"] == pytest.approx(real / computed)
    assert stats["real_tokens_per_batch"] == pytest.approx(real / len(batch_list))
    assert stats["rows_per_epoch"] == sum(int(b["weights"].any(1).sum()) for b in batch_list)
    assert stats["empty_documents_skipped"] == sum(len(doc) < 2 for doc in documents)
    assert stats["split_documents"] == sum(len(doc) - 1 > settings_["seq_len"] for doc in documents)


@EACH_STRATEGY
@FUZZ
@given(case=cases())
def test_same_seed_and_epoch_same_batches_and_start_skips(strategy, case):
    documents, settings_ = case
    settings_ = for_strategy(strategy, settings_)
    full = list(batches(documents, **settings_, epoch=1))
    assert_same_batches(list(batches(documents, **settings_, epoch=1)), full)
    for start in sorted({0, 1, len(full) // 2, len(full) - 1, len(full)}):
        assert_same_batches(list(batches(documents, **settings_, epoch=1, start=start)),
                            full[start:])


@EACH_STRATEGY
def test_start_makes_only_the_batches_it_yields(strategy, monkeypatch):
    documents = make_documents(np.random.default_rng(0).integers(2, 50, size=300))
    made = []
    original = data.make_batch
    monkeypatch.setattr(data, "make_batch", lambda *args: made.append(1) or original(*args))
    iterator = batches(documents, strategy=strategy, seq_len=16, batch_size=4, start=40)
    next(iterator)
    assert len(made) == 1


@EACH_STRATEGY
def test_epochs_and_seeds_give_other_orders_and_no_shuffle_is_fixed(strategy):
    documents = make_documents(np.random.default_rng(1).integers(0, 80, size=300))
    settings_ = {"strategy": strategy, "seq_len": 16, "batch_size": 4}

    def inputs(**kwargs):
        return np.concatenate([b["inputs"].ravel() for b in batches(documents, **settings_,
                                                                     **kwargs)])

    assert not np.array_equal(inputs(seed=1, epoch=0), inputs(seed=1, epoch=1))
    assert not np.array_equal(inputs(seed=1, epoch=0), inputs(seed=2, epoch=0))
    np.testing.assert_array_equal(inputs(shuffle=False, epoch=0), inputs(shuffle=False, epoch=3))
    # Without shuffling, the first row holds (the start of) the first non-empty document.
    first = next(doc for doc in documents if len(doc) > 1)
    assert inputs(shuffle=False)[0] == first[0]


@EACH_STRATEGY
@FUZZ
@given(case=cases(), data_=st.data())
def test_resumed_stream_yields_the_same_batches_across_epochs(strategy, case, data_):
    documents, settings_ = case
    settings_ = for_strategy(strategy, settings_)
    stream = DataStream(documents, **settings_)
    n = stream.batches_per_epoch
    list(itertools.islice(stream, data_.draw(st.integers(0, n - 1))))
    saved = json.loads(json.dumps(stream.position))
    uninterrupted = list(itertools.islice(stream, n + 2))
    resumed = DataStream(documents, **settings_, position=saved)
    assert_same_batches(list(itertools.islice(resumed, n + 2)), uninterrupted)
    assert resumed.position == stream.position
    # The stream's epochs are those of ``batches``.
    epoch_1 = list(batches(documents, **settings_, epoch=1))
    stream = DataStream(documents, **settings_, position={"epoch": 1, "batch": 0})
    assert_same_batches(list(itertools.islice(stream, len(epoch_1))), epoch_1)
    assert stream.position == {"epoch": 2, "batch": 0}


@EACH_STRATEGY
@FUZZ
@given(case=cases(multiple=6), process_count=st.sampled_from([2, 3]))
def test_processes_together_make_the_single_process_batches(strategy, case, process_count):
    documents, settings_ = case
    settings_ = for_strategy(strategy, settings_)
    single = list(batches(documents, **settings_))
    slices = []
    for p in range(process_count):
        local = dict(settings_, process_index=p, process_count=process_count)
        slices.append(list(batches(documents, **local)))
        shapes = DataStream(documents, **local).shapes
        assert all(batch["inputs"].shape in shapes for batch in slices[-1])
    for i, batch in enumerate(single):
        for key in BATCH_KEYS:
            np.testing.assert_array_equal(np.concatenate([s[i][key] for s in slices]), batch[key])
    assert all(len(s) == len(single) for s in slices)


@FUZZ
@given(case=cases())
def test_dynamic_pads_each_batch_to_its_longest_row(case):
    documents, settings_ = case
    settings_ = for_strategy("dynamic", settings_)
    seq_len, pad = settings_["seq_len"], settings_["pad_multiple"]
    shapes = DataStream(documents, **settings_).shapes
    assert len(shapes) <= -(-seq_len // pad)
    for batch in batches(documents, **settings_):
        longest = int(batch["weights"].sum(1).max())
        assert batch["inputs"].shape[1] == min(-(-longest // pad) * pad, seq_len)


def test_bucket_batches_hold_rows_of_one_bucket():
    documents = make_documents(np.random.default_rng(2).integers(0, 200, size=400))
    stream = DataStream(documents, strategy="bucket", seq_len=64, batch_size=8, num_buckets=4,
                        pad_multiple=8)
    lengths = stream.stats["bucket_lengths"]
    assert len(lengths) == 4 == len(stream.shapes)
    for batch in itertools.islice(stream, stream.batches_per_epoch):
        k = lengths.index(batch["inputs"].shape[1])
        row_len = batch["weights"].sum(1)
        row_len = row_len[row_len > 0]
        assert np.all(row_len <= lengths[k]) and np.all(row_len > ([0] + lengths)[k])


def _padding(row_len_W, lengths_U):
    """Positions of padding when each row goes to the smallest bucket that holds it."""
    lengths_U = np.asarray(lengths_U)
    bucket_W = np.searchsorted(lengths_U, row_len_W)
    assert np.all(bucket_W < len(lengths_U))
    return int((lengths_U[bucket_W] - row_len_W).sum())


@pytest.mark.parametrize("seq_len, pad_multiple", [(32, 4), (30, 4), (30, 1)])
def test_bucket_dp_matches_brute_force(seq_len, pad_multiple):
    histogram = {1: 5, 3: 7, 4: 2, 9: 20, 10: 1, 13: 4, 17: 3, 22: 9, 29: 6, 30: 1}
    row_len_W = np.repeat(list(histogram), list(histogram.values()))
    candidates = sorted({*range(pad_multiple, seq_len + 1, pad_multiple), seq_len})
    for k in range(1, 6):
        chosen = bucket_lengths(row_len_W, k, pad_multiple, seq_len)
        assert len(chosen) <= k and all(c in candidates for c in chosen)
        best = min(
            _padding(row_len_W, subset)
            for subset in itertools.combinations(candidates, k)
            if subset[-1] >= row_len_W.max()
        )
        assert _padding(row_len_W, chosen) == best


def test_bucket_dp_uses_at_most_the_lengths_there_are():
    assert bucket_lengths(np.array([3, 3, 40]), 8, 8, 64).tolist() == [8, 40]


@pytest.fixture(scope="module")
def stdlib_documents():
    return load_corpus("stdlib", cache_dir=CORPUS_CACHE_DIR).train


def test_bucket_dp_beats_powers_of_two_on_the_stdlib(stdlib_documents):
    pairs_N = np.array([len(doc) - 1 for doc in stdlib_documents])
    row_len_W = fixed_rows(pairs_N, 1024).length_Q
    chosen = bucket_lengths(row_len_W, 8, 64, 1024)
    assert _padding(row_len_W, chosen) < _padding(row_len_W, [2**i for i in range(3, 11)])


@FUZZ
@given(case=cases(), budget=st.integers(1, 8), data_parallel=st.sampled_from([1, 2, 4]))
def test_token_budget_batch_sizes(case, budget, data_parallel):
    documents, settings_ = case
    settings_.pop("batch_size", None)
    settings_ |= {"tokens_per_batch": settings_["seq_len"] * data_parallel * budget,
                  "data_parallel": data_parallel, "strategy": "bucket"}
    shapes = DataStream(documents, **settings_).shapes
    for b, t in shapes:
        assert b % data_parallel == 0 and b >= data_parallel
        assert b * t <= settings_["tokens_per_batch"]
    assert all(batch["inputs"].shape in shapes for batch in batches(documents, **settings_))


@pytest.mark.parametrize("seq_len", [4, 16])
def test_best_fit_decreasing_matches_a_plain_scan(seq_len):
    rng = np.random.default_rng(seq_len)
    length_P = rng.integers(1, seq_len + 1, size=500)
    rooms, expected = [], []
    for n in np.sort(length_P)[::-1]:
        fits = [r for r, room in enumerate(rooms) if room >= n]
        row = min(fits, key=lambda r: rooms[r]) if fits else len(rooms)
        rooms += [seq_len] * (row == len(rooms))
        rooms[row] -= n
        expected.append(row)
    row_P = best_fit_decreasing(length_P, seq_len)
    np.testing.assert_array_equal(row_P[np.argsort(-length_P, kind="stable")], expected)
    assert np.all(np.bincount(row_P, weights=length_P) <= seq_len)


@pytest.mark.parametrize(
    "strategy, batching, minimum",
    [
        ("pack", {"batch_size": 16}, 0.995),
        ("bucket", {"batch_size": 16}, 0.95),
        ("bucket", {"tokens_per_batch": 16384}, 0.95),
    ],
)
def test_padding_efficiency_on_the_stdlib(stdlib_documents, strategy, batching, minimum):
    stream = DataStream(stdlib_documents, strategy=strategy, seq_len=1024, **batching)
    assert stream.stats["padding_efficiency"] >= minimum
    assert len(stream.shapes) == (1 if strategy == "pack" else 8)


@pytest.mark.parametrize(
    "settings_, message",
    [
        ({"strategy": "bucket", "batch_size": None, "tokens_per_batch": 15},
         "tokens_per_batch=15 is smaller than the longest bucket row"),
        ({"strategy": "bucket", "num_buckets": 0}, "num_buckets must be >= 1"),
        ({"strategy": "dynamic", "pad_multiple": 0}, "pad_multiple must be >= 1"),
        ({"strategy": "pack", "pack_window": 0}, "pack_window must be >= 1"),
        ({"tokens_per_batch": 64}, "exactly one of batch_size and tokens_per_batch, got both"),
        ({"batch_size": None}, "exactly one of batch_size and tokens_per_batch, got neither"),
        ({"bucket_count": 4}, "unknown batching option 'bucket_count'"),
        ({"strategy": "sorted"}, "unknown batching strategy 'sorted'"),
        ({"strategy": "dynamic", "batch_size": None, "tokens_per_batch": 64},
         "takes batch_size, not tokens_per_batch"),
        ({"strategy": "pack", "batch_size": None, "tokens_per_batch": 15},
         "raise tokens_per_batch to at least 16"),
        ({"batch_size": 6, "data_parallel": 4}, "not a multiple of data_parallel=4"),
        ({"batch_size": 3, "process_count": 2}, "not a multiple of process_count=2"),
        ({"process_index": 2, "process_count": 2}, "process_index=2 is not in"),
    ],
)
def test_bad_settings_are_config_errors(settings_, message):
    documents = make_documents([17, 5, 1, 40])
    settings_ = {"seq_len": 16, "batch_size": 4} | settings_
    with pytest.raises(ConfigError, match=message):
        batches(documents, **settings_)
    with pytest.raises(ConfigError, match=message):
        DataStream(documents, **settings_)


@pytest.mark.parametrize(
    "settings_, field",
    [
        ({"seq_len": 0}, "data.seq_len"),
        ({"strategy": "bucket", "num_buckets": 0}, "data.buckets"),
        ({"strategy": "dynamic", "pad_multiple": 0}, "data.pad_multiple"),
        ({"strategy": "pack", "pack_window": 0}, "data.pack_window"),
        ({"strategy": "bucket", "batch_size": None, "tokens_per_batch": 15},
         "data.tokens_per_batch"),
        ({"strategy": "dynamic", "batch_size": None, "tokens_per_batch": 64},
         "data.tokens_per_batch"),
        ({"batch_size": 6, "data_parallel": 4}, "data.batch_size"),
        ({"strategy": "sorted"}, "data.batching"),
        ({"seed": -1}, "run.seed"),
        ({"data_parallel": 0}, None),
    ],
)
def test_config_errors_name_the_config_field_and_no_flag(settings_, field):
    settings_ = {"seq_len": 16, "batch_size": 4} | settings_
    with pytest.raises(ConfigError) as info:
        batches(make_documents([17, 5, 1, 40]), **settings_)
    assert info.value.field == field
    assert "--" not in str(info.value)


@EACH_STRATEGY
def test_all_empty_documents_are_a_config_error(strategy):
    with pytest.raises(ConfigError, match="no \\(input, target\\) pairs"):
        DataStream(make_documents([1, 0, 1]), strategy=strategy, seq_len=8, batch_size=2)
