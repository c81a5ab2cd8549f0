"""The items ``fastjudge bench`` judges: the bundled sample cycled to N, or synthetic items made
from a seed. Image judges get pictures drawn with Pillow here, encoded as PNG bytes, so the
judge decodes each image as it would one read from a file.

Every item is distinct where it matters for speed: each image is drawn from its own seed, so no
image embedding or image prefix state is reused across items (a benchmark that judged one image
N times would measure the caches), nor across the runs of one command (each run draws its own
round of pictures for the same captions). LAVE items repeat when the bundled sample is cycled;
their shared prefix (instructions and demonstrations) is the same for every item in real jobs
too, and nothing else of an item is cached.
"""

from __future__ import annotations

import io
import random

SOURCES = ("bundled", "synthetic")

COLORS = {"red": (200, 40, 40), "green": (40, 160, 60), "blue": (40, 70, 200),
          "yellow": (230, 200, 40), "white": (240, 240, 240), "black": (20, 20, 20),
          "orange": (240, 140, 30), "purple": (130, 50, 160)}
SHAPES = ("square", "circle", "triangle", "bar")
RELATIONS = ("to the left of", "above", "next to", "below")
OBJECTS = ("dog", "cat", "bus", "kite", "umbrella", "bicycle", "horse", "clock", "bench", "cup")


def _bundled_rows() -> list[dict]:
    from ..demo import sample_rows

    return sample_rows()


def lave_items(n: int, source: str = "bundled", seed: int = 0, start: int = 0) -> list:
    """``n`` LAVE examples, item ``start`` onwards (warm-up items come from past the measured
    ones). Bundled: the sample VQA rows cycled, ids made unique per cycle."""
    from ..judges.lave import VQAExample

    if source == "bundled":
        rows = _bundled_rows()
        out = []
        for i in range(start, start + n):
            row = rows[i % len(rows)]
            out.append(VQAExample(row["question"], row["references"], row["prediction"],
                                  row.get("caption"), f"{row['id']}#{i // len(rows)}"))
        return out
    return [_synthetic_vqa(random.Random(f"{seed}:{i}"), i) for i in range(start, start + n)]


def _synthetic_vqa(rng: random.Random, index: int):
    """A VQA item with ten noisy references (the outlier filter has work to do) and a
    prediction that is one of them, a wording variant, or wrong."""
    from ..judges.lave import VQAExample

    obj = rng.choice(OBJECTS)
    kind = rng.randrange(3)
    if kind == 0:
        question, answers = f"What color is the {obj}?", list(COLORS)
    elif kind == 1:
        question, answers = f"How many {obj}s are in the picture?", ["1", "2", "3", "4", "two"]
    else:
        question, answers = f"Is the {obj} {rng.choice(list(COLORS))}?", ["yes", "no"]
    main = rng.choice(answers)
    refs = [main if rng.random() < 0.7 else rng.choice(answers) for _ in range(10)]
    pick = rng.random()
    prediction = main if pick < 0.5 else (f"it is {main}" if pick < 0.7 else rng.choice(answers))
    return VQAExample(question, refs, prediction, f"A {obj} in a picture.", f"syn-{index}")


def image_text_items(n: int, source: str = "bundled", seed: int = 0, start: int = 0,
                     size: tuple[int, int] = (640, 480), picture_round: int = 0) -> list:
    """``n`` image-text examples, item ``start`` onwards, each with its own drawn picture
    (``size`` = width, height). Bundled: the sample file's captions cycled, over a picture of
    random shapes; synthetic: a caption about two shapes and a picture that shows them.
    ``picture_round``: another round draws other pictures (background, blobs) for the same
    captions and shapes: the same prompts and token counts, none of the same images."""
    from ..judges.visexmem import ImageTextExample

    rows = _bundled_rows() if source == "bundled" else None
    out = []
    for i in range(start, start + n):
        rng = random.Random(f"{seed}:{i}")
        first, second = _shape(rng), _shape(rng)
        relation = rng.choice(RELATIONS)
        picture = random.Random(f"{seed}:{i}:{picture_round}")
        if rows is not None:
            row = rows[i % len(rows)]
            caption, ident = row["caption"], f"{row['id']}#{i // len(rows)}"
        else:
            caption = f"A {first[0]} {first[1]} {relation} a {second[0]} {second[1]}."
            ident = f"syn-{i}"
        out.append(ImageTextExample(_png(draw_scene(picture, first, second, relation, size)),
                                    caption, id=ident))
    return out


def _shape(rng: random.Random) -> tuple[str, str]:
    return rng.choice(list(COLORS)), rng.choice(SHAPES)


def draw_scene(rng: random.Random, first: tuple[str, str], second: tuple[str, str],
               relation: str, size: tuple[int, int]):
    """A PIL picture: a vertical gradient background, a few distractor blobs, and the two
    named shapes placed as ``relation`` says."""
    from PIL import Image, ImageDraw

    w, h = size
    top, bottom = [rng.randrange(60, 200) for _ in range(3)], [rng.randrange(60, 200) for _ in range(3)]
    image = Image.new("RGB", (w, h))
    draw = ImageDraw.Draw(image)
    for y in range(h):  # one line per row: cheap, and gives the encoder something non-flat
        t = y / max(h - 1, 1)
        draw.line([(0, y), (w, y)], fill=tuple(int(a + (b - a) * t) for a, b in zip(top, bottom)))
    for _ in range(rng.randrange(2, 6)):
        x, y, r = rng.randrange(w), rng.randrange(h), rng.randrange(max(w // 40, 1), max(w // 12, 2))
        draw.ellipse([x - r, y - r, x + r, y + r], fill=tuple(rng.randrange(256) for _ in range(3)))
    s = max(min(w, h) // 5, 2)
    horizontal = relation in ("to the left of", "next to")
    centers = ([(w // 3, h // 2), (2 * w // 3, h // 2)] if horizontal
               else [(w // 2, h // 3), (w // 2, 2 * h // 3)])
    if relation == "below":
        centers.reverse()
    for (color, shape), (cx, cy) in zip((first, second), centers):
        box = [cx - s // 2, cy - s // 2, cx + s // 2, cy + s // 2]
        fill = COLORS[color]
        if shape == "circle":
            draw.ellipse(box, fill=fill)
        elif shape == "triangle":
            draw.polygon([(box[0], box[3]), (box[2], box[3]), (cx, box[1])], fill=fill)
        elif shape == "bar":
            draw.rectangle([box[0], cy - s // 6, box[2], cy + s // 6], fill=fill)
        else:
            draw.rectangle(box, fill=fill)
    return image


def _png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def bench_items(judge: str, n: int, source: str, seed: int, start: int = 0,
                size: tuple[int, int] = (640, 480), picture_round: int = 0) -> list:
    """The examples for ``judge`` (lave, visexmem, holistic); ``picture_round`` as
    :func:`image_text_items` (LAVE items have no per-item cache to avoid)."""
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
    if judge == "lave":
        return lave_items(n, source, seed, start)
    return image_text_items(n, source, seed, start, size, picture_round)
