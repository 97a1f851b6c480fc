"""``patches.VLLM_INTERNALS`` lists every vLLM internal the plugin touches, and only real ones.

The plugin's own sources are scanned (AST) for the private attributes they read or call and
the vLLM symbols they assign to; ``PolicyBlockPool`` is inspected for the ``BlockPool`` methods
it overrides. Each list must equal the table's. Every table entry is then looked up in the
installed vLLM: private attributes on live vLLM objects, patched and overridden names in the
source of the vLLM module that owns them.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import vllm
from managers import make_manager
from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware
from vllm.v1.core.block_pool import BlockPool

import arc_dev.bench.plugin as bench_plugin
import arc_evictor.vllm_plugin as plugin
from arc_evictor.vllm_plugin import patches
from arc_evictor.vllm_plugin.block_pool import PolicyBlockPool
from arc_evictor.vllm_plugin.patches import VLLM_INTERNALS, VLLM_INTERNALS_BY_SERIES, VllmInternal
from arc_evictor.vllm_plugin.version import SUPPORTED_VLLM, TARGET_VLLM, vllm_series

PLUGIN_DIR = Path(plugin.__file__).parent


def plugin_modules() -> dict[str, ast.Module]:
    return {path.stem: ast.parse(path.read_text()) for path in sorted(PLUGIN_DIR.glob("*.py"))}


def entries(kind: str) -> list[VllmInternal]:
    return [entry for entry in VLLM_INTERNALS.entries if entry.kind == kind]


def names_defined_by_the_plugin(trees: dict[str, ast.Module]) -> set[str]:
    """Functions, methods, ``self.`` attributes and module globals the plugin itself defines."""
    defined: set[str] = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                defined.add(node.name)
            elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Name):
                        defined.add(target.id)
                    elif (
                        isinstance(target, ast.Attribute)
                        and isinstance(target.value, ast.Name)
                        and target.value.id == "self"
                    ):
                        defined.add(target.attr)
    return defined


def vllm_imports(tree: ast.Module) -> dict[str, str]:
    """Local name -> dotted vLLM path, for every ``from vllm... import`` in ``tree``."""
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
            for alias in node.names:
                bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return bound


def dotted(node: ast.expr, bound: dict[str, str]) -> str | None:
    """``a.b.c`` as a dotted vLLM path when ``a`` is a name imported from vLLM, else None."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in bound:
        return None
    return ".".join([bound[node.id], *reversed(parts)])


def resolve(path: str) -> Any:
    """The vLLM module, or the attribute of one, that ``path`` names."""
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError:
        module, name = path.rsplit(".", 1)
        return getattr(importlib.import_module(module), name)


def defined_in_source(owner: str, name: str) -> bool:
    """True when vLLM's source defines ``name`` in class or module ``owner``."""
    target = resolve(owner)
    if isinstance(target, ModuleType):
        scope: list[ast.stmt] = ast.parse(inspect.getsource(target)).body
    else:
        assert target.__module__ == owner.rsplit(".", 1)[0], f"{owner} is defined elsewhere"
        module = ast.parse(inspect.getsource(importlib.import_module(target.__module__)))
        (cls,) = [
            node
            for node in module.body
            if isinstance(node, ast.ClassDef) and node.name == target.__name__
        ]
        scope = cls.body
    defined: set[str] = set()
    for node in scope:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            defined.add(node.name)
        elif isinstance(node, ast.ImportFrom | ast.Import):
            defined |= {alias.asname or alias.name for alias in node.names}
        elif isinstance(node, ast.Assign):
            defined |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return name in defined


def test_the_table_names_the_vllm_version_the_plugin_accepts() -> None:
    series = vllm_series()
    assert VLLM_INTERNALS is VLLM_INTERNALS_BY_SERIES[series]
    assert VLLM_INTERNALS.vllm_version == TARGET_VLLM[series]
    assert set(VLLM_INTERNALS_BY_SERIES) == set(TARGET_VLLM)
    for table in VLLM_INTERNALS_BY_SERIES.values():
        assert table.vllm_version.startswith(SUPPORTED_VLLM)
        keys = [(entry.owner, entry.name) for entry in table.entries]
        assert len(keys) == len(set(keys)), "an entry is listed twice"
        assert all(entry.use for entry in table.entries)
    assert VLLM_INTERNALS_BY_SERIES["0.33"].changes  # what moved since 0.32, and how


def test_every_private_vllm_attribute_the_plugin_reads_or_calls_is_listed() -> None:
    trees = plugin_modules()
    private_accessed = {
        node.attr
        for tree in trees.values()
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
    }
    from_vllm = private_accessed - names_defined_by_the_plugin(trees)
    listed = {entry.name for entry in entries("private")}
    assert from_vllm == listed
    # The scan sees the names the plugin is known to depend on.
    assert {"_block_hash", "_cache", "_partial_hit_reqs", "_maybe_evict_cached_block"} <= from_vllm


def test_every_vllm_symbol_the_plugin_assigns_to_is_listed_as_patched() -> None:
    assigned: set[str] = set()
    for tree in plugin_modules().values():
        bound = vllm_imports(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                assigned |= {path for t in targets if (path := dotted(t, bound)) is not None}
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr":
                pytest.fail("the plugin patches vLLM with setattr, which this scan cannot read")
    listed = {f"{entry.owner}.{entry.name}" for entry in entries("patched")}
    assert assigned == listed
    # The coordinator's BlockPool, five methods (the CPU offload scheduler's __init__ among
    # them), the key middleware.
    assert len(assigned) == 7


def test_every_block_pool_method_the_policy_pool_overrides_is_listed() -> None:
    overridden = {
        name
        for name, value in vars(PolicyBlockPool).items()
        if inspect.isfunction(value) and hasattr(BlockPool, name)
    }
    listed = {entry.name for entry in entries("overridden")}
    assert overridden == listed
    assert {entry.owner for entry in entries("overridden")} == {"vllm.v1.core.block_pool.BlockPool"}


def test_every_listed_private_attribute_exists_on_vllms_own_objects() -> None:
    native_pool = BlockPool(8, enable_caching=True, hash_block_size=4)
    manager = make_manager("lru", num_blocks=8)
    live = [
        native_pool,
        native_pool.cached_block_hash_to_block,
        native_pool.blocks[1],
        manager,
        manager.coordinator.single_type_managers[0],
    ]
    for entry in entries("private"):
        owner = resolve(entry.owner)
        (instance,) = [obj for obj in live if isinstance(obj, owner)]
        assert type(instance).__module__.startswith("vllm."), f"{entry.owner} is not vLLM's"
        assert hasattr(instance, entry.name), f"vLLM {vllm.__version__} has no {entry}"


def test_every_listed_patched_or_overridden_name_is_defined_by_vllm() -> None:
    for entry in [*entries("patched"), *entries("overridden")]:
        assert defined_in_source(entry.owner, entry.name), f"vLLM does not define {entry}"


def test_installing_the_plugin_replaces_every_listed_patched_symbol(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Restored at teardown: the guard is process-wide. ``install`` ran in conftest.
    monkeypatch.setattr(AuthenticationMiddleware, "__call__", AuthenticationMiddleware.__call__)
    patches.guard_every_path()
    for entry in entries("patched"):
        current = getattr(resolve(entry.owner), entry.name)
        # The code object, not __module__: functools.wraps copies vLLM's __module__.
        assert Path(current.__code__.co_filename).parent == PLUGIN_DIR, entry


def test_only_the_block_pool_and_patches_modules_import_vllm_internals() -> None:
    importers = {name for name, tree in plugin_modules().items() if vllm_imports(tree)}
    assert importers == {"block_pool", "patches"}
    bench = ast.parse(Path(bench_plugin.__file__).read_text())
    assert vllm_imports(bench) == {}
