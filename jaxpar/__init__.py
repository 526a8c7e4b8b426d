"""jaxpar: Llama and Mixtral training in JAX/Flax with data, tensor, pipeline, context and expert
parallelism over one named device mesh.

Where things live: `config` (every key and its default), `mesh` + `axes` (the five-axis mesh),
`sharding` (the one logical → mesh rules table), `parallel/` (one module per parallelism and the
plan that decides them), `models/` (the families and their functional face), `train/` (loss, step,
setup, loop), `data/`, `interop/` (transformers checkpoints), `kernels/`.
"""


def generate(model_config, params, prompts, **kwargs):
    """Token ids continuing each prompt: `jaxpar.sampling.generate` (imported on first use, so
    `import jaxpar` stays light)."""
    from jaxpar.sampling import generate as _generate

    return _generate(model_config, params, prompts, **kwargs)
