"""The Qwen language model's layers as modules, built from a checkpoint's state: projections
fused where they read the same input, norms in float32, FP8 projections kept as
:class:`fp8.Fp8Weight` modules. The computation is ``qwen_model``'s."""

from __future__ import annotations

import torch

from .fp8 import Fp8Weight, fuse, projection_weight
from .loading import CheckpointError, check_shapes
from .qwen_shape import QwenShape


def _weight(value) -> torch.nn.Module | torch.nn.Parameter:
    """A projection weight as a module member: a plain tensor as a frozen parameter, an FP8
    weight (itself a module holding its scales) as it is."""
    return value if isinstance(value, Fp8Weight) else torch.nn.Parameter(value, requires_grad=False)


class QwenLayer(torch.nn.Module):
    """What every decoder layer has: its two RMSNorm scales (float32, as transformers computes
    norms) and the gated MLP (gate and up projections fused)."""

    def __init__(self, kind: str, in_norm, post_norm, gate_up, down):
        super().__init__()
        self.kind = kind
        self.register_buffer("in_norm", in_norm)
        self.register_buffer("post_norm", post_norm)
        self.gate_up = _weight(gate_up)
        self.down = _weight(down)


class AttentionLayer(QwenLayer):
    """A full (gated, for Qwen3.5) attention layer: q, fused k/v, o and the q/k norms."""

    def __init__(self, q, kv, o, q_norm, k_norm, **common):
        super().__init__("full_attention", **common)
        self.q, self.kv, self.o = _weight(q), _weight(kv), _weight(o)
        self.register_buffer("q_norm", q_norm)
        self.register_buffer("k_norm", k_norm)


class DeltaNetLayer(QwenLayer):
    """A Gated DeltaNet layer: fused input projections (qkv, z, b, a), the causal conv, the decay
    parameters and the gated output norm."""

    def __init__(self, in_proj, conv, dt_bias, neg_A, gated_norm, out, **common):
        super().__init__("linear_attention", **common)
        self.in_proj, self.out = _weight(in_proj), _weight(out)
        self.conv = torch.nn.Parameter(conv, requires_grad=False)
        self.register_buffer("dt_bias", dt_bias)
        self.register_buffer("neg_A", neg_A)
        self.register_buffer("gated_norm", gated_norm)


def build_layers(state: dict[str, torch.Tensor], shape: QwenShape, device, dtype):
    """The language model's tensors from a checkpoint state, projections fused where they read
    the same input: (embed, lm_head or None when tied, final norm, layers). A state with FP8
    weights (``load_state_dict(keep_fp8=True)``) gives :class:`fp8.Fp8Weight` projections, run
    as FP8 GEMMs; every other tensor is dequantized."""
    prefix = "model.language_model." if any(k.startswith("model.language_model.") for k in state) \
        else "model."
    check_shapes(state, shape.tensor_shapes(prefix))

    def take(name: str, full: bool = False) -> torch.Tensor:
        w = dense(name, full)
        return w.dequantize(dtype) if isinstance(w, Fp8Weight) else w

    def dense(name: str, full: bool = False):
        key = name if full else prefix + name
        if key not in state:
            raise CheckpointError(f"checkpoint lacks tensor {key!r}")
        return projection_weight(state, key, device, dtype)

    def fused(*names: str):
        return fuse([dense(n) for n in names], dtype)

    def norm(name: str) -> torch.Tensor:
        # Kept in float32: norms are computed in float32 as transformers does. Qwen3.5's
        # norms are zero-centred (scale = 1 + w).
        w = state[prefix + name].to(device=device, dtype=torch.float32)
        return 1.0 + w if shape.hybrid else w

    embed = take("embed_tokens.weight")
    lm_head = take("lm_head.weight", full=True) if "lm_head.weight" in state else None
    layers = []
    for i, kind in enumerate(shape.layer_types):
        p = f"layers.{i}."
        common = dict(in_norm=norm(p + "input_layernorm.weight"),
                      post_norm=norm(p + "post_attention_layernorm.weight"),
                      gate_up=fused(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                      down=dense(p + "mlp.down_proj.weight"))
        if kind == "full_attention":
            a = p + "self_attn."
            layers.append(AttentionLayer(q=dense(a + "q_proj.weight"),
                                         kv=fused(a + "k_proj.weight", a + "v_proj.weight"),
                                         o=dense(a + "o_proj.weight"), q_norm=norm(a + "q_norm.weight"),
                                         k_norm=norm(a + "k_norm.weight"), **common))
        elif kind == "linear_attention":
            a = p + "linear_attn."
            layers.append(DeltaNetLayer(
                in_proj=fused(*(a + f"in_proj_{n}.weight" for n in ("qkv", "z", "b", "a"))),
                conv=take(a + "conv1d.weight"), dt_bias=take(a + "dt_bias"),
                neg_A=-state[prefix + a + "A_log"].to(device=device, dtype=torch.float32).exp(),
                gated_norm=state[prefix + a + "norm.weight"].to(device=device, dtype=dtype),
                out=dense(a + "out_proj.weight"), **common))
        else:
            raise CheckpointError(f"unsupported layer type {kind!r}")
    return embed, lm_head, norm("norm.weight"), layers
