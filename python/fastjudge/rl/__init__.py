"""Reward adapters for RL trainers.

* :mod:`.trl`: TRL reward functions (LAVE, VisExMEM, holistic), sync and ``async def``, with
  TRL's logging callables;
* :mod:`.verl`: verl ``compute_score`` functions (one item, async, batched; LAVE, VisExMEM,
  holistic) over one judge per process, loaded by verl as
  ``custom_reward_function.path=pkg://fastjudge.rl`` (v0.7.0 on) or by the path of the file
  ``fastjudge/rl/verl_entry.py`` (every release);
* :mod:`.verl_remote`: the same forms posting to one running ``fastjudge serve``, the judge
  shared by the whole job (``pkg://fastjudge.rl.verl_remote``);
* :mod:`.openrlhf_reward`: OpenRLHF's in-process ``reward_func(queries, prompts, labels)``;
* :mod:`.answers`: the answer of a completion (reasoning removed, empty answers refused);
* :mod:`.chat_markers`: a policy's chat-template markers, learned from its template;
* :mod:`.inputs`: trainer inputs (conversations, reference columns, images) as judge fields.
"""

from .inputs import references_of as _references  # noqa: F401 - the names before the split
from .inputs import text_of as _text  # noqa: F401
from .trl import (
                  holistic_reward_fn,
                  holistic_reward_fn_async,
                  lave_reward_fn,
                  lave_reward_fn_async,
                  visexmem_reward_fn,
                  visexmem_reward_fn_async,
)
from .verl import (
                  DEVICE_OPTION,
                  MODEL_OPTION,
                  compute_score,
                  compute_score_async,
                  compute_score_batch,
                  compute_score_float,
                  compute_score_holistic,
                  compute_score_holistic_async,
                  compute_score_visexmem,
                  compute_score_visexmem_async,
                  configure,
                  get_judge,
)

__all__ = ["lave_reward_fn", "visexmem_reward_fn", "holistic_reward_fn", "lave_reward_fn_async",
           "visexmem_reward_fn_async", "holistic_reward_fn_async", "compute_score",
           "compute_score_async", "compute_score_batch", "compute_score_float",
           "compute_score_visexmem", "compute_score_visexmem_async", "compute_score_holistic",
           "compute_score_holistic_async", "configure",
           "get_judge", "MODEL_OPTION", "DEVICE_OPTION"]
