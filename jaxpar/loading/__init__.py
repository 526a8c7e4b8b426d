"""A trained run or a transformers checkpoint, loaded for inference: `load.load(...)` (scripts/sample.py,
scripts/harness.py) and lm-eval's `--model jaxpar` (`lm_eval`, registered when imported).

It sits above `jaxpar.train` (restoring a checkpoint builds the train program), so the sampler and
the evaluations the training loop runs (`jaxpar.sampling`, `jaxpar.downstream`) stay below it.
"""
