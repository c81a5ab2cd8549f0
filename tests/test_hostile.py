"""Hostile and careless input: each case costs only its own item, or ends the command cleanly.

Decompression bombs and oversize images are item errors found from the image header; a text too
long for the token limit is an item error found before tokenizing; repeated ids follow one rule
in every job, the same whether or not the job was interrupted; a corrupt line inside an output
file costs only its own item; output to standard output, pipes and devices is streamed; and a
checkpoint that cannot be loaded is one line on stderr and exit status 2.

The bomb is what PIL's decompression-bomb check reads (``PIL/Image.py``,
``_decompression_bomb_check``: a warning above ``MAX_IMAGE_PIXELS`` = 89,478,485 pixels, a
``DecompressionBombError`` above twice that, raised by ``Image.open`` from the header alone):
a 65-byte PNG whose IHDR claims 14000 x 14000 pixels, with an empty IDAT.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
import zlib
from functools import partial
from pathlib import Path

import numpy as np
import pytest
from conftest import TEST_DEVICE, read_rows, write_lines

import fastjudge
from fastjudge.cli import main
from fastjudge.engine_options import EngineOptions

GOOD = {"question": "What color is the kite?", "references": ["red", "red", "orange"],
        "prediction": "red"}
CPU = ("--device", "cpu", "--dtype", "float32", "--no-progress")


def png_header(width: int, height: int) -> bytes:
    """A PNG that claims ``width`` x ``height`` pixels and holds none."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))


def png_bytes(seed: int, h: int = 48, w: int = 64) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    pixels = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


# -- images -----------------------------------------------------------------------------------
def test_bomb_and_oversize_images_are_image_errors(tmp_path):
    from fastjudge.io.images import ImageError, load_image

    bomb = tmp_path / "bomb.png"
    bomb.write_bytes(png_header(14000, 14000))
    for source in (str(bomb), bomb.read_bytes()):
        with pytest.raises(ImageError, match="refused as a decompression bomb: Image size "
                                             r"\(196000000 pixels\) exceeds limit"):
            load_image(source)
    # above the budget, below PIL's limit: refused from the header, never decoded
    from fastjudge.io.images import MAX_IMAGE_PIXELS

    with pytest.raises(ImageError) as big:
        load_image(png_header(9000, 9000))
    assert str(big.value) == (f"image is 9000x9000 = 81000000 pixels, above the pixel budget of "
                              f"{MAX_IMAGE_PIXELS} (max_image_pixels); not decoded")
    # the budget is the caller's, and holds for decoded arrays too
    small = np.zeros((40, 30, 3), dtype=np.uint8)
    assert load_image(small, max_pixels=1200).width == 30
    with pytest.raises(ImageError, match="30x40 = 1200 pixels, above the pixel budget of 1199"):
        load_image(small, max_pixels=1199)


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    from fastjudge.checkpoints import build_random_qwen_vl
    from fastjudge.demo import tokenizer_corpus

    return build_random_qwen_vl(tmp_path_factory.mktemp("hostile_vl"), tokenizer_corpus(), seed=5)


@pytest.fixture
def pairs(tmp_path):
    """A bomb, then a good pair, in one chunk."""
    (tmp_path / "bomb.png").write_bytes(png_header(14000, 14000))
    (tmp_path / "good.png").write_bytes(png_bytes(1))
    return write_lines(tmp_path / "pairs.jsonl", [
        json.dumps({"id": "bomb", "image": "bomb.png", "text": "A small boat on a lake."}),
        json.dumps({"id": "good", "image": "good.png", "text": "A small boat on a lake."})])


def test_bomb_is_one_error_row_in_visexmem_job(vl_dir, pairs, tmp_path, capsys):
    """The job finishes; the bomb's row is its error, the good pair of its chunk is scored."""
    out = tmp_path / "out.jsonl"
    argv = ["visexmem", "--model", str(vl_dir), "--input", str(pairs), "--output", str(out), *CPU,
            "--no-explain", "--max-claims", "2", "--max-claim-chars", "30"]
    assert main(argv) == 3  # exit 3: a row is an item error
    rows = {r["id"]: r for r in read_rows(out)}
    assert rows["bomb"]["error"].startswith(
        f"line 1: invalid example: {tmp_path / 'bomb.png'} refused as a decompression bomb: ")
    assert rows["bomb"]["score"] is None and rows["bomb"]["claims"] is None  # result fields null (docs/jobs.md)
    assert rows["good"]["error"] is None and rows["good"]["claims"] and 0 <= rows["good"]["score"] <= 1
    assert "2 items (0 already done), 1 errors" in capsys.readouterr().err


def test_pixel_budget_flag_and_holistic_rescore(vl_dir, pairs, tmp_path):
    """``rescore --judge holistic``: the bomb is its own error row, the good pair is scored;
    ``--max-image-pixels`` refuses a real image over the budget, by its header."""
    out = tmp_path / "out.jsonl"
    argv = ["rescore", "--judge", "holistic", "--model", str(vl_dir), "--input", str(pairs), *CPU]
    assert main([*argv, "--output", str(out)]) == 3  # exit 3: a row is an item error
    rows = {r["id"]: r for r in read_rows(out)}
    assert "refused as a decompression bomb" in rows["bomb"]["error"]
    assert rows["good"]["error"] is None and 0 <= rows["good"]["score"] <= 1
    strict = tmp_path / "strict.jsonl"
    assert main([*argv, "--output", str(strict), "--max-image-pixels", "3071"]) == 3
    rows = {r["id"]: r for r in read_rows(strict)}
    assert rows["good"]["error"] == ("line 2: invalid example: image is 64x48 = 3072 pixels, above "
                                     "the pixel budget of 3071 (max_image_pixels); not decoded")


def test_bomb_in_a_ray_batch_costs_only_itself(vl_dir):
    """One Ray batch (the actor's ``map_batches`` callable, run here without a cluster) holding a
    bomb and a good pair: the bomb gets its error, the good pair its score."""
    pa = pytest.importorskip("pyarrow")
    from fastjudge import HolisticJudge, ImageTextExample
    from fastjudge.io.jobs import score_examples
    from fastjudge.io.ray_pool import ActorScorer
    from fastjudge.judges.registry import get_judge

    judge = HolisticJudge(vl_dir, engine=EngineOptions(device=TEST_DEVICE, dtype="float32"))
    examples = [ImageTextExample(png_header(14000, 14000), "A boat.", id="bomb"),
                ImageTextExample(png_bytes(2), "A boat.", id="good")]
    actor = ActorScorer(lambda: partial(score_examples, judge, get_judge("holistic")))
    out = actor(pa.table({"pos": [7, 8], "example": [pickle.dumps(e) for e in examples]}))
    results = dict(zip(out.column("pos").to_pylist(), map(pickle.loads, out.column("result").to_pylist())))
    assert results[7]["error"].startswith("invalid example: bytes refused as a decompression bomb")
    assert results[8]["error"] is None and 0 <= results[8]["score"] <= 1


# -- text -------------------------------------------------------------------------------------
def test_long_prediction_is_refused_before_tokenizing(t5_dir, tmp_path, capsys):
    """A 3 MB prediction under a 1024-token limit: its row says so without a token count (it was
    never tokenized); the good items around it, in the same chunk, are scored."""
    from fastjudge.backends.t5.backend import TorchT5Backend

    codec = TorchT5Backend(t5_dir, device="cpu", dtype="float32").codec
    longest = max(len(token) for token in codec.tokenizer.get_vocab())
    inp = write_lines(tmp_path / "in.jsonl", [
        json.dumps({"id": "a", **GOOD}), json.dumps({"id": "long", **GOOD, "prediction": "red " * 750_000}),
        json.dumps({"id": "b", **GOOD, "prediction": "orange"})])
    out = tmp_path / "out.jsonl"
    assert main(["lave", "--model", str(t5_dir), "--input", str(inp), "--output", str(out), *CPU,
                 "--num-shots", "0", "--max-input-tokens", "1024"]) == 3  # an item error
    rows = {r["id"]: r for r in read_rows(out)}
    chars = len(GOOD["question"]) + len("red " * 750_000)  # the prediction and the rest of the prompt
    assert rows["long"]["error"].startswith("line 2: invalid example: text is ")
    assert rows["long"]["error"].endswith(
        f" characters, more than a prompt of 1024 tokens can hold ({1024 * longest} characters "
        "with this tokenizer); not tokenized")
    assert int(rows["long"]["error"].split("text is ")[1].split()[0]) > chars
    assert rows["long"]["prompt_tokens"] == 0 and rows["long"]["rating"] is None
    for key in ("a", "b"):
        assert rows[key]["error"] is None and rows[key]["rating"] in (1, 2, 3)
    assert codec.max_text_chars(1024) == 1024 * longest


def test_long_caption_is_refused_before_tokenizing(vl_dir):
    from fastjudge import HolisticJudge, ImageTextExample, VisExJudge

    judge = HolisticJudge(vl_dir, engine=EngineOptions(device=TEST_DEVICE, dtype="float32", max_input_tokens=512))
    limit = 512 * max(len(token) for token in judge.codec.tokenizer.get_vocab())
    caption = "boat " * (limit // 5 + 1)
    expected = (f"invalid example: text is {len(caption)} characters, more than a prompt of 512 "
                f"tokens can hold ({limit} characters with this tokenizer); not tokenized")
    long, good = judge.score([ImageTextExample(png_bytes(3), caption), ImageTextExample(png_bytes(3), "A boat.")])
    assert long.error == expected and long.prompt_tokens is None
    assert good.error is None
    visex = VisExJudge(judge.backend, explain=False, max_claims=2, max_claim_chars=30)
    [result] = visex.score([ImageTextExample(png_bytes(3), caption)])
    assert result.error == expected


# -- jobs -------------------------------------------------------------------------------------
def _vqa_lines():
    """Ids a, b, a, c, a, a malformed line, b."""
    item = {"prediction": "red", "references": ["red"] * 3}
    ids = ["a", "b", "a", "c", "a", None, "b"]
    return [json.dumps({"id": i, **item, "n": n}) if i else '{"id": "broken"'
            for n, i in enumerate(ids, 1)]


REPEATS = {3: ("a", 1), 5: ("a", 1), 7: ("b", 2)}  # line -> (id, its first line)


def _check_repeat_rule(rows):
    assert len(rows) == 7
    repeats = [r for r in rows if r["error"] and "repeats" in r["error"]]
    assert sorted(r["error"] for r in repeats) == sorted(
        f"line {n}: id '{i}' repeats line {first}; each id is scored once" for n, (i, first) in REPEATS.items())
    assert sorted(r["n"] for r in repeats) == [3, 5, 7]  # the repeats' own input fields
    scored = {r["id"]: r for r in rows if not r["error"]}
    assert set(scored) == {"a", "b", "c"} and scored["a"]["n"] == 1 and scored["b"]["n"] == 2


def test_repeated_ids_one_rule_resumed_or_not(tmp_path, capsys):
    """vqa-acc (read as it goes): each id scored once, later lines error rows naming the first;
    a run killed after any number of rows and resumed writes the same rows."""
    inp = write_lines(tmp_path / "in.jsonl", _vqa_lines())
    out = tmp_path / "out.jsonl"
    argv = ["vqa-acc", "--input", str(inp), "--no-progress", "--output", str(out)]
    assert main(argv) == 3  # exit 3: the repeats are error rows
    full = read_rows(out)
    _check_repeat_rule(full)
    for k in range(len(full)):
        out.write_text("".join(json.dumps(r) + "\n" for r in full[:k]))
        assert main(argv) == (3 if any(r["error"] for r in full[k:]) else 0)
        resumed = read_rows(out)
        assert resumed[:k] == full[:k]
        assert sorted(map(json.dumps, resumed)) == sorted(map(json.dumps, full)), k
    capsys.readouterr()
    assert main(argv) == 0 and read_rows(out) == resumed
    assert "0 items (7 already done)" in capsys.readouterr().err


def test_repeated_ids_in_lave_and_parquet_jobs(t5_dir, tmp_path):
    pytest.importorskip("pyarrow")
    from fastjudge.io.parquet import read_parquet_rows

    lines = [json.dumps({"id": i, **GOOD, "n": n}) for n, i in enumerate(["a", "b", "a", "c", "a"], 1)]
    lines += ['{"id": "broken"', json.dumps({"id": "b", **GOOD, "n": 7})]
    inp = write_lines(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    assert main(["lave", "--model", str(t5_dir), "--input", str(inp), "--output", str(out), *CPU]) == 3
    _check_repeat_rule(read_rows(out))
    # rescore to Parquet, resumed after its first part: the same rows
    parts = tmp_path / "out.parquet"
    argv = ["rescore", "--model", str(t5_dir), "--input", str(inp), "--output", str(parts), *CPU,
            "--rows-per-part", "3"]
    assert main(argv) == 3
    full = read_parquet_rows(parts)
    _check_repeat_rule(full)
    for extra in sorted(parts.glob("part-*.parquet"))[1:]:
        extra.unlink()
    assert main(argv) == (3 if any(r["error"] for r in full[3:]) else 0)
    resumed = read_parquet_rows(parts)
    assert resumed[:3] == full[:3]
    key = lambda r: (str(r["id"]), r["n"] or 0)  # noqa: E731
    assert [(key(r), r["error"], r["rating"]) for r in sorted(resumed, key=key)] == \
        [(key(r), r["error"], r["rating"]) for r in sorted(full, key=key)]


def test_corrupt_line_inside_output_costs_only_its_item(tmp_path, capsys):
    lines = [json.dumps({"id": i, "prediction": "red", "references": ["red", "blue"]}) for i in "abcdef"]
    inp = write_lines(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    argv = ["vqa-acc", "--input", str(inp), "--no-progress", "--output", str(out)]
    assert main(argv) == 0
    rows = out.read_text().splitlines(keepends=True)
    broken = rows[:2] + ['{"id": "c", "vqa_acc\n'] + rows[3:4] + ["[1, 2]\n"] + rows[5:]
    out.write_text("".join(broken))
    capsys.readouterr()
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert (f"fastjudge: removed corrupt line(s) 3, 5 (not a JSON row) from {out}; their items "
            "are scored again") in err
    assert "partial" not in err and "2 items (4 already done)" in err
    assert out.read_text().splitlines(keepends=True) == rows[:2] + rows[3:4] + rows[5:] + [rows[2], rows[4]]


def _cli(*args, **kwargs):
    """``fastjudge`` in a child process (a hang ends at the timeout, failing the test)."""
    env = {**os.environ, "PYTHONPATH": str(Path(fastjudge.__file__).resolve().parents[1])}
    return subprocess.run([sys.executable, "-m", "fastjudge.cli", *args], env=env, timeout=120,
                          capture_output=True, **kwargs)


def test_output_to_stdout_pipes_and_devices(tmp_path, capsys):
    lines = [json.dumps({"id": i, "prediction": "red", "references": ["red"] * 4}) for i in "abc"]
    inp = write_lines(tmp_path / "in.jsonl", lines)
    argv = ["vqa-acc", "--input", str(inp), "--no-progress", "--output"]
    expected = [{**json.loads(line), "vqa_accuracy": 1.0, "exact_match": 1.0, "error": None} for line in lines]
    for target in ("-", "/dev/stdout"):  # the child's stdout is a pipe
        done = _cli(*argv, target, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert [json.loads(x) for x in done.stdout.decode().splitlines()] == expected
        assert "3 items (0 already done)" in done.stderr.decode()
    assert not (tmp_path / "-").exists()
    assert main([*argv, "/dev/null"]) == 0
    assert "3 items (0 already done)" in capsys.readouterr().err
    fifo = tmp_path / "rows.fifo"
    os.mkfifo(fifo)
    reader = subprocess.Popen(["cat", str(fifo)], stdout=subprocess.PIPE)
    try:
        assert _cli(*argv, str(fifo)).returncode == 0
        got = reader.communicate(timeout=60)[0]
    finally:
        reader.kill()
    assert [json.loads(x) for x in got.decode().splitlines()] == expected
    assert "'-': standard output" in " ".join(_cli("vqa-acc", "--help").stdout.decode().split())


# -- checkpoints ------------------------------------------------------------------------------
def _broken_copy(src, dst, config=None, weights=None):
    shutil.copytree(src, dst)
    if config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    if weights is not None:
        weights(dst / "model.safetensors")
    return dst


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _pickle_only(path, payload: bytes):
    path.unlink()
    (path.parent / "pytorch_model.bin").write_bytes(payload)


class _Payload:
    def __reduce__(self):
        return (os.getpid, ())


CASES = {
    "truncated": (None, _truncate, "model.safetensors: not a readable safetensors file (SafetensorError: "),
    "garbage": (None, lambda p: p.write_bytes(os.urandom(4096)),
                "model.safetensors: not a readable safetensors file (SafetensorError: "),
    "heads": (lambda c: c.update(num_heads=0), None,
              "config.json: num_heads must be an integer from 1 to 16777216, got 0"),
    "d_kv": (lambda c: c.update(d_kv=-4), None, "config.json: d_kv must be an integer from 1 to 16777216, got -4"),
    "absurd": (lambda c: c.update(d_model=10 ** 12), None,
               "config.json: d_model must be an integer from 1 to 16777216, got 1000000000000"),
    "missing": (lambda c: c.pop("num_layers"), None, "config.json lacks 'num_layers'"),
    "not-json": (None, lambda p: (p.parent / "config.json").write_text("{not json"),
                 "config.json: not valid JSON ("),
    "shape": (lambda c: c.update(vocab_size=c["vocab_size"] + 5), None,
              "tensor 'shared.weight' has shape ["),
    "pickle": (None, lambda p: _pickle_only(p, pickle.dumps(_Payload(), protocol=2)),
               "pytorch_model.bin: pickle refused or unreadable under weights_only (UnpicklingError: "),
    "pickle-garbage": (None, lambda p: _pickle_only(p, b"\x80\x02garbage"),
                       "pytorch_model.bin: pickle refused or unreadable under weights_only ("),
}


@pytest.mark.parametrize("case", list(CASES))
def test_checkpoint_failures_are_one_line_and_status_2(case, t5_dir, tmp_path, capsys):
    config, weights, message = CASES[case]
    model = _broken_copy(t5_dir, tmp_path / "model", config, weights)
    inp = write_lines(tmp_path / "in.jsonl", [json.dumps({"id": "a", **GOOD})])
    out = tmp_path / "out.jsonl"
    assert main(["lave", "--model", str(model), "--input", str(inp), "--output", str(out), *CPU,
                 "--allow-pickle"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"fastjudge: error: {model}") and message in err[-1], err
    assert not any("Traceback" in line for line in err)
    assert not out.exists()


def test_qwen_config_and_shape_failures(vl_dir, tmp_path, capsys):
    """The Qwen side: an impossible value in ``text_config`` and a tensor the config does not
    fit."""
    def heads(c):
        c["text_config"]["num_attention_heads"] = 0

    def head_dim(c):
        c["text_config"]["head_dim"] *= 2

    for name, edit, message in (("heads", heads, "config.json: num_attention_heads must be an integer"),
                                ("head_dim", head_dim, "self_attn.q_proj.weight' has shape [")):
        model = _broken_copy(vl_dir, tmp_path / name, edit)
        assert main(["visexmem", "--holistic", "--model", str(model), "--input", str(tmp_path / "x.jsonl"),
                     "--output", str(tmp_path / "o.jsonl"), *CPU]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith(f"fastjudge: error: {model}") and message in err[-1], err
