"""scripts/shape.py measures a package by its stated rules: checked on a tiny package."""

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "shape.py"


@pytest.fixture(scope="module")
def shape():
    spec = importlib.util.spec_from_file_location("shape_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while defined
    spec.loader.exec_module(module)
    return module


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip("\n"))


@pytest.fixture
def package(tmp_path: Path) -> Path:
    root = tmp_path / "pkg"
    write(root / "__init__.py", "")
    # 5 code lines: the docstring's two non-blank lines, the import, the def, the return.
    write(
        root / "first.py",
        '''
        """A module.

        Its docstring's blank line above does not count."""

        # a comment line does not count
        import pkg.second


        def first():  # a trailing comment leaves a code line
            return pkg.second
        ''',
    )
    # The import inside the function closes a circle with `first`.
    write(
        root / "second.py",
        """
        def second():
            from pkg import first

            return first
        """,
    )
    # Relative imports of a name and of a submodule; no circle.
    write(root / "sub" / "__init__.py", "from .leaf import VALUE\n")
    write(root / "sub" / "leaf.py", "VALUE = 1\n")
    write(root / "third.py", "from .sub import leaf\nfrom pkg.sub import VALUE\n")
    # Engine.step: its def line and 22 statements, the comment left out.
    statements = "".join(f"        x{i} = {i}\n" for i in range(22))
    (root / "engine.py").write_text(
        "class Engine:\n    def step(self):\n        # not counted\n" + statements
    )
    write(
        root / "kernel.c",
        """
        /* a block comment
           over two lines */
        #include <stdio.h>
        // a line comment

        int f(void) { /* inline */ return 1; }
        /* a comment */ int g;
        """,
    )
    return root


def test_python_code_lines_count_docstrings_but_not_blanks_or_comments(shape, package):
    read = shape.read_shape(package)
    lines = {module.name: len(module.code_rows) for module in read.modules}
    assert lines["pkg.first"] == 5
    assert lines["pkg.second"] == 3
    assert lines["pkg"] == 0
    assert lines["pkg.engine"] == 2 + 22
    docstrings = {module.name: len(module.docstring_rows) for module in read.modules}
    assert docstrings["pkg.first"] == 2


def test_c_code_lines_leave_out_comments(shape, package):
    read = shape.read_shape(package)
    assert list(read.c_code_lines.values()) == [3]


def test_imports_anywhere_make_circles_and_relative_imports_resolve(shape, package):
    graph = shape.import_graph(shape.read_shape(package))
    assert graph["pkg.second"] == {"pkg.first"}
    assert graph["pkg.third"] == {"pkg.sub", "pkg.sub.leaf"}
    assert graph["pkg.sub"] == {"pkg.sub.leaf"}
    assert shape.import_circles(graph) == [["pkg.first", "pkg.second"]]


def test_function_lengths_and_the_limits(shape, package, capsys):
    module = next(m for m in shape.read_shape(package).modules if m.name == "pkg.engine")
    (step,) = shape.function_lengths(module, package.parent)
    assert (step.qualname, step.code_lines, step.where) == ("Engine.step", 23, "pkg/engine.py:2")

    report = shape.measure(package, baseline=1000)
    assert any("Engine.step" in limit for limit in report.broken)
    assert any("import circles" in limit for limit in report.broken)
    assert any("within 3%" in limit for limit in report.broken)
    assert not any("module over" in limit for limit in report.broken)
    assert shape.main(["--package", str(package)]) == 1
    assert shape.main(["--package", str(package), "--report-only"]) == 0
    assert "Engine.step: 23 code lines" in capsys.readouterr().out


def test_the_package_keeps_its_shape():
    """updraft itself: no import circle, no module over 500 code lines, at most five
    functions over 60, ``Engine.step`` at most 20 (the script's own limits)."""
    done = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "all limits kept" in done.stdout


def test_architecture_names_every_module():
    """ARCHITECTURE.md is the map of the code: each module is named there by its path
    in the package."""
    root = SCRIPT.parent.parent
    architecture = (root / "ARCHITECTURE.md").read_text()
    modules = [
        path.relative_to(root / "updraft").as_posix()
        for path in sorted((root / "updraft").rglob("*.py"))
        if path.name not in ("__init__.py", "__main__.py")
    ]
    assert [module for module in modules if module not in architecture] == []
