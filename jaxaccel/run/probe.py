"""An own model's first forward and backward, before any work: what ``model.check`` cannot see
from shapes. ``loop.preflight`` runs it for a factory of one's own (``--model FILE.py:FUNCTION``),
not for jaxaccel's GPT presets (their start-up is a benchmarked target; their tests prove the
same). One compiled program on ids [2, T], T the run's sequence length, from the run's seed:

- no index past the end of an array (``jax.experimental.checkify``'s index checks): jnp indexing
  clamps one silently (``nnx.Embed`` gives NaN), the mark of a position table shorter than the
  sequence (a factory that ignores ``max_seq_len``) or an embedding shorter than the vocabulary;
- finite logits; a finite gradient that is not zero for every ``nnx.Param`` (some may be: a
  zero-initialised output projection leaves the layers before it none at first);
- no variable drawn at random that is not an ``nnx.Param``: it would never train;
- the logits at a position do not change with a later token (causal attention), nor, with
  ``--batching pack``, with another document's token in the same row.

Each failure is one ConfigError line naming the cause, the user's line where JAX can tell, and
the setting that depends on it.
"""

import os

import flax
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.experimental import checkify

from jaxaccel.step import grads, trace
from jaxaccel.model import contract as model_lib, nn
from jaxaccel.core.errors import ConfigError

ROWS = 2
# A later token's change that moves an earlier position's logits by more than this share of the
# largest logit is seen: positions it cannot reach compute bit for bit the same values.
LEAK_TOLERANCE = 1e-5


def check(model_cfg, gpt_settings, *, seq_len: int, packed: bool, seed: int) -> None:
    """A ConfigError line if the model ``model_cfg`` builds from ``seed`` (before any technique)
    is not what training needs (the module's docstring); nothing otherwise."""
    name, vocab = model_cfg.name, model_cfg.vocab_size
    T = max(int(seq_len), 2)
    _refuse_random_variables(model_cfg, gpt_settings)
    batches, changed = _batches(vocab, T, packed)
    key = jax.random.PRNGKey(seed)

    def run(index_checks: bool):
        return _compiled(jax.jit(_measure(model_cfg, gpt_settings, packed,
                                          index_checks=index_checks)).lower(key, batches))(
            key, batches)

    try:
        try:
            found = run(index_checks=True)
        except (ConfigError, jax.errors.JaxRuntimeError):
            raise
        except Exception:       # noqa: BLE001 - checkify may not read a kernel (pallas_call)
            found = run(index_checks=False)     # and a failure here is the model's own
    except (ConfigError, jax.errors.JaxRuntimeError):
        raise
    except Exception as e:      # noqa: BLE001 - the user's code: one line with where it failed
        raise ConfigError(f"model {name}: its first forward and backward on ids [{ROWS}, {T}] "
                          f"failed: {model_lib._describe(e)}", field="model.name") from None
    if "index_error" in found:
        _refuse_index(found.pop("index_error").get_exception(), name, T, model_cfg,
                      lambda shape: _gather_line(jax.make_jaxpr(_measure(
                          model_cfg, gpt_settings, packed, logits_only=True))(key, batches),
                          shape))
    found = jax.device_get(found)
    if not found["logits_finite"]:
        where = _first_nan(_measure(model_cfg, gpt_settings, packed, logits_only=True), seed,
                           batches)
        raise ConfigError(f"model {name}: its logits at initialisation hold NaN or inf (ids "
                          f"[{ROWS}, {T}], seed {seed}){where}; training would diverge at its "
                          f"first step: fix the model's initialisation or forward pass",
                          field="model.name")
    _refuse_gradient(found, name, T, lambda: _first_nan(
        _measure(model_cfg, gpt_settings, packed), seed, batches))
    _refuse_leak(found["moved"], changed, name, T, packed)


# ---------------------------------------------------------------------------------------------
# The measurement, one jitted function.

def _batches(vocab: int, T: int, packed: bool) -> tuple[dict, int]:
    """The step's batch (``main``, every id up to ``vocab - 1`` and position up to ``T - 1``)
    and the pair for the causality probe (``a``, ``b``: one token changed), and that token's
    position: the last; packed, two documents in each row, and the first one's last."""
    ids = jax.random.randint(jax.random.PRNGKey(0), (ROWS, T), 0, vocab).at[0, 0].set(vocab - 1)
    main = {**model_lib.sequence_batch(ids), "targets": jnp.roll(ids, -1, axis=1)}
    half = T // 2
    if packed:
        segments = jnp.where(jnp.arange(T) < half, 1, 2)
        positions = jnp.where(jnp.arange(T) < half, jnp.arange(T), jnp.arange(T) - half)
        a = {"inputs": ids, "positions": jnp.broadcast_to(positions, (ROWS, T)).astype(jnp.int32),
             "segment_ids": jnp.broadcast_to(segments, (ROWS, T)).astype(jnp.int32)}
        changed = half - 1
    else:
        a, changed = model_lib.sequence_batch(ids), T - 1
    b = {**a, "inputs": a["inputs"].at[:, changed].set((ids[:, changed] + 1) % vocab)}
    return {"main": main, "a": a, "b": b}, changed


def _measure(model_cfg, gpt_settings, packed: bool, *, logits_only: bool = False,
             index_checks: bool = True):
    """``measure(key, batches) -> found`` (or, ``logits_only``, the logits alone); with
    ``index_checks``, ``found["index_error"]`` is checkify's Error of the forward pass."""

    def measure(key, batches):
        model = model_lib.build(model_cfg, gpt_settings, key)
        graphdef, state = nnx.split(model)
        apply = model_lib.make_apply(graphdef, segment_attention=packed)
        main, step_key = batches["main"], jax.random.fold_in(key, 2)
        trainable = nn.trainable(state)
        if logits_only:
            return apply(state, main, step_key)

        def forward(leaves, tree):
            return apply(jax.tree.unflatten(tree, leaves), main, step_key)

        def loss(weights, rest):
            # the forward pass with index checks (checkify's, not on the backward's scatters);
            # its variables made inside checkify's trace, which reseeding them may then change
            leaves, tree = jax.tree.flatten(grads.combine(weights, rest))
            if not index_checks:
                logits = forward(leaves, tree)
                return _token_loss(logits, main), (logits, None)
            index_error, logits = checkify.checkify(
                lambda leaves: forward(leaves, tree), errors=checkify.index_checks)(leaves)
            return _token_loss(logits, main), (logits, index_error)

        weights, _, rest = grads.partition(state, trainable)
        (_, (logits, index_error)), gradient = jax.value_and_grad(loss, has_aux=True)(weights,
                                                                                      rest)
        return {**({"index_error": index_error} if index_checks else {}),
                "logits_finite": jnp.isfinite(logits).all(),
                "grad_finite": _per_variable(gradient, lambda g: jnp.isfinite(g).all()),
                "grad_nonzero": _per_variable(gradient, lambda g: (g != 0).any()),
                "moved": _moved(apply, state, batches)}

    return measure


def _token_loss(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32),
                                                           batch["targets"]).mean()


def _per_variable(state, fn) -> dict:
    return {_path(p): fn(v[...]) for p, v in nnx.to_flat_state(state)}


def _path(path) -> str:
    return "/".join(map(str, path))


def _moved(apply, state, batches):
    """Per position, how far the logits moved when one token changed (``batches["b"]``), as a
    share of the largest logit; evaluation mode (no dropout), so nothing else moves them."""
    a, b = apply(state, batches["a"]), apply(state, batches["b"])
    moved = jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max(axis=(0, 2))
    return moved / jnp.maximum(jnp.abs(a.astype(jnp.float32)).max(), 1e-30)


# ---------------------------------------------------------------------------------------------
# What a failure says.

def _refuse_index(error, name: str, T: int, model_cfg, locate) -> None:
    """An index past an array's end: clamped or NaN, and training goes on wrong. ``locate(
    shape)``: where the forward pass gathers from an array of that shape."""
    if error is None:
        return
    what = str(error).strip().rstrip(".")
    sizes = [int(w) for w in what.split() if w.isdigit()]
    short = bool(sizes) and sizes[-1] < T       # "... for axis 0 with size N"
    where = _where(error) or locate(tuple(getattr(error, "operand_shape", ())))
    raise ConfigError(
        f"model {name}: its forward pass on ids [{ROWS}, {T}] indexes past the end of an array "
        f"({what.removeprefix('out-of-bounds indexing for ')}){where}: jnp indexing would "
        f"clamp it silently (nnx.Embed gives NaN); size the model's tables by the factory's "
        f"max_seq_len ({model_cfg.max_seq_len}) and vocab_size ({model_cfg.vocab_size})"
        + (f", or lower seq_len to {sizes[-1]}" if short else ""),
        field="data.seq_len" if short else "model.name")


def _gather_line(jaxpr, shape: tuple) -> str:
    """`` at FILE:LINE``: the user's line of the first gather from an array of ``shape`` in
    ``jaxpr``. An equation inside a jitted function (``jnp.take``) keeps only the frames below
    it, so the line is the innermost of the user's above it, kept while descending."""
    def walk(jaxpr, outer: str) -> str | None:
        for eqn in jaxpr.eqns:
            here = _user_line(eqn.source_info.traceback.frames
                              if eqn.source_info.traceback else []) or outer
            if eqn.primitive.name == "gather" and tuple(eqn.invars[0].aval.shape) == shape:
                return here
            for sub in trace.subjaxprs(list(eqn.params.values())):
                found = walk(getattr(sub, "jaxpr", sub), here)
                if found is not None:
                    return found
        return None

    return walk(jaxpr.jaxpr, "") or ""


def _refuse_gradient(found: dict, name: str, T: int, locate) -> None:
    finite, nonzero = found["grad_finite"], found["grad_nonzero"]
    bad = [p for p, ok in finite.items() if not ok]
    if bad:
        more = f" (and {len(bad) - 1} more of {len(finite)})" if len(bad) > 1 else ""
        raise ConfigError(
            f"model {name}: its gradient at initialisation is NaN or inf for {bad[0]}{more} "
            f"though its logits are finite{locate()}: a sqrt, log or division at 0 in the "
            f"backward pass? (ids [{ROWS}, {T}]); training would diverge at its first step",
            field="model.name")
    if not any(nonzero.values()):
        raise ConfigError(
            f"model {name}: none of its {len(nonzero)} nnx.Param variables gets a gradient (ids "
            f"[{ROWS}, {T}]): its logits do not depend on its weights (an integer cast, "
            f"jax.lax.stop_gradient, or weights held outside the module?), so nothing would "
            f"train", field="model.name")


def _refuse_random_variables(model_cfg, gpt_settings) -> None:
    """A floating variable that is not trained (not an ``nnx.Param``) nor a ``nn.Buffer``, but
    computed from the factory's key: drawn at random, as a weight, it would never train. Read
    from the initialisation's jaxpr (``trace.from_inputs``), nothing computed."""
    kinds = {}

    def candidates(key):
        state = nnx.state(model_lib.build(model_cfg, gpt_settings, key))
        kinds.update({_path(p): type(v).__name__ for p, v in nnx.to_flat_state(state)})
        return {_path(p): v[...] for p, v in nnx.to_flat_state(state)
                if not isinstance(v, (nnx.Param, nn.Buffer, nnx.RngState))
                and jnp.issubdtype(v.dtype, jnp.floating)}

    jaxpr, shapes = jax.make_jaxpr(candidates, return_shape=True)(jax.random.PRNGKey(0))
    drawn = [p for p, random in zip(sorted(shapes), trace.from_inputs(jaxpr)) if random]
    if drawn:
        more = f" (and {len(drawn) - 1} more)" if len(drawn) > 1 else ""
        raise ConfigError(
            f"model {model_cfg.name}: its variable {drawn[0]}{more} is drawn at random, but it "
            f"is a {kinds[drawn[0]]}, not an nnx.Param, so it would never train; declare it "
            f"nnx.Param, or jaxaccel.model.nn.Buffer if it is meant to stay as drawn",
            field="model.name")


def _refuse_leak(moved, position: int, name: str, T: int, packed: bool) -> None:
    """Changing the token at ``position`` moved logits it must not reach: at earlier positions
    (a mask that is not causal), or, packed, in the row's other document."""
    half = T // 2
    earlier = [t for t in range(position) if moved[t] > LEAK_TOLERANCE]
    if earlier:
        raise ConfigError(
            f"model {name}: its logits at position {earlier[0]} change when the token at "
            f"position {position} changes: it sees later tokens (attention without a causal "
            f"mask, or a mix over the sequence), so its loss would be a lie; mask attention "
            f"causally", field="model.name")
    other = [t for t in range(half, T) if moved[t] > LEAK_TOLERANCE] if packed else []
    if other:
        raise ConfigError(
            f"model {name}: with --batching pack its logits at position {other[0]} (the second "
            f"document of a row) change with a token of the first document: the documents are "
            f"not kept apart; mask attention by segment_ids (jaxaccel.model.attention takes "
            f"them), or use --batching fixed, dynamic or bucket", field="data.batching")


def _compiled(lowered):
    """On a CPU, compiled at LLVM's optimisation level 0: the probe runs once, on small shapes,
    and its initialisation's random draws compile several times faster so (measured: a 16-wide
    model's probe 1.7 s instead of 2.9 s on the project's 2-core CPU)."""
    if jax.default_backend() == "cpu":
        return lowered.compile(compiler_options={"xla_backend_optimization_level": 0})
    return lowered.compile()


def _first_nan(measure, seed: int, batches) -> str:
    """`` (first made at FILE:LINE)``: where the measurement first makes a NaN, if JAX can say."""
    key = jax.random.PRNGKey(seed)
    try:
        error, _ = _compiled(jax.jit(checkify.checkify(measure, errors=checkify.nan_checks)).lower(
            key, batches))(key, batches)
    except Exception:       # noqa: BLE001 - only a hint for a message already decided
        return ""
    found = error.get_exception()
    where = _where(found) if found is not None else ""
    return f" (first made{where})" if where else ""


def _where(error) -> str:
    """`` at FILE:LINE``: the last frame of the user's code where checkify found ``error``."""
    return _user_line(getattr(getattr(error, "traceback_info", None), "frames", None) or [])


def _user_line(frames) -> str:
    """`` at FILE:LINE`` of the innermost of ``frames`` in the user's code (not JAX's, Flax's or
    jaxaccel's), or ""."""
    library = [os.path.dirname(os.path.abspath(m.__file__)) for m in (jax, flax, nn)]
    theirs = [f for f in frames if not any(os.path.abspath(f.file_name).startswith(p)
                                           for p in library)
              and "site-packages" not in f.file_name and "<" not in f.file_name]
    return f" at {os.path.basename(theirs[0].file_name)}:{theirs[0].line_num}" if theirs else ""
