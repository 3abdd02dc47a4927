"""Lines of code of the mirrord package: lines holding code, not blank, not only a comment, not a docstring.

    python -m bench.loc [PACKAGE_DIR]      the total, then each module's count (largest first)

A line counts when a token other than a comment or a line break starts on it or runs across it (a
multi-line string counts each of its lines); the lines of a module's, class's or function's docstring
do not. The simplify issue's budget (10,500) is measured with this script.
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from pathlib import Path

_NOT_CODE = {
    tokenize.COMMENT,
    tokenize.NL,
    tokenize.NEWLINE,
    tokenize.INDENT,
    tokenize.DEDENT,
    tokenize.ENCODING,
    tokenize.ENDMARKER,
}


def docstring_lines(tree: ast.AST) -> set[int]:
    """The line numbers that docstrings span in a parsed module."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                lines.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return lines


def count_source(source: str) -> int:
    """Lines of code in one module's source."""
    code: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in _NOT_CODE:
            code.update(range(token.start[0], token.end[0] + 1))
    return len(code - docstring_lines(ast.parse(source)))


def count_package(root: Path) -> dict[str, int]:
    """Lines of code per module below `root` (paths relative to root's parent)."""
    return {
        str(path.relative_to(root.parent)): count_source(path.read_text(encoding="utf-8"))
        for path in sorted(root.rglob("*.py"))
    }


def main(argv: list[str]) -> int:
    """Print the total and the per-module counts."""
    root = Path(argv[0]) if argv else Path(__file__).resolve().parent.parent / "mirrord"
    counts = count_package(root)
    print(f"{sum(counts.values())} lines of code in {len(counts)} modules of {root.name}/")
    for name, lines in sorted(counts.items(), key=lambda item: (-item[1], item[0])):
        print(f"{lines:6d}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
