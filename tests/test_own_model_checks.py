"""A model of one's own that is wrong in a way training would not show: each case is one line
naming the cause and the setting that depends on it, exit status 2, before any work
(``model.check`` on the abstract model, ``jaxaccel.run.probe``'s first forward and backward for a
factory of one's own, the stack's checks), and ``--model-args`` mistakes under ``--model-args``.

Each model is a file written into the test's folder, trained through ``experiments.train``'s
``main`` as a user would (``--model FILE.py:FUNCTION``)."""

import os
import textwrap

import jax
import pytest
from flax import nnx

from experiments import train as train_cli
from jaxaccel.run import loop, probe
from jaxaccel.model import contract as model_lib, nn
from jaxaccel.techniques import stacking, registry as techniques
from jaxaccel.run.config import build
from jaxaccel.core.errors import ConfigError

HERE = os.path.dirname(os.path.abspath(__file__))
TINY_LM = os.path.join(os.path.dirname(HERE), "examples", "tiny_lm.py") + ":make"

# What every model file starts with: a 16-wide causal model with a learned position table,
# a token table, blocks in an nn.Stack and a head; each case changes one thing.
HEADER = '''
import jax
import jax.numpy as jnp
from flax import nnx
from jaxaccel.model import nn
from jaxaccel.model.attention import dot_product_attention


class Block(nnx.Module):
    def __init__(self, width, rngs, causal=True, segments=True):
        self.qkv = nnx.Linear(width, 3 * width, rngs=rngs)
        self.out = nnx.Linear(width, width, rngs=rngs)
        self.causal, self.segments = causal, segments

    def __call__(self, x, segment_ids=None):
        B, T, D = x.shape
        q, k, v = (t.reshape(B, T, 2, D // 2) for t in jnp.split(self.qkv(x), 3, axis=-1))
        out = dot_product_attention(q, k, v, causal=self.causal,
                                    segment_ids=segment_ids if self.segments else None)
        return x + self.out(out.reshape(B, T, D))


class Other(Block):
    def __call__(self, x, segment_ids=None):
        return x + jax.nn.relu(self.out(x))


class LM(nnx.Module):
    def __init__(self, vocab_size, max_seq_len, *, rngs, blocks=None, positions=None):
        self.emb = nnx.Embed(vocab_size, 16, rngs=rngs)
        self.pos = nnx.Embed(positions or max_seq_len, 16, rngs=rngs)
        self.blocks = nn.Stack(blocks or [Block(16, rngs) for _ in range(2)])
        self.head = nnx.Linear(16, vocab_size, rngs=rngs)

    def __call__(self, inputs, positions=None, segment_ids=None):
        x = self.emb(inputs) + self.pos(positions)
        return self.head(self.blocks(x, segment_ids=segment_ids))
'''


def model_file(tmp_path, source: str, name: str = "model") -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(HEADER + textwrap.dedent(source))
    return str(path)


def train(corpus_path, tmp_path, capsys, model: str, *flags) -> tuple[int, list[str]]:
    """``experiments.train``'s exit status and its stderr's lines, a tiny run of ``model``."""
    code = train_cli.main(["--model", model, "--data", corpus_path, "--seq-len", "16",
                           "--batch-size", "4", "--steps", "1", "--no-progress",
                           "--final-eval-batches", "1", "--run-dir", str(tmp_path / "run"),
                           "--cache-dir", str(tmp_path / "cache"), *flags])
    return code, capsys.readouterr().err.strip().splitlines()


def refused(corpus_path, tmp_path, capsys, model, *flags, says: str, flag: str) -> str:
    """Assert the run is one error line saying ``says``, naming ``flag``, exit status 2, and
    that no step ran; the line."""
    code, err = train(corpus_path, tmp_path, capsys, model, *flags)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("error: ") and says in err[0] and f"[{flag} /" in err[0], err[0]
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")
    return err[0]


def model_cfg(spec: str, **values):
    return build(values={"model.name": spec, "model.max_seq_len": 16, "data.seq_len": 16,
                         **values})


# ---------------------------------------------------------------------------------------------
# What a model gives, not just its shape.

def test_integer_logits_are_refused_before_any_work(corpus_path, tmp_path, capsys):
    """They "trained" before: a zero gradient, a nonsense loss, exit status 0."""
    spec = model_file(tmp_path, '''
        class Rounded(LM):
            def __call__(self, inputs, positions=None, segment_ids=None):
                return super().__call__(inputs, positions, segment_ids).astype(jnp.int32)

        def make(vocab_size, max_seq_len, *, rngs):
            return Rounded(vocab_size, max_seq_len, rngs=rngs)
        ''') + ":make"
    refused(corpus_path, tmp_path, capsys, spec, says="its logits are int32, not a float dtype",
            flag="--model")


def test_nan_logits_at_initialisation_name_the_line(corpus_path, tmp_path, capsys):
    """Before: the run diverged at step 1 and advised a lower learning rate."""
    spec = model_file(tmp_path, '''
        class Broken(LM):
            def __call__(self, inputs, positions=None, segment_ids=None):
                logits = super().__call__(inputs, positions, segment_ids)
                return logits * jnp.log(jnp.zeros(()) - 1.0)

        def make(vocab_size, max_seq_len, *, rngs):
            return Broken(vocab_size, max_seq_len, rngs=rngs)
        ''') + ":make"
    line = refused(corpus_path, tmp_path, capsys, spec, says="its logits at initialisation "
                   "hold NaN or inf", flag="--model")
    assert "(first made at model.py:" in line


def test_a_gradient_that_is_nan_though_the_logits_are_finite_is_refused(tmp_path):
    spec = model_file(tmp_path, '''
        class Sqrt(LM):
            def __call__(self, inputs, positions=None, segment_ids=None):
                logits = super().__call__(inputs, positions, segment_ids)
                return logits + jnp.sqrt(jnp.zeros_like(logits) * self.head.bias[...])

        def make(vocab_size, max_seq_len, *, rngs):
            return Sqrt(vocab_size, max_seq_len, rngs=rngs)
        ''') + ":make"
    cfg = model_cfg(spec)
    with pytest.raises(ConfigError, match="gradient at initialisation is NaN or inf for "
                                          "head/bias though its logits are finite") as caught:
        probe.check(cfg.model, cfg.gpt, seq_len=16, packed=False, seed=0)
    assert caught.value.field == "model.name"


# Logits that do not depend on the weights: no gradient reaches any of them.
FROZEN = '''
        class Frozen(LM):
            def __call__(self, inputs, positions=None, segment_ids=None):
                return jax.lax.stop_gradient(super().__call__(inputs, positions, segment_ids))

        def make(vocab_size, max_seq_len, *, rngs):
            return Frozen(vocab_size, max_seq_len, rngs=rngs)
        '''


def test_logits_that_do_not_depend_on_the_weights_are_refused(corpus_path, tmp_path, capsys):
    spec = model_file(tmp_path, FROZEN) + ":make"
    refused(corpus_path, tmp_path, capsys, spec, says="none of its 12 nnx.Param variables gets a "
            "gradient", flag="--model")


def test_zero_initialised_projections_are_no_missing_gradient(tmp_path):
    """Zero-initialised output projections leave the layers before them without a gradient at
    the first step, legitimately: only a gradient zero for every weight is refused."""
    spec = model_file(tmp_path, '''
        class Zeroed(LM):
            def __init__(self, vocab_size, max_seq_len, *, rngs):
                super().__init__(vocab_size, max_seq_len, rngs=rngs)
                for block in self.blocks.layers:
                    block.out.kernel[...] = jnp.zeros_like(block.out.kernel[...])
                self.head.kernel[...] = jnp.zeros_like(self.head.kernel[...])

        def make(vocab_size, max_seq_len, *, rngs):
            return Zeroed(vocab_size, max_seq_len, rngs=rngs)
        ''') + ":make"
    cfg = model_cfg(spec)
    probe.check(cfg.model, cfg.gpt, seq_len=16, packed=False, seed=0)


def test_a_model_with_no_nnx_param_is_refused(corpus_path, tmp_path, capsys):
    """Weights kept as nnx.Variable: nothing would train, and the run said nothing."""
    spec = model_file(tmp_path, '''
        class Plain(nnx.Module):
            def __init__(self, vocab_size, max_seq_len, *, rngs):
                self.emb = nnx.Variable(jax.random.normal(rngs.params(), (vocab_size, 16)))
                self.head = nnx.Variable(jax.random.normal(rngs.params(), (16, vocab_size)))

            def __call__(self, inputs, positions=None, segment_ids=None):
                return self.emb[...][inputs] @ self.head[...]

        def make(vocab_size, max_seq_len, *, rngs):
            return Plain(vocab_size, max_seq_len, rngs=rngs)
        ''') + ":make"
    refused(corpus_path, tmp_path, capsys, spec, says="has no nnx.Param, so nothing would train "
            "(its weights are nnx.Variable)", flag="--model")


# ---------------------------------------------------------------------------------------------
# Scanned layers, pipeline stages, progressive stacking: what the unscanned stack computes.

MIXED = '''
    def make(vocab_size, max_seq_len, *, rngs):
        return LM(vocab_size, max_seq_len, rngs=rngs, blocks=[Block(16, rngs), Other(16, rngs)])
    '''


def test_scan_layers_refuses_blocks_of_another_class(corpus_path, tmp_path, capsys):
    """Before, the scanned model ran block 0's code with block 1's weights: a different loss
    at step 1, same seed, no word said. Pipeline stages need scanned layers: the same check."""
    spec = model_file(tmp_path, MIXED) + ":make"
    refused(corpus_path, tmp_path, capsys, spec, "--scan-layers",
            says="but block 1 differs from block 0: it is a Other, not a Block",
            flag="--scan-layers")


@pytest.mark.parametrize("second, says", [
    ("Block(16, rngs, causal=False)", "a setting of its own differs"),
    ("wide(rngs)", r"its out/kernel is a Param \(32, 16\) float32, block 0's a Param "
                   r"\(16, 16\) float32"),
])
def test_blocks_of_one_class_that_differ_are_found(tmp_path, second, says):
    spec = model_file(tmp_path, f'''
        def wide(rngs):
            block = Block(16, rngs)
            block.out = nnx.Linear(32, 16, rngs=rngs)
            return block

        def make(vocab_size, max_seq_len, *, rngs):
            return LM(vocab_size, max_seq_len, rngs=rngs, blocks=[Block(16, rngs), {second}])
        ''') + ":make"
    with pytest.raises(ConfigError, match=says) as caught:
        techniques.abstract(model_cfg(spec, **{"remat.scan_layers": True}))
    assert caught.value.field == "remat.scan_layers"


def test_progressive_stacking_refuses_a_copy_into_another_class(corpus_path, tmp_path, capsys):
    """Before, the grown block 1 (an Other) started from block 0's (a Block) weights."""
    spec = model_file(tmp_path, MIXED) + ":make"
    refused(corpus_path, tmp_path, capsys, spec, "--progressive-stack", "2",
            says="starts block 1 of the grown stack as a copy of block 0, but block 1 differs "
                 "from it: it is a Other, not a Block", flag="--progressive-stack")


def test_progressive_stacking_takes_a_pattern_that_repeats(tmp_path):
    spec = model_file(tmp_path, '''
        def make(vocab_size, max_seq_len, *, rngs):
            return LM(vocab_size, max_seq_len, rngs=rngs,
                      blocks=[Block(16, rngs), Other(16, rngs), Block(16, rngs), Other(16, rngs)])
        ''') + ":make"
    stack = nn.the_stack(techniques.abstract(model_cfg(spec)), "test")[1]
    stacking.check_copies(stack, [2, 4])
    with pytest.raises(ConfigError, match="block 1 differs from it"):
        stacking.check_copies(stack, [1, 2, 4])


# ---------------------------------------------------------------------------------------------
# --model-args: its mistakes named as its own.

@pytest.mark.parametrize("args", ["width", "width:", "width: null", "depth: 1, width"])
def test_model_args_with_a_value_left_out_are_refused(args):
    cfg = model_cfg(TINY_LM, **{"model.args": args}).model
    with pytest.raises(ConfigError, match="gives width no value; write 'width: VALUE'") as caught:
        model_lib.factory_args(cfg)
    assert caught.value.field == "model.args"


@pytest.mark.parametrize("args, says", [
    ("width", "gives width no value"),
    ("width: abc", "model_args' width: 'abc' is not a value the factory takes"),
    ("widht: 32", "model_args names widht, which the factory passes on to what does not take "
                  "it (TypeError: TinyLM.__init__() got an unexpected keyword argument 'widht'"),
])
def test_model_args_mistakes_name_model_args(corpus_path, tmp_path, capsys, args, says):
    """The README's own example (a **options factory): each was blamed on --model before."""
    refused(corpus_path, tmp_path, capsys, TINY_LM, "--model-args", args, says=says,
            flag="--model-args")


def test_an_annotated_factory_refuses_a_value_of_another_type_before_it_runs(tmp_path):
    spec = model_file(tmp_path, '''
        def make(vocab_size, max_seq_len, *, rngs, depth: int = 2, scale: float = 1.0):
            raise AssertionError("not called")
        ''') + ":make"
    for args, says in (("depth: 2.5", "gives depth 2.5, a float, but the factory's depth is int"),
                       ("depth: true", "gives depth True, a bool, but the factory's depth is int"),
                       ("scale: abc", "gives scale 'abc', a str, but the factory's scale is float")):
        with pytest.raises(ConfigError, match=says) as caught:
            model_lib.build(model_cfg(spec, **{"model.args": args}).model, None,
                            jax.random.PRNGKey(0))
        assert caught.value.field == "model.args"


def test_a_factory_that_fails_whatever_its_args_is_blamed_on_the_model(tmp_path):
    spec = model_file(tmp_path, '''
        def make(vocab_size, max_seq_len, *, rngs, width=16):
            raise RuntimeError("a bug of the model's own")
        ''') + ":make"
    with pytest.raises(ConfigError, match="the factory raised RuntimeError") as caught:
        model_lib.build(model_cfg(spec, **{"model.args": "width: 8"}).model, None,
                        jax.random.PRNGKey(0))
    assert caught.value.field == "model.name"


# ---------------------------------------------------------------------------------------------
# More ways an own model is wrong quietly.

@pytest.mark.parametrize("table", ["nnx.Embed(4, 16, rngs=rngs)",      # NaN past its end
                                   "nnx.Param(jnp.zeros((4, 16)))"])    # clamped: silent
def test_a_position_table_shorter_than_the_sequence_is_refused(corpus_path, tmp_path, capsys,
                                                               table):
    """A factory that ignores max_seq_len: jnp indexing clamps (or nnx.Embed gives NaN, and
    the run "diverged" at step 1 with advice about the learning rate)."""
    spec = model_file(tmp_path, f'''
        class Short(LM):
            def __init__(self, vocab_size, max_seq_len, *, rngs):
                super().__init__(vocab_size, max_seq_len, rngs=rngs)
                self.table = {table}

            def __call__(self, inputs, positions=None, segment_ids=None):
                table = self.table.embedding if isinstance(self.table, nnx.Embed) else self.table
                x = self.emb(inputs) + jnp.take(table[...], positions, axis=0,
                                                mode="fill" if "Embed" in "{table}" else "clip")
                return self.head(self.blocks(x, segment_ids=segment_ids))

        def make(vocab_size, max_seq_len, *, rngs):
            return Short(vocab_size, max_seq_len, rngs=rngs)
        ''') + ":make"
    line = refused(corpus_path, tmp_path, capsys, spec, says="indexes past the end of an array "
                   "(array of shape (4, 16): index 4 is out of bounds for axis 0 with size 4) at "
                   "model.py:", flag="--seq-len")
    assert "max_seq_len (16)" in line and "or lower seq_len to 4" in line


def test_a_random_weight_that_is_not_a_param_is_refused(corpus_path, tmp_path, capsys):
    """It never trains; a constant table as an nnx.Variable, or a random one as nn.Buffer, is
    fine."""
    source = '''
        class Extra(LM):
            def __init__(self, vocab_size, max_seq_len, *, rngs):
                super().__init__(vocab_size, max_seq_len, rngs=rngs)
                self.table = {kind}({value})

            def __call__(self, inputs, positions=None, segment_ids=None):
                x = self.emb(inputs) + self.table[...][positions]
                return self.head(self.blocks(x, segment_ids=segment_ids))

        def make(vocab_size, max_seq_len, *, rngs):
            return Extra(vocab_size, max_seq_len, rngs=rngs)
        '''
    drawn = "jax.random.normal(rngs.params(), (max_seq_len, 16))"
    spec = model_file(tmp_path, source.format(kind="nnx.Variable", value=drawn)) + ":make"
    refused(corpus_path, tmp_path, capsys, spec, says="its variable table is drawn at random, but "
            "it is a Variable, not an nnx.Param, so it would never train", flag="--model")
    constant = "jnp.sin(jnp.arange(max_seq_len * 16.0).reshape(max_seq_len, 16))"
    for kind, value, name in (("nnx.Variable", constant, "constant"),
                              ("nn.Buffer", drawn, "buffer")):
        spec = model_file(tmp_path, source.format(kind=kind, value=value), name) + ":make"
        probe._refuse_random_variables(model_cfg(spec).model, None)


def test_a_model_that_sees_later_tokens_is_refused(corpus_path, tmp_path, capsys):
    """Attention without a causal mask: the loss falls fast, and it is a lie."""
    spec = model_file(tmp_path, '''
        def make(vocab_size, max_seq_len, *, rngs):
            return LM(vocab_size, max_seq_len, rngs=rngs,
                      blocks=[Block(16, rngs, causal=False) for _ in range(2)])
        ''') + ":make"
    refused(corpus_path, tmp_path, capsys, spec, says="its logits at position 0 change when the "
            "token at position 15 changes: it sees later tokens", flag="--model")


def test_packed_documents_that_see_each_other_are_refused(corpus_path, tmp_path, capsys):
    """A call that takes segment_ids= and drops them: with --batching pack the documents of a
    row attended to each other, silently."""
    spec = model_file(tmp_path, '''
        def make(vocab_size, max_seq_len, *, rngs, segments=False):
            return LM(vocab_size, max_seq_len, rngs=rngs,
                      blocks=[Block(16, rngs, segments=segments) for _ in range(2)])
        ''') + ":make"
    refused(corpus_path, tmp_path, capsys, spec, "--batching", "pack",
            says="with --batching pack its logits at position 8 (the second document of a row) "
                 "change with a token of the first document", flag="--batching")
    cfg = model_cfg(spec, **{"model.args": "segments: true"})
    probe.check(cfg.model, cfg.gpt, seq_len=16, packed=True, seed=0)


def test_a_stack_the_model_never_calls_is_refused(corpus_path, tmp_path, capsys):
    """Its blocks never trained, and the block techniques acted on nothing."""
    spec = model_file(tmp_path, '''
        class Skipping(LM):
            def __call__(self, inputs, positions=None, segment_ids=None):
                return self.head(self.emb(inputs) + self.pos(positions))

        def make(vocab_size, max_seq_len, *, rngs):
            return Skipping(vocab_size, max_seq_len, rngs=rngs)
        ''') + ":make"
    refused(corpus_path, tmp_path, capsys, spec, "--stochastic-depth", "0.5",
            says="never calls its nn.Stack (blocks) in its forward pass", flag="--model")


def test_pipeline_stages_refuse_a_stack_called_twice(tmp_path):
    """Pipeline stages cut the model at its stack's one call: the head would get the stages'
    output in place of the second call's."""
    spec = model_file(tmp_path, '''
        class Twice(LM):
            def __call__(self, inputs, positions=None, segment_ids=None):
                x = self.emb(inputs) + self.pos(positions)
                x = self.blocks(self.blocks(x, segment_ids=segment_ids), segment_ids=segment_ids)
                return self.head(x)

        def make(vocab_size, max_seq_len, *, rngs):
            return Twice(vocab_size, max_seq_len, rngs=rngs)
        ''') + ":make"
    model = techniques.abstract(model_cfg(spec))
    model_lib.check(model, spec, vocab_size=320, packed=False)      # unpipelined: it may
    with pytest.raises(ConfigError, match="calls its nn.Stack 2 times, but pipeline stages run "
                                          "the stack once") as caught:
        model_lib.check(model, spec, vocab_size=320, packed=False, pipelined=True)
    assert caught.value.field == "mesh.strategy"


def test_blocks_that_change_the_width_are_refused_where_a_technique_needs_it(
        corpus_path, tmp_path, capsys):
    """Unscanned and without a block technique they run (nothing depends on the width);
    stochastic depth puts a block's rows back into x: before, a traceback."""
    spec = model_file(tmp_path, '''
        class Widen(nnx.Module):
            def __init__(self, a, b, rngs):
                self.lin = nnx.Linear(a, b, rngs=rngs)

            def __call__(self, x, segment_ids=None):
                return jnp.tanh(self.lin(x))

        def make(vocab_size, max_seq_len, *, rngs):
            return LM(vocab_size, max_seq_len, rngs=rngs,
                      blocks=[Widen(16, 32, rngs), Widen(32, 16, rngs)])
        ''') + ":make"
    model = techniques.abstract(model_cfg(spec))
    model_lib.check(model, spec, vocab_size=320, packed=False)
    refused(corpus_path, tmp_path, capsys, spec, "--stochastic-depth", "0.5",
            says="stochastic depth runs each block of the nn.Stack on part of x and puts the "
                 "result back, but block 0 (Widen) turns x (2, 8, 16) into (2, 8, 32)",
            flag="--stochastic-depth")


def test_a_tuple_of_logits_and_more_says_to_return_the_logits(tmp_path):
    spec = model_file(tmp_path, '''
        class Pair(LM):
            def __call__(self, inputs, positions=None, segment_ids=None):
                return super().__call__(inputs, positions, segment_ids), jnp.zeros(())

        def make(vocab_size, max_seq_len, *, rngs):
            return Pair(vocab_size, max_seq_len, rngs=rngs)
        ''') + ":make"
    with pytest.raises(ConfigError, match=r"gave a tuple \(\[2, 8, 320\], \[\]\), not logits "
                                          r"\[2, 8, 320\] .*; return the logits alone"):
        model_lib.check(techniques.abstract(model_cfg(spec)), spec, vocab_size=320,
                        packed=False)


def test_the_probe_runs_for_own_models_only(monkeypatch):
    """jaxaccel's GPT presets start without it (their start-up is a benchmarked target)."""
    ran = []
    monkeypatch.setattr(probe, "check", lambda *a, **k: ran.append(a[0].name))
    cfg = build(values={"gpt.d_model": 32, "gpt.n_layers": 1, "gpt.n_heads": 2,
                        "model.max_seq_len": 16, "data.seq_len": 16})
    loop.preflight(cfg, {"data": 1})
    assert ran == []
    loop.preflight(model_cfg(TINY_LM, **{"model.args": "width: 16, depth: 1"}), {"data": 1})
    assert ran == [TINY_LM]


def test_weights_too_many_for_one_device_skip_the_probe_and_say_so(monkeypatch, capsys):
    monkeypatch.setattr(probe, "check", lambda *a, **k: pytest.fail("the probe ran"))
    monkeypatch.setattr(loop.hardware, "memory_limit_bytes", lambda device=None: 1000)
    loop.preflight(model_cfg(TINY_LM, **{"model.args": "width: 16, depth: 1"}), {"data": 1})
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "are not checked before the first step" in err[0], err


def test_a_kernel_checkify_cannot_read_leaves_the_other_checks(monkeypatch, tmp_path):
    """checkify may not read a kernel (a pallas_call): the probe runs without index checks."""
    def unreadable(fn, errors=None):
        raise NotImplementedError("no checkify rule")
    monkeypatch.setattr(probe.checkify, "checkify", unreadable)
    cfg = model_cfg(TINY_LM, **{"model.args": "width: 16, depth: 1"})
    probe.check(cfg.model, cfg.gpt, seq_len=16, packed=False, seed=0)
    spec = model_file(tmp_path, FROZEN) + ":make"
    cfg = model_cfg(spec)
    with pytest.raises(ConfigError, match="gets a gradient"):
        probe.check(cfg.model, cfg.gpt, seq_len=16, packed=False, seed=0)


def test_a_syntax_error_in_the_model_file_names_its_line(corpus_path, tmp_path, capsys):
    """The compiler raises it without a frame of the user's file: its own file and line."""
    path = tmp_path / "broken.py"
    path.write_text("import jax\n\n\ndef make(vocab_size, max_seq_len, *, rngs):\n    return (\n")
    line = refused(corpus_path, tmp_path, capsys, f"{path}:make", says="SyntaxError",
                   flag="--model")
    assert "(broken.py:5)" in line and "importlib" not in line, line


@pytest.mark.parametrize("name,says", [
    ("examples/tiny_lm.py", "names a file but not its factory; give examples/tiny_lm.py:FUNCTION"),
    ("examples/tiny_lm.py:", "leaves out the function"),
    (":make", "leaves out the file or module"),
    ("no_such_package.models:make", "No module named 'no_such_package'"),
])
def test_a_model_name_that_is_not_a_factory_says_what_is_missing(corpus_path, tmp_path, capsys,
                                                                 name, says):
    """Where a name lacks its function or module, and where an import fails in importlib's own
    code (no line of the user's to name: none named, not importlib's)."""
    line = refused(corpus_path, tmp_path, capsys, name, says=says, flag="--model")
    assert "importlib" not in line and "frozen" not in line and "__init__.py" not in line, line
