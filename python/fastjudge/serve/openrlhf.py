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

So: the query after its prompt when it starts with it (each run of media tokens, with the
whitespace around it, compared as one image); else, when the prompt ends with the policy's
assistant header, the query after its last such header (and after what the template writes
after the header, such as Qwen3's empty think block); else, for a left-truncated prompt, the
query after the longest tail of the prompt it starts with. A query none of these fits is an
item error naming the three tries.

The markers (assistant header, turn headers, end of turn, media and special tokens) are the
policy's own, learned from its chat template (:mod:`fastjudge.rl.chat_markers`; the server's
``--policy-template``). Without a template, tables of the common templates' markers (ChatML /
Qwen, Llama 3, Gemma 3 and 4, Phi, Mistral, DeepSeek) stand in.

The response is then judged on its answer (:mod:`fastjudge.rl.answers`): the special tokens
removed, a completed reasoning block removed (``reasoning="keep"``: judged as is), and an
empty answer or one that ends inside its reasoning block (including a block the prompt's
generation prompt opened, as Qwen3.5's with thinking on) an item error saying so.

Labels: a JSON object string with the judge's fields (``{"question", "references"}`` for LAVE,
``{"text"|"caption", "image_b64"|"image"}`` for the image judges), or a JSON list / plain string
of references, with the question taken from the prompt (its last user turn when the prompt is
chat-formatted). OpenRLHF sends ``""`` when no label key is configured: an item error saying
so. OpenRLHF sends no image bytes, so the image judges take the image from the label:
``image_b64``, or ``image`` as OpenRLHF's image column holds it (``datasets/prompts_dataset.py``;
``utils/vlm_utils.py``, ``load_images``): a path (relative to the server's ``--image-root``, or
absolute inside it; a path that leaves that folder is refused, and without ``--image-root``
every path is), an ``http(s)`` URL under one of the server's ``--image-url-prefix`` (fetched;
any other URL is refused), a ``data:`` URL, or a list of these holding one image.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
from typing import Any

from ..judges.registry import ItemError
from ..rl.answers import AnswerError, answer_of, opens_reasoning

#: End-of-turn, padding and media markers that decoding with special tokens kept leaves in a
#: response or a prompt's question.
SPECIAL_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|im_start|>", "<|eot_id|>",
                  "<|end_of_text|>", "<|begin_of_text|>", "</s>", "<s>", "<pad>", "<eos>",
                  "<|end|>", "<|user|>", "<|assistant|>", "<end_of_turn>", "<start_of_turn>",
                  "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
                  "<start_of_image>", "<end_of_image>", "<image_soft_token>", "<bos>",
                  "<|turn>", "<turn|>", "<|image>", "<image|>", "<|image|>")
_SPECIAL = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))
# a Qwen-style chat turn: <|im_start|>role\n text (up to <|im_end|> or the end)
_TURN = re.compile(r"<\|im_start\|>(\w+)\n(.*?)(?:<\|im_end\|>|$)", re.S)
# the user turns of the Llama 3 and Gemma templates
_USER_TURNS = (_TURN,
               re.compile(r"<\|start_header_id\|>(\w+)<\|end_header_id\|>\n\n(.*?)(?:<\|eot_id\|>|$)", re.S),
               re.compile(r"<start_of_turn>(\w+)\n(.*?)(?:<end_of_turn>|$)", re.S),
               re.compile(r"<\|turn>(\w+)\n(.*?)(?:<turn\|>|$)", re.S))
#: Tokens that stand for an image or a video, as templates write them and as processors expand
#: them (Qwen-VL: pads between vision start/end; Gemma 3: soft tokens between start/end of
#: image; Gemma 4: ``<|image|>`` repeated between ``<|image>`` and ``<image|>``).
MEDIA_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
                "<start_of_image>", "<end_of_image>", "<image_soft_token>", "<|image>",
                "<image|>", "<|image|>")
#: what a run of media tokens is compared as
_IMAGE = "\ufffc"
#: The assistant headers of common chat templates (ChatML/Qwen, Llama 3, Gemma, Phi/Zephyr,
#: Mistral, DeepSeek), each as written right before the response.
ASSISTANT_HEADERS = ("<|im_start|>assistant\n", "<|start_header_id|>assistant<|end_header_id|>\n\n",
                     "<start_of_turn>model\n", "<|turn>model\n", "<|assistant|>\n", "<|assistant|>",
                     "[/INST]", "<｜Assistant｜>")
#: Markers that start a turn: a prompt whose text after its last assistant header holds one
#: does not end with an open assistant turn.
_TURN_STARTS = ("<|im_start|>", "<|start_header_id|>", "<start_of_turn>", "<|turn>", "<|user|>",
                "[INST]", "<｜User｜>")
#: Shortest prompt tail accepted as the start of a left-truncated query: a shorter overlap is as
#: likely a coincidence (the executor keeps at least the whole prompt budget, hundreds of tokens).
MIN_TRUNCATED_OVERLAP = 32


class SplitError(ItemError):
    """A query in which the response could not be told from the prompt."""


def clean(text: str, markers=None) -> str:
    """``text`` without the special tokens (the policy's own, else the table's) and without
    surrounding whitespace; reasoning markers are kept for :func:`~fastjudge.rl.answers.answer_of`."""
    tokens = SPECIAL_TOKENS if markers is None else markers.special_tokens + SPECIAL_TOKENS
    pattern = _SPECIAL if markers is None else _alternatives(tokens)
    return pattern.sub("", text.replace(_IMAGE, "")).strip()


def _alternatives(tokens) -> re.Pattern:
    return re.compile("|".join(re.escape(t) for t in sorted(set(tokens), key=len, reverse=True)))


def _user_turns(markers) -> tuple:
    if markers is None:
        return _USER_TURNS
    end = re.escape(markers.end_of_turn.strip() or markers.end_of_turn)
    return (re.compile(f"{re.escape(markers.user_header)}()(.*?)(?:{end}|$)", re.S),)


def prompt_question(prompt: str, markers=None) -> str:
    """The question a prompt asks: its last user turn when chat-formatted, else the prompt."""
    for turn in _user_turns(markers):
        users = [content for role, content in turn.findall(prompt) if role in ("user", "")]
        if users:
            return clean(users[-1], markers)
    return clean(prompt, markers)


def collapse_media(text: str, markers=None) -> str:
    """``text`` with each run of media tokens, and the whitespace around it, written as one
    placeholder: a prompt's image placeholder and the processor's expansion of it compare
    equal."""
    tokens = MEDIA_TOKENS if markers is None or not markers.media_tokens else markers.media_tokens
    one = "(?:" + "|".join(re.escape(t) for t in sorted(set(tokens), key=len, reverse=True)) + ")"
    return re.sub(rf"\s*{one}(?:\s*{one})*\s*", _IMAGE, text)


def _headers(markers) -> tuple[tuple[str, ...], tuple[str, ...]]:
    if markers is None:
        return ASSISTANT_HEADERS, _TURN_STARTS
    return (markers.assistant_header,), markers.turn_headers


def prompt_tail(prompt: str, markers=None) -> str | None:
    """What the prompt writes after its last assistant header (Qwen3's empty think block, a
    thinking template's open one), when it ends with an open assistant turn; None otherwise."""
    headers, turn_starts = _headers(markers)
    at, header = max(((prompt.rfind(h), h) for h in headers), key=lambda f: (f[0], len(f[1])))
    if at < 0:
        return None
    tail = prompt[at + len(header):]
    return None if any(t in tail for t in turn_starts) else tail


def _after_assistant_header(query: str, prompt: str, markers=None) -> str | None:
    """The response after the query's last assistant header, when the prompt ends with an open
    assistant turn; None otherwise."""
    tail = prompt_tail(prompt, markers)
    if tail is None:
        return None
    headers, _ = _headers(markers)
    header = max(((prompt.rfind(h), h) for h in headers), key=lambda f: (f[0], len(f[1])))[1]
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


def split_response(query: str, prompt: str, markers=None) -> str:
    """The response part of an OpenRLHF query (see the module docstring); :class:`SplitError`
    when none of the ways fits. ``markers``: the policy's
    (:class:`~fastjudge.rl.chat_markers.ChatMarkers`), else the tables'."""
    if query.startswith(prompt):
        return query[len(prompt):]
    q, p = collapse_media(query, markers), collapse_media(prompt, markers)
    if q.startswith(p):
        return q[len(p):]
    response = _after_assistant_header(q, p, markers)
    if response is not None:
        return response
    # a left-truncated prompt: the query starts with the prompt's tail (a character cut by the
    # token boundary decodes as U+FFFD)
    rest = q.lstrip("\ufffd")
    n = _overlap(p, rest) if p else 0
    if n >= min(MIN_TRUNCATED_OVERLAP, len(p)) and n > 0:
        return rest[n:]
    raise SplitError("cannot tell the response from the prompt: the query does not start with "
                     "its prompt (media-token runs compared as one), the prompt ends with no assistant "
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
    """A label's image path as a file inside ``image_root`` (relative to it, or absolute and
    inside it); :class:`ItemError` otherwise."""
    if image_root is None:
        raise ItemError(f"{where}: the label names an image path, but image files are read only "
                        "under --image-root; start the server with --image-root DIR (or set the "
                        "image root of the reward function), or send the image as image_b64")
    if not isinstance(path, str) or not path:
        raise ItemError(f"{where}: image must be a path, a URL or a list holding one")
    root = os.path.realpath(image_root)
    full = os.path.realpath(path if os.path.isabs(path) else os.path.join(root, path))
    if os.path.commonpath([root, full]) != root:
        raise ItemError(f"{where}: image path {path!r} is outside --image-root")
    return full


def fetch_label_image(max_bytes: int, timeout_s: float = 30.0):
    """``fetch(url, where) -> bytes`` for :func:`label_image`, with the chat route's limits (no
    redirects, at most ``max_bytes``); a failure is the item's error."""
    def fetch(url: str, where: str) -> bytes:
        from .openai_routes import fetch_image

        try:
            return fetch_image(url, where, max_bytes, timeout_s)
        except Exception as bad:  # noqa: BLE001 - any failure to fetch is this item's error
            raise ItemError(str(getattr(bad, "message", bad))) from None
    return fetch


def label_image(value: Any, where: str, image_root: str | None = None,
                url_prefixes: tuple[str, ...] = (), fetch=None) -> tuple[str, Any]:
    """A label's ``image`` as OpenRLHF's image column holds it: ``("bytes", data)`` or
    ``("path", file)``. ``fetch(url, where) -> bytes`` reads an allowed URL."""
    if isinstance(value, (list, tuple)):
        images = [v for v in value if v is not None]
        if len(images) != 1:
            raise ItemError(f"{where}: the label's image list holds {len(images)} images; the judge "
                            "takes one")
        value = images[0]
    if isinstance(value, str) and value.startswith("data:"):
        try:
            return "bytes", base64.b64decode(value.split(",", 1)[1], validate=True)
        except (IndexError, binascii.Error, ValueError):
            raise ItemError(f"{where}: the image data: URL is not valid base64") from None
    if isinstance(value, str) and value.startswith(("http://", "https://")):
        if not any(value.startswith(prefix) for prefix in url_prefixes):
            raise ItemError(f"{where}: the image URL is not under an allowed prefix "
                            "(--image-url-prefix); nothing is fetched from elsewhere")
        if fetch is None:
            raise ItemError(f"{where}: image URLs cannot be fetched here")
        return "bytes", fetch(value, where)
    return "path", image_under_root(value, image_root, where)


def stock_item(query: str, prompt: str, label: Any, where: str, text_judge: bool,
               image_root: str | None = None, markers=None, reasoning: str = "strip",
               url_prefixes: tuple[str, ...] = (), fetch=None) -> tuple[dict, bool]:
    """The judge item of one stock-payload sample, and whether it names an image file (checked
    to lie under ``image_root``; such an item is read as a file row, not an HTTP item)."""
    try:
        response = split_response(query, prompt, markers)
    except SplitError as bad:
        raise SplitError(f"{where}: {bad}") from None
    tail = prompt_tail(prompt, markers)
    try:
        answer = answer_of(clean(response, markers), reasoning,
                           opened=reasoning == "strip" and tail is not None and opens_reasoning(tail))
    except AnswerError as none:
        raise ItemError(f"{where}: {none}") from None
    fields = _label_fields(label, where)
    if text_judge:
        return {"question": prompt_question(prompt, markers), **fields, "prediction": answer}, False
    # image judges: the answer is the text to check against the label's image
    item = {**fields, "text": answer}
    if "image_b64" not in item and "image" in item:
        kind, image = label_image(item["image"], where, image_root, url_prefixes, fetch)
        if kind == "bytes":
            item.pop("image")
            item["image_b64"] = base64.b64encode(image).decode("ascii")
            return item, False
        item["image"] = image
        return item, True
    return item, False


def stock_example(spec, query: str, prompt: str, label: Any, where: str, text_judge: bool,
                  image_root: str | None = None, markers=None, reasoning: str = "strip",
                  url_prefixes: tuple[str, ...] = (), fetch=None):
    """The judge's example of one stock-payload sample (:class:`ItemError`, or the judge's own
    ``ValueError`` for an image that does not decode, when it has none)."""
    item, image_file = stock_item(query, prompt, label, where, text_judge, image_root, markers,
                                  reasoning, url_prefixes, fetch)
    if image_file:  # a checked path under the image root: read as a file job's row
        from ..judges.items import image_text_from_row

        return image_text_from_row(item, None, where)
    return spec.parse_item(item, where)
