"""The installed package: extension module, kernels package, lazy public API, model-free imports
without torch, and the entry point."""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import fastjudge


def test_extension_and_kernels_import():
    from fastjudge import _engine, kernels

    assert hasattr(_engine, "plan_batches")
    assert isinstance(kernels.triton_available(), bool)


def test_public_api():
    for name in ("LaveJudge", "LaveResult", "VQAExample"):
        assert hasattr(fastjudge, name)
    assert fastjudge.__version__


def test_public_names_resolve_lazily_to_their_modules():
    from fastjudge import engine_options, verification
    from fastjudge.judges import holistic, lave, visexmem

    homes = {"EngineOptions": engine_options, "LaveJudge": lave, "LaveResult": lave, "VQAExample": lave,
             "VisExJudge": visexmem, "VisExResult": visexmem, "ClaimResult": visexmem,
             "ImageTextExample": visexmem, "HolisticJudge": holistic, "HolisticResult": holistic,
             "verify": verification}
    assert set(fastjudge.__all__) == set(homes) | {"__version__"}
    assert set(fastjudge.__all__) <= set(dir(fastjudge))
    for name, module in homes.items():
        assert getattr(fastjudge, name) is getattr(module, name)
    try:
        fastjudge.NoSuchJudge  # noqa: B018 - the attribute lookup is the test
    except AttributeError as err:
        assert "NoSuchJudge" in str(err)
    else:
        raise AssertionError("an unknown name must raise AttributeError")


#: Runs first in the child interpreter: every import of these packages fails, as if they were
#: not installed. Checked by importing torch before anything else.
_WITHOUT_TORCH = textwrap.dedent("""
    import sys

    class _NotInstalled:
        blocked = {"torch", "transformers", "triton", "xgrammar"}

        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in self.blocked:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, _NotInstalled())
    try:
        import torch
    except ImportError:
        pass
    else:
        raise SystemExit("torch is still importable")
""")


def test_model_free_metrics_import_without_torch():
    """``fastjudge.metrics`` needs numpy only: import it and compute with torch unimportable."""
    child = _WITHOUT_TORCH + textwrap.dedent("""
        import fastjudge
        import fastjudge.metrics
        import fastjudge.metrics.image_text_meta_eval
        import fastjudge.metrics.meta_eval
        import fastjudge.metrics.stats
        import fastjudge.metrics.vqa
        from fastjudge.metrics import bootstrap_ci, spearman, vqa_accuracy
        from fastjudge.metrics.meta_eval import meta_evaluate

        assert fastjudge.__version__ and "LaveJudge" in dir(fastjudge)
        assert vqa_accuracy("two", ["two"] * 3 + ["2"] * 7) == 1.0
        assert abs(spearman([1, 2, 3, 4], [10, 20, 40, 30]) - 0.8) < 1e-12
        ci = bootstrap_ci([1, 2, 3, 4, 5], [1, 3, 2, 5, 4], n=50, seed=0)
        assert ci.low <= ci.high
        human = {str(i): float(i % 3) for i in range(12)}
        result = meta_evaluate(human, {"m": {k: v + 0.1 for k, v in human.items()}}, n_boot=0)
        assert result
        assert not {"torch", "transformers"} & set(sys.modules), "torch was loaded"
        print("ok")
    """)
    package_root = str(Path(fastjudge.__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [package_root, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


def test_extension_links_no_torch():
    """The host core must load without torch: check its dynamic dependencies."""
    from fastjudge import _engine

    if shutil.which("ldd") is None:
        return
    deps = subprocess.run(["ldd", _engine.__file__], capture_output=True, text=True).stdout
    # the libraries' names only: a load address such as 0x00007f99100c1000 may spell "c10"
    names = [line.split()[0] for line in deps.splitlines() if line.strip()]
    assert names and not any("torch" in n or n.startswith("libc10") for n in names), names


def test_cli_help_lists_commands(capsys):
    from fastjudge.cli import build_parser

    text = build_parser().format_help()
    assert "lave" in text and "demo" in text
