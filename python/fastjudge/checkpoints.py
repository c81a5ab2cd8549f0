"""Random-weight judge checkpoints, saved as real Hugging Face directories.

The demo and the tests cannot download weights, so they build checkpoints of the real
architectures with random weights and a tokenizer trained on a small corpus, and load them
through exactly the path a user's checkpoint takes (config.json, model.safetensors, tokenizer
files). Random weights give meaningless ratings; the code path is the real one.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Iterable

# Flan-T5 shapes (d_model, d_ff, d_kv, heads, layers). "tiny" is for tests.
T5_SHAPES = {
    "tiny": dict(d_model=64, d_ff=128, d_kv=16, num_heads=4, num_layers=2),
    "small": dict(d_model=512, d_ff=1024, d_kv=64, num_heads=6, num_layers=8),
    "base": dict(d_model=768, d_ff=2048, d_kv=64, num_heads=12, num_layers=12),
}


def train_t5_tokenizer(out_dir: str | os.PathLike, corpus: Iterable[str], vocab_size: int = 800,
                       extra_ids: int = 100):
    """Train a SentencePiece unigram model on ``corpus`` and save it as a T5 tokenizer.

    Special ids follow T5: pad=0, eos=1, unk=2, then the pieces, then ``<extra_id_*>``.
    """
    import sentencepiece as spm
    from transformers import T5Tokenizer

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(list(corpus)), model_writer=model, vocab_size=vocab_size,
        model_type="unigram", pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
        character_coverage=1.0, hard_vocab_limit=False, minloglevel=2,
        # Ratings are whole pieces in real Flan-T5 ("▁1", "▁2", "▁3"); keep it so here.
        user_defined_symbols=["▁1", "▁2", "▁3"],
    )
    proto = spm.SentencePieceProcessor(model_proto=model.getvalue())
    vocab = [(proto.id_to_piece(i), proto.get_score(i)) for i in range(proto.get_piece_size())]
    tokenizer = T5Tokenizer(vocab=vocab, extra_ids=extra_ids)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out))
    (out / "spiece.model").write_bytes(model.getvalue())
    return tokenizer


def build_random_t5(out_dir: str | os.PathLike, corpus: Iterable[str], shape: str = "tiny",
                    seed: int = 0, vocab_size: int = 800, tie_word_embeddings: bool = False,
                    feed_forward_proj: str = "gated-gelu", model_vocab_size: int | None = None) -> Path:
    """A random-weight T5 v1.1 / Flan-T5-shaped checkpoint directory with a trained tokenizer.

    ``model_vocab_size`` sizes the embedding and LM head beyond the tokenizer (real Flan-T5:
    32128 rows for 32100 tokens), for benchmarks that should pay the real head's cost.
    """
    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    out = Path(out_dir)
    tokenizer = train_t5_tokenizer(out, corpus, vocab_size=vocab_size)
    dims = T5_SHAPES[shape]
    config = T5Config(
        vocab_size=max(len(tokenizer), model_vocab_size or 0), feed_forward_proj=feed_forward_proj,
        tie_word_embeddings=tie_word_embeddings, decoder_start_token_id=0, pad_token_id=0,
        eos_token_id=1, dropout_rate=0.0, **dims,
    )
    torch.manual_seed(seed)
    model = T5ForConditionalGeneration(config).eval()
    model.save_pretrained(str(out), safe_serialization=True)
    if not tie_word_embeddings:
        # Flan-T5 ships a separate, untied LM head and no output rescaling. transformers saves
        # T5 heads tied, so write the checkpoint the way the real one is laid out.
        from safetensors.torch import load_file, save_file

        weights_file = out / "model.safetensors"
        state = load_file(str(weights_file))
        state["lm_head.weight"] = torch.randn_like(state["shared.weight"]) * dims["d_model"] ** -0.5
        save_file(state, str(weights_file), metadata={"format": "pt"})
        cfg = json.loads((out / "config.json").read_text())
        cfg.pop("scale_decoder_outputs", None)
        cfg["tie_word_embeddings"] = False
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def scale_output_rows(model_dir: str | os.PathLike, scales: dict[int, float]) -> None:
    """Multiply rows of a saved checkpoint's (untied) LM head in place, ``{token id: factor}``.

    Random weights almost never emit EOS, while a real judge's outputs end at varied lengths,
    often on a rating. Scaling up the EOS and rating rows makes those tokens win greedy steps
    often enough to give that shape to generations (tests and benchmarks of decoding)."""
    from safetensors.torch import load_file, save_file

    weights_file = Path(model_dir) / "model.safetensors"
    state = load_file(str(weights_file))
    if "lm_head.weight" not in state:
        raise ValueError(f"{model_dir}: no separate lm_head.weight to scale")
    for token, factor in scales.items():
        state["lm_head.weight"][token] *= factor
    save_file(state, str(weights_file), metadata={"format": "pt"})


# Qwen shapes: (hidden, intermediate, layers, heads, kv heads, head_dim, DeltaNet k/v heads, dims).
QWEN_SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                 linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16),
    "mini": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
                 linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64),
    "small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                  linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
                  linear_value_head_dim=64),
    "medium": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
                   num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                   linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=64,
                   linear_value_head_dim=64),
}

QWEN_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]

# The structure of Qwen's chat template: turns in <|im_start|>role ... <|im_end|>, and with
# thinking disabled an empty <think></think> block opening the assistant turn.
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}"
)


def train_bpe_tokenizer(out_dir: str | os.PathLike, corpus: Iterable[str], vocab_size: int = 1000):
    """A byte-level BPE tokenizer with Qwen's special tokens and chat-template structure."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Digits split one by one, as in Qwen's pre-tokenizer.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=QWEN_SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(corpus), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", chat_template=QWEN_CHAT_TEMPLATE)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    return fast


def _randomize_norms(model, seed: int) -> None:
    """Norm weights start at 0 (zero-centred) or 1; random ones make a wrong norm formula fail
    the faithfulness tests instead of passing by accident."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn(p.shape, generator=gen) * 0.2)


def build_random_qwen(out_dir: str | os.PathLike, corpus: Iterable[str], arch: str = "qwen3_5",
                      shape: str = "tiny", seed: int = 0, vocab_size: int = 1000,
                      multimodal: bool = False) -> Path:
    """A random-weight Qwen3.5 (hybrid Gated DeltaNet + gated attention) or Qwen3 (dense)
    causal LM checkpoint with a trained BPE tokenizer. ``multimodal=True`` saves Qwen3.5 as
    ``Qwen3_5ForConditionalGeneration`` (language model nested under a vision tower)."""
    import torch

    out = Path(out_dir)
    tokenizer = train_bpe_tokenizer(out, corpus, vocab_size=vocab_size)
    dims = dict(QWEN_SHAPES[shape])
    torch.manual_seed(seed)
    if arch == "qwen3":
        from transformers import Qwen3Config, Qwen3ForCausalLM

        for key in [k for k in dims if k.startswith("linear_")]:
            dims.pop(key)
        config = Qwen3Config(vocab_size=len(tokenizer), tie_word_embeddings=False, **dims)
        model = Qwen3ForCausalLM(config)
    elif arch == "qwen3_5":
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        n = dims["num_hidden_layers"]
        # Both layer kinds, full attention every other layer (real models: every fourth).
        layer_types = ["linear_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
        text = Qwen3_5TextConfig(vocab_size=len(tokenizer), tie_word_embeddings=False,
                                 layer_types=layer_types, **dims)
        if multimodal:
            from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

            vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                          out_hidden_size=dims["hidden_size"], patch_size=14,
                          temporal_patch_size=2, spatial_merge_size=2)
            config = Qwen3_5Config(text_config=text.to_dict(), vision_config=vision,
                                   tie_word_embeddings=False)
            model = Qwen3_5ForConditionalGeneration(config)
        else:
            model = Qwen3_5ForCausalLM(text)
    else:
        raise ValueError(f"unknown arch {arch!r}")
    _randomize_norms(model, seed)
    model.eval().save_pretrained(str(out), safe_serialization=True)
    return out


QWEN_VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


# Vision towers of the multimodal checkpoints, by text shape. "tiny" is for tests.
QWEN_VISION_SHAPES = {
    "tiny": dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2),
    "mini": dict(depth=2, hidden_size=128, intermediate_size=512, num_heads=4),
    "small": dict(depth=4, hidden_size=256, intermediate_size=1024, num_heads=4),
    "medium": dict(depth=6, hidden_size=256, intermediate_size=1024, num_heads=4),
}


def build_random_qwen_vl(out_dir: str | os.PathLike, corpus: Iterable[str], seed: int = 0,
                         vocab_size: int = 1000, shape: str = "tiny") -> Path:
    """A random-weight multimodal Qwen3.5 (``Qwen3_5ForConditionalGeneration``) checkpoint
    for image+text prompts: a BPE tokenizer that also carries the vision special tokens
    (``<|vision_start|>``, ``<|vision_end|>``, ``<|image_pad|>``, ``<|video_pad|>``), the config's
    image/video/vision start/end token ids set to them, and a ``preprocessor_config.json``
    consistent with the vision config (Qwen3-VL/Qwen3.5 processor fields).

    ``shape`` names the language model's dimensions (``QWEN_SHAPES``) and the vision tower's
    (``QWEN_VISION_SHAPES``); "tiny" is the test checkpoint. The text rotary uses
    ``partial_rotary_factor=0.5`` and an interleaved ``mrope_section`` that splits the rotary
    frequency pairs (``head_dim / 4`` of them) over t/h/w: ``[2, 1, 1]`` for tiny's head_dim 16,
    ``[6, 5, 5]`` for head_dim 64, so each position row drives some frequencies."""
    import torch
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3_5TextConfig

    out = Path(out_dir)
    tokenizer = train_bpe_tokenizer(out, corpus, vocab_size=vocab_size)
    tokenizer.add_tokens(QWEN_VISION_TOKENS, special_tokens=True)
    tokenizer.save_pretrained(str(out))
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_VISION_TOKENS}
    dims = dict(QWEN_SHAPES[shape])
    n = dims["num_hidden_layers"]
    layer_types = ["linear_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    pairs = int(dims["head_dim"] * 0.5) // 2  # rotary frequency pairs: sum of mrope_section
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "mrope_section": [pairs - 2 * (pairs // 3), pairs // 3, pairs // 3],
            "mrope_interleaved": True}
    text = Qwen3_5TextConfig(vocab_size=len(tokenizer), tie_word_embeddings=False,
                             layer_types=layer_types, rope_parameters=rope, **dims)
    patch, merge, temporal = 14, 2, 2
    vision = dict(**QWEN_VISION_SHAPES[shape],
                  out_hidden_size=dims["hidden_size"], patch_size=patch,
                  temporal_patch_size=temporal, spatial_merge_size=merge)
    config = Qwen3_5Config(text_config=text.to_dict(), vision_config=vision, tie_word_embeddings=False,
                           image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                           vision_start_token_id=ids["<|vision_start|>"],
                           vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(config)
    _randomize_norms(model, seed)
    model.eval().save_pretrained(str(out), safe_serialization=True)
    factor = patch * merge
    preprocessor = {
        "image_processor_type": "Qwen2VLImageProcessorFast",
        "patch_size": patch, "merge_size": merge, "temporal_patch_size": temporal,
        "size": {"shortest_edge": 4 * factor * factor, "longest_edge": 64 * factor * factor},
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "rescale_factor": 1 / 255, "do_rescale": True, "do_normalize": True, "do_resize": True,
        "do_convert_rgb": True, "resample": 3,
    }
    (out / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
    return out
