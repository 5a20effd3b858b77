"""The loss curve (``loss.png``): per-step and smoothed loss, held-out accuracy, resumes, reference."""

from __future__ import annotations

__all__ = ["plot_metrics"]


def plot_metrics(metrics: dict, path: str, title: str) -> None:
    """Draw the loss curve of ``metrics`` (and the held-out accuracy, resumes, reference) to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [s for s, _ in metrics["losses"]]
    losses = [v for _, v in metrics["losses"]]
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    ref = metrics.get("reference_losses")
    if ref:  # a broad band under the sharded run's curve: where they agree, the band is centred on it
        ax.plot(
            [s for s, _ in ref],
            [v for _, v in ref],
            lw=3.5,
            color="tab:orange",
            alpha=0.45,
            label="1-process reference (--check-reference)",
        )
    ax.plot(steps, losses, lw=0.7, color="tab:blue", alpha=0.6, label="training loss (per step)")
    if len(losses) >= 20:
        window = [losses[max(0, i - 19) : i + 1] for i in range(len(losses))]
        ax.plot(
            steps,
            [sum(w) / len(w) for w in window],
            lw=1.8,
            color="tab:blue",
            label="training loss (20-step mean)",
        )
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy on answer digits")
    for r in metrics.get("resumes", []):
        ax.axvline(r["step"], color="tab:red", ls=":", lw=1.2)
        ax.text(
            r["step"],
            0.62,
            f" resumed on\n {r['mesh']}\n ({r['layout']})",
            fontsize=8,
            color="tab:red",
            ha="left",
            va="center",
            transform=ax.get_xaxis_transform(),
        )
    handles, labels = ax.get_legend_handles_labels()
    evals = metrics.get("evals", [])
    if evals:
        ax2 = ax.twinx()
        ax2.plot(
            [e[0] for e in evals],
            [100 * e[1] for e in evals],
            "o-",
            color="tab:green",
            ms=4,
            label="held-out exact match (%)",
        )
        ax2.set_ylim(0, 100)
        ax2.set_ylabel("held-out exact match (%)", color="tab:green")
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    ax.legend(handles, labels, loc="lower left", fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
