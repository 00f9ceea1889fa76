"""Fixed batching: the Batch contract, coverage of every pair, order, skipping and resuming."""

import collections
import itertools
import json

import numpy as np
import pytest

from jaxaccel.data.batching import BATCH_KEYS, DataStream, batch_stats, batches
from jaxaccel.core.errors import ConfigError

SEQ_LEN, BATCH_SIZE = 16, 4


@pytest.fixture
def documents():
    """Documents whose tokens are unique (1000 * doc + position), so a pair names its source."""
    rng = np.random.default_rng(0)
    # The last ones hold seq_len - 1, seq_len, seq_len + 1 and 3 * seq_len + 1 pairs.
    lengths = [*rng.integers(2, 60, size=40), SEQ_LEN, SEQ_LEN + 1, SEQ_LEN + 2, 3 * SEQ_LEN + 2]
    return [np.arange(length, dtype=np.int32) + 1000 * d for d, length in enumerate(lengths)]


def _all_pairs(documents):
    return collections.Counter(
        (int(x), int(y)) for doc in documents for x, y in zip(doc[:-1], doc[1:])
    )


def _batched_pairs(batch_list):
    pairs = collections.Counter()
    for batch in batch_list:
        real = batch["weights"] == 1
        pairs.update(zip(batch["inputs"][real].tolist(), batch["targets"][real].tolist()))
    return pairs


def _assert_same_batches(got, expected):
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        for key in BATCH_KEYS:
            np.testing.assert_array_equal(a[key], b[key])


def test_batch_keys_dtypes_and_shapes(documents):
    dtypes = {"inputs": np.int32, "targets": np.int32, "weights": np.float32}
    dtypes |= {"segment_ids": np.int32, "positions": np.int32}
    for batch in batches(documents, seq_len=SEQ_LEN, batch_size=BATCH_SIZE):
        assert tuple(batch) == BATCH_KEYS
        for key in BATCH_KEYS:
            assert batch[key].dtype == dtypes[key]
            assert batch[key].shape == (BATCH_SIZE, SEQ_LEN)


def test_every_pair_appears_exactly_once_per_epoch(documents):
    batch_list = list(batches(documents, seq_len=SEQ_LEN, batch_size=BATCH_SIZE, seed=3))
    assert _batched_pairs(batch_list) == _all_pairs(documents)


def test_rows_are_chunks_with_their_own_positions(documents):
    chunks_per_doc = collections.Counter()
    for batch in batches(documents, seq_len=SEQ_LEN, batch_size=BATCH_SIZE):
        for row in range(BATCH_SIZE):
            real = batch["segment_ids"][row] == 1
            n = int(real.sum())
            assert np.all(real[:n]) and not np.any(batch["segment_ids"][row, n:])
            if n == 0:
                continue
            pair_index = batch["inputs"][row, :n] % 1000
            np.testing.assert_array_equal(batch["positions"][row, :n], pair_index % SEQ_LEN)
            np.testing.assert_array_equal(batch["weights"][row], real.astype(np.float32))
            assert not np.any(batch["positions"][row, n:]) and not np.any(batch["inputs"][row, n:])
            chunks_per_doc[int(batch["inputs"][row, 0]) // 1000] += 1
    for d, doc in enumerate(documents):
        assert chunks_per_doc[d] == -(-(len(doc) - 1) // SEQ_LEN)
    assert chunks_per_doc[len(documents) - 1] == 4


def test_order_is_a_function_of_seed_and_epoch(documents):
    def first_inputs(**kwargs):
        batch_list = batches(documents, seq_len=SEQ_LEN, batch_size=2, **kwargs)
        return np.stack([batch["inputs"] for batch in batch_list])

    np.testing.assert_array_equal(first_inputs(seed=1, epoch=0), first_inputs(seed=1, epoch=0))
    assert not np.array_equal(first_inputs(seed=1, epoch=0), first_inputs(seed=1, epoch=1))
    assert not np.array_equal(first_inputs(seed=1, epoch=0), first_inputs(seed=2, epoch=0))
    unshuffled = first_inputs(shuffle=False)
    np.testing.assert_array_equal(unshuffled[0, 0, :3], documents[0][:3])


def test_start_skips_batches(documents):
    settings = {"seq_len": SEQ_LEN, "batch_size": BATCH_SIZE, "seed": 5, "epoch": 2}
    full = list(batches(documents, **settings))
    for start in (0, 1, 7, len(full) - 1, len(full)):
        _assert_same_batches(list(batches(documents, **settings, start=start)), full[start:])


def test_spread_makes_only_the_chosen_batches(documents, monkeypatch):
    """``spread=N`` gives N of the epoch's batches, the first and the last among them, evenly
    spaced, identical to those of the whole epoch; it makes no other batch."""
    from jaxaccel.data import batching as data
    settings = {"seq_len": SEQ_LEN, "batch_size": BATCH_SIZE, "shuffle": False}
    full = list(batches(documents, **settings))
    made = []
    local_batch = data._local_batch
    monkeypatch.setattr(data, "_local_batch", lambda *a: made.append(a[2]) or local_batch(*a))
    last = len(full) - 1
    for spread, chosen in ((1, [0]), (2, [0, last]), (3, [0, round(last / 2), last]),
                           (len(full) + 5, list(range(len(full))))):
        made.clear()
        _assert_same_batches(list(batches(documents, **settings, spread=spread)),
                             [full[i] for i in chosen])
        assert made == chosen
    assert list(batches(documents, **settings, start=len(full), spread=3)) == []


def test_partial_last_batch_is_filled_with_zero_rows(documents):
    batch_list = list(batches(documents, seq_len=SEQ_LEN, batch_size=BATCH_SIZE))
    rows = DataStream(documents, seq_len=SEQ_LEN, batch_size=BATCH_SIZE).stats["rows_per_epoch"]
    assert rows % BATCH_SIZE != 0 and len(batch_list) == -(-rows // BATCH_SIZE)
    last = batch_list[-1]
    fill = slice(rows % BATCH_SIZE, BATCH_SIZE)
    for key in BATCH_KEYS:
        assert not np.any(last[key][fill])
    assert np.all(last["weights"][: rows % BATCH_SIZE].sum(axis=1) > 0)


def test_stream_epochs_match_batches(documents):
    stream = DataStream(documents, seq_len=SEQ_LEN, batch_size=BATCH_SIZE, seed=7)
    n = stream.batches_per_epoch
    got = list(itertools.islice(stream, 2 * n))
    for epoch in (0, 1):
        expected = batches(documents, seq_len=SEQ_LEN, batch_size=BATCH_SIZE, seed=7, epoch=epoch)
        expected = list(expected)
        _assert_same_batches(got[epoch * n : (epoch + 1) * n], expected)
    assert stream.position == {"epoch": 2, "batch": 0}


def test_resumed_stream_yields_identical_batches(documents):
    settings = {"seq_len": SEQ_LEN, "batch_size": BATCH_SIZE, "seed": 11}
    stream = DataStream(documents, **settings)
    n = stream.batches_per_epoch
    list(itertools.islice(stream, n - 2))
    saved = json.dumps(stream.position)
    assert json.loads(saved) == {"epoch": 0, "batch": n - 2}
    uninterrupted = list(itertools.islice(stream, 5))
    resumed = DataStream(documents, **settings, position=json.loads(saved))
    _assert_same_batches(list(itertools.islice(resumed, 5)), uninterrupted)
    assert resumed.position == stream.position == {"epoch": 1, "batch": 3}


def test_stream_stats(documents):
    stream = DataStream(documents, seq_len=SEQ_LEN, batch_size=BATCH_SIZE)
    pairs = sum(len(doc) - 1 for doc in documents)
    rows = sum(-(-(len(doc) - 1) // SEQ_LEN) for doc in documents)
    assert stream.stats["rows_per_epoch"] == rows
    assert stream.batches_per_epoch == -(-rows // BATCH_SIZE)
    assert stream.stats["split_documents"] == sum(len(doc) - 1 > SEQ_LEN for doc in documents)
    slots = stream.batches_per_epoch * BATCH_SIZE * SEQ_LEN
    assert stream.stats["padding_efficiency"] == pytest.approx(pairs / slots)


def test_batch_stats_count_real_and_padded_tokens(documents):
    batch_list = list(batches(documents, seq_len=SEQ_LEN, batch_size=BATCH_SIZE))
    counts = [batch_stats(batch) for batch in batch_list]
    assert all(type(v) is int for c in counts for v in c.values())
    assert all(c["real_tokens"] + c["padded_tokens"] == BATCH_SIZE * SEQ_LEN for c in counts)
    assert sum(c["real_tokens"] for c in counts) == sum(len(doc) - 1 for doc in documents)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"batch_size": 0}, "batch_size must be >= 1"),
        ({"seq_len": 0}, "seq_len must be >= 1"),
        ({"strategy": "magic"}, "unknown batching strategy 'magic'"),
        ({"seed": -1}, "seed must be >= 0"),
        ({"strategy": "bucket", "num_buckets": 10**9}, "exceeds seq_len"),
    ],
)
def test_bad_settings_are_config_errors(documents, kwargs, message):
    settings = {"seq_len": SEQ_LEN, "batch_size": BATCH_SIZE} | kwargs
    with pytest.raises(ConfigError, match=message):
        batches(documents, **settings)
    with pytest.raises(ConfigError, match=message):
        DataStream(documents, **settings)


def test_no_documents_is_a_config_error():
    with pytest.raises(ConfigError, match="no documents"):
        batches([], seq_len=SEQ_LEN, batch_size=BATCH_SIZE)
    with pytest.raises(ConfigError, match="no \\(input, target\\) pairs"):
        DataStream([np.array([1], dtype=np.int32)], seq_len=SEQ_LEN, batch_size=BATCH_SIZE)


@pytest.mark.parametrize("position", [{"epoch": 0, "batch": 10_000}, {"epoch": -1, "batch": 0}, {}])
def test_bad_position_is_a_config_error(documents, position):
    with pytest.raises(ConfigError, match="does not fit an epoch"):
        DataStream(documents, seq_len=SEQ_LEN, batch_size=BATCH_SIZE, position=position)
