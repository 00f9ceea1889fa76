"""Progressive layer stacking (Gong et al. 2019, "Efficient Training of BERT by Progressively
Stacking"): train a shallow model, then double its depth by stacking a copy of its trained blocks
on top (new block ``L + i`` starts as block ``i``), and go on training.

``--progressive-stack S`` trains S stages of depth ``L / 2^(S-1)``, twice that, ..., ``L``, growing
at ``--stack-at`` (default: equal shares of the run). A stage's model is the full model with its
``nn.Stack`` cut to its first blocks (``truncate``, before other techniques). The optimizer's step
count and moments (copied with their blocks) and the loader carry over; a stage's last checkpoint
holds the shallow state, so a resumed run rebuilds its step's depth (``depth_at``).
"""

import re

import jax
import jax.numpy as jnp
from flax import nnx

from jaxaccel.model import nn
from jaxaccel.core.errors import ConfigError
from jaxaccel.core.sections import StackingSettings     # declared without jax
from jaxaccel.core.sharding import refuse_pipeline


def check(cfg) -> None:
    """What progressive stacking cannot combine with: pipeline stages."""
    if cfg.stacking.stages > 1:
        refuse_pipeline(cfg.mesh.strategy, "progressive stacking", "stacking.stages")


def truncate(model, depth: int) -> int:
    """Cut the model's stack to its first ``depth`` blocks, in place; the depth it had."""
    _, stack = nn.the_stack(model, "progressive stacking", "stacking.stages")
    full = len(stack)
    if depth < full:
        stack.layers = nnx.List(list(stack.layers)[:depth])
    return full


def depths(n_layers: int, stages: int) -> list[int]:
    """The depth of each stage: halvings of ``n_layers``, the last being ``n_layers``."""
    if stages < 1:
        raise ConfigError(f"progressive_stack must be at least 1 (1 = off), got {stages}",
                          field="stacking.stages")
    first = n_layers // 2 ** (stages - 1)
    if first < 1 or first * 2 ** (stages - 1) != n_layers:
        raise ConfigError(
            f"progressive_stack={stages} halves n_layers={n_layers} {stages - 1} times, which "
            f"does not divide it; use n_layers divisible by {2 ** (stages - 1)} or fewer stages",
            field="stacking.stages")
    return [first * 2 ** s for s in range(stages)]


def check_copies(stack, stage_depths: list[int]) -> None:
    """A ConfigError unless each block a growth copies into is of the class and structure of the
    block it copies (``nn.block_difference``): new block ``i`` starts as old block ``i mod d``."""
    if stack.scanned:       # scanning checked that every block has block 0's structure
        return
    blocks = list(stack.layers)
    for depth, grown in zip(stage_depths, stage_depths[1:]):
        for i in range(depth, grown):
            why = nn.block_difference(blocks[i % depth], blocks[i])
            if why:
                raise ConfigError(
                    f"progressive_stack starts block {i} of the grown stack as a copy of block "
                    f"{i % depth}, but block {i} differs from it: "
                    f"{why.replace('block 0', f'block {i % depth}')}; the copy would compute "
                    f"another function: give the stack blocks of one class and structure"
                    + (f" (or a pattern repeating every {depth} blocks)" if depth > 1 else "")
                    + ", or fewer stages", field="stacking.stages")


def boundaries(total_steps: int, stages: int, stack_at: str | None = None) -> list[int]:
    """The steps at which the depth doubles (``stages - 1`` of them, increasing, inside the
    run): ``stack_at``'s comma-separated steps, or equal shares of ``total_steps``."""
    if stages == 1:
        return []
    if stack_at:
        try:
            steps = [int(s) for s in stack_at.split(",") if s.strip()]
        except ValueError:
            steps = []
    else:
        steps = [round(total_steps * s / stages) for s in range(1, stages)]
    if (len(steps) != stages - 1 or sorted(set(steps)) != steps or steps[0] < 1
            or steps[-1] >= total_steps):
        raise ConfigError(
            f"stack_at={stack_at!r} must give {stages - 1} increasing steps between 1 and "
            f"{total_steps - 1} (the run has {total_steps} steps); e.g. "
            f"{','.join(str(round(total_steps * s / stages)) for s in range(1, stages))}",
            field="stacking.at")
    return steps


def depth_at(step: int, n_layers: int, stages: int, ends: list[int]) -> int:
    """The depth of the state at ``step``: a stage's end step still holds its (shallow) state."""
    return depths(n_layers, stages)[sum(step > end for end in ends)]


def stage_end(step: int, total_steps: int, ends: list[int]) -> int:
    """The step at which the stage training ``step`` ends (the next growth, or the run's end)."""
    return next((end for end in ends if end > step), total_steps)


def grow(old_state, new_abstract, old_depth: int, stack_path: tuple):
    """The state of the model twice as deep: each leaf of ``new_abstract`` (its abstract
    TrainState) from ``old_state``'s at the same path, block ``i`` of the stack at ``stack_path``
    from old block ``i mod old_depth`` (stacked blocks doubled), optimizer state included."""
    prefix = re.escape("".join(f"[{k!r}]" for k in (*stack_path, "layers")))
    indexed = re.compile("(" + prefix + r")\[(\d+)\]")
    old = {jax.tree_util.keystr(path): leaf
           for path, leaf in jax.tree_util.tree_flatten_with_path(old_state)[0]}
    new_leaves, treedef = jax.tree_util.tree_flatten_with_path(new_abstract)

    def take(path, target):
        name = indexed.sub(lambda m: f"{m.group(1)}[{int(m.group(2)) % old_depth}]",
                           jax.tree_util.keystr(path))
        leaf = old[name]
        if leaf.shape != target.shape:                     # stacked blocks [L, ...] -> [2L, ...]
            if leaf.shape[1:] != target.shape[1:] or target.shape[0] != 2 * leaf.shape[0]:
                raise ValueError(f"cannot grow {name}: {leaf.shape} -> {target.shape}")
            return jnp.concatenate([leaf, leaf])
        return jnp.array(leaf, copy=True)    # a block's copies are separate (donated) buffers

    return jax.tree_util.tree_unflatten(treedef,
                                        [take(path, target) for path, target in new_leaves])


def report(cfg, ctx) -> dict | None:
    """The stages' (first step, depth)."""
    return {"stages": ctx.run.get("stages")} if cfg.stacking.stages > 1 else None


def describe(report: dict) -> str:
    return "stacked " + " -> ".join(f"{depth} layers at step {start}"
                                    for start, depth in report["stages"])


def check_model(cfg, model, tags: set) -> None:
    """A stack whose depth the stages halve, grown by copies of its blocks."""
    if cfg.stacking.stages > 1:
        stack = nn.the_stack(model, "progressive stacking", "stacking.stages")[1]
        check_copies(stack, depths(len(stack), cfg.stacking.stages))


def growth(cfg, model, total_steps: int, first_step: int):
    """(full depth, steps at which the depth doubles, depth at ``first_step``) of a run of
    ``model`` (its full depth); the depths None without stacking."""
    stages = cfg.stacking.stages
    ends = boundaries(total_steps, stages, cfg.stacking.at)
    if stages == 1:
        return None, ends, None
    full = len(nn.the_stack(model, "progressive stacking")[1])
    return full, ends, depth_at(first_step, full, stages, ends)


def next_depth(depth: int) -> int:
    return 2 * depth


def grown(old_state, new_abstract, old_depth: int, model):
    """``grow`` into ``model``'s stack (the deeper model of ``new_abstract``)."""
    return grow(old_state, new_abstract, old_depth, nn.the_stack(model, "progressive stacking")[0])


def resume_values(cfg, total_steps: int) -> dict:
    """The steps at which the depth doubles: a resumed run must grow at the same ones."""
    if cfg.stacking.stages == 1:
        return {}
    return {"stacking.at": boundaries(total_steps, cfg.stacking.stages, cfg.stacking.at)}
