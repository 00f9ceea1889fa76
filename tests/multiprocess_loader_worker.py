"""One of two processes of tests/test_multiprocess_loader.py: loads its slice of each global
batch, assembles the global arrays through jax.distributed and reports what it sees."""

import json
import sys

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxaccel.data.batching import DataStream
from jaxaccel.data.loader import DevicePrefetcher


def documents():
    rng = np.random.default_rng(0)
    return [rng.integers(3, 200, int(n)).astype(np.int32) for n in rng.integers(2, 40, 60)]


def main(port: str, process_id: str, out_path: str, strategy: str):
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=int(process_id))
    stream = DataStream(documents(), strategy=strategy, seq_len=16, batch_size=4, seed=1,
                        process_index=jax.process_index(), process_count=jax.process_count())
    mesh = Mesh(np.array(jax.devices()), ("data",))
    feed = DevicePrefetcher(stream, sharding=NamedSharding(mesh, PartitionSpec("data")))
    gather = jax.jit(lambda b: {k: v for k, v in b.items()},
                     out_shardings=NamedSharding(mesh, PartitionSpec()))
    report = []
    for _ in range(5):
        batch, counts = next(feed)
        whole = jax.device_get(gather(batch))
        report.append({"local_real_tokens": counts["real_tokens"],
                       "global_shape": list(batch["inputs"].shape),
                       **{k: np.asarray(v).tolist() for k, v in whole.items()}})
    feed.close()
    with open(out_path, "w") as f:
        json.dump({"process_count": jax.process_count(), "batches": report}, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
