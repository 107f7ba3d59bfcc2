"""Write an import-only stand-in for ``torchvision`` into this interpreter's
site-packages (setup_vllm.sh runs it in benchmarks/peers/.venv-vllm).

vLLM's Qwen3.5 module imports its vision tower's module, which imports transformers'
Qwen2-VL image processor, which imports ``torchvision`` at module level. The only
torchvision on PyPI for torch 2.13.0 (0.28.0) is built against CUDA torch: beside the CPU
torch its ops do not load and its import fails. The benchmark runs text models on
token-id prompts, so no image code runs; the stand-in only lets those imports succeed,
with the names transformers reads at import time. Calling anything in it raises.
"""

from __future__ import annotations

import site
from pathlib import Path

MODULES = {
    "__init__.py": '"""Import-only stand-in (benchmarks/peers/stand_in_torchvision.py)."""\n'
    '__version__ = "0.28.0"\n'
    "from . import io, transforms  # noqa: E402, F401\n",
    "io.py": "import enum\n\n\n"
    "class ImageReadMode(enum.Enum):\n"
    "    UNCHANGED = 0\n    GRAY = 1\n    GRAY_ALPHA = 2\n    RGB = 3\n    RGB_ALPHA = 4\n\n\n"
    "def decode_image(*args, **kwargs):\n"
    '    raise NotImplementedError("torchvision stand-in: no image decoding")\n',
    "transforms/__init__.py": "import enum\n\n\n"
    "class InterpolationMode(enum.Enum):\n"
    '    NEAREST = "nearest"\n    NEAREST_EXACT = "nearest-exact"\n'
    '    BILINEAR = "bilinear"\n    BICUBIC = "bicubic"\n    BOX = "box"\n'
    '    HAMMING = "hamming"\n    LANCZOS = "lanczos"\n\n\n'
    "from . import functional, v2  # noqa: E402, F401\n",
    "transforms/functional.py": "from . import InterpolationMode  # noqa: F401\n\n\n"
    "def pil_to_tensor(*args, **kwargs):\n"
    '    raise NotImplementedError("torchvision stand-in: no image transforms")\n',
    "transforms/v2/__init__.py": "from . import functional  # noqa: F401\n",
    "transforms/v2/functional.py": (
        "from ..functional import InterpolationMode, pil_to_tensor  # noqa: F401\n"
    ),
}


def main() -> None:
    root = Path(site.getsitepackages()[0]) / "torchvision"
    init = root / "__init__.py"
    if root.exists() and not (init.is_file() and "stand-in" in init.read_text()):
        raise SystemExit(f"{root} is a real torchvision: uninstall it first")
    for name, text in MODULES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    print(f"wrote a torchvision stand-in at {root}")


if __name__ == "__main__":
    main()
