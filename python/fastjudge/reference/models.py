"""Checkpoints loaded the transformers way, for the reference paths."""

from __future__ import annotations

import json
from pathlib import Path

import torch

PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"  # one image in a Qwen chat turn
IMAGE_PAD = "<|image_pad|>"


def torch_dtype(dtype) -> torch.dtype:
    return dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype))


def model_type(model_dir) -> str:
    return json.loads((Path(model_dir) / "config.json").read_text())["model_type"]


def load_model(model_dir, dtype="float32", device="cpu"):
    """(model, tokenizer): ``T5ForConditionalGeneration`` for T5 checkpoints,
    ``Qwen3_5ForConditionalGeneration`` for Qwen3.5 (text-only checkpoints included), else
    ``AutoModelForCausalLM``."""
    import transformers as tf

    kind = model_type(model_dir)
    cls = {"t5": tf.T5ForConditionalGeneration, "mt5": tf.T5ForConditionalGeneration,
           "qwen3_5": tf.Qwen3_5ForConditionalGeneration}.get(kind, tf.AutoModelForCausalLM)
    model = cls.from_pretrained(str(model_dir), dtype=torch_dtype(dtype)).eval().to(torch.device(device))
    return model, tf.AutoTokenizer.from_pretrained(str(model_dir))


def image_processor(model_dir):
    """(transformers' PIL image processor built from the checkpoint's preprocessor_config.json,
    its merge size). ``Qwen3VLProcessor`` itself cannot be built without torchvision (for its
    video processor), so the image processor is built alone."""
    from transformers import Qwen2VLImageProcessorPil

    pre = json.loads((Path(model_dir) / "preprocessor_config.json").read_text())
    pre.pop("image_processor_type", None)
    return Qwen2VLImageProcessorPil(**pre), pre["merge_size"]


def chat_text(tokenizer, user: str) -> str:
    """One user turn and the open assistant turn, thinking off (what the judges ask)."""
    return tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                         add_generation_prompt=True, enable_thinking=False)


def expand_image_pads(texts: list[str], grid_thw, merge: int) -> list[str]:
    """Each ``<|image_pad|>`` (in order over ``texts``) repeated to its image's token count, as
    the Qwen processors do."""
    counts = iter((torch.as_tensor(grid_thw).prod(-1) // merge ** 2).tolist())
    out = []
    for t in texts:
        head, *rest = t.split(IMAGE_PAD)
        out.append(head + "".join(IMAGE_PAD * next(counts) + r for r in rest))
    return out


def left_padded(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, attention mask) of token rows, padded on the left (decoder-only batching)."""
    width = max(map(len, rows))
    ids = torch.tensor([[pad_id] * (width - len(r)) + list(r) for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask
