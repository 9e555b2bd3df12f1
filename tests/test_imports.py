"""Imports point one way (docs/architecture.md): the graph of capsnet's modules, read from
the source with `ast` (nothing is imported), has no cycle; and a capsnet module is imported
inside a function only where that defers TensorFlow's import (the importer does not import
TensorFlow, the imported module does), with a comment that says so."""
import ast
import functools
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENTRY_POINTS = ("train.py", "evaluate.py", "export.py", "predict.py")
TENSORFLOW = ("tensorflow", "keras", "tensorflow_datasets")


def module_name(path):
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources():
    """{module name: path} of the package, the entry points and the Hydra plugins."""
    paths = [*sorted((REPO / "capsnet").rglob("*.py")), *(REPO / p for p in ENTRY_POINTS),
             *sorted((REPO / "hydra_plugins").rglob("*.py"))]
    return {module_name(path): path for path in paths}


def imports(path, modules):
    """(module imported, line, inside a function) of each import in `path`: `from a import b`
    names a.b where that is a module, else a."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend((alias.name, child.lineno, in_function) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative: from the importing package
                    base = ".".join([*package.split(".")[:len(package.split(".")) - child.level + 1], base]).strip(".")
                for alias in child.names:
                    name = f"{base}.{alias.name}"
                    found.append((name if name in modules else base, child.lineno, in_function))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(ast.parse(path.read_text(), str(path)), False)
    return found


@functools.cache
def graph():
    modules = sources()
    return modules, {name: imports(path, modules) for name, path in modules.items()}


def find_cycle(edges):
    """One cycle of the directed graph {node: {node, ...}} as a list of nodes, or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(edges):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_find_cycle_finds_one_and_only_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"a"}}) == ["a", "a"]


def test_imports_resolve_modules_relative_and_local(tmp_path, monkeypatch):
    pkg = tmp_path / "capsnet"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "one.py").write_text("from capsnet.sub import two\nfrom . import two\n"
                                        "def f():\n    from capsnet.sub.two import thing\n")
    (pkg / "sub" / "two.py").write_text("")
    monkeypatch.setattr(__import__(__name__), "REPO", tmp_path)
    modules = {"capsnet", "capsnet.sub", "capsnet.sub.one", "capsnet.sub.two"}
    assert imports(pkg / "sub" / "one.py", modules) == [("capsnet.sub.two", 1, False), ("capsnet.sub.two", 2, False),
                                                        ("capsnet.sub.two", 4, True)]


def test_capsnet_modules_import_each_other_without_a_cycle():
    """Every import counts, a function's too: a cycle held together by imports inside
    functions is still a cycle of the design."""
    modules, found = graph()
    edges = {name: {target for target, _, _ in targets if target in modules and target != name}
             for name, targets in found.items()}
    assert find_cycle(edges) is None, " -> ".join(find_cycle(edges))


def imports_tensorflow(modules, found):
    """The modules whose import imports TensorFlow (theirs at module level, or a capsnet
    module's that they import at module level)."""
    heavy = {name for name, targets in found.items()
             if any(t.split(".")[0] in TENSORFLOW for t, _, local in targets if not local)}
    changed = True
    while changed:
        changed = False
        for name, targets in found.items():
            if name not in heavy and any(t in heavy for t, _, local in targets if not local):
                heavy.add(name)
                changed = True
    return heavy


def says_why(lines, lineno):
    """Whether a comment naming TensorFlow stands on the import's line, or on a line of the
    run of imports, comments and blank lines right above it."""
    if "#" in lines[lineno - 1] and "TensorFlow" in lines[lineno - 1].split("#", 1)[1]:
        return True
    i = lineno - 2
    while i >= 0:
        text = lines[i].strip()
        if text.startswith("#"):
            if "TensorFlow" in text:
                return True
        elif text and not text.startswith(("import ", "from ")):
            return False
        elif "#" in text and "TensorFlow" in text.split("#", 1)[1]:
            return True
        i -= 1
    return False


def test_a_capsnet_module_is_imported_inside_a_function_only_to_defer_tensorflow():
    modules, found = graph()
    heavy = imports_tensorflow(modules, found)
    local = [(name, target, line) for name, targets in found.items() for target, line, in_function in targets
             if in_function and target in modules]
    assert local, "the entry points import the library after TensorFlow: some imports are local"
    wrong = []
    for name, target, line in local:
        where = f"{modules[name].relative_to(REPO)}:{line} imports {target}"
        if name in heavy:
            wrong.append(f"{where}: {name} imports TensorFlow already (import it at the top)")
        elif target not in heavy:
            wrong.append(f"{where}: {target} does not import TensorFlow (import it at the top)")
        elif not says_why(modules[name].read_text().splitlines(), line):
            wrong.append(f"{where}: no comment naming TensorFlow says why it is imported here")
    assert not wrong, "\n".join(wrong)


def test_the_config_and_the_entry_points_checks_import_no_tensorflow():
    """What runs before the TensorFlow import (the config's checks, the run dir's, predict's
    paths) is free of it, read from the source: the rule the function-local imports serve."""
    modules, found = graph()
    heavy = imports_tensorflow(modules, found)
    light = {"capsnet.cli", "capsnet.config", "capsnet.prediction", "capsnet.training.run_lock", *ENTRY_POINTS}
    assert not {module_name(REPO / m) if m.endswith(".py") else m for m in light} & heavy
    assert {"capsnet.training.loop", "capsnet.data", "capsnet.tasks.single_label"} <= heavy


def private_imports(name, path, modules):
    """(line, module, name) of each `from capsnet... import _name` in module `name` (at
    `path`) that takes a private name from a module of another package: a helper that
    another package needs gets a public name in the module where it belongs."""
    own = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "capsnet":
            is_package = any(m.startswith(node.module + ".") for m in modules)
            package = node.module if is_package else node.module.rpartition(".")[0]
            found.extend((node.lineno, node.module, alias.name) for alias in node.names
                         if alias.name.startswith("_") and package != own)
    return found


def test_private_imports_finds_another_package_s_private_names(tmp_path):
    source = tmp_path / "images.py"
    source.write_text("from capsnet.data.tfds import _shorten, fail_fast\nfrom capsnet.tasks.base import _own\n")
    modules = {"capsnet.data", "capsnet.data.tfds", "capsnet.tasks", "capsnet.tasks.base", "capsnet.tasks.images"}
    assert private_imports("capsnet.tasks.images", source, modules) == [(1, "capsnet.data.tfds", "_shorten")]


def test_no_module_imports_another_package_s_private_helpers():
    modules, _ = graph()
    wrong = [f"{modules[name].relative_to(REPO)}:{line} imports {private} from {module}"
             for name in modules for line, module, private in private_imports(name, modules[name], modules)]
    assert not wrong, "\n".join(wrong)
