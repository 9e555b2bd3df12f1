"""No function in capsnet/ is longer than 120 lines (a longer one is split into helpers
that each say what they do)."""
import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_LINES = 120


def test_no_function_of_capsnet_is_longer_than_120_lines():
    long = []
    for path in sorted((REPO / "capsnet").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= MAX_LINES:
                long.append(f"{path.relative_to(REPO)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not long
