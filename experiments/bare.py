"""The floor a training loop is measured against: a bare JAX script, as short as a user would
write it from the library's public pieces, that ``experiments.overhead`` runs beside
``experiments.train`` on the same model, optimizer and batches.

    python -m experiments.bare --d-model 32 --n-layers 1 --n-heads 2 --seq-len 32 \\
        --batch-size 4 --steps 1000

It imports JAX and the pieces, reads the corpus, jits the state's initialisation and
``lm_train_step`` (the state donated), runs the first step, puts the other batches on the device,
then runs them in a plain ``for`` loop with one wait at the end. It prints one JSON line: the seconds from the
command's start to the first step's result (Linux's /proc, as ``experiments.train`` counts
them), the steps after the first and their seconds. Nothing else: no logging, evaluation,
checkpoints or checks.
"""

import argparse
import json
import os
import time

import jax
import numpy as np
from flax import nnx

from jaxaccel.model import gpt, contract as model
from jaxaccel.step import optim
from jaxaccel.data.corpus import load_corpus
from jaxaccel.data.batching import batches
from jaxaccel.step.state import init_state
from jaxaccel.step.train import lm_train_step


def process_age() -> float:
    """Seconds since this process started."""
    with open("/proc/self/stat") as f:
        start_ticks = int(f.read().rpartition(")")[2].split()[19])
    with open("/proc/uptime") as f:
        return float(f.read().split()[0]) - start_ticks / os.sysconf("SC_CLK_TCK")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("d-model", 256), ("n-layers", 4), ("n-heads", 4), ("seq-len", 256),
                          ("max-seq-len", 256), ("batch-size", 16), ("steps", 100),
                          ("warmup-steps", 100)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--data", default="stdlib")
    parser.add_argument("--cache-dir", default=None)
    args = parser.parse_args(argv)

    corpus = load_corpus(args.data, cache_dir=args.cache_dir)
    vocab_size = corpus.tokenizer.padded_vocab_size          # as experiments.train sets it
    optimizer = optim.make_optimizer("adamw", warmup_steps=args.warmup_steps,
                                     total_steps=args.steps)

    @jax.jit
    def make_state(key):        # one program: the model's initialisation and the optimizer's
        lm = gpt.make(vocab_size, args.max_seq_len, rngs=nnx.Rngs(params=key),
                      d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads)
        return init_state(nnx.state(lm), optimizer, seed=0)

    graphdef = nnx.graphdef(nnx.eval_shape(lambda: gpt.make(
        vocab_size, args.max_seq_len, rngs=nnx.Rngs(params=0), d_model=args.d_model,
        n_layers=args.n_layers, n_heads=args.n_heads)))
    schedule = optim.make_schedule("cosine", optim.DEFAULTS["adamw"].learning_rate,
                                   warmup_steps=args.warmup_steps, total_steps=args.steps)
    step = jax.jit(lm_train_step(model.make_apply(graphdef, segment_attention=False), optimizer,
                                 schedule), donate_argnums=0)
    state = make_state(jax.random.PRNGKey(0))
    made = batches(corpus.train, strategy="fixed", seq_len=args.seq_len, batch_size=args.batch_size)
    state, metrics = step(state, jax.device_put(next(made)))
    jax.block_until_ready(metrics)
    to_first_step = process_age()
    placed = [jax.device_put(b) for _, b in zip(range(args.steps - 1), made)]
    begin = time.perf_counter()
    for batch in placed:
        state, metrics = step(state, batch)
    jax.block_until_ready(state)
    seconds = time.perf_counter() - begin
    print(json.dumps({"command_to_first_step": to_first_step, "steps": len(placed),
                      "seconds": seconds, "loss": float(np.asarray(metrics["loss"]))}))


if __name__ == "__main__":
    main()
