"""The config schema: every key jaxpar understands, with its default.

Config files (`configs/*.py`) start from `base_config()` and override fields. Preflight
(`jaxpar.preflight`) rejects any key that is not in this schema, so a typo never passes silently.
`config.model` uses the field names of transformers' `LlamaConfig` / `MixtralConfig`.
"""

import jax.numpy as jnp
from ml_collections import ConfigDict, FieldReference
from ml_collections.config_dict import placeholder

from jaxpar.axes import DATA, MESH_AXES

# `train.param_dtype` / `train.compute_dtype` names and what they mean.
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# `model.rope_scaling.rope_type` values (transformers' names).
ROPE_TYPES = ("default", "llama3")
# Stored vocab rows/columns are padded to a multiple of this (zeros, masked in the loss). It is a
# constant, not a function of the mesh, so parameter shapes and initial values never depend on it.
VOCAB_PAD_MULTIPLE = 128


def padded_vocab_size(vocab_size: int) -> int:
    return -(-vocab_size // VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE


def head_dim_of(model) -> int:
    """`model.head_dim`, or hidden_size / num_attention_heads when it is None (transformers' rule)."""
    return model.head_dim if model.head_dim is not None else model.hidden_size // model.num_attention_heads


def llama_model_config(**overrides) -> ConfigDict:
    """A Llama `config.model` section, LlamaConfig field names plus `model_type`."""
    model = ConfigDict(
        dict(
            model_type="llama",
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            # None: hidden_size // num_attention_heads.
            head_dim=placeholder(int),
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            # rope_type "default" or "llama3"; the other fields are used by llama3 only.
            rope_scaling=dict(
                rope_type="default",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=8192,
            ),
            max_position_embeddings=4096,
            tie_word_embeddings=False,
            initializer_range=0.02,
        )
    )
    model.update(overrides)
    return model


def mixtral_model_config(**overrides) -> ConfigDict:
    """A Mixtral `config.model` section: the Llama fields (Mixtral 8x7B's values) plus MixtralConfig's
    MoE fields, `capacity_factor` and `router_z_loss_coef` (see `jaxpar.models.moe`)."""
    model = llama_model_config(
        model_type="mixtral",
        intermediate_size=14336,
        num_key_value_heads=8,
        rms_norm_eps=1e-5,
        rope_theta=1e6,
        max_position_embeddings=32768,
    )
    model.update(
        dict(
            num_local_experts=8,
            num_experts_per_tok=2,
            router_aux_loss_coef=0.02,  # Mixtral 8x7B's value (MixtralConfig's default is 0.001)
            router_z_loss_coef=0.0,
            # 0: dropless. > 0: each expert takes at most ceil(seq_len * k / E * factor) tokens
            # of each sequence; the rest are dropped (their MoE output is zero).
            capacity_factor=0.0,
        )
    )
    model.update(overrides)
    return model


def base_config() -> ConfigDict:
    c = ConfigDict()
    c.model = llama_model_config()

    # Mesh axis sizes; -1 on one axis takes the remaining devices.
    c.mesh = ConfigDict({name: 1 for name in MESH_AXES})
    c.mesh[DATA] = -1

    c.parallel = ConfigDict(
        dict(
            zero_stage=0,  # 0 replicated; 1 optimizer state over data; 3 params + optimizer state over data
            sequence_parallel=False,  # shard activations between blocks along seq over `tensor`
            # auto | none | full | save_dots. auto: the fastest measured for the backend
            # (`jaxpar.models.options.AUTO_REMAT`: full on CPU, none elsewhere).
            remat="auto",
            attention_impl="auto",  # auto | xla | cudnn | jaxpar_xla (auto: cudnn on GPU for 16-bit, jaxpar_xla on CPU, else xla)
            # Pipeline (used when mesh.pipeline > 1): gpipe | 1f1b | interleaved_1f1b | zb_h1.
            pipeline_schedule="1f1b",
            num_microbatches=0,  # per step, replacing train.grad_accum; 0 means mesh.pipeline
            virtual_stages=1,  # layer chunks per pipeline rank (> 1 only with interleaved_1f1b)
            # Context parallelism (used when mesh.context > 1): all_gather | ring | all_to_all.
            context_impl="all_gather",
            context_load_balance=True,  # 2c chunks, rank r holds chunks r and 2c-1-r (causal balance)
            context_block_size=512,  # query / key chunk of the flash-style attention (bounds temp memory)
            # Layers per pipeline stage (per virtual stage when interleaved, in stage order), as a
            # list or "21,20,20,19"; "auto": balanced by modelled cost (`parallel.pipeline.balance`).
            pipeline_stage_layers=FieldReference("auto", field_type=object),
            # Embedding / LM head with pipeline: "spread" (vocab-parallel over the pipeline ranks:
            # 1/p of the tables and their work on each) or "ends" (whole tables on every rank, the
            # first stage embeds, the last runs the head + loss).
            pipeline_vocab="spread",
        )
    )

    c.train = ConfigDict(
        dict(
            steps=100,
            global_batch_size=8,
            seq_len=128,
            grad_accum=1,
            # Optimizers and schedules: one record each in `jaxpar.optim`; each reads the keys named after it.
            optimizer="adamw",  # adamw | adafactor | lion | muon | sgd
            learning_rate=3e-4,
            lr_schedule="cosine",  # cosine | wsd | linear | constant, each after a linear warmup
            warmup_steps=10,
            final_learning_rate_fraction=0.1,
            wsd_decay_fraction=0.2,  # wsd: the last fraction of train.steps decays ...
            wsd_decay_shape="1-sqrt",  # ... shaped linear | cosine | 1-sqrt
            weight_decay=0.1,
            weight_decay_exclude="norm",  # logical names, comma-separated, whose params are not decayed
            adam_b1=0.9,  # adamw, and muon's AdamW part
            adam_b2=0.95,
            adam_eps=1e-8,
            adafactor_decay_rate=0.8,
            adafactor_min_dim_to_factor=128,
            adafactor_clipping_threshold=1.0,  # 0: no update clipping
            adafactor_momentum=0.0,  # 0: none
            lion_b1=0.9,
            lion_b2=0.99,
            muon_beta=0.95,
            muon_ns_steps=5,
            muon_nesterov=True,
            muon_consistent_rms=0.2,  # 0: Keller Jordan's width scaling instead
            sgd_momentum=0.9,  # 0: none
            sgd_nesterov=False,
            max_grad_norm=1.0,
            seed=0,
            param_dtype="float32",
            compute_dtype="float32",  # float32 | bfloat16 | float16 (dynamic loss scaling)
            loss_scale_init=2.0**15,
            loss_scale_period=2000,  # finite steps before the fp16 loss scale doubles
            log_every=1,  # metrics fetched and logged every this many steps (progress bar or, off a TTY, a line)
            # A non-finite loss or gradient norm (fp32 / bf16): "stop" ends the run at that step, the
            # workdir and the last good checkpoint intact; "skip" leaves params and optimizer state
            # unchanged for that step and goes on, stopping once more than max_skipped_steps were skipped.
            on_nonfinite="stop",
            max_skipped_steps=10,
            # fp16: the dynamic loss scale skips overflowing steps; the run stops when a step overflows
            # at the smallest scale (1), or when more than max_skipped_fraction of the last
            # skip_window steps were skipped.
            max_skipped_fraction=0.5,
            skip_window=100,
            # A transformers checkpoint directory to start from (a fresh run's initial params; each
            # process reads only the slices its devices hold). Ignored when resuming.
            init_from_hf="",
            # Observability (`jaxpar.train.observe`): a jax.profiler trace of steps profile_start ..
            # profile_start + profile_steps - 1 (1-based) under WORKDIR/profile (0 steps: none);
            # TensorBoard scalars under WORKDIR/tensorboard; the peak FLOP/s of one device for MFU
            # (0: a table per device kind, or on CPU a matmul measured once).
            profile_start=3,
            profile_steps=0,
            tensorboard=True,
            peak_flops_per_device=0.0,
        )
    )

    c.data = ConfigDict(
        dict(
            source="stdlib",  # stdlib | text | tokens
            path="",  # text: a file or folder; tokens: a flat binary token file
            token_dtype="uint16",  # dtype of a `tokens` file
            max_corpus_bytes=4_000_000,  # cap on the built-in stdlib corpus
        )
    )

    c.checkpoint = ConfigDict(
        dict(
            dir="",  # "" → WORKDIR/checkpoints; any path Orbax handles (local, NFS, gs://)
            every_steps=100,  # async save every this many steps (0: only at the end) and at the end
            keep=3,  # newest complete checkpoints kept (0: all)
            async_save=True,
        )
    )
    return c
