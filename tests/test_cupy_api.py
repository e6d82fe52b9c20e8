"""Every CuPy name the project uses exists in the real `cupy` package, and takes the keywords we
pass it. The stand-in (tests/cupy_standin) would accept a misspelt attribute NumPy happens to
have; this reads the code that runs on the CUDA backend and asks the installed CuPy (which
imports without a GPU) instead. NCCL's calls (workers/planes/nccl/engine.py's `nccl.`, `self.nccl.`) are not
read: without libnccl, which the wheel does not bring, `cupy.cuda.nccl` has no API to ask."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import numpy as np
import pytest

cupy = pytest.importorskip("cupy", reason="the real cupy package is not installed (pip install -e '.[test]' has it)")
if not hasattr(cupy, "cuda") or not hasattr(cupy.cuda, "Stream"):  # the stand-in, not CuPy
    pytest.skip("`cupy` here is not the real package", allow_module_level=True)

ROOT = Path(__file__).resolve().parent.parent
CPU_ONLY_FOLDER = "workers/backends/cpu/"  # the CPU backend's own modules: NumPy and numba only
# code whose `xp` may be CuPy: the shared kernels and what handles device arrays
SOURCES = sorted(
    str(path.relative_to(ROOT))
    for pattern in ("workers/**/*.py", "bench/*.py")
    for path in ROOT.glob(pattern)
    if not str(path.relative_to(ROOT)).startswith(CPU_ONLY_FOLDER)
)
# what each root name stands for, where the code says it
ROOTS = {
    "xp": lambda: cupy,
    "self.xp": lambda: cupy,
    "cupy": lambda: cupy,
    "self.cupy": lambda: cupy,
    "self.runtime": lambda: cupy.cuda.runtime,  # workers/planes/ipc/engine.py's IPC calls
    "cupyx": lambda: __import__("cupyx"),
}
# the CUDA backend's own attributes
BACKEND_ROOTS = {
    "self.compute": lambda: cupy.cuda.Stream,
    "self.copy": lambda: cupy.cuda.Stream,
    "self.device": lambda: cupy.cuda.Device,
    "graph": lambda: cupy.cuda.Graph,
    "array": lambda: cupy.ndarray,  # to_host's device array
}
BACKEND = "workers/backends/cuda/__init__.py"
CUPY_FILES = (
    "workers/backends/cuda/__init__.py",
    "workers/planes/nccl/engine.py",
    "workers/planes/ipc/engine.py",
    "workers/graphs.py",
    "bench/tp_matmul.py",
)
NOT_ARRAY_METHODS = set(dir(dict)) | set(dir(list)) | set(dir(str)) | set(dir(set))
KERNEL_FILES = [s for s in SOURCES if s.startswith(("workers/kernels/", "workers/backends/cuda/"))] + [
    "workers/collectives.py",
    "workers/graphs.py",
]


def _chain(node: ast.AST) -> list[str] | None:
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    names.append(node.id)
    return names[::-1]


def _mark_parents(tree):
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            child.parent = node


def _parameters(obj) -> set[str] | None:
    """The keyword names `obj` accepts (None: any, or not knowable)."""
    if isinstance(obj, type):
        obj = obj.__init__
    if isinstance(obj, cupy.ufunc):
        return {"out", "casting", "dtype"}
    try:
        params = inspect.signature(obj).parameters.values()
        if any(p.kind is p.VAR_KEYWORD for p in params):
            return None
        return {p.name for p in params}
    except (TypeError, ValueError):
        pass
    first = (getattr(obj, "__doc__", None) or "").strip().splitlines()[:1]
    found = re.match(r"[\w.]+\((.*)\)", first[0]) if first else None
    if found is None or "**" in found.group(1):
        return None
    return {m.group(1) for m in re.finditer(r"(\w+)\s*(?:=|,|$)", found.group(1).replace("\\*", ""))}


def _collect():
    uses = []
    for path in SOURCES:
        tree = ast.parse((ROOT / path).read_text())
        _mark_parents(tree)
        called = {id(n.func): n for n in ast.walk(tree) if isinstance(n, ast.Call)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or isinstance(node.parent, ast.Attribute):
                continue
            chain = _chain(node)
            if chain is None:
                continue
            for length in (2, 1):
                root = ".".join(chain[:length])
                applies = root == "xp" or root.startswith("self.xp") or path in CUPY_FILES
                known = root in ROOTS or (path == BACKEND and root in BACKEND_ROOTS)
                if known and len(chain) > length and applies:
                    call = called.get(id(node))
                    keywords = [k.arg for k in call.keywords if k.arg] if call is not None else []
                    uses.append((path, node.lineno, root, chain[length:], keywords))
                    break
    return uses


USES = _collect()


def test_the_scan_sees_the_backend_and_the_kernels():
    roots = {root for _, _, root, _, _ in USES}
    assert {"xp", "self.xp", "self.compute", "self.copy", "cupy"} <= roots
    assert len(USES) > 100


@pytest.mark.parametrize("path", sorted({u[0] for u in USES}))
def test_every_cupy_attribute_and_keyword_exists(path):
    missing = []
    for _, line, root, chain, keywords in (u for u in USES if u[0] == path):
        obj = {**ROOTS, **BACKEND_ROOTS}[root]()
        for name in chain:
            if not hasattr(obj, name):
                missing.append(f"{path}:{line} {root}.{'.'.join(chain)}: no {name!r}")
                obj = None
                break
            obj = getattr(obj, name)
        if obj is None or not callable(obj) or not keywords:
            continue
        accepted = _parameters(obj)
        for keyword in keywords:
            if accepted is not None and keyword not in accepted:
                missing.append(f"{path}:{line} {root}.{'.'.join(chain)}(): no keyword {keyword!r}")
    assert not missing, "\n".join(missing)


def test_every_array_method_the_kernels_call_exists_on_cupy_arrays():
    missing = []
    for path in KERNEL_FILES:
        for node in ast.walk(ast.parse((ROOT / path).read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            name, receiver = node.func.attr, _chain(node.func.value)
            if receiver and receiver[0] in ("xp", "np", "self", "p", "graphs"):
                continue  # module functions and our own objects
            if hasattr(np.ndarray, name) and name not in NOT_ARRAY_METHODS and not hasattr(cupy.ndarray, name):
                missing.append(f"{path}:{node.lineno} .{name}()")
            if hasattr(np.ndarray, name) and hasattr(cupy.ndarray, name) and name not in NOT_ARRAY_METHODS:
                accepted = _parameters(getattr(cupy.ndarray, name))
                for keyword in (k.arg for k in node.keywords if k.arg):
                    if accepted is not None and keyword not in accepted:
                        missing.append(f"{path}:{node.lineno} .{name}(): no keyword {keyword!r}")
    assert not missing, "\n".join(missing)
