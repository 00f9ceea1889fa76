"""Text generation from a trained model: prefill, then one jitted ``lax.fori_loop`` over the new
tokens (no host round trip per token; one compile per prompt length and count of new tokens).

A model with ``init_cache(batch, length, dtype)`` and ``decode(inputs_BT, positions_BT, cache,
cache_index=None) -> (logits_BTV, cache)`` (jaxaccel's GPT) decodes over a key/value cache: the
prefill (no ``cache_index``) fills it from slot 0, each new token is one cached step. Any other
model reruns itself over the row of ids so far (S = prompt + new tokens; causal attention never
sees the empty slots): S times the work, the same tokens.

Sampling: temperature 0 is greedy; otherwise the logits over the tokenizer's real ids
(``valid_ids``) divided by the temperature, restricted to the ``top_k`` largest, drawn with
``fold_in(key, i)`` for new token i. The model runs in evaluation mode, LoRA merged (``load_run``).
"""

import dataclasses
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxaccel.core.errors import ConfigError
from jaxaccel.model.contract import make_apply, sequence_batch


def cached(model) -> bool:
    """Whether ``model`` offers a key/value cache (``init_cache`` and ``decode``)."""
    return all(callable(getattr(model, name, None)) for name in ("init_cache", "decode"))


def make_decode(model):
    """``(prefill, step)`` of ``model`` as pure functions of its state: ``prefill(state,
    prompt_BT, length) -> (logits_BTV, cache)`` and ``step(state, inputs_B1, cache, index) ->
    (logits_B1V, cache)`` (the token at position ``index``), cached or by recomputing."""
    graphdef = nnx.graphdef(model)
    if cached(model):
        def prefill(state, prompt_BT, length):
            m = nnx.merge(graphdef, state)
            B, T = prompt_BT.shape
            dtype = jax.tree.leaves(nnx.filter_state(state, nnx.Param))[0].dtype
            positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
            return m.decode(prompt_BT, positions_BT, m.init_cache(B, length, dtype))

        def step(state, inputs_B1, cache, index):
            positions_B1 = jnp.full(inputs_B1.shape, index, jnp.int32)
            return nnx.merge(graphdef, state).decode(inputs_B1, positions_B1, cache, index)

        return prefill, step
    apply = make_apply(graphdef)

    def prefill(state, prompt_BT, length):
        B, T = prompt_BT.shape
        ids_BS = jnp.zeros((B, length), jnp.int32).at[:, :T].set(prompt_BT)
        return apply(state, sequence_batch(ids_BS))[:, :T], ids_BS

    def step(state, inputs_B1, ids_BS, index):
        ids_BS = jax.lax.dynamic_update_slice_in_dim(ids_BS, inputs_B1, index, axis=1)
        logits_BSV = apply(state, sequence_batch(ids_BS))
        return jax.lax.dynamic_slice_in_dim(logits_BSV, index, 1, axis=1), ids_BS

    return prefill, step


def sample(logits_BV, key, *, temperature: float, top_k: int, valid_ids: int | None = None):
    """Next ids [B] from float32 logits [B, V]: greedy at temperature 0, else top-k sampling.
    ``temperature`` and ``top_k`` are static; ids >= ``valid_ids`` are never chosen."""
    V = logits_BV.shape[-1]
    if valid_ids is not None and valid_ids < V:
        logits_BV = jnp.where(jnp.arange(V) < valid_ids, logits_BV, -jnp.inf)
    if temperature == 0:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    logits_BV = logits_BV / temperature
    k = min(top_k, V if valid_ids is None else min(valid_ids, V))
    if k < V:
        kth_B1 = jax.lax.top_k(logits_BV, k)[0][:, -1:]
        logits_BV = jnp.where(logits_BV >= kth_B1, logits_BV, -jnp.inf)
    return jax.random.categorical(key, logits_BV, axis=-1).astype(jnp.int32)


def make_prefill(model, cache_len: int):
    """``prefill(state, prompt_BT) -> (logits_BTV, cache)``, jitted; ``cache_len`` cache slots."""
    prefill, _ = make_decode(model)
    return jax.jit(lambda state, prompt_BT: prefill(state, prompt_BT, cache_len))


def make_decode_loop(model, *, max_new_tokens: int, temperature: float, top_k: int,
                     valid_ids: int | None = None):
    """``decode_loop(state, last_logits_BV, cache, prompt_len, key) -> tokens_BN``, jitted:
    token 0 from the prefill's last logits, then N - 1 cached steps in one ``lax.fori_loop``
    (token i - 1 in, token i out, at position prompt_len + i - 1)."""
    _, decode = make_decode(model)
    N = max_new_tokens

    def pick(logits_BV, key, i):
        return sample(logits_BV, jax.random.fold_in(key, i), temperature=temperature,
                      top_k=top_k, valid_ids=valid_ids)

    @jax.jit
    def decode_loop(state, last_logits_BV, cache, prompt_len, key):
        B = last_logits_BV.shape[0]
        tokens_BN = jnp.zeros((B, N), jnp.int32).at[:, 0].set(pick(last_logits_BV, key, 0))

        def step(i, carry):
            tokens_BN, cache = carry
            index = prompt_len + i - 1
            inputs_B1 = jax.lax.dynamic_slice_in_dim(tokens_BN, i - 1, 1, axis=1)
            logits_B1V, cache = decode(state, inputs_B1, cache, index)
            token_B = pick(logits_B1V[:, 0], key, i)
            return jax.lax.dynamic_update_slice_in_dim(tokens_BN, token_B[:, None], i,
                                                       axis=1), cache

        tokens_BN, _ = jax.lax.fori_loop(1, N, step, (tokens_BN, cache))
        return tokens_BN

    return decode_loop


def generate(model, prompt_BT, *, max_new_tokens: int, temperature: float = 0.0,
             top_k: int = 1, key=None, valid_ids: int | None = None, context: int | None = None):
    """``max_new_tokens`` new ids [B, N] after ``prompt_BT`` (rows of one length) from ``model``
    (an nnx module, in evaluation mode). Compiles on each call: for timing use ``Generator``."""
    return Generator(model, prompt_BT.shape[1], max_new_tokens, temperature=temperature,
                     top_k=top_k, valid_ids=valid_ids, context=context).run(
        nnx.state(model), prompt_BT, key)[0]


class Generator:
    """Prefill and decode loop for one prompt length and one count of new tokens, compiled
    ahead of time (``compile``) so that ``run`` times only the work."""

    def __init__(self, model, prompt_len: int, max_new_tokens: int, *, temperature: float,
                 top_k: int, valid_ids: int | None = None, context: int | None = None):
        if context is not None:
            check_lengths(context, prompt_len, max_new_tokens)
        check_sampling(temperature, top_k)
        self.prompt_len, self.max_new_tokens = prompt_len, max_new_tokens
        self.cached = cached(model)
        self.prefill = make_prefill(model, prompt_len + max_new_tokens)
        self.decode_loop = make_decode_loop(model, max_new_tokens=max_new_tokens,
                                            temperature=temperature, top_k=top_k,
                                            valid_ids=valid_ids)
        self.compile_seconds = None

    def compile(self, params, prompt_BT, key):
        """Compile both programs (seconds in ``compile_seconds``)."""
        start = time.perf_counter()
        logits_BTV, cache = jax.eval_shape(self.prefill, params, prompt_BT)
        self.prefill = self.prefill.lower(params, prompt_BT).compile()
        B, _, V = logits_BTV.shape
        last_BV = jax.ShapeDtypeStruct((B, V), logits_BTV.dtype)
        self.decode_loop = self.decode_loop.lower(params, last_BV, cache,
                                                  jnp.int32(self.prompt_len), key).compile()
        self.compile_seconds = time.perf_counter() - start

    def run(self, params, prompt_BT, key=None):
        """``(tokens_BN, timings)``: the new ids and the prefill's and decode's seconds."""
        key = jax.random.PRNGKey(0) if key is None else key
        prompt_BT = jnp.asarray(prompt_BT, jnp.int32)
        start = time.perf_counter()
        logits_BTV, cache = jax.block_until_ready(self.prefill(params, prompt_BT))
        middle = time.perf_counter()
        tokens_BN = jax.block_until_ready(self.decode_loop(
            params, logits_BTV[:, -1], cache, jnp.int32(self.prompt_len), key))
        end = time.perf_counter()
        return tokens_BN, Timings(prefill_seconds=middle - start, decode_seconds=end - middle,
                                  prompt_tokens=prompt_BT.size,
                                  decode_steps=prompt_BT.shape[0] * (self.max_new_tokens - 1))


@dataclasses.dataclass
class Timings:
    """Seconds of one generation: the prefill and the decode loop (``decode_steps`` one-token
    steps over all rows; the first new token comes from the prefill's logits)."""

    prefill_seconds: float
    decode_seconds: float
    prompt_tokens: int
    decode_steps: int

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds

    @property
    def decode_tokens_per_s(self) -> float | None:
        return self.decode_steps / self.decode_seconds if self.decode_steps else None


def check_lengths(context: int, prompt_len: int, max_new_tokens: int):
    """One ConfigError line if the prompt or prompt + new tokens exceed the model's context."""
    if prompt_len < 1:
        raise ConfigError("the prompt is empty; give at least one token", field="prompt")
    if prompt_len >= context:
        raise ConfigError(
            f"the prompt is {prompt_len} tokens, but the model's context is {context} "
            f"and at least one new token must fit; shorten the prompt", field="prompt")
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be at least 1, got {max_new_tokens}",
                          field="max_new_tokens")
    if prompt_len + max_new_tokens > context:
        raise ConfigError(f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) "
                          f"exceeds the model's context of {context}; ask for at most "
                          f"{context - prompt_len} new tokens", field="max_new_tokens")


def check_sampling(temperature: float, top_k: int):
    """One ConfigError line for a temperature that is not finite and >= 0, or top_k < 1."""
    if not 0.0 <= temperature < float("inf"):
        raise ConfigError(f"temperature must be a finite number >= 0 (0 = greedy), got "
                          f"{temperature}", field="temperature")
    if top_k < 1:
        raise ConfigError(f"top_k must be at least 1, got {top_k}", field="top_k")


def read_run_config(run_dir: str):
    """The TrainConfig of a run directory (its ``config.yaml``), after checking that the
    directory and a finished checkpoint exist: one ConfigError line (field ``run_dir``) if not."""
    from jaxaccel.run.config import TrainConfig, build, read_config_file

    if not os.path.isdir(run_dir):
        raise ConfigError(f"run directory {run_dir} does not exist; pass the run_dir of a "
                          f"training run", field="run_dir")
    config_file = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(config_file):
        raise ConfigError(f"{run_dir} has no config.yaml, so it is not a training run "
                          f"directory; pass the run_dir of a training run", field="run_dir")
    checkpoints = os.path.join(run_dir, "checkpoints")
    if not (os.path.isdir(checkpoints) and any(n.isdigit() for n in os.listdir(checkpoints))):
        raise ConfigError(f"{run_dir} has no checkpoint; train it first (experiments.train "
                          f"writes one at the end of a run) or pass another run_dir",
                          field="run_dir")
    try:
        return build(TrainConfig, read_config_file(config_file))
    except ConfigError as e:
        raise ConfigError(f"{config_file} is not readable ({e}); pass the run_dir of a "
                          f"training run", field="run_dir") from None


def load_run(run_dir: str, model: str | None = None):
    """``(config, model, step)`` of a training run's latest checkpoint: the model in evaluation
    mode, in float32, with LoRA merged into its weights (``techniques.merge``; adapters stay).
    ``model``: the run's own factory ``FILE.py:FUNCTION`` where it is now, if it moved since
    the run trained (``--model``; else the one the run recorded)."""
    from jaxaccel.techniques import registry as techniques
    from jaxaccel.run.loop import read_trained_run

    read_run_config(run_dir)
    try:
        trained, model, step = read_trained_run(run_dir, field="run_dir", model=model,
                                                model_field="model")
    except ConfigError as e:       # the run's own model (its file, its code): --model fixes it
        raise ConfigError(str(e), field="model" if e.field in ("model", "model.name")
                          else "run_dir") from None
    techniques.merge(model)
    model.eval()
    graphdef, state = nnx.split(model)
    state = jax.tree.map(lambda a: a.astype(jnp.float32)
                         if jnp.issubdtype(a.dtype, jnp.floating) else a, state)
    return trained, nnx.merge(graphdef, state), step


def valid_ids_of(tokenizer) -> int:
    """The ids a tokenizer can decode: sampling never picks the padded vocabulary's tail."""
    return int(tokenizer.vocab_size)


def cut_at_eos(ids, eos_id: int) -> np.ndarray:
    """The ids before the first ``eos_id`` (all of them if there is none)."""
    ids = np.asarray(ids)
    hits = np.flatnonzero(ids == eos_id)
    return ids[:hits[0]] if hits.size else ids
