"""What ``fastjudge meta-eval`` shows of a :func:`.meta_eval.meta_evaluate` result: one markdown
table per statistic (metrics x groups, ``value [CI]``, the significantly best metric of a column
in bold) and, with ``--plot``, a grouped bar chart (matplotlib, optional).
"""

from __future__ import annotations

import numpy as np

__all__ = ["format_markdown", "plot_meta_eval", "PlotUnavailable", "require_matplotlib"]

_STAT_TITLE = {"spearman": "Spearman's ρ", "kendall": "Kendall's τ-b"}


def format_markdown(result: dict) -> str:
    """One markdown table per statistic: metrics x groups, ``value [CI]``; bold = best of the
    column and significantly better than the second best."""
    lines = []
    groups = result["groups"]
    boot = result["bootstrap"]
    for stat in result["stats"]:
        ci_note = (f" ({int(boot['confidence'] * 100)}% bootstrap CI)" if boot["n"] else "")
        lines.append(f"### {_STAT_TITLE[stat]} with human judgments{ci_note}")
        lines.append("")
        header = ["metric"] + [f"{g['label']} (n={g['n']})" for g in groups]
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|" + "|".join(["---"] + ["---:"] * len(groups)) + "|")
        for name in result["metrics"]:
            cells = [name]
            for g in groups:
                e = g["metrics"][name]
                v = e[stat]
                text = "n/a" if v is None else f"{v:.3f}"
                best = g["best"][stat]
                if v is not None and best["metric"] == name and best["significant"]:
                    text = f"**{text}**"
                ci = e.get(f"{stat}_ci")
                if ci and ci[0] is not None:
                    text += f" [{ci[0]:.3f}, {ci[1]:.3f}]"
                cells.append(text)
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    if boot["n"] and len(result["metrics"]) > 1:
        lines.append(f"Bold: best in its column and significantly better than the second best "
                     f"({boot['n']} bootstrap resamples, {boot['test']}, p < {boot['alpha']}).")
    alphas = [(g["label"], g.get("krippendorff_alpha")) for g in groups if "krippendorff_alpha" in g]
    if alphas:
        lines.append("Inter-annotator agreement (Krippendorff's α, nominal): " + ", ".join(
            f"{label} {'n/a' if a is None else f'{a:.3f}'}" for label, a in alphas) + ".")
    return "\n".join(lines).rstrip() + "\n"


class PlotUnavailable(RuntimeError):
    pass


def require_matplotlib():
    """``matplotlib.pyplot`` drawing to files (the Agg backend); :class:`PlotUnavailable` when
    matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailable("--plot needs matplotlib, which is not installed; install it with "
                              "pip install 'fastjudge[plot]' (or pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_meta_eval(result: dict, path, stat: str = "spearman") -> None:
    """Grouped bar chart (groups on x, one bar per metric) of a correlation with its bootstrap
    CI as error bars and ``*`` over a column's significantly best metric, saved as PNG."""
    plt = require_matplotlib()
    groups, names = result["groups"], result["metrics"]
    width = 0.8 / max(len(names), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 + len(groups) * len(names) * 0.45), 4.2))
    x = np.arange(len(groups))
    for j, name in enumerate(names):
        vals = [g["metrics"][name][stat] for g in groups]
        heights = [np.nan if v is None else v for v in vals]
        lo, hi = [], []
        for g, v in zip(groups, vals):
            ci = g["metrics"][name].get(f"{stat}_ci")
            if v is None or not ci or ci[0] is None:
                lo.append(0.0)
                hi.append(0.0)
            else:
                lo.append(max(0.0, v - ci[0]))
                hi.append(max(0.0, ci[1] - v))
        pos = x + (j - (len(names) - 1) / 2) * width
        ax.bar(pos, heights, width, label=name,
               yerr=[lo, hi] if result["bootstrap"]["n"] else None, capsize=3)
        for p, g, v, up in zip(pos, groups, vals, hi):
            best = g["best"][stat]
            if v is not None and best["metric"] == name and best["significant"]:
                ax.annotate("*", (p, v + up), ha="center", va="bottom", fontsize=12)
    labels = ["\n".join("-" if v is None else str(v) for v in g["fields"].values())
              if g["fields"] else g["label"] for g in groups]
    ax.set_xticks(x, [f"{label}\n(n={g['n']})" for label, g in zip(labels, groups)], fontsize=8)
    ax.set_ylabel(_STAT_TITLE[stat])
    ci = (f", {int(result['bootstrap']['confidence'] * 100)}% bootstrap CI"
          if result["bootstrap"]["n"] else "")
    ax.set_title(f"{_STAT_TITLE[stat]} with human judgments{ci}")
    ax.axhline(0.0, color="black", linewidth=0.8)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    lo_y, hi_y = ax.get_ylim()
    ax.set_ylim(lo_y, hi_y + 0.06 * (hi_y - lo_y))  # room for the "*" marks
    if len(names) > 1 and result["bootstrap"]["n"]:
        fig.text(0.01, 0.01, "* significantly better than the second best", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)
