"""The client's value classes (``pocketflow.records``) behave as the frozen dataclasses and
``typing.NamedTuple``s they replaced: immutable, equal and hashed by their fields, shown with
their fields, changed by ``replace`` (checked as a new value is), and pickled whole (Ray and
Lithops ship handles and server infos to their workers)."""

from __future__ import annotations

import copy
import pickle

import pytest

from pocketflow.client import ObjectInfo
from pocketflow.config import ClientConfig
from pocketflow.errors import InvalidRequest
from pocketflow.handle import NO_ROUTES, EarlierMap, JobHandle, LostServer, Routes, ServerInfo
from pocketflow.layout import View, view_of
from pocketflow.protocol import HEADER_FLAG_PERSIST, ObjectHeader, Reply, RequestOp

TOKEN = "1767225600000." + "cd" * 32


def _info(i: int = 0, **changes: object) -> ServerInfo:
    fields = {"node_id": f"dram-{i}", "address": f"127.0.0.1:{41000 + i}", "tier": "dram",
              "weight": 1.0, "persist": False}
    fields.update(changes)
    return ServerInfo(**fields)  # type: ignore[arg-type]


def _handle() -> JobHandle:
    routes = Routes.of({"hot": ["dram-0"]}, {"shuffle/r1": "hot"})
    return JobHandle("job-1", "sort", 3, (_info(0), _info(1, persist=True)), TOKEN,
                     lost=(LostServer("dram-7", "127.0.0.1:9"),), routes=routes,
                     suspects=("dram-1",), held_weights=(("dram-1", 1.0, True),),
                     earlier=(EarlierMap((("dram-0", 1.0, False),), routes),))


def _values() -> list[object]:
    """One value of each class, with every field away from its default where it has one."""
    return [
        _info(3, weight=0.25, persist=True),
        LostServer("nvme-2", "127.0.0.1:7"),
        Routes.of({"hot": ["dram-0", "dram-1"]}, {"a/b": "hot"}),
        _handle(),
        EarlierMap((("dram-0", 0.5, True), ("dram-1", 0.0, False)),
                   Routes.of({"hot": ["dram-0"]}, {"a": "hot"})),
        ObjectInfo("k", 12, True),
        ClientConfig(block_size_bytes=65536, io_threads=2, small_ops="flight",
                     explicit=frozenset({"io_threads"})),
    ]


@pytest.mark.parametrize("value", _values(), ids=lambda v: type(v).__name__)
def test_a_value_is_immutable(value: object) -> None:
    field = type(value).__slots__[0]
    before = getattr(value, field)
    with pytest.raises(AttributeError, match="frozen"):
        setattr(value, field, before)
    with pytest.raises(AttributeError, match="frozen"):
        delattr(value, field)
    with pytest.raises(AttributeError):
        value.not_a_field = 1  # type: ignore[attr-defined]
    assert getattr(value, field) == before


@pytest.mark.parametrize("value", _values(), ids=lambda v: type(v).__name__)
def test_a_value_pickles_and_copies_to_an_equal_value_with_the_same_hash(value: object) -> None:
    for restored in (pickle.loads(pickle.dumps(value, protocol=p)) for p in (2, 5)):
        assert type(restored) is type(value)
        assert restored == value and hash(restored) == hash(value)
        assert repr(restored) == repr(value)
    assert copy.copy(value) == value and copy.deepcopy(value) == value
    assert {value: 1}[copy.deepcopy(value)] == 1


@pytest.mark.parametrize("value", _values(), ids=lambda v: type(v).__name__)
def test_replace_changes_one_field_and_keeps_the_rest(value: object) -> None:
    fields = type(value).__slots__
    same = value.replace()  # type: ignore[attr-defined]
    assert same == value and same is not value
    with pytest.raises(TypeError, match="no field"):
        value.replace(no_such_field=1)  # type: ignore[attr-defined]
    # A field changed to another value of its kind makes an unequal value. (Routes: dropping
    # the pools would leave a route naming no pool.)
    field = "routes" if isinstance(value, Routes) else fields[0]
    changed = value.replace(**{field: _other(getattr(value, field))})  # type: ignore[attr-defined]
    assert getattr(changed, field) != getattr(value, field)
    assert changed != value
    for name in fields:
        if name != field:
            assert getattr(changed, name) == getattr(value, name)


def _other(current: object) -> object:
    if isinstance(current, str):
        return current + "x"
    if isinstance(current, int):
        return current + 1
    if isinstance(current, tuple):
        return ()
    raise AssertionError(current)


def test_equality_is_by_class_and_fields() -> None:
    assert _info(1) == _info(1) and hash(_info(1)) == hash(_info(1))
    assert _info(1) != _info(2)
    assert _info(1) != ("dram-1", "127.0.0.1:41001", "dram", 1.0, False)
    assert LostServer("a", "h:1") != ObjectInfo("a", 1)
    assert len({_info(1), _info(1), _info(2)}) == 2


def test_replace_checks_the_new_value_as_the_constructor_does() -> None:
    info = _info()
    with pytest.raises(InvalidRequest, match="weight"):
        info.replace(weight=-1.0)
    with pytest.raises(InvalidRequest, match="host:port"):
        info.replace(address="nowhere")
    assert info.replace(weight=1 / 3).weight == 0.333333
    handle = _handle()
    with pytest.raises(InvalidRequest, match="duplicate node ids"):
        handle.replace(servers=(_info(0), _info(0)))
    with pytest.raises(InvalidRequest, match="block size"):
        handle.replace(block_size_bytes=0)
    assert handle.replace(servers=[_info(5)]).servers == (_info(5),)


def test_repr_names_the_fields() -> None:
    assert repr(_info(2)) == ("ServerInfo(node_id='dram-2', address='127.0.0.1:41002', "
                              "tier='dram', weight=1.0, persist=False)")
    assert repr(ObjectInfo("k", 3)) == "ObjectInfo(key='k', size=3, persist=None)"
    assert repr(NO_ROUTES) == "Routes(pools=(), routes=())"
    # The handle keeps its own short repr (no token, no CA).
    assert TOKEN not in repr(_handle()) and repr(_handle()).startswith("JobHandle(job_id='job-1'")


def test_client_config_equality_ignores_where_the_settings_came_from() -> None:
    a = ClientConfig(io_threads=2, explicit=frozenset({"io_threads"}))
    b = ClientConfig(io_threads=2)
    assert a == b and hash(a) == hash(b)
    assert a.explicit == frozenset({"io_threads"}) and "explicit=" in repr(a)
    assert a != ClientConfig(io_threads=3)
    assert ClientConfig.setting_names()[0] == "block_size_bytes"
    assert "explicit" not in ClientConfig.setting_names()
    assert len(ClientConfig.setting_names()) == 9


def test_the_named_tuples_keep_fields_defaults_methods_and_pickling() -> None:
    header = ObjectHeader(2, 10)
    assert header == (2, 10, 0, 0, 0) and isinstance(header, tuple)
    assert ObjectHeader._fields == ("version", "size", "block_count", "block_size", "flags")
    assert header._replace(flags=HEADER_FLAG_PERSIST).persist and not header.persist
    assert ObjectHeader.decode(header.encode()) == header
    assert pickle.loads(pickle.dumps(header)) == header
    assert ObjectHeader.__module__ == "pocketflow.protocol"
    assert "block-0 record" in (ObjectHeader.__doc__ or "")
    reply = Reply(1, 0, None, memoryview(b"x"))
    assert (reply.request_id, reply.header) == (1, None)
    assert RequestOp._fields[-1] == "value"
    view = view_of(_handle())
    assert isinstance(view, View) and view.epoch == 3 and view.handle == _handle()
    with pytest.raises(AttributeError):
        header.size = 3  # type: ignore[misc]


def test_a_record_class_must_name_its_fields() -> None:
    from pocketflow.records import Record

    with pytest.raises(TypeError, match="__slots__"):
        type("NoFields", (Record,), {})
