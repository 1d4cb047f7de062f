"""The decode path's shape (issue 48 item 1): a cache owns its state and hands its backend arguments; a backend
reads them and returns the output. A lint over the backends' and kernels' code, and checks of what a layer holds."""

import ast
from dataclasses import fields, replace
from pathlib import Path

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx.core as mx
import pytest

from cartridge.attention import backends, contiguous, policy
from cartridge.attention.caches import CartridgeCache
from cartridge.attention.kernels import cpu, cuda_inputs, metal
from cartridge.attention.pages import make_prefix
from cartridge.attention.prefix import LayerPrefix
from cartridge.tiers import TIERS

ATTENTION = Path(__file__).resolve().parents[2] / "cartridge" / "attention"
# the code a cache's attention call runs after the cache: the backends and the kernels, with their records
DECODE_PATH = sorted([*(ATTENTION / "backends").glob("*.py"), *(ATTENTION / "kernels").glob("*.py"),
                      ATTENTION / "contiguous.py", ATTENTION / "state.py"])


def _root(node):
    """The name an attribute or subscript chain starts from (`a` of `a.b[0].c`), or None."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _targets(target):
    """The single targets of an assignment target (the elements of a tuple or list target)."""
    if isinstance(target, (ast.Tuple, ast.List)):
        return [t for element in target.elts for t in _targets(element)]
    return _targets(target.value) if isinstance(target, ast.Starred) else [target]


def _writes_to_arguments(tree):
    """(line, function, target) of every attribute a function assigns or deletes on one of its arguments other
    than self/cls (`arg.x = ...`, `arg.y.x += ...`), directly or through setattr/delattr/object.__setattr__. An
    item written into an argument (`arg.memo[key] = ...`, `buffer[...] = ...`) is not an attribute: memos of
    what depends only on a call's shape, and arrays a kernel writes, are."""
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        args = fn.args
        params = {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]} - {"self", "cls"}
        params |= {a.arg for a in (args.vararg, args.kwarg) if a is not None}
        name = getattr(fn, "name", "<lambda>")
        for node in ast.walk(fn):
            targets = []
            if isinstance(node, (ast.Assign, ast.Delete)):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            for t in (single for target in targets for single in _targets(target)):
                if isinstance(t, ast.Attribute) and _root(t) in params:
                    found.append((node.lineno, name, ast.unparse(t)))
            if isinstance(node, ast.Call):
                callee = ast.unparse(node.func)
                if callee in ("setattr", "delattr", "object.__setattr__") and node.args \
                        and _root(node.args[0]) in params:
                    found.append((node.lineno, name, f"{callee}({ast.unparse(node.args[0])}, ...)"))
    return found


def test_the_lint_finds_a_callee_writing_its_callers_cache():
    """The check itself: the pattern issue 48 names (a kernel setting `cache.written_from`) is found, in every form."""
    source = ("def attend(record, cache, queries):\n    cache.written_from = 3\n    cache.tail.n += 1\n"
              "    (a, cache.x) = 1, 2\n    setattr(cache, 'scratch', {})\n    self_like = record\n"
              "class K:\n    def m(self, cache):\n        self.keys = cache\n        object.__setattr__(cache, 'k', 1)\n")
    found = _writes_to_arguments(ast.parse(source))
    assert [(line, target) for line, _, target in found] == [
        (2, "cache.written_from"), (3, "cache.tail.n"), (4, "cache.x"), (5, "setattr(cache, ...)"),
        (10, "object.__setattr__(cache, ...)")]


@pytest.mark.parametrize("path", DECODE_PATH, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_backend_or_kernel_writes_an_attribute_of_what_it_was_given(path):
    """A backend's `attend`, a kernel and a record's methods write their own state only (`self.x`), never an
    attribute of an argument: a cache's state (its tail, `written_from`, its scratch) changes in the cache."""
    assert _writes_to_arguments(ast.parse(path.read_text())) == []


@pytest.mark.parametrize("path", DECODE_PATH, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_backend_or_kernel_is_handed_a_cache(path):
    """What the decode path below the cache takes is the cache's tail and scratch (`state`), not the cache."""
    for fn in ast.walk(ast.parse(path.read_text())):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            assert "cache" not in {a.arg for a in [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]}, \
                f"{path.name}:{fn.lineno} {fn.name}"


def _records():
    """A layer's backend record of every kind, built here on the CPU: the CPU's question prefill, CUDA's kernels over
    stored pages and over dense pages (the contiguous buffer), Metal's."""
    k, v = (mx.random.normal((2, 100, 64), key=mx.random.key(s)).astype(mx.float16) for s in (1, 2))
    stored = make_prefix(TIERS["mlx4g32"], k, TIERS["mlx4g32"], v, 32)
    dense = make_prefix(TIERS["fp16"], k, TIERS["fp16"], v, 32)
    return [(stored, cpu.QuestionPrefill()), (stored, cuda_inputs.lay_out(stored)), (dense, contiguous.lay_out(dense)),
            (stored, metal.lay_out(stored))]


def test_a_layer_holds_data_not_a_callable():
    """`LayerPrefix` holds the pages and its backend's record (data: `policy.place` lays it out, a registry entry's
    `attend` reads it), never a function to call; no record is callable, and each names a registry entry."""
    names = {f.name for f in fields(LayerPrefix)}
    assert "kernel" not in names and "backend" in names
    placed, _ = policy.place([_records()[0][0]], "portable", mx.float32, [(64, 64)])
    layers = [placed[0], *(replace(prefix, backend=record) for prefix, record in _records())]
    for layer in layers:
        assert [f.name for f in fields(layer) if callable(getattr(layer, f.name))] == []
    for layer in layers[1:]:
        assert backends.get(layer.backend.name) is not None, type(layer.backend).__name__


class RecordingRecord:
    """The record of the recording backend below: its name only."""

    name = "recording"


def test_the_cache_hands_its_backend_its_tail_and_scratch_and_keeps_written_from():
    """One call through a recording backend: it gets the cache's own chunks (not copies), its length, the lowest
    position written since the previous call (lowered by a trim and rewrite) and the cache's scratch; the cache,
    not the backend, moves `written_from` on after each call."""
    seen = []

    class Recording(backends.AttentionBackend):
        name = "recording"

        def build(self, prefix):
            return RecordingRecord()

        def attend(self, record, prefix, queries, tail, scale, sinks, scratch):
            seen.append((tail, scratch))
            return queries

    entry, (prefix, _) = Recording(), _records()[0]
    backends.REGISTRY.insert(0, entry)
    try:
        cache = CartridgeCache(replace(prefix, backend=entry.build(prefix)))
        x = mx.zeros((1, 2, 5, 64), dtype=mx.float16)
        for feed, trim in ((5, 0), (1, 0), (1, 3)):
            cache.trim(trim)
            cache.update_and_fetch(x[:, :, :feed], x[:, :, :feed])
            cache.attention(mx.zeros((1, 4, feed, 64), dtype=mx.float16), 0.125, None)
    finally:
        backends.REGISTRY.remove(entry)
    assert [(t.length, t.written_from) for t, _ in seen] == [(5, 0), (6, 5), (4, 3)]
    assert all(t.k_chunks is cache.tail_chunks[0] and s is cache.scratch for t, s in seen)
    assert cache.written_from == cache.tail_len == 4
