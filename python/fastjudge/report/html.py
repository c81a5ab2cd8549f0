"""The report page: rows are read one at a time; the summary counts every row, while only the
first ``limit`` rows are drawn, so the page size is bounded whatever the input size. All
untrusted text goes through :func:`html.escape`; JSON inside ``<script>`` escapes ``<>&``."""

from __future__ import annotations

import base64
import io
import json
import math
from collections import Counter
from html import escape
from pathlib import Path

MAX_LINE_BYTES = 32 << 20  # a longer line (room for an image_b64) is reported, not parsed
THUMB_SIDE = 480  # thumbnails fit in a THUMB_SIDE square


def safe_json(value) -> str:
    """JSON safe to place inside a ``<script>`` element."""
    text = json.dumps(value, ensure_ascii=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def iter_rows(path):
    """``(row, problem)`` per line; a bad line gives ``(None, message)``."""
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            if len(line) > MAX_LINE_BYTES:
                yield None, f"line {n}: longer than {MAX_LINE_BYTES} bytes"
                continue
            try:
                row = json.loads(line)
            except ValueError as bad:
                yield None, f"line {n}: not JSON ({bad})"
                continue
            yield (row, None) if isinstance(row, dict) else (None, f"line {n}: not an object")


def thumbnail(image, root) -> tuple[str, int, int] | str:
    """``(data URI, original width, original height)`` or an error message."""
    from PIL import Image

    from ..io.images import MAX_IMAGE_PIXELS, check_pixel_budget

    try:
        source = io.BytesIO(image) if isinstance(image, bytes) else Path(root or ".") / str(image)
        with Image.open(source) as img:
            width, height = img.size
            check_pixel_budget(width, height, MAX_IMAGE_PIXELS)  # before decoding
            img = img.convert("RGB")
            img.thumbnail((THUMB_SIDE, THUMB_SIDE))
            buf = io.BytesIO()
            img.save(buf, format="JPEG", quality=80)
    except Exception as bad:  # one bad image costs one message, not the report
        name = "image_b64" if isinstance(image, bytes) else repr(str(image)[:200])
        return f"image {name}: {bad}"
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode(), width, height


def _num(v):
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _support_bar(v) -> str:
    v = _num(v)
    if v is None:
        return ""
    pct = max(0.0, min(1.0, v)) * 100
    return f'<span class="bar"><span style="width:{pct:.0f}%"></span></span> {v:.2f}'


def visex_row(row: dict, n: int, root) -> str:
    """An image with its evidence boxes and the claims table."""
    claims = [c for c in row.get("claims") or [] if isinstance(c, dict)]
    boxes: dict[str, list] = {}
    for c in claims:
        for eid, box in zip(c.get("evidence_ids") or [], c.get("evidence_boxes") or []):
            if isinstance(box, list) and len(box) == 4 and all(_num(b) is not None for b in box):
                boxes.setdefault(str(eid), box)
    out = [f'<section class="row visex" data-row="{n}" data-error="{int(bool(row.get("error")))}">',
           f'<h3>#{n} {escape(str(row.get("id", "")))} — score '
           f'{escape(str(row.get("score")))}</h3>',
           f'<p class="caption">{escape(str(row.get("text", "")))}</p>']
    image = row.get("image")
    if image is None and isinstance(row.get("image_b64"), str):
        try:
            image = base64.b64decode(row["image_b64"], validate=True)
        except ValueError:
            image = b""  # reported below as an unreadable image
    if image is not None:
        thumb = thumbnail(image, root)
        if isinstance(thumb, str):
            out.append(f'<p class="warn">{escape(thumb)}</p>')
        else:
            uri, w, h = thumb
            out.append(f'<div class="figure" data-w="{w}" data-h="{h}"><img src="{uri}" alt="">')
            for eid, (x0, y0, x1, y1) in boxes.items():
                out.append(f'<div class="box" data-eid="{escape(eid)}" data-box="{x0},{y0},{x1},{y1}" '
                           f'style="left:{100 * x0 / w:.3f}%;top:{100 * y0 / h:.3f}%;'
                           f'width:{100 * (x1 - x0) / w:.3f}%;height:{100 * (y1 - y0) / h:.3f}%">'
                           f'<span>{escape(eid)}</span></div>')
            out.append("</div>")
    out.append('<table class="claims"><tr><th>claim</th><th>type</th><th>decision</th>'
               '<th>support</th><th>evidence</th><th>links</th><th>explanation</th></tr>')
    for c in claims:
        ids = " ".join(str(e) for e in c.get("evidence_ids") or [])
        links = " ".join(f"{k.split('_')[0]}={c[k]}" for k in
                         ("parent_part_id", "head_part_id", "target_part_id") if c.get(k))
        out.append(f'<tr class="claim" data-eids="{escape(ids)}"><td>'
                   f'{escape(str(c.get("part_id", "")))} {escape(str(c.get("text", "")))}</td>'
                   f'<td>{escape(str(c.get("type") or ""))}</td>'
                   f'<td>{escape(str(c.get("decision") or ""))}</td>'
                   f'<td>{_support_bar(c.get("support"))}</td><td>{escape(ids)}</td>'
                   f'<td>{escape(links)}</td><td>{escape(str(c.get("explanation") or ""))}</td></tr>')
    out.append("</table>")
    if row.get("explanation"):
        out.append(f'<p>{escape(str(row["explanation"]))}</p>')
    for w in row.get("warnings") or []:
        out.append(f'<p class="warn">warning: {escape(str(w))}</p>')
    if row.get("error"):
        out.append(f'<p class="err">error: {escape(str(row["error"]))}</p>')
    out.append("</section>")
    return "".join(out)


def lave_row(row: dict, n: int, other) -> str:
    """Question, references with counts, candidate, rating, probabilities and rationale."""
    refs = Counter(str(r) for r in row.get("references") or [])
    probs = row.get("probs") or {}
    gap = None
    if other is not None and _num(row.get("score")) is not None:
        gap = abs(row["score"] - other)
    out = [f'<section class="row lave" data-row="{n}" data-error="{int(bool(row.get("error")))}" '
           f'data-rating="{escape(str(row.get("rating")))}" data-gap="{"" if gap is None else f"{gap:.3f}"}">',
           f'<h3>#{n} {escape(str(row.get("id", "")))} — rating {escape(str(row.get("rating")))}'
           f', score {escape(str(row.get("score")))}'
           + (f", other {other:.2f}" if other is not None else "") + "</h3>",
           f'<p>Q: <span class="caption">{escape(str(row.get("question", "")))}</span></p>',
           "<p>references: " + ", ".join(f"{escape(r)} ×{k}" for r, k in refs.most_common()) + "</p>",
           f'<p>candidate: <b>{escape(str(row.get("prediction", "")))}</b></p>']
    if isinstance(probs, list):  # `fastjudge lave` writes P(rating 1), P(2), P(3)
        probs = {str(k): v for k, v in enumerate(probs, start=1)}
    if isinstance(probs, dict) and probs:
        out.append('<p class="probs">P(rating) ' + " ".join(f"{escape(str(k))}: {_support_bar(v)}"
                                                           for k, v in probs.items()) + "</p>")
    if row.get("rationale"):
        out.append(f'<p class="rationale">{escape(str(row["rationale"]))}</p>')
    if row.get("error"):
        out.append(f'<p class="err">error: {escape(str(row["error"]))}</p>')
    out.append("</section>")
    return "".join(out)
