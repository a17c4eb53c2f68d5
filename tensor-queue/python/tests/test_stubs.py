"""The hand-written stubs match the extension module."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

import tensor_queue
from tensor_queue import _native

STUB = os.path.join(os.path.dirname(tensor_queue.__file__), "_native.pyi")


def stub_names() -> dict[str, set[str] | None]:
    tree = ast.parse(open(STUB).read())
    names: dict[str, set[str] | None] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            names[node.name] = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
        elif isinstance(node, ast.FunctionDef):
            names[node.name] = None
    return names


def test_stub_and_module_name_the_same_things() -> None:
    stubs = stub_names()
    module = {n for n in dir(_native) if not n.startswith("_")}
    assert set(stubs) == module
    for name, members in stubs.items():
        if members is None:
            assert callable(getattr(_native, name))
            continue
        cls = getattr(_native, name)
        public = {n for n in vars(cls) if not n.startswith("__") or n in members}
        public.discard("__new__")
        assert members - {"__new__"} == public, name


def test_the_package_exports_what_it_documents() -> None:
    for name in tensor_queue.__all__:
        assert hasattr(tensor_queue, name), name
    assert os.path.exists(os.path.join(os.path.dirname(tensor_queue.__file__), "py.typed"))


def test_mypy_stubtest() -> None:
    pytest.importorskip("mypy", reason="mypy is not installed: stubtest skipped")
    done = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "tensor_queue._native", "--ignore-missing-stub"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
