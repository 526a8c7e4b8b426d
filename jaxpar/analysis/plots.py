"""PNG plots of a sweep (`jaxpar.analysis.sweep`): per-device memory by layout, and predicted step
time split into compute / communication / bubble. Needs matplotlib (imported here only)."""

from __future__ import annotations

GIB = 2**30


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def plot_memory(rows, path: str, *, title: str) -> None:
    """Stacked predicted terms on the hardware (bars), compiled and predicted XLA:CPU peaks
    (markers), the usable HBM (line)."""
    plt = _pyplot()
    from jaxpar.analysis.sweep import memory_breakdown

    labels = [r.candidate.describe() for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 0.55 * len(rows) + 2), 5.5))
    x = range(len(rows))
    bottom = [0.0] * len(rows)
    names = [name for name, _ in memory_breakdown(next((r for r in rows if r.target), rows[0]))] if rows else []
    for i, name in enumerate(names):
        heights = [dict(memory_breakdown(r)).get(name, 0) / GIB for r in rows]
        ax.bar(x, heights, bottom=bottom, label=f"hw: {name}", color=plt.cm.tab10(i))
        bottom = [b + h for b, h in zip(bottom, heights)]
    compiled = [(i, r.compiled.memory.live_total / GIB) for i, r in enumerate(rows) if r.compiled]
    predicted = [(i, r.cpu.memory.peak / GIB) for i, r in enumerate(rows) if r.cpu]
    if compiled:
        ax.scatter(*zip(*compiled), marker="o", color="black", zorder=3, label="compiled (XLA:CPU)")
    if predicted:
        ax.scatter(*zip(*predicted), marker="x", color="red", zorder=4, label="predicted (XLA:CPU)")
    if rows:
        ax.axhline(rows[0].usable / GIB, color="gray", linestyle="--", label="usable HBM")
    ax.set_yscale("log")
    ax.set_ylabel("GiB per device")
    ax.set_xticks(list(x), labels, rotation=60, ha="right", fontsize=7)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
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
