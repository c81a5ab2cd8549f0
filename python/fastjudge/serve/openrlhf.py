"""OpenRLHF's stock remote-reward payload, turned into judge items.

OpenRLHF's agent executor posts ``{"query": [prompt + response], "prompts": [prompt],
"labels": [label]}`` (the text decoded with special tokens kept) and feeds the ``rewards`` it
gets back to ``torch.tensor``. Here each query becomes one judge item, or one item error:

- the prediction is the query after its prompt, with chat special tokens removed and the rest
  stripped; a query that does not start with its prompt is an item error;
- the label is a JSON object string with the judge's fields (``{"question", "references"}``
  for LAVE, ``{"text"|"caption", "image_b64"|"image"}`` for the image judges), or a JSON list /
  plain string of references, with the question taken from the prompt (its last user turn when
  the prompt is chat-formatted).
"""

from __future__ import annotations

import json
import re
from typing import Any

from ..judges.registry import ItemError

#: End-of-turn and padding markers that decoding with special tokens kept leaves in a response.
SPECIAL_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|im_start|>", "<|eot_id|>",
                  "<|end_of_text|>", "<|begin_of_text|>", "</s>", "<s>", "<pad>", "<eos>",
                  "<|end|>", "<|user|>", "<|assistant|>")
_SPECIAL = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))
# a Qwen-style chat turn: <|im_start|>role\n text (up to <|im_end|> or the end)
_TURN = re.compile(r"<\|im_start\|>(\w+)\n(.*?)(?:<\|im_end\|>|$)", re.S)


def is_stock_payload(body: dict) -> bool:
    """OpenRLHF's own payload carries ``prompts`` (and ``labels``) beside ``query``."""
    return "prompts" in body or "labels" in body


def clean(text: str) -> str:
    return _SPECIAL.sub("", text).strip()


def prompt_question(prompt: str) -> str:
    """The question a prompt asks: its last user turn when chat-formatted, else the prompt."""
    users = [content for role, content in _TURN.findall(prompt) if role == "user"]
    return clean(users[-1] if users else prompt)


def _label_fields(label: Any, where: str) -> dict:
    """The judge fields a label gives: a JSON object's own fields, or ``references``."""
    if isinstance(label, str):
        try:
            decoded = json.loads(label)
        except ValueError:
            return {"references": [label]}
    else:
        decoded = label
    if isinstance(decoded, dict):
        return decoded
    if isinstance(decoded, list):
        return {"references": decoded}
    if isinstance(decoded, (str, int, float)) and not isinstance(decoded, bool):
        return {"references": [str(decoded)]}
    raise ItemError(f"{where}: a label is a JSON object, a list of references or a string")


def stock_item(query: Any, prompt: Any, label: Any, where: str, text_judge: bool) -> dict:
    """The judge item (a dict for ``spec.parse_item``) of one stock-payload sample."""
    if not isinstance(query, str) or not isinstance(prompt, str):
        raise ItemError(f"{where}: query and prompt must be strings")
    if not query.startswith(prompt):
        raise ItemError(f"{where}: the query does not start with its prompt")
    response = clean(query[len(prompt):])
    fields = _label_fields(label, where)
    if text_judge:
        return {"question": prompt_question(prompt), **fields, "prediction": response}
    # image judges: the response is the text to check against the label's image
    return {**fields, "text": response}


def stock_items(body: dict) -> list[tuple[Any, Any, Any]]:
    """``(query, prompt, label)`` per sample; the lists must be as long as ``query``."""
    queries, prompts = body.get("query"), body.get("prompts")
    labels = body.get("labels", [None] * len(queries) if isinstance(queries, list) else None)
    if not all(isinstance(x, list) for x in (queries, prompts, labels)) or not (
            len(queries) == len(prompts) == len(labels)):
        raise ValueError('"query", "prompts" and "labels" must be lists of one length')
    return list(zip(queries, prompts, labels))
