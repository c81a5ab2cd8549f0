"""Qwen3.5 (hybrid Gated DeltaNet + gated attention) and Qwen3 (dense) in plain PyTorch.

Read in this order: ``shape`` (the config), ``layers`` (attention and DeltaNet layers, each a
module with its own forward; the delta rule is ``gated_delta``), ``pool`` (every row's state,
allocated once, addressed by slot), ``model`` (the one forward and the compiled or eager step),
``decode`` (greedy decoding under grammars), ``backend`` (requests, prefix snapshots, images).
``vision`` is the vision tower, ``positions`` the image tokens and M-RoPE positions, ``caches``
the prefix-cache key and the image-embedding cache.
"""
