"""Importance sampling of documents (``data.sampling``): draw each batch's rows in proportion to
a smoothed score of their document, and reweight the loss so its gradient stays unbiased.

Rows are ``data.fixed_rows`` of the training documents: N rows of n_i real pairs, A = sum n_i;
only ``fixed`` batching is supported (the others change shapes with the draw or mix documents).
Scores are per *document* (a short run draws each row about once: stdlib at seq_len 128 has
14 k documents, 251 k rows): a row's per-token loss (``loss``) or gradient-norm bound
(``grad-norm``: ||softmax(logits) - onehot|| over its real tokens, Katharopoulos & Fleuret
2018), relative to the batch's token mean so that scores stay in scale; unseen documents score
1. Row i of document d(i) is drawn with probability

    p_i = (1 - floor) * s_d(i)^power / sum_j s_d(j)^power  +  floor / N

B rows with replacement from ``default_rng([seed, STREAM, t])`` for batch t. Row b's token
weights are multiplied by u_b = R / (B A p_b), R the batch's real tokens, and the loss
normalised by R (``train.lm_loss``): its expectation is exactly the token mean over the
training set, for any batch size and accumulation. ``uniform`` leaves all this out.

The step returns the rows' score sums (``aux["rows"]``); ``Sampler.submit`` fetches them
``FETCH_LAG`` steps late and batch t is drawn from the scores of steps <= t - lag, lag =
prefetch + FETCH_LAG + 2, so the prefetch thread never waits and draws do not depend on timing.
The loader position ``{"batch": t, "sampler": ...}`` holds the score table as of t - lag and the
updates since, so a resumed run draws the same batches (``loop.resume_settings`` records
``data.prefetch``, on which the lag depends)."""

import base64
import collections
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxaccel.data.batching import DataStream, fixed_rows, make_batch
from jaxaccel.core.errors import ConfigError
from jaxaccel.core.sections import SAMPLING     # declared without jax
from jaxaccel.core.sharding import refuse_pipeline

SCORE_KEYS = {"loss": "loss", "grad-norm": "grad_bound"}   # each score's row sums in aux["rows"]
FETCH_LAG = 2       # the loop fetches a step's scores this many steps after it
STREAM = 0x5A4D     # keeps the draws' random stream apart from the epochs' shuffles
_FIXED_ONLY = ("importance sampling draws rows of fixed batching, not {!r}; use --batching fixed "
               "or --sampling uniform")


def check(cfg) -> None:
    """Importance sampling's settings, and what it cannot combine with: batchings other than
    fixed, and pipeline stages."""
    if cfg.data.sampling == "uniform":
        return
    if cfg.data.batching != "fixed":
        raise ConfigError(_FIXED_ONLY.format(cfg.data.batching), field="data.sampling")
    refuse_pipeline(cfg.mesh.strategy, "importance sampling", "data.sampling")


def lag(prefetch: int) -> int:
    """Steps between a step and the first batch drawn with its scores."""
    return prefetch + FETCH_LAG + 2


def row_scores(logits_BTV, batch, sampling: str) -> dict:
    """``{SCORE_KEYS[sampling]: [B]}``: each row's summed token loss, or summed gradient bound
    ||softmax(logits) - onehot(target)||, over its real tokens, in float32, without gradient."""
    logits_BTV = jax.lax.stop_gradient(logits_BTV).astype(jnp.float32)
    real_BT = (batch["weights"] > 0).astype(jnp.float32)
    token_loss_BT = optax.softmax_cross_entropy_with_integer_labels(logits_BTV, batch["targets"])
    if sampling == "loss":
        return {"loss": jnp.sum(token_loss_BT * real_BT, axis=-1)}
    # ||p - e_y||^2 = sum_v p_v^2 - 2 p_y + 1, with p_y = exp(-token loss).
    lse_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
    sum_p2_BT = jnp.sum(jnp.exp(2.0 * (logits_BTV - lse_BT[..., None])), axis=-1)
    bound_BT = jnp.sqrt(jnp.maximum(sum_p2_BT - 2.0 * jnp.exp(-token_loss_BT) + 1.0, 0.0))
    return {"grad_bound": jnp.sum(bound_BT * real_BT, axis=-1)}


def row_probabilities(scores_D: np.ndarray, doc_W: np.ndarray, power: float,
                      floor: float) -> np.ndarray:
    """p_i of every row (float64, sums to 1): its document's score to ``power``, normalised
    over the rows, mixed with ``floor`` of the uniform distribution."""
    q_W = np.power(scores_D.astype(np.float64), power)[doc_W]
    total = q_W.sum()
    uniform = 1.0 / len(doc_W)
    if not np.isfinite(total) or total <= 0:
        return np.full(len(doc_W), uniform)
    return (1.0 - floor) * q_W / total + floor * uniform


def importance_weights(p_B: np.ndarray, n_B: np.ndarray, total_pairs: int) -> np.ndarray:
    """u_b = R / (B A p_b) of each drawn row: the loss normalised by the batch's real tokens R
    is then unbiased for the token mean of all A pairs (module docstring)."""
    return n_B.sum() / (len(p_B) * total_pairs * p_B)


def relative_scores(sums_B: np.ndarray, n_B: np.ndarray) -> np.ndarray:
    """Each row's per-token score over the batch's token mean (1 where that mean is 0)."""
    sums_B = sums_B.astype(np.float64)
    level = sums_B.sum() / n_B.sum()
    if not (np.isfinite(level) and level > 0):
        return np.ones(len(sums_B))
    return sums_B / n_B / level


def draw(p_W: np.ndarray, count: int, seed: int, step: int) -> np.ndarray:
    """``count`` rows drawn with replacement from p_W, from (seed, step) alone."""
    cdf_W = np.cumsum(p_W)
    u = np.random.default_rng([seed, STREAM, step]).random(count) * cdf_W[-1]
    return np.minimum(np.searchsorted(cdf_W, u, side="right"), len(p_W) - 1)


class Sampler:
    """The score table and the probabilities each batch is drawn from; thread-safe (the
    prefetch thread calls ``probabilities`` and ``record_draw``). After step s, ``head`` has
    every step <= s applied, ``base`` the steps <= s - lag + 1, ``recent`` those between."""

    def __init__(self, doc_W, row_len_W, num_documents: int, *, sampling: str, power: float,
                 floor: float, lag: int, state: dict | None = None):
        if lag <= FETCH_LAG:    # batch t would wait for scores fetched only after it is used
            raise ValueError(f"lag={lag} must exceed FETCH_LAG={FETCH_LAG}")
        self.doc_W, self.row_len_W = doc_W, row_len_W
        self.key = SCORE_KEYS[sampling]
        self.power, self.floor, self.lag = power, floor, lag
        self._condition = threading.Condition()
        self._closed = False
        self._drawn = {}                      # step -> rows drawn (prefetch thread writes)
        self._pending = collections.deque()   # (step, device array of row sums), not fetched
        self._published = {}                  # step -> probabilities for batch step + lag
        state = state or {"step": 0, "scores": None, "recent": []}
        self.base = (np.ones(num_documents, np.float32) if state["scores"] is None
                     else _decode(state["scores"], num_documents))
        self.recent = collections.deque(
            (s, np.asarray(docs, np.int64), np.asarray(values, np.float32))
            for s, docs, values in state["recent"])
        self.observed = state["step"] - 1     # the last step whose scores are applied
        self.head = self.base.copy()
        self._publish(max(state["step"] - lag, -1), self.base)
        for s, docs, values in self.recent:
            self.head[docs] = values
            self._publish(s, self.head)

    def _publish(self, step: int, scores_D: np.ndarray):
        """Publish the probabilities of ``scores_D``, the table as of the observed ``step``."""
        p_W = row_probabilities(scores_D, self.doc_W, self.power, self.floor)
        with self._condition:
            self._published[step] = p_W
            self.observed = max(self.observed, step)
            for old in [k for k in self._published if k < step - self.lag]:
                del self._published[old]
            self._condition.notify_all()

    def probabilities(self, step: int) -> np.ndarray:
        """The row probabilities batch ``step`` is drawn from (waits for its scores)."""
        key = max(step - self.lag, -1)
        with self._condition:
            while key not in self._published:
                if self._closed:
                    raise RuntimeError("the sampler was closed")
                if key <= self.observed:
                    raise RuntimeError(f"batch {step} needs the scores of step {key}, which "
                                       f"are no longer kept")
                self._condition.wait(timeout=0.1)
            return self._published[key]

    def record_draw(self, step: int, rows_B: np.ndarray):
        with self._condition:
            self._drawn[step] = rows_B

    def submit(self, step: int, metrics: dict):
        """Keep step's row scores (device arrays); fetch those ``FETCH_LAG`` steps older."""
        self._pending.append((step, metrics["rows"][self.key]))
        while self._pending and self._pending[0][0] <= step - FETCH_LAG:
            self._observe(*self._pending.popleft())

    def flush(self):
        """Fetch and apply every submitted step's scores (blocks on them)."""
        while self._pending:
            self._observe(*self._pending.popleft())

    def _observe(self, step: int, sums_B):
        if step != self.observed + 1:
            raise RuntimeError(f"scores of step {step} after those of step {self.observed}")
        with self._condition:
            rows_B = self._drawn.pop(step)
        sums_B = np.asarray(jax.device_get(sums_B))
        relative_B = relative_scores(sums_B, self.row_len_W[rows_B])
        docs, inverse = np.unique(self.doc_W[rows_B], return_inverse=True)
        values = (np.bincount(inverse, relative_B) / np.bincount(inverse)).astype(np.float32)
        self.head[docs] = values
        self.recent.append((step, docs, values))
        while len(self.recent) > self.lag - 1:
            _, old_docs, old_values = self.recent.popleft()
            self.base[old_docs] = old_values
        self._publish(step, self.head)

    def state(self) -> dict:
        """JSON-serialisable state for resuming at batch observed + 1 (call ``flush`` first)."""
        return {"step": self.observed + 1,
                "scores": base64.b64encode(self.base.astype("<f4").tobytes()).decode("ascii"),
                "recent": [[s, docs.tolist(), values.tolist()] for s, docs, values in self.recent]}

    def close(self):
        """Wake and fail any draw still waiting (the prefetch thread is being stopped)."""
        with self._condition:
            self._closed = True
            self._condition.notify_all()


def _decode(text: str, num_documents: int) -> np.ndarray:
    scores = np.frombuffer(base64.b64decode(text), dtype="<f4").astype(np.float32)
    if len(scores) != num_documents:
        raise ConfigError(f"the checkpoint's sampler scores {len(scores)} documents, the corpus "
                          f"has {num_documents}; resume with the data it was written with",
                          field="data.path")
    return scores


class SampledStream:
    """Endless importance-sampled training Batches, a ``DataStream`` to the loop: its settings
    (``strategy`` fixed) plus ``sampling``, ``power``, ``floor``, ``lag``. ``position``:
    ``{"batch": t}``, plus ``"sampler"`` (``Sampler.state``, added at checkpoints) to resume."""

    def __init__(self, documents, *, strategy: str = "fixed", seq_len: int, seed: int = 0,
                 position: dict | None = None, process_index: int = 0, process_count: int = 1,
                 sampling: str, power: float, floor: float, lag: int, **options):
        if strategy != "fixed":
            raise ConfigError(_FIXED_ONLY.format(strategy), field="data.sampling")
        # A fixed stream checks the settings and resolves the batch size.
        uniform = DataStream(documents, strategy="fixed", seq_len=seq_len, seed=seed,
                             shuffle=False, process_index=process_index,
                             process_count=process_count, **options)
        ((self._batch_size, self._seq_len),) = uniform.global_shapes
        self._uniform_stats = uniform.stats
        pairs_N = np.maximum(np.array([len(doc) for doc in documents], np.int64) - 1, 0)
        self.rows = fixed_rows(pairs_N, self._seq_len)
        self.row_len_W = self.rows.row_lengths()
        self.total_pairs = int(self.row_len_W.sum())
        self._documents, self._seed = documents, seed
        self._process_index, self._process_count = process_index, process_count
        position = {"batch": 0} if position is None else position
        batch, state = position.get("batch"), position.get("sampler")
        if not (isinstance(batch, int) and batch >= 0) or (
                position != {"batch": 0} and (state is None or state.get("step") != batch)):
            raise ConfigError(f"data position {sorted(position)} is not an importance-sampled "
                              f"stream's; resume with the sampling settings it was saved with",
                              field="data.sampling")
        self._batch = batch
        self.sampler = Sampler(self.rows.doc_Q, self.row_len_W, len(documents),
                               sampling=sampling, power=power, floor=floor, lag=lag, state=state)

    @property
    def position(self) -> dict:
        return {"batch": self._batch}

    @property
    def shapes(self) -> list[tuple[int, int]]:
        return [(self._batch_size // self._process_count, self._seq_len)]

    @property
    def global_shapes(self) -> list[tuple[int, int]]:
        return [(self._batch_size, self._seq_len)]

    @property
    def batches_per_epoch(self) -> int:
        """Batches of as many rows as the training set has (draws are with replacement)."""
        return self._uniform_stats["batches_per_epoch"]

    @property
    def stats(self) -> dict:
        """The fixed stream's, with the expected real tokens of a batch of uniform draws."""
        stats = dict(self._uniform_stats)
        stats["real_tokens_per_batch"] = self._batch_size * self.total_pairs / self.rows.num_rows
        stats["padding_efficiency"] = self.total_pairs / (self.rows.num_rows * self._seq_len)
        return stats

    def __iter__(self) -> "SampledStream":
        return self

    def __next__(self) -> dict:
        step = self._batch
        p_W = self.sampler.probabilities(step)
        rows_B = draw(p_W, self._batch_size, self._seed, step)
        self.sampler.record_draw(step, rows_B)
        weights_B = importance_weights(p_W[rows_B], self.row_len_W[rows_B], self.total_pairs)
        local = self._batch_size // self._process_count
        mine = slice(self._process_index * local, (self._process_index + 1) * local)
        batch = make_batch(self._documents, self.rows, rows_B[mine], local, self._seq_len)
        batch["weights"] = (batch["weights"] * weights_B[mine, None]).astype(np.float32)
        self._batch += 1
        return batch
