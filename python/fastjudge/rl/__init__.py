"""Reward adapters for RL trainers.

* :mod:`.trl`: TRL reward functions (LAVE, VisExMEM, holistic), with TRL's logging callables;
* :mod:`.verl`: verl ``compute_score`` functions (one item, async, batched) over one judge per
  process, loaded by verl as ``custom_reward_function.path=pkg://fastjudge.rl``;
* :mod:`.inputs`: trainer inputs (conversations, reference columns, images) as judge fields.
"""

from .inputs import references_of as _references  # noqa: F401 - the names before the split
from .inputs import text_of as _text  # noqa: F401
from .trl import holistic_reward_fn, lave_reward_fn, visexmem_reward_fn
from .verl import (
    DEVICE_OPTION,
    MODEL_OPTION,
    compute_score,
    compute_score_async,
    compute_score_batch,
    compute_score_float,
    configure,
    get_judge,
)

__all__ = ["lave_reward_fn", "visexmem_reward_fn", "holistic_reward_fn", "compute_score",
           "compute_score_async", "compute_score_batch", "compute_score_float", "configure",
           "get_judge", "MODEL_OPTION", "DEVICE_OPTION"]
