"""The part of etcd's v3 gRPC API this client uses: its messages and methods.

etcd's API is gRPC with protobuf messages (``etcdserverpb`` and ``mvccpb``). We
do not ship generated modules: python-etcd3's, made by an old ``protoc``, only
loaded with the pure-Python protobuf runtime chosen process-wide. Instead the
few messages used are described here by etcd's field numbers and types (the
wire contract, stable since etcd 3.0; names do not travel on the wire), and
protobuf builds their classes at first use with whatever runtime the process
has. They live in a private descriptor pool, so another etcd library loaded
in the same process cannot clash with them.

A message is a list of fields ``(name, number, type)``: a scalar type
(``bytes``, ``int64``, ...), an enum or message name of this module, ``*``
before it for a repeated field, and an optional fourth item naming the
``oneof`` the field belongs to.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

_PACKAGE = "elastic_ft.etcdwire"

_ENUMS: dict[str, tuple[str, ...]] = {
    "EventType": ("PUT", "DELETE"),
    "CompareResult": ("EQUAL", "GREATER", "LESS", "NOT_EQUAL"),
    "CompareTarget": ("VERSION", "CREATE", "MOD", "VALUE", "LEASE"),
}

# Enum values used by the client (the index in the tuples above).
EVENT_PUT = 0
COMPARE_EQUAL = 0
TARGET_CREATE = 1
TARGET_MOD = 2

_HEADER = ("header", 1, "ResponseHeader")

_MESSAGES: dict[str, list[tuple[str, ...]]] = {
    "ResponseHeader": [("cluster_id", 1, "uint64"), ("member_id", 2, "uint64"),
                       ("revision", 3, "int64"), ("raft_term", 4, "uint64")],
    "KeyValue": [("key", 1, "bytes"), ("create_revision", 2, "int64"), ("mod_revision", 3, "int64"),
                 ("version", 4, "int64"), ("value", 5, "bytes"), ("lease", 6, "int64")],
    "Event": [("type", 1, "EventType"), ("kv", 2, "KeyValue"), ("prev_kv", 3, "KeyValue")],
    "RangeRequest": [("key", 1, "bytes"), ("range_end", 2, "bytes"), ("limit", 3, "int64"),
                     ("revision", 4, "int64"), ("keys_only", 8, "bool"), ("count_only", 9, "bool")],
    "RangeResponse": [_HEADER, ("kvs", 2, "*KeyValue"), ("more", 3, "bool"), ("count", 4, "int64")],
    "PutRequest": [("key", 1, "bytes"), ("value", 2, "bytes"), ("lease", 3, "int64")],
    "PutResponse": [_HEADER],
    "DeleteRangeRequest": [("key", 1, "bytes"), ("range_end", 2, "bytes")],
    "DeleteRangeResponse": [_HEADER, ("deleted", 2, "int64")],
    "RequestOp": [("request_range", 1, "RangeRequest", "request"),
                  ("request_put", 2, "PutRequest", "request"),
                  ("request_delete_range", 3, "DeleteRangeRequest", "request")],
    "ResponseOp": [("response_range", 1, "RangeResponse", "response"),
                   ("response_put", 2, "PutResponse", "response"),
                   ("response_delete_range", 3, "DeleteRangeResponse", "response")],
    "Compare": [("result", 1, "CompareResult"), ("target", 2, "CompareTarget"), ("key", 3, "bytes"),
                ("version", 4, "int64", "target_union"), ("create_revision", 5, "int64", "target_union"),
                ("mod_revision", 6, "int64", "target_union"), ("value", 7, "bytes", "target_union"),
                ("lease", 8, "int64", "target_union"), ("range_end", 64, "bytes")],
    "TxnRequest": [("compare", 1, "*Compare"), ("success", 2, "*RequestOp"), ("failure", 3, "*RequestOp")],
    "TxnResponse": [_HEADER, ("succeeded", 2, "bool"), ("responses", 3, "*ResponseOp")],
    "WatchCreateRequest": [("key", 1, "bytes"), ("range_end", 2, "bytes"), ("start_revision", 3, "int64")],
    "WatchRequest": [("create_request", 1, "WatchCreateRequest", "request_union")],
    "WatchResponse": [_HEADER, ("watch_id", 2, "int64"), ("created", 3, "bool"), ("canceled", 4, "bool"),
                      ("compact_revision", 5, "int64"), ("cancel_reason", 6, "string"),
                      ("events", 11, "*Event")],
    "LeaseGrantRequest": [("TTL", 1, "int64"), ("ID", 2, "int64")],
    "LeaseGrantResponse": [_HEADER, ("ID", 2, "int64"), ("TTL", 3, "int64"), ("error", 4, "string")],
    "LeaseRevokeRequest": [("ID", 1, "int64")],
    "LeaseRevokeResponse": [_HEADER],
    "LeaseKeepAliveRequest": [("ID", 1, "int64")],
    "LeaseKeepAliveResponse": [_HEADER, ("ID", 2, "int64"), ("TTL", 3, "int64")],
    "LeaseTimeToLiveRequest": [("ID", 1, "int64"), ("keys", 2, "bool")],
    "LeaseTimeToLiveResponse": [_HEADER, ("ID", 2, "int64"), ("TTL", 3, "int64"),
                                ("grantedTTL", 4, "int64")],
    "AuthenticateRequest": [("name", 1, "string"), ("password", 2, "string")],
    "AuthenticateResponse": [_HEADER, ("token", 2, "string")],
    "StatusRequest": [],
    "StatusResponse": [_HEADER, ("version", 2, "string"), ("dbSize", 3, "int64"), ("leader", 4, "uint64")],
}

_SCALARS = ("bytes", "int64", "uint64", "bool", "string")


@dataclass(frozen=True)
class Method:
    """One etcd RPC: its gRPC path and the message names it takes and returns."""

    path: str
    request: str
    response: str


RANGE = Method("/etcdserverpb.KV/Range", "RangeRequest", "RangeResponse")
DELETE_RANGE = Method("/etcdserverpb.KV/DeleteRange", "DeleteRangeRequest", "DeleteRangeResponse")
TXN = Method("/etcdserverpb.KV/Txn", "TxnRequest", "TxnResponse")
WATCH = Method("/etcdserverpb.Watch/Watch", "WatchRequest", "WatchResponse")
LEASE_GRANT = Method("/etcdserverpb.Lease/LeaseGrant", "LeaseGrantRequest", "LeaseGrantResponse")
LEASE_REVOKE = Method("/etcdserverpb.Lease/LeaseRevoke", "LeaseRevokeRequest", "LeaseRevokeResponse")
LEASE_KEEP_ALIVE = Method(
    "/etcdserverpb.Lease/LeaseKeepAlive", "LeaseKeepAliveRequest", "LeaseKeepAliveResponse"
)
LEASE_TIME_TO_LIVE = Method(
    "/etcdserverpb.Lease/LeaseTimeToLive", "LeaseTimeToLiveRequest", "LeaseTimeToLiveResponse"
)
AUTHENTICATE = Method("/etcdserverpb.Auth/Authenticate", "AuthenticateRequest", "AuthenticateResponse")
STATUS = Method("/etcdserverpb.Maintenance/Status", "StatusRequest", "StatusResponse")


def _file_descriptor() -> Any:
    """The messages above as one proto3 ``FileDescriptorProto``."""
    from google.protobuf import descriptor_pb2

    field_proto = descriptor_pb2.FieldDescriptorProto
    scalar_types = {name: getattr(field_proto, f"TYPE_{name.upper()}") for name in _SCALARS}
    file = descriptor_pb2.FileDescriptorProto(name="elastic_ft_etcdwire.proto", package=_PACKAGE, syntax="proto3")
    for name, values in _ENUMS.items():
        enum = file.enum_type.add(name=name)
        for number, value in enumerate(values):
            enum.value.add(name=f"{name.upper()}_{value}", number=number)
    for name, fields in _MESSAGES.items():
        message = file.message_type.add(name=name)
        oneofs: list[str] = []
        for spec in fields:
            field_name, number, type_name = spec[0], int(spec[1]), str(spec[2])
            repeated = type_name.startswith("*")
            type_name = type_name.lstrip("*")
            field = message.field.add(name=field_name, number=number, json_name=field_name)
            field.label = field_proto.LABEL_REPEATED if repeated else field_proto.LABEL_OPTIONAL
            if type_name in scalar_types:
                field.type = scalar_types[type_name]
            else:
                field.type = field_proto.TYPE_ENUM if type_name in _ENUMS else field_proto.TYPE_MESSAGE
                field.type_name = f".{_PACKAGE}.{type_name}"
            if len(spec) > 3:
                if spec[3] not in oneofs:
                    oneofs.append(spec[3])
                    message.oneof_decl.add(name=spec[3])
                field.oneof_index = oneofs.index(spec[3])
    return file


@functools.cache
def messages() -> dict[str, type]:
    """The message classes by name, built once per process."""
    from google.protobuf import descriptor_pool, message_factory

    pool = descriptor_pool.DescriptorPool()
    pool.AddSerializedFile(_file_descriptor().SerializeToString())
    return {
        name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{_PACKAGE}.{name}"))
        for name in _MESSAGES
    }


def message(type_name: str, /, **fields: Any) -> Any:
    """A new message of type ``type_name`` with ``fields`` set (positional-only:
    ``AuthenticateRequest`` has a field called ``name``)."""
    return messages()[type_name](**fields)
