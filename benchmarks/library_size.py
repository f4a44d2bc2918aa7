"""How big the model library is, and how much of its code checks arguments.

    python -m benchmarks.library_size            # one line per module, then the totals

The model library is ``course_lib`` without ``course_lib/instruments/`` and ``course_lib/course/``.
A *code line* is a line that holds code: not blank, not a comment, not part of a docstring.
A *check line* is a code line of an argument check:

- a ``raise`` statement,
- an ``if`` block whose body only raises (its condition lines included),
- a call of a check helper (a function whose name starts with ``check_`` or ``require_``,
  or ``_check_``/``_require_``), as a statement or assigned to a name.
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "course_lib"


def _lines_of(node: ast.AST) -> set[int]:
    return set(range(node.lineno, node.end_lineno + 1))


def _is_check_call(node: ast.AST) -> bool:
    if isinstance(node, (ast.Expr, ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Call):
        func = node.value.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        return name.lstrip("_").startswith(("check_", "require_"))
    return False


def _only_raises(node: ast.If) -> bool:
    return all(isinstance(s, ast.Raise) for s in node.body) and (
        not node.orelse or (len(node.orelse) == 1 and isinstance(node.orelse[0], ast.If)
                            and _only_raises(node.orelse[0]))
    )


def measure(path: Path) -> tuple[int, int, int]:
    """(lines, code lines, check lines) of one file."""
    source = path.read_text()
    tree = ast.parse(source)
    docstrings: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                docstrings |= _lines_of(body[0])
    code: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                            tokenize.DEDENT, tokenize.ENDMARKER):
            code |= set(range(tok.start[0], tok.end[0] + 1))
    code -= docstrings
    checks: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) or _is_check_call(node):
            checks |= _lines_of(node)
        elif isinstance(node, ast.If) and _only_raises(node):
            checks |= _lines_of(node)
    return len(source.splitlines()), len(code), len(checks & code)


def main() -> None:
    files = sorted(p for p in ROOT.rglob("*.py")
                   if not {"course", "instruments"} & set(p.relative_to(ROOT).parts[:-1]))
    total = [0, 0, 0]
    print(f"{'module':<28}{'lines':>7}{'code':>7}{'checks':>8}")
    for path in files:
        lines, code, checks = measure(path)
        total = [total[0] + lines, total[1] + code, total[2] + checks]
        print(f"{str(path.relative_to(ROOT.parent)):<28}{lines:>7}{code:>7}{checks:>8}")
    share = total[2] / max(total[1], 1)
    print(f"{'model library':<28}{total[0]:>7}{total[1]:>7}{total[2]:>8}   "
          f"check share {share:.2%} of code lines, {len(files)} files")


if __name__ == "__main__":
    sys.exit(main())
