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
