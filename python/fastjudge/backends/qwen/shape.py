"""The shape of a Qwen3.5 (hybrid) or Qwen3 (dense) language model: read from its config.json,
checked for values no model can have, and the tensor shapes it implies (checked against the
weights at load)."""

from __future__ import annotations

from dataclasses import dataclass

from ..loading import CheckpointError, require_ints, require_positive, shape_from_config


@dataclass(frozen=True)
class QwenShape:
    arch: str
    vocab_size: int
    hidden: int
    num_layers: int
    heads: int
    kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    eps: float
    layer_types: tuple[str, ...]
    hybrid: bool  # Qwen3.5: zero-centred norms, gated attention output, DeltaNet layers
    max_positions: int
    lin_k_heads: int = 0
    lin_v_heads: int = 0
    lin_k_dim: int = 0
    lin_v_dim: int = 0
    conv_kernel: int = 0
    # M-RoPE (multimodal Qwen3.5): rotary frequency pairs taken from the t/h/w position rows,
    # interleaved (transformers' default when the config names none)
    mrope_section: tuple[int, ...] = (11, 11, 10)

    @classmethod
    def from_config(cls, cfg: dict) -> "QwenShape":
        """The shape config.json declares; CheckpointError for a missing or impossible value."""
        return shape_from_config(cls, cfg)

    @classmethod
    def _read(cls, cfg: dict) -> "QwenShape":
        model_type = cfg.get("model_type")
        text = cfg.get("text_config", cfg) if model_type == "qwen3_5" else cfg
        hybrid = model_type in ("qwen3_5", "qwen3_5_text")
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        # checked before they are used: a zero divides, a huge layer count fills memory
        require_ints({"hidden_size": text["hidden_size"], "num_attention_heads": text["num_attention_heads"],
                      "num_hidden_layers": text["num_hidden_layers"]})
        head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
        partial = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0))
        if rope.get("rope_type", "default") not in ("default",) and not rope.get("mrope_section"):
            raise CheckpointError(f"rope type {rope.get('rope_type')!r} is not supported")
        n = text["num_hidden_layers"]
        layer_types = tuple(text.get("layer_types") or ["full_attention"] * n)
        return cls(
            arch=model_type, vocab_size=text["vocab_size"], hidden=text["hidden_size"],
            num_layers=n, heads=text["num_attention_heads"], kv_heads=text["num_key_value_heads"],
            head_dim=head_dim, rotary_dim=int(head_dim * partial),
            rope_theta=rope.get("rope_theta", text.get("rope_theta", 10000.0)),
            eps=text.get("rms_norm_eps", 1e-6), layer_types=layer_types, hybrid=hybrid,
            max_positions=text.get("max_position_embeddings", 32768),
            lin_k_heads=text.get("linear_num_key_heads", 0),
            lin_v_heads=text.get("linear_num_value_heads", 0),
            lin_k_dim=text.get("linear_key_head_dim", 0),
            lin_v_dim=text.get("linear_value_head_dim", 0),
            conv_kernel=text.get("linear_conv_kernel_dim", 0),
            mrope_section=tuple(rope.get("mrope_section") or (11, 11, 10)),
        )

    def _validate(self) -> None:
        require_ints({"vocab_size": self.vocab_size, "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim,
                      "max_position_embeddings": self.max_positions})
        if self.heads % self.kv_heads:
            raise CheckpointError("config.json: num_attention_heads must be a multiple of "
                                  "num_key_value_heads")
        if not (2 <= self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise CheckpointError(f"config.json: the rotary dimension (head_dim x "
                                  f"partial_rotary_factor) is {self.rotary_dim}; it must be even, "
                                  f"from 2 to head_dim ({self.head_dim})")
        require_positive({"rope_theta": self.rope_theta, "rms_norm_eps": self.eps})
        if len(self.layer_types) != self.num_layers:
            raise CheckpointError(f"config.json: layer_types lists {len(self.layer_types)} layers, "
                                  f"num_hidden_layers is {self.num_layers}")
        if "linear_attention" in self.layer_types:
            require_ints({"linear_num_key_heads": self.lin_k_heads,
                          "linear_num_value_heads": self.lin_v_heads,
                          "linear_key_head_dim": self.lin_k_dim, "linear_value_head_dim": self.lin_v_dim})
            # the causal conv keeps its last kernel - 1 inputs as state
            require_ints({"linear_conv_kernel_dim": self.conv_kernel}, minimum=2, maximum=1024)

    def tensor_shapes(self, prefix: str) -> dict[str, tuple]:
        """The shape this config implies for each language-model tensor (names under
        ``prefix``; ``None``: a size it leaves open)."""
        d, hd = self.hidden, self.head_dim
        shapes: dict[str, tuple] = {f"{prefix}embed_tokens.weight": (self.vocab_size, d),
                                    "lm_head.weight": (self.vocab_size, d), f"{prefix}norm.weight": (d,)}
        key_dim, val_dim, lin_v = self.lin_k_heads * self.lin_k_dim, self.lin_v_heads * self.lin_v_dim, self.lin_v_heads
        for i, kind in enumerate(self.layer_types):
            p = f"{prefix}layers.{i}."
            shapes.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                           p + "mlp.gate_proj.weight": (None, d), p + "mlp.up_proj.weight": (None, d),
                           p + "mlp.down_proj.weight": (d, None)})
            if kind == "full_attention":
                a = p + "self_attn."
                shapes.update({a + "q_proj.weight": (self.heads * hd * (2 if self.hybrid else 1), d),
                               a + "k_proj.weight": (self.kv_heads * hd, d),
                               a + "v_proj.weight": (self.kv_heads * hd, d),
                               a + "o_proj.weight": (d, self.heads * hd),
                               a + "q_norm.weight": (hd,), a + "k_norm.weight": (hd,)})
            elif kind == "linear_attention":
                a = p + "linear_attn."
                shapes.update({a + "in_proj_qkv.weight": (2 * key_dim + val_dim, d),
                               a + "in_proj_z.weight": (val_dim, d), a + "in_proj_b.weight": (lin_v, d),
                               a + "in_proj_a.weight": (lin_v, d),
                               a + "conv1d.weight": (2 * key_dim + val_dim, 1, self.conv_kernel),
                               a + "dt_bias": (lin_v,), a + "A_log": (lin_v,),
                               a + "norm.weight": (self.lin_v_dim,), a + "out_proj.weight": (d, val_dim)})
        return shapes
