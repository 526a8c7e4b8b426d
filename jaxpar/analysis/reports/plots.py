"""PNG plots, drawn to be read at the size a page shows them (at most 1600 px wide, labels horizontal):

- a sweep (`jaxpar.analysis.reports.sweep`), from its CSV records (`record`, or `sweep.csv` read back,
  so `replot_sweep` redraws a shipped sweep without compiling anything): `plot_memory` (the model's
  peak against the compiled one for every layout, and the leanest layouts' peaks on the hardware
  against its usable memory) and `plot_step_time` (the fastest layouts' predicted step time split into
  compute, communication and bubble);
- a run (`plot_run`): loss, eval loss and learning rate against step, from its metrics records
  (`read_run` reads them);
- a pipeline schedule's table (`plot_schedule`): one row per rank, each cell as long as its step
  lasts under the lockstep cost model, so the white is the bubble.

Needs matplotlib (imported here only).
"""

from __future__ import annotations

import csv
import json
import os
import re

GIB = 2**30
WIDTH_IN, DPI = 16, 100  # 1600 px
TOP = 24  # bars in a ranking: the rest are in sweep.md's table


def pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 11, "axes.titlesize": 13, "axes.labelsize": 11, "legend.fontsize": 10})
    return plt


def _num(value) -> float | None:
    """A CSV cell (or a typed value) as a number; None when empty."""
    return None if value in ("", None) else float(value)


def _true(value) -> bool:
    return value is True or value == "True"


# -- sweeps ----------------------------------------------------------------------------------------


def plot_memory(records: list[dict], path: str, *, title: str, usable_bytes: float) -> None:
    """Left: predicted against compiled peak per device on XLA:CPU for every layout (log-log; on the
    diagonal the model is exact). Right: the TOP leanest layouts' predicted peak on the hardware
    against its usable memory."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(WIDTH_IN, 8), gridspec_kw={"width_ratios": [1, 1.6]})
    pairs = [(_num(r["compiled_peak_bytes"]) / GIB, _num(r["predicted_peak_bytes"]) / GIB) for r in records
             if _num(r["compiled_peak_bytes"]) and _num(r["predicted_peak_bytes"])]
    if pairs:
        compiled, predicted = zip(*pairs)
        low, high = min(compiled + predicted) / 1.3, max(compiled + predicted) * 1.3
        left.fill_between([low, high], [low / 1.1, high / 1.1], [low * 1.1, high * 1.1], color="0.9", label="within 10%")
        left.plot([low, high], [low, high], color="0.5", linewidth=1)
        left.scatter(compiled, predicted, s=28, color="tab:blue", label=f"{len(pairs)} layouts")
        left.set_xscale("log")
        left.set_yscale("log")
        left.set_xlim(low, high)
        left.set_ylim(low, high)
        from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

        for axis in (left.xaxis, left.yaxis):  # plain numbers at 1, 2, 5 x 10^k, no crowded minor labels
            axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
            axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            axis.set_minor_formatter(NullFormatter())
    left.set_xlabel("compiled peak, GiB per device (XLA:CPU)")
    left.set_ylabel("model's peak, GiB per device (same program)")
    left.set_title("The memory model against the compiler")
    left.legend(loc="upper left")

    hw = sorted((r for r in records if _num(r["predicted_peak_bytes_hw"])), key=lambda r: _num(r["predicted_peak_bytes_hw"]))
    shown = hw[:TOP][::-1]
    y = range(len(shown))
    right.barh(y, [_num(r["predicted_peak_bytes_hw"]) / GIB for r in shown],
               color=["tab:green" if _true(r["fits"]) else "tab:gray" for r in shown])
    right.axvline(usable_bytes / GIB, color="tab:red", linestyle="--", label=f"usable: {usable_bytes / GIB:.0f} GiB")
    right.set_yticks(list(y), [r["layout"] for r in shown], fontsize=9)
    right.set_xlabel("model's peak on the hardware, GiB per device (green: fits)")
    right.set_title(f"The {len(shown)} leanest of {len(hw)} layouts")
    right.legend(loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def plot_step_time(records: list[dict], path: str, *, title: str) -> None:
    """The TOP fastest layouts' predicted step time, stacked compute / communication / bubble; a
    layout that does not fit the hardware's memory is hatched."""
    plt = pyplot()
    priced = sorted((r for r in records if _num(r["predicted_step_s"])), key=lambda r: _num(r["predicted_step_s"]))
    shown = priced[:TOP][::-1]
    fig, ax = plt.subplots(figsize=(WIDTH_IN, 0.32 * len(shown) + 2.2))
    y = list(range(len(shown)))
    left = [0.0] * len(shown)
    fits = sum(_true(r["fits"]) for r in priced)
    hatched = 0 < fits < len(priced)  # marking every bar (or none) would say nothing
    for i, (name, column) in enumerate((("compute", "predicted_compute_s"), ("communication", "predicted_comm_s"),
                                        ("bubble", "predicted_bubble_s"))):
        values = [_num(r[column]) or 0.0 for r in shown]
        ax.barh(y, values, left=left, label=name, color=plt.cm.Set2(i),
                hatch=["//" if hatched and not _true(r["fits"]) else "" for r in shown], edgecolor="white")
        left = [a + b for a, b in zip(left, values)]
    ax.scatter([_num(r["predicted_step_s"]) for r in shown], y, marker="|", s=260, color="black", zorder=3,
               label="step time (communication hidden behind compute not counted)")
    ax.set_yticks(y, [r["layout"] for r in shown], fontsize=9)
    ax.set_xlabel("predicted seconds per step (bars: all the work, communication whether hidden or not)")
    note = {0: "none fits the memory", len(priced): "all fit"}.get(fits, f"{fits} fit; hatched: does not fit")
    ax.set_title(f"{title}\nthe {len(shown)} fastest of {len(priced)} layouts ({note})")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.6 / ax.figure.get_figheight()), ncol=4, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)


def read_sweep(directory: str) -> tuple[list[dict], str, str]:
    """(sweep.csv's records, the sweep's title from sweep.md, its hardware profile name)."""
    with open(os.path.join(directory, "sweep.csv"), newline="") as f:
        records = list(csv.DictReader(f))
    with open(os.path.join(directory, "sweep.md")) as f:
        title = f.readline().lstrip("# ").strip()
    match = re.search(r"\((\S+) for time and fit\)", title)
    return records, title, match.group(1) if match else "a100-80g"


def replot_sweep(directory: str) -> list[str]:
    """Redraws DIR/memory.png and DIR/step_time.png from DIR/sweep.csv; returns their paths."""
    from jaxpar.analysis.cost import hardware as hw
    from jaxpar.analysis.planner.search import USABLE_FRACTION

    records, title, hardware = read_sweep(directory)
    usable = USABLE_FRACTION * hw.get(hardware).hbm_bytes
    paths = [os.path.join(directory, "memory.png"), os.path.join(directory, "step_time.png")]
    plot_memory(records, paths[0], title=f"Per-device memory: {title}", usable_bytes=usable)
    plot_step_time(records, paths[1], title=f"Predicted step time: {title}")
    return paths


# -- a run -----------------------------------------------------------------------------------------


class RunError(ValueError):
    """A run directory with nothing to plot (one line, naming the file)."""


def read_run(run_dir: str) -> tuple[list[dict], str]:
    """(RUN_DIR/metrics.jsonl's records, a title saying how the loss went); RunError when there is
    no such file or no step with a loss in it."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise RunError(f"{run_dir!r}: no metrics.jsonl there (is it a scripts/train.py workdir?)")
    records = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise RunError(f"{path}:{number}: not a JSON record ({e.msg})") from None
    steps = [r for r in records if r.get("loss") is not None and "step" in r]
    if not steps:
        raise RunError(f"{path}: no step with a loss to plot yet")
    first, last = steps[0], steps[-1]
    title = f"{os.path.normpath(run_dir)}: loss {first['loss']:.2f} at step {first['step']} -> {last['loss']:.2f} at step {last['step']}"
    return records, title


def plot_run(records: list[dict], path: str, *, title: str) -> None:
    """Training loss (and eval loss where the run evaluated) and learning rate against step."""
    plt = pyplot()
    train = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None and "step" in r]
    evals = [(r["step"], r["eval_loss"]) for r in records if r.get("eval_loss") is not None]
    rates = [(r["step"], r["learning_rate"]) for r in records if r.get("learning_rate") is not None]
    fig, (loss_ax, lr_ax) = plt.subplots(2, 1, figsize=(9, 6.4), sharex=True, gridspec_kw={"height_ratios": [3, 1.2]})
    if train:
        steps, losses = zip(*train)
        loss_ax.plot(steps, losses, color="tab:blue", alpha=0.35, linewidth=1, label="training loss")
        window = max(1, len(losses) // 20)  # one batch's loss swings with its documents: show the trend too
        mean = [sum(losses[max(0, i - window + 1) : i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(losses))]
        loss_ax.plot(steps, mean, color="tab:blue", linewidth=2, label=f"mean of the last {window} steps")
    if evals:
        loss_ax.plot(*zip(*evals), "o-", color="tab:orange", label="eval loss")
    loss_ax.set_ylabel("loss (nats per token)")
    loss_ax.grid(alpha=0.3)
    loss_ax.legend(loc="upper right")
    loss_ax.set_title(title)
    if rates:
        lr_ax.plot(*zip(*rates), color="tab:green", linewidth=1.2)
    lr_ax.set_ylabel("learning rate")
    lr_ax.set_xlabel("step")
    lr_ax.grid(alpha=0.3)
    lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


# -- a pipeline schedule ---------------------------------------------------------------------------

_COLOURS = {"F": "#4C9BE8", "B": "#F28E2B", "W": "#59A14F"}


def plot_schedule(schedule, path: str, *, title: str) -> None:
    """One row per rank, time to the right: each step as wide as its lockstep cost (F = 1, a whole
    B = 2, a split B = W = 1), each action a box labelled with its microbatch (and `.u` its local
    virtual stage when a rank holds several); what is left white in a row is that rank idling."""
    from jaxpar.parallel.pipeline.table import action_cost, step_costs

    plt = pyplot()
    from matplotlib.patches import Patch, Rectangle

    costs = step_costs(schedule)
    total = int(costs.sum())
    p, split, show_v = schedule.num_ranks, schedule.split_backward, schedule.virtual_stages > 1
    fig, ax = plt.subplots(figsize=(min(WIDTH_IN, 2.5 + 0.22 * total), 0.5 * p + 1.6))
    start = 0
    for t, row in enumerate(schedule.grid):
        for r, cell in enumerate(row):
            x = start
            for action in cell:
                width = action_cost(action.kind, split)
                ax.add_patch(Rectangle((x, r), width, 0.9, facecolor=_COLOURS[action.kind], edgecolor="white",
                                       alpha=0.55 if show_v and action.vstage else 1.0))
                label = f"{action.mb}" + (f".{action.vstage}" if show_v else "")
                ax.text(x + width / 2, r + 0.45, label, ha="center", va="center", fontsize=8 if total < 80 else 6)
                x += width
        start += int(costs[t])
    ax.set_xlim(0, total)
    ax.set_ylim(p, 0)
    ax.set_yticks([r + 0.45 for r in range(p)], [f"rank {r}" for r in range(p)])
    unit = "a stage chunk's F" if show_v else "F"
    ax.set_xlabel(f"time in units of {unit} (F = 1; a whole B = 2; with B split, B = W = 1)")
    handles = [Patch(color=_COLOURS["F"], label="F: forward"),
               Patch(color=_COLOURS["B"], label="B: input gradient" if split else "B: backward")]
    if split:
        handles.append(Patch(color=_COLOURS["W"], label="W: weight gradient"))
    if show_v:
        handles.append(Patch(facecolor="0.6", alpha=0.55, label="paler: the rank's later stage"))
    ax.set_title(title)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    below = 0.6 / (ax.get_position().height * fig.get_figheight())  # 0.6 in under the axes, past the x label
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -below), ncol=len(handles), frameon=False)
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)

