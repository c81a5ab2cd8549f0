"""The shape of a T5 v1.1 / Flan-T5 checkpoint: read from its config.json, checked for values no
model can have, and the tensor shapes it implies (checked against the weights at load)."""

from __future__ import annotations

from dataclasses import dataclass

from ..loading import CheckpointError, require_ints, require_positive, shape_from_config


@dataclass(frozen=True)
class T5Shape:
    vocab_size: int
    d_model: int
    d_kv: int
    num_heads: int
    num_layers: int
    num_decoder_layers: int
    num_buckets: int
    max_distance: int
    eps: float
    gated: bool
    act: str
    scale_decoder_outputs: bool
    decoder_start_token_id: int
    eos_token_id: int

    @property
    def head_scale(self) -> float:
        """What the final norm's output is multiplied by before the LM head."""
        return self.d_model ** -0.5 if self.scale_decoder_outputs else 1.0

    @classmethod
    def from_config(cls, cfg: dict) -> "T5Shape":
        """The shape config.json declares; CheckpointError for a missing or impossible value."""
        return shape_from_config(cls, cfg)

    @classmethod
    def _read(cls, cfg: dict) -> "T5Shape":
        ff = cfg.get("feed_forward_proj", "relu")
        gated = ff.startswith("gated-")
        act = cfg.get("dense_act_fn") or (ff.split("-", 1)[1] if gated else ff)
        if gated and act == "gelu":
            act = "gelu_new"  # transformers maps "gated-gelu" to the tanh approximation
        return cls(
            vocab_size=cfg["vocab_size"],
            d_model=cfg["d_model"],
            d_kv=cfg["d_kv"],
            num_heads=cfg["num_heads"],
            num_layers=cfg["num_layers"],
            num_decoder_layers=cfg.get("num_decoder_layers") or cfg["num_layers"],
            num_buckets=cfg.get("relative_attention_num_buckets", 32),
            max_distance=cfg.get("relative_attention_max_distance", 128),
            eps=cfg.get("layer_norm_epsilon", 1e-6),
            gated=gated,
            act=act,
            # Original T5 (tied head) rescales decoder outputs by d_model**-0.5; T5 v1.1 and
            # Flan-T5 (tie_word_embeddings=False, separate lm_head) do not.
            scale_decoder_outputs=cfg.get("scale_decoder_outputs",
                                          cfg.get("tie_word_embeddings", True) is not False),
            decoder_start_token_id=cfg.get("decoder_start_token_id", cfg.get("pad_token_id", 0)) or 0,
            eos_token_id=cfg.get("eos_token_id", 1),
        )

    def _validate(self) -> None:
        require_ints({"vocab_size": self.vocab_size, "d_model": self.d_model, "d_kv": self.d_kv,
                      "num_heads": self.num_heads, "num_layers": self.num_layers,
                      "num_decoder_layers": self.num_decoder_layers,
                      "relative_attention_max_distance": self.max_distance})
        # the bidirectional buckets are halved, then split in exact and log-spaced halves
        require_ints({"relative_attention_num_buckets": self.num_buckets}, minimum=4)
        if self.max_distance <= self.num_buckets // 2:
            raise CheckpointError("config.json: relative_attention_max_distance must exceed half "
                                  "of relative_attention_num_buckets")
        require_ints({"decoder_start_token_id": self.decoder_start_token_id,
                      "eos_token_id": self.eos_token_id}, minimum=0, maximum=self.vocab_size - 1)
        require_positive({"layer_norm_epsilon": self.eps})

    def tensor_shapes(self) -> dict[str, tuple]:
        """The shape this config implies for each tensor (``None``: a size it leaves open)."""
        d, inner, h = self.d_model, self.num_heads * self.d_kv, self.num_heads
        shapes: dict[str, tuple] = {"shared.weight": (self.vocab_size, d),
                                    "lm_head.weight": (self.vocab_size, d)}
        for stack, n in (("encoder", self.num_layers), ("decoder", self.num_decoder_layers)):
            shapes[f"{stack}.final_layer_norm.weight"] = (d,)
            shapes[f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"] = (self.num_buckets, h)
            attention = ("SelfAttention", "EncDecAttention") if stack == "decoder" else ("SelfAttention",)
            for i in range(n):
                block = f"{stack}.block.{i}.layer"
                for j, kind in enumerate(attention):
                    shapes.update({f"{block}.{j}.{kind}.{p}.weight": (inner, d) for p in "qkv"})
                    shapes[f"{block}.{j}.{kind}.o.weight"] = (d, inner)
                ff = f"{block}.{len(attention)}.DenseReluDense"
                shapes.update({f"{ff}.{w}.weight": (None, d) for w in ("wi", "wi_0", "wi_1")})
                shapes[f"{ff}.wo.weight"] = (d, None)
                shapes.update({f"{block}.{j}.layer_norm.weight": (d,) for j in range(len(attention) + 1)})
        return shapes
