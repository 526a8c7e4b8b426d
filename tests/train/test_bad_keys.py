"""The probe's config keys by record: optimizers (each in its own section, `train.adamw.b1` ...),
learning-rate schedules, families (Llama and the MoE families' own keys), pipeline schedules and the
other parallel options, list-valued keys typed on the command line. Each bad value goes through
scripts/train.py's `main` in this process and must be refused before anything is compiled or
written, in one line naming the key (`tests/train/probe.py` checks the contract); the key and value
the line names are the ones the case set."""


import pytest

from tests.train.probe import Probe

# (id, flags, words the one line must hold); "moe:" before an id: the Qwen3-MoE tiny config.
CASES = [
    # -- optimizers: each record's own section and checks
    ("optimizer_unknown", ["--config.train.optimizer=adam"], "train.optimizer='adam' is not one of"),
    ("adamw_eps_zero", ["--config.train.adamw.eps=0"], "train.adamw.eps=0.0"),
    ("adamw_eps_nan", ["--config.train.adamw.eps=nan"], "train.adamw.eps=nan"),
    ("adamw_b1_negative", ["--config.train.adamw.b1=-0.1"], "train.adamw.b1=-0.1"),
    ("adamw_b2_nan", ["--config.train.adamw.b2=nan"], "train.adamw.b2=nan"),
    ("adamw_b1_word", ["--config.train.adamw.b1=high"], "--config.train.adamw.b1='high' must be a number"),
    ("lion_b2_one", ["--config.train.optimizer=lion", "--config.train.lion.b2=1"], "train.lion.b2=1.0"),
    ("lion_b1_inf", ["--config.train.optimizer=lion", "--config.train.lion.b1=inf"], "train.lion.b1=inf"),
    ("sgd_momentum_negative", ["--config.train.optimizer=sgd", "--config.train.sgd.momentum=-0.5"], "train.sgd.momentum=-0.5"),
    ("sgd_nesterov_word", ["--config.train.optimizer=sgd", "--config.train.sgd.nesterov=sometimes"], "train.sgd.nesterov='sometimes'"),
    ("muon_ns_steps_zero", ["--config.train.optimizer=muon", "--config.train.muon.ns_steps=0"], "train.muon.ns_steps=0"),
    ("muon_beta_one", ["--config.train.optimizer=muon", "--config.train.muon.beta=1.0"], "train.muon.beta=1.0"),
    ("adafactor_decay", ["--config.train.optimizer=adafactor", "--config.train.adafactor.decay_rate=1.5"],
     "train.adafactor.decay_rate=1.5"),
    ("adafactor_clip", ["--config.train.optimizer=adafactor", "--config.train.adafactor.clipping_threshold=-1"],
     "train.adafactor.clipping_threshold=-1.0"),
    ("adamw_eps_inf", ["--config.train.adamw.eps=inf"], "train.adamw.eps=inf"),
    ("moved_adam_eps", ["--config.train.adam_eps=1e-6"], "--config.train.adam_eps: the key moved to --config.train.adamw.eps"),
    ("section_of_optimizer", ["--config.train.adamw=0.9"], "--config.train.adamw: train.adamw is a section"),
    ("lr_inf", ["--config.train.learning_rate=inf"], "train.learning_rate=inf"),
    ("clip_nan", ["--config.train.max_grad_norm=nan"], "train.max_grad_norm=nan"),
    ("decay_exclude_unknown", ["--config.train.weight_decay_exclude=norm,gate"], "train.weight_decay_exclude='norm,gate' names ['gate']"),
    ("seed_too_large", ["--config.train.seed=4294967296"], "train.seed=4294967296"),
    # -- learning-rate schedules
    ("schedule_unknown", ["--config.train.lr_schedule=step"], "train.lr_schedule='step' is not one of"),
    ("wsd_fraction", ["--config.train.lr_schedule=wsd", "--config.train.wsd.decay_fraction=1.5"], "train.wsd.decay_fraction=1.5"),
    ("wsd_shape", ["--config.train.lr_schedule=wsd", "--config.train.wsd.decay_shape=cubic"], "train.wsd.decay_shape='cubic'"),
    ("warmup_beyond_steps_fraction", ["--config.train.final_learning_rate_fraction=-0.5"], "train.final_learning_rate_fraction=-0.5"),
    # -- families: Llama's keys, the MoE families' own
    ("vocab_zero", ["--config.model.vocab_size=0"], "model.vocab_size=0"),
    ("intermediate_zero", ["--config.model.intermediate_size=0"], "model.intermediate_size=0"),
    ("positions_zero", ["--config.model.max_position_embeddings=0"], "model.max_position_embeddings=0"),
    ("kv_not_dividing", ["--config.model.num_key_value_heads=3"], "model.num_key_value_heads=3"),
    ("rope_theta_negative", ["--config.model.rope_theta=-10000"], "model.rope_theta=-10000.0"),
    ("tie_word", ["--config.model.tie_word_embeddings=maybe"], "tie_word_embeddings='maybe' must be true or false"),
    ("moe:experts_zero", ["--config.model.num_experts=0"], "model.num_experts=0"),
    ("moe:top_k_beyond", ["--config.model.num_experts_per_tok=17"], "model.num_experts_per_tok=17"),
    ("moe:dense_layer_out_of_range", ["--config.model.mlp_only_layers=[7]"], "model.mlp_only_layers has [7], not layer indices 0 .. 1"),
    ("moe:dense_layers_words", ["--config.model.mlp_only_layers=1,x"], "model.mlp_only_layers has ['x']"),
    ("moe:every_layer_dense", ["--config.model.mlp_only_layers=0,1"], "model.mlp_only_layers"),
    ("moe:sparse_step_zero", ["--config.model.decoder_sparse_step=0"], "model.decoder_sparse_step=0"),
    ("moe:aux_negative", ["--config.model.router_aux_loss_coef=-1"], "model.router_aux_loss_coef=-1.0"),
    ("moe:dense_layers_not_a_list", ["--config.model.mlp_only_layers=[1"], "--config.model.mlp_only_layers='[1' is not a list"),
    # -- pipeline schedules and the other parallel options
    ("pipeline_deeper_than_layers", ["--config.mesh.pipeline=4"], "model.num_hidden_layers=2 cannot fill mesh.pipeline"),
    ("microbatches_not_multiple", ["--config.mesh.pipeline=2", "--config.parallel.num_microbatches=3"], "parallel.num_microbatches=3"),
    ("stage_layers_sum", ["--config.mesh.pipeline=2", "--config.parallel.pipeline_stage_layers=1,2"], "parallel.pipeline_stage_layers"),
    ("stage_layers_words", ["--config.mesh.pipeline=2", "--config.parallel.pipeline_stage_layers=a,b"], "parallel.pipeline_stage_layers"),
    ("stage_layers_list_length", ["--config.mesh.pipeline=2", "--config.parallel.pipeline_stage_layers=[2]"],
     "parallel.pipeline_stage_layers=[2] has 1 entries"),
    ("schedule_v_for_1f1b", ["--config.mesh.pipeline=2", "--config.parallel.virtual_stages=2"], "parallel.virtual_stages=2"),
    ("virtual_stages_negative", ["--config.parallel.virtual_stages=-1"], "parallel.virtual_stages=-1"),
    ("pipeline_vocab", ["--config.parallel.pipeline_vocab=everywhere"], "parallel.pipeline_vocab='everywhere'"),
    ("context_impl", ["--config.parallel.context_impl=tree"], "parallel.context_impl='tree'"),
    ("context_block_zero", ["--config.parallel.context_block_size=0"], "parallel.context_block_size=0"),
    ("zero_axes", ["--config.parallel.zero_axes=tensor"], "parallel.zero_axes='tensor'"),
    ("mesh_axis_zero", ["--config.mesh.tensor=0"], "mesh"),
    ("mesh_needs_more_devices", ["--config.mesh.data=16"], "mesh"),
    # -- checkpoints and logging
    ("profile_negative", ["--config.train.profile_steps=-1"], "train.profile_steps=-1"),
    ("peak_flops_negative", ["--config.train.peak_flops_per_device=-1"], "train.peak_flops_per_device=-1.0"),
    ("async_save_word", ["--config.checkpoint.async_save=later"], "async_save='later' must be true or false"),
    # -- experiment trackers (jaxpar.trackers)
    ("logger_unknown", ["--config.train.loggers=tensorboard,wandbb"], "train.loggers='tensorboard,wandbb': 'wandbb' is not one of"),
    ("wandb_mode", ["--config.train.loggers=wandb", "--config.train.wandb_mode=cloud"], "train.wandb_mode='cloud' is not one of"),
    ("wandb_project_empty", ["--config.train.loggers=wandb", "--config.train.wandb_project="], "train.wandb_project='' must name"),
]


@pytest.fixture
def probe(tmp_path, capsys, monkeypatch):
    return Probe(tmp_path, capsys, monkeypatch)


def test_the_table_is_large_enough():
    assert len(CASES) >= 40 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("name, flags, expected", CASES, ids=[c[0] for c in CASES])
def test_bad_key_is_one_line_before_anything_is_written(name, flags, expected, probe):
    config = probe.moe_config if name.startswith("moe:") else probe.config
    probe.refused("train", probe.train(*flags, config=config), expected)


@pytest.mark.parametrize("text, value", [("[7]", [7]), ("7", [7]), ("1,2", [1, 2]), ("[1, 2]", [1, 2]), ("[]", []), ("", [])])
def test_a_list_key_is_set_from_the_command_line(text, value):
    """Every key can be set from the command line, list-valued ones included (the README's promise;
    `--config.model.mlp_only_layers=[7]` was an ml_collections cast error). The reference: the list
    the text spells."""
    from jaxpar.command.config_file import apply_overrides
    from tests.support import tiny

    config = tiny.qwen3_moe()
    apply_overrides(config, [("model.mlp_only_layers", text)])
    assert config.model.mlp_only_layers == value and all(type(v) is int for v in config.model.mlp_only_layers)


def test_a_list_set_on_the_command_line_reaches_the_model(probe, capsys):
    """--config.model.mlp_only_layers=[1] reaches scripts/train.py's run as a list: the model it builds is
    the Qwen3-MoE whose layer 1 is dense, as the same config written in Python builds it (training
    with such a layer: tests/models/test_families_degeneracy.py)."""
    import dataclasses

    import jax

    from jaxpar import command, models
    from tests.support import tiny
    from tests.train.probe import script

    train, seen = script("train"), []
    capture = dataclasses.replace(train.COMMANDS[0], run=lambda args, config: seen.append(config))
    argv = probe.train("--config.model.mlp_only_layers=[1]", config=probe.moe_config)
    assert command.main(train.__doc__, (capture,), argv) == 0, capsys.readouterr().err[-2000:]
    (config,) = seen
    assert list(config.model.mlp_only_layers) == [1]

    def shapes(model_config):
        return jax.tree.map(lambda s: s.shape, models.param_shapes(model_config))

    assert shapes(config.model) == shapes(tiny.qwen3_moe(vocab_size=256, mlp_only_layers=[1]).model)
    assert shapes(config.model) != shapes(tiny.qwen3_moe(vocab_size=256).model)
