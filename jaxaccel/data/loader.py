"""Feeding the step: ``DevicePrefetcher``'s thread makes the next batches of a ``DataStream`` on
the host, places them on the devices with the step's input sharding (one global array from each
process's slice when there are several processes) and queues them, so the step finds its input
waiting. With ``depth=0`` there is no thread: each batch is made when the step asks for it, and
on a CPU (one process) handed to the step as host arrays, whose call copies them to its device,
the host's memory: at a 1 ms step the thread's placing and hand-over cost more than they hide."""

import contextlib
import queue
import threading
import time

import jax

from jaxaccel.data.batching import BATCH_DTYPES, batch_stats


def place_batch(batch: dict, sharding=None) -> dict:
    """Put a host batch on the devices; with several processes, ``batch`` is this process's rows
    of the global batch and ``sharding`` (required then) says how the global array is laid out."""
    if jax.process_count() > 1:
        if sharding is None:
            raise ValueError("several processes need the batch sharding to build global arrays")
        return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}
    return jax.device_put(batch, sharding)


def prefetch_depth(data) -> int:
    """``data.prefetch`` (a config's data section) resolved: as set, else 0 for one process on a
    CPU without importance sampling, else 2."""
    if data.prefetch is not None:
        return data.prefetch
    on_host = jax.process_count() == 1 and jax.default_backend() == "cpu"
    return 0 if on_host and data.sampling == "uniform" else 2


class DevicePrefetcher:
    """Iterator of ``(device batch, host counts)`` that stays ``depth`` batches ahead.
    ``position`` is the stream position after the last batch handed out (the thread runs ahead),
    the one a checkpoint records; ``wait_seconds`` sums the time ``next`` waited for a batch."""

    _END = object()

    def __init__(self, stream, *, sharding=None, depth: int = 2):
        self.position = stream.position
        self.wait_seconds = 0.0
        self._stream, self._sharding, self._thread = stream, sharding, None
        if depth == 0:
            self._host = jax.process_count() == 1 and all(
                d.platform == "cpu" for d in (sharding.device_set if sharding is not None
                                              else jax.local_devices()))
            return
        self._queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._produce, args=(stream, sharding), daemon=True, name="prefetch")
        self._thread.start()

    def _produce(self, stream, sharding):
        try:
            for batch in stream:
                item = (place_batch(batch, sharding), batch_stats(batch), stream.position)
                while not self._stop.is_set():
                    with contextlib.suppress(queue.Full):
                        self._queue.put(item, timeout=0.1)
                        break
                if self._stop.is_set():
                    return
        except BaseException as error:  # handed to the consumer, which re-raises it
            self._queue.put(error)
            return
        self._queue.put(self._END)

    def __iter__(self):
        return self

    def __next__(self):
        start = time.perf_counter()
        if self._thread is None:        # depth 0: made now, in this thread
            batch = next(self._stream)
            counts = batch_stats(batch)
            self.position = self._stream.position
            self.wait_seconds += time.perf_counter() - start
            return (batch if self._host else place_batch(batch, self._sharding)), counts
        item = self._queue.get()
        self.wait_seconds += time.perf_counter() - start
        if item is self._END:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        batch, counts, self.position = item
        return batch, counts

    def close(self):
        """Stop the thread and drop the batches it made ahead."""
        if self._thread is None:
            return
        self._stop.set()
        while self._thread.is_alive():
            with contextlib.suppress(queue.Empty):
                self._queue.get(timeout=0.1)
        self._thread.join()


def abstract_key():
    """A PRNG key's shape and dtype (``jax.random.PRNGKey``'s), to trace with: making a real
    one compiles a program."""
    return jax.ShapeDtypeStruct((2,), jax.numpy.uint32)


def abstract_batch(shape: tuple[int, int], sharding=None) -> dict:
    """ShapeDtypeStructs of a Batch of ``shape`` = (batch size, length), for compiling ahead."""
    return {k: jax.ShapeDtypeStruct(shape, d, sharding=sharding) for k, d in BATCH_DTYPES.items()}
