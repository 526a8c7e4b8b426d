"""The config schema: every key jaxpar understands, with its default.

Config files (`configs/*.py`) start from `base_config()` and override fields; `config.model` comes
from the family's schema (`jaxpar.models.<family>.model_config`, e.g. `jaxpar.models.llama`), with
the field names of the family's transformers config. Preflight (`jaxpar.train.preflight`) rejects
any key that is not in this schema, so a typo never passes silently. What each key means: `MEANINGS`
at the end, from which (with the records) docs/config.md is generated. Each optimizer's and
learning-rate schedule's own keys are a section `train.<record>` built from the record
(`jaxpar.optim.SECTIONS`); `upgrade` reads configs saved before those sections existed.
"""

import copy

from ml_collections import ConfigDict, FieldReference

from jaxpar import fp8, objective, optim, trackers
from jaxpar.axes import CONTEXT, DATA, EXPERT, MESH_AXES, PIPELINE, TENSOR
from jaxpar.models.llama.schema import model_config as llama_model_config

# Keys that moved, old dotted name -> new: each record's flat `train.` keys (`train.adam_b1`) to
# its section (`train.adamw.b1`). `upgrade` moves them in saved configs; a user typing an old one
# is told where it went (preflight, `--config.KEY=VALUE`).
MOVED_KEYS = {
    f"train.{h.was}": f"train.{section}.{h.name}" for section, keys in optim.SECTIONS.items() for h in keys if h.was
}


def upgrade(config: dict) -> dict:
    """A saved config (a plain nested dict: a checkpoint's, or WORKDIR/config.json) with every key
    of `MOVED_KEYS` moved to its new place; a copy, the input is left as it is. Configs written
    before a key moved still resume, sample and convert."""
    config = copy.deepcopy(config)
    for old, new in MOVED_KEYS.items():
        *old_path, old_key = old.split(".")
        node = config
        for part in old_path:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or old_key not in node:
            continue
        value = node.pop(old_key)
        *new_path, new_key = new.split(".")
        node = config
        for part in new_path:
            node = node.setdefault(part, {})
        node.setdefault(new_key, value)
    return config


def with_defaults(saved: dict) -> ConfigDict:
    """A saved config (a plain nested dict) in today's layout (`upgrade`) with every key added since
    it was saved at its default, which is what runs did before the key existed; the model section's
    defaults are its family's. Restoring a checkpoint builds today's program from it."""
    from jaxpar.models.families import FAMILIES  # the families import this module's neighbours

    config = upgrade(saved)
    defaults = base_config().to_dict()
    model = config.get("model", {})
    if isinstance(model, dict) and model.get("model_type") in FAMILIES:
        defaults["model"] = FAMILIES[model["model_type"]].schema().to_dict()

    def fill(node: dict, default: dict) -> dict:
        for key, value in default.items():
            if key not in node:
                node[key] = copy.deepcopy(value)
            elif isinstance(value, dict) and isinstance(node[key], dict):
                fill(node[key], value)
        return node

    return ConfigDict(fill(config, defaults))


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
            zero_stage=0,
            zero_axes="auto",
            sequence_parallel=False,
            collective_matmul="none",
            expert_overlap=False,
            remat="auto",
            attention_impl="auto",
            pipeline_schedule="1f1b",  # the pipeline keys are read when mesh.pipeline > 1
            num_microbatches=0,
            virtual_stages=0,  # 0: the schedule's own (`ScheduleKind.default_virtual_stages`)
            context_impl="all_gather",  # the context keys are read when mesh.context > 1
            context_load_balance=True,
            context_block_size=512,
            context_latent=True,
            pipeline_stage_layers=FieldReference("auto", field_type=object),  # a list, or a string
            pipeline_vocab="spread",
        )
    )

    c.train = ConfigDict(
        dict(
            steps=100,
            global_batch_size=8,
            seq_len=128,
            grad_accum=1,
            # Optimizers and schedules: one record each in `jaxpar.optim`; a record's own keys are its
            # section below (train.adamw.b1, train.wsd.decay_fraction, ...), set or not whether selected.
            optimizer="adamw",  # adamw | adafactor | lion | muon | sgd
            learning_rate=3e-4,
            lr_schedule="cosine",  # cosine | wsd | linear | constant, each after a linear warmup
            warmup_steps=10,
            final_learning_rate_fraction=0.1,  # where cosine, linear and wsd end: learning_rate × this
            weight_decay=0.1,
            weight_decay_exclude="norm",  # logical names, comma-separated, whose params are not decayed
            max_grad_norm=1.0,
            mtp_loss_weight=0.3,  # multi-token prediction (models with such modules: DeepSeek-V3's)
            objective="lm",  # lm | dpo (`jaxpar.objective`, its keys in train.dpo)
            seed=0,
            param_dtype="float32",
            compute_dtype="float32",
            loss_scale_init=2.0**15,
            loss_scale_period=2000,
            log_every=1,
            on_nonfinite="stop",
            max_skipped_steps=10,
            max_skipped_fraction=0.5,
            skip_window=100,
            init_from_hf="",
            profile_start=3,  # observability: `jaxpar.train.observe`
            profile_steps=0,
            tensorboard=True,
            loggers="tensorboard",  # experiment trackers, comma-separated: `jaxpar.trackers`
            peak_flops_per_device=0.0,
            skip_fit_check=False,
            predicted_step_s=0.0,
        )
    )
    c.train.update({key.name: key.default for key in trackers.KEYS})  # each tracker's own keys
    c.train.update(fp8.KEYS)  # FP8 matmuls: `jaxpar.fp8`
    # LoRA fine-tuning (`jaxpar.models.lora`): rank 0 trains every parameter.
    c.train.lora = ConfigDict(dict(rank=0, alpha=16.0, dropout=0.0, targets="q,k,v,o,gate,up,down", init_from_peft="",
                                 base_in_compute_dtype=False))
    c.train.dpo = ConfigDict(dict(objective.KEYS))
    for section, keys in optim.SECTIONS.items():
        c.train[section] = ConfigDict(optim.hyperparameters.defaults(keys))

    # Documents, packing, mixtures: `jaxpar.data.corpus` (and README "Your own data").
    c.data = ConfigDict(
        dict(
            source="stdlib",
            path="",
            token_dtype="uint16",
            max_corpus_bytes=4_000_000,
            tokenizer="",
            text_field="text",
            format="text",
            text_documents="file",
            eos_id=-1,
            packing=True,
            mixture=FieldReference("", field_type=object),  # a string, or a list of dicts
            mixture_stages=FieldReference([], field_type=object),  # [[STEP, WEIGHTS], ...]
        )
    )

    # Held-out evaluation (`jaxpar.train.eval`): off unless eval.path or eval.share is set.
    c.eval = ConfigDict(
        dict(
            path="",
            share=0.0,
            every_steps=0,
            steps=0,
            harness_every_steps=0,  # lm-eval tasks in the loop: `jaxpar.downstream.harness`
            harness_tasks="",
            harness_include_path="",
            harness_limit=0,
        )
    )

    c.checkpoint = ConfigDict(
        dict(
            dir="",
            every_steps=100,
            keep=3,
            async_save=True,
            local_dir="",  # the frequent tier: `jaxpar.checkpoint.tiers`
            local_every_steps=0,
            local_keep=2,
        )
    )
    return c


# What each key means, one line each: docs/config.md is generated from this table, the schema above,
# and the records (`python scripts/docs.py config`; `tests/docs/test_config_reference.py` keeps them
# in step). The allowed values of keys that name a record (a schedule, an optimizer, ...) are listed
# there from the records, so they are not repeated here. `config.model`'s keys: `jaxpar.models.schema`.
MEANINGS = {
    f"mesh.{DATA}": "data-parallel replicas: the batch is split over them (with ZeRO also optimizer state and parameters)",
    f"mesh.{PIPELINE}": "pipeline ranks: the layers are split into stages over them",
    f"mesh.{CONTEXT}": "context-parallel ranks: every sequence is split over them",
    f"mesh.{EXPERT}": "expert-parallel ranks: the MoE experts are split over them; for dense layers more data replicas",
    f"mesh.{TENSOR}": "tensor-parallel ranks: heads and MLP columns of every layer are split over them",
    "parallel.zero_stage": "0: replicated; 1: optimizer state sharded over the ZeRO axes; 3 (FSDP): parameters too",
    "parallel.zero_axes": "the mesh axes ZeRO shards over; auto: data x context whenever mesh.context > 1, except ZeRO-3 "
    "with a pipeline (data only)",
    "parallel.sequence_parallel": "also split the residual stream between blocks along the sequence over tensor "
    "(reduce-scatter + all-gather instead of all-reduce; less activation memory)",
    "parallel.collective_matmul": "with sequence parallelism, the gathers before and the scatters after the dense "
    "projections: none (the partitioner's collectives), permutes (exchanges of collective-permutes, each beside a partial "
    "matmul), xla (XLA's GPU windowed einsum; needs its XLA_FLAGS, the plain path on CPU)",
    "parallel.expert_overlap": "with expert parallelism: each device's rows dispatched to the experts in two independent "
    "chunks, so one chunk's all-to-all can run beside the other's expert matmuls",
    "parallel.remat": "what the backward recomputes; offload: save_dots' projection outputs wait in host memory; auto: full "
    "on CPU (measured), on an accelerator the cost model's fastest that fits (scripts/train.py)",
    "parallel.attention_impl": "the attention kernel; auto: cudnn on GPU for 16-bit compute, jaxpar_xla on CPU, xla "
    "otherwise",
    "parallel.pipeline_schedule": "the order in which pipeline ranks run forwards and backwards",
    "parallel.num_microbatches": "microbatches per step through the pipeline (they replace train.grad_accum); 0: "
    "mesh.pipeline",
    "parallel.virtual_stages": "layer chunks per pipeline rank; 0: the schedule's own (2 for interleaved_1f1b, zb_v "
    "and dualpipev, else 1); interleaved_1f1b takes any v >= 1, zb_v and dualpipev only 2, the others only 1",
    "parallel.pipeline_stage_layers": "layers per pipeline stage in stage order, as a list or \"21,20,20,19\"; auto: "
    "balanced by modelled cost",
    "parallel.pipeline_vocab": "with a pipeline, where embedding and LM head run: spread (vocab-parallel, 1/p of the "
    "tables and their work on each rank) or ends (the first stage embeds, the last runs head and loss)",
    "parallel.context_impl": "how attention reaches the other context ranks' keys and values",
    "parallel.context_load_balance": "cut each sequence into 2c chunks, rank r holding chunks r and 2c-1-r, so causal "
    "attention costs every rank the same (else contiguous slices)",
    "parallel.context_block_size": "query / key chunk of the flash-style context attention (bounds its temporary "
    "memory)",
    "parallel.context_latent": "with context_impl all_gather, a model with latent attention (DeepSeek-V3's MLA) gathers "
    "each token's latent and RoPE key and up-projects them on every rank, instead of gathering keys and values "
    "(not when train.fp8 runs v_proj, MLA's up-projection, in FP8: docs/fp8.md)",
    "train.steps": "optimizer updates of the run",
    "train.global_batch_size": "sequences per step, over all devices",
    "train.seq_len": "tokens per sequence",
    "train.grad_accum": "microbatches per step without a pipeline (gradient accumulation)",
    "train.optimizer": "the optimizer (run after global-norm clipping)",
    "train.learning_rate": "the peak learning rate, reached after warmup",
    "train.lr_schedule": "the learning-rate schedule after the linear warmup",
    "train.warmup_steps": "updates of linear warmup from 0 to train.learning_rate",
    "train.final_learning_rate_fraction": "the learning rate after train.steps, as a fraction of the peak",
    "train.weight_decay": "decoupled weight decay, times the learning rate (sgd: L2 added to the gradient)",
    "train.weight_decay_exclude": "logical names, comma-separated, whose parameters are not decayed (norm: the norm "
    "scales)",
    "train.max_grad_norm": "global gradient-norm clipping threshold",
    "train.mtp_loss_weight": "weight of the multi-token prediction loss (the mean over its depths) for models with "
    "such modules (model.num_nextn_predict_layers > 0); 0: they do not run",
    "train.seed": "initialisation and data-order seed",
    "train.param_dtype": "what parameters are stored and updated in",
    "train.compute_dtype": "what forward and backward run in; float16 adds dynamic loss scaling",
    "train.loss_scale_init": "fp16: the initial loss scale",
    "train.loss_scale_period": "fp16: finite steps before the loss scale doubles",
    "train.log_every": "metrics fetched and logged every this many steps (progress bar, or off a terminal a line)",
    "train.on_nonfinite": "a non-finite loss or gradient norm (fp32 / bf16): stop ends the run at that step, the last "
    "good checkpoint intact; skip leaves the state unchanged for that step and goes on",
    "train.max_skipped_steps": "with on_nonfinite=skip: stop once more than this many steps were skipped",
    "train.max_skipped_fraction": "fp16: stop when more than this fraction of the last skip_window steps overflowed",
    "train.skip_window": "fp16: the window of max_skipped_fraction, in steps",
    "train.init_from_hf": "a transformers checkpoint directory a fresh run starts from (ignored when resuming)",
    "train.profile_start": "the first profiled step (1-based)",
    "train.profile_steps": "steps traced by jax.profiler under WORKDIR/profile (0: none)",
    "train.tensorboard": "false: leave tensorboard out of train.loggers (the key from before train.loggers)",
    "train.loggers": "experiment trackers the metrics records go to besides metrics.jsonl, comma-separated (a resumed run "
    "continues the same tracked run)",
    **{f"train.{key.name}": key.meaning for key in trackers.KEYS},
    **fp8.MEANINGS,
    "train.lora.rank": "LoRA: the adapters' rank; > 0 freezes the model and trains adapters on train.lora.targets (0: "
    "full fine-tuning)",
    "train.lora.alpha": "LoRA: the adapters' output is scaled by alpha / rank",
    "train.lora.dropout": "LoRA: dropout on the adapters' input while training, PEFT's lora_dropout (attention and dense MLP "
    "matrices; needs train.grad_accum=1 and no pipeline; 0: adapters folded into the weights)",
    "train.lora.targets": "LoRA: the matrices adapted, by their parameter names, comma-separated (q,k,v,o attention; "
    "gate,up,down MLP and expert; a family's own, e.g. q_a,q_b,kv_a,kv_b)",
    "train.lora.base_in_compute_dtype": "LoRA: hold the frozen base in train.compute_dtype (what the forward casts it to "
    "anyway) instead of train.param_dtype; the adapters stay in train.param_dtype",
    "train.lora.init_from_peft": "LoRA: a PEFT adapter folder (adapter_config.json + adapter_model.safetensors) a fresh "
    "run starts its adapters from (with train.init_from_hf its base)",
    **objective.MEANINGS,
    "train.peak_flops_per_device": "one device's peak FLOP/s for MFU (0: a table per device kind, or on CPU a matmul "
    "measured once)",
    "train.skip_fit_check": "skip the check, before anything is allocated, that the compiled step fits the devices' "
    "memory",
    "train.predicted_step_s": "the planner's predicted step time (train.py --plan sets it), logged beside the "
    "measured one; 0: none",
    "data.source": "stdlib: the Python standard library's source (built in); text: files; tokens: a binary token "
    "file; datasets: jsonl / json / parquet / arrow",
    "data.path": "text: a file or folder; tokens: a token file; datasets: a file, a folder of them or a glob",
    "data.token_dtype": "the dtype of a tokens file",
    "data.max_corpus_bytes": "cap on the built-in stdlib corpus",
    "data.tokenizer": "a local transformers tokenizer folder (stdlib, text, datasets); empty: bytes are the tokens",
    "data.text_field": "the field of a jsonl / json / parquet / arrow record that holds its text",
    "data.format": "what a record holds: text (data.text_field, every token counts), chat (messages rendered by "
    "data.tokenizer's chat template, the assistant's tokens count), prompt_completion (the completion's tokens count) "
    "or preference (prompt, chosen and rejected: pairs for train.objective='dpo', both completions count)",
    "data.text_documents": "text files: a document per file or per line",
    "data.eos_id": "tokens without an offsets sidecar: a document ends after each eos_id; -1: no boundaries",
    "data.packing": "pack documents into rows (false: one document per row, cut and padded)",
    "data.mixture": "weighted sources mixed document by document, \"PATH:WEIGHT,...\" (or in a config file a list of "
    "dicts); data.path is then unused",
    "data.mixture_stages": "the mixture's weights by step, [[STEP, WEIGHTS], ...]: from train step STEP on, WEIGHTS "
    "(one per data.mixture entry, or a dict by entry name); data.mixture's own weights hold before the first",
    "eval.path": "an eval corpus, read with data's settings",
    "eval.share": "or this share of the training documents, held out by a hash of their tokens",
    "eval.every_steps": "evaluate every this many steps (0: only at the end; always at the end)",
    "eval.steps": "batches of train.global_batch_size rows per evaluation (0: the whole eval set once)",
    "eval.harness_every_steps": "run lm-eval tasks on the model every this many steps (0: off)",
    "eval.harness_tasks": "the lm-eval task names, comma-separated",
    "eval.harness_include_path": "a folder of lm-eval task YAML files (local data: dataset_path json, data_files)",
    "eval.harness_limit": "documents per task in each harness evaluation (0: all)",
    "checkpoint.dir": "where checkpoints go; empty: WORKDIR/checkpoints; any path Orbax handles (local, NFS, gs://)",
    "checkpoint.every_steps": "save every this many steps (0: only at the end), and always at the end",
    "checkpoint.keep": "newest complete checkpoints kept (0: all)",
    "checkpoint.async_save": "write checkpoints in the background while training goes on",
    "checkpoint.local_dir": "the frequent tier: fast storage every process sees (a node's disk, /dev/shm) a restart "
    "resumes from when it is newer than checkpoint.dir's; empty: one tier",
    "checkpoint.local_every_steps": "with checkpoint.local_dir: save there every this many steps (steps due in "
    "checkpoint.dir go there only)",
    "checkpoint.local_keep": "newest complete checkpoints the local tier keeps",
}
