"""A policy's chat-template markers, learned from its own template instead of kept by hand.

To tell a policy's response from its prompt (OpenRLHF hands the reward the two decoded
together) and to find the question in a prompt, the reward needs the policy's markers: where a
turn ends, how the assistant's turn is announced, what the generation prompt writes after that
header (Qwen3's empty think block, Gemma 4's empty thought channel), how a user turn starts, and
which tokens stand for an image (which the policy's processor then expands). Every new template
changes them; so they are learned by rendering a probe conversation through the template once:

* ``[user U1]`` without and with the generation prompt: the generation prompt;
* ``[user U1, assistant A1, user U2]``: the text between U1 and A1, and between A1 and U2. What
  the two share at their start is the end of a turn followed by the start of the next; the
  end of a turn is what ``[user U1]`` ends with after U1. The assistant header is what
  follows the end of U1's turn up to A1; the user header, what follows the end of A1's turn
  up to U2;
* ``[user [image, U1]]``: the text the template writes for an image, whose tokens, with the
  media tokens the tokenizer declares (``image_token``, ``boi_token``, ``eoi_token``,
  ``video_token``, ...), are the media tokens.

The template is rendered as transformers renders it (a sandboxed jinja2 environment with
``trim_blocks`` and ``lstrip_blocks``, ``raise_exception``, ``tojson``, ``strftime_now``, the
``generation`` block), with the tokenizer's special tokens (``bos_token``, ...) as variables.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

from .answers import REASONING_BLOCKS

__all__ = ["ChatMarkers", "learn_markers", "load_markers", "render"]

# sentinel words no template writes or changes (letters only: templates may trim or escape)
_U1, _A1, _U2 = "Fjprobeuserone", "Fjprobeassistantone", "Fjprobeusertwo"
# a token as chat templates write them: <...> with no spaces inside
_TOKEN = re.compile(r"<[^<>\s]+>|\u25c1[^\u25c1\u25b7\s]+\u25b7")
# tokenizer_config.json keys naming a media token (Gemma 3/4: boi/eoi/image; Qwen-VL: image,
# video, vision start/end)
_MEDIA_KEY = re.compile(r"^(?:boi|eoi|boa|eoa|image|video|vision|audio)\w*_token$")


@dataclass(frozen=True)
class ChatMarkers:
    """The markers of one chat template (see the module docstring). ``media_tokens``: tokens
    standing for an image or a video, in the prompt or as a processor expands them;
    ``special_tokens``: the template's and tokenizer's tokens, removed from an answer or a
    question."""

    assistant_header: str
    user_header: str
    end_of_turn: str
    generation_tail: str = ""
    media_tokens: tuple[str, ...] = ()
    special_tokens: tuple[str, ...] = ()
    source: str = ""

    @property
    def turn_headers(self) -> tuple[str, ...]:
        return (self.user_header, self.assistant_header)


class _Generation:
    """The ``{% generation %}`` block transformers' templates may use: rendered as is."""

    def __new__(cls):
        from jinja2 import nodes
        from jinja2.ext import Extension

        class Generation(Extension):
            tags = {"generation"}

            def parse(self, parser):
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

            def _body(self, caller):
                return caller()

        return Generation


@lru_cache(maxsize=16)
def _compiled(template: str):
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation(), "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def render(template: str, messages: list, add_generation_prompt: bool = False,
           special: dict | None = None, **variables: Any) -> str:
    """``template`` rendered for ``messages`` as ``apply_chat_template(tokenize=False)``
    renders it."""
    return _compiled(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                      **(special or {}), **variables)


def _common_prefix(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def _between(text: str, start: str, end: str) -> str:
    at = text.index(start) + len(start)
    return text[at:text.index(end, at)]


def learn_markers(template: str, special: dict | None = None, media_tokens: tuple[str, ...] = (),
                  source: str = "", **variables: Any) -> ChatMarkers:
    """The markers of ``template`` (see the module docstring). ``special``: the tokenizer's
    special tokens by name (``bos_token``, ``eos_token``, ...); ``media_tokens``: the media
    tokens the tokenizer declares; ``variables``: extra template variables (such as
    ``enable_thinking``) the policy's prompts are rendered with. ``ValueError`` when the probe
    does not show the markers."""
    special = dict(special or {})

    def say(role, content):
        return {"role": role, "content": content}

    try:
        full = render(template, [say("user", _U1), say("assistant", _A1), say("user", _U2)], True,
                      special, **variables)
        alone = render(template, [say("user", _U1)], False, special, **variables)
        prompted = render(template, [say("user", _U1)], True, special, **variables)
    except Exception as bad:  # a template error of any kind: say which template
        raise ValueError(f"the chat template{' of ' + source if source else ''} does not render a "
                         f"user/assistant/user probe: {bad}") from None
    if not all(w in full for w in (_U1, _A1, _U2)) or not full.index(_U1) < full.index(_A1) < full.index(_U2):
        raise ValueError(f"the chat template{' of ' + source if source else ''} does not write the "
                         "probe's turns in order")
    user_to_assistant = _between(full, _U1, _A1)
    assistant_to_user = _between(full, _A1, _U2)
    shared = _common_prefix(user_to_assistant, assistant_to_user)
    head = full[:full.index(_U1)]
    user_rest = assistant_to_user[len(shared):]
    # the end of a turn: what the template writes after the last user's words when nothing
    # follows; else the part of `shared` before the longest end of it that starts the first
    # user turn as well
    after_last = alone[alone.index(_U1) + len(_U1):] if _U1 in alone else ""
    if after_last and shared.startswith(after_last):
        cut = len(after_last)
    else:
        cut = next((k for k in range(len(shared) + 1) if head.endswith(shared[k:] + user_rest)),
                   len(shared))
    end_of_turn = shared[:cut]
    assistant_header = user_to_assistant[len(end_of_turn):]
    user_header = shared[cut:] + user_rest
    generation = prompted[len(alone):] if prompted.startswith(alone) else ""
    tail = generation[len(assistant_header):] if generation.startswith(assistant_header) else ""
    if not assistant_header.strip() or not end_of_turn.strip():
        raise ValueError(f"the chat template{' of ' + source if source else ''} marks no assistant "
                         "header or end of turn")
    media = list(media_tokens)
    try:
        with_image = render(template, [say("user", [{"type": "image"}, {"type": "text", "text": _U1}])],
                            False, special, **variables)
        before = with_image[:with_image.index(_U1)]
        written = before[before.rindex(user_header) + len(user_header):] if user_header in before else ""
        media += [t for t in _TOKEN.findall(written) if "{" not in t]
    except Exception:  # noqa: BLE001 - a text-only template: no image placeholder to learn
        pass
    tokens = [t for t in special.values() if isinstance(t, str) and t]
    for marker in (end_of_turn, assistant_header, user_header, tail):
        tokens += _TOKEN.findall(marker)
    tokens += media
    # reasoning markers stay: the answer is found by them (fastjudge.rl.answers)
    tokens = [t for t in tokens if not any(t in marker for pair in REASONING_BLOCKS for marker in pair)]
    return ChatMarkers(assistant_header=assistant_header, user_header=user_header,
                       end_of_turn=end_of_turn, generation_tail=tail,
                       media_tokens=tuple(dict.fromkeys(media)),
                       special_tokens=tuple(dict.fromkeys(tokens)), source=source)


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):  # AddedToken as JSON
        return value["content"]
    return None


def load_markers(path: str | os.PathLike, **variables: Any) -> ChatMarkers:
    """The markers of the policy whose tokenizer is at ``path``: a directory with
    ``tokenizer_config.json`` (and ``chat_template.jinja`` or ``chat_template.json`` where the
    template is kept apart), or a template file (``.jinja``). ``variables``: as in
    :func:`learn_markers`."""
    path = os.fspath(path)
    special: dict[str, str] = {}
    media: list[str] = []
    if os.path.isdir(path):
        config = _read_json(os.path.join(path, "tokenizer_config.json"))
        template = None
        if os.path.isfile(os.path.join(path, "chat_template.jinja")):
            with open(os.path.join(path, "chat_template.jinja"), encoding="utf-8") as f:
                template = f.read()
        template = template or _read_json(os.path.join(path, "chat_template.json")).get("chat_template")
        template = template or config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        extra = config.get("extra_special_tokens")
        declared = {**config, **(extra if isinstance(extra, dict) else {})}
        for key, value in declared.items():
            text = _token_text(value)
            if text is None or not key.endswith("_token"):
                continue
            if _MEDIA_KEY.match(key):
                media.append(text)
            else:
                special[key] = text
        for added in (config.get("added_tokens_decoder") or {}).values():
            if isinstance(added, dict) and added.get("special") and isinstance(added.get("content"), str):
                special.setdefault(f"added:{added['content']}", added["content"])
    else:
        with open(path, encoding="utf-8") as f:
            template = f.read()
    if not isinstance(template, str) or not template.strip():
        raise ValueError(f"{path}: no chat template found (tokenizer_config.json 'chat_template', "
                         "chat_template.jinja or chat_template.json)")
    names = {k: v for k, v in special.items() if not k.startswith("added:")}
    markers = learn_markers(template, names, tuple(media), source=path, **variables)
    extra = tuple(v for k, v in special.items() if k.startswith("added:"))
    return ChatMarkers(**{**markers.__dict__,
                          "special_tokens": tuple(dict.fromkeys(markers.special_tokens + extra))})
