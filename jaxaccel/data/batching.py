"""Batching: token documents -> Batch dicts of numpy arrays (the contract in DESIGN.md).

A document of n tokens gives n - 1 (input, target) pairs. A strategy lays them out in rows of at
most ``seq_len`` pairs (a ``RowPlan``) and groups an epoch's rows into batches of shape [B, T]
(an ``EpochPlan``): ``fixed`` (a chunk of one document per row, padded to seq_len), ``dynamic``
(each batch padded to its longest row), ``bucket`` (batches of rows of one of ``num_buckets``
lengths chosen to minimise padding) or ``pack`` (pieces of documents side by side in each row).
Plans use only document lengths, so every shape (a jit compile each) is known before the first
batch (``DataStream.shapes``) and any batch is made alone, each process making its slice.
Documents of < 2 tokens are skipped and counted."""

import bisect
import math
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np

from jaxaccel.core.errors import ConfigError

BATCH_KEYS = ("inputs", "targets", "weights", "segment_ids", "positions")
BATCH_DTYPES = {"inputs": np.int32, "targets": np.int32, "weights": np.float32,
                "segment_ids": np.int32, "positions": np.int32}

# Options and defaults. Best-fit's cost grows with the open rows, so packing goes by windows of
# pieces; on the stdlib at seq_len 1024 windows of 2048 pack an epoch into 30,563 rows (the whole
# epoch at once: 30,557; bound 30,555; windows of 64: 30,718).
OPTIONS = {"pad_multiple": 64, "num_buckets": 8, "pack_window": 2048, "data_parallel": 1}

Batch = dict[str, np.ndarray]

# The config field of each checked setting, for errors (data_parallel comes from the mesh).
_FIELDS = {"seq_len": "data.seq_len", "pad_multiple": "data.pad_multiple",
           "num_buckets": "data.buckets", "pack_window": "data.pack_window"}


class RowPlan(NamedTuple):
    """The W rows of an epoch, each a run of Q pieces of documents ("segments") side by side:
    segment q is pairs ``start_Q[q]`` .. ``start_Q[q] + length_Q[q] - 1`` of document
    ``doc_Q[q]``; row w holds segments ``row_offsets[w]`` .. ``row_offsets[w + 1] - 1``."""

    doc_Q: np.ndarray  # int64
    start_Q: np.ndarray  # int64
    length_Q: np.ndarray  # int64
    row_offsets: np.ndarray  # int64 [W + 1]

    @property
    def num_rows(self) -> int:
        return len(self.row_offsets) - 1

    def row_lengths(self) -> np.ndarray:
        """Pairs in each row, int64 [W]."""
        pairs_before = np.concatenate([[0], np.cumsum(self.length_Q)])  # [Q + 1]
        return pairs_before[self.row_offsets[1:]] - pairs_before[self.row_offsets[:-1]]


class EpochPlan(NamedTuple):
    """The Z global batches of an epoch, in the order they are yielded: batch z holds rows
    ``order_W[batch_offsets[z] : batch_offsets[z + 1]]`` of ``rows`` in an array of shape
    [batch_size_Z[z], length_Z[z]]; the rows after those are all zero."""

    rows: RowPlan
    order_W: np.ndarray  # int64, the rows in the order the batches yield them
    batch_offsets: np.ndarray  # int64 [Z + 1]
    batch_size_Z: np.ndarray  # int64
    length_Z: np.ndarray  # int64

    @property
    def num_batches(self) -> int:
        return len(self.batch_offsets) - 1


class Sizes(NamedTuple):
    """Checked batching settings; every global batch size is a multiple of ``multiple``."""

    seq_len: int
    batch_size: int | None  # None: a token budget per bucket
    tokens_per_batch: int | None
    pad_multiple: int
    num_buckets: int
    pack_window: int
    multiple: int


def fixed_rows(pairs_N: np.ndarray, seq_len: int) -> RowPlan:
    """One row per chunk of at most seq_len pairs of each document (split, never truncated)."""
    chunks_N = -(-pairs_N // seq_len)
    doc_Q = np.repeat(np.arange(len(pairs_N)), chunks_N)
    first_chunk_N = np.cumsum(chunks_N) - chunks_N
    start_Q = (np.arange(len(doc_Q)) - first_chunk_N[doc_Q]) * seq_len
    length_Q = np.minimum(seq_len, pairs_N[doc_Q] - start_Q)
    return RowPlan(doc_Q, start_Q, length_Q, np.arange(len(doc_Q) + 1))


def bucket_lengths(row_len_W: np.ndarray, num_buckets: int, pad_multiple: int,
                   seq_len: int) -> np.ndarray:
    """At most num_buckets row lengths minimising padding when each row is padded to the
    smallest that holds it: a dynamic programme, O(num_buckets * C^2), over the C lengths some
    row rounds up to (only those can be optimal). After k rounds ``slots_C[j]`` is the fewest
    positions that at most k buckets, the largest at candidate j, give all rows up to j."""
    rounded_W = np.minimum(-(-row_len_W // pad_multiple) * pad_multiple, seq_len)
    length_C, count_C = np.unique(rounded_W, return_counts=True)
    rows_up_to_C = np.cumsum(count_C)
    slots_C = length_C * rows_up_to_C
    previous_by_round = []  # per round, the bucket below each candidate j; j if none was added
    for _ in range(num_buckets - 1):
        previous_C, next_slots_C = np.arange(len(length_C)), slots_C.copy()
        for j in range(1, len(length_C)):
            # The bucket at j takes the rows above bucket i, for each candidate i < j.
            slots_via_C = slots_C[:j] + length_C[j] * (rows_up_to_C[j] - rows_up_to_C[:j])
            i = int(np.argmin(slots_via_C))
            if slots_via_C[i] < next_slots_C[j]:
                previous_C[j], next_slots_C[j] = i, slots_via_C[i]
        previous_by_round.append(previous_C)
        slots_C = next_slots_C
    chosen = [len(length_C) - 1]
    for previous_C in reversed(previous_by_round):
        if previous_C[chosen[-1]] != chosen[-1]:
            chosen.append(int(previous_C[chosen[-1]]))
    return length_C[chosen[::-1]]


def best_fit_decreasing(length_P: np.ndarray, capacity: int) -> np.ndarray:
    """Row of each piece when pieces go, longest first, into the open row with the least room
    that fits them (else a new row, numbered in order). Needs at most 11/9 of the optimal rows,
    with many short pieces nearly always the optimum. Open rows are kept sorted by room."""
    order_P = np.argsort(-length_P, kind="stable")
    row_P = np.empty(len(length_P), dtype=np.int64)
    open_rows = []  # (room left, row), sorted; rows with no room left are dropped
    num_rows = 0
    for p, n in zip(order_P.tolist(), length_P[order_P].tolist()):
        i = bisect.bisect_left(open_rows, (n, -1))
        if i < len(open_rows):
            room, row = open_rows.pop(i)
        else:
            room, row, num_rows = capacity, num_rows, num_rows + 1
        row_P[p] = row
        if room > n:
            bisect.insort(open_rows, (room - n, row))
    return row_P


def cut_batches(rows: RowPlan, order_W: np.ndarray, batch_size: int, length: int) -> EpochPlan:
    """Rows ``order_W`` cut into batches of batch_size rows of ``length``, the last maybe short."""
    offsets = np.append(np.arange(0, len(order_W), batch_size), len(order_W))
    num_batches = len(offsets) - 1
    return EpochPlan(rows, order_W, offsets, np.full(num_batches, batch_size),
                     np.full(num_batches, length))


class Fixed:
    """Each chunk of at most seq_len pairs of one document is a row padded to seq_len."""

    def __init__(self, pairs_N: np.ndarray, sizes: Sizes):
        self.sizes = sizes
        self.rows = fixed_rows(pairs_N, sizes.seq_len)

    def shapes(self) -> list[tuple[int, int]]:
        return [(self.sizes.batch_size, self.sizes.seq_len)]

    def plan(self, rng: np.random.Generator | None) -> EpochPlan:
        """The batches of an epoch; rows in a random order, or in document order without rng."""
        order_W = (np.arange(self.rows.num_rows) if rng is None
                   else rng.permutation(self.rows.num_rows))
        return cut_batches(self.rows, order_W, self.sizes.batch_size, self.sizes.seq_len)

    def stats(self) -> dict:
        """Settings the strategy chose from the data, for ``DataStream.stats``."""
        return {}


class Dynamic(Fixed):
    """``dynamic`` (module docstring): at most ceil(seq_len / pad_multiple) shapes."""

    def shapes(self) -> list[tuple[int, int]]:
        """Rounded lengths from the least a batch's longest row can be to the longest row."""
        sizes, num_rows = self.sizes, self.rows.num_rows
        fewest_rows = num_rows - (-(-num_rows // sizes.batch_size) - 1) * sizes.batch_size
        row_len_W = np.sort(self.rows.row_lengths())
        lowest, highest = -(-row_len_W[[fewest_rows - 1, -1]] // sizes.pad_multiple)
        lengths = {min(m * sizes.pad_multiple, sizes.seq_len) for m in range(lowest, highest + 1)}
        return [(sizes.batch_size, length) for length in sorted(lengths)]

    def plan(self, rng: np.random.Generator | None) -> EpochPlan:
        """The batches of fixed, each as long as its longest row needs."""
        plan = super().plan(rng)
        row_len_W = self.rows.row_lengths()[plan.order_W]
        longest_Z = np.maximum.reduceat(row_len_W, plan.batch_offsets[:-1])
        pad = self.sizes.pad_multiple
        return plan._replace(length_Z=np.minimum(-(-longest_Z // pad) * pad, self.sizes.seq_len))


class Bucket(Fixed):
    """``bucket``: each batch rows of one bucket u, [B_u, T_u]; with a token budget B_u is
    tokens_per_batch // T_u rounded down to the batch multiple."""

    def __init__(self, pairs_N: np.ndarray, sizes: Sizes):
        super().__init__(pairs_N, sizes)
        row_len_W = self.rows.row_lengths()
        self.length_U = bucket_lengths(row_len_W, sizes.num_buckets, sizes.pad_multiple,
                                       sizes.seq_len)
        self.bucket_W = np.searchsorted(self.length_U, row_len_W)
        if sizes.batch_size is not None:
            self.batch_size_U = np.full(len(self.length_U), sizes.batch_size)
            return
        tokens, multiple, longest = sizes.tokens_per_batch, sizes.multiple, int(self.length_U[-1])
        if tokens < longest * multiple:
            raise ConfigError(
                f"tokens_per_batch={tokens} is smaller than the longest bucket row ({longest} "
                f"tokens) times the batch multiple {multiple} (data_parallel and process_count); "
                f"raise tokens_per_batch to at least {longest * multiple}",
                field="data.tokens_per_batch")
        self.batch_size_U = tokens // self.length_U // multiple * multiple

    def shapes(self) -> list[tuple[int, int]]:
        return sorted(zip(self.batch_size_U.tolist(), self.length_U.tolist()))

    def plan(self, rng: np.random.Generator | None) -> EpochPlan:
        """Rows shuffled within their bucket, cut into batches, batches of all buckets shuffled;
        without rng, rows keep document order and batches go by their first row."""
        by_bucket_W = (np.arange(self.rows.num_rows) if rng is None
                       else rng.permutation(self.rows.num_rows))
        by_bucket_W = by_bucket_W[np.argsort(self.bucket_W[by_bucket_W], kind="stable")]
        rows_U = np.bincount(self.bucket_W, minlength=len(self.length_U))
        batches_U = -(-rows_U // self.batch_size_U)
        bucket_Z = np.repeat(np.arange(len(rows_U)), batches_U)
        index_Z = np.arange(len(bucket_Z)) - np.repeat(np.cumsum(batches_U) - batches_U, batches_U)
        bucket_end_U = np.cumsum(rows_U)
        first_Z = bucket_end_U[bucket_Z] - rows_U[bucket_Z] + index_Z * self.batch_size_U[bucket_Z]
        count_Z = np.minimum(self.batch_size_U[bucket_Z], bucket_end_U[bucket_Z] - first_Z)
        batch_order_Z = (np.argsort(by_bucket_W[first_Z], kind="stable") if rng is None
                         else rng.permutation(len(bucket_Z)))
        first_Z, count_Z = first_Z[batch_order_Z], count_Z[batch_order_Z]
        bucket_Z = bucket_Z[batch_order_Z]
        offsets = np.concatenate([[0], np.cumsum(count_Z)])
        order_W = by_bucket_W[np.repeat(first_Z - offsets[:-1], count_Z) + np.arange(offsets[-1])]
        return EpochPlan(self.rows, order_W, offsets, self.batch_size_U[bucket_Z],
                         self.length_U[bucket_Z])

    def stats(self) -> dict:
        return {"bucket_lengths": self.length_U.tolist()}


class Pack(Fixed):
    """``pack``: full rows of seq_len pairs of long documents; each epoch shuffles the other
    pieces and packs each window of pack_window of them by best-fit decreasing."""

    def __init__(self, pairs_N: np.ndarray, sizes: Sizes):
        self.sizes = sizes
        self.full_rows = fixed_rows(pairs_N // sizes.seq_len * sizes.seq_len, sizes.seq_len)
        length_N = pairs_N % sizes.seq_len
        self.doc_P = np.flatnonzero(length_N)
        self.start_P = (pairs_N - length_N)[self.doc_P]
        self.length_P = length_N[self.doc_P]

    def plan(self, rng: np.random.Generator | None) -> EpochPlan:
        """Packs the pool afresh and orders all rows at random (or by their first document)."""
        pool_P = np.arange(len(self.doc_P)) if rng is None else rng.permutation(len(self.doc_P))
        row_P = np.empty(len(pool_P), dtype=np.int64)  # the packed row of piece pool_P[p]
        num_packed = 0
        for begin in range(0, len(pool_P), self.sizes.pack_window):
            window = slice(begin, begin + self.sizes.pack_window)
            row_P[window] = num_packed + best_fit_decreasing(self.length_P[pool_P[window]],
                                                             self.sizes.seq_len)
            num_packed = int(row_P[window].max()) + 1
        # Segments grouped by row, longest first in a row (the order best-fit placed them).
        piece_Q = pool_P[np.lexsort((-self.length_P[pool_P], row_P))]
        packed_ends_W = np.cumsum(np.bincount(row_P, minlength=num_packed))
        rows = RowPlan(
            np.concatenate([self.full_rows.doc_Q, self.doc_P[piece_Q]]),
            np.concatenate([self.full_rows.start_Q, self.start_P[piece_Q]]),
            np.concatenate([self.full_rows.length_Q, self.length_P[piece_Q]]),
            np.concatenate([self.full_rows.row_offsets, self.full_rows.num_rows + packed_ends_W]))
        order_W = (np.argsort(np.minimum.reduceat(rows.doc_Q, rows.row_offsets[:-1]),
                              kind="stable") if rng is None else rng.permutation(rows.num_rows))
        return cut_batches(rows, order_W, self.sizes.batch_size, self.sizes.seq_len)


STRATEGIES = {"fixed": Fixed, "dynamic": Dynamic, "bucket": Bucket, "pack": Pack}


def make_batch(documents: Sequence[np.ndarray], plan: RowPlan, rows_B: np.ndarray,
               batch_size: int, seq_len: int) -> Batch:
    """The Batch holding ``rows_B`` of ``plan``, topped up with all-zero rows to batch_size,
    segments side by side from column 0: one slice per segment, then numpy gathers/scatters."""
    # The batch's Q segments, row by row; row b holds segments first_B[b] ..
    first_in_plan_B = plan.row_offsets[rows_B]
    segments_B = plan.row_offsets[rows_B + 1] - first_in_plan_B
    first_B = np.cumsum(segments_B) - segments_B
    in_plan_Q = np.repeat(first_in_plan_B - first_B, segments_B) + np.arange(segments_B.sum())
    doc_Q, start_Q, length_Q = (plan.doc_Q[in_plan_Q], plan.start_Q[in_plan_Q],
                                plan.length_Q[in_plan_Q])
    segment_id_Q = np.arange(len(in_plan_Q)) - np.repeat(first_B, segments_B) + 1
    # Segment q contributes its n + 1 tokens, so the input of its pair a (counting the pairs
    # of all segments in order) is token a + q, and the target the one after.
    tokens = np.concatenate([documents[d][s : s + n + 1] for d, s, n in zip(
        doc_Q.tolist(), start_Q.tolist(), length_Q.tolist())] or [np.zeros(0)])
    pairs_before = np.concatenate([[0], np.cumsum(length_Q)])  # [Q + 1]
    row_begin_B = pairs_before[first_B]
    row_len_B = pairs_before[first_B + segments_B] - row_begin_B
    segment_A = np.repeat(np.arange(len(in_plan_Q)), length_Q)
    pair_A = np.arange(len(segment_A))
    # Where pair a lands in the flattened [batch_size * seq_len] array.
    slot_A = pair_A + np.repeat(np.arange(len(rows_B)) * seq_len - row_begin_B, row_len_B)

    def scatter(values_A: np.ndarray) -> np.ndarray:
        array_BT = np.zeros((batch_size, seq_len), dtype=np.int32)
        array_BT.ravel()[slot_A] = values_A
        return array_BT

    segment_ids_BT = scatter(segment_id_Q[segment_A])
    return {
        "inputs": scatter(tokens[pair_A + segment_A]),
        "targets": scatter(tokens[pair_A + segment_A + 1]),
        "weights": (segment_ids_BT > 0).astype(np.float32),
        "segment_ids": segment_ids_BT,
        "positions": scatter(pair_A - pairs_before[segment_A]),
    }


def batches(documents: Sequence[np.ndarray], *, strategy: str = "fixed", seq_len: int,
            batch_size: int | None = None, tokens_per_batch: int | None = None, seed: int = 0,
            epoch: int = 0, shuffle: bool = True, start: int = 0, spread: int | None = None,
            process_index: int = 0, process_count: int = 1, **options) -> Iterator[Batch]:
    """One epoch of Batches from batch index ``start`` on, this process's rows of each; a
    partial batch is topped up with all-zero rows. ``spread=N``: only N of them, spread evenly
    over the epoch from ``start`` (its last batch included); only those are made. Settings are
    checked at the call, not at the first ``next``. ``options``: pad_multiple, num_buckets,
    pack_window, data_parallel."""
    if start < 0:
        raise ConfigError(f"start must be >= 0, got {start}; pass the index of the first batch")
    batcher, _ = _make_strategy(documents, strategy, seq_len, batch_size, tokens_per_batch, seed,
                                process_index, process_count, options)
    plan = batcher.plan(_epoch_rng(seed, epoch, shuffle))
    chosen = range(start, plan.num_batches)
    if spread is not None and len(chosen) > 0:
        chosen = sorted(set(np.linspace(chosen[0], chosen[-1], min(spread, len(chosen)))
                            .round().astype(int).tolist()))
    return (_local_batch(documents, plan, i, process_index, process_count) for i in chosen)


class DataStream:
    """Endless training Batches over epochs 0, 1, 2, ..., each in its own shuffled order.
    ``position`` ({"epoch": e, "batch": i}) names the next batch; a stream built with
    ``position=`` that value yields exactly what the original would have yielded next, so a
    resume is bitwise exact. Settings are those of ``batches``."""

    def __init__(self, documents: Sequence[np.ndarray], *, strategy: str = "fixed", seq_len: int,
                 batch_size: int | None = None, tokens_per_batch: int | None = None,
                 seed: int = 0, shuffle: bool = True, position: dict | None = None,
                 process_index: int = 0, process_count: int = 1, **options):
        self._batcher, self._empty_documents = _make_strategy(
            documents, strategy, seq_len, batch_size, tokens_per_batch, seed, process_index,
            process_count, options)
        self._documents, self._seed, self._shuffle = documents, seed, shuffle
        self._process_index, self._process_count = process_index, process_count
        self._cached_plan = (None, None)  # (epoch, its EpochPlan), set in one assignment
        position = {"epoch": 0, "batch": 0} if position is None else position
        self._epoch, self._batch = self._parse_position(position)

    @property
    def position(self) -> dict:
        """The next batch to be yielded, as {"epoch": e, "batch": i}."""
        return {"epoch": self._epoch, "batch": self._batch}

    @property
    def shapes(self) -> list[tuple[int, int]]:
        """Every (local batch size, T) this stream can yield in any epoch, sorted."""
        return sorted((b // self._process_count, t) for b, t in self._batcher.shapes())

    @property
    def global_shapes(self) -> list[tuple[int, int]]:
        """Every (global batch size, T): the shapes the step is compiled for."""
        return sorted(self._batcher.shapes())

    @property
    def batches_per_epoch(self) -> int:
        """Batches in the current epoch (pack re-packs, so its count may differ by epoch)."""
        return self._epoch_plan(self._epoch).num_batches

    @property
    def stats(self) -> dict:
        """How the current epoch uses its global batches; padding_efficiency: pairs / positions."""
        plan = self._epoch_plan(self._epoch)
        real_tokens = int(plan.rows.length_Q.sum())
        return {
            "rows_per_epoch": plan.rows.num_rows,
            "batches_per_epoch": plan.num_batches,
            "split_documents": int(np.count_nonzero(np.bincount(plan.rows.doc_Q) > 1)),
            "empty_documents_skipped": self._empty_documents,
            "real_tokens_per_epoch": real_tokens,
            "padding_efficiency": real_tokens / int(np.sum(plan.batch_size_Z * plan.length_Z)),
            "real_tokens_per_batch": real_tokens / plan.num_batches,
        } | self._batcher.stats()

    def __iter__(self) -> "DataStream":
        return self

    def __next__(self) -> Batch:
        plan = self._epoch_plan(self._epoch)
        batch = _local_batch(self._documents, plan, self._batch, self._process_index,
                             self._process_count)
        self._batch += 1
        if self._batch == plan.num_batches:
            self._epoch, self._batch = self._epoch + 1, 0
        return batch

    def _epoch_plan(self, epoch: int) -> EpochPlan:
        if self._cached_plan[0] != epoch:
            rng = _epoch_rng(self._seed, epoch, self._shuffle)
            self._cached_plan = (epoch, self._batcher.plan(rng))
        return self._cached_plan[1]

    def _parse_position(self, position: dict) -> tuple[int, int]:
        """Checks that a saved position fits this stream's epochs."""
        epoch, batch = position.get("epoch"), position.get("batch")
        valid = isinstance(epoch, int) and isinstance(batch, int) and epoch >= 0 and batch >= 0
        num_batches = self._epoch_plan(epoch if valid else 0).num_batches
        if not (valid and batch < num_batches):
            raise ConfigError(f"data position {position} does not fit an epoch of {num_batches} "
                              "batches; resume with the data and batching settings the "
                              "position was saved with")
        return epoch, batch


def batch_stats(batch: Batch) -> dict[str, int]:
    """Host-side token counts of a Batch: real (weighted) targets and padding positions."""
    return {"real_tokens": int(batch["weights"].sum(dtype=np.float64)),
            "padded_tokens": int(np.count_nonzero(batch["segment_ids"] == 0))}


def _make_strategy(documents: Sequence[np.ndarray], strategy: str, seq_len: int,
                   batch_size: int | None, tokens_per_batch: int | None, seed: int,
                   process_index: int, process_count: int, options: dict) -> tuple[Fixed, int]:
    """The strategy over the documents' pair counts and the count of empty documents, after
    rejecting settings that cannot make batches (naming the setting, and field, to change)."""
    if strategy not in STRATEGIES:
        raise ConfigError(f"unknown batching strategy {strategy!r}; choose one of: "
                          f"{', '.join(STRATEGIES)}", field="data.batching")
    if seed < 0:
        raise ConfigError(f"seed must be >= 0, got {seed}; pass a non-negative seed",
                          field="run.seed")
    if not 0 <= process_index < process_count:
        raise ConfigError(f"process_index={process_index} is not in [0, process_count="
                          f"{process_count}); pass the index of this process among "
                          "process_count >= 1 processes")
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ConfigError(f"unknown batching option {unknown[0]!r}; choose from: "
                          f"{', '.join(OPTIONS)}")
    values = OPTIONS | options
    for name, value in [("seq_len", seq_len), *values.items()]:
        if not (isinstance(value, int) and value >= 1):
            raise ConfigError(f"{name} must be >= 1, got {value!r}; pass an integer {name} >= 1",
                              field=_FIELDS.get(name))
    if strategy == "bucket" and values["num_buckets"] > seq_len:
        # each bucket is a row length: more than seq_len of them only costs planning time
        raise ConfigError(f"num_buckets={values['num_buckets']} exceeds seq_len={seq_len}; pass "
                          f"at most seq_len buckets", field=_FIELDS["num_buckets"])
    if (batch_size is None) == (tokens_per_batch is None):
        given = "neither" if batch_size is None else "both"
        raise ConfigError(f"pass exactly one of batch_size and tokens_per_batch, got {given}",
                          field="data.batch_size")
    data_parallel = values["data_parallel"]
    multiple = math.lcm(data_parallel, process_count)
    if tokens_per_batch is not None:
        if strategy == "dynamic":
            raise ConfigError("dynamic batching takes batch_size, not tokens_per_batch; use bucket "
                              "batching for token budgets", field="data.tokens_per_batch")
        if tokens_per_batch < 1:
            raise ConfigError(f"tokens_per_batch must be >= 1, got {tokens_per_batch}; pass a "
                              "positive budget", field="data.tokens_per_batch")
        if strategy != "bucket":
            batch_size = tokens_per_batch // seq_len // multiple * multiple
            if batch_size == 0:
                raise ConfigError(
                    f"tokens_per_batch={tokens_per_batch} holds no batch of {multiple} rows of "
                    f"seq_len={seq_len}; raise tokens_per_batch to at least {seq_len * multiple}",
                    field="data.tokens_per_batch")
    elif batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}; pass a positive batch size",
                          field="data.batch_size")
    else:
        for name, count in (("data_parallel", data_parallel), ("process_count", process_count)):
            if batch_size % count:
                raise ConfigError(f"batch_size={batch_size} is not a multiple of {name}={count}; "
                                  f"pass a batch_size that is (e.g. "
                                  f"{-(-batch_size // count) * count})", field="data.batch_size")
    sizes = Sizes(seq_len, batch_size, tokens_per_batch, values["pad_multiple"],
                  values["num_buckets"], values["pack_window"], multiple)
    if len(documents) == 0:
        raise ConfigError("no documents to batch; pass a corpus with at least one document",
                          field="data.path")
    lengths = getattr(documents, "lengths", None)   # corpus.Documents: not read, may be huge
    if lengths is None:
        lengths = [len(doc) for doc in documents]
    pairs_N = np.maximum(np.asarray(lengths, dtype=np.int64) - 1, 0)
    if pairs_N.sum() == 0:
        raise ConfigError(f"the {len(documents)} documents have no (input, target) pairs; pass a "
                          "corpus with a document of >= 2 tokens", field="data.path")
    return STRATEGIES[strategy](pairs_N, sizes), int(np.count_nonzero(pairs_N == 0))


def _epoch_rng(seed: int, epoch: int, shuffle: bool) -> np.random.Generator | None:
    """The random source of an epoch, a pure function of (seed, epoch); None without shuffling."""
    return np.random.default_rng([seed, epoch]) if shuffle else None


def _local_batch(documents: Sequence[np.ndarray], plan: EpochPlan, index: int,
                 process_index: int, process_count: int) -> Batch:
    """This process's rows [p * B / P, (p + 1) * B / P) of global batch ``index``."""
    local_size = int(plan.batch_size_Z[index]) // process_count
    rows_B = plan.order_W[plan.batch_offsets[index] : plan.batch_offsets[index + 1]]
    rows_B = rows_B[process_index * local_size : (process_index + 1) * local_size]
    return make_batch(documents, plan.rows, rows_B, local_size, int(plan.length_Z[index]))
