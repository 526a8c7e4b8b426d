"""The peers in benchmarks/peers/ measure what jaxpar's side measures: the transformers peer's model is
the bench config's, as transformers reads the config.json jaxpar writes; the MaxText runner's own tiny
model is configs/maxtext_tiny.py in MaxText's key names, and its meshes are jaxpar's by name and size.
The MaxText runner is read here, not run (MaxText lives in its own environment;
tests/scripts/test_bench_script.py runs `bench.py mesh` without it and `bench.py step --peer` with the
transformers peer)."""

import importlib.util
import math

from jaxpar.axes import CONTEXT, DATA, PIPELINE, TENSOR
from jaxpar.bench import mesh
from jaxpar.bench.step import write_peer_config
from jaxpar.command.config_file import load_config
from tests.support.paths import REPO

# MaxText's ICI keys by the jaxpar axis each one is on this mesh (fsdp is data with ZeRO-3).
ICI = {"ici_data_parallelism": DATA, "ici_fsdp_parallelism": DATA, "ici_tensor_parallelism": TENSOR,
       "ici_pipeline_parallelism": PIPELINE, "ici_context_parallelism": CONTEXT}


def runner():
    spec = importlib.util.spec_from_file_location("run_tiny", REPO / "benchmarks" / "peers" / "maxtext" / "run_tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # stdlib only at import: MaxText is imported when it runs
    return module


def test_the_maxtext_runner_trains_configs_maxtext_tiny():
    config = load_config(str(REPO / "configs" / "maxtext_tiny.py"))
    assert runner().TINY_LLAMA == mesh.maxtext_overrides(config)
    assert config.model.head_dim * config.model.num_attention_heads == config.model.hidden_size  # MaxText's attention shape


def test_the_maxtext_meshes_are_jaxpars_by_name_and_size():
    meshes = runner().MESHES
    assert set(meshes) == set(mesh.MESHES) - {"one"}
    for name, keys in meshes.items():
        sizes, parallel = mesh.MESHES[name]
        theirs = {}
        for key, value in keys.items():
            if key in ICI and int(value) > 1:
                theirs[ICI[key]] = theirs.get(ICI[key], 1) * int(value)
        assert theirs == sizes and math.prod(theirs.values()) == mesh.DEVICES, name
        assert (keys.get("ici_fsdp_parallelism", "-1") not in ("1",)) == (parallel.get("zero_stage") == 3), name  # fsdp = ZeRO-3
        assert keys.get("num_pipeline_microbatches") == (str(parallel["num_microbatches"]) if "num_microbatches" in parallel else None)


def test_the_runner_sets_what_a_run_needs():
    module = runner()
    args, extra = module.arguments(["--mesh=pp2dp4", "--remat=none", "--steps=7", "base_mlp_dim=12"])
    keys = module.overrides(args, extra)
    assert keys["base_mlp_dim"] == "12" and keys["steps"] == "7" and keys["ici_pipeline_parallelism"] == "2"
    assert keys["remat_policy"] == "none" and keys["scan_layers"] == "false"  # scanned layers are always checkpointed
    assert keys["dataset_type"] == "synthetic" and keys["enable_checkpointing"] == "false"


def test_the_peer_config_is_the_jaxpar_model_as_transformers_reads_it(tmp_path):
    import transformers

    for model in ("llama", "mixtral"):
        config = load_config(str(REPO / "configs" / f"bench_{model}.py"))
        hf = transformers.AutoConfig.from_pretrained(write_peer_config(config, str(tmp_path / model)))
        m = config.model
        assert (hf.model_type, hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers, hf.vocab_size) == (
            m.model_type, m.hidden_size, m.intermediate_size, m.num_hidden_layers, m.vocab_size)
        assert (hf.num_attention_heads, hf.num_key_value_heads, hf.tie_word_embeddings) == (
            m.num_attention_heads, m.num_key_value_heads, m.tie_word_embeddings)
    assert (hf.num_local_experts, hf.num_experts_per_tok) == (8, 2)
