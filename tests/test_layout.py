"""The package's structure: the import graph has no cycle, library code never imports a tool (the
benchmarks, the demo/test builders, the command line, the app or the converter), and the model
modules stay pure (no file, network or tokenizer code)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "gemma4_mlx"
TOOLS = ("gemma4_mlx.bench", "gemma4_mlx.testing", "gemma4_mlx.cli", "gemma4_mlx.__main__", "gemma4_mlx.memory.__main__")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str]) -> set[str]:
    """The modules of ours a file imports, relative imports resolved: ``from X import y`` is X.y
    when that is a module, else X."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
    return {m for m in found if m.split(".")[0] in ("gemma4_mlx", "app", "convert") and m != name}


def graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: imports(p, set(files)) for name, p in files.items()}


def test_library_never_imports_tools():
    for name, deps in graph().items():
        if name.startswith(TOOLS):
            continue
        bad = [d for d in deps if d.startswith(TOOLS) or d.split(".")[0] in ("app", "convert")]
        assert not bad, f"{name} imports {bad}"


def test_no_import_cycle():
    g = graph()
    state: dict[str, int] = {}

    def visit(node, path):
        state[node] = 1
        for dep in g.get(node, ()):
            if state.get(dep) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(dep) :] + [dep]))
            if dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for node in g:
        if node not in state:
            visit(node, [node])


def test_models_are_pure():
    """models/ and ops/ import no I/O, tokenizer or generation code of ours."""
    allowed = ("gemma4_mlx.models", "gemma4_mlx.ops", "gemma4_mlx.config", "gemma4_mlx.errors", "gemma4_mlx.modalities")
    for name, deps in graph().items():
        if name.startswith(("gemma4_mlx.models", "gemma4_mlx.ops")):
            ours = {d for d in deps if d.startswith("gemma4_mlx")} - {"gemma4_mlx"}
            assert all(d.startswith(allowed) for d in ours), f"{name} imports {sorted(ours)}"


def test_the_check_can_fail(tmp_path, monkeypatch):
    """A library module importing a tool is caught (the graph above is really read)."""
    global PACKAGE
    fake = tmp_path / "gemma4_mlx"
    (fake / "bench").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "bench" / "__init__.py").write_text("")
    (fake / "loading.py").write_text("from .bench import speed\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    try:
        test_library_never_imports_tools()
    except AssertionError as e:
        assert "gemma4_mlx.loading imports" in str(e)
    else:
        raise AssertionError("the check missed a library module importing a benchmark")
