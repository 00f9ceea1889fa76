"""What a traced function computes, read from its jaxpr: the tags it names, the FLOPs of its
matmuls, and the matmuls it runs in float32.

Reading the traced program rather than a config holds for any model: a scanned body counts once
per iteration, remat'd and custom-gradient code is read through, and shapes are those the step
computes (token dropping's kept tokens, stochastic depth's kept rows).
"""

import contextlib
import math
import os

import jax
from jax.extend import core as jex_core

from jaxaccel.model.embedding import SKIP_SCOPE   # lookups that are matmuls only in form


def subjaxprs(value):
    """The jaxprs in an equation's parameter ``value`` (a call's body, a scan's)."""
    if isinstance(value, (jex_core.ClosedJaxpr, jex_core.Jaxpr)):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from subjaxprs(item)


def equations(jaxpr, times: int = 1):
    """``(equation, times)`` for every equation of ``jaxpr`` and the jaxprs inside it; ``times``
    is how often it runs (a scan's body runs ``length`` times)."""
    if isinstance(jaxpr, jex_core.ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    for eqn in jaxpr.eqns:
        yield eqn, times
        inner = times * eqn.params.get("length", 1) if eqn.primitive.name == "scan" else times
        for sub in subjaxprs(list(eqn.params.values())):
            yield from equations(sub, inner)


def from_inputs(jaxpr) -> list[bool]:
    """For each output of ``jaxpr`` (a ClosedJaxpr), whether it is computed from the inputs, not
    from constants alone (an equation's outputs count as computed from all its inputs: a call's
    body is not read through)."""
    reached = set(jaxpr.jaxpr.invars)
    for eqn in jaxpr.jaxpr.eqns:
        if any(isinstance(v, jex_core.Var) and v in reached for v in eqn.invars):
            reached.update(eqn.outvars)
    return [isinstance(v, jex_core.Var) and v in reached for v in jaxpr.jaxpr.outvars]


def tags(jaxpr) -> set[str]:
    """The names ``checkpoint_name`` (``nn.tag``) gives tensors in ``jaxpr``."""
    return {eqn.params["name"] for eqn, _ in equations(jaxpr) if eqn.primitive.name == "name"}


def _skipped(eqn) -> bool:
    return SKIP_SCOPE in str(eqn.source_info.name_stack)


def matmul_flops(jaxpr) -> float:
    """FLOPs of the matmuls (``dot_general``) ``jaxpr`` runs: 2 x output size x contracted size,
    times how often each runs; lookups under ``SKIP_SCOPE`` left out."""
    total = 0.0
    for eqn, times in equations(jaxpr):
        if eqn.primitive.name != "dot_general" or _skipped(eqn):
            continue
        (contract, _), _ = eqn.params["dimension_numbers"]
        lhs, out = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
        total += 2.0 * math.prod(out) * math.prod(lhs[d] for d in contract) * times
    return total


def float32_matmuls(jaxpr) -> list[str]:
    """Where ``jaxpr`` multiplies two float32 operands (``file:line (function)``, each once; a
    flax layer's line as ``flax's linear.py:422 (Linear.__call__)``: its ``dtype`` decides)."""
    import jax.numpy as jnp
    seen = {}                   # ordered, each once
    for eqn, _ in equations(jaxpr):
        if eqn.primitive.name == "dot_general" and not _skipped(eqn) and all(
                v.aval.dtype == jnp.float32 for v in eqn.invars[:2]):
            seen[_location(eqn)] = None
    return list(seen)


def _location(eqn) -> str:
    from jax._src import source_info_util
    frame = source_info_util.user_frame(eqn.source_info.traceback)
    if frame is None:
        return "an unknown line"
    where = f"{os.path.basename(frame.file_name)}:{frame.start_line} ({frame.function_name})"
    return f"{FLAX_LAYER}{where}" if _in_flax(frame.file_name) else where


FLAX_LAYER = "flax's "          # how float32_matmuls marks a line of flax's own layers


def _in_flax(file_name: str) -> bool:
    import flax
    return os.path.abspath(file_name).startswith(os.path.dirname(os.path.abspath(flax.__file__)))


@contextlib.contextmanager
def counting():
    """Inside: jaxaccel's attention traces as the XLA einsums, whatever a run uses."""
    from jaxaccel.model import attention
    with attention.as_xla():
        yield


def training_flops(fn, *args) -> float:
    """3 x the matmul FLOPs of the forward pass ``fn(*args)`` (forward, and the backward's two
    products per matmul), as MFU counts them."""
    with counting():
        jaxpr = jax.make_jaxpr(fn)(*args)
    return 3.0 * matmul_flops(jaxpr)
