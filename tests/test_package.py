"""The installed package: extension module, kernels package, public API and entry point."""

import shutil

import fastjudge


def test_extension_and_kernels_import():
    from fastjudge import _engine, kernels

    assert hasattr(_engine, "plan_batches")
    assert isinstance(kernels.triton_available(), bool)


def test_public_api():
    for name in ("LaveJudge", "LaveResult", "VQAExample"):
        assert hasattr(fastjudge, name)
    assert fastjudge.__version__


def test_extension_links_no_torch():
    """The host core must load without torch: check its dynamic dependencies."""
    import subprocess

    from fastjudge import _engine

    if shutil.which("ldd") is None:
        return
    deps = subprocess.run(["ldd", _engine.__file__], capture_output=True, text=True).stdout
    assert "torch" not in deps and "c10" not in deps


def test_cli_help_lists_commands(capsys):
    from fastjudge.cli import build_parser

    text = build_parser().format_help()
    assert "lave" in text and "demo" in text
