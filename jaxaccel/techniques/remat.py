"""How a model's stack of blocks is compiled: remat by policy, and scanned layers.

``apply`` installs ``Remat`` on the model's ``nn.Stack``: each block, under ``jax.checkpoint``,
keeps what the ``--remat`` policy saves and recomputes the rest in the backward pass: ``none``
(no remat), ``full`` (its input), ``dots`` (matmul outputs without batch dimensions),
``attention`` (the tensors tagged ``query``, ``key``, ``value``, ``attention_out`` by
``nn.tag``), ``mlp`` (``mlp_in``, ``mlp_gate``), ``offload`` (attention's, in pinned host
memory; on jax 0.11's CPU backend it saves nothing) or ``save:NAME,NAME`` (the model's own
tags). ``check_tags`` refuses a policy whose tags the model never uses (it would act as full).

``--scan-layers`` stacks the blocks' variables on a leading layer axis and runs them with one
``lax.scan``: one block to compile instead of n (``nn.Stack.scan``).
"""

import jax

from jaxaccel.model import contract as model_lib, nn
from jaxaccel.step import trace
from jaxaccel.core.errors import ConfigError
from jaxaccel.core.sections import REMAT_POLICIES, RematSettings     # declared without jax

_ATTENTION = (nn.QUERY, nn.KEY, nn.VALUE, nn.ATTENTION_OUT)
POLICY_TAGS = {"attention": _ATTENTION, "mlp": (nn.MLP_IN, nn.MLP_GATE), "offload": _ATTENTION}


def tags(name: str) -> tuple[str, ...]:
    """The tensor names a policy keeps (empty for those that name none)."""
    if name.startswith("save:"):
        return tuple(t.strip() for t in name[5:].split(",") if t.strip())
    return POLICY_TAGS.get(name, ())


def policy(name: str):
    """The ``jax.checkpoint`` policy of a name (None: no remat); ConfigError if unknown."""
    if name == "none":
        return None
    if name == "full":
        return jax.checkpoint_policies.nothing_saveable
    if name == "dots":
        return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    if name == "offload":
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=(), names_which_can_be_offloaded=tags(name),
            offload_src="device", offload_dst="pinned_host")
    if name in POLICY_TAGS or (name.startswith("save:") and tags(name)):
        return jax.checkpoint_policies.save_only_these_names(*tags(name))
    raise ConfigError(f"unknown remat policy {name!r}; choose one of {', '.join(REMAT_POLICIES)} "
                      f"or save:NAME,NAME", field="remat.policy")


def check_policy(name: str) -> str:
    policy(name)
    return name


def check(cfg) -> None:
    check_policy(cfg.remat.policy)


class Remat(nn.BlockTransform):
    """Every block checkpointed under a named policy (innermost of the block transforms)."""

    order = 0

    def __init__(self, name: str):
        self.name = check_policy(name)

    def wrap(self, fn, variant, scanned: bool):
        if self.name == "none":
            return fn
        # Inside lax.scan the loop already keeps XLA from merging the recomputation with the
        # forward pass; the barrier would only cost speed.
        return jax.checkpoint(fn, policy=policy(self.name), prevent_cse=not scanned)


def apply(model, settings: RematSettings, *, check: bool = True) -> None:
    """Scan the model's stack (``scan_layers``) and install the remat policy on it. A policy that
    keeps tagged tensors first traces the model (nothing computed) and refuses, model unchanged,
    one whose tags it never names (``check_tags``); ``check=False`` leaves that to the caller
    (the loop reads the tags of the step it traces anyway, ``loop.preflight``)."""
    check_policy(settings.policy)
    if not settings.scan_layers and settings.policy == "none":
        return
    _, stack = nn.the_stack(
        model, "remat and scanned layers",
        "remat.scan_layers" if settings.scan_layers else "remat.policy")
    if check and tags(settings.policy):
        jaxpr = model_lib.forward_jaxpr(model, f"remat {settings.policy}", "remat.policy")
        check_tags(settings.policy, trace.tags(jaxpr))
    if settings.scan_layers:
        stack.scan()
    if settings.policy != "none":
        stack.add(Remat(settings.policy))


def check_tags(name: str, named: set[str]) -> None:
    """ConfigError when the policy keeps tagged tensors and the model's step names none of
    them (``named``: the tags found in it, ``jaxaccel.step.trace.tags``)."""
    wanted = tags(name)
    if wanted and not set(wanted) & named:
        found = f"it names {', '.join(sorted(named))}" if named else "it tags no tensor"
        raise ConfigError(
            f"remat {name} keeps the tensors tagged {', '.join(wanted)}, but the model's blocks "
            f"never tag them ({found}), so it would recompute everything like full; tag them "
            f"with jaxaccel.model.nn.tag, or choose full, dots or save:NAME", field="remat.policy")


def transform(model, cfg, ctx) -> None:
    apply(model, cfg.remat, check=False)     # preflight checks the traced step's tags


def report(cfg, ctx) -> dict | None:
    plan = ctx.run.get("remat_plan")
    if cfg.remat.policy == "none" and not cfg.remat.scan_layers and not plan:
        return None
    return {"policy": cfg.remat.policy, "scan_layers": cfg.remat.scan_layers, "plan": plan}


def check_model(cfg, model, tags: set) -> None:
    check_tags(cfg.remat.policy, tags)


def plan_for_budget(make_step, abstract_state, shapes, budget: int, batch_sharding=None):
    """(settings, plan): the remat policy a run's memory budget chooses (``planner``), with
    ``make_step(settings)`` the run's step under those settings."""
    from jaxaccel.techniques.planner import choose_remat
    policy, plan = choose_remat(lambda p: make_step({"remat.policy": p}), abstract_state, shapes,
                                budget, batch_sharding)
    return {"remat.policy": policy}, plan
