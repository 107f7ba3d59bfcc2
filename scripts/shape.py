"""Measure the package's shape and say which limits it breaks.

    python scripts/shape.py                  # report, exit 1 if a limit is broken
    python scripts/shape.py --report-only    # report, exit 0
    python scripts/shape.py --baseline 15926 # also: Python code lines within 3% of 15,926

Pure standard library (it never imports the package or torch), so it runs anywhere.

What it counts:

* Code lines of a Python file: lines that are not blank and not only a comment.
  Docstrings count as code lines (they are what a reader reads, and a function that
  needs a long docstring is long); a blank line inside a string does not count. The
  report also gives the count without docstrings (module, class and function
  docstrings), so either rule can be read off it.
* Code lines of a C file: lines that are not blank and not only a `//` or `/* */`
  comment.
* A function's length: its code lines, from the `def` line (decorators left out) to
  its last line, nested functions included.
* Import circles: every `import` and `from ... import` of a package module, wherever
  it stands (module level, inside a function, under `if TYPE_CHECKING:`), is an edge
  from the importing module to the imported one (`from pkg.a import b` goes to
  `pkg.a.b` when that is a module, else to `pkg.a`). Each set of modules that reach
  one another through such edges (a strongly connected component) is one circle,
  reported with its modules and one shortest loop through them.

Limits: no import circle; no module over 500 code lines; at most 5 functions over 60
code lines; `Engine.step` at most 20 code lines; with `--baseline N`, Python code lines
within 3% of N (and with `--c-baseline N`, C code lines within 3% of N).
"""

from __future__ import annotations

import argparse
import ast
import io
import sys
import tokenize
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

MODULE_LIMIT = 500
FUNCTION_LIMIT = 60
LONG_FUNCTIONS_ALLOWED = 5
ENGINE_STEP_LIMIT = 20
BASELINE_TOLERANCE = 0.03

_NON_CODE_TOKENS = {
    tokenize.COMMENT,
    tokenize.NL,
    tokenize.NEWLINE,
    tokenize.INDENT,
    tokenize.DEDENT,
    tokenize.ENCODING,
    tokenize.ENDMARKER,
}


@dataclass
class PythonModule:
    name: str
    path: Path
    source: str
    tree: ast.Module
    code_rows: set[int]
    docstring_rows: set[int]


@dataclass
class FunctionLength:
    where: str
    qualname: str
    code_lines: int


@dataclass
class Shape:
    package: Path
    modules: list[PythonModule] = field(default_factory=list)
    c_code_lines: dict[Path, int] = field(default_factory=dict)

    @property
    def python_code_lines(self) -> int:
        return sum(len(module.code_rows) for module in self.modules)

    @property
    def docstring_lines(self) -> int:
        return sum(len(module.docstring_rows) for module in self.modules)


def python_code_rows(source: str) -> set[int]:
    """Row numbers (1-based) of the code lines of `source`, by the rule above."""
    lines = source.splitlines()
    rows: set[int] = set()
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    for token in tokens:
        if token.type in _NON_CODE_TOKENS:
            continue
        rows.update(range(token.start[0], token.end[0] + 1))
    return {row for row in rows if row <= len(lines) and lines[row - 1].strip()}


def docstring_rows(tree: ast.Module, source: str) -> set[int]:
    """Non-blank rows that belong to docstrings (of the module, classes and functions)."""
    lines = source.splitlines()
    rows: set[int] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        body = node.body
        if (
            body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            first, last = body[0].lineno, body[0].end_lineno or body[0].lineno
            rows.update(row for row in range(first, last + 1) if lines[row - 1].strip())
    return rows


def c_code_lines(source: str) -> int:
    """Lines of C that are not blank and not only a comment (`//` or `/* */`)."""
    count = 0
    in_block_comment = False
    for line in source.splitlines():
        has_code = False
        position = 0
        while position < len(line):
            if in_block_comment:
                end = line.find("*/", position)
                if end < 0:
                    break
                in_block_comment = False
                position = end + 2
            elif line.startswith("/*", position):
                in_block_comment = True
                position += 2
            elif line.startswith("//", position):
                break
            else:
                if not line[position].isspace():
                    has_code = True
                position += 1
        count += has_code
    return count


def module_name(package: Path, path: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def read_shape(package: Path) -> Shape:
    shape = Shape(package)
    for path in sorted(package.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source, filename=str(path))
        shape.modules.append(
            PythonModule(
                name=module_name(package, path),
                path=path,
                source=source,
                tree=tree,
                code_rows=python_code_rows(source),
                docstring_rows=docstring_rows(tree, source),
            )
        )
    for path in sorted(package.rglob("*.c")):
        shape.c_code_lines[path] = c_code_lines(path.read_text(encoding="utf-8"))
    return shape


def function_lengths(module: PythonModule, root: Path) -> list[FunctionLength]:
    """Every function and method of a module, measured in its code lines."""
    found: list[FunctionLength] = []
    where = module.path.relative_to(root)

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                qualname = prefix + child.name
                end = child.end_lineno or child.lineno
                length = sum(1 for row in module.code_rows if child.lineno <= row <= end)
                found.append(FunctionLength(f"{where}:{child.lineno}", qualname, length))
                visit(child, qualname + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(module.tree, "")
    return found


def _from_base(module: PythonModule, node: ast.ImportFrom) -> str:
    """The absolute name a `from X import ...` statement imports from."""
    if not node.level:
        return node.module or ""
    # A package's own `.` is itself; a plain module's `.` is its package.
    is_package = module.path.name == "__init__.py"
    base = module.name.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def imported_modules(module: PythonModule, known: set[str]) -> set[str]:
    """The package modules one module imports, by the rule in the module docstring."""
    targets: set[str] = set()
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(module, node)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                if submodule in known:
                    targets.add(submodule)
                elif base in known:
                    targets.add(base)
    targets.discard(module.name)
    return targets


def import_graph(shape: Shape) -> dict[str, set[str]]:
    """Module -> the package modules it imports."""
    known = {module.name for module in shape.modules}
    return {module.name: imported_modules(module, known) for module in shape.modules}


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    lowlink: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = lowlink[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            advanced = False
            for successor in successors:
                if successor not in index:
                    index[successor] = lowlink[successor] = counter
                    counter += 1
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    advanced = True
                    break
                if successor in on_stack:
                    lowlink[node] = min(lowlink[node], index[successor])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                lowlink[parent] = min(lowlink[parent], lowlink[node])
            if lowlink[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return sorted(components)


def shortest_loop(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One shortest loop through the component's first module, staying inside it."""
    members = set(component)
    start = component[0]
    previous: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for successor in sorted(graph[node] & members):
            if successor == start:
                path = [node]
                while path[-1] != start:
                    path.append(previous[path[-1]])
                return [*reversed(path), start]
            if successor not in previous:
                previous[successor] = node
                queue.append(successor)
    return component


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)
    broken: list[str] = field(default_factory=list)

    def say(self, text: str = "") -> None:
        self.lines.append(text)

    def check(self, ok: bool, limit: str) -> str:
        if not ok:
            self.broken.append(limit)
        return "ok" if ok else "OVER LIMIT"


def measure(package: Path, baseline: int | None = None, c_baseline: int | None = None) -> Report:
    """Measure `package` (a directory) and report it against the limits."""
    shape = read_shape(package)
    root = package.parent
    report = Report()
    c_total = sum(shape.c_code_lines.values())
    python_total = shape.python_code_lines
    modules, c_files = len(shape.modules), len(shape.c_code_lines)
    report.say(f"package {package.name}: {modules} Python modules, {c_files} C files")
    report.say(
        f"  Python code lines: {python_total:,} "
        f"({python_total - shape.docstring_lines:,} without docstrings)"
    )
    report.say(f"  C code lines: {c_total:,}")
    for label, total, base in (("Python", python_total, baseline), ("C", c_total, c_baseline)):
        if base is not None:
            change = (total - base) / base if base else float("inf")
            ok = abs(change) <= BASELINE_TOLERANCE
            verdict = report.check(ok, f"{label} code lines within 3% of {base}")
            report.say(f"  {label} against baseline {base:,}: {change:+.1%} [{verdict}]")

    graph = import_graph(shape)
    circles = import_circles(graph)
    verdict = report.check(not circles, "no import circles")
    report.say()
    report.say(f"import circles: {len(circles)} [{verdict}]")
    for component in circles:
        report.say(f"  {len(component)} modules: {', '.join(component)}")
        report.say(f"    e.g. {' -> '.join(shortest_loop(graph, component))}")

    large = sorted(
        (
            (len(m.code_rows), m.path.relative_to(root))
            for m in shape.modules
            if len(m.code_rows) > MODULE_LIMIT
        ),
        reverse=True,
    )
    verdict = report.check(not large, f"no module over {MODULE_LIMIT} code lines")
    report.say()
    report.say(f"modules over {MODULE_LIMIT} code lines: {len(large)} [{verdict}]")
    for length, path in large:
        report.say(f"  {length:5d}  {path}")

    functions = [f for module in shape.modules for f in function_lengths(module, root)]
    long_functions = sorted(
        (f for f in functions if f.code_lines > FUNCTION_LIMIT), key=lambda f: -f.code_lines
    )
    verdict = report.check(
        len(long_functions) <= LONG_FUNCTIONS_ALLOWED,
        f"at most {LONG_FUNCTIONS_ALLOWED} functions over {FUNCTION_LIMIT} code lines",
    )
    report.say()
    report.say(
        f"functions over {FUNCTION_LIMIT} code lines: {len(long_functions)} "
        f"(at most {LONG_FUNCTIONS_ALLOWED}) [{verdict}]"
    )
    for function in long_functions:
        report.say(f"  {function.code_lines:5d}  {function.where}  {function.qualname}")

    steps = [f for f in functions if f.qualname == "Engine.step"]
    report.say()
    if not steps:
        report.say("Engine.step: not found")
    for step in steps:
        verdict = report.check(
            step.code_lines <= ENGINE_STEP_LIMIT, f"Engine.step at most {ENGINE_STEP_LIMIT} lines"
        )
        report.say(
            f"Engine.step: {step.code_lines} code lines (at most {ENGINE_STEP_LIMIT}), "
            f"{step.where} [{verdict}]"
        )

    report.say()
    if report.broken:
        report.say(f"limits broken: {len(report.broken)}: {'; '.join(report.broken)}")
    else:
        report.say("all limits kept")
    return report


def main(argv: list[str] | None = None) -> int:
    default_package = Path(__file__).resolve().parent.parent / "updraft"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--package", type=Path, default=default_package, help="package directory")
    parser.add_argument("--baseline", type=int, help="Python code lines to stay within 3%% of")
    parser.add_argument("--c-baseline", type=int, help="C code lines to stay within 3%% of")
    parser.add_argument(
        "--report-only", action="store_true", help="print the report and exit 0 whatever it says"
    )
    args = parser.parse_args(argv)
    report = measure(args.package.resolve(), args.baseline, args.c_baseline)
    print("\n".join(report.lines))
    return 0 if args.report_only or not report.broken else 1


if __name__ == "__main__":
    sys.exit(main())
