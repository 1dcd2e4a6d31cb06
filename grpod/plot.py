"""`grpod plot RUN_DIR`: one PNG of a run's curves, so a user can look instead of read.

Reads `<run>/metrics.jsonl` (step, eval and sync records) and draws reward, held-out accuracy
(pass@1, and mean@k when a dataset evaluation measured it), loss,
KL, entropy, importance ratio, clipped fraction, the trainer/vLLM mismatch (mismatch KL and the
share of IS weights truncated or masked), staleness, sync latency and the resident memory of the
daemon, its engines and its other children against the step. A panel
whose metric the run never recorded says so instead of disappearing.
"""

from __future__ import annotations

from pathlib import Path

from grpod.service.logs import MetricsFileError, read_metrics

PANELS = (
    # "reward/*": each reward function of a dataset source (reward/<name>), when the run has them.
    ("reward", "step", ("reward_mean", "reward/*")),
    ("held-out accuracy", "eval", ("eval_accuracy", "eval_mean_at_k")),
    ("loss", "step", ("loss",)),
    ("KL", "step", ("kl",)),
    ("entropy (nats/token)", "step", ("entropy",)),
    ("importance ratio", "step", ("ratio_mean", "ratio_min", "ratio_max")),
    ("clipped fraction", "step", ("clipped_low_fraction", "clipped_high_fraction")),
    ("trainer/vLLM mismatch", "step", ("mismatch_kl", "tis_capped_fraction", "tis_masked_fraction")),
    ("staleness (versions)", "step", ("staleness_mean", "staleness_max")),
    ("sync latency (s)", "sync", ("total_s",)),
    ("resident memory (MiB)", "memory", ("daemon_rss_mib", "children_rss_mib", "engine_rss_mib/*", "engine_gpu_mib/*")),
)


class PlotError(Exception):
    pass


def run_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise PlotError(f"{path}: no metrics; is {run_dir} a grpod run directory?")
    try:
        return read_metrics(path)
    except MetricsFileError as exc:
        raise PlotError(str(exc)) from None


def panel_series(records: list[dict], kind: str, keys: tuple[str, ...]) -> dict[str, list[tuple[int, float]]]:
    """The (step, value) points of each of a panel's keys that `records` hold; a key ending in
    "*" stands for every recorded key with that prefix."""
    names: list[str] = []
    for key in keys:
        if key.endswith("*"):
            prefix = key[:-1]
            names += sorted({k for r in records if r.get("kind") == kind for k in r if k.startswith(prefix)})
        else:
            names.append(key)
    series = {}
    for name in names:
        points = [(r["step"], r[name]) for r in records if r.get("kind") == kind and r.get(name) is not None]
        if points:
            series[name] = points
    return series


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = run_metrics(run_dir)
    out = Path(out) if out else Path(run_dir) / "metrics.png"
    rows = (len(PANELS) + 1) // 2
    fig, axes = plt.subplots(rows, 2, figsize=(12, 3.2 * rows))
    for ax in axes.flat[len(PANELS):]:
        ax.set_visible(False)
    for ax, (title, kind, keys) in zip(axes.flat, PANELS):
        lines = panel_series(records, kind, keys)
        for key, points in lines.items():
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=key)
        drawn = bool(lines)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "not recorded in this run", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(f"grpod run {Path(run_dir).resolve().name}")
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out
