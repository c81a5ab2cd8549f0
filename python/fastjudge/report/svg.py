"""Inline SVG charts for the report (histogram, scatter); every label is escaped."""

from __future__ import annotations

from html import escape


def histogram(counts: dict, title: str, width: int = 360, height: int = 160) -> str:
    """Bars for ``{label: count}`` in the given order."""
    if not counts:
        return f"<p>{escape(title)}: no data</p>"
    labels = list(counts)
    top = max(counts.values()) or 1
    bar_w = (width - 20) / len(labels)
    parts = [f'<svg class="chart" width="{width}" height="{height + 30}" role="img">'
             f'<title>{escape(title)}</title>']
    for i, label in enumerate(labels):
        h = (height - 20) * counts[label] / top
        x = 10 + i * bar_w
        parts.append(f'<rect x="{x:.1f}" y="{height - h:.1f}" width="{max(bar_w - 2, 1):.1f}" '
                     f'height="{h:.1f}" fill="#4a7bd0"><title>{escape(str(label))}: '
                     f'{counts[label]}</title></rect>')
        parts.append(f'<text x="{x + bar_w / 2:.1f}" y="{height + 14}" font-size="10" '
                     f'text-anchor="middle">{escape(str(label))}</text>')
        parts.append(f'<text x="{x + bar_w / 2:.1f}" y="{height - h - 3:.1f}" font-size="9" '
                     f'text-anchor="middle">{counts[label]}</text>')
    parts.append("</svg>")
    return "".join(parts)


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
