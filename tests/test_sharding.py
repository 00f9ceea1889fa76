"""Meshes, logical axis rules and strategies, distributed settings; the 8-device suite runs in a
subprocess (the device count is fixed when JAX starts); the multi-process tests are in
tests/test_distributed.py."""

import socket

import jax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

from conftest import run_multidevice
from jaxaccel.techniques import registry as techniques
from jaxaccel.run.config import build
from jaxaccel.core.errors import ConfigError
from jaxaccel.step.optim import make_optimizer
from jaxaccel.core.sharding import (AUTO, COMPUTE_RULES, PARAM_RULES, check_split,
                                    initialize_distributed, logical_spec, make_mesh, mesh_shape,
                                    param_shardings, parse_mesh, state_shardings, variable_axes)
from jaxaccel.step.state import init_state


def abstract_state(**values):
    """The variables (ShapeDtypeStructs) of the GPT a config of ``values`` (by path) builds."""
    return nnx.state(techniques.abstract(build(values=values)))


def test_strategies_fill_the_mesh_with_their_own_axes():
    def shape(stage=1, data=1, fsdp=1, tensor=1):
        return {"stage": stage, "data": data, "fsdp": fsdp, "tensor": tensor}

    assert mesh_shape("dp", 8) == shape(data=8)
    assert mesh_shape("fsdp", 8) == shape(fsdp=8)
    assert mesh_shape("tp", 4) == shape(tensor=4)
    assert mesh_shape("fsdp+tp", 8) == shape(fsdp=4, tensor=2)
    assert mesh_shape("dp+fsdp", 8) == shape(data=2, fsdp=4)
    assert mesh_shape("dp+fsdp", 16, process_count=2) == shape(data=2, fsdp=8)
    assert mesh_shape("fsdp+tp", 8, parse_mesh("tensor=4,fsdp=-1")) == shape(fsdp=2, tensor=4)
    assert mesh_shape("dp", 1) == shape()


@pytest.mark.parametrize("strategy, mesh, message", [
    ("dp", "data=3", "has 3 devices but 8 are available"),
    ("fsdp+tp", "fsdp=3,tensor=-1", "needs a multiple of 3 devices"),
    ("dp", "fsdp=2", "does not use the fsdp axis"),
    ("fsdp+tp", "fsdp=-1,tensor=-1", "both at -1"),
    ("zero", None, "unknown sharding strategy 'zero'"),
])
def test_a_mesh_that_does_not_fit_is_one_clear_error(strategy, mesh, message):
    with pytest.raises(ConfigError, match=message) as info:
        mesh_shape(strategy, 8, parse_mesh(mesh))
    assert info.value.field == ("mesh.strategy" if mesh is None else "mesh.shape")
    assert "--" not in str(info.value)


@pytest.mark.parametrize("text", ["data", "data=0", "pipeline=2", "data=x"])
def test_bad_mesh_text_is_rejected(text):
    with pytest.raises(ConfigError, match="write the mesh as axis=size pairs") as info:
        parse_mesh(text)
    assert info.value.field == "mesh.shape"


def test_make_mesh_checks_the_device_count():
    with pytest.raises(ConfigError, match="has 2 devices but 1 are available"):
        make_mesh({"data": 2, "fsdp": 1, "tensor": 1})
    mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, "explicit")
    assert mesh.axis_names == ("stage", "data", "fsdp", "tensor")
    assert all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)


def test_dimensions_the_tensor_axis_does_not_divide_are_rejected():
    """The split is checked on the variables' logical axes, whatever the model (not on the
    GPT's head counts as before): a kernel whose ``kv_heads`` dimension (2 heads x 16) the
    tensor axis does not divide is one line naming it; a strategy over ``tensor`` for a model
    that names no dimension for it is refused."""
    state = abstract_state(**{"gpt.d_model": 96, "gpt.n_heads": 6, "gpt.n_kv_heads": 2})
    with pytest.raises(ConfigError, match=r"attn/wk/kernel \(96, 32\): dimension 1 \(32, "
                                          r"logical axis kv_heads\) does not split over the "
                                          r"tensor axis \(3 devices\)") as info:
        check_split({"data": 1, "fsdp": 1, "tensor": 3}, state, strategy="tp")
    assert info.value.field == "mesh.shape" and "\n" not in str(info.value)
    check_split({"data": 2, "fsdp": 1, "tensor": 2}, state, strategy="tp")
    unnamed = {"kernel": (AUTO, AUTO)}             # axis rules that name no tensor dimension
    with pytest.raises(ConfigError, match="splits over the tensor axis, but the model names no "
                                          "dimension for it") as info:
        check_split({"data": 1, "fsdp": 1, "tensor": 2}, state, unnamed, strategy="tp")
    assert info.value.field == "mesh.strategy"
    check_split({"data": 1, "fsdp": 2, "tensor": 1}, state, unnamed, strategy="fsdp")


def test_logical_specs_use_each_mesh_axis_once():
    assert logical_spec(("embed", "heads"), PARAM_RULES) == PartitionSpec("fsdp", "tensor")
    assert logical_spec(("embed", "heads"), COMPUTE_RULES) == PartitionSpec(None, "tensor")
    assert logical_spec(("batch", "seq", "embed"), COMPUTE_RULES) == PartitionSpec(
        ("data", "fsdp"), None, None)
    assert logical_spec(("mlp", "heads"), PARAM_RULES) == PartitionSpec("tensor", None)


@pytest.mark.parametrize("values", [{"gpt.n_layers": 2},
                                    {"gpt.n_layers": 2, "gpt.mlp": "gelu",
                                     "gpt.tie_embeddings": True}])
def test_every_parameter_has_logical_axes_in_both_layouts(values):
    for scan in (False, True):
        layout = abstract_state(**values, **{"remat.scan_layers": scan})
        axes = variable_axes(layout)
        for leaf, names in zip(jax.tree.leaves(layout),
                               jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))):
            assert len(names) == leaf.ndim
            assert set(names) <= set(PARAM_RULES)
    stacked = variable_axes(abstract_state(**values, **{"remat.scan_layers": True}))
    assert stacked["blocks"]["layers"]["attn"]["wq"]["kernel"] == ("layers", "embed", "heads")
    unrolled = variable_axes(abstract_state(**values))
    assert unrolled["blocks"]["layers"][0]["attn"]["wq"]["kernel"] == ("embed", "heads")


def test_optimizer_moments_take_their_parameters_sharding():
    cfg = build(values={"gpt.n_layers": 1})
    mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 1})
    optimizer = make_optimizer("adamw", learning_rate=1e-3, weight_decay=0.1, warmup_steps=0,
                               total_steps=10)
    state = jax.eval_shape(lambda: init_state(
        nnx.state(techniques.build(cfg, jax.random.PRNGKey(0))), optimizer, 0,
        trainable=nnx.Param))
    params = param_shardings(mesh, state.params)
    shardings = state_shardings(mesh, state, params)
    adam = [s for s in jax.tree.leaves(
        shardings.opt_state, is_leaf=lambda x: hasattr(x, "mu") and hasattr(x, "nu"))
        if hasattr(s, "mu")]
    assert len(adam) == 1
    assert jax.tree.leaves(adam[0].mu) == jax.tree.leaves(params)
    assert jax.tree.leaves(adam[0].nu) == jax.tree.leaves(params)
    assert adam[0].count.spec == PartitionSpec()
    assert shardings.step.spec == PartitionSpec()
    assert params["blocks"]["layers"][0]["attn"]["wo"]["kernel"].spec == PartitionSpec("tensor",
                                                                                      "fsdp")


def test_distributed_settings_are_checked():
    initialize_distributed(None, None, None)          # one process: nothing to start
    for args, message, field in [
        ((None, 2, 1), "need a coordinator", "mesh.coordinator"),
        (("127.0.0.1:1234", None, 0), "needs num_processes", "mesh.num_processes"),
        (("127.0.0.1:1234", 2, 2), "process_id=2 is not in \\[0, num_processes=2\\)",
         "mesh.process_id"),
        (("localhost", 2, 1), "is not HOST:PORT", "mesh.coordinator"),
        (("127.0.0.1:99999", 2, 0), "port 99999 is not a TCP port", "mesh.coordinator"),
    ]:
        with pytest.raises(ConfigError, match=message) as info:
            initialize_distributed(*args)
        assert info.value.field == field and "--" not in str(info.value)
    with socket.socket() as taken:          # another program on process 0's port
        taken.bind(("", 0))
        taken.listen()
        with pytest.raises(ConfigError, match="cannot listen on port .* another program"):
            initialize_distributed(f"127.0.0.1:{taken.getsockname()[1]}", 2, 0)


# The 8-device suite (tests/multidevice/test_strategies.py) in parts of about equal time, each a
# process of its own: every strategy against one device (with the checkpoint and memory tests
# that read the states it trains), the explicit axes and embeddings, the loop resumed on another
# mesh, the experiment, FP8 and sparsity, the grouped-query heads scanned and with Pallas
# against one reference. The last part runs every test the others do not.
PARTS = [("test_every_strategy_trains_like_one_device",
          "test_fsdp_stores_an_eighth_of_parameters_and_optimizer_state_per_device",
          "test_checkpoint_restores_across_meshes"),
         ("test_explicit_axes_train_like_one_device",
          "test_the_sorted_sum_embedding_trains_like_one_device"),
         ("test_training_loop_resumes_on_another_mesh",),
         ("test_sharding_experiment_writes_every_row",),
         ("test_fp8_and_nm_sparsity_train_on_fsdp_tp_like_one_device",),
         ("test_scanned_layers_and_grouped_query_heads_under_tp_with_explicit_axes",
          "test_pallas_attention_runs_per_shard_under_fsdp_and_tp")]


@pytest.mark.parametrize("tests", [*PARTS, None], ids=[p[0][5:30] for p in PARTS] + ["rest"])
def test_eight_device_suite(tests):
    """A part of the 8-device suite, on 8 simulated CPU devices."""
    if tests is None:
        run_multidevice("tests/multidevice/test_strategies.py",
                        others_than=[name for part in PARTS for name in part])
    else:
        run_multidevice("tests/multidevice/test_strategies.py", tests=tests)
