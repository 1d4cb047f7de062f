"""The package's import structure (issue 32.3 and 32.4), read from the source with `ast`:

- no import cycle among cartridge/ modules, counting every import: module level and inside functions
  (lazy imports), relative imports resolved, `from pkg import sub` counted as importing the submodule;
- no private name used across modules: `from M import _name`, `alias._name` where alias is an imported
  cartridge module, and `obj._attr` read on anything but `self`/`cls` in a module other than the one
  that defines `_attr` (as a method or an attribute of `self`).
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "cartridge"


def module_name(path):
    """'cartridge.attention.route' for cartridge/attention/route.py ('cartridge.tiers' for its __init__)."""
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def is_package(name):
    return MODULES[name].name == "__init__.py"


def resolve(name, node):
    """The absolute module an `ImportFrom` node names, relative levels resolved against module `name`."""
    if node.level == 0:
        return node.module
    base = name.split(".") if is_package(name) else name.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def owning_module(dotted):
    """The longest prefix of `dotted` that is a cartridge module, or None."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in MODULES:
            return ".".join(parts[:n])
    return None


def imports(name):
    """Yield (node, target module, imported names) for every import in module `name`, lazy ones included:
    `from pkg import sub` yields the submodule `pkg.sub` as the target."""
    for node in ast.walk(TREES[name]):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = owning_module(alias.name)
                if target:
                    yield node, target, []
        elif isinstance(node, ast.ImportFrom):
            base = resolve(name, node)
            if not base or owning_module(base) is None:
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in MODULES:
                    yield node, sub, []
                else:
                    yield node, owning_module(base), [alias.name]


def import_graph():
    """{module: {module it imports}}, self-imports (a package naming its own names) left out."""
    graph = {name: set() for name in MODULES}
    for name in MODULES:
        for _, target, _ in imports(name):
            if target != name:
                graph[name].add(target)
    return graph


def find_cycle(graph):
    """One cycle of `graph` as a list of modules (first == last), or None. Iterative DFS."""
    state = {}
    for start in sorted(graph):
        if start in state:
            continue
        stack, path = [(start, iter(sorted(graph[start])))], [start]
        state[start] = "open"
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                path.pop()
                state[node] = "done"
            elif state.get(child) == "open":
                return path[path.index(child):] + [child]
            elif child not in state:
                state[child] = "open"
                stack.append((child, iter(sorted(graph[child]))))
                path.append(child)
    return None


def test_the_walk_sees_lazy_and_relative_imports():
    graph = import_graph()
    assert len(MODULES) > 50
    assert "cartridge.errors" in graph["cartridge.format.reader"]  # module-level relative import
    assert "cartridge.calibrate" in graph["cartridge.cli.common"]  # only inside a function
    assert "cartridge.attention.kernels.cuda" in graph["cartridge.attention.backends.cuda"]  # lazy as well
    assert "cartridge.attention.auto_table" in graph["cartridge.attention.backends.proof"]  # from .. import sub
    assert "cartridge.attention" not in graph["cartridge.attention.backends.proof"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def private_imports():
    """'module: from M import _name' for every private name imported from another cartridge module."""
    found = []
    for name in MODULES:
        for node, target, names in imports(name):
            for imported in names:
                if imported.startswith("_") and not imported.startswith("__") and target != name:
                    found.append(f"{name}:{node.lineno}: from {target} import {imported}")
    return found


def module_aliases(name):
    """{local name: cartridge module} for the modules that `name` imports as names."""
    aliases = {}
    for node, target, names in imports(name):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and owning_module(alias.name) == alias.name:
                    aliases[alias.asname] = alias.name
        elif not names:
            for alias in node.names:
                aliases[alias.asname or alias.name] = target
    return aliases


def defined_private_attributes(name):
    """Private names a module defines on its classes: methods, class attributes, and `self._x = ...`."""
    names = set()
    for node in ast.walk(TREES[name]):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(item.name)
                elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                    for t in (item.targets if isinstance(item, ast.Assign) else [item.target]):
                        if isinstance(t, ast.Name):
                            names.add(t.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                names.add(node.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def private_attribute_reads():
    """'module:line: x._name' for every private attribute reached on an imported module, or on any object
    other than self/cls when the attribute is defined only by other modules' classes."""
    defined = {name: defined_private_attributes(name) for name in MODULES}
    found = []
    for name, tree in TREES.items():
        aliases = module_aliases(name)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                continue
            owner = node.value.id if isinstance(node.value, ast.Name) else None
            if owner in ("self", "cls"):
                continue
            if owner in aliases:
                if aliases[owner] != name:
                    found.append(f"{name}:{node.lineno}: {owner}._{node.attr[1:]} ({aliases[owner]})")
            elif node.attr not in defined[name] and any(node.attr in d for d in defined.values()):
                where = sorted(m for m, d in defined.items() if node.attr in d)
                found.append(f"{name}:{node.lineno}: {ast.unparse(node)} (defined in {', '.join(where)})")
    return found


def test_the_private_checks_find_what_they_look_for(monkeypatch):
    source = ("from cartridge.read import load\nfrom .write.build import _planted\n"
              "def f(cart):\n    return load._planted_too, cart._planted_attr, cart._own\n"
              "class C:\n    def __init__(self):\n        self._own = 1\n")
    monkeypatch.setitem(MODULES, "cartridge.planted", PACKAGE / "planted.py")
    monkeypatch.setitem(TREES, "cartridge.planted", ast.parse(source))
    monkeypatch.setitem(TREES, "cartridge.errors", ast.parse("class E:\n    _planted_attr = 1\n"))
    assert [r for r in private_imports() if r.startswith("cartridge.planted")] == [
        "cartridge.planted:2: from cartridge.write.build import _planted"]
    assert [r for r in private_attribute_reads() if r.startswith("cartridge.planted")] == [
        "cartridge.planted:4: load._planted_too (cartridge.read.load)",
        "cartridge.planted:4: cart._planted_attr (defined in cartridge.errors)"]


def test_no_private_name_imported_across_modules():
    assert private_imports() == []


def test_no_private_attribute_read_across_modules():
    assert private_attribute_reads() == []
