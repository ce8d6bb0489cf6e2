"""Decode Kubernetes protobuf request bodies of core kinds into JSON objects.

client-go's typed clients (so ``kubectl create namespace/configmap/secret``, ``kubectl run``, ...)
send built-in kinds as ``application/vnd.kubernetes.protobuf``. The CRD server cannot decode
protobuf (it even panics on it), so the shim transcodes such bodies to JSON first. The schema comes
from Kubernetes' own ``generated.proto`` files (prepare.sh copies them from the Debian source
packages next to the binaries); this module parses just enough of the proto2 syntax they use and
maps the special types (Time, Quantity, IntOrString, RawExtension, FieldsV1, []byte) to their JSON
forms. Responses need nothing: clients also accept JSON.
"""

from __future__ import annotations

import base64
import json
import re
import struct
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

MAGIC = b"k8s\x00"  # prefix of every Kubernetes protobuf body; then a runtime.Unknown envelope
META = "k8s.io.apimachinery.pkg.apis.meta.v1"
CORE = "k8s.io.api.core.v1"
VARINT_TYPES = frozenset({"int32", "int64", "uint32", "uint64", "bool", "sint32", "sint64"})
SCALARS = VARINT_TYPES | {"string", "bytes", "double", "float", "fixed32", "fixed64", "sfixed32", "sfixed64"}


@dataclass(frozen=True)
class Field:
    name: str
    type: str  # scalar name or a (still unresolved) message name
    repeated: bool
    scope: str  # fully qualified name of the message that declares it (to resolve `type`)
    map_types: tuple[str, str] | None = None


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7


class ProtoSchema:
    """Messages of a set of generated.proto files, by fully qualified name."""

    def __init__(self, files: list[Path]) -> None:
        self.messages: dict[str, dict[int, Field]] = {}
        for path in files:
            self._parse(path.read_text())

    def _parse(self, text: str) -> None:
        package, stack = "", list[str]()
        for raw in text.splitlines():
            line = raw.split("//", 1)[0].strip()
            if match := re.match(r"package\s+([\w.]+)\s*;", line):
                package = match[1]
            elif match := re.match(r"(message|enum|oneof)\s+(\w+)\s*\{", line):
                scope = stack[-1] if stack else package
                stack.append(f"{scope}.{match[2]}" if match[1] == "message" else "")
                if match[1] == "message":
                    self.messages[stack[-1]] = {}
            elif line.startswith("}"):
                stack.pop()
            elif (
                stack
                and stack[-1]
                and (match := re.match(r"map<\s*([\w.]+)\s*,\s*([\w.]+)\s*>\s+(\w+)\s*=\s*(\d+)", line))
            ):
                field = Field(match[3], "", False, stack[-1], (match[1], match[2]))
                self.messages[stack[-1]][int(match[4])] = field
            elif (
                stack
                and stack[-1]
                and (match := re.match(r"(optional|repeated|required)?\s*([\w.]+)\s+(\w+)\s*=\s*(\d+)", line))
            ):
                field = Field(match[3], match[2], match[1] == "repeated", stack[-1])
                self.messages[stack[-1]][int(match[4])] = field

    def resolve(self, type_name: str, scope: str) -> str:
        if type_name in SCALARS:
            return type_name
        name = type_name.lstrip(".")
        parts = scope.split(".")
        for i in range(len(parts), -1, -1):  # innermost scope first, as protoc resolves
            candidate = ".".join([*parts[:i], name])
            if candidate in self.messages:
                return candidate
        raise ValueError(f"unknown protobuf type {type_name!r} (in {scope})")

    # ---- decoding ---------------------------------------------------------------------------

    def decode_body(self, body: bytes) -> dict[str, Any]:
        """A whole request body (magic + runtime.Unknown) -> the object as JSON-ready dict."""
        if not body.startswith(MAGIC):
            raise ValueError("not a Kubernetes protobuf body (no k8s\\0 prefix)")
        envelope = self._fields(body[len(MAGIC) :])
        type_meta = self._fields(envelope.get(1, [b""])[0])
        api_version = type_meta.get(1, [b""])[0].decode()
        kind = type_meta.get(2, [b""])[0].decode()
        message = next((f"{p}.{kind}" for p in (CORE, META) if f"{p}.{kind}" in self.messages), None)
        if message is None:
            raise ValueError(f"no protobuf schema for kind {kind!r}")
        obj = self.decode(message, envelope.get(2, [b""])[0])
        return {"apiVersion": api_version, "kind": kind, **obj}

    @staticmethod
    def _fields(data: bytes) -> dict[int, list[Any]]:
        """Raw wire fields: number -> values (ints for varint/fixed, bytes for length-delimited)."""
        out: dict[int, list[Any]] = {}
        pos = 0
        while pos < len(data):
            key, pos = _read_varint(data, pos)
            number, wire = key >> 3, key & 7
            value: Any
            if wire == 0:
                value, pos = _read_varint(data, pos)
            elif wire == 1:
                value, pos = data[pos : pos + 8], pos + 8
            elif wire == 2:
                length, pos = _read_varint(data, pos)
                value, pos = data[pos : pos + length], pos + length
            elif wire == 5:
                value, pos = data[pos : pos + 4], pos + 4
            else:
                raise ValueError(f"unsupported protobuf wire type {wire}")
            out.setdefault(number, []).append(value)
        return out

    def decode(self, message: str, data: bytes) -> Any:
        raw = self._fields(data)
        special = (
            _SPECIAL.get(message.rsplit(".", 1)[-1]) if message.startswith("k8s.io.apimachinery") else None
        )
        if special:
            return special(raw)
        out: dict[str, Any] = {}
        for number, field in self.messages[message].items():
            if number not in raw:
                continue
            if field.map_types:
                key_type = self.resolve(field.map_types[0], field.scope)
                value_type = self.resolve(field.map_types[1], field.scope)
                entries = {}
                for entry in raw[number]:
                    pair = self._fields(entry)
                    key = self._value(key_type, pair.get(1, [b""])[0]) if 1 in pair else ""
                    entries[key] = (
                        self._value(value_type, pair[2][0]) if 2 in pair else self._empty(value_type)
                    )
                out[field.name] = entries
                continue
            type_name = self.resolve(field.type, field.scope)
            values = [self._value(type_name, v) for v in self._unpack(type_name, raw[number])]
            if field.repeated:
                out[field.name] = values
            elif values[-1] not in (None, "", 0, False) or isinstance(values[-1], dict):
                # Go's protobuf writes every non-pointer scalar, its JSON omits the empty ones
                # (omitempty). Dropping zeros also drops an explicit 0/false of a pointer field
                # (e.g. terminationGracePeriodSeconds: 0): rare in what kubectl generates.
                out[field.name] = values[-1]
        return out

    @staticmethod
    def _unpack(type_name: str, values: list[Any]) -> list[Any]:
        """Packed repeated varints arrive as one length-delimited blob."""
        if type_name not in VARINT_TYPES or not values or not isinstance(values[0], bytes):
            return values
        out = []
        for blob in values:
            pos = 0
            while pos < len(blob):
                value, pos = _read_varint(blob, pos)
                out.append(value)
        return out

    def _empty(self, type_name: str) -> Any:
        return self._value(type_name, b"" if type_name not in VARINT_TYPES else 0)

    def _value(self, type_name: str, value: Any) -> Any:
        if type_name == "string":
            return value.decode()
        if type_name == "bytes":
            return base64.b64encode(value).decode()  # []byte is base64 in Kubernetes JSON
        if type_name == "bool":
            return bool(value)
        if type_name in ("int32", "int64"):
            return value - (1 << 64) if value >= 1 << 63 else value
        if type_name in ("uint32", "uint64"):
            return value
        if type_name == "double":
            return struct.unpack("<d", value)[0]
        if type_name == "float":
            return struct.unpack("<f", value)[0]
        if type_name in SCALARS:
            return int.from_bytes(value, "little", signed=type_name.startswith("s"))
        return self.decode(type_name, value)


def _first(raw: dict[int, list[Any]], number: int, default: Any) -> Any:
    return raw[number][-1] if number in raw else default


def _time(raw: dict[int, list[Any]], micro: bool = False) -> str | None:
    if 1 not in raw and 2 not in raw:
        return None  # the zero time: JSON null, omitted
    stamp = datetime.fromtimestamp(_first(raw, 1, 0), UTC).replace(microsecond=_first(raw, 2, 0) // 1000)
    return stamp.strftime("%Y-%m-%dT%H:%M:%S.%fZ" if micro else "%Y-%m-%dT%H:%M:%SZ")


def _int_or_string(raw: dict[int, list[Any]]) -> int | str:
    if _first(raw, 1, 0) == 1:
        return str(_first(raw, 3, b"").decode())
    value = int(_first(raw, 2, 0))
    return value - (1 << 64) if value >= 1 << 63 else value


_SPECIAL: dict[str, Any] = {
    "Time": _time,
    "MicroTime": lambda raw: _time(raw, micro=True),
    "Quantity": lambda raw: _first(raw, 1, b"").decode(),
    "IntOrString": _int_or_string,
    "RawExtension": lambda raw: json.loads(_first(raw, 1, b"null") or b"null"),
    "FieldsV1": lambda raw: json.loads(_first(raw, 1, b"null") or b"null"),
    "Duration": lambda raw: f"{_first(raw, 1, 0) / 1e9:g}s",
}


def load_schema(proto_dir: Path) -> ProtoSchema | None:
    """The schema from the .proto files prepare.sh copied, or None when there are none."""
    files = sorted(proto_dir.rglob("*.proto")) if proto_dir.is_dir() else []
    return ProtoSchema(files) if files else None
