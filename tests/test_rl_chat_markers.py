"""The prompt/response split learned from the policy's own chat template, with real templates
(``tests/fixtures/chat_templates``, sources in its README) and OpenRLHF's queries built as its
executor builds them.

Upstream contracts:
- OpenRLHF v0.11.0 (commit 3c3be6234e0cb353e76bb8019947db9dfe99fca7):
  ``openrlhf/datasets/prompts_dataset.py`` ``preprocess_data``: the prompt is
  ``apply_chat_template(chat, tokenize=False, add_generation_prompt=True)`` with no thinking
  switch, ``"<image>"`` in the input becoming a ``{"type": "image"}`` content part
  (``_str_to_content_list``); ``openrlhf/utils/vlm_utils.py`` ``process_prompt_with_images``
  (Qwen3.5 and Gemma 4 policies): the processor's ids of that prompt with the images expanded;
  ``openrlhf/utils/agent.py`` ``SingleTurnAgentExecutor.execute``: ``query =
  decode(prompt_ids + action_ids, skip_special_tokens=False)``, posted with the prompt text.
- transformers v5 (the installed release): ``Gemma4Processor.replace_image_token`` (the image
  token becomes ``boi + image_token * n + eoi``) and ``Gemma3Processor.replace_image_token``
  (``full_image_sequence``: ``"\\n\\n" + boi + image_token * n + eoi + "\\n\\n"``), applied by
  ``ProcessorMixin`` to each image placeholder in turn; ``apply_chat_template(tokenize=False)``
  for the rendering our probe must reproduce.

The query is the processor's text followed by the response: what ``decode`` returns for a
tokenizer that round-trips its text, as these templates' tokenizers do for these strings.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("jinja2")

from fastjudge.rl.chat_markers import load_markers, render  # noqa: E402
from fastjudge.serve.openrlhf import prompt_question, split_response  # noqa: E402

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
QUESTION = "What sport is this?"


def template(name: str) -> str:
    return (TEMPLATES / name / "chat_template.jinja").read_text()


def special(name: str) -> dict:
    config = json.loads((TEMPLATES / name / "tokenizer_config.json").read_text())
    return {k: v for k, v in config.items() if k in ("bos_token", "eos_token", "pad_token")}


def openrlhf_prompt(name: str, text: str, **variables) -> str:
    """``preprocess_data`` with ``--data.apply_chat_template``: the input as one user turn,
    ``<image>`` as an image content part."""
    parts = text.split("<image>")
    content = [{"type": "text", "text": parts[0].strip()}] if len(parts) == 1 else (
        [p for i, part in enumerate(parts)
         for p in ([{"type": "image"}] if i else []) + ([{"type": "text", "text": part.strip()}]
                                                        if part.strip() else [])])
    chat = [{"role": "user", "content": text if len(parts) == 1 else content}]
    return render(template(name), chat, True, special(name), **variables)


def gemma4_processed(prompt: str, soft_tokens: int) -> str:
    """The text Gemma 4's processor tokenizes: each ``<|image|>`` replaced in turn by
    ``Gemma4Processor.replace_image_token``."""
    from transformers.models.gemma4.processing_gemma4 import Gemma4Processor

    config = json.loads((TEMPLATES / "gemma4" / "tokenizer_config.json").read_text())
    me = SimpleNamespace(boi_token=config["boi_token"], eoi_token=config["eoi_token"],
                         image_token=config["image_token"])
    expanded = Gemma4Processor.replace_image_token(me, {"num_soft_tokens_per_image": [soft_tokens]}, 0)
    return prompt.replace(me.image_token, expanded, 1)


def gemma3_processed(prompt: str, crops: int = 0) -> str:
    from transformers.models.gemma3.processing_gemma3 import Gemma3Processor

    config = json.loads((TEMPLATES / "gemma3" / "tokenizer_config.json").read_text())
    me = SimpleNamespace(full_image_sequence=f"\n\n{config['boi_token']}{config['image_token'] * 256}"
                                             f"{config['eoi_token']}\n\n")
    expanded = Gemma3Processor.replace_image_token(me, {"num_crops": [crops]}, 0)
    return prompt.replace(config["boi_token"], expanded, 1)


# -- the markers ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name,header,user,end,tail,media", [
    ("qwen3_5", "<|im_start|>assistant\n", "<|im_start|>user\n", "<|im_end|>\n",
     "<think>\n\n</think>\n\n", {"<|image_pad|>", "<|vision_start|>", "<|vision_end|>"}),
    ("gemma4", "<|turn>model\n", "<|turn>user\n", "<turn|>\n", "<|channel>thought\n<channel|>",
     {"<|image|>", "<|image>", "<image|>"}),
    ("llama3", "<|start_header_id|>assistant<|end_header_id|>\n\n",
     "<|start_header_id|>user<|end_header_id|>\n\n", "<|eot_id|>", "", set()),
    ("gemma3", "<start_of_turn>model\n", "<start_of_turn>user\n", "<end_of_turn>\n", "",
     {"<start_of_image>", "<image_soft_token>", "<end_of_image>"}),
])
def test_markers_learned_from_each_template(name, header, user, end, tail, media):
    markers = load_markers(TEMPLATES / name)
    assert (markers.assistant_header, markers.user_header, markers.end_of_turn) == (header, user, end)
    assert markers.generation_tail == tail
    assert media <= set(markers.media_tokens)
    # the reasoning markers stay in the text for the answer extraction
    assert not {"<think>", "</think>", "<|channel>", "<channel|>"} & set(markers.special_tokens)


def test_thinking_on_changes_only_the_generation_tail():
    assert load_markers(TEMPLATES / "qwen3_5", enable_thinking=True).generation_tail == "<think>\n"
    gemma = load_markers(TEMPLATES / "gemma4", enable_thinking=True)
    assert gemma.generation_tail == "" and gemma.assistant_header == "<|turn>model\n"


def test_probe_renders_as_transformers_apply_chat_template(tmp_path):
    """Our rendering of a template is transformers' own (``apply_chat_template`` on a tokenizer
    built here, with each fixture template as its chat template)."""
    from fastjudge.checkpoints import train_bpe_tokenizer
    from fastjudge.demo import tokenizer_corpus

    tokenizer = train_bpe_tokenizer(tmp_path / "tok", tokenizer_corpus(), vocab_size=300)
    conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]},
                    {"role": "assistant", "content": "<think>\nhm\n</think>\n\nskiing"},
                    {"role": "user", "content": "  And now?  "}]
    for name in ("qwen3_5", "gemma4", "gemma3"):
        tokenizer.chat_template = template(name)
        for thinking in (False, True):
            theirs = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True,
                                                   enable_thinking=thinking, bos_token="<bos>")
            ours = render(template(name), conversation, True, {"bos_token": "<bos>"},
                          enable_thinking=thinking)
            assert ours == theirs, name


# -- OpenRLHF queries split by the learned markers ---------------------------------------------
def test_gemma4_vlm_query_with_the_processors_image_expansion(lave_judge):
    """A Gemma 4 VLM policy (OpenRLHF v0.10.0 on): the query holds the prompt with ``<|image|>``
    expanded to ``<|image>`` + 280 soft tokens + ``<image|>``; thinking off (the default
    generation prompt writes the empty thought channel) and on."""
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient

    from fastjudge.judges.lave import VQAExample
    from fastjudge.serve import create_app

    markers = load_markers(TEMPLATES / "gemma4")
    prompt = openrlhf_prompt("gemma4", f"<image>{QUESTION}")
    assert prompt.endswith("<|turn>model\n<|channel>thought\n<channel|>") and "<|image|>" in prompt
    query = gemma4_processed(prompt, 280) + "skiing<turn|>"
    assert query.count("<|image|>") == 280 and not query.startswith(prompt)
    assert split_response(query, prompt, markers) == "skiing<turn|>"
    assert prompt_question(prompt, markers) == QUESTION
    thinking = openrlhf_prompt("gemma4", f"<image>{QUESTION}", enable_thinking=True)
    thought = (gemma4_processed(thinking, 280)
               + "<|channel>thought\nSnow, poles and boots on long boards.<channel|>skiing<turn|>")
    unfinished = gemma4_processed(thinking, 280) + "<|channel>thought\nSnow, poles and boots"
    expected = lave_judge.score([VQAExample(QUESTION, ["skiing", "ski"], "skiing")])[0].score
    app = create_app(lave_judge, reward_on_error=-1.0, policy_markers=markers)
    with TestClient(app) as c:
        r = c.post("/get_reward", json={"query": [query, thought, unfinished],
                                        "prompts": [prompt, thinking, thinking],
                                        "labels": [json.dumps(["skiing", "ski"])] * 3}).json()
    assert r["errors"][:2] == [None, None]
    assert r["rewards"][:2] == [pytest.approx(expected)] * 2
    assert r["rewards"][2] == -1.0 and "never closes" in r["errors"][2]


def test_qwen3_5_thinking_policy(lave_judge):
    """Qwen3.5 with thinking on: the generation prompt opens ``<think>\\n``, so the response is
    ``reasoning</think>\\n\\nanswer``; one that runs out of tokens while thinking has no
    answer."""
    markers = load_markers(TEMPLATES / "qwen3_5")
    prompt = openrlhf_prompt("qwen3_5", f"<image>{QUESTION}", enable_thinking=True)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")
    processed = prompt.replace("<|image_pad|>", "<|image_pad|>" * 64)
    from fastjudge.serve.openrlhf import stock_item

    done = processed + "The person wears skis on snow.\n</think>\n\nskiing<|im_end|>"
    item, _ = stock_item(done, prompt, json.dumps(["skiing"]), "q", True, markers=markers)
    assert (item["question"], item["prediction"]) == (QUESTION, "skiing")
    kept, _ = stock_item(done, prompt, json.dumps(["skiing"]), "q", True, markers=markers,
                         reasoning="keep")
    assert kept["prediction"].startswith("The person wears skis") and kept["prediction"].endswith("skiing")
    from fastjudge.judges.registry import ItemError

    with pytest.raises(ItemError, match="never closes"):
        stock_item(processed + "The person wears skis and", prompt, "skiing", "q", True, markers=markers)
    with pytest.raises(ItemError, match="empty"):
        stock_item(processed + "Done.\n</think>\n\n<|im_end|>", prompt, "skiing", "q", True,
                   markers=markers)


@pytest.mark.parametrize("crops", [0, 2])
def test_gemma3_and_llama3_queries(crops):
    """Gemma 3's processor writes each ``<start_of_image>`` as a block of soft tokens (with
    pan-and-scan crops, inside a sentence: the split then goes by the assistant header);
    Llama 3 is text only."""
    gemma = load_markers(TEMPLATES / "gemma3")
    prompt = openrlhf_prompt("gemma3", f"<image>{QUESTION}")
    query = gemma3_processed(prompt, crops) + "skiing<end_of_turn>"
    assert split_response(query, prompt, gemma) == "skiing<end_of_turn>"
    assert prompt_question(prompt, gemma) == QUESTION
    llama = load_markers(TEMPLATES / "llama3")
    prompt = openrlhf_prompt("llama3", QUESTION)
    assert prompt.startswith("<|begin_of_text|><|start_header_id|>user")
    assert split_response(prompt + "skiing<|eot_id|>", prompt, llama) == "skiing<|eot_id|>"
    assert prompt_question(prompt, llama) == QUESTION


GRANITE = (  # ibm-granite/granite-3.3-8b-instruct's turn format, reduced to text turns
    "{%- for message in messages -%}"
    "{{- '<|start_of_role|>' + message['role'] + '<|end_of_role|>' + message['content'] + '<|end_of_text|>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_of_role|>assistant<|end_of_role|>' -}}{%- endif -%}")


def test_a_template_no_table_knows(tmp_path):
    """The tables fail on a template they do not list; the learned markers do not."""
    (tmp_path / "chat_template.jinja").write_text(GRANITE)
    markers = load_markers(tmp_path / "chat_template.jinja")
    assert markers.assistant_header == "<|start_of_role|>assistant<|end_of_role|>"
    system = "<|start_of_role|>system<|end_of_role|>Be brief.<|end_of_text|>\n"
    prompt = system + render(GRANITE, [{"role": "user", "content": QUESTION}], True)
    # the decoded query differs from the prompt text (a tokenizer's clean-up of " ?")
    query = prompt.replace("Be brief.", "Be brief .") + "skiing<|end_of_text|>"
    from fastjudge.serve.openrlhf import SplitError, clean

    with pytest.raises(SplitError):
        split_response(query, prompt)
    assert clean(split_response(query, prompt, markers), markers) == "skiing"
    assert prompt_question(prompt, markers) == QUESTION


def test_serve_command_line_takes_the_policy_template():
    from fastjudge.cli import build_parser
    from fastjudge.serve.command import policy_markers_of

    args = build_parser().parse_args(["serve", "--model", "m", "--policy-template",
                                      str(TEMPLATES / "gemma4"), "--reasoning", "keep"])
    assert policy_markers_of(args) == load_markers(TEMPLATES / "gemma4")
    assert args.reasoning == "keep"
    plain = build_parser().parse_args(["serve", "--model", "m"])
    assert policy_markers_of(plain) is None and plain.reasoning == "strip"
