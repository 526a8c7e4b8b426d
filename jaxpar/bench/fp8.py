"""FP8 training on CPU (`train.fp8`), for what CPU can say: the loss curves and the emulated step time.

`curves`: the same config trained from the same seed on the same data in fp32, in bf16, and in bf16
with each FP8 recipe, through the real loop (`jaxpar.train.loop.train`); each FP8 curve is compared
with the bf16 one over windows of `WINDOW` steps (the mean loss per window: single steps are noisy
in both), and the gaps are the report. `step_times`: the train step of one config in bf16 and in
each recipe, alternated within one invocation, median seconds per step. On CPU XLA converts the
FP8 operands back to fp32 and runs an fp32 dot, so the FP8 step is the bf16 one plus the
quantization passes: an emulation, slower, saying nothing of a GPU's FP8 GEMMs.
"""

from __future__ import annotations

import os
import statistics

import numpy as np

WINDOW = 20
RECIPES = ("tensorwise", "rowwise", "delayed")


def _variant(config, precision: str):
    c = config.copy_and_resolve_references()
    c.train.compute_dtype = "float32" if precision == "fp32" else "bfloat16"
    c.train.fp8 = precision if precision in RECIPES else "none"
    return c


def windowed(losses, window: int = WINDOW) -> np.ndarray:
    losses = np.asarray(losses, np.float64)
    usable = len(losses) // window * window
    return losses[:usable].reshape(-1, window).mean(axis=1)


def curves(config, root: str, recipes=RECIPES) -> dict:
    """{precision: [loss per step]} for fp32, bf16 and each of `recipes`, and the gaps to bf16."""
    from jaxpar.train.loop import train

    losses = {}
    for precision in ("fp32", "bf16", *recipes):
        history = train(_variant(config, precision), os.path.join(root, precision), progress=False)
        losses[precision] = [float(r["loss"]) for r in history]
    window = min(WINDOW, len(losses["bf16"]))  # a short run (the docs' check): one window
    reference = windowed(losses["bf16"], window)
    gaps = {}
    for precision in ("fp32", *recipes):
        mine = windowed(losses[precision], window)
        gaps[precision] = {
            "max_window_gap": float(np.max(np.abs(mine - reference))),
            "max_window_gap_relative": float(np.max(np.abs(mine - reference) / reference)),
            "final_window_gap": float(mine[-1] - reference[-1]),
        }
    return {"window": window, "losses": losses, "gaps_to_bf16": gaps}


def plot(result: dict, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    for precision, losses in result["losses"].items():
        steps = np.arange(1, len(losses) + 1)
        ax.plot(steps, losses, lw=0.6, alpha=0.35)
        mean = windowed(losses, result["window"])
        centres = np.arange(len(mean)) * result["window"] + result["window"] / 2
        ax.plot(centres, mean, lw=1.6, color=ax.lines[-1].get_color(), label=precision)
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss (thin: per step; thick: mean of {result['window']})")
    ax.set_title("FP8 recipes against bf16 and fp32 (tiny Llama, CPU, emulated FP8)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def step_times(config, steps: int, repeats: int, recipes=RECIPES) -> dict[str, float]:
    """Median seconds per step of bf16 and each of `recipes`, round-robin over `repeats` rounds."""
    from jaxpar.train import harness

    runs = {}
    for precision in ("bf16", *recipes):
        run = harness.prepare(_variant(config, precision))
        run.compile()
        run.step()  # warm-up
        runs[precision] = run
    times = {precision: [] for precision in runs}
    for _ in range(repeats):
        for precision, run in runs.items():
            times[precision] += run.steps(steps)[1]
    return {precision: statistics.median(t) for precision, t in times.items()}
