"""Batching: token documents -> Batch dicts of numpy arrays (the contract in DESIGN.md).

A document of L tokens gives L - 1 (input, target) pairs. A batching strategy lays the pairs
of all documents out in rows of at most ``seq_len`` pairs (a ``RowPlan``); an epoch is a
shuffled order of those rows, cut into batches of ``batch_size`` rows; ``make_batch`` turns
the rows of one batch into arrays. Planning looks only at document lengths, so an epoch is
planned in full up front and any batch of it can be made without making the ones before it.
"""

from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import numpy as np

from jaxaccel.errors import ConfigError

BATCH_KEYS = ("inputs", "targets", "weights", "segment_ids", "positions")

Batch = dict[str, np.ndarray]


class RowPlan(NamedTuple):
    """Rows of an epoch, each a run of pieces of documents ("segments") laid side by side.

    Segment s is pairs ``start_S[s]`` .. ``start_S[s] + length_S[s] - 1`` of document
    ``doc_S[s]``; row r holds segments ``row_offsets_R1[r]`` .. ``row_offsets_R1[r + 1] - 1``.
    """

    doc_S: np.ndarray  # int64
    start_S: np.ndarray  # int64
    length_S: np.ndarray  # int64
    row_offsets_R1: np.ndarray  # int64 [R + 1]

    @property
    def num_rows(self) -> int:
        """Rows in an epoch."""
        return len(self.row_offsets_R1) - 1


def fixed_rows(pairs_D: np.ndarray, seq_len: int) -> RowPlan:
    """One document per row, cut into chunks of at most seq_len pairs, each chunk its own row.

    Long documents are split, never truncated; every pair appears in exactly one row.
    """
    chunks_D = -(-pairs_D // seq_len)
    doc_S = np.repeat(np.arange(len(pairs_D)), chunks_D)
    first_chunk_D = np.cumsum(chunks_D) - chunks_D
    start_S = (np.arange(len(doc_S)) - first_chunk_D[doc_S]) * seq_len
    length_S = np.minimum(seq_len, pairs_D[doc_S] - start_S)
    return RowPlan(doc_S, start_S, length_S, np.arange(len(doc_S) + 1))


# A strategy maps the pair counts of the documents and seq_len to the rows of an epoch.
STRATEGIES: dict[str, Callable[[np.ndarray, int], RowPlan]] = {"fixed": fixed_rows}


def plan_rows(documents: Sequence[np.ndarray], strategy: str, seq_len: int) -> RowPlan:
    """Lays out the (input, target) pairs of ``documents`` in rows with ``strategy``."""
    if strategy not in STRATEGIES:
        raise ConfigError(
            f"unknown batching strategy {strategy!r}; choose one of: {', '.join(STRATEGIES)}"
        )
    if len(documents) == 0:
        raise ConfigError("no documents to batch; pass a corpus with at least one document")
    pairs_D = np.maximum(np.array([len(doc) for doc in documents], dtype=np.int64) - 1, 0)
    if pairs_D.sum() == 0:
        raise ConfigError("the documents have no (input, target) pairs; each needs >= 2 tokens")
    return STRATEGIES[strategy](pairs_D, seq_len)


def epoch_order(num_rows: int, *, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The order of rows in an epoch: a pure function of (seed, epoch) when shuffling."""
    if not shuffle:
        return np.arange(num_rows)
    return np.random.default_rng([seed, epoch]).permutation(num_rows)


def make_batch(
    documents: Sequence[np.ndarray],
    plan: RowPlan,
    rows_B: np.ndarray,
    batch_size: int,
    seq_len: int,
) -> Batch:
    """The Batch holding ``rows_B`` of ``plan``, topped up with all-zero rows to batch_size."""
    inputs_BxT = np.zeros((batch_size, seq_len), dtype=np.int32)
    targets_BxT = np.zeros((batch_size, seq_len), dtype=np.int32)
    segment_ids_BxT = np.zeros((batch_size, seq_len), dtype=np.int32)
    positions_BxT = np.zeros((batch_size, seq_len), dtype=np.int32)
    arange_T = np.arange(seq_len, dtype=np.int32)
    offsets = plan.row_offsets_R1
    for b, row in enumerate(rows_B):
        col = 0
        for segment, s in enumerate(range(offsets[row], offsets[row + 1]), start=1):
            doc_L, start, n = documents[plan.doc_S[s]], plan.start_S[s], plan.length_S[s]
            inputs_BxT[b, col : col + n] = doc_L[start : start + n]
            targets_BxT[b, col : col + n] = doc_L[start + 1 : start + n + 1]
            segment_ids_BxT[b, col : col + n] = segment
            positions_BxT[b, col : col + n] = arange_T[:n]
            col += n
    return {
        "inputs": inputs_BxT,
        "targets": targets_BxT,
        "weights": (segment_ids_BxT > 0).astype(np.float32),
        "segment_ids": segment_ids_BxT,
        "positions": positions_BxT,
    }


def batches(
    documents: Sequence[np.ndarray],
    *,
    strategy: str = "fixed",
    seq_len: int,
    batch_size: int,
    seed: int = 0,
    epoch: int = 0,
    shuffle: bool = True,
    start: int = 0,
) -> Iterator[Batch]:
    """One epoch of Batches of shape [batch_size, seq_len], from batch index ``start`` on.

    The batches before ``start`` are skipped without being made. The last batch is filled up
    with all-zero rows (weights 0) so that every batch has the same shape. Settings are checked
    at the call, not at the first ``next``.
    """
    _check_sizes(seq_len=seq_len, batch_size=batch_size, seed=seed)
    if start < 0:
        raise ConfigError(f"start must be >= 0, got {start}; pass the index of the first batch")
    plan = plan_rows(documents, strategy, seq_len)
    order_R = epoch_order(plan.num_rows, seed=seed, epoch=epoch, shuffle=shuffle)
    return (
        make_batch(documents, plan, _batch_rows(order_R, i, batch_size), batch_size, seq_len)
        for i in range(start, _num_batches(plan, batch_size))
    )


class DataStream:
    """Endless training Batches over epochs 0, 1, 2, ..., each in its own shuffled order.

    ``position`` ({"epoch": e, "batch": i}, JSON-serialisable) names the next batch to be
    yielded; a stream built with ``position=`` that value yields exactly the batches the
    original stream would have yielded next, which makes checkpoint/resume bitwise exact.
    """

    def __init__(
        self,
        documents: Sequence[np.ndarray],
        *,
        strategy: str = "fixed",
        seq_len: int,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        position: dict | None = None,
    ):
        _check_sizes(seq_len=seq_len, batch_size=batch_size, seed=seed)
        self._documents = documents
        self._plan = plan_rows(documents, strategy, seq_len)
        self._seq_len, self._batch_size = seq_len, batch_size
        self._seed, self._shuffle = seed, shuffle
        self.batches_per_epoch = _num_batches(self._plan, batch_size)
        self.stats = _epoch_stats(self._plan, self.batches_per_epoch * batch_size * seq_len)
        if position is None:
            position = {"epoch": 0, "batch": 0}
        self._epoch, self._batch = self._parse_position(position)
        self._order_epoch, self._order_R = None, None

    @property
    def position(self) -> dict:
        """The next batch to be yielded, as {"epoch": e, "batch": i}."""
        return {"epoch": self._epoch, "batch": self._batch}

    def __iter__(self) -> "DataStream":
        return self

    def __next__(self) -> Batch:
        if self._order_epoch != self._epoch:
            self._order_R = epoch_order(
                self._plan.num_rows, seed=self._seed, epoch=self._epoch, shuffle=self._shuffle
            )
            self._order_epoch = self._epoch
        rows_B = _batch_rows(self._order_R, self._batch, self._batch_size)
        batch = make_batch(self._documents, self._plan, rows_B, self._batch_size, self._seq_len)
        self._batch += 1
        if self._batch == self.batches_per_epoch:
            self._epoch, self._batch = self._epoch + 1, 0
        return batch

    def _parse_position(self, position: dict) -> tuple[int, int]:
        """Checks that a saved position fits this stream's epochs."""
        epoch, batch = position.get("epoch"), position.get("batch")
        if not (
            isinstance(epoch, int)
            and isinstance(batch, int)
            and epoch >= 0
            and 0 <= batch < self.batches_per_epoch
        ):
            raise ConfigError(
                f"data position {position} does not fit an epoch of {self.batches_per_epoch} "
                "batches; resume with the data, seq_len and batch_size the position was saved with"
            )
        return epoch, batch


def batch_stats(batch: Batch) -> dict[str, int]:
    """Host-side token counts of a Batch: real (weighted) targets and padding positions."""
    return {
        "real_tokens": int(batch["weights"].sum(dtype=np.float64)),
        "padded_tokens": int(np.count_nonzero(batch["segment_ids"] == 0)),
    }


def _check_sizes(*, seq_len: int, batch_size: int, seed: int) -> None:
    """Rejects sizes that cannot make a batch, naming the setting to change."""
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}; pass a positive batch size")
    if seq_len < 1:
        raise ConfigError(f"seq_len must be >= 1, got {seq_len}; pass a positive sequence length")
    if seed < 0:
        raise ConfigError(f"seed must be >= 0, got {seed}; pass a non-negative seed")


def _num_batches(plan: RowPlan, batch_size: int) -> int:
    """Batches in an epoch, counting a last partial one."""
    return -(-plan.num_rows // batch_size)


def _batch_rows(order_R: np.ndarray, index: int, batch_size: int) -> np.ndarray:
    """The rows of batch ``index`` of an epoch in row order ``order_R``; fewer in a last batch."""
    return order_R[index * batch_size : (index + 1) * batch_size]


def _epoch_stats(plan: RowPlan, slots: int) -> dict:
    """How an epoch uses its batches: rows, split documents and the share of real tokens."""
    real_tokens = int(plan.length_S.sum())
    return {
        "rows_per_epoch": plan.num_rows,
        "split_documents": int(np.count_nonzero(np.bincount(plan.doc_S) > 1)),
        "real_tokens_per_epoch": real_tokens,
        "padding_efficiency": real_tokens / slots,
    }
