"""VisExMEM's prompts: this project's own wording (a trained VisExMEM model's prompts are not
public); the output formats follow the paper. Prompts are sequences of text and image slots
(``runtime.requests.Image``), which the checkpoint's codec expands to image tokens.

Every prompt is a shared prefix (the intro, the whole image and the caption; in the
``"shared"`` evidence layout also every candidate region with its crop) and a task. The
holistic-score control has an intro of its own that says nothing of claims or regions."""

from __future__ import annotations

from typing import Sequence

from ...runtime.requests import Image
from .schemas import PART_TYPES, SCORE_MAX

DECISION_PREFIX = '{"decision": "'

INTRO = ("You are an image-text evaluator. You check a caption against the image one atomic "
         "claim at a time, point to the regions of the image that hold the visual evidence, and "
         "decide whether the image supports each claim.")
DECOMPOSE_TASK = (
    "Task: split the caption into atomic parts, each a short claim that can be checked on its "
    "own. Give every part an id (P1, P2, ...), its text, a type (" + ", ".join(PART_TYPES) + "), "
    "and links to other parts by id: parent_part_id (the part it refines), head_part_id (the "
    "object it is about) and target_part_id (the other object of a relation); use null where a "
    'link does not apply. Answer in JSON: {"parts": [...]}')
PROPOSE_TASK = ("Task: give bounding boxes of the image regions that the caption mentions, with "
                'coordinates from 0 to 1000. Answer in JSON: {"boxes": [{"bbox_2d": [x0, y0, x1, y1]}]}')
SELECT_TASK = ("Task: select the candidate regions that hold the visual evidence for this claim. "
               'Answer in JSON: {"selected_evidence_ids": [...]}')
VERIFY_TASK = ("Task: does the image support the claim? Look at the evidence regions. "
               'Answer in JSON: {"decision": "yes"} or {"decision": "no"}')
EXPLAIN_CLAIM_TASK = ("Task: in one short sentence, explain this decision from the evidence. "
                      'Answer in JSON: {"explanation": "..."}')
EXPLAIN_OVERALL_TASK = ("Task: in two short sentences, explain the overall score from these "
                        'decisions. Answer in JSON: {"explanation": "..."}')

Prompt = tuple  # of str and Image, in order


HOLISTIC_INTRO = ("You are an image-text evaluator. You look at the image as a whole and judge how "
                  "well the caption describes it.")
HOLISTIC_SCORE_TASK = (f"Task: rate the agreement of the image and the caption as a whole, from 0 (they "
                       f"do not match at all) to {SCORE_MAX} (the caption is entirely right). "
                       'Answer in JSON: {"score": N}')
#: The forced start of the holistic-score answer; the number is read right after it.
SCORE_PREFIX = '{"score": '
SCORE_SUFFIX = "}"


def base_prefix(image: Image, caption: str, intro: str = INTRO) -> Prompt:
    """Intro, the whole image and the caption: shared by every stage of an example."""
    return (f"{intro}\n\n", image, f"\nCaption: {caption}\n\n")


def candidates_head(width: int, height: int) -> str:
    return f"Candidate regions (pixel boxes x0, y0, x1, y1 in a {width}x{height} image):"


def box_listing(boxes: Sequence[Sequence[int]]) -> str:
    """The candidate regions by id, without their crops."""
    return "\n".join(f"E{i}: {list(b)}" for i, b in enumerate(boxes, start=1))


def evidence_prefix(base: Prompt, width: int, height: int, boxes: Sequence[Sequence[int]],
                    crops: Sequence[Image]) -> Prompt:
    """``base`` + the candidate regions, each with its crop: the shared prefix of the evidence
    stages in the ``"shared"`` layout."""
    regions: list = []
    for i, (box, crop) in enumerate(zip(boxes, crops), start=1):
        sep = "" if i == 1 else "\n"
        regions += [f"{sep}E{i}: {list(box)} ", crop]
    return base + (candidates_head(width, height) + "\n", *regions, "\n\n")


def verification_task(claim: str, evidence_ids: Sequence[str], boxes: Sequence[Sequence[int]] = (),
                      crops: Sequence[Image] | None = None) -> Prompt:
    """A claim's verification task. With ``crops`` (per-claim layout) each selected region comes
    with its crop; without (shared layout, the crops are in the prefix) only the ids."""
    if crops is None:
        return (f"Claim: {claim}\nEvidence regions: {', '.join(evidence_ids) or 'none selected'}\n{VERIFY_TASK}",)
    if not evidence_ids:
        return (f"Claim: {claim}\nEvidence regions: none selected\n{VERIFY_TASK}",)
    regions: list = []
    for i, (e, box, crop) in enumerate(zip(evidence_ids, boxes, crops)):
        sep = "" if i == 0 else "\n"
        regions += [f"{sep}{e} {box}: ", crop]
    return (f"Claim: {claim}\nEvidence regions:\n", *regions, f"\n{VERIFY_TASK}")


def single_response_task(width: int, height: int, boxes: Sequence[Sequence[int]], explain: bool,
                         claims: Sequence[str] | None = None) -> str:
    """The task of the "Dec." control: every step in one answer. ``claims``: the example's own
    claims, listed as C1, C2, ... (the answer then rates those instead of decomposing)."""
    why = " and a short explanation of that rating" if explain else ""
    if claims is None:
        what = ("split the caption into atomic parts, each a short claim that can be checked on its "
                "own, with an id (P1, P2, ...), its text, a type (" + ", ".join(PART_TYPES) + ") and "
                "links to other parts by id (parent_part_id, head_part_id, target_part_id; null where "
                "a link does not apply). For every part give")
        listing, shape = "", '{"claims": [{"part_id": ..., "text": ..., ...}, ...]'
    else:
        what = "for every claim below give"
        listing = "Claims:\n" + "\n".join(f"C{k}: {c}" for k, c in enumerate(claims, start=1)) + "\n"
        shape = '{"claims": {"C1": {...}, ...}'
    overall = ', "explanation": "...", "score": N}' if explain else ', "score": N}'
    return (f"{candidates_head(width, height)}\n{box_listing(boxes)}\n{listing}"
            f"Task: evaluate the caption in a single answer. First {what} the ids of the candidate "
            f"regions that hold its visual evidence (selected_evidence_ids), how well the image "
            f"supports it from 0 (not at all) to {SCORE_MAX} (fully) as support{why}. "
            + ("Then explain the overall result in two short sentences. " if explain else "")
            + f"Last, give the overall alignment of image and caption from 0 to {SCORE_MAX} as score. "
            f"Answer in JSON: {shape}{overall}")
