"""Builders of judges for TensorRT-LLM's LLM API, installed as ``fastjudge.builders``.

``fastjudge build flan-t5`` and ``fastjudge build qwen3.5`` (``cli.py``) quantize a judge
checkpoint to FP8 with NVIDIA ModelOpt on judge prompts (or keep it in BF16), write the
checkpoint the torch backend and TensorRT-LLM's LLM API load, the LLM-API options file, report
the judge's agreement with the source judge, and record everything in ``fastjudge-engine.json``.

Modules: ``calibration`` (prompts), ``quantize`` (ModelOpt), ``fp8_export`` (Hugging Face layout
checkpoints), ``llm_options`` (the options file), ``agreement`` (the report), ``manifest``,
``pipeline`` (the shared steps),
``flan_t5`` and ``qwen3_5`` (the two builds), ``vision_onnx`` (the Qwen3.5 vision tower), ``cli``.
"""

# Defaults shared by the command line and the modules (kept here so that building the
# argument parser imports nothing heavy).
DEFAULT_MIN_AGREEMENT = 0.98  # rating agreement below which a build warns loudly
DEFAULT_HELDOUT_FRACTION = 0.25  # calibration items held out for the agreement report
DEFAULT_ONNX_OPSET = 18
