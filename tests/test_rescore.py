"""``fastjudge rescore``: one process and a real local Ray cluster (CPU, 2 actors), JSONL and
Parquet in and out, resumption, error rows and the judge registry, on the tiny random-weight
Flan-T5 checkpoint."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from test_cli import VALID, read_rows, write_lines  # noqa: E402

from fastjudge.cli import main  # noqa: E402
from fastjudge.io.jobs import local_rows, prepare  # noqa: E402
from fastjudge.io.parquet import read_parquet_rows  # noqa: E402
from fastjudge.judges import registry  # noqa: E402

# Ray Data's own configuration code warns about its deprecated settings
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:ray")

MODEL = ("--dtype", "float32", "--device", "cpu", "--no-progress")
FLOAT_FIELDS = ("probs", "soft_score")


def run(command, model, inp, out, *extra):
    return main([command, "--model", str(model), "--input", str(inp), "--output", str(out),
                 *MODEL, *extra])


def assert_same_rows(got, expected):
    """Same rows as a set: ids unique and equal; every field equal, probabilities (and the
    soft score made of them) to 1e-5 (batch composition changes float summation order)."""
    got_ids = [str(r["id"]) for r in got]
    assert len(got_ids) == len(set(got_ids))
    assert sorted(got_ids) == sorted(str(r["id"]) for r in expected)
    by_id = {str(r["id"]): r for r in expected}
    for g in got:
        e = by_id[str(g["id"])]
        assert {k: v for k, v in g.items() if k not in FLOAT_FIELDS} == \
            {k: v for k, v in e.items() if k not in FLOAT_FIELDS}
        for k in FLOAT_FIELDS:
            assert (g[k] is None) == (e[k] is None)
            if g[k] is not None:
                assert g[k] == pytest.approx(e[k], abs=1e-5)


@pytest.fixture
def mixed_input(tmp_path):
    """Valid items, malformed lines, an item the judge rejects and one without an id."""
    lines = [json.dumps(VALID[0]), json.dumps(VALID[1]),
             '{"id": "broken", "question": "Is it',  # line 3: malformed JSON
             '["an", "array"]',  # line 4: not an object
             "",
             json.dumps({"id": "empty", "question": "What?", "references": [], "prediction": "x"}),
             json.dumps(VALID[2]), json.dumps(VALID[3]),
             json.dumps({"question": "Who is there?", "references": ["a cat"], "prediction": "cat"})]
    return write_lines(tmp_path / "in.jsonl", lines)


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.data")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def parquet_input(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


PARQUET_ROWS = [
    {"id": f"p{i}", "question": q, "references": [{"answer": a} for a in refs], "prediction": p}
    for i, (q, refs, p) in enumerate([
        ("What color is the kite?", ["red", "red", "orange"], "red"),
        ("Is the kite flying?", ["yes", "yes", "no"], "no"),
        ("How many dogs are there?", ["2", "two"], "3"),
        ("What is on the table?", ["cake"], "pie"),
        ("What is the man holding?", [], "a bat"),  # rejected: no references
        ("Where is the cat?", ["on the sofa", "sofa"], "sofa"),
    ])
] + [{"id": None, "question": "Who is there?", "references": [{"answer": "a cat"}],
      "prediction": "cat"}]


# -- Ray -------------------------------------------------------------------------------------
def test_ray_cli_matches_single_process(ray_cluster, t5_dir, mixed_input, tmp_path, capsys):
    """`fastjudge rescore --ray` writes the rows `fastjudge lave` writes (as a set), error rows
    included, and `fastjudge rescore` without --ray does too."""
    assert run("lave", t5_dir, mixed_input, tmp_path / "lave.jsonl") == 3  # exit 3: some rows are item errors
    expected = read_rows(tmp_path / "lave.jsonl")
    assert len(expected) == 8
    assert run("rescore", t5_dir, mixed_input, tmp_path / "local.jsonl") == 3
    assert_same_rows(read_rows(tmp_path / "local.jsonl"), expected)
    capsys.readouterr()

    out = tmp_path / "ray.jsonl"
    assert run("rescore", t5_dir, mixed_input, out, "--ray", "--num-workers", "2") == 3
    err = capsys.readouterr().err
    assert "6 items on 2 Ray workers (1 CPUs each), batches of 3" in err
    assert "8 items (0 already done), 3 errors" in err
    rows = read_rows(out)
    assert_same_rows(rows, expected)
    by_id = {str(r["id"]): r for r in rows}
    assert "invalid JSON" in by_id["line-3"]["error"]
    assert by_id["line-4"]["error"].startswith("line 4: expected a JSON object")
    assert by_id["empty"]["error"] == "line 6: invalid example: references are empty"
    assert by_id["empty"]["question"] == "What?"
    assert by_id["line-9"]["rating"] in (1, 2, 3) and by_id["line-9"]["error"] is None
    assert by_id["q2"]["extra"] == {"keep": [1, 2]} and by_id["4"]["id"] == 4


def test_ray_parquet_input_and_resume(ray_cluster, t5_dir, tmp_path, capsys):
    inp = parquet_input(tmp_path / "in.parquet", PARQUET_ROWS)
    full = tmp_path / "full.jsonl"
    assert run("rescore", t5_dir, inp, full) == 3  # one process; exit 3: p4 is an item error
    expected = read_rows(full)
    assert sorted(str(r["id"]) for r in expected) == ["line-7", "p0", "p1", "p2", "p3", "p4", "p5"]
    by_id = {r["id"]: r for r in expected}
    assert by_id["p4"]["error"] == "line 5: invalid example: references are empty"
    assert by_id["p0"]["references"] == [{"answer": "red"}, {"answer": "red"}, {"answer": "orange"}]
    assert all(by_id[i]["rating"] in (1, 2, 3) for i in ("p0", "p1", "p2", "p3", "p5", "line-7"))
    # The same items from JSONL score the same.
    jsonl = write_lines(tmp_path / "in.jsonl", [json.dumps(r) for r in PARQUET_ROWS])
    assert run("rescore", t5_dir, jsonl, tmp_path / "from-jsonl.jsonl") == 3
    assert_same_rows(read_rows(tmp_path / "from-jsonl.jsonl"), expected)

    # A previous run wrote three rows; the Ray run adds only the others.
    out = tmp_path / "out.jsonl"
    head = "".join(json.dumps(r) + "\n" for r in expected[:3])
    out.write_text(head, encoding="utf-8")
    capsys.readouterr()
    item_errors = any(r["error"] for r in expected[3:])
    assert run("rescore", t5_dir, inp, out, "--ray", "--num-workers", "2") == (3 if item_errors else 0)
    err = capsys.readouterr().err
    assert "7 items (3 already done)" not in err and "4 items (3 already done)" in err
    text = out.read_text(encoding="utf-8")
    assert text.startswith(head)
    assert_same_rows(read_rows(out), expected)

    # Nothing left: nothing dispatched, file unchanged.
    assert run("rescore", t5_dir, inp, out, "--ray", "--num-workers", "2") == 0
    err = capsys.readouterr().err
    assert "0 items (7 already done)" in err and "Ray workers" not in err
    assert out.read_text(encoding="utf-8") == text


# -- one process -----------------------------------------------------------------------------
def test_parquet_output_parts_and_resume(t5_dir, mixed_input, tmp_path, capsys):
    assert run("lave", t5_dir, mixed_input, tmp_path / "lave.jsonl") == 3
    expected = read_rows(tmp_path / "lave.jsonl")
    out = tmp_path / "out.parquet"
    assert run("rescore", t5_dir, mixed_input, out, "--rows-per-part", "3") == 3
    parts = sorted(p.name for p in out.iterdir())
    assert parts == ["part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    schema = pq.read_schema(out / parts[0])
    assert schema.field("id").type == pa.string()
    assert schema.field("references").type == pa.string()  # strings in some rows, objects in others
    assert schema.field("probs").type == pa.list_(pa.float64())
    assert schema.field("rating").type == pa.int64()
    rows = read_parquet_rows(out)
    assert len(rows) == 8

    def normalized(row):  # the rule: id as a string, a field of mixed types as JSON text
        row = {k: v for k, v in row.items() if v is not None or k in registry.LAVE_RESULT_FIELDS}
        row["id"] = str(row["id"])
        if "references" in row and not isinstance(row["references"], str):
            row["references"] = json.dumps(row["references"], separators=(",", ":"))
        return row

    assert_same_rows([normalized(r) for r in rows], [normalized(r) for r in expected])

    # A killed run: its last part never landed (a temporary file remains).
    last = pq.read_table(out / parts[-1]).to_pylist()
    (out / parts[-1]).rename(out / ".part-00002.parquet.tmp")
    capsys.readouterr()
    item_errors = any(r["error"] for r in last)
    assert run("rescore", t5_dir, mixed_input, out, "--rows-per-part", "3") == (3 if item_errors else 0)
    err = capsys.readouterr().err
    assert "removed 1 unfinished part file" in err and "2 items (6 already done)" in err
    assert sorted(p.name for p in out.iterdir()) == parts  # tmp gone, new part 00002
    assert_same_rows([normalized(r) for r in read_parquet_rows(out)],
                     [normalized(r) for r in expected])
    assert run("rescore", t5_dir, mixed_input, out) == 0
    assert len(read_parquet_rows(out)) == 8


def test_registry_is_shared_and_extensible(tmp_path, capsys, monkeypatch):
    """serve and rescore read one registry; a judge added by one call works end to end, and
    a judge that raises on one item's batches gives that item (alone) an error row."""
    from fastjudge import serve

    assert serve.JUDGES is registry.JUDGES and serve.register_judge is registry.register_judge
    assert registry.JUDGES["lave"].result_fields == registry.LAVE_RESULT_FIELDS

    class LengthJudge:
        def __init__(self, bonus):
            self.bonus = bonus

        def stream(self, examples):
            for i, text in enumerate(examples):
                if text == "boom":
                    raise RuntimeError("device lost")
                yield SimpleNamespace(index=i, length=len(text) + self.bonus, error=None)

    def options(p):
        p.add_argument("--bonus", type=float, default=0.0)
        p.add_argument("--chunk-size", type=int, default=7)  # exists: lave's stays

    def parse(d, where):
        if not isinstance(d.get("text"), str):
            raise registry.ItemError(f"{where}: text must be a string")
        return d["text"]

    monkeypatch.setitem(registry.JUDGES, "length", None)  # removed again after the test
    registry.register_judge("length", lambda args: LengthJudge(args.bonus), parse,
                            add_args=options,
                            result_row=lambda r: {"score": r.length, "error": r.error})
    inp = write_lines(tmp_path / "in.jsonl", [
        json.dumps({"id": "a", "text": "four"}), json.dumps({"id": "b", "text": 3}),
        json.dumps({"id": "c", "text": "boom"}), json.dumps({"id": "d", "text": "xy"}), "{"])
    out = tmp_path / "out.jsonl"
    assert main(["rescore", "--judge", "length", "--model", "unused", "--input", str(inp),
                 "--output", str(out), "--no-progress", "--chunk-size", "3", "--bonus", "2"]) == 3
    by_id = {r["id"]: r for r in read_rows(out)}
    assert by_id["a"] == {"id": "a", "text": "four", "score": 6.0, "error": None}
    assert by_id["b"]["error"] == "line 2: item: text must be a string"
    assert by_id["c"]["error"] == "line 3: RuntimeError: device lost" and by_id["c"]["score"] is None
    # "d" shared a batch with "c": the failure is c's alone (c fails alone, d scores alone)
    assert by_id["d"] == {"id": "d", "text": "xy", "score": 4.0, "error": None}
    assert by_id["line-5"]["error"].startswith("line 5: invalid JSON")
    assert "5 items (0 already done), 3 errors, mean score 5.0000" in capsys.readouterr().err
    from fastjudge.cli import build_parser

    assert build_parser().parse_args(["rescore", "--model", "m", "--input", "i", "--output",
                                      "o"]).chunk_size == 1024


def test_prepare_and_local_rows_keep_order_of_lines(lave_judge):
    from fastjudge.io.jsonl import InputLine

    spec = registry.get_judge("lave")
    lines = [InputLine(1, dict(VALID[0])), InputLine(2, None, "line 2: invalid JSON (x)"),
             InputLine(3, {"question": "q", "references": ["a"], "prediction": None})]
    rows, todo = prepare(spec, lines)
    assert rows == [{"id": "line-2", **dict.fromkeys(spec.result_fields),
                     "error": "line 2: invalid JSON (x)"}]
    scored = {r["id"]: r for r in local_rows(lave_judge, spec, todo, chunk_size=1)}
    assert scored["q1"]["rating"] in (1, 2, 3)
    assert scored["line-3"]["error"].startswith("line 3: ") and "prediction" in scored["line-3"]["error"]
    with pytest.raises(ValueError, match="unknown judge 'nope'"):
        registry.get_judge("nope")


def test_rescore_errors(t5_dir, tmp_path, capsys):
    inp = write_lines(tmp_path / "in.jsonl", [json.dumps(VALID[0])])
    assert run("rescore", tmp_path / "no-model", inp, tmp_path / "out.jsonl") == 2
    assert "fastjudge: error:" in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()
    assert run("rescore", t5_dir, tmp_path / "absent.parquet", tmp_path / "o.jsonl") == 2
    assert "absent.parquet" in capsys.readouterr().err
    # a part directory written from another input is refused, not mixed
    out = tmp_path / "o.parquet"
    assert run("rescore", t5_dir, inp, out) == 0
    other = write_lines(tmp_path / "other.jsonl", [json.dumps({**VALID[0], "id": "z", "k": 1})])
    assert run("rescore", t5_dir, other, out) == 2
    assert "different schema" in capsys.readouterr().err
    shutil.rmtree(out)
