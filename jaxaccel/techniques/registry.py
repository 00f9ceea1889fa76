"""The techniques a run's settings name, run through their records (``jaxaccel.core.sections``'s
TECHNIQUES, in order) and nowhere else: ``build`` transforms a model with each, ``check`` asks
each whether its settings fit the rest, ``report`` what each did. A technique's module offers
any of these functions (``<verb>_<record name>`` where one module serves two records, as
``lora`` serves LoRA and adapters):

- ``transform(model, cfg, ctx)``: change the model in place (``ctx``: a ``Context``);
- ``check(cfg)``: a ConfigError for settings it cannot run with (before any work);
- ``check_model(cfg, model, tags)``: the same for the run's abstract model and the tags its
  traced step names; ``device_note(cfg)``: a line on this device's support (or None);
- ``report(cfg, ctx)``: what it did, for the run's summary (None: it did nothing);
- ``describe(report)``: that report as a few words for the summary's model line;
- ``merge(model)`` and ``WRAPPERS``: its updates folded into the weights, and the classes it
  wraps layers in, which a base model's reading removes (``strip_model``);
- ``resume_values(cfg, total_steps)``: settings it derives that a resume must match;
- ``llama_blocker(cfg)`` and ``exported_settings(cfg, model)``: why it bars a Hugging Face
  Llama export (and the fix), and its settings in a merged model's native export;
- for the one technique of a run that has them: ``growth``, ``next_depth`` and ``grown`` (it
  grows the model between stages: progressive stacking), ``plan_for_budget`` (settings that
  fit a memory budget: remat's policy).

``build`` runs the records of each phase in turn: the factory's model, the ``init`` phase,
``--init-from``'s weights, the ``layers`` phase (LoRA, adapters, N:M sparsity, FP8), the compute
dtype, then the ``blocks`` phase (scan and remat, stochastic depth, token dropping).
"""

import dataclasses
import functools
import importlib

import jax
import jax.numpy as jnp
from flax import nnx

from jaxaccel.core.sections import PHASES, TECHNIQUES
from jaxaccel.core.sharding import pipelined
from jaxaccel.data import sampling
from jaxaccel.model import contract as model_lib
from jaxaccel.step import optim, precision
from jaxaccel.techniques import pipeline, stacking, surgery

LORA_KEY = 0x10A      # folded into the model's key for the fine-tuning weights' draws
# The sections of a run's settings that a resumed run must match, besides the techniques' own
BASE_RESUME_SECTIONS = ("model", "gpt", "optimizer", "precision")


@dataclasses.dataclass
class Context:
    """What a technique's ``transform`` or ``report`` may need besides the config."""

    key: jax.Array | None = None        # the model's key
    tune_key: jax.Array | None = None   # the fine-tuning weights' key
    full_layers: int | None = None      # the stack's depth once every stacking stage has grown
    params: object = None               # report: the trained variables
    mesh_shape: dict | None = None      # report: the mesh's axis sizes
    run: dict = dataclasses.field(default_factory=dict)    # report: what the loop measured


@functools.cache
def _module(name: str):
    return importlib.import_module(name)


def hooks(verb: str) -> list:
    """``(technique, function)`` for ``verb`` (``transform``, ``check``, ...) in the records'
    order: the module's ``<verb>_<name>``, else its ``<verb>``; each function once (a module
    serving two records with one function runs it for the first)."""
    found = {}
    for technique in TECHNIQUES:
        module = _module(technique.module)
        fn = getattr(module, f"{verb}_{technique.name}", None) or getattr(module, verb, None)
        if fn is not None and fn not in found:
            found[fn] = technique
    return [(technique, fn) for fn, technique in found.items()]


def build(cfg, key, *, depth: int | None = None, base_state=None) -> nnx.Module:
    """The model of ``cfg`` (a ``TrainConfig``) from ``key`` with its techniques; ``depth`` cuts
    its stack (a stacking stage); ``base_state`` replaces its weights before the ``layers``
    phase (a fine-tune's base)."""
    model = model_lib.build(cfg.model, cfg.gpt, key)
    optim.mark_no_decay(model)
    full_layers = stacking.truncate(model, depth) if depth is not None else None
    ctx = Context(key=key, tune_key=jax.random.fold_in(key, LORA_KEY), full_layers=full_layers)
    compute_dtype = cfg.policy().compute_dtype
    transforms = hooks("transform")
    for phase in PHASES:
        if phase == "layers" and base_state is not None:
            nnx.update(model, base_state)
        if phase == "blocks" and compute_dtype != jnp.float32:
            precision.compute_in(model, compute_dtype)
        for technique, transform in transforms:
            if technique.phase == phase:
                transform(model, cfg, ctx)
    return model


def abstract(cfg, **kwargs) -> nnx.Module:
    """``build`` with ShapeDtypeStructs for arrays, to check the model before any work."""
    return model_lib.abstract(lambda: build(cfg, jax.random.PRNGKey(0), **kwargs))


def variables(cfg, depth: int | None = None):
    """``make(key, *base) -> nnx.State`` of ``build``, for the sharded initialisation."""
    def make(key, *base):
        return nnx.state(build(cfg, key, depth=depth, base_state=base[0] if base else None))
    return make


def check(cfg) -> None:
    """Each technique, and importance sampling, checks its settings and what it cannot join."""
    for _, fn in hooks("check"):
        fn(cfg)
    sampling.check(cfg)


def device_notes(cfg) -> dict:
    """What each technique has to say of this device before any work (``device_note``: fp8's,
    that emulated FP8 is no faster), as ``{"<name>_note": text}``."""
    return {f"{technique.name}_note": fn(cfg) for technique, fn in hooks("device_note")}


def check_model(cfg, model, tags: set) -> None:
    """Each technique's checks of the run's abstract model and of the tags its traced step
    names (``check_model``), a ConfigError line for what does not fit."""
    for _, fn in hooks("check_model"):
        fn(cfg, model, tags)


def report(cfg, params, mesh_shape: dict, run: dict) -> dict:
    """What each technique the run used did, for its summary (``run``: what the loop measured),
    by record name; the attention, a base run, pipeline stages and sampling besides."""
    done = {"attention": (cfg.gpt.attention or "xla") if model_lib.is_preset(cfg.model.name)
            else None}
    ctx = Context(params=params, mesh_shape=mesh_shape, run=run)
    for technique, fn in hooks("report"):
        done[technique.name] = fn(cfg, ctx)
    if done.get("lora") is None and cfg.run.init_from:    # a base run, but no fine-tune
        done["init_from"] = cfg.run.init_from
    if pipelined(cfg.mesh.strategy):
        done["pipeline"] = {"schedule": cfg.mesh.pipeline_schedule,
                            "bubble": pipeline.bubble_fraction(mesh_shape["stage"],
                                                               cfg.optimizer.accumulate)}
    if cfg.data.sampling != "uniform":
        done["sampling"] = cfg.data.sampling
    return {k: v for k, v in done.items() if v is not None}


def describe(techniques: dict) -> list[str]:
    """The summary's words for what each technique did (``report``'s mapping), in order."""
    return [fn(techniques[technique.name]) for technique, fn in hooks("describe")
            if technique.name in techniques]


def wrappers() -> tuple:
    """Every class a technique wraps a model's layers in (``WRAPPERS``)."""
    return tuple(dict.fromkeys(w for t in TECHNIQUES
                               for w in getattr(_module(t.module), "WRAPPERS", ())))


def merge(model) -> None:
    """Each technique's updates folded into the weights they update (``merge``: LoRA's), in
    place, where that computes the same."""
    for _, fn in hooks("merge"):
        fn(model)


def strip_model(model) -> None:
    """A trained model as a base to fine-tune: ``merge``d and every technique's wrappers
    removed, in place."""
    merge(model)
    surgery.unwrap(model, wrappers())


def llama_blockers(cfg) -> list[tuple[str, str]]:
    """(why, fix) of each technique whose settings bar a Hugging Face Llama export
    (``llama_blocker``)."""
    found = [fn(cfg) for _, fn in hooks("llama_blocker")]
    return [reason for reason in found if reason is not None]


def exported_settings(cfg, model) -> dict:
    """The settings each technique gives a ``merge``d model's native export
    (``exported_settings``: LoRA's rank, 0 once merged)."""
    return {k: v for _, fn in hooks("exported_settings") for k, v in fn(cfg, model).items()}


def _only(verb: str, cfg=None):
    """The function for ``verb`` of the one technique that has it (on in ``cfg``, if given)."""
    found = [(t, fn) for t, fn in hooks(verb) if cfg is None or t.is_on(cfg)]
    if len(found) > 1:
        raise ValueError(f"techniques {[t.name for t, _ in found]} all offer {verb!r}; "
                         f"a run has one")
    return found[0][1] if found else None


def growth(cfg, model, total_steps: int, first_step: int):
    """(full depth, steps at which the model grows, depth at ``first_step``) of the technique
    that grows the model during a run (``growth``: progressive stacking's), else None, [],
    None."""
    fn = _only("growth", cfg)
    return fn(cfg, model, total_steps, first_step) if fn else (None, [], None)


def stage_end(step: int, total_steps: int, ends: list[int]) -> int:
    """The step at which the stage training ``step`` ends: the next of ``growth``'s ends, or
    the run's end."""
    return stacking.stage_end(step, total_steps, ends)


def next_depth(cfg, depth: int) -> int:
    """The depth the model grows to at a growth step from ``depth``."""
    return _only("next_depth", cfg)(depth)


def grown(cfg, old_state, new_abstract, old_depth: int, model):
    """The grown model's state: ``new_abstract`` (its abstract state; ``model`` the grown
    model) filled from ``old_state``, the state at ``old_depth``."""
    return _only("grown", cfg)(old_state, new_abstract, old_depth, model)


def plan_for_budget(make_step, abstract_state, shapes, budget: int, batch_sharding=None):
    """(settings, plan) that fit a run's memory budget (``plan_for_budget``: remat's policy),
    ``make_step(settings)`` being the run's step under other settings."""
    return _only("plan_for_budget")(make_step, abstract_state, shapes, budget, batch_sharding)


def resume_values(cfg, total_steps: int) -> dict:
    """The settings a resumed run must match that each technique derives (``resume_values``)."""
    return {k: v for _, fn in hooks("resume_values") for k, v in fn(cfg, total_steps).items()}


def resume_sections() -> tuple:
    """The sections a resumed run must match: the model's and the step's, and each technique's
    whose record says so."""
    return BASE_RESUME_SECTIONS + tuple(t.name for t in TECHNIQUES if t.resume)


def stripped() -> dict:
    """The settings that build a fine-tune's base model: float32, and every technique whose
    record strips it off."""
    return {"precision.policy": "fp32",
            **{k: v for t in TECHNIQUES if t.strip for k, v in t.off_values().items()}}
