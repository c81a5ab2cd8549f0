"""A file for verl's ``custom_reward_function.path``, for every verl release.

verl runs a file path standalone, as a module of its own outside any package
(``importlib.util.spec_from_file_location``); before v0.7.0 that is the only way it loads a
reward function. This file's imports are absolute, so it loads there, and it gives the same
functions as ``pkg://fastjudge.rl``, and those of ``pkg://fastjudge.rl.verl_remote`` (one
shared judge server) with ``remote_`` before their names. ``python -m fastjudge.rl.verl_entry`` prints its path::

    python -m verl.trainer.main_ppo ... \\
        custom_reward_function.path=$(python -m fastjudge.rl.verl_entry) \\
        custom_reward_function.name=compute_score
"""

import os

from fastjudge.rl import verl_remote as _remote
from fastjudge.rl.verl import (
    compute_score,
    compute_score_async,
    compute_score_batch,
    compute_score_float,
    compute_score_holistic,
    compute_score_holistic_async,
    compute_score_visexmem,
    compute_score_visexmem_async,
)

# the shared-judge forms of fastjudge.rl.verl_remote, each as remote_<form>
remote_compute_score = _remote.compute_score
remote_compute_score_async = _remote.compute_score_async
remote_compute_score_batch = _remote.compute_score_batch
remote_compute_score_visexmem = _remote.compute_score_visexmem
remote_compute_score_visexmem_async = _remote.compute_score_visexmem_async
remote_compute_score_holistic = _remote.compute_score_holistic
remote_compute_score_holistic_async = _remote.compute_score_holistic_async

__all__ = ["compute_score", "compute_score_async", "compute_score_batch", "compute_score_float",
           "compute_score_visexmem", "compute_score_visexmem_async", "compute_score_holistic",
           "compute_score_holistic_async", "remote_compute_score", "remote_compute_score_async",
           "remote_compute_score_batch", "remote_compute_score_visexmem",
           "remote_compute_score_visexmem_async", "remote_compute_score_holistic",
           "remote_compute_score_holistic_async"]

if __name__ == "__main__":
    print(os.path.abspath(__file__))
