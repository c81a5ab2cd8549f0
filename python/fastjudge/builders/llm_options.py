"""The LLM-API options file of a build: what ``tensorrt_llm.LLM`` is given beside the checkpoint.

Written as JSON text to ``OUT/llm_api_options.yaml`` (JSON is YAML, so ``trtllm-serve
OUT/checkpoint --config OUT/llm_api_options.yaml`` reads it too); ``backends/trtllm.py`` passes
it to ``LLM(**options)``. Every name is a field of ``TorchLlmArgs`` or of its nested configs in
NVIDIA/TensorRT-LLM ``tensorrt_llm/llmapi/llm_args.py`` (v1.3.0rc22 to v1.4.0rc1;
``tests/fixtures/trtllm_llm_args.json`` transcribes the names this file may use):

* sizes from the judge's prompt lengths: ``max_input_len`` (the longest calibration or held-out
  prompt plus headroom; for T5 the encoder input, which also sizes the cross-attention pool),
  ``max_seq_len`` (input plus the tokens the judge generates), ``max_batch_size`` and
  ``max_num_tokens`` (a batch's token budget, never below one whole prompt: T5's encoder input
  is not chunked);
* ``cuda_graph_config``: decode-step CUDA graphs for powers of two up to ``max_batch_size``,
  batches padded up to the next one;
* ``torch_compile_config`` only when asked for (``torch_compile=True``; ``fastjudge build
  --torch-compile``): torch.compile of the model with full graphs, no inductor and no piecewise
  CUDA graphs. Off by default: upstream's encoder-decoder examples never set it
  (``docs/source/models/encoder-decoder.md``) and its support table does not list torch.compile
  for the hybrid Qwen3.5 rows (``docs/source/models/supported-models.md``), so the default is
  the configuration upstream runs;
* ``kv_cache_config``: the share of free GPU memory for the KV cache; block reuse only where the
  release supports it (not for T5, whose requests share no decoder prefix, nor for Qwen3.5, listed
  without KV-cache reuse in ``docs/source/models/supported-models.md``); for T5
  ``cross_kv_cache_fraction``, the cross-attention pool's share, sized from the judge's token
  budgets: every request holds ``max_input_len`` encoder tokens in the cross pool and its
  decoder tokens in the self pool, block-rounded;
* T5: ``attn_backend="TRTLLM"`` (the backend that applies T5's relative attention bias),
  ``enable_chunked_prefill=False``, encoder CUDA graphs (``encoder_cuda_graph_config``,
  ``encoder_max_batch_size``; releases before them run the encoder eagerly). The encoder graph
  config carries both token-count buckets (``num_tokens``) and sequence-length buckets
  (``seq_lens``): the releases that read it build token-mode encoder graphs only when both are
  given, and refuse an encoder-decoder model whose config lacks them at ``LLM()``
  (``tensorrt_llm/_torch/pyexecutor/engine/runners/encoder.py``, ``EncoderConfigMixin.create``
  calling ``validate_token_encoder_bucket_config``); Qwen:
  ``guided_decoding_backend="xgrammar"`` for VisExMEM's JSON stages.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from fastjudge.backends.trtllm import OPTIONS_FILE

DEFAULT_KV_CACHE_FRACTION = 0.85  # of the GPU memory free after the model loads
TOKENS_PER_BLOCK = 32  # KvCacheConfig.tokens_per_block's default: pools are allocated in blocks
MAX_BATCH_TOKENS = 16384  # a batch's token budget, unless one prompt alone needs more


def _blocks(tokens: int) -> int:
    return TOKENS_PER_BLOCK * math.ceil(tokens / TOKENS_PER_BLOCK)


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    sizes = [1 << i for i in range(max_batch_size.bit_length()) if 1 << i <= max_batch_size]
    return sizes if sizes[-1] == max_batch_size else sizes + [max_batch_size]


def cross_kv_fraction(max_input_len: int, decoder_len: int) -> float:
    """The cross-attention pool's share of the KV cache when every request holds its whole
    encoder input there and its decoder tokens in the self-attention pool (same layers, heads and
    head size in both, so tokens weigh alike), each rounded up to whole blocks."""
    cross, own = _blocks(max_input_len), _blocks(decoder_len)
    return round(cross / (cross + own), 4)


def limits(max_input_len: int, max_new_tokens: int, max_batch_size: int, longest_prompt: int,
           decoder_prefix: int = 0) -> dict:
    """``decoder_prefix``: T5 decoder tokens before the generated ones (the start token)."""
    return {"max_input_len": max_input_len, "max_batch_size": max_batch_size,
            "max_new_tokens": max_new_tokens, "max_seq_len": max_input_len + decoder_prefix + max_new_tokens,
            "max_num_tokens": max(max_input_len, min(max_batch_size * max_input_len, MAX_BATCH_TOKENS)),
            "longest_calibration_prompt": longest_prompt}


def llm_options(kind: str, model_type: str | None, lim: dict,
                kv_cache_fraction: float = DEFAULT_KV_CACHE_FRACTION, torch_compile: bool = False) -> dict:
    """The options of a ``kind`` judge ("flan-t5" or "qwen3.5") with limits ``lim``
    (:func:`limits`); ``torch_compile``: add ``torch_compile_config`` (off by default, see the
    module docstring)."""
    encoder_decoder = kind == "flan-t5"
    batch = graph_batch_sizes(lim["max_batch_size"])
    reuse = not encoder_decoder and "qwen3_5" not in (model_type or "")
    kv = {"free_gpu_memory_fraction": kv_cache_fraction, "enable_block_reuse": reuse}
    options = {
        "max_batch_size": lim["max_batch_size"], "max_num_tokens": lim["max_num_tokens"],
        "max_input_len": lim["max_input_len"], "max_seq_len": lim["max_seq_len"], "max_beam_width": 1,
        "attn_backend": "TRTLLM",
        "cuda_graph_config": {"batch_sizes": batch, "enable_padding": True},
        "kv_cache_config": kv,
    }
    if torch_compile:
        options["torch_compile_config"] = {"enable_fullgraph": True, "enable_inductor": False,
                                           "enable_piecewise_cuda_graph": False}
    if encoder_decoder:
        kv["cross_kv_cache_fraction"] = cross_kv_fraction(lim["max_input_len"],
                                                          lim["max_seq_len"] - lim["max_input_len"])
        options["enable_chunked_prefill"] = False
        options["encoder_max_batch_size"] = lim["max_batch_size"]
        options["encoder_cuda_graph_config"] = {
            "batch_sizes": batch, "num_tokens": token_buckets(lim["max_num_tokens"]),
            "seq_lens": _seq_buckets(lim["max_input_len"]), "enable_padding": True}
    else:
        options["guided_decoding_backend"] = "xgrammar"
    return options


def token_buckets(max_num_tokens: int) -> list[int]:
    """Encoder graph token counts (a packed batch's total tokens): powers of two from 64, then
    ``max_num_tokens`` (a packed batch is padded up to the next; buckets above the batch token
    budget would be dropped by the release)."""
    return _seq_buckets(max_num_tokens)


def _seq_buckets(max_input_len: int) -> list[int]:
    """Encoder graph lengths: powers of two from 64, then ``max_input_len`` (inputs are padded
    up to the next)."""
    out = [n for n in (64 << i for i in range(16)) if n < max_input_len]
    return out + [max_input_len]


def write_llm_options(out_dir: str | os.PathLike, options: dict) -> Path:
    path = Path(out_dir) / OPTIONS_FILE
    path.write_text(json.dumps(options, indent=2) + "\n")
    return path
