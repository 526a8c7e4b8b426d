"""Downstream evaluation: lm-eval-harness tasks on a jaxpar model, on a mesh.

`model.JaxparLM` is jaxpar as an lm-eval model over params on a mesh (it imports lm-eval, the
[eval] extra; `jaxpar.loading.lm_eval` registers it as `jaxpar`, loading a run first); `scoring`
holds the batched log-likelihoods and the generation it runs, with no lm-eval import; `harness` runs named tasks from local task files
(scripts/harness.py, and the training loop every `eval.harness_every_steps`) and checks the
`eval.harness_*` keys. Nothing here is imported by `import jaxpar`.
"""
