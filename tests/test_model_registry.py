"""A model family is one config parser, one model file and its registry rows: no other
module of the package names an architecture, and a family registered from outside the
package loads and generates like one of updraft's own."""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import shutil
from pathlib import Path

import pytest

from tests.helpers import greedy
from updraft import LLM
from updraft.demo import DEMO_MODEL_DIR
from updraft.model_config import ModelConfig, register_model
from updraft.model_config import registry as registry_module
from updraft.model_config.registry import ARCHITECTURES
from updraft.models.llama import LlamaForCausalLM

PACKAGE = Path(registry_module.__file__).resolve().parent.parent
# llama.cpp's tokenizer and pre-tokenizer names share words with its architecture names
# ("llama", "qwen2"), as vLLM's reasoning-parser names do ("qwen3"): these modules name
# tokenizers and parsers, not families.
NAME_TABLES = (
    PACKAGE / "checkpoints" / "gguf_vocab",
    PACKAGE / "serve" / "parsers" / "reasoning.py",
)


def named_architectures(source: str, gguf: bool = True) -> set[str]:
    """The registered architectures a module's code names: in a string (docstrings
    aside), a name, an import or a class; and, with ``gguf``, llama.cpp's names of them
    as whole strings."""
    names = set(ARCHITECTURES)
    gguf_names = {row.gguf_name for row in ARCHITECTURES.values() if row.gguf_name}
    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) not in docstrings:
                found |= {name for name in names if name in node.value}
                if gguf and node.value in gguf_names:
                    found.add(node.value)
        elif isinstance(node, ast.Name | ast.ClassDef | ast.alias):
            identifier = getattr(node, "id", None) or getattr(node, "name", "")
            if identifier.rpartition(".")[2] in names:
                found.add(identifier.rpartition(".")[2])
    return found


def family_files() -> set[Path]:
    """The registry, and each row's parser and model file."""
    files = {Path(registry_module.__file__).resolve()}
    for row in ARCHITECTURES.values():
        files.add(Path(inspect.getsourcefile(row.parse)).resolve())
        model = row.model
        module = model.partition(":")[0] if isinstance(model, str) else model.__module__
        files.add(Path(importlib.util.find_spec(module).origin).resolve())
    return files


def test_a_family_is_named_only_in_its_parser_its_model_file_and_the_registry():
    allowed = family_files()
    assert {path.relative_to(PACKAGE).as_posix() for path in allowed} == {
        "model_config/registry.py",
        "model_config/llama.py",
        "model_config/gemma3.py",
        "model_config/gemma4.py",
        "model_config/deepseek.py",
        "model_config/qwen35.py",
        "model_config/gpt_oss.py",
        "models/llama.py",
        "models/gemma.py",
        "models/gemma4.py",
        "models/deepseek.py",
        "models/qwen35.py",
        "models/gpt_oss.py",
    }
    naming = {
        path.relative_to(PACKAGE).as_posix(): sorted(found)
        for path in sorted(PACKAGE.rglob("*.py"))
        if (
            found := named_architectures(
                path.read_text(), gguf=not any(path.is_relative_to(t) for t in NAME_TABLES)
            )
        )
        and path.resolve() not in allowed
    }
    assert naming == {}, "architectures named outside their family's files"


@pytest.mark.parametrize(
    "planted",
    [
        'if config.architecture == "Qwen2ForCausalLM":\n    pass\n',
        "from updraft.models.gemma import Gemma3ForCausalLM\n",
        'GGUF = {"qwen3": "x"}\n',
    ],
)
def test_the_scan_finds_an_architecture_named_elsewhere(planted):
    assert named_architectures(planted)
    assert not named_architectures('"""Qwen2ForCausalLM, in a docstring, is prose."""\n')


class OutsideLlama(LlamaForCausalLM):
    """A model class of a package other than updraft's; counts the models built."""

    built = 0

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        OutsideLlama.built += 1


@pytest.fixture
def outside_family(tmp_path):
    """The demo checkpoint under an architecture name updraft does not know, served by
    a class registered from outside the package."""
    directory = tmp_path / "outside"
    shutil.copytree(DEMO_MODEL_DIR, directory)
    config = json.loads((directory / "config.json").read_text())
    config["architectures"] = ["OutsideForCausalLM"]
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported architecture"):
        ModelConfig.from_dir(directory)
    row = register_model("OutsideForCausalLM", f"{__name__}:OutsideLlama")
    yield directory, row
    del ARCHITECTURES["OutsideForCausalLM"]


def test_a_family_registered_from_outside_the_package_loads_and_generates(outside_family):
    directory, row = outside_family
    assert ModelConfig.from_dir(directory).architecture == "OutsideForCausalLM"
    prompts = ["The cat", "Once upon a time"]
    built = OutsideLlama.built
    outside = LLM(str(directory), enforce_eager=True).generate(prompts, greedy(12))
    demo = LLM(str(DEMO_MODEL_DIR), enforce_eager=True).generate(prompts, greedy(12))
    assert [o.outputs[0].token_ids for o in outside] == [o.outputs[0].token_ids for o in demo]
    assert all(len(o.outputs[0].token_ids) == 12 for o in outside)
    assert OutsideLlama.built == built + 1
    assert row.model == f"{__name__}:OutsideLlama"


def test_register_model_refuses_a_name_that_is_not_a_string():
    with pytest.raises(ValueError, match="architecture name must be a string"):
        register_model("", LlamaForCausalLM)
