"""The adapter to torch's private rendezvous names refuses, at import, a torch whose internals changed.

Each test takes one thing the etcd3 rendezvous relies on away from torch's
``dynamic_rendezvous`` module (monkeypatched, undone after the test) and runs
the check again: it must name what changed, in one message.
"""

from __future__ import annotations

import ast
import importlib.util
import pathlib

import pytest
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

from elastic_ft.rendezvous import torch_internals
from elastic_ft.rendezvous.torch_internals import TorchInternalsChanged, check, problems

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "elastic_ft"


def test_the_installed_torch_has_every_name_the_rendezvous_uses():
    assert problems() == []


def test_a_class_torch_removed_is_named(monkeypatch):
    monkeypatch.delattr(dr, "_RendezvousJoinOp")
    with pytest.raises(TorchInternalsChanged, match=r"_RendezvousJoinOp is gone"):
        check()


def test_a_method_whose_parameters_changed_is_named(monkeypatch):
    monkeypatch.setattr(dr.DynamicRendezvousHandler, "_stop_heartbeats", lambda self, timeout: None)
    with pytest.raises(TorchInternalsChanged, match=r"DynamicRendezvousHandler\._stop_heartbeats takes "
                                                    r"\('self', 'timeout'\), expected \('self',\)"):
        check()


def test_a_private_attribute_the_constructor_no_longer_sets_is_named(monkeypatch):
    class Handler(dr.DynamicRendezvousHandler):
        def __init__(self) -> None:  # sets none of torch's private attributes
            self.settings = None

    monkeypatch.setattr(dr, "DynamicRendezvousHandler", Handler)
    with pytest.raises(TorchInternalsChanged) as info:
        check()
    assert "no longer sets _this_node, _state_holder, _op_executor, _heartbeat_lock" in str(info.value)


def test_an_action_torch_dropped_is_named(monkeypatch):
    import enum

    fewer = enum.Enum("_Action", [a.name for a in dr._Action if a.name != "REMOVE_FROM_REDUNDANCY_LIST"])
    monkeypatch.setattr(dr, "_Action", fewer)
    with pytest.raises(TorchInternalsChanged, match=r"_Action lacks REMOVE_FROM_REDUNDANCY_LIST"):
        check()


def test_importing_the_adapter_fails_on_a_changed_torch(monkeypatch):
    monkeypatch.delattr(dr._BackendRendezvousStateHolder, "_sanitize")
    spec = importlib.util.spec_from_file_location("torch_internals_again", torch_internals.__file__)
    module = importlib.util.module_from_spec(spec)
    with pytest.raises(ImportError, match=r"_BackendRendezvousStateHolder\._sanitize is gone"):
        spec.loader.exec_module(module)


def test_only_the_adapter_uses_torchs_private_rendezvous_names():
    """No other module imports a ``_`` name from torch's elastic package or reads one of the handler's."""
    private_attrs = {"_state_holder", "_op_executor", "_heartbeat_lock", "_this_node", "_stop_heartbeats",
                     "_get_store", "_sanitize"}
    holder_attrs = {"_token", "_state"}  # torch's state holder's; other classes of ours may have such names
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "torch_internals.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributed.elastic"):
                found += [f"{path.relative_to(PACKAGE)}:{node.lineno} imports {a.name}"
                          for a in node.names if a.name.startswith("_")]
            elif isinstance(node, ast.Attribute) and (
                node.attr in private_attrs or (node.attr in holder_attrs and path.parent.name == "rendezvous")
            ):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} uses .{node.attr}")
            elif isinstance(node, ast.FunctionDef) and node.name in private_attrs:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} overrides {node.name}")
    assert not found, "torch's private rendezvous names outside rendezvous/torch_internals.py: " + "; ".join(found)
