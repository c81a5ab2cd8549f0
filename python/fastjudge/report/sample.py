"""A bundled-free sample for ``fastjudge report --sample``: two VisExMEM-shaped output rows and
their pictures, drawn with Pillow shapes at run time (nothing binary ships in the package)."""

from __future__ import annotations

import json
from pathlib import Path


def write_sample(folder) -> Path:
    """Write ``sample_visexmem_out.jsonl`` and its images into ``folder``; returns the JSONL."""
    from PIL import Image, ImageDraw

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    img = Image.new("RGB", (400, 300), (135, 190, 235))
    d = ImageDraw.Draw(img)
    d.rectangle((0, 220, 400, 300), fill=(90, 160, 70))
    d.ellipse((40, 120, 160, 240), fill=(220, 40, 40))  # a red ball on the grass
    d.rectangle((250, 60, 370, 230), fill=(150, 100, 50))  # a brown door
    img.save(folder / "ball_door.png")
    img2 = Image.new("RGB", (320, 320), (250, 250, 240))
    ImageDraw.Draw(img2).polygon([(160, 30), (290, 280), (30, 280)], fill=(240, 200, 30))
    img2.save(folder / "triangle.png")
    rows = [
        {"id": "ball", "image": "ball_door.png", "text": "A red ball lies on the grass next to a blue door.",
         "score": 0.5, "warnings": [], "error": None,
         "explanation": "The ball is red and on grass; the door is brown, not blue.",
         "claims": [
             {"part_id": "P1", "text": "a red ball", "type": "object", "decision": "yes", "support": 0.94,
              "evidence_ids": ["E1"], "evidence_boxes": [[40, 120, 160, 240]], "explanation": "red disc at left"},
             {"part_id": "P2", "text": "ball on the grass", "type": "relation", "decision": "yes",
              "support": 0.81, "head_part_id": "P1", "target_part_id": "P3",
              "evidence_ids": ["E1", "E3"], "evidence_boxes": [[40, 120, 160, 240], [0, 220, 400, 300]],
              "explanation": "the ball touches the green strip"},
             {"part_id": "P4", "text": "a blue door", "type": "attribute", "decision": "no", "support": 0.08,
              "parent_part_id": "P1", "evidence_ids": ["E2"], "evidence_boxes": [[250, 60, 370, 230]],
              "explanation": "the door is brown"}]},
        {"id": "tri", "image": "triangle.png", "text": "A yellow triangle <b>on white</b>.", "score": 1.0,
         "warnings": ["box [0, 0, 999, 999] clipped to the image"], "error": None,
         "claims": [{"part_id": "P1", "text": "a yellow triangle", "type": "object", "decision": "yes",
                     "support": 0.97, "evidence_ids": ["E1"], "evidence_boxes": [[30, 30, 290, 280]],
                     "explanation": "a large yellow triangle"}]},
        {"id": "broken", "image": "missing.png", "text": "an unreadable picture", "score": None,
         "claims": [], "warnings": [], "error": "image 'missing.png': file not found"},
    ]
    out = folder / "sample_visexmem_out.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out
