"""The config schema: every key jaxpar understands, with its default.

Config files (`configs/*.py`) start from `base_config()` and override fields; `config.model` comes
from the family's schema (`jaxpar.models.<family>.model_config`, e.g. `jaxpar.models.llama`), with
the field names of the family's transformers config. Preflight (`jaxpar.train.preflight`) rejects
any key that is not in this schema, so a typo never passes silently.
"""

from ml_collections import ConfigDict, FieldReference

from jaxpar.axes import DATA, MESH_AXES
from jaxpar.models.llama.schema import model_config as llama_model_config


def resolve_derived(config: dict) -> dict:
    """A config as a plain nested dict (e.g. saved JSON) with every derived default made explicit
    and every key its other keys leave unused dropped, so two configs that describe the same run
    compare equal: `model.head_dim` None -> hidden_size // num_attention_heads; the llama3 fields
    of `model.rope_scaling` under rope_type "default"; `data.token_dtype` unless data.source is
    "tokens", `data.path` unless "text", "tokens" or "datasets", `data.max_corpus_bytes` unless "stdlib"."""
    config = ConfigDict(config)  # a deep copy, and sections by attribute
    model = config.get("model")
    if isinstance(model, ConfigDict):
        if model.get("head_dim") is None and {"hidden_size", "num_attention_heads"} <= set(model.keys()):
            model.head_dim = model.hidden_size // model.num_attention_heads
        scaling = model.get("rope_scaling")
        if isinstance(scaling, ConfigDict) and scaling.get("rope_type", "default") == "default":
            model.rope_scaling = ConfigDict({"rope_type": "default"})
    try:
        data = config.data  # by attribute: the section's name is also a mesh axis name (jaxpar.axes)
    except AttributeError:
        data = None
    if isinstance(data, ConfigDict) and "source" in data:
        unused = {"tokens": ("max_corpus_bytes",), "text": ("token_dtype", "max_corpus_bytes"),
                  "datasets": ("token_dtype", "max_corpus_bytes")}.get(
            data.source, ("token_dtype", "path")
        )
        for key in unused:
            if key in data:
                del data[key]
    return config.to_dict()


def base_config() -> ConfigDict:
    c = ConfigDict()
    c.model = llama_model_config()

    # Mesh axis sizes; -1 on one axis takes the remaining devices.
    c.mesh = ConfigDict({name: 1 for name in MESH_AXES})
    c.mesh[DATA] = -1

    c.parallel = ConfigDict(
        dict(
            zero_stage=0,  # 0 replicated; 1 optimizer state over data; 3 params + optimizer state over data
            # The mesh axes ZeRO shards over: "data", "data+context", or "auto" (data x context whenever
            # mesh.context > 1, except ZeRO-3 with a pipeline: `jaxpar.parallel.zero` says why it is the default).
            zero_axes="auto",
            sequence_parallel=False,  # shard activations between blocks along seq over `tensor`
            # auto | none | full | save_dots. auto: the fastest measured for the backend
            # (`jaxpar.parallel.plan.AUTO_REMAT`: full on CPU, none elsewhere).
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
            # Before anything is allocated the loop compares the compiled step's memory per device with
            # what a device holds and stops (exit 2) when it does not fit (`jaxpar.train.fit`); True skips it.
            skip_fit_check=False,
            # The planner's predicted step time (`scripts/train.py --plan` sets it): every metrics record
            # then carries it as predicted_step_s beside the measured step_s. 0: none.
            predicted_step_s=0.0,
        )
    )

    # Documents, packing, mixtures: `jaxpar.data.corpus` (and README "Your own data").
    c.data = ConfigDict(
        dict(
            source="stdlib",  # stdlib | text | tokens | datasets
            # text: a file or folder; tokens: a flat binary token file; datasets: a jsonl / json /
            # parquet / arrow file, a folder of them or a glob
            path="",
            token_dtype="uint16",  # dtype of a `tokens` file
            max_corpus_bytes=4_000_000,  # cap on the built-in stdlib corpus
            tokenizer="",  # a local transformers tokenizer folder (stdlib / text / datasets); "": bytes
            text_field="text",  # the field of a .jsonl / json / parquet / arrow record holding its text
            text_documents="file",  # text source, plain files: a document per "file" or per "line"
            # tokens without an offsets sidecar (prepare_data.py writes one): a document ends after
            # each eos_id; -1: no document boundaries (windows of seq_len + 1 tokens)
            eos_id=-1,
            packing=True,  # pack documents into rows (False: one document per row, cut and padded)
            # Weighted sources, mixed document by document (data.path unused): "PATH:WEIGHT,..." read
            # with the settings above, or in a config file a list of dicts with path, weight and
            # any of source, text_field, text_documents, token_dtype, eos_id.
            mixture=FieldReference("", field_type=object),
        )
    )

    # Held-out evaluation (`jaxpar.train.eval`): off unless eval.path or eval.share is set.
    c.eval = ConfigDict(
        dict(
            path="",  # an eval corpus, read with data's settings (source, tokenizer, packing)
            share=0.0,  # or this share of the training documents, held out by a hash of their tokens
            every_steps=0,  # evaluate every this many steps (0: only at the end; always at the end)
            steps=0,  # batches of train.global_batch_size rows per evaluation (0: the whole eval set once)
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
