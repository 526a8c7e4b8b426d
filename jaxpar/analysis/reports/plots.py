"""PNG plots of a sweep (`jaxpar.analysis.reports.sweep`): per-device memory by layout, and predicted step
time split into compute / communication / bubble. Needs matplotlib (imported here only)."""

from __future__ import annotations

GIB = 2**30


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def plot_memory(rows, path: str, *, title: str) -> None:
    """Top: the model's per-device terms on the hardware (stacked, linear) against the usable
    HBM. Bottom: compiled and predicted XLA:CPU peaks (log: fp32 activations, [S, S] scores)."""
    plt = _pyplot()
    from jaxpar.analysis.reports.sweep import memory_breakdown

    labels = [r.candidate.describe() for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(6, 0.45 * len(rows) + 2), 8), sharex=True)
    x = list(range(len(rows)))
    bottoms = [0.0] * len(rows)
    names = [name for name, _ in memory_breakdown(next((r for r in rows if r.target), rows[0]))] if rows else []
    for i, name in enumerate(names):
        heights = [dict(memory_breakdown(r)).get(name, 0) / GIB for r in rows]
        top.bar(x, heights, bottom=bottoms, label=name, color=plt.cm.tab10(i))
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    if rows:
        top.axhline(rows[0].usable / GIB, color="gray", linestyle="--", label="usable HBM")
    top.set_ylabel("GiB per device (model, hardware)")
    top.set_title(title, fontsize=10)
    top.legend(fontsize=7, loc="upper left")
    compiled = [(i, r.compiled.memory.live_total / GIB) for i, r in enumerate(rows) if r.compiled]
    predicted = [(i, r.cpu.memory.peak / GIB) for i, r in enumerate(rows) if r.cpu]
    if compiled:
        bottom.scatter(*zip(*compiled), marker="o", color="black", label="compiled (XLA:CPU)")
    if predicted:
        bottom.scatter(*zip(*predicted), marker="x", color="red", label="model (XLA:CPU)")
    bottom.set_yscale("log")
    bottom.set_ylabel("GiB per device (XLA:CPU)")
    bottom.legend(fontsize=7, loc="upper left")
    bottom.set_xticks(x, labels, rotation=60, ha="right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_step_time(rows, path: str, *, title: str) -> None:
    plt = _pyplot()
    priced = [r for r in rows if r.target]
    labels = [r.candidate.describe() for r in priced]
    parts = [
        ("compute", [r.target.time.compute for r in priced]),
        ("communication", [r.target.time.comm for r in priced]),
        ("bubble", [r.target.time.bubble for r in priced]),
    ]
    fig, ax = plt.subplots(figsize=(max(6, 0.55 * len(priced) + 2), 5.5))
    x = range(len(priced))
    bottom = [0.0] * len(priced)
    for i, (name, values) in enumerate(parts):
        ax.bar(x, values, bottom=bottom, label=name, color=plt.cm.Set2(i))
        bottom = [b + v for b, v in zip(bottom, values)]
    for i, r in enumerate(priced):
        if r.target.memory.peak > r.usable:
            ax.text(i, bottom[i], "OOM", ha="center", va="bottom", fontsize=6, color="red")
    ax.set_ylabel("predicted seconds per step")
    ax.set_xticks(list(x), labels, rotation=60, ha="right", fontsize=7)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
