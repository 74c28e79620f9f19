"""gg's object model: content names, thunk files, placeholders, force_thunk's rewriting."""

from __future__ import annotations

import pytest
from pocketflow_gg.errors import InvalidName, InvalidThunk
from pocketflow_gg.objects import (
    content_name,
    file_name,
    is_thunk,
    placeholder,
    placeholders_in,
    replace_placeholders,
    size_of,
)
from pocketflow_gg.proto import ProtoSyntaxError, ThunkMessage, parse_proto
from pocketflow_gg.thunk import Thunk

# gg's examples/fibonacci/README.md: `gg-hash` of fib and add, and the fib(10) thunk.
FIB = "VOIOYOzqPDKzUblafpIDyiGTKyymk0dPT_CKLaRdBFZA004c5670"
ADD = "V5tpA.GDOUdjLVlBznCj61Fi8HvqGhIcV67Ni3YvOkEE001bc520"
FIB10 = "TIUi7P.HZPSfs0EsjWHBuJ5E8fItQQrIC_Z_b8eo05mM00000125"


def fib_thunk(n: int) -> Thunk:
    return Thunk(
        function_hash=FIB,
        args=("fib", str(n)),
        envars=(f"FIB_FUNCTION_HASH={FIB}", f"ADD_FUNCTION_HASH={ADD}"),
        executables=((FIB, ""),),
        outputs=("out", "left", "right"),
    )


def test_content_name_of_known_bytes() -> None:
    # SHA-256 of b"" is 47DEQpj8HBSa-_TImW-5JCeuQeRkm5NMpJWZG3hSuFU= in URL-safe base64.
    assert content_name(b"") == "V47DEQpj8HBSa._TImW.5JCeuQeRkm5NMpJWZG3hSuFU00000000"
    assert content_name(b"abc") == "VungWv48Bz.pBQUDeXa4iI7ADYaOWF3qctBD_YfIAFa000000003"
    assert content_name(b"##GGTHUNK##")[0] == "T"
    assert size_of(content_name(b"x" * 300)) == 300


def test_file_name_matches_content_name(tmp_path) -> None:
    path = tmp_path / "blob"
    data = bytes(range(256)) * 9000  # several read chunks
    path.write_bytes(data)
    assert file_name(path) == content_name(data)


def test_fib10_thunk_has_ggs_name() -> None:
    thunk = fib_thunk(10)
    assert thunk.name == FIB10
    assert thunk.data.startswith(b"##GGTHUNK##")
    assert len(thunk.data) == 0x125
    assert fib_thunk(11).name != FIB10


def test_thunk_round_trips_through_its_file() -> None:
    thunk = Thunk(
        function_hash=FIB,
        args=("fib", placeholder(ADD)),
        envars=("A=1",),
        values=((content_name(b"v2"), "b.txt"), (content_name(b"v1"), "")),
        thunks=((FIB10, "left"),),
        executables=((FIB, ""), (ADD, "bin/add")),
        outputs=("out",),
        timeout_ms=5000,
        links=(("x", "y"),),
    )
    parsed = Thunk.parse(thunk.data)
    assert parsed == thunk
    assert parsed.name == thunk.name
    message = ThunkMessage.FromString(thunk.data[len(b"##GGTHUNK##"):])
    assert message.timeout == 5000
    assert list(message.thunks) == [f"{FIB10}=left"]
    # Entries are serialized sorted by name, whatever order they were given in.
    assert list(message.values) == sorted(message.values)
    assert list(message.executables) == [f"{ADD}=bin/add", FIB]


def test_entry_order_does_not_change_the_name() -> None:
    one, two = content_name(b"1"), content_name(b"2")
    a = Thunk(function_hash=FIB, args=("f",), values=((one, "a"), (two, "b")),
              executables=((FIB, ""),), outputs=("o",))
    b = Thunk(function_hash=FIB, args=("f",), values=((two, "b"), (one, "a")),
              executables=((FIB, ""),), outputs=("o",))
    assert a.name == b.name


def test_reducing_a_dependency_rewrites_the_thunk_and_its_name() -> None:
    dep = fib_thunk(9)
    parent = Thunk(function_hash=ADD, args=("add", placeholder(dep.name)),
                   thunks=((dep.name, "left"),), executables=((ADD, ""),), outputs=("out",))
    result = content_name(b"34")
    reduced = parent.reduced({dep.name: result})
    assert reduced.name != parent.name
    assert reduced.thunks == ()
    assert reduced.values == ((result, "left"),)
    assert reduced.args == ("add", placeholder(result))
    assert parent.reduced({}) is parent


def test_placeholders() -> None:
    text = f"--in={placeholder(ADD)} {placeholder(FIB10 + '#left')}"
    assert placeholders_in(text) == [ADD, FIB10 + "#left"]
    assert replace_placeholders(text, {ADD: "/a", FIB10 + "#left": "/b"}) == "--in=/a /b"


@pytest.mark.parametrize("bad", ["", "X" + FIB[1:], FIB[:-1], FIB + "0", FIB.replace("O", "-")])
def test_bad_names_are_refused(bad: str) -> None:
    with pytest.raises(InvalidName):
        is_thunk(bad)


def test_bad_thunks_are_refused() -> None:
    with pytest.raises(InvalidThunk, match="magic"):
        Thunk.parse(b"not a thunk")
    with pytest.raises(InvalidThunk, match="cannot parse"):
        Thunk.parse(b"##GGTHUNK##\xff\xff\xff")
    with pytest.raises(InvalidThunk, match="output"):
        Thunk(function_hash=FIB, args=("f",), executables=((FIB, ""),), outputs=())
    with pytest.raises(InvalidThunk, match="executable"):
        Thunk(function_hash=FIB, args=("f",), outputs=("o",))
    with pytest.raises(InvalidThunk, match="names a thunk"):
        Thunk(function_hash=FIB, args=("f",), values=((FIB10, ""),),
              executables=((FIB, ""),), outputs=("o",))


def test_proto_reader_refuses_what_it_does_not_know() -> None:
    with pytest.raises(ProtoSyntaxError):
        parse_proto('syntax = "proto3";\nmessage A {\n  oneof x { string a = 1; }\n}\n',
                    file_name="t.proto")
    with pytest.raises(ProtoSyntaxError, match="unknown field type"):
        parse_proto("message A {\n  Missing m = 1;\n}\n", file_name="t.proto")
