import chex
import jax
import pytest

from jaxaccel.checkpoint import Checkpointer
from jaxaccel.config import build_parser
from jaxaccel.errors import ConfigError
from jaxaccel.model import ModelConfig, init_params
from jaxaccel.optim import make_optimizer
from jaxaccel.state import init_state

CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, max_seq_len=8)


def make_state(seed):
    optimizer = make_optimizer(learning_rate=1e-3, total_steps=10)
    return init_state(init_params(CFG, jax.random.PRNGKey(seed)), optimizer, seed)


def test_round_trip_restores_state_position_and_step(tmp_path):
    saved = make_state(0).replace(step=jax.numpy.int32(7))
    ckpt = Checkpointer(str(tmp_path))
    ckpt.save(7, saved, loader_position={"epoch": 1, "batch": 3}, config={"d_model": 32})
    state, position, step = Checkpointer(str(tmp_path)).restore(make_state(1), config={"d_model": 32})
    chex.assert_trees_all_equal(state, saved)
    assert position == {"epoch": 1, "batch": 3} and step == 7


def test_restore_checks_the_config_first(tmp_path):
    ckpt = Checkpointer(str(tmp_path))
    ckpt.save(1, make_state(0), loader_position={"epoch": 0, "batch": 1}, config={"seq_len": 8})
    with pytest.raises(ConfigError, match=r"seq_len=8 \(now 16\)"):
        ckpt.restore(make_state(0), config={"seq_len": 16})


def test_help_lists_every_flag_the_issue_names():
    text = build_parser().format_help()
    for flag in ("--model", "--data", "--steps", "--batch-size", "--seq-len", "--seed",
                 "--run-dir", "--checkpoint-every", "--eval-every", "--resume", "--json",
                 "--d-model", "--n-layers", "--n-heads", "--n-kv-heads", "--d-ff"):
        assert flag in text
