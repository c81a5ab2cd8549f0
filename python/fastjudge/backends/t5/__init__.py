"""T5 v1.1 / Flan-T5 (encoder-decoder) in plain PyTorch.

Read in this order: ``shape`` (the config), ``model`` (weights, the packed encoder, the one
decoder forward over the state pool), ``decode`` (the pool and greedy decoding with early exit
and refill), ``backend`` (requests, encoder packs, score-only rows).
"""
