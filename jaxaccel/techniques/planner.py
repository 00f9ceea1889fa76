"""Choose a remat policy for a memory budget, from XLA's compiled memory analysis.

Each policy's train step is compiled ahead of time (nothing runs) for its device bytes at the
requested batch, its FLOPs, and by search the largest batch within the budget. The choice is the
fastest policy that fits: by measured step time when given, else by compiled FLOPs (the
recomputation a policy pays), ties going to the earlier policy in ``REMAT_POLICIES``.
"""

import dataclasses

import jax

from jaxaccel.step.compiled import flops, memory_bytes
from jaxaccel.core.errors import ConfigError
from jaxaccel.data.loader import abstract_batch
from jaxaccel.core.sections import REMAT_POLICIES


@dataclasses.dataclass
class Plan:
    """The chosen policy, how it was chosen, and one row of figures per policy."""

    policy: str
    criterion: str          # "step_s" (measured) or "flops" (compiled)
    budget: int
    batch_size: int
    rows: list[dict]


def compile_step(train_step, abstract_state, batch_size: int, seq_len: int,
                 batch_sharding=None):
    """The train step compiled (state donated, as the loop runs it) for a batch shape, sharded
    as the state's ShapeDtypeStructs and ``batch_sharding`` say, when they say."""
    return jax.jit(train_step, donate_argnums=0).lower(
        abstract_state, abstract_batch((batch_size, seq_len), batch_sharding)).compile()


def largest_batch(total_at, budget: int, *, limit: int = 4096, hint: int = 2,
                  rounds: int = 6, multiple: int = 1) -> int:
    """The largest batch b <= limit with ``total_at(b) <= budget``; 0 if not even 1 fits. With
    ``multiple`` (the microbatch count: a batch must split into them) only its multiples are
    tried, and b is one.

    Memory grows nearly affinely with the batch, so secant guesses find it in a few compiles:
    the line through the bytes at 1 and ``hint`` (a batch whose bytes are known saves a
    compile), extrapolation while no batch is known not to fit, then regula falsi with the
    Illinois step between the largest that fits and the smallest that does not (a curved
    profile cannot stall it), each fitting guess followed by a probe of the next batch; after
    ``rounds`` guesses a binary search finishes. ``total_at`` is called once per batch.
    """
    if multiple > 1:
        return multiple * largest_batch(lambda units: total_at(units * multiple), budget,
                                        limit=limit // multiple, hint=max(hint // multiple, 1),
                                        rounds=rounds)
    known = {}
    lo, hi = 0, limit + 1     # lo fits (0: nothing yet); hi does not fit, or is past the limit

    def probe(b):
        nonlocal lo, hi
        if b not in known:
            known[b] = total_at(b)
        if known[b] <= budget:
            lo = max(lo, b)
        else:
            hi = min(hi, b)

    probe(1)
    if lo == 0:
        return 0
    if limit >= 2:
        probe(min(max(hint, 2), limit))
    stale = 0       # guesses in a row that left hi in place: halve its weight (Illinois)
    for _ in range(rounds):
        if hi - lo <= 1:
            return lo
        if hi <= limit:
            x0, y0 = lo, known[lo]
            x1, y1 = hi, budget + (known[hi] - budget) / 2 ** stale
        else:
            x0 = max(b for b in known if b <= max(lo // 2, 1))
            x0, y0, x1, y1 = x0, known[x0], lo, known[lo]
        slope = max((y1 - y0) / (x1 - x0), 1e-9)
        guess = min(max(x0 + int((budget - y0) // slope), lo + 1), hi - 1)
        before = hi
        probe(guess)
        if lo == guess and guess + 1 < hi:
            probe(guess + 1)
        stale = stale + 1 if hi == before <= limit else 0
    while hi - lo > 1:
        mid = (lo + hi) // 2 if hi <= limit else min(2 * lo, limit)
        if mid == lo:
            break
        probe(mid)
    return lo


def plan_remat(make_step, abstract_state, *, seq_len: int, batch_size: int, budget: int,
               policies=REMAT_POLICIES, step_seconds: dict | None = None,
               search: bool = True, multiple: int = 1, limit: int = 4096,
               batch_sharding=None) -> Plan:
    """Compile ``make_step(policy)`` for each policy and choose one that fits ``budget`` bytes.

    ``abstract_state``: the TrainState's ShapeDtypeStructs (with shardings and
    ``batch_sharding``, the bytes are per device). ``step_seconds`` maps policies to measured
    step times; without it FLOPs decide. With ``search`` each row also gets ``max_batch`` (the
    largest batch in budget among the multiples of ``multiple``, the microbatch count) and
    ``probed`` (the bytes at each batch compiled). ConfigError when no policy fits the batch.
    """
    if budget < 1:
        raise ConfigError(f"memory budget must be a positive number of bytes, got {budget}",
                          field="run.memory_budget")
    rows = []
    for policy in policies:
        step = make_step(policy)
        executables = {}

        def compiled(b, step=step, executables=executables):
            if b not in executables:
                executables[b] = compile_step(step, abstract_state, b, seq_len, batch_sharding)
            return executables[b]

        def total_at(b, compiled=compiled):
            return memory_bytes(compiled(b))["total"]

        at_batch = compiled(batch_size)
        memory = memory_bytes(at_batch)
        if not memory:
            raise ConfigError(f"the {jax.default_backend()} backend gives no compiled memory "
                              f"analysis to plan with; leave memory_budget unset and choose "
                              f"model.remat", field="run.memory_budget")
        rows.append({
            "policy": policy, "batch_size": batch_size, "temp_bytes": memory["temp"],
            "total_bytes": memory["total"], "host_bytes": memory["host_total"],
            "flops": flops(at_batch), "step_s": (step_seconds or {}).get(policy),
            "fits": memory["total"] <= budget,
            "max_batch": (largest_batch(total_at, budget, limit=limit, hint=batch_size,
                                        multiple=multiple) if search else None),
            "compiles": len(executables),
            "probed": {b: memory_bytes(e)["total"] for b, e in sorted(executables.items())}})
    policy, criterion = choose_policy(rows, budget, batch_size)
    return Plan(policy=policy, criterion=criterion, budget=budget, batch_size=batch_size,
                rows=rows)


def choose_policy(rows: list[dict], budget: int, batch_size: int) -> tuple[str, str]:
    """The fastest of the rows that fit, and the criterion: ``step_s`` when every fitting row
    has a timing, else ``flops``; ties go to the earlier row."""
    fitting = [r for r in rows if r["fits"]]
    if not fitting:
        least = min(rows, key=lambda r: r["total_bytes"])
        raise ConfigError(
            f"no remat policy fits batch {batch_size} in {budget:,} bytes (the leanest, "
            f"{least['policy']!r}, needs {least['total_bytes']:,}); lower the batch size or raise "
            f"memory_budget", field="run.memory_budget")
    criterion = "step_s" if all(r.get("step_s") is not None for r in fitting) else "flops"
    best = min(fitting, key=lambda r: (r[criterion] is None, r[criterion] or 0.0))
    return best["policy"], criterion


def choose_remat(make_step, abstract_state, shapes, budget: int, batch_sharding=None):
    """The policy a run's ``memory_budget`` chooses, and the plan: ``plan_remat`` at the run's
    batch shape with the most tokens (the longest among those), without the largest-batch
    search (``experiments.remat``'s), whose compiles would make too long a start for a run."""
    rows, seq_len = max(shapes, key=lambda shape: (shape[0] * shape[1], shape[1]))
    plan = plan_remat(make_step, abstract_state, seq_len=seq_len, batch_size=rows, budget=budget,
                      search=False, batch_sharding=batch_sharding)
    return plan.policy, plan
