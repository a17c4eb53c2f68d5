"""Every name in _native.pyi exists with that signature; the exceptions are as documented."""

import ast
import builtins
import inspect
import pathlib
import queue

import pytest

import tensor_queue as tq
from tensor_queue import _native

PYI = pathlib.Path(tq.__file__).with_name("_native.pyi")


def _stub_items():
    tree = ast.parse(PYI.read_text())
    items = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            items.append((node.name, None, node))
        elif isinstance(node, ast.ClassDef):
            for m in node.body:
                if isinstance(m, ast.FunctionDef):
                    items.append((node.name, m.name, m))
    return items


def _stub_params(fn):
    a = fn.args
    names = [x.arg for x in a.posonlyargs + a.args]
    if names and names[0] in ("self", "cls"):
        names = names[1:]
    return names + [x.arg for x in a.kwonlyargs]


def test_stub_file_is_installed():
    assert PYI.exists(), "the .pyi is not installed with the package"
    assert PYI.with_name("py.typed").exists()


@pytest.mark.parametrize("cls,name,fn", _stub_items(), ids=lambda x: x if isinstance(x, str) else "")
def test_stub_name_exists_with_signature(cls, name, fn):
    obj = getattr(_native, cls if name is None else cls)
    if name is not None:
        assert hasattr(obj, name), f"{cls}.{name} missing"
        static = inspect.getattr_static(obj, name)
        if any(getattr(d, "id", None) == "property" for d in fn.decorator_list):
            assert inspect.isdatadescriptor(static), f"{cls}.{name} is not a property"
            return
        obj = static
        if isinstance(obj, staticmethod):
            obj = obj.__func__
        obj = getattr(_native, cls).__dict__.get(name, obj)
        obj = getattr(getattr(_native, cls), name)
    if name in ("__enter__", "__exit__", "__iter__", "__next__", "__new__", "__dlpack__", "__dlpack_device__"):
        assert callable(obj)
        if name not in ("__new__",):
            return
    if name == "__new__":
        sig = inspect.signature(getattr(_native, cls))
    else:
        try:
            sig = inspect.signature(obj)
        except (TypeError, ValueError):
            pytest.fail(f"{cls}.{name}: no text signature to check")
    got = [p for p in sig.parameters if p not in ("self", "cls", "$self", "$cls")]
    assert got == _stub_params(fn), f"{cls}.{name}: module {sig} vs stub {_stub_params(fn)}"


def test_module_has_no_undocumented_public_names():
    stubbed = {n for n, m, _ in _stub_items()}
    public = {n for n in dir(_native) if not n.startswith("_")}
    assert public <= stubbed | {"version"}, public - stubbed


def test_package_all_names_exist():
    for n in tq.__all__:
        assert hasattr(tq, n), n


BUILTIN = {
    "Disconnected": EOFError,
    "Timeout": TimeoutError,
    "Empty": queue.Empty,
    "Full": queue.Full,
    "NotSendable": TypeError,
    "TooLarge": ValueError,
    "PeerRefused": ConnectionRefusedError,
    "NoReceiver": ConnectionRefusedError,
    "InvalidArgument": ValueError,
    "UsedAfterFork": RuntimeError,
    "NotTheConsumer": RuntimeError,
    "ProducerFailed": None,
    "Rejected": None,
    "RouteRefused": None,
    "ProtocolError": None,
    "Closed": None,
}


@pytest.mark.parametrize("name", list(BUILTIN))
def test_exception_hierarchy(name):
    exc = getattr(tq, name)
    assert issubclass(exc, tq.TensorQueueError)
    assert issubclass(tq.TensorQueueError, Exception)
    if BUILTIN[name] is not None:
        assert issubclass(exc, BUILTIN[name])
    assert exc.__doc__


def test_queue_signature_matches_docs():
    sig = inspect.signature(tq.Queue)
    assert list(sig.parameters) == ["maxsize", "address", "connect_timeout"]
    # put also takes the keyword-only stream= that the docs give every send ("or `stream=`").
    assert list(inspect.signature(tq.Queue.put).parameters) == ["self", "obj", "block", "timeout", "stream"]
    assert inspect.signature(tq.Queue.put).parameters["stream"].kind is inspect.Parameter.KEYWORD_ONLY
    assert list(inspect.signature(tq.Queue.get).parameters) == ["self", "block", "timeout"]


def test_memory_and_doctor_are_public():
    assert callable(tq.memory.usage) and callable(tq.memory.trim)
    assert callable(tq.doctor) and callable(tq.record_stream)
