"""Build llama.cpp's ``llama-quantize`` from the source tree the ``llama-cpp-python``
sdist vendors (the version and SHA-256 ``tests/llama_cpp_tree.py`` pins), so that
``tests/test_llama_quantize.py`` can check files quantized by llama.cpp itself.

    python scripts/build_llama_quantize.py      # a few minutes on two cores

It needs cmake, a C++ compiler and ninja or make. The tree and the build go to
``$UPDRAFT_TEST_CACHE`` (default ``~/.cache/updraft-tests``); the binary's path is
printed, and the test finds it there.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.llama_cpp_tree import PACKAGE, SHA256, VERSION, cache_root, download_pypi_file


def quantize_binary() -> Path:
    """Where the built ``llama-quantize`` lies."""
    return cache_root() / f"llama.cpp-build-{VERSION}" / "bin" / "llama-quantize"


def main() -> Path:
    root = cache_root()
    source = root / f"llama.cpp-source-{VERSION}"
    if not (source / "CMakeLists.txt").is_file():
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=root) as scratch:
            archive = Path(scratch) / "sdist.tar.gz"
            download_pypi_file(
                archive, PACKAGE, VERSION, f"llama_cpp_python-{VERSION}.tar.gz", SHA256
            )
            prefix = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
            with tarfile.open(archive) as tar:
                members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
                for member in members:
                    member.name = member.name.removeprefix(prefix)
                tar.extractall(Path(scratch) / "tree", members=members, filter="data")
            shutil.move(Path(scratch) / "tree", source)
    build = quantize_binary().parent.parent
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    flags = ["-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"]
    flags += ["-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_OPENSSL=OFF", "-DCMAKE_BUILD_TYPE=Release"]
    subprocess.run(["cmake", "-S", source, "-B", build, *generator, *flags], check=True)
    subprocess.run(["cmake", "--build", build, "--target", "llama-quantize", "-j"], check=True)
    print(quantize_binary())
    return quantize_binary()


if __name__ == "__main__":
    main()
