"""gg's protobuf messages, built at import time from ``gg.proto`` (next to this file).

The schema is read with a parser for the small subset of proto3 that file uses (one package,
messages whose fields are scalars, messages, ``repeated`` and ``map<string, string>``) and turned
into message classes with protobuf's runtime descriptor API, so nothing generated is checked in
and ``pip install -e`` on a clean machine needs only the ``protobuf`` package.
"""

from __future__ import annotations

import re
from pathlib import Path

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

PROTO_PATH = Path(__file__).with_name("gg.proto")

_Field = descriptor_pb2.FieldDescriptorProto
_SCALARS = {
    "string": _Field.TYPE_STRING,
    "bytes": _Field.TYPE_BYTES,
    "uint32": _Field.TYPE_UINT32,
    "uint64": _Field.TYPE_UINT64,
    "int32": _Field.TYPE_INT32,
    "int64": _Field.TYPE_INT64,
    "bool": _Field.TYPE_BOOL,
}
_FIELD = re.compile(r"^(repeated\s+)?(\w+)\s+(\w+)\s*=\s*(\d+)\s*;$")
_MAP_FIELD = re.compile(r"^map<\s*(\w+)\s*,\s*(\w+)\s*>\s+(\w+)\s*=\s*(\d+)\s*;$")


class ProtoSyntaxError(ValueError):
    """``gg.proto`` uses something outside the subset this module reads."""


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


def _scalar_or_message(type_name: str, package: str, messages: set[str]) -> tuple[int, str]:
    if type_name in _SCALARS:
        return _SCALARS[type_name], ""
    if type_name in messages:
        return _Field.TYPE_MESSAGE, f".{package}.{type_name}"
    raise ProtoSyntaxError(f"unknown field type {type_name!r}")


def parse_proto(text: str, *, file_name: str) -> descriptor_pb2.FileDescriptorProto:
    """A ``FileDescriptorProto`` for ``text`` (the subset described in the module doc)."""
    lines = [re.sub(r"//.*", "", line).strip() for line in text.splitlines()]
    lines = [line for line in lines if line]
    package = ""
    messages = {m.group(1) for line in lines if (m := re.match(r"^message\s+(\w+)\s*\{$", line))}
    fdp = descriptor_pb2.FileDescriptorProto(name=file_name, syntax="proto3")
    current: descriptor_pb2.DescriptorProto | None = None
    for line in lines:
        if m := re.match(r'^syntax\s*=\s*"proto3"\s*;$', line):
            continue
        if m := re.match(r"^package\s+([\w.]+)\s*;$", line):
            package = m.group(1)
            fdp.package = package
        elif m := re.match(r"^message\s+(\w+)\s*\{$", line):
            if current is not None:
                raise ProtoSyntaxError("nested messages are not supported")
            current = fdp.message_type.add(name=m.group(1))
        elif line == "}":
            if current is None:
                raise ProtoSyntaxError("unbalanced '}'")
            current = None
        elif current is not None and (m := _MAP_FIELD.match(line)):
            key_type, value_type, name, number = m.groups()
            entry = current.nested_type.add(name=f"{_camel(name)}Entry")
            entry.options.map_entry = True
            for entry_name, entry_number, entry_type in (("key", 1, key_type),
                                                         ("value", 2, value_type)):
                kind, type_ref = _scalar_or_message(entry_type, package, messages)
                field = entry.field.add(name=entry_name, number=entry_number, type=kind,
                                        label=_Field.LABEL_OPTIONAL)
                if type_ref:
                    field.type_name = type_ref
            current.field.add(name=name, number=int(number), type=_Field.TYPE_MESSAGE,
                              label=_Field.LABEL_REPEATED,
                              type_name=f".{package}.{current.name}.{entry.name}")
        elif current is not None and (m := _FIELD.match(line)):
            repeated, type_name, name, number = m.groups()
            kind, type_ref = _scalar_or_message(type_name, package, messages)
            field = current.field.add(
                name=name, number=int(number), type=kind,
                label=_Field.LABEL_REPEATED if repeated else _Field.LABEL_OPTIONAL,
            )
            if type_ref:
                field.type_name = type_ref
        else:
            raise ProtoSyntaxError(f"cannot read line {line!r}")
    if current is not None:
        raise ProtoSyntaxError("message not closed")
    return fdp


def _load() -> tuple[type, type]:
    fdp = parse_proto(PROTO_PATH.read_text(encoding="utf-8"), file_name="pocketflow_gg/gg.proto")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    function = message_factory.GetMessageClass(pool.FindMessageTypeByName("gg.protobuf.Function"))
    thunk = message_factory.GetMessageClass(pool.FindMessageTypeByName("gg.protobuf.Thunk"))
    return function, thunk


FunctionMessage, ThunkMessage = _load()
"""The ``gg.protobuf.Function`` and ``gg.protobuf.Thunk`` message classes."""
