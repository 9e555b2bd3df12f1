"""The fast tier (`make test`, `-m "not slow"`) starts no process and sends no signal: a
test that does, directly or through a helper or fixture of its module or of conftest.py,
carries the `slow` marker (tests/README.md)."""
import ast
import re
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
# What starts a process or signals one: a Python interpreter's start-up with TensorFlow alone
# costs seconds, and a signal test waits on the process it signals.
PROCESS = re.compile(r"\b(subprocess|Popen|os\.kill|killpg|run_entry_point|run_json_script)\b")


def _segment(lines, node):
    """A node's source lines (ast.get_source_segment splits the whole file at every call)."""
    return "".join(lines[node.lineno - 1:node.end_lineno])


def _functions(tree, source):
    """{name: source} of every function of a module, nested ones too."""
    lines = source.splitlines(keepends=True)
    return {node.name: _segment(lines, node) for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _marked_slow(decorators, lines):
    return any("mark.slow" in _segment(lines, d) for d in decorators)


def _module_marked_slow(tree, lines):
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets):
            if "mark.slow" in _segment(lines, node.value):
                return True
    return False


def _names(text):
    return set(re.findall(r"\b\w+\b", text))


def process_helpers(helpers):
    """The helpers that start a process, themselves or through another helper they name
    (a fixture is named in a test's signature, so fixtures count too)."""
    found = {name for name, body in helpers.items() if PROCESS.search(body)}
    names = {name: _names(body) for name, body in helpers.items()}
    while True:
        more = {name for name in helpers if name not in found and names[name] & found}
        if not more:
            return found
        found |= more


def starts_a_process(text, helpers):
    """Whether `text` starts a process, itself or through a helper it names."""
    return bool(PROCESS.search(text) or _names(text) & process_helpers(helpers))


def fast_tests_starting_processes(path, shared_helpers):
    source = path.read_text()
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    if _module_marked_slow(tree, lines):
        return []
    helpers = {**shared_helpers, **{k: v for k, v in _functions(tree, source).items() if not k.startswith("test_")}}
    starters = process_helpers(helpers)
    found = []
    for cls in [tree, *(n for n in tree.body if isinstance(n, ast.ClassDef))]:
        if isinstance(cls, ast.ClassDef) and _marked_slow(cls.decorator_list, lines):
            continue
        for node in cls.body:
            if (isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
                    and not _marked_slow(node.decorator_list, lines)
                    and (PROCESS.search(text := _segment(lines, node)) or _names(text) & starters)):
                found.append(f"{path.name}::{node.name}")
    return found


def test_no_fast_test_starts_a_process():
    conftest = (TESTS / "conftest.py").read_text()
    shared = {k: v for k, v in _functions(ast.parse(conftest), conftest).items()}
    found = [name for path in sorted(TESTS.glob("test_*.py")) if path.name != Path(__file__).name
             for name in fast_tests_starting_processes(path, shared)]
    assert not found, "start a process outside the slow tier (mark them @pytest.mark.slow): " + ", ".join(found)


def test_the_check_finds_a_process_through_a_helper(tmp_path):
    """The check itself: a test reaching subprocess through a module helper is found,
    the same test marked slow, or in a module marked slow, is not."""
    body = ("import subprocess, pytest\n"
            "def helper():\n    subprocess.run(['true'])\n"
            "def test_a():\n    helper()\n"
            "@pytest.mark.slow\ndef test_b():\n    helper()\n"
            "def test_c():\n    assert 1 + 1 == 2\n")
    path = tmp_path / "test_example.py"
    path.write_text(body)
    assert fast_tests_starting_processes(path, {}) == ["test_example.py::test_a"]
    path.write_text("import pytest\npytestmark = pytest.mark.slow\n" + body)
    assert fast_tests_starting_processes(path, {}) == []


@pytest.mark.parametrize("text", ["os.kill(pid, signal.SIGTERM)", "run_entry_point('train.py', cwd=x)"])
def test_the_check_knows_signals_and_entry_points(text):
    assert starts_a_process(text, {})
