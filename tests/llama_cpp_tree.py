"""llama.cpp's own source tree, as the ``llama-cpp-python`` source distribution on PyPI
vendors it: its tokenizer test vocabularies (``models/ggml-vocab-*.gguf`` with the
``.inp`` strings and the ``.out`` ids llama.cpp gives them), its chat templates
(``models/templates``) and its converter (``convert_hf_to_gguf.py``, with the
``gguf-py`` it writes through).

The archive is downloaded once, checked against its published SHA-256 and unpacked into
``$UPDRAFT_TEST_CACHE`` (default: ``updraft-tests`` in the user's cache directory);
only the parts named above are kept. A test that needs the tree skips, saying why, when
it cannot be fetched.

``convert`` writes a checkpoint directory as GGUF with the converter itself, in a
process of its own. The one change made to it: every architecture's vocabulary is
llama.cpp's built-in ``llama-spm`` one (the converter's own ``_set_vocab_builtin``) cut
to the model's vocabulary size, because the tiny checkpoints here carry no tokenizer
files of a real model, which the converter otherwise reads and fingerprints. The
tensors and the metadata of the model are written exactly as the converter writes them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
import zipfile
from pathlib import Path

import pytest

PACKAGE = "llama-cpp-python"
VERSION = "0.3.36"
SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
# What is kept of the archive's vendor/llama.cpp.
KEPT = ("models/", "convert_hf_to_gguf.py", "conversion/", "gguf-py/")


def cache_root() -> Path:
    if os.environ.get("UPDRAFT_TEST_CACHE"):
        return Path(os.environ["UPDRAFT_TEST_CACHE"]).expanduser()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser()
    return cache / "updraft-tests"


def download_pypi_file(
    target: Path, package: str, version: str, filename: str, sha256: str
) -> None:
    """``filename`` of ``package`` ``version`` from PyPI into ``target``, checked."""
    index = f"https://pypi.org/pypi/{package}/json"
    with urllib.request.urlopen(index, timeout=60) as response:
        release = json.load(response)
    (found,) = [url for url in release["releases"][version] if url["filename"] == filename]
    url = urllib.parse.urljoin(index, found["url"])
    digest = hashlib.sha256()
    with urllib.request.urlopen(url, timeout=300) as response, target.open("wb") as out:
        while chunk := response.read(1 << 20):
            digest.update(chunk)
            out.write(chunk)
    if digest.hexdigest() != sha256:
        raise RuntimeError(f"{url}: SHA-256 {digest.hexdigest()}, expected {sha256}")


def _unpack(archive: Path, tree: Path) -> None:
    prefix = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
    staging = Path(tempfile.mkdtemp(dir=tree.parent, prefix=".unpacking-"))
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            inner = member.name.removeprefix(prefix)
            if member.name.startswith(prefix) and inner.startswith(KEPT) and member.isfile():
                member.name = inner
                tar.extract(member, staging, filter="data")
    staging.rename(tree)


def llama_cpp_tree() -> Path:
    """The unpacked tree, fetched on first use; skips the calling test if it cannot be."""
    root = cache_root()
    tree = root / f"llama.cpp-{PACKAGE}-{VERSION}"
    if (tree / "convert_hf_to_gguf.py").is_file():
        return tree
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=root) as scratch:
            archive = Path(scratch) / "sdist.tar.gz"
            sdist = f"{PACKAGE.replace('-', '_')}-{VERSION}.tar.gz"
            download_pypi_file(archive, PACKAGE, VERSION, sdist, SHA256)
            if not tree.exists():
                _unpack(archive, tree)
    except (OSError, RuntimeError, ValueError) as error:
        pytest.skip(f"llama.cpp's tree ({PACKAGE} {VERSION} sdist) cannot be fetched: {error}")
    return tree


# Mistral's own Tekken tokenizer file, as the mistral-common wheel ships it.
MISTRAL_COMMON = ("mistral-common", "1.13.1", "mistral_common-1.13.1-py3-none-any.whl")
MISTRAL_COMMON_SHA256 = "98b4d0755b8d90bf4691fa8f1b70cb3b4a8cd4dc1653c4ed08ef3d1c7d2c29af"
TEKKEN_FILE = "mistral_common/data/tekken_240718.json"


def tekken_file() -> Path:
    """Mistral's ``tekken_240718.json`` (Mistral Nemo's tokenizer), fetched on first use;
    skips the calling test if it cannot be."""
    target = cache_root() / "tekken_240718.json"
    if target.is_file():
        return target
    try:
        cache_root().mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache_root()) as scratch:
            wheel = Path(scratch) / "mistral_common.whl"
            download_pypi_file(wheel, *MISTRAL_COMMON, MISTRAL_COMMON_SHA256)
            with zipfile.ZipFile(wheel) as archive:
                staged = Path(scratch) / target.name
                staged.write_bytes(archive.read(TEKKEN_FILE))
            staged.rename(target)
    except (OSError, RuntimeError, ValueError, KeyError) as error:
        pytest.skip(f"Mistral's Tekken file ({MISTRAL_COMMON[2]}) cannot be fetched: {error}")
    return target


def vocab_files(tree: Path) -> dict[str, Path]:
    """``name`` -> ``models/ggml-vocab-<name>.gguf`` for every vocabulary with cases."""
    return {
        path.name.removeprefix("ggml-vocab-").removesuffix(".gguf"): path
        for path in sorted((tree / "models").glob("ggml-vocab-*.gguf"))
        if path.with_name(path.name + ".inp").is_file()
    }


def vocab_cases(path: Path) -> list[tuple[str, list[int]]]:
    """The ``.inp`` strings of a vocabulary and the ids llama.cpp gives each (``.out``,
    one line a case), read as llama.cpp's test-tokenizer-0 reads them: every string
    ends with the separator, an empty string is a case, and a carriage return is text."""
    separator = "\n__ggml_vocab_test__\n"
    strings = _read_exactly(path.with_name(path.name + ".inp")).split(separator)
    if strings[-1] == "":
        strings.pop()
    lines = _read_exactly(path.with_name(path.name + ".out")).split("\n")
    return [
        (s, [int(t) for t in line.split()])
        for s, line in zip(strings, lines[: len(strings)], strict=True)
    ]


def _read_exactly(path: Path) -> str:
    """A file's text with its line ends as they are."""
    return path.read_bytes().decode("utf-8")


# Run in the converter's process: the vocabulary patch, then the converter's own main().
_CONVERT = """
import sys
tree = sys.argv.pop(1)
sys.path[0:0] = [tree, tree + "/gguf-py"]
import convert_hf_to_gguf

def builtin_vocabulary(self):
    self._set_vocab_builtin("llama-spm", self.hparams["vocab_size"])

find_class = convert_hf_to_gguf.get_model_class

def with_builtin_vocabulary(*args, **kwargs):
    cls = find_class(*args, **kwargs)
    cls.set_vocab = builtin_vocabulary
    return cls

convert_hf_to_gguf.get_model_class = with_builtin_vocabulary
convert_hf_to_gguf.main()
"""


def convert(checkpoint: Path, outfile: Path, outtype: str = "f32", *extra: str) -> Path:
    """``checkpoint`` written as GGUF to ``outfile`` by llama.cpp's converter."""
    tree = llama_cpp_tree()
    command = [sys.executable, "-c", _CONVERT, str(tree), str(checkpoint)]
    command += ["--outfile", str(outfile), "--outtype", outtype, *extra]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{done.stderr[-4000:]}")
    return outfile


# The converter run once per argument list (as JSON in argv), in one process.
_CONVERT_ALL = _CONVERT.replace(
    "convert_hf_to_gguf.main()\n",
    "import json\nfor argv in json.loads(sys.argv[1]):\n"
    "    sys.argv = [sys.argv[0], *argv]\n    convert_hf_to_gguf.main()\n",
)


def convert_all(jobs: list[tuple[Path, Path, str, tuple[str, ...]]]) -> None:
    """``convert`` of each (checkpoint, outfile, outtype, extra arguments), in one
    process: the converter's imports are paid once."""
    tree = llama_cpp_tree()
    argvs = [[str(c), "--outfile", str(o), "--outtype", t, *extra] for c, o, t, extra in jobs]
    command = [sys.executable, "-c", _CONVERT_ALL, str(tree), json.dumps(argvs)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{done.stderr[-4000:]}")


def copy_tree_file(relative: str, target: Path) -> Path:
    """A file of the tree copied to ``target``."""
    return Path(shutil.copy(llama_cpp_tree() / relative, target))


# The converter's main() once per job, in one process: its imports and its reading of
# the built-in vocabulary's file (memoised here) are most of its time.
_CONVERT_MANY = _CONVERT.replace(
    "convert_hf_to_gguf.main()\n",
    """import functools, json
import gguf
gguf.GGUFReader = functools.lru_cache(gguf.GGUFReader)
for job in json.loads(sys.argv.pop(1)):
    sys.argv = [sys.argv[0], *job]
    convert_hf_to_gguf.main()
""",
)


def convert_many(jobs: list[tuple[Path, Path, str]]) -> None:
    """Each (checkpoint, outfile, outtype) written as ``convert`` writes it, in one
    process."""
    tree = llama_cpp_tree()
    argv = [[str(c), "--outfile", str(o), "--outtype", t] for c, o, t in jobs]
    command = [sys.executable, "-c", _CONVERT_MANY, str(tree), json.dumps(argv)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{done.stderr[-4000:]}")


def convert_checkpoints(
    files: dict[str, tuple[str, dict, str]], root: Path
) -> dict[str, tuple[Path, Path]]:
    """name -> (checkpoint, GGUF file) for ``files`` (name -> tiny checkpoint kind, its
    changes, the converter's outtype): each checkpoint built once, every file converted
    in one process."""
    from tests.checkpoints import build_checkpoint

    checkpoints: dict[str, Path] = {}
    jobs, made = [], {}
    for name, (kind, changes, outtype) in files.items():
        key = f"{kind} {json.dumps(changes, sort_keys=True)}"
        if key not in checkpoints:
            checkpoint = build_checkpoint(kind, root / f"{kind}-{len(checkpoints)}", **changes)
            # Gemma's converter cuts the embedding to the tokenizer's size; these
            # checkpoints' vocabulary is llama.cpp's built-in one cut to theirs.
            vocab = {str(i): i for i in range(256)}
            tokenizer = {"model": {"vocab": vocab}, "added_tokens": []}
            (checkpoint / "tokenizer.json").write_text(json.dumps(tokenizer))
            checkpoints[key] = checkpoint
        path = root / f"{name}.gguf"
        jobs.append((checkpoints[key], path, outtype))
        made[name] = (checkpoints[key], path)
    convert_many(jobs)
    return made
