"""Regenerate what the docs ship that is made, not written: the config reference and the pictures.

  python scripts/docs.py config                        # docs/config.md from the schema and the records
  python scripts/docs.py figures [--run=runs/llama_tiny]

`config` writes docs/config.md (`jaxpar.reference`); tests/docs/test_config_reference.py fails when
the file differs from what it would write. `figures` redraws docs/figures/mesh.png (the five-axis mesh:
which axis splits what) and each axis's row of it (mesh_AXIS.png, for its page), one table per
pipeline schedule in docs/figures/schedules/ (drawn from the schedule's own table), the sweep plots in
docs/sweeps/*/ from their sweep.csv (no compiling), and, given `--run`, docs/figures/quickstart_loss.png
from that run's metrics.jsonl.
"""

from __future__ import annotations

import glob
import os
import sys

from jaxpar import command
from jaxpar.command import Command, Flag, UsageError

DOCS = "docs"
FIGURES = os.path.join(DOCS, "figures")
# The size every schedule is drawn at: each schedule takes it (m >= 2p for dualpipev), v = 2 where a
# schedule takes virtual stages (the same sizes as the config reference's schedule table).
P, M = 4, 8


def run_config(args, config) -> int:
    from jaxpar import reference

    text = reference.render()
    with open(args.out, "w") as f:
        f.write(text)
    print(f"wrote {args.out} ({len(text.splitlines())} lines)")
    return 0


# -- the mesh diagram ------------------------------------------------------------------------------

DEVICE_COLOURS = ("#4C9BE8", "#F28E2B")  # device 0, device 1 of each axis
AXIS_ROWS = (  # (axis, what it splits, what it communicates)
    ("data", "the batch (rows of sequences)\nZeRO-1/3 also split optimizer state / parameters",
     "gradients: all-reduce once per step\n(ZeRO: reduce-scatter + all-gather)"),
    ("pipeline", "the layers, into stages", "activations forward, gradients backward\n(ppermute between neighbouring stages)"),
    ("context", "the sequence (load-balanced chunks)", "attention's keys and values\n(all-gather, ring or all-to-all)"),
    ("expert", "the MoE experts", "tokens to their experts and back\n(two all-to-alls per MoE layer)"),
    ("tensor", "heads and MLP columns in every layer", "an all-reduce after attention and MLP\n(SP: reduce-scatter + all-gather)"),
)


PICTURE_X, PICTURE_W = 6.3, 3.4  # where the pictures go, and their width (8 cells)
CAPTIONS = {
    "data": "8 sequences of a batch",
    "pipeline": "8 layers: stage 0 | stage 1",
    "context": "one sequence in 2c = 4 chunks: device 0 holds the first and the last",
    "expert": "4 experts",
    "tensor": "q, k, v, gate, up by columns (o and down by rows)",
}


def _cells(ax, y, labels, owners):
    from matplotlib.patches import Rectangle

    width = PICTURE_W / len(labels)
    for i, (label, owner) in enumerate(zip(labels, owners)):
        x = PICTURE_X + i * width
        ax.add_patch(Rectangle((x, y), width * 0.92, 0.5, facecolor=DEVICE_COLOURS[owner], edgecolor="none"))
        ax.text(x + width * 0.46, y + 0.25, label, ha="center", va="center", fontsize=9, color="white")


def _illustrate(ax, axis: str, y: float) -> None:
    """A small picture of what `axis` splits over two devices (blue: device 0, orange: device 1)."""
    half = [0] * 4 + [1] * 4
    pictures = {
        "data": ([f"s{i}" for i in range(8)], half),
        "pipeline": ([f"L{i}" for i in range(8)], half),
        "context": ([f"t{i}" for i in range(8)], [0, 0, 1, 1, 1, 1, 0, 0]),  # chunks r and 2c-1-r on rank r
        "expert": ([f"E{i}" for i in range(4)], [0, 0, 1, 1]),
        "tensor": (["W[:, :n/2]", "W[:, n/2:]"], [0, 1]),
    }
    labels, owners = pictures[axis]
    _cells(ax, y, labels, owners)
    ax.text(PICTURE_X, y - 0.18, CAPTIONS[axis], fontsize=8.5, color="0.35", va="center")


def draw_mesh(path: str, only: str | None = None) -> None:
    """The five axes, one row each (or, with `only`, that axis's row alone, for its own page)."""
    from jaxpar.analysis.reports.plots import pyplot
    from jaxpar.axes import MESH_AXES

    plt = pyplot()
    order = {name: i for i, name in enumerate(MESH_AXES)}
    rows = sorted((row for row in AXIS_ROWS if only in (None, row[0])), key=lambda row: order[row[0]])
    header = 1.6 if only is None else 0.5
    height = len(rows) * 1.3 + header
    fig, ax = plt.subplots(figsize=(14, height * 0.72))
    fig.subplots_adjust(left=0, right=1, bottom=0, top=1)  # one data unit = 100 px
    ax.set_xlim(0, 14)
    ax.set_ylim(-0.7, height - 0.7)
    ax.axis("off")
    top = height - 1.0
    if only is None:
        ax.text(0.1, top, "mesh = " + " × ".join(MESH_AXES), fontsize=16, fontweight="bold", va="center")
        ax.text(0.1, top - 0.5, "One named device mesh. Each axis splits one thing over its devices; drawn here for 2 "
                "devices per axis (blue: device 0, orange: device 1).\nAxes listed outermost first: tensor varies "
                "fastest, so its groups (a collective in every layer) are neighbours on the fastest links.",
                fontsize=10, va="center", color="0.25")
    heads = top - (1.15 if only is None else 0.05)
    for column, head in ((0.1, "axis"), (1.5, "what it splits"), (PICTURE_X, "over two devices (blue, orange)"),
                         (10.1, "what it communicates")):
        ax.text(column, heads, head, fontsize=10.5, color="0.45", va="center")
    for k, (axis, splits, talks) in enumerate(rows):
        y = (len(rows) - 1 - k) * 1.3
        ax.add_patch(plt.Rectangle((0, y - 0.45), 14, 1.2, facecolor="0.95" if k % 2 else "white", edgecolor="none"))
        ax.text(0.1, y + 0.2, axis, fontsize=15, fontweight="bold", va="center", family="monospace")
        ax.text(1.5, y + 0.2, splits, fontsize=11, va="center")
        _illustrate(ax, axis, y)
        ax.text(10.1, y + 0.2, talks, fontsize=10.5, va="center")
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


# -- every picture ---------------------------------------------------------------------------------


def schedule_figures(directory: str) -> list[str]:
    """One PNG per schedule record, drawn from its own table at p = P, m = M."""
    from jaxpar.analysis.reports.plots import plot_schedule
    from jaxpar.parallel.pipeline.schedules import SCHEDULES, bubble_fraction

    os.makedirs(directory, exist_ok=True)
    written = []
    for kind in SCHEDULES:
        v = kind.default_virtual_stages
        table = kind.table(P, M, v)
        title = (f"{kind.name}: p = {P}, m = {M}, v = {v}: {table.num_steps} steps; bubble {bubble_fraction(table):.3f} "
                 f"(textbook {kind.bubble(P, M, v):.3f})")
        path = os.path.join(directory, f"{kind.name}.png")
        plot_schedule(table, path, title=title)
        written.append(path)
    return written


def run_figures(args, config) -> int:
    from jaxpar.analysis.reports.plots import RunError, plot_run, read_run, replot_sweep

    try:
        records, title = read_run(args.run) if args.run else (None, "")
    except RunError as e:
        raise UsageError(f"--run={e}") from None
    os.makedirs(FIGURES, exist_ok=True)
    written = [os.path.join(FIGURES, "mesh.png")]
    draw_mesh(written[0])
    for axis, _, _ in AXIS_ROWS:  # each parallelism page's own row
        written.append(os.path.join(FIGURES, f"mesh_{axis}.png"))
        draw_mesh(written[-1], only=axis)
    written += schedule_figures(os.path.join(FIGURES, "schedules"))
    for directory in sorted(glob.glob(os.path.join(DOCS, "sweeps", "*", "sweep.csv"))):
        written += replot_sweep(os.path.dirname(directory))
    if records:
        written.append(os.path.join(FIGURES, "quickstart_loss.png"))
        plot_run(records, written[-1], title=title)
    for path in written:
        print(f"wrote {path}")
    return 0


COMMANDS = (
    Command("config", "write docs/config.md from the schema and the records", run_config, devices=False, flags=(
        Flag("out", str, os.path.join(DOCS, "config.md"), "the file to write"),
    )),
    Command("figures", "redraw every picture the docs ship", run_figures, devices=False, flags=(
        Flag("run", str, "", "a Quickstart run's workdir: also redraw docs/figures/quickstart_loss.png from it"),
    )),
)


def main(argv: list[str] | None = None) -> int:
    return command.main(__doc__, COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
