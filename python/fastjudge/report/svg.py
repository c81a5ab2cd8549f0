"""Inline SVG charts for the report (histogram, scatter); every label is escaped."""

from __future__ import annotations

from html import escape


def _tick(value: float) -> str:
    return f"{round(value, 3):g}"


def histogram(bars: list[tuple[str, int]], title: str, x_label: str, y_label: str = "rows",
              edges: list[float] | None = None, width: int = 440, height: int = 220) -> str:
    """A bar chart with labelled axes: ``bars`` is ``[(bin label, count)]`` in order. With
    ``edges`` (one more than the bars: numeric bins) the x ticks mark the bin edges, else each
    bar carries its label (categories). Each bar's tooltip names its bin and count."""
    if not bars:
        return f"<p>{escape(title)}: no data</p>"
    left, right, top, bottom = 46, 12, 28, 44
    plot_w, plot_h = width - left - right, height - top - bottom
    most = max(count for _, count in bars) or 1
    bar_w = plot_w / len(bars)
    base = top + plot_h
    parts = [f'<svg class="chart" width="{width}" height="{height}" role="img" '
             f'aria-label="{escape(title)}"><title>{escape(title)}</title>'
             f'<text x="{left}" y="16" font-size="13" font-weight="bold">{escape(title)}</text>']
    for value in sorted({0, (most + 1) // 2, most}):  # y ticks: 0, the middle, the top
        y = base - plot_h * value / most
        parts.append(f'<line x1="{left - 4}" y1="{y:.1f}" x2="{left + plot_w}" y2="{y:.1f}" '
                     f'stroke="#e4e4e4"/><text x="{left - 6}" y="{y + 4:.1f}" font-size="11" '
                     f'text-anchor="end">{value}</text>')
    for i, (label, count) in enumerate(bars):
        h = plot_h * count / most
        x = left + i * bar_w
        parts.append(f'<rect x="{x + 1:.1f}" y="{base - h:.1f}" width="{max(bar_w - 2, 1):.1f}" '
                     f'height="{h:.1f}" fill="#4a7bd0"><title>{escape(x_label)} {escape(label)}: '
                     f'{count} {escape(y_label)}</title></rect>')
        if count:
            parts.append(f'<text x="{x + bar_w / 2:.1f}" y="{base - h - 3:.1f}" font-size="10" '
                         f'text-anchor="middle">{count}</text>')
        if edges is None:
            parts.append(f'<text x="{x + bar_w / 2:.1f}" y="{base + 15}" font-size="11" '
                         f'text-anchor="middle">{escape(label)}</text>')
    if edges is not None:
        for i, edge in enumerate(edges):
            x = left + i * bar_w
            parts.append(f'<line x1="{x:.1f}" y1="{base}" x2="{x:.1f}" y2="{base + 4}" '
                         f'stroke="#555"/><text x="{x:.1f}" y="{base + 15}" font-size="11" '
                         f'text-anchor="middle">{_tick(edge)}</text>')
    parts.append(f'<line x1="{left}" y1="{base}" x2="{left + plot_w}" y2="{base}" stroke="#555"/>'
                 f'<line x1="{left}" y1="{top}" x2="{left}" y2="{base}" stroke="#555"/>'
                 f'<text x="{left + plot_w / 2:.1f}" y="{height - 6}" font-size="12" '
                 f'text-anchor="middle">{escape(x_label)}</text>'
                 f'<text x="12" y="{top + plot_h / 2:.1f}" font-size="12" text-anchor="middle" '
                 f'transform="rotate(-90 12 {top + plot_h / 2:.1f})">{escape(y_label)}</text></svg>')
    return "".join(parts)


def score_bins(scores: list[float], n: int = 10) -> tuple[list[tuple[str, int]], list[float]]:
    """``n`` equal bins over [0, 1] (or over the scores' range when some lie outside it), empty
    bins included so the axis reads evenly: ``([(label, count)], edges)``. Each bin holds its
    lower edge; the last holds its upper edge too."""
    lo, hi = (0.0, 1.0) if all(0 <= s <= 1 for s in scores) else (min(scores), max(scores))
    step = (hi - lo) / n or 1.0
    counts = [0] * n
    for s in scores:
        counts[min(int((s - lo) / step), n - 1)] += 1
    edges = [lo + k * step for k in range(n + 1)]
    labels = [f"[{_tick(edges[k])}, {_tick(edges[k + 1])}" + ("]" if k == n - 1 else ")")
              for k in range(n)]
    return list(zip(labels, counts)), edges


def scatter(points: list[tuple[float, float]], x_label: str, y_label: str,
            size: int = 300) -> str:
    """Dots for ``(x, y)`` pairs, both axes scaled to the data's range."""
    if not points:
        return ""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    sx = (size - 40) / ((x1 - x0) or 1)
    sy = (size - 40) / ((y1 - y0) or 1)
    parts = [f'<svg class="chart" width="{size}" height="{size}" role="img">'
             f'<line x1="30" y1="{size - 30}" x2="{size - 5}" y2="{size - 30}" stroke="#888"/>'
             f'<line x1="30" y1="5" x2="30" y2="{size - 30}" stroke="#888"/>'
             f'<text x="{size / 2}" y="{size - 8}" font-size="11" text-anchor="middle">'
             f'{escape(x_label)}</text><text x="10" y="{size / 2}" font-size="11" '
             f'transform="rotate(-90 10 {size / 2})" text-anchor="middle">{escape(y_label)}</text>']
    for x, y in points:
        cx = 30 + (x - x0) * sx
        cy = size - 30 - (y - y0) * sy
        parts.append(f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="3" fill="#d0604a" '
                     f'fill-opacity="0.6"/>')
    parts.append("</svg>")
    return "".join(parts)
