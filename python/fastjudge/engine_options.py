"""How a judge's model runs, as one object: :class:`EngineOptions`.

Every judge takes its metric's own options plus ``engine=EngineOptions(...)``; the commands,
the reward server, the RL adapters and ``fastjudge bench`` build one from their command line or
settings and pass it through unchanged, and :func:`fastjudge.backends.load_backend` opens the
model from it. The command-line flag of each field is generated from its declaration below
(``fastjudge.judges.registry.ENGINE_OPTIONS``), so a new engine option is one field here.

This module imports nothing heavy: the commands parse their arguments without torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

BACKENDS = ("torch", "trtllm")
COMPILE_MODES = ("off", "on", "auto")
#: Default row cap per batch, its one home (the planner and scheduler read it). Large enough that
#: the token budget is the binding limit for typical judge prompts (300-1200 tokens under a
#: 16k-64k budget), small enough to bound per-batch state and logits memory when prompts are
#: very short.
DEFAULT_MAX_BATCH_SIZE = 64


def _flag(help: str, type: type = str, choices: tuple | None = None) -> dict:
    """A field's command-line declaration (read by the registry)."""
    return {"help": help, "type": type, "choices": choices}


@dataclass(frozen=True)
class EngineOptions:
    """The engine a judge runs on: backend, placement, precision, batching and limits.

    ``None`` leaves a choice to the backend (its documented default). Options a backend does
    not have are ignored by it: the trtllm backend takes its device, dtype and batching from
    its build; the T5 backend has no prefix cache or jump-forward decoding."""

    backend: str = field(default="torch", metadata=_flag(
        "torch (default) or trtllm (--model is then a `fastjudge build` output)", choices=BACKENDS))
    device: str = field(default="auto", metadata=_flag("cpu, cuda, cuda:N or auto (default)"))
    dtype: Any = field(default=None, metadata=_flag(
        "float32 or bfloat16 (default: bfloat16 on CUDA and on CPUs with native bf16 support, "
        "else float32; float32 is the precision faithfulness is tested in)"))
    compile: str = field(default="auto", metadata=_flag(
        "torch.compile the torch backends' decoding and score-only steps (CUDA graphs on CUDA): "
        "off, on, or auto (default: on for CUDA, off on the CPU, where compiled steps were "
        "measured slower; docs/engine.md)", choices=COMPILE_MODES))
    max_batch_tokens: int | None = field(default=None, metadata=_flag(
        "token budget of one batch (default: the backend's)", int))
    max_batch_size: int = field(default=DEFAULT_MAX_BATCH_SIZE, metadata=_flag(
        "most requests in one batch (%(default)s)", int))
    max_decode_rows: int | None = field(default=None, metadata=_flag(
        "most rows of a batch decoding at once, the others joining as rows finish (default: "
        "the backend's)", int))
    max_input_tokens: int | None = field(default=None, metadata=_flag(
        "longest prompt in tokens; a longer item gets an error (default: the backend's limit)",
        int))
    allow_pickle: bool = field(default=False, metadata=_flag(
        "allow pickle-based weights (*.bin); only for trusted checkpoints", bool))
    jump_forward: bool = field(default=True, metadata=_flag(
        "run grammar-forced tokens one decode step each instead of in one multi-token step "
        "(same outputs, slower; for comparisons)", bool))
    prefix_cache_bytes: int | None = field(default=None, metadata=_flag(
        "Qwen backend: memory for shared-prefix states (default 2 GiB)", int))
    decode_cache_bytes: int | None = field(default=None, metadata=_flag(
        "torch backends: memory of the state pool, allocated once (rows' K/V and DeltaNet states, "
        "T5 rows' encoder states; default 1 GiB on CPU, 16 GiB on CUDA)", int))
    fp8_gemm: bool | None = field(default=None, metadata=_flag(
        "FP8 checkpoints: run projections as FP8 GEMMs (default: on GPUs with FP8 tensor "
        "cores) or dequantize them at load (--no-fp8-gemm)", bool))
    gpu_memory_fraction: float | None = field(default=None, metadata=_flag(
        "trtllm backend: share of free GPU memory for the KV cache (default 0.85)", float))

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r}; available: {', '.join(BACKENDS)}")
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"compile must be one of {COMPILE_MODES}, got {self.compile!r}")
        for name in ("max_batch_tokens", "max_decode_rows", "max_input_tokens",
                     "prefix_cache_bytes", "decode_cache_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.gpu_memory_fraction is not None and not 0 < self.gpu_memory_fraction <= 1:
            raise ValueError(f"gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction}")

    @classmethod
    def from_args(cls, args) -> "EngineOptions":
        """From parsed command-line arguments; a field the command does not define keeps its
        default."""
        return cls(**{f.name: getattr(args, f.name, f.default) for f in fields(cls)})

    def with_(self, **changes) -> "EngineOptions":
        """A copy with ``changes`` (the object itself is frozen); itself when there are none."""
        return replace(self, **changes) if changes else self


def engine_fields():
    """The fields of :class:`EngineOptions` with their command-line declarations."""
    return fields(EngineOptions)
