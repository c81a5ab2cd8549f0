"""The trtllm backend's calls into TensorRT-LLM, checked against transcriptions of the upstream
signatures (TensorRT-LLM cannot be installed beside the CPU torch this suite runs on).

Upstream: NVIDIA/TensorRT-LLM ``tensorrt_llm/runtime/model_runner_cpp.py``,
``ModelRunnerCpp.generate``. Its named parameters are transcribed below; extra keyword arguments
land in ``**kwargs``, of which ``generate`` reads only the SamplingConfig attributes it lists
(``num_beams``, ``top_k``, ...) and a few speculative-decoding keys, silently dropping the rest,
so the fake refuses any other keyword: a misspelt or removed argument fails here instead of
being ignored on the GPU.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fastjudge.backends.trtllm import TrtllmBackend
from fastjudge.runtime.requests import Choice, Request, Text

# ModelRunnerCpp.generate: the SamplingConfig attributes it accepts through **kwargs
SAMPLING_KWARGS = {"num_beams", "top_k", "top_p", "top_p_min", "top_p_reset_ids", "top_p_decay",
                   "temperature", "min_tokens", "beam_search_diversity_rate", "repetition_penalty",
                   "presence_penalty", "frequency_penalty", "length_penalty", "early_stopping",
                   "no_repeat_ngram_size", "random_seed", "num_return_sequences", "min_p",
                   "beam_width_array"}


class FakeModelRunnerCpp:
    """``ModelRunnerCpp.generate``'s parameter list (model_runner_cpp.py), answering like the
    real runner: ``sequence_lengths`` is in the result only when ``output_sequence_lengths``."""

    def __init__(self, vocab: int, answer: list[int]):
        self.vocab, self.answer, self.calls = vocab, answer, []

    def generate(self, batch_input_ids, position_ids=None, encoder_input_ids=None,
                 encoder_input_features=None, encoder_output_lengths=None, cross_attention_masks=None,
                 mrope_params=None, sampling_config=None, lora_uids=None, lookahead_config=None,
                 streaming=False, stopping_criteria=None, logits_processor_names=None, max_new_tokens=1,
                 end_id=None, pad_id=None, bad_words_list=None, stop_words_list=None, return_dict=False,
                 output_sequence_lengths=False, output_generation_logits=False, output_log_probs=False,
                 output_cum_log_probs=False, prompt_table=None, prompt_tasks=None,
                 input_token_extra_ids=None, return_all_generated_tokens=False,
                 language_adapter_uids=None, mm_embedding_offloading=False, **kwargs):
        unknown = set(kwargs) - SAMPLING_KWARGS
        if unknown:
            raise TypeError(f"ModelRunnerCpp.generate would ignore {sorted(unknown)}")
        self.calls.append(dict(kwargs, max_new_tokens=max_new_tokens, return_dict=return_dict,
                               output_sequence_lengths=output_sequence_lengths,
                               output_generation_logits=output_generation_logits))
        rows = len(batch_input_ids)
        out_ids, lengths = [], []
        for ids in batch_input_ids:
            seq = ids.tolist() + self.answer[:max_new_tokens]
            width = len(ids) + max_new_tokens
            out_ids.append([seq + [end_id] * (width - len(seq))])
            lengths.append([len(seq)])
        logits = torch.zeros(rows, 1, max_new_tokens, self.vocab)
        for step, tok in enumerate(self.answer[:max_new_tokens]):
            logits[:, 0, step, tok] = 5.0
        out = {"output_ids": torch.tensor(out_ids), "generation_logits": logits if output_generation_logits else None}
        if output_sequence_lengths:
            out["sequence_lengths"] = torch.tensor(lengths)
        return out if return_dict else out["output_ids"]


def _t5_backend(runner):
    return SimpleNamespace(_runner=runner, decoder_start_token_id=0, eos_token_ids={1}, pad_token_id=0)


def test_fake_mirrors_upstream_parameter_names():
    """The fake's named parameters are exactly those of ModelRunnerCpp.generate
    (tensorrt_llm/runtime/model_runner_cpp.py) after ``self``."""
    params = [p for p in inspect.signature(FakeModelRunnerCpp.generate).parameters if p not in ("self", "kwargs")]
    assert params[:3] == ["batch_input_ids", "position_ids", "encoder_input_ids"]
    assert {"output_sequence_lengths", "output_generation_logits", "return_dict"} <= set(params)


def test_t5_text_reads_sequence_lengths_it_asked_for():
    """ModelRunnerCpp.generate returns ``sequence_lengths`` only with output_sequence_lengths=True;
    the T5 text path asks for it, and decodes up to it."""
    runner = FakeModelRunnerCpp(vocab=12, answer=[7, 8, 1])
    reqs = [Request(index=0, prompt_ids=[3, 4, 5], spec=Text(max_new_tokens=4)),
            Request(index=1, prompt_ids=[6], spec=Text(max_new_tokens=4))]
    outs = TrtllmBackend._run_t5(_t5_backend(runner), reqs)
    assert runner.calls[0]["output_sequence_lengths"] is True
    assert [o.token_ids for o in outs] == [[7, 8], [7, 8]]
    assert all(o.finished for o in outs)


def test_t5_choice_call_is_accepted_upstream():
    """A Choice batch's call passes only parameters ModelRunnerCpp.generate has."""
    runner = FakeModelRunnerCpp(vocab=12, answer=[9])
    request = Request(index=0, prompt_ids=[3], spec=Choice(token_ids=(9, 10)))
    outs = TrtllmBackend._run_t5(_t5_backend(runner), [request])
    assert runner.calls[0]["max_new_tokens"] == 1
    assert np.argmax(outs[0].probs) == 0


def test_fake_refuses_an_argument_upstream_lacks():
    """The contract can fail: a keyword outside the upstream signature raises."""
    with pytest.raises(TypeError):
        FakeModelRunnerCpp(4, [1]).generate([torch.tensor([1])], output_sequence_length=True)
