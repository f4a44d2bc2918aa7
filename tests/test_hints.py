"""Hints give the idea and name the API; they never give a line of the answer.

Chapter 00 promises this, and this test keeps the promise for every exercise of every solution
notebook: no hint of an exercise contains, in its code, one of the exercise's solution statements,
a call chain of them (``logits[:, :-1].reshape(-1, vocab)``, ``torch.softmax(scores, dim=-1)``:
two or more steps of calls, indexing or attributes, one of them a call with arguments or an
index) or one of their slices that select positions (``[:, :-1]``, not ``[:, None]``). Code is compared as Python prints it back
(``ast.unparse``) with white space removed, so spacing and quotes do not hide a copy; the names
must match, as they do when a hint hands over the line.
"""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

import nbformat
import pytest

from course_lib.course.exercises import BEGIN, END, GRADED_TAG, SOLUTION_ONLY_TAG

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))
HINT_START = "<details><summary>Hint"
CODE_SPAN = re.compile(r"```(?:python)?\n(.*?)```|`([^`\n]+)`", re.S)
MIN_STATEMENT = 12  # shorter statements (`return x`, `i += 1`) say nothing a name does not
MIN_CHAIN = 8


def _squeeze(code: str) -> str:
    """``code`` as Python prints it back, without white space (as is, if it does not parse)."""
    try:
        code = ast.unparse(ast.parse(code.strip()))
    except SyntaxError:
        pass
    return re.sub(r"\s+", "", code)


def _trailers(node: ast.expr) -> tuple[int, bool]:
    """How many calls, indexings and attributes ``node`` chains, and whether one of them is a
    call with arguments or an indexing."""
    steps, specific = 0, False
    while isinstance(node, ast.Call | ast.Subscript | ast.Attribute):
        steps += 1
        if isinstance(node, ast.Subscript) or (
                isinstance(node, ast.Call) and (node.args or node.keywords)):
            specific = True
        node = node.func if isinstance(node, ast.Call) else node.value
    return steps, specific


def _bounded_slice(index: ast.expr) -> bool:
    """Whether an index holds a slice with a bound or a step (``[:, :-1]``, ``[1:]``), which
    selects positions; ``[:, None]`` and ``[..., :]`` only reshape or take everything."""
    parts = index.elts if isinstance(index, ast.Tuple) else [index]
    return any(isinstance(part, ast.Slice) and (part.lower or part.upper or part.step)
               for part in parts)


def solution_pieces(code: str) -> set[str]:
    """The statements, call chains and slices of a solution block, squeezed (see the module)."""
    try:
        tree = ast.parse(textwrap.dedent(code))
    except SyntaxError:
        return set()
    pieces = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign | ast.AugAssign | ast.Return | ast.Expr | ast.AnnAssign):
            text = _squeeze(ast.unparse(node))
            if len(text) >= MIN_STATEMENT:
                pieces.add(text)
        if isinstance(node, ast.expr):
            steps, specific = _trailers(node)
            text = _squeeze(ast.unparse(node))
            if steps >= 2 and specific and len(text) >= MIN_CHAIN:
                pieces.add(text)
        if isinstance(node, ast.Subscript) and _bounded_slice(node.slice):
            pieces.add(_squeeze(f"[{ast.unparse(node.slice)}]").replace("(", "").replace(")", ""))
    return pieces


def _blocks(source: str) -> list[str]:
    """The solution blocks of a code cell (the lines between the markers)."""
    return re.findall(rf"{re.escape(BEGIN)}\n(.*?)\n[ \t]*{re.escape(END)}", source, re.S)


def exercises(nb: nbformat.NotebookNode) -> list[tuple[int, list[str], list[str]]]:
    """Per graded cell, in order: (its number, the code of the hints before it since the previous
    graded cell, the solution code before it)."""
    found, hints, code = [], [], []
    for cell in nb.cells:
        tags = cell.get("metadata", {}).get("tags", [])
        if cell.cell_type == "markdown" and cell.source.startswith(HINT_START):
            hints += [a or b for a, b in CODE_SPAN.findall(cell.source)]
        elif cell.cell_type == "code" and GRADED_TAG in tags:
            found.append((len(found) + 1, hints, code))
            hints, code = [], []
        elif cell.cell_type == "code":
            code += [cell.source] if SOLUTION_ONLY_TAG in tags else _blocks(cell.source)
    return found


def given_away(hint_code: list[str], solution_code: list[str]) -> list[str]:
    """The pieces of the solution that the hints' code contains."""
    hints = [_squeeze(span) for span in hint_code]
    hints += [h.replace("(", "").replace(")", "") for h in hints]
    pieces = set().union(*(solution_pieces(code) for code in solution_code))
    return sorted(piece for piece in pieces if any(piece in hint for hint in hints))


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.stem)
def test_no_hint_gives_a_line_of_its_solution(path):
    nb = nbformat.read(path, as_version=4)
    chapter = int(path.name[:2])
    leaks = {f"{chapter}.{number}": given_away(hints, code)
             for number, hints, code in exercises(nb)}
    leaks = {exercise: pieces for exercise, pieces in leaks.items() if pieces}
    assert not leaks, f"hints that hand over the solution's code: {leaks}"


def test_the_rule_catches_a_line_a_chain_and_a_slice():
    solution = ["predictions = logits[:, :-1].reshape(-1, vocab)\n"
                "return F.cross_entropy(predictions, ids[:, 1:].reshape(-1))"]
    assert given_away(["F.cross_entropy(predictions, ids[:, 1:].reshape(-1))"], solution)
    assert given_away(["logits[:, :-1].reshape(-1,vocab)"], solution)  # a chain, spaced otherwise
    assert given_away(["[:, :-1]"], solution)  # a slice
    assert not given_away(["F.cross_entropy", ".reshape", "Tensor.reshape(-1)"], solution)
    assert not given_away(["logits[:, t]", "x[:, None]"], solution + ["y = x[:, None] * 2"])


def test_every_solution_notebook_has_exercises_with_hints():
    for path in SOLUTIONS:
        found = exercises(nbformat.read(path, as_version=4))
        assert found and sum(bool(hints) for _, hints, _ in found) >= len(found) // 2, path.name
