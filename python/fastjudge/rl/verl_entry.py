"""A file for verl's ``custom_reward_function.path``, for every verl release.

verl runs a file path standalone, as a module of its own outside any package
(``importlib.util.spec_from_file_location``); before v0.7.0 that is the only way it loads a
reward function. This file's imports are absolute, so it loads there, and it gives the same
functions as ``pkg://fastjudge.rl``. ``python -m fastjudge.rl.verl_entry`` prints its path::

    python -m verl.trainer.main_ppo ... \\
        custom_reward_function.path=$(python -m fastjudge.rl.verl_entry) \\
        custom_reward_function.name=compute_score
"""

import os

from fastjudge.rl.verl import compute_score, compute_score_async, compute_score_batch, compute_score_float

__all__ = ["compute_score", "compute_score_async", "compute_score_batch", "compute_score_float"]

if __name__ == "__main__":
    print(os.path.abspath(__file__))
