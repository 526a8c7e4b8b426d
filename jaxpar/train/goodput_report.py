"""A workdir's goodput ledger as a table and a plot (`scripts/goodput.py`).

`table(attempts)`: one row per start and one for the whole run, the seconds of every kind
(`jaxpar.train.goodput.KINDS`, `restart` between starts) and the share that trained the model.
`plot(attempts, path)`: above, the run's timeline (each start a bar cut into its kinds, in the order
a start goes through them, restarts as gaps); below, the seconds of each kind accumulated over the
run's wall time, from the points each start recorded every so often (`Ledger.snapshots`), with each
start's lost time moved from productive where it ended.
"""

from __future__ import annotations

from jaxpar.train.goodput import KINDS, RESTART, account, totals

# Colours per kind: productive green, the costs of starting warm, faults red, the rest grey.
COLOURS = {"productive": "tab:green", "compile": "tab:orange", "input": "tab:cyan", "checkpoint": "tab:blue",
           "restore": "tab:purple", "eval": "tab:olive", "lost": "tab:red", "other": "lightgrey", RESTART: "dimgrey"}
ORDER = ("compile", "input", "restore", "productive", "eval", "checkpoint", "lost", "other")  # the bar's segments


def _row(name: str, kinds: dict, wall: float, ended: str = "") -> list[str]:
    share = 100 * kinds["productive"] / wall if wall > 0 else 0.0
    return [name, f"{wall:.1f}", f"{share:.1f}%", *(f"{kinds.get(k, 0.0):.1f}" for k in (*KINDS, RESTART)), ended]


def table(attempts: list[dict]) -> str:
    """The breakdown, in seconds, as aligned text."""
    header = ["start", "wall s", "goodput", *KINDS, RESTART, "ended"]
    rows = []
    for i, a in enumerate(attempts):
        kinds = account(a)
        gap = max(0.0, a["started"] - attempts[i - 1]["updated"]) if i else 0.0
        ended = a.get("ended") or "killed (no end recorded)"
        rows.append(_row(f"{i + 1}: steps {a['first_step'] + 1}-{a['last_step']}", {**kinds, RESTART: gap},
                         a["updated"] - a["started"], ended))
    total = totals(attempts)
    rows.append(_row("all", total, total["wall"]))
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(cell.rjust(w) if j else cell.ljust(w) for j, (cell, w) in enumerate(zip(r, widths)))
                     for r in [header, *rows])


def _accumulated(attempts: list[dict]) -> tuple[list[float], dict[str, list[float]]]:
    """(time since the first start, seconds of each kind so far) at every recorded point."""
    first = attempts[0]["started"]
    times, series = [0.0], {k: [0.0] for k in (*KINDS, RESTART)}
    before = dict.fromkeys((*KINDS, RESTART), 0.0)
    for i, a in enumerate(attempts):
        if i:
            before[RESTART] += max(0.0, a["started"] - attempts[i - 1]["updated"])
        points = [(p[0], dict(zip(KINDS, p[1:]))) for p in a.get("snapshots", [])]
        points.append((a["updated"] - a["started"], account(a)))  # the end, lost where it belongs
        for elapsed, kinds in points:
            times.append(a["started"] - first + elapsed)
            for k in series:
                series[k].append(before[k] + kinds.get(k, 0.0))
        for k, v in account(a).items():
            before[k] += v
    return times, series


def plot(attempts: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    first = attempts[0]["started"]
    fig, (bar_ax, area_ax) = plt.subplots(2, 1, figsize=(10, 6.4), sharex=True, gridspec_kw={"height_ratios": [1, 3]})
    for i, a in enumerate(attempts):
        kinds, at = account(a), a["started"] - first
        for kind in ORDER:
            if kinds[kind] > 0:
                bar_ax.broken_barh([(at, kinds[kind])], (0, 1), color=COLOURS[kind])
                at += kinds[kind]
        bar_ax.text(a["started"] - first, 1.1, f"start {i + 1}", fontsize=9)
    bar_ax.set_yticks([])
    bar_ax.set_ylim(0, 1.5)
    bar_ax.set_title(title)
    times, series = _accumulated(attempts)
    kinds = [k for k in (*ORDER, RESTART) if series[k][-1] > 0]
    area_ax.stackplot(times, [series[k] for k in kinds], labels=kinds, colors=[COLOURS[k] for k in kinds], alpha=0.85)
    area_ax.set_xlabel("wall time since the first start (s)")
    area_ax.set_ylabel("seconds, accumulated")
    area_ax.grid(alpha=0.3)
    area_ax.legend(loc="upper left", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
