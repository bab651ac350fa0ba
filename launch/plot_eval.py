"""Tables and PNG plots of evaluation sweeps: success vs horizon cap, and Pass@k vs k.

`longhorizon eval --sweep ...` calls these; each takes the sweep's JSON document (see
`launch/recipes/eval.py`) and writes one file.
"""

from __future__ import annotations

from pathlib import Path


def horizon_table(sweep: dict) -> str:
    """Markdown table: one row per horizon cap, with success, its interval, Avg@n and turns."""
    samples = sweep["samples_per_task"]
    categories = sorted({c for point in sweep["points"] for c in point["per_category"]})
    header = ["horizon cap", "success", "95% CI", f"avg@{samples}", "mean turns", "failed", *categories]
    rows = []
    for point in sweep["points"]:
        low, high = point["success_rate_ci95"]
        rows.append([
            str(point["horizon_cap"]), f"{point['success_rate']:.1%}", f"{low:.1%}-{high:.1%}",
            f"{point[f'avg@{samples}']:.3f}", f"{point['mean_turns']:.1f}", str(point["failed_episodes"]),
            *[f"{point['per_category'][c]['success_rate']:.1%}" if c in point["per_category"] else "-"
              for c in categories],
        ])
    return _markdown(header, rows)


def pass_at_k_table(sweep: dict) -> str:
    """Markdown table: one row per k, with Pass@k, its bootstrap interval and per-category values."""
    categories = sorted({c for point in sweep["points"] for c in point["per_category"]})
    header = ["k", "pass@k", "95% CI (bootstrap over tasks)", *categories]
    rows = []
    for point in sweep["points"]:
        low, high = point["ci95"]
        rows.append([
            str(point["k"]), f"{point['pass@k']:.1%}", f"{low:.1%}-{high:.1%}",
            *[f"{point['per_category'][c]:.1%}" if c in point["per_category"] else "-" for c in categories],
        ])
    return _markdown(header, rows)


def _markdown(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(header[i]), *(len(row[i]) for row in rows)) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(cell.ljust(width) for cell, width in zip(cells, widths)) + " |"

    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)]) + "\n"


def _figure():
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on servers
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6.4, 4.2), dpi=110)
    return plt, figure, axes


def _title(sweep: dict) -> str:
    return f"{sweep['env']} ({sweep['split']}, {sweep['tasks']} tasks, engine {sweep['engine']})"


def plot_horizon_sweep(sweep: dict, path: str | Path) -> Path:
    """Success rate against the horizon cap, with Wilson intervals, and one thin line per category."""
    plt, figure, axes = _figure()
    points = sweep["points"]
    caps = [p["horizon_cap"] for p in points]
    rates = [p["success_rate"] for p in points]
    lower = [p["success_rate"] - p["success_rate_ci95"][0] for p in points]
    upper = [p["success_rate_ci95"][1] - p["success_rate"] for p in points]
    axes.errorbar(caps, rates, yerr=[lower, upper], marker="o", capsize=3, linewidth=2, label="all tasks")
    categories = sorted({c for p in points for c in p["per_category"]})
    if len(categories) > 1:
        for category in categories:
            values = [(p["horizon_cap"], p["per_category"][category]["success_rate"])
                      for p in points if category in p["per_category"]]
            axes.plot(*zip(*values), marker=".", linewidth=1, alpha=0.6, label=category)
    axes.set_xlabel("horizon cap (most turns per episode)")
    axes.set_ylabel("success rate")
    axes.set_ylim(-0.02, 1.02)
    axes.set_xticks(caps)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    axes.set_title(f"Interaction budget: {_title(sweep)}", fontsize=9)
    return _save(plt, figure, path)


def plot_pass_at_k_sweep(sweep: dict, path: str | Path) -> Path:
    """Pass@k against k (log scale), with the bootstrap interval as a band."""
    plt, figure, axes = _figure()
    points = sweep["points"]
    ks = [p["k"] for p in points]
    axes.plot(ks, [p["pass@k"] for p in points], marker="o", linewidth=2, label="pass@k (unbiased)")
    axes.fill_between(ks, [p["ci95"][0] for p in points], [p["ci95"][1] for p in points], alpha=0.25,
                      label="95% CI (bootstrap over tasks)")
    axes.set_xscale("log", base=2)
    axes.set_xticks(ks)
    axes.set_xticklabels([str(k) for k in ks])
    axes.set_xlabel(f"k (of {sweep['samples_per_task']} samples per task)")
    axes.set_ylabel("pass@k")
    axes.set_ylim(-0.02, 1.02)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    axes.set_title(f"Pass@k, horizon {sweep['horizon_cap']}: {_title(sweep)}", fontsize=9)
    return _save(plt, figure, path)


def _save(plt, figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path
