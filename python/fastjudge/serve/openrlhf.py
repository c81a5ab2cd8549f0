"""OpenRLHF's stock remote-reward payload, turned into judge items.

OpenRLHF's single-turn executor (``openrlhf/utils/agent.py``, from v0.9 to v0.11) posts
``{"query": [query], "prompts": [prompt], "labels": [label]}`` per sample, where ``query`` is
the prompt's and the response's token ids decoded with special tokens kept, and feeds the
``rewards`` it gets back to ``torch.tensor``. Each query becomes one judge item, or one item
error whose message says why (the sample's reward is then the server's ``reward_on_error``).

Where the response starts (:func:`split_response`). The query holds the prompt as the policy
saw it, which is not always the prompt text:

* a vision-language policy's processor expands each image placeholder into one image token per
  merged patch (``<|image_pad|>`` repeated), so runs of those tokens are compared as one;
* a prompt longer than the generation budget leaves only its tail in the query (the executor
  keeps the last ``max_len - max_tokens`` prompt tokens);
* other processors rewrite the placeholder (Gemma's ``<start_of_image>`` becomes a block of
  soft tokens).

So: the query after its prompt when it starts with it (image-token runs collapsed); else, when
the prompt ends with a chat template's assistant header, the query after its last such header
(and after what the template writes after the header, such as Qwen3's empty think block); else,
for a left-truncated prompt, the query after the longest tail of the prompt it starts with. A
query none of these fits is an item error naming the three tries.

Labels: a JSON object string with the judge's fields (``{"question", "references"}`` for LAVE,
``{"text"|"caption", "image_b64"|"image"}`` for the image judges), or a JSON list / plain string
of references, with the question taken from the prompt (its last user turn when the prompt is
chat-formatted). OpenRLHF sends ``""`` when no label key is configured: an item error saying
so. OpenRLHF sends no image bytes, so the image judges take the image from the label:
``image_b64``, or ``image`` a path relative to the server's ``--image-root`` (a path that leaves
that folder is refused, and without ``--image-root`` every path is).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from ..judges.registry import ItemError

#: End-of-turn, padding and media markers that decoding with special tokens kept leaves in a
#: response or a prompt's question.
SPECIAL_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|im_start|>", "<|eot_id|>",
                  "<|end_of_text|>", "<|begin_of_text|>", "</s>", "<s>", "<pad>", "<eos>",
                  "<|end|>", "<|user|>", "<|assistant|>", "<end_of_turn>", "<start_of_turn>",
                  "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
                  "<start_of_image>", "<end_of_image>", "<image_soft_token>")
_SPECIAL = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))
# a Qwen-style chat turn: <|im_start|>role\n text (up to <|im_end|> or the end)
_TURN = re.compile(r"<\|im_start\|>(\w+)\n(.*?)(?:<\|im_end\|>|$)", re.S)
# the user turns of the Llama 3 and Gemma templates
_USER_TURNS = (_TURN,
               re.compile(r"<\|start_header_id\|>(\w+)<\|end_header_id\|>\n\n(.*?)(?:<\|eot_id\|>|$)", re.S),
               re.compile(r"<start_of_turn>(\w+)\n(.*?)(?:<end_of_turn>|$)", re.S))
#: Tokens a processor repeats once per image patch: a run of them is one image in the prompt.
MEDIA_PADS = ("<|image_pad|>", "<|video_pad|>", "<image_soft_token>")
_MEDIA_RUN = re.compile("|".join(f"(?:{re.escape(t)})+" for t in MEDIA_PADS))
#: The assistant headers of common chat templates (ChatML/Qwen, Llama 3, Gemma, Phi/Zephyr,
#: Mistral, DeepSeek), each as written right before the response.
ASSISTANT_HEADERS = ("<|im_start|>assistant\n", "<|start_header_id|>assistant<|end_header_id|>\n\n",
                     "<start_of_turn>model\n", "<|assistant|>\n", "<|assistant|>", "[/INST]",
                     "<｜Assistant｜>")
#: Markers that start a turn: a prompt whose text after its last assistant header holds one
#: does not end with an open assistant turn.
_TURN_STARTS = ("<|im_start|>", "<|start_header_id|>", "<start_of_turn>", "<|user|>", "[INST]",
                "<｜User｜>")
#: Shortest prompt tail accepted as the start of a left-truncated query: a shorter overlap is as
#: likely a coincidence (the executor keeps at least the whole prompt budget, hundreds of tokens).
MIN_TRUNCATED_OVERLAP = 32


class SplitError(ItemError):
    """A query in which the response could not be told from the prompt."""


def clean(text: str) -> str:
    return _SPECIAL.sub("", text).strip()


def prompt_question(prompt: str) -> str:
    """The question a prompt asks: its last user turn when chat-formatted, else the prompt."""
    for turn in _USER_TURNS:
        users = [content for role, content in turn.findall(prompt) if role == "user"]
        if users:
            return clean(users[-1])
    return clean(prompt)


def collapse_media(text: str) -> str:
    """``text`` with each run of image/video pad tokens written as one token."""
    return _MEDIA_RUN.sub(lambda m: m.group(0)[:m.group(0).index(">") + 1], text)


def _after_assistant_header(query: str, prompt: str) -> str | None:
    """The response after the query's last assistant header, when the prompt ends with an open
    assistant turn of a template this knows; None otherwise."""
    found = [(prompt.rfind(h), h) for h in ASSISTANT_HEADERS]
    at, header = max(found, key=lambda f: (f[0], len(f[1])))
    if at < 0:
        return None
    tail = prompt[at + len(header):]  # what the template writes after the header
    if any(t in tail for t in _TURN_STARTS):
        return None  # the prompt ends in another turn: no open assistant turn
    start = query.rfind(header)
    if start < 0:
        return None
    response = query[start + len(header):]
    return response[len(tail):] if response.startswith(tail) else response


def _overlap(prompt: str, query: str) -> int:
    """Length of the longest prefix of ``query`` that is a suffix of ``prompt`` (prefix
    function of ``query + sep + prompt``: linear time)."""
    s = query + "\x00" + prompt
    fail = [0] * len(s)
    for i in range(1, len(s)):
        k = fail[i - 1]
        while k and s[i] != s[k]:
            k = fail[k - 1]
        if s[i] == s[k]:
            k += 1
        fail[i] = k
    return fail[-1]


def split_response(query: str, prompt: str) -> str:
    """The response part of an OpenRLHF query (see the module docstring); :class:`SplitError`
    when none of the ways fits."""
    if query.startswith(prompt):
        return query[len(prompt):]
    q, p = collapse_media(query), collapse_media(prompt)
    if q.startswith(p):
        return q[len(p):]
    response = _after_assistant_header(q, p)
    if response is not None:
        return response
    # a left-truncated prompt: the query starts with the prompt's tail (a character cut by the
    # token boundary decodes as U+FFFD)
    rest = q.lstrip("\ufffd")
    n = _overlap(p, rest) if p else 0
    if n >= min(MIN_TRUNCATED_OVERLAP, len(p)) and n > 0:
        return rest[n:]
    raise SplitError("cannot tell the response from the prompt: the query does not start with "
                     "its prompt (image-token runs collapsed), the prompt ends with no assistant "
                     "header found in the query, and the query does not start with the end of "
                     "the prompt (a left-truncated prompt)")


def _label_fields(label: Any, where: str) -> dict:
    """The judge fields a label gives: a JSON object's own fields, or ``references``."""
    if label is None or (isinstance(label, str) and not label.strip()):
        raise ItemError(f"{where}: the label is empty; OpenRLHF sends \"\" when no label key is "
                        "set: set --data.label_key (--label_key before v0.10.2) to the dataset "
                        "column holding the references or the judge's fields")
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


def image_under_root(path: Any, image_root: str | None, where: str) -> str:
    """A label's image path as a file inside ``image_root``; :class:`ItemError` otherwise."""
    if image_root is None:
        raise ItemError(f"{where}: the label names an image path, but the server reads image "
                        "files only under --image-root; start it with --image-root DIR or send "
                        "the image as image_b64")
    if not isinstance(path, str) or not path or os.path.isabs(path):
        raise ItemError(f"{where}: image must be a path relative to --image-root")
    root = os.path.realpath(image_root)
    full = os.path.realpath(os.path.join(root, path))
    if os.path.commonpath([root, full]) != root:
        raise ItemError(f"{where}: image path {path!r} leaves --image-root")
    return full


def stock_item(query: str, prompt: str, label: Any, where: str, text_judge: bool,
               image_root: str | None = None) -> tuple[dict, bool]:
    """The judge item of one stock-payload sample, and whether it names an image file (checked
    to lie under ``image_root``; such an item is read as a file row, not an HTTP item)."""
    try:
        response = clean(split_response(query, prompt))
    except SplitError as bad:
        raise SplitError(f"{where}: {bad}") from None
    fields = _label_fields(label, where)
    if text_judge:
        return {"question": prompt_question(prompt), **fields, "prediction": response}, False
    # image judges: the response is the text to check against the label's image
    item = {**fields, "text": response}
    if "image_b64" not in item and "image" in item:
        item["image"] = image_under_root(item["image"], image_root, where)
        return item, True
    return item, False


def stock_example(spec, query: str, prompt: str, label: Any, where: str, text_judge: bool,
                  image_root: str | None = None):
    """The judge's example of one stock-payload sample (:class:`ItemError`, or the judge's own
    ``ValueError`` for an image that does not decode, when it has none)."""
    item, image_file = stock_item(query, prompt, label, where, text_judge, image_root)
    if image_file:  # a checked path under the image root: read as a file job's row
        from ..judges.items import image_text_from_row

        return image_text_from_row(item, None, where)
    return spec.parse_item(item, where)

