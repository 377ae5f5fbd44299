"""PNG figures for docs/results.md (matplotlib, headless); every figure is titled and labelled to stand alone."""

from __future__ import annotations

from pathlib import Path


def _plt():
    try:
        import matplotlib
    except ImportError:
        from quads_megatron.errors import ConfigError

        raise ConfigError("the paper tools draw with matplotlib: pip install 'quads-megatron[study]' "
                          "(or pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    _plt().close(fig)
    return path


def figure(ncols: int = 1, width: float = 5.5, height: float = 4.0, title: str | None = None):
    plt = _plt()
    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
    if title:
        fig.suptitle(title, fontsize=11)
    return fig, list(axes[0])


def grouped_bars(ax, groups: list[str], series: dict[str, list[float]], ylabel: str, log: bool = False):
    """Bars of several series (legend) over the same groups (x axis)."""
    n = len(series)
    w = 0.8 / max(1, n)
    for j, (name, vals) in enumerate(series.items()):
        xs = [i + (j - (n - 1) / 2) * w for i in range(len(groups))]
        ax.bar(xs, vals, width=w, label=name)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
