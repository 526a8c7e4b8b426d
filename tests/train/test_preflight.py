"""Bad configs fail before anything compiles, with one line per problem naming the key to change."""

import pytest

from jaxpar.mesh import MeshError, make_mesh, resolve_mesh_shape
from jaxpar.train.preflight import ConfigError, check
from tests.support import tiny


def small_config(**model):
    return tiny.llama({"seq_len": 32}, **{"vocab_size": 256, "max_position_embeddings": 128, "head_dim": None, **model})


def errors_of(config, devices=8) -> list[str]:
    with pytest.raises(ConfigError) as info:
        check(config, devices)
    return str(info.value).splitlines()


def only_error(config, devices=8) -> str:
    lines = errors_of(config, devices)
    assert len(lines) == 1, lines
    return lines[0]


def test_valid_config_passes_and_resolves_mesh():
    c = small_config()
    c.mesh.update(data=-1, tensor=2)
    assert check(c, 8) == {"data": 4, "pipeline": 1, "context": 1, "expert": 1, "tensor": 2}


def test_mesh_product_must_match_device_count():
    c = small_config()
    c.mesh.update(data=2, tensor=2)
    assert "4 devices but 8 are available" in only_error(c)


def test_mesh_fill_axis_must_divide():
    c = small_config()
    c.mesh.update(data=-1, tensor=3)
    assert "mesh" in only_error(c)
    with pytest.raises(MeshError, match="only one axis may be -1"):
        resolve_mesh_shape(dict(data=-1, tensor=-1, pipeline=1, context=1, expert=1), 8)


def test_make_mesh_has_five_named_axes_tensor_innermost():
    mesh = make_mesh(dict(data=2, tensor=4, pipeline=1, context=1, expert=1))
    assert mesh.axis_names == ("data", "pipeline", "context", "expert", "tensor")
    assert dict(mesh.shape)["tensor"] == 4
    # The four devices of one tensor group sit next to each other in the device list.
    ids = [[d.id for d in row] for row in mesh.devices.reshape(2, 4)]
    assert all(max(row) - min(row) == 3 for row in ids)


@pytest.mark.parametrize(
    "mesh, train, expected_key",
    [
        (dict(data=8), dict(global_batch_size=12), "train.global_batch_size"),
        (dict(data=4, expert=2), dict(global_batch_size=16, grad_accum=4), "train.global_batch_size"),
    ],
)
def test_batch_must_divide_replicas_times_accumulation(mesh, train, expected_key):
    c = small_config()
    c.mesh.update({"data": 1, **mesh})
    c.train.update(train)
    assert only_error(c).startswith(expected_key)


def test_heads_not_divisible_by_tensor():
    c = small_config(num_attention_heads=6, num_key_value_heads=2, hidden_size=48)
    c.mesh.update(data=2, tensor=4)
    line = only_error(c)
    assert "model.num_attention_heads=6" in line and "mesh.tensor=4" in line


def test_intermediate_not_divisible_by_tensor():
    c = small_config(intermediate_size=100)
    c.mesh.update(data=1, tensor=8)
    assert only_error(c).startswith("model.intermediate_size=100")


def test_kv_heads_must_divide_tensor_when_replicated():
    c = small_config(num_attention_heads=12, num_key_value_heads=3, hidden_size=48)
    c.mesh.update(data=2, tensor=4)
    assert "model.num_key_value_heads=3" in only_error(c)


def test_sequence_parallel_needs_seq_divisible_by_tensor():
    c = small_config()
    c.mesh.update(data=1, tensor=8)
    c.train.seq_len = 36
    c.parallel.sequence_parallel = True
    assert only_error(c).startswith("train.seq_len=36")


def test_zero_needs_hidden_divisible_by_data():
    c = small_config(hidden_size=36, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    c.mesh.update(data=8)
    c.parallel.zero_stage = 1
    assert only_error(c).startswith("model.hidden_size=36")


def test_bad_choices_each_name_their_key():
    c = small_config()
    c.parallel.zero_stage = 2
    c.parallel.remat = "some"
    c.train.compute_dtype = "float8"
    lines = errors_of(c)
    assert [line.split("=")[0] for line in lines] == ["parallel.zero_stage", "parallel.remat", "train.compute_dtype"]


def test_unknown_keys_are_rejected():
    c = small_config()
    c.train.unlock()
    c.train.learning_rat = 0.1
    c.model.rope_scaling.unlock()
    c.model.rope_scaling.fator = 2.0
    lines = errors_of(c)
    assert any(line.startswith("train.learning_rat: unknown config key") for line in lines)
    assert any(line.startswith("model.rope_scaling.fator: unknown config key") for line in lines)


def test_indivisible_context_sequence_and_missing_data_path():
    c = small_config()
    c.mesh.update(data=2, context=4)
    c.train.seq_len = 36  # divisible by 4, not by the 8 chunks of load balancing
    c.data.update(source="text", path="/nonexistent/corpus.txt")
    lines = errors_of(c)
    assert any(line.startswith("train.seq_len=36 is not divisible by 2 × mesh.context = 8") for line in lines)
    assert any("data.path" in line for line in lines)


def test_byte_corpus_needs_byte_vocab():
    c = small_config(vocab_size=128)
    assert "model.vocab_size" in only_error(c)
