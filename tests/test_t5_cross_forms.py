"""The T5 decoder's two exact forms of cross-attention in greedy decoding: reassociated over the
encoder states, and per head over K/V projected once per row (``backends.t5.decode``'s choice,
``projection_pays``). Each against transformers' greedy ``generate`` on one padded batch
(transformers v5.25.0 ``generation/utils.py``, ``GenerationMixin.generate`` with
``do_sample=False, num_beams=1``, whose cross-attention is ``models/t5/modeling_t5.py``,
``T5Attention.forward`` with ``key_value_states``: K/V projected from the encoder states at the
first step and read from the cache at every later one): the same tokens, the same end and the
same logits at the tracked ids, on rows that end at varied lengths (rows leave and others join
the pool); and the two forms against each other within float32 rounding."""

from __future__ import annotations

import numpy as np
import pytest
from test_t5_decode import MAX_NEW, SHORT, padded, prompts, rating_ids, run_text, varied  # noqa: F401

from fastjudge.backends.t5.backend import TorchT5Backend
from fastjudge.backends.t5.decode import projection_pays
from fastjudge.backends.t5.model import T5Model


def spy_projections(monkeypatch) -> list[int]:
    """The token count of every ``T5Model.project_cross`` call from now on."""
    calls = []
    project = T5Model.project_cross

    def logged(self, enc):
        calls.append(enc.shape[0])
        return project(self, enc)

    monkeypatch.setattr(T5Model, "project_cross", logged)
    return calls


@pytest.mark.parametrize("project", [True, False])
@pytest.mark.parametrize("rows", [2, 12])
def test_each_form_gives_generates_tokens(varied, prompts, padded, project, rows, monkeypatch):  # noqa: F811
    calls = spy_projections(monkeypatch)
    backend = TorchT5Backend(varied, device="cpu", dtype="float32", max_decode_rows=rows)
    backend.project_cross = project
    track = rating_ids(backend.codec)
    outs = run_text(backend, prompts, track=track)
    # every prompt token projected once in the projected form, none in the reassociated one
    assert sum(calls) == (sum(len(backend.codec.encode_prompt(p)) for p in prompts) if project else 0)
    assert (backend.pool.cross_slots >= rows) if project else backend.pool.cross_slots == 0
    for out, (ids, eos, logits) in zip(outs, padded):
        assert out.token_ids == ids
        assert out.finished == eos
        np.testing.assert_allclose(out.tracked_logits, logits[:, track].double().numpy(), rtol=1e-4, atol=1e-4)


def test_forms_agree_within_float32_rounding(varied, prompts):  # noqa: F811
    """The same steps in both forms: logits at a quarter of the vocabulary within 1e-5."""
    backend = TorchT5Backend(varied, device="cpu", dtype="float32", max_decode_rows=5)
    track = range(0, backend.shape.vocab_size, 4)
    runs = {}
    for project in (True, False):
        backend.project_cross = project
        runs[project] = run_text(backend, prompts, track=track)
    for a, b in zip(runs[True], runs[False]):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(a.tracked_logits, b.tracked_logits, rtol=0, atol=1e-5)


def test_the_budget_of_steps_picks_the_form(varied, prompts, monkeypatch):  # noqa: F811
    """By default the projection runs for a long budget and not for a short one (score-only
    rows, one step, never project), and a K/V pool that does not fit the state budget falls
    back to the reassociated form, with the same tokens."""
    backend = TorchT5Backend(varied, device="cpu", dtype="float32")
    shape = backend.shape
    assert not projection_pays(shape, 1) and not projection_pays(shape, SHORT) and projection_pays(shape, MAX_NEW)
    calls = spy_projections(monkeypatch)
    short = run_text(backend, prompts, max_new=SHORT)
    assert calls == [] and backend.pool.cross_slots == 0
    long = run_text(backend, prompts)
    assert calls and backend.pool.cross_slots > 0

    tight = TorchT5Backend(varied, device="cpu", dtype="float32", decode_cache_bytes=backend.pool.mem.nbytes)
    tight.project_cross = True
    calls.clear()
    assert [o.token_ids for o in run_text(tight, prompts)] == [o.token_ids for o in long]
    assert calls == [] and tight.pool.cross_slots == 0
    assert [o.token_ids for o in run_text(tight, prompts, max_new=SHORT)] == [o.token_ids for o in short]
