"""Every technique's contract on jaxaccel's GPT and on a model it did not write
(``tests/foreign_model.py``): identity at initialisation, scanned equals unrolled, a checkpoint
round trip, training with each technique, sharded equals one device (8 simulated devices), what a
model lacks as one line before any work, and the three settings that once did nothing silently."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import run_multidevice
from jaxaccel.model import contract as model_lib, nn
from jaxaccel.step import optim, precision, trace
from jaxaccel.techniques import remat, registry as techniques
from jaxaccel.run.config import build, override
from jaxaccel.core.errors import ConfigError
from jaxaccel.data.loader import abstract_batch
from jaxaccel.run.loop import train

HERE = os.path.dirname(os.path.abspath(__file__))
FOREIGN = os.path.join(HERE, "foreign_model.py") + ":make"
NO_STACK = os.path.join(HERE, "foreign_model.py") + ":make_no_stack"
MODELS = {
    "gpt": {"model.name": "tiny", "gpt.d_model": 32, "gpt.n_layers": 2, "gpt.n_heads": 2},
    "foreign": {"model.name": FOREIGN},
}
# The layers each technique wraps on the foreign model, which declares no defaults.
FOREIGN_TARGETS = {"adapters.targets": "out,down", "init.gates": "out,down"}


def config(name: str, corpus_path=None, tmp_path=None, **values):
    """A small run of model ``name`` ("gpt" or "foreign") with these settings."""
    base = {**MODELS[name], "model.max_seq_len": 32, "data.seq_len": 32, "data.batch_size": 4,
            "run.steps": 2, "run.log_every": 1, "run.eval_every": 0, "run.progress": False,
            "run.final_eval_batches": 1, "run.checkpoint_every": 0,
            "optimizer.warmup_steps": 1}
    if name == "foreign":
        base.update({k: v for k, v in FOREIGN_TARGETS.items()})
    if corpus_path is not None:
        base.update({"data.path": corpus_path, "data.cache_dir": str(tmp_path / "cache"),
                     "run.run_dir": str(tmp_path / "run")})
    return build(values={**base, **values})


def batch(rows=2, T=32, seed=0):
    ids = jax.random.randint(jax.random.PRNGKey(seed), (rows, T), 3, 200)
    return {**model_lib.sequence_batch(ids), "targets": jnp.roll(ids, -1, axis=1),
            "weights": jnp.ones((rows, T), jnp.float32)}


def logits(cfg, key=jax.random.PRNGKey(0), step_key=None, **build_kwargs):
    model = techniques.build(cfg, key, **build_kwargs)
    graphdef, state = nnx.split(model)
    return model_lib.make_apply(graphdef)(state, batch(), step_key)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("technique", [{"lora.rank": 4}, {"adapters.dim": 8}])
def test_fine_tuning_starts_as_the_base_model(name, technique):
    base = logits(config(name))
    tuned = logits(config(name, **technique, **{"run.init_from": None}))
    np.testing.assert_array_equal(np.asarray(tuned), np.asarray(base))


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("scheme", ["rezero", "skipinit"])
def test_gated_blocks_start_as_the_identity(name, scheme):
    model = techniques.build(config(name, **{"init.scheme": scheme}), jax.random.PRNGKey(0))
    graphdef, state = nnx.split(model)
    parts = model_lib.parts(graphdef, state)
    x, token_args = parts.embed(state, batch())
    stack_state = model_lib.stack_of(state, parts.stack_path)
    y = parts.blocks(stack_state, x, token_args, batch(), None, 0, None)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    assert not [p for p, n in nnx.iter_graph(model) if isinstance(n, (nnx.LayerNorm,
                                                                        nnx.RMSNorm))
                and p[:len(parts.stack_path)] == parts.stack_path]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("extra", [{}, {"stochastic_depth.rate": 0.5, "token_drop.keep": 0.5,
                                        "token_drop.layers": "1:2"}])
def test_scanned_equals_unrolled(name, extra):
    cfg = config(name, **extra)
    key = jax.random.PRNGKey(3)
    unrolled = logits(cfg, step_key=key)
    scanned = logits(override(cfg, {"remat.scan_layers": True, "remat.policy": "full"}),
                     step_key=key)
    np.testing.assert_allclose(np.asarray(scanned), np.asarray(unrolled), rtol=1e-5, atol=1e-5)


# Each technique trains (finite losses, the technique reported) on both models. Several share a
# run to keep the suite short, and the runs serve the tests after them too: "layers" saves the
# checkpoints that "blocks" fine-tunes with LoRA and adapters (``run.init_from``), that the
# old-format test rewrites, and (on the foreign model) that the round trip resumes against.
# "layers" and "blocks" train one-block models (``ONE_BLOCK``; a second block was a third of their
# compiles): the techniques act on each block alike, and scanned equals unrolled over two blocks
# above; "init" grows two blocks from one (progressive stacking).
RUNS = {
    "layers": {"precision.policy": "fp8", "sparsity.pattern": "2:4", "sparsity.every": 1,
               "init.scheme": "rezero", "remat.policy": "mlp", "run.checkpoint_every": 2},
    # LoRA and adapters on the "layers" run's weights; ReZero as that run had it (its gates are
    # part of the weights a fine-tune starts from).
    "blocks": {"remat.scan_layers": True, "remat.policy": "attention",
               "stochastic_depth.rate": 0.5, "token_drop.keep": 0.5,
               "token_drop.layers": "0:1", "token_drop.score": "loss",
               "optimizer.accumulate": 2, "lora.rank": 2, "adapters.dim": 4,
               "init.scheme": "rezero"},
    "init": {"init.scheme": "tfixup", "precision.policy": "fp16", "data.batching": "pack",
             "stacking.stages": 2},
}
ONE_BLOCK = {"gpt": {"gpt.n_layers": 1}, "foreign": {"model.args": "depth: 1"}}
# The foreign model's "layers" run is also the uninterrupted run of the checkpoint round trip:
# 4 steps, a checkpoint every 2, and token dropping's running losses in its state.
ROUND_TRIP = {"token_drop.keep": 0.5, "token_drop.layers": "0:1", "token_drop.score": "loss",
              "run.steps": 4}


def run_config(name, run, corpus_path=None, tmp_path=None):
    """The config of ``RUNS[run]`` on model ``name``, in ``tmp_path``."""
    extra = {} if run == "init" else ONE_BLOCK[name]
    if (name, run) == ("foreign", "layers"):
        extra = {**extra, **ROUND_TRIP}
    return config(name, corpus_path, tmp_path, **RUNS[run], **extra)


@pytest.fixture(scope="module")
def trained(corpus_path, tmp_path_factory):
    """``trained(name, run)``: the summary of ``RUNS[run]`` on model ``name``, trained once, when
    a test first asks for it ("blocks" trains "layers" first: it starts from its weights)."""
    root = tmp_path_factory.mktemp("runs")
    summaries = {}

    def get(name, run):
        if (name, run) not in summaries:
            cfg = run_config(name, run, corpus_path, root / f"{name}-{run}")
            if run == "blocks":
                cfg = override(cfg, {"run.init_from": get(name, "layers").run_dir})
            summaries[name, run] = train(cfg)
        return summaries[name, run]
    return get


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("run", RUNS)
def test_every_technique_trains(name, run, trained):
    summary = trained(name, run)
    assert summary.steps == run_config(name, run).run.steps
    assert np.isfinite(summary.val_loss) and summary.val_tokens > 0
    assert summary.diverged_at_step is None
    done = summary.techniques
    if run == "layers":
        assert done["sparsity"]["density"] == 0.5 and "fp8" in done and done["init"] == "rezero"
    if run == "blocks":
        assert done["remat"] == {"policy": "attention", "scan_layers": True, "plan": None}
        assert 0 < done["stochastic_depth"]["kept"] < 1 and done["token_drop"]["keep"] == 0.5
    if run == "init":
        assert done["init"] == "tfixup" and [d for _, d in done["stacking"]["stages"]] == [1, 2]


@pytest.mark.parametrize("name", MODELS)
def test_lora_and_adapters_train_only_their_weights(name, trained):
    """The "blocks" run, LoRA and adapters on the "layers" run's weights, trains fewer
    parameters than the model has."""
    tuned = trained(name, "blocks")
    assert tuned.techniques["lora"]["init_from"] == trained(name, "layers").run_dir
    assert 0 < tuned.trainable_params < tuned.params
    assert np.isfinite(tuned.val_loss)


def test_checkpoint_round_trip_with_technique_state(trained, corpus_path, tmp_path):
    """A run of the foreign model paused and resumed ends bitwise where an uninterrupted one
    does, FP8 histories, N:M masks and token dropping's running losses included (jaxaccel's
    GPT: tests/test_loop.py). The uninterrupted run is the foreign model's "layers" run."""
    whole = trained("foreign", "layers")
    paused = run_config("foreign", "layers", corpus_path, tmp_path)
    assert paused.run.steps == 4 and paused.run.checkpoint_every == 2
    assert train(override(paused, {"run.stop_at": "2"})).stopped_at == 2
    resumed = train(override(paused, {"run.resume": True}))
    assert resumed.val_loss == whole.val_loss

    def losses(run_dir):
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            return [r["loss"] for r in map(json.loads, f) if r["kind"] == "train"]
    assert len(losses(whole.run_dir)) == 4
    assert losses(resumed.run_dir) == losses(whole.run_dir)


def test_an_old_checkpoint_is_one_line(trained, tmp_path):
    import shutil

    from jaxaccel.run.checkpoint import Checkpointer
    copy = tmp_path / "old"
    shutil.copytree(os.path.join(trained("gpt", "layers").run_dir, "checkpoints"), copy)
    latest = max(int(p.name) for p in copy.iterdir() if p.name.isdigit())
    meta = copy / str(latest) / "meta" / "metadata"
    record = json.loads(meta.read_text())
    record.pop("format")
    meta.write_text(json.dumps(record))
    with pytest.raises(ConfigError, match="format 1"):
        Checkpointer(str(copy)).restore(None, config={})


@pytest.mark.parametrize("part", range(4))
def test_sharded_equals_one_device(part):
    """tests/multidevice/test_any_model.py on 8 simulated devices, in 4 parts (a process each,
    about 15 s of CPU; in 3 the first part took 23 s)."""
    run_multidevice("tests/multidevice/test_any_model.py", part, 4)


# ---------------------------------------------------------------------------------------------
# What a model lacks: one line, before any work.

@pytest.mark.parametrize("setting, field", [
    ({"stochastic_depth.rate": 0.5}, "stochastic_depth.rate"),
    ({"remat.scan_layers": True}, "remat.scan_layers"),
    ({"token_drop.keep": 0.5}, "token_drop.keep"),
    ({"init.scheme": "rezero"}, "init.scheme"),
])
def test_a_block_technique_on_a_model_without_a_stack(setting, field):
    cfg = build(values={"model.name": NO_STACK, "model.max_seq_len": 32, **setting})
    with pytest.raises(ConfigError, match="no jaxaccel.model.nn.Stack") as caught:
        techniques.abstract(cfg)
    assert caught.value.field == field


def test_a_layer_technique_without_targets_names_the_setting():
    cfg = build(values={"model.name": FOREIGN, "adapters.dim": 4, "model.max_seq_len": 32})
    with pytest.raises(ConfigError, match="no default layers for adapters") as caught:
        techniques.abstract(cfg)
    assert caught.value.field == "adapters.targets"
    cfg = build(values={"model.name": FOREIGN, "lora.rank": 2, "lora.targets": "wq,wv",
                        "model.max_seq_len": 32})
    with pytest.raises(ConfigError, match="'wq' matches none of the model's linear layers"):
        techniques.abstract(cfg)


@pytest.mark.parametrize("spec, message", [
    ("missing_file.py:make", "does not exist"),
    (FOREIGN.replace(":make", ":nothing"), "has no function 'nothing'"),
    ("no_such_package_x.module:make", "importing no_such_package_x.module failed"),
])
def test_a_model_that_cannot_load_is_one_line(spec, message):
    with pytest.raises(ConfigError, match=message):
        techniques.abstract(build(values={"model.name": spec}))


@pytest.mark.parametrize("args, expected", [
    ("width: 64, depth: 4", {"width": 64, "depth": 4}), ("{width: 64}", {"width": 64}),
    ("width: 64\ndepth: 2", {"width": 64, "depth": 2}), ("3", None), ("a b", None)])
def test_model_args_are_a_yaml_mapping_braces_optional(args, expected):
    cfg = build(values={"model.name": FOREIGN, "model.args": args}).model
    if expected is None:
        with pytest.raises(ConfigError, match="not a mapping of names to values"):
            model_lib.factory_args(cfg)
    else:
        assert model_lib.factory_args(cfg) == expected


def test_a_gpt_field_with_a_factory_is_refused():
    with pytest.raises(ConfigError, match="--model-args") as caught:
        techniques.abstract(build(values={"model.name": FOREIGN, "gpt.d_model": 64}))
    assert caught.value.field == "gpt.d_model"


def test_a_model_with_the_wrong_vocabulary_is_one_line():
    cfg = build(values={"model.name": FOREIGN, "model.max_seq_len": 32})
    model = techniques.abstract(cfg)
    with pytest.raises(ConfigError, match=r"not logits \[2, 8, 999\]"):
        model_lib.check(model, FOREIGN, vocab_size=999, packed=False)


# ---------------------------------------------------------------------------------------------
# The settings that once did nothing silently.

class Untagged(nnx.Module):
    """Blocks in a Stack, but no tensor tagged for remat."""

    def __init__(self, vocab_size, max_seq_len, *, rngs):
        self.emb = nnx.Embed(vocab_size, 16, rngs=rngs)
        self.blocks = nn.Stack([nnx.Linear(16, 16, rngs=rngs) for _ in range(2)])
        self.head = nnx.Linear(16, vocab_size, rngs=rngs)

    def __call__(self, inputs, positions=None, segment_ids=None):
        return self.head(self.blocks(self.emb(inputs)))


class Float32Matmul(Untagged):
    """Multiplies by a float32 constant inside its forward pass."""

    def __call__(self, inputs, positions=None, segment_ids=None):
        x = self.emb(inputs) @ jnp.eye(16, dtype=jnp.float32)
        return self.head(self.blocks(x))


def traced(model, cfg):
    graphdef, state = nnx.split(model)
    apply = precision.cast(model_lib.make_apply(graphdef), cfg.policy())
    return jax.make_jaxpr(apply)(state, dict(abstract_batch((2, 8))), jax.random.PRNGKey(0))


def test_a_remat_policy_whose_tags_the_model_never_names_is_an_error():
    model = Untagged(320, 32, rngs=nnx.Rngs(0))
    named = trace.tags(traced(model, build()))
    assert named == set()
    with pytest.raises(ConfigError, match="never tag them") as caught:
        remat.check_tags("attention", named)
    assert caught.value.field == "remat.policy"
    remat.check_tags("full", named)
    remat.check_tags("attention", trace.tags(traced(techniques.abstract(config("foreign")),
                                                    build())))


def test_a_16_bit_policy_computes_every_matmul_in_16_bits():
    """nnx.Embed returns float32 unless its dtype is set: the policy sets it (precision.
    compute_in), so no matmul of the foreign model stays float32; a model that multiplies by a
    float32 constant gets a warning naming the line."""
    cfg = config("foreign", **{"precision.policy": "bf16"})
    assert trace.float32_matmuls(traced(techniques.abstract(cfg), cfg)) == []
    model = Float32Matmul(320, 32, rngs=nnx.Rngs(0))
    precision.compute_in(model, jnp.bfloat16)
    where = trace.float32_matmuls(traced(model, cfg))
    warning = precision.float32_warning(where, cfg.policy())
    assert warning and "test_any_model.py" in warning and "__call__" in warning


def test_the_decay_mask_follows_rank_type_and_metadata_not_names():
    model = techniques.abstract(config("foreign"))
    mask = optim.decay_mask(nnx.state(model))
    assert not mask["tok_emb"]["embedding"] and not mask["pos_emb"]["embedding"]
    block = mask["layers"]["layers"][0]
    assert block["qkv"]["kernel"] and block["down"]["kernel"]
    assert not block["qkv"]["bias"] and not block["ln1"]["scale"]
    scanned = techniques.abstract(config("foreign", **{"remat.scan_layers": True}))
    block = optim.decay_mask(nnx.state(scanned))["layers"]["layers"]
    assert block["qkv"]["kernel"] and not block["ln1"]["scale"] and not block["qkv"]["bias"]


def test_dropout_of_nnx_layers_draws_per_step_and_layer_and_is_off_in_evaluation():
    cfg = config("foreign", **{"model.args": "dropout: 0.5"})
    model = techniques.build(cfg, jax.random.PRNGKey(0))
    graphdef, state = nnx.split(model)
    apply = model_lib.make_apply(graphdef)
    a, b = (apply(state, batch(), jax.random.PRNGKey(k)) for k in (1, 2))
    assert not np.allclose(a, b)
    np.testing.assert_array_equal(apply(state, batch(), jax.random.PRNGKey(1)), a)
    evaluation = model_lib.make_apply(model_lib.eval_graphdef(graphdef, state))
    np.testing.assert_array_equal(evaluation(state, batch()), evaluation(state, batch()))


def test_sampling_without_a_cache_gives_the_cached_tokens():
    """A model without ``init_cache``/``decode`` samples by recomputing the prefix: the same
    greedy tokens as jaxaccel's GPT's key/value cache."""
    from jaxaccel.outputs import generate
    model = techniques.build(config("gpt"), jax.random.PRNGKey(0))

    class Plain(nnx.Module):
        def __init__(self, inner):
            self.inner = inner

        def __call__(self, *args, **kwargs):
            return self.inner(*args, **kwargs)

    prompt = jnp.arange(3, 8, dtype=jnp.int32)[None]
    cached = generate.generate(model, prompt, max_new_tokens=6, context=32)
    plain = Plain(model)
    assert not generate.cached(plain)
    recomputed = generate.generate(plain, prompt, max_new_tokens=6, context=32)
    np.testing.assert_array_equal(np.asarray(cached), np.asarray(recomputed))


@pytest.mark.parametrize("name", MODELS)
def test_lora_under_sparsity_folds_exactly_and_under_fp8_stays(name):
    """N:M masks fold into the kernel before the LoRA update does (the dense model computes what
    trained); under FP8 a folded update would be quantised as it never trained, so it stays."""
    from jaxaccel.techniques import lora, surgery
    cfg = config(name, **{"lora.rank": 2, "lora.targets": "blocks", "sparsity.pattern": "2:4"})
    model = techniques.build(cfg, jax.random.PRNGKey(0))
    for _, layer in surgery.wrappers(model, lora.LoRA):      # a non-zero update
        layer.lora_b[...] = jax.random.normal(jax.random.PRNGKey(1), layer.lora_b.shape) * 0.1
    graphdef, state = nnx.split(model)
    before = model_lib.make_apply(graphdef)(state, batch())
    assert lora.merge(model) == 0                           # every LoRA sits under a mask
    surgery.unwrap(model)
    graphdef, state = nnx.split(model)
    np.testing.assert_allclose(np.asarray(model_lib.make_apply(graphdef)(state, batch())),
                               np.asarray(before), rtol=2e-5, atol=2e-5)
    tuned = techniques.build(override(cfg, {"sparsity.pattern": "none",
                                            "precision.policy": "fp8"}), jax.random.PRNGKey(0))
    assert lora.merge(tuned) == 0 and surgery.wrappers(tuned, lora.LoRA)
    plain = techniques.build(override(cfg, {"sparsity.pattern": "none"}), jax.random.PRNGKey(0))
    assert lora.merge(plain) > 0 and not surgery.wrappers(plain, lora.LoRA)
