"""What goes into VisExMEM and comes out of it: the example and its results (plain
dataclasses at the judge's boundary, no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence


@dataclass
class ImageTextExample:
    """One image-text pair. ``image``: a path, encoded bytes, a PIL image or an H x W x 3 uint8
    array; ``boxes``: optional candidate evidence boxes ``(x0, y0, x1, y1)`` in pixels;
    ``claims``: optional claims of the text to check instead of decomposing it, each a string or
    a dict with ``text`` and optionally ``part_id``, ``type`` and the link fields (see
    ``claims.given_parts`` for the bounds)."""

    image: object
    text: str
    boxes: Sequence | None = None
    id: object = None
    claims: Sequence | None = None


@dataclass
class ClaimResult:
    """One claim of a caption and its verification.

    ``part_id``, ``text``, ``type`` and the links to other parts (``parent_part_id``,
    ``head_part_id``, ``target_part_id``) come from the decomposition (or the given claims).
    ``evidence_ids`` / ``evidence_boxes``: the candidate regions selected for it (``E1``...,
    pixel boxes ``[x0, y0, x1, y1]``). ``support``: P(yes) renormalised over {yes, no} at the
    verification step; ``decision``: "yes" when ``support >= 0.5``. ``explanation``: written
    after the decision, when the judge explains."""

    part_id: str
    text: str
    type: str | None  # None: a given claim without a type
    parent_part_id: str | None = None
    head_part_id: str | None = None
    target_part_id: str | None = None
    decision: str | None = None
    support: float | None = None
    evidence_ids: list[str] = field(default_factory=list)
    evidence_boxes: list[list[int]] = field(default_factory=list)
    explanation: str | None = None


@dataclass
class VisExResult:
    """One image-text pair's VisExMEM evaluation.

    ``index``: the example's position in the input; ``id``: its ``id``. ``score``: the
    aggregate (the judge's ``aggregate``, by default the mean) of the claims' support, in
    [0, 1]; ``claims``: the :class:`ClaimResult` of each claim; ``explanation``: the overall
    explanation. ``warnings``: what was repaired or dropped (clipped boxes, fixed part links)
    without failing the item; ``error``: why the item failed (``claims`` then empty, ``score``
    None). ``prompt_tokens``: the longest prompt of the item's stages."""

    index: int
    id: object = None
    score: float | None = None
    claims: list[ClaimResult] = field(default_factory=list)
    explanation: str | None = None
    error: str | None = None
    warnings: list[str] = field(default_factory=list)
    prompt_tokens: int | None = None
