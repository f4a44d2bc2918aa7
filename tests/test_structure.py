"""The shape of course_lib itself: three folders (the model library, instruments/, course/) whose
imports go one way only, and every function short enough to read next to the notes."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

LIB = Path(__file__).resolve().parents[1] / "course_lib"
DATA_MODULES = {"bpe", "corpus", "tokenizer", "tasks", "metrics"}
MODEL_MODULES = {"attention", "blocks", "cache", "configs", "generation", "layers", "models",
                 "positions", "rnn", "pretrained", "train"}
INSTRUMENTS = {"bert_app", "divergence", "gym", "hf_bpe", "induction", "measure", "probes",
               "tokens", "viz"}  # not lessons
MAX_CODE_LINES = 60


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(LIB.parent).with_suffix("").parts)


def _imports(path: Path, module: str | None = None) -> set[str]:
    """Every course_lib module that ``path`` (the module ``module``) imports, as dotted names."""
    tree = ast.parse(path.read_text())
    package = (module or _module_name(path)).rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.startswith("course_lib")}


def _library_files() -> list[Path]:
    """The model library: course_lib's own modules, outside instruments/ and course/."""
    return sorted(p for p in LIB.rglob("*.py")
                  if p.relative_to(LIB).parts[0] not in {"course", "instruments"})


def _folder_files(folder: str) -> list[Path]:
    return sorted((LIB / folder).rglob("*.py"))


def _imports_from(paths: list[Path], prefixes: tuple[str, ...]) -> dict[str, list[str]]:
    found = {_module_name(p): sorted(i for i in _imports(p) if i.startswith(prefixes))
             for p in paths}
    return {module: names for module, names in found.items() if names}


def test_the_model_library_never_imports_the_instruments_or_the_course_machinery():
    assert _imports_from(_library_files(), ("course_lib.course", "course_lib.instruments")) == {}


def test_the_instruments_never_import_the_course_machinery():
    assert _imports_from(_folder_files("instruments"), ("course_lib.course",)) == {}


def test_every_instrument_lives_in_instruments_and_nowhere_else():
    """No module of an instrument's name (or a shim that re-exports it) in the model library or
    in course/, and nothing imports one from its old places."""
    for name in INSTRUMENTS:
        assert (LIB / "instruments" / f"{name}.py").exists(), name
    elsewhere = {p.stem for p in _library_files() + _folder_files("course")}
    assert elsewhere & INSTRUMENTS == set()
    old = tuple(f"course_lib.{place}{name}" for name in INSTRUMENTS for place in ("", "course."))
    assert _imports_from(sorted(LIB.rglob("*.py")), old) == {}


def test_the_data_modules_never_import_the_models():
    offenders = {}
    for name in DATA_MODULES:
        imported = _imports(LIB / f"{name}.py")
        bad = sorted(i for i in imported if i.count(".") >= 1 and i.split(".")[1] in MODEL_MODULES)
        if bad:
            offenders[name] = bad
    assert offenders == {}


def _import_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of the graph (module -> modules it imports) as a path, or [] if none."""
    def walk(module: str, path: list[str]) -> list[str]:
        for imported in sorted(graph.get(module, ())):
            if imported in path:
                return path[path.index(imported):] + [imported]
            if cycle := walk(imported, path + [imported]):
                return cycle
        return []
    for module in sorted(graph):
        if cycle := walk(module, [module]):
            return cycle
    return []


def test_the_model_library_has_no_import_cycle():
    """Type-checking imports count too: a reader following them must not go round in circles
    (the key/value cache lives below attention, which takes it)."""
    names = {_module_name(p) for p in _library_files()}
    graph = {_module_name(p): {i for i in _imports(p) if i in names} - {_module_name(p)}
             for p in _library_files()}
    assert _import_cycle(graph) == []
    assert "course_lib.attention" not in graph["course_lib.cache"]
    assert _import_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def _code_lines(node: ast.FunctionDef, lines: list[str]) -> int:
    """Lines of a function that hold code: no blank lines, comments or docstring."""
    skip: set[int] = set()
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant):
        skip = set(range(first.lineno, first.end_lineno + 1))
    return sum(1 for i in range(node.lineno, node.end_lineno + 1)
               if i not in skip and lines[i - 1].strip()
               and not lines[i - 1].strip().startswith("#"))


@pytest.mark.parametrize("path", sorted(LIB.rglob("*.py")), ids=lambda p: _module_name(p))
def test_no_function_is_longer_than_sixty_code_lines(path):
    text = path.read_text()
    lines = text.splitlines()
    too_long = {node.name: _code_lines(node, lines) for node in ast.walk(ast.parse(text))
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                and _code_lines(node, lines) > MAX_CODE_LINES}
    assert too_long == {}


def test_the_structure_checks_can_fail(tmp_path):
    """The helpers above see a relative import of the tooling and a long function."""
    fake = tmp_path / "fake.py"
    fake.write_text("from .course import grade\n\ndef f():\n" + "    x = 1\n" * 61)
    assert "course_lib.course" in _imports(fake, "course_lib.fake")
    tree = ast.parse(fake.read_text())
    function = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef))
    assert _code_lines(function, fake.read_text().splitlines()) == 62
    fake.write_text("from ..course.checks import ch05\n")  # an instrument importing a check
    assert "course_lib.course.checks" in _imports(fake, "course_lib.instruments.fake")


def _check_sites(function: ast.FunctionDef) -> list[int]:
    """Indices of the top-level statements of ``function`` that check something: call a check
    helper (check_..., require_...) or raise, anywhere inside them (a ``try`` that turns a
    failure into a clear error is work, not a check)."""
    def checks(node: ast.AST) -> bool:
        return not isinstance(node, ast.Try) and any(
            isinstance(c, ast.Raise) or isinstance(c, ast.Call)
            and getattr(c.func, "id", getattr(c.func, "attr", "")).lstrip("_")
            .startswith(("check_", "require_")) for c in ast.walk(node))
    return [i for i, statement in enumerate(function.body) if checks(statement)]


_BUNDLING = {"dict", "tuple", "list", "super", "__init__"}


def _is_preamble(statement: ast.stmt) -> bool:
    """A docstring, ``super().__init__()`` or an assignment that only names or bundles the
    arguments (``kw = dict(mask=mask, ...)``): nothing a check must precede."""
    calls = [c for c in ast.walk(statement) if isinstance(c, ast.Call)]
    bundling = all(getattr(c.func, "id", getattr(c.func, "attr", "")) in _BUNDLING for c in calls)
    if isinstance(statement, ast.Expr):
        return isinstance(statement.value, ast.Constant) or (bool(calls) and bundling)
    return isinstance(statement, ast.Assign | ast.AnnAssign) and bundling


def _public_functions() -> list[tuple[str, ast.FunctionDef]]:
    """Every public function and method (``__init__`` included) of the model library; the
    check helpers themselves are not."""
    found = []
    for path in _library_files():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith(
                    ("_", "check_", "require_")):
                found.append((f"{_module_name(path)}.{node.name}", node))
            elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                found += [(f"{_module_name(path)}.{node.name}.{f.name}", f) for f in node.body
                          if isinstance(f, ast.FunctionDef)
                          and (not f.name.startswith("_") or f.name == "__init__")]
    return found


def _checks_not_first(function: ast.FunctionDef) -> list[int]:
    """The check sites of ``function`` if they are not one run of statements before the work."""
    sites = _check_sites(function)
    if not sites:
        return []
    one_run = sites == list(range(sites[0], sites[-1] + 1))
    first = all(_is_preamble(s) for s in function.body[:sites[0]])
    return [] if one_run and first else sites


# what these check after their work is a result, not an argument
CHECKS_A_RESULT = {"course_lib.rnn.gradient_norms": "what the learner's fn returned"}


def test_every_public_function_checks_its_arguments_first():
    """The maths below the checks reads like the notes: a public function's argument checks
    are one run of statements before any work, not scattered between the steps."""
    late = {name: sites for name, f in _public_functions()
            if (sites := _checks_not_first(f)) and name not in CHECKS_A_RESULT}
    assert late == {}


@pytest.mark.parametrize(("source", "sites"), [
    ("def f(self, x):\n    check_x(x)\n    y = g(x)\n    if y:\n        require_y(y)\n"
     "    return y\n", [0, 2]),  # a check after the work
    ("def f(x):\n    y = g(x)\n    check_x(y)\n    return y\n", [1]),  # work before it
    ("def f(x):\n    y = g(x)\n    if y < 0:\n        raise ValueError(y)\n    return y\n",
     [1]),  # an inline refusal after the work
])
def test_the_checks_first_rule_can_fail(source, sites):
    assert _checks_not_first(ast.parse(source).body[0]) == sites


def test_the_checks_first_rule_allows_a_docstring_and_bundled_arguments():
    source = ('def f(self, x, mask):\n    """Doc."""\n    kw = dict(mask=mask)\n'
              '    super().__init__()\n    check_x(x, **kw)\n    return g(x, **kw)\n')
    assert _checks_not_first(ast.parse(source).body[0]) == []


def _returns_a_value(function: ast.FunctionDef) -> bool:
    return any(isinstance(n, ast.Return) and n.value is not None for n in ast.walk(function))


def test_a_check_returns_nothing_and_a_require_returns_what_it_checked():
    """``check_*`` raises or returns None; a helper that hands back the checked value (an int,
    a device, a list of ids) is a ``require_*``: the name says which."""
    returning = sorted(f"{_module_name(path)}.{node.name}" for path in _library_files()
                       for node in ast.walk(ast.parse(path.read_text()))
                       if isinstance(node, ast.FunctionDef)
                       and node.name.lstrip("_").startswith("check_") and _returns_a_value(node))
    assert returning == []
    fake = ast.parse("def check_n(n):\n    if n < 0:\n        raise ValueError(n)\n    return n\n")
    assert _returns_a_value(fake.body[0])


# small enough for a learner to read next to the notes: about 6,500 lines for chapters 01-13,
# chapter 14's pieces on top
MAX_LIBRARY_LINES = 7_300


def test_the_model_library_stays_small_enough_to_read():
    lines = sum(len(path.read_text().splitlines()) for path in _library_files())
    assert 0 < lines <= MAX_LIBRARY_LINES
