"""tierfs's own csi.proto is wire-identical to the CSI v1 spec for everything it declares.

The expected tables below are transcribed from the CSI specification's
csi.proto (container-storage-interface/spec); if one of them changes, a
kubelet built against the real spec stops understanding tierfs.
"""

from __future__ import annotations

import pytest
from google.protobuf.descriptor import FieldDescriptor as FD

from tierfs.csi import server
from tierfs.rpc import csi_pb2 as pb2

# the gRPC method path kubelet and the sidecars call -> (request, response) message names
METHODS = {
    "/csi.v1.Identity/GetPluginInfo": ("GetPluginInfoRequest", "GetPluginInfoResponse"),
    "/csi.v1.Identity/GetPluginCapabilities": (
        "GetPluginCapabilitiesRequest",
        "GetPluginCapabilitiesResponse",
    ),
    "/csi.v1.Identity/Probe": ("ProbeRequest", "ProbeResponse"),
    "/csi.v1.Node/NodePublishVolume": ("NodePublishVolumeRequest", "NodePublishVolumeResponse"),
    "/csi.v1.Node/NodeUnpublishVolume": (
        "NodeUnpublishVolumeRequest",
        "NodeUnpublishVolumeResponse",
    ),
    "/csi.v1.Node/NodeGetCapabilities": (
        "NodeGetCapabilitiesRequest",
        "NodeGetCapabilitiesResponse",
    ),
    "/csi.v1.Node/NodeGetInfo": ("NodeGetInfoRequest", "NodeGetInfoResponse"),
}

STR, BOOL, I64 = FD.TYPE_STRING, FD.TYPE_BOOL, FD.TYPE_INT64
ENUM, MSG = FD.TYPE_ENUM, FD.TYPE_MESSAGE
MAP = "map<string,string>"

# message -> {field: (number, type, repeated, message/enum type name or None)}
FIELDS = {
    "GetPluginInfoRequest": {},
    "GetPluginInfoResponse": {"name": (1, STR), "vendor_version": (2, STR), "manifest": (3, MAP)},
    "GetPluginCapabilitiesRequest": {},
    "GetPluginCapabilitiesResponse": {
        "capabilities": (1, MSG, "repeated", "csi.v1.PluginCapability")
    },
    "PluginCapability": {
        "service": (1, MSG, "", "csi.v1.PluginCapability.Service"),
        "volume_expansion": (2, MSG, "", "csi.v1.PluginCapability.VolumeExpansion"),
    },
    "PluginCapability.Service": {"type": (1, ENUM, "", "csi.v1.PluginCapability.Service.Type")},
    "PluginCapability.VolumeExpansion": {
        "type": (1, ENUM, "", "csi.v1.PluginCapability.VolumeExpansion.Type")
    },
    "ProbeRequest": {},
    "ProbeResponse": {"ready": (1, MSG, "", "google.protobuf.BoolValue")},
    "NodePublishVolumeRequest": {
        "volume_id": (1, STR),
        "publish_context": (2, MAP),
        "staging_target_path": (3, STR),
        "target_path": (4, STR),
        "volume_capability": (5, MSG, "", "csi.v1.VolumeCapability"),
        "readonly": (6, BOOL),
        "secrets": (7, MAP),
        "volume_context": (8, MAP),
    },
    "NodePublishVolumeResponse": {},
    "NodeUnpublishVolumeRequest": {"volume_id": (1, STR), "target_path": (2, STR)},
    "NodeUnpublishVolumeResponse": {},
    "NodeGetCapabilitiesRequest": {},
    "NodeGetCapabilitiesResponse": {
        "capabilities": (1, MSG, "repeated", "csi.v1.NodeServiceCapability")
    },
    "NodeServiceCapability": {"rpc": (1, MSG, "", "csi.v1.NodeServiceCapability.RPC")},
    "NodeServiceCapability.RPC": {"type": (1, ENUM, "", "csi.v1.NodeServiceCapability.RPC.Type")},
    "NodeGetInfoRequest": {},
    "NodeGetInfoResponse": {
        "node_id": (1, STR),
        "max_volumes_per_node": (2, I64),
        "accessible_topology": (3, MSG, "", "csi.v1.Topology"),
    },
    "Topology": {"segments": (1, MAP)},
    "VolumeCapability": {
        "block": (1, MSG, "", "csi.v1.VolumeCapability.BlockVolume"),
        "mount": (2, MSG, "", "csi.v1.VolumeCapability.MountVolume"),
        "access_mode": (3, MSG, "", "csi.v1.VolumeCapability.AccessMode"),
    },
    "VolumeCapability.BlockVolume": {},
    "VolumeCapability.MountVolume": {
        "fs_type": (1, STR),
        "mount_flags": (2, STR, "repeated"),
        "volume_mount_group": (3, STR),
    },
    "VolumeCapability.AccessMode": {
        "mode": (1, ENUM, "", "csi.v1.VolumeCapability.AccessMode.Mode")
    },
}

ONEOFS = {
    "PluginCapability": {"type": {"service", "volume_expansion"}},
    "VolumeCapability": {"access_type": {"block", "mount"}},
    "NodeServiceCapability": {"type": {"rpc"}},
}

ENUMS = {
    "PluginCapability.Service.Type": {
        "UNKNOWN": 0,
        "CONTROLLER_SERVICE": 1,
        "VOLUME_ACCESSIBILITY_CONSTRAINTS": 2,
        "GROUP_CONTROLLER_SERVICE": 3,
        "SNAPSHOT_METADATA_SERVICE": 4,
    },
    "PluginCapability.VolumeExpansion.Type": {"UNKNOWN": 0, "ONLINE": 1, "OFFLINE": 2},
    "VolumeCapability.AccessMode.Mode": {
        "UNKNOWN": 0,
        "SINGLE_NODE_WRITER": 1,
        "SINGLE_NODE_READER_ONLY": 2,
        "MULTI_NODE_READER_ONLY": 3,
        "MULTI_NODE_SINGLE_WRITER": 4,
        "MULTI_NODE_MULTI_WRITER": 5,
        "SINGLE_NODE_SINGLE_WRITER": 6,
        "SINGLE_NODE_MULTI_WRITER": 7,
    },
    "NodeServiceCapability.RPC.Type": {
        "UNKNOWN": 0,
        "STAGE_UNSTAGE_VOLUME": 1,
        "GET_VOLUME_STATS": 2,
        "EXPAND_VOLUME": 3,
        "VOLUME_CONDITION": 4,
        "SINGLE_NODE_MULTI_WRITER": 5,
        "VOLUME_MOUNT_GROUP": 6,
    },
}


def _nested(name: str):
    parts = name.split(".")
    desc = pb2.DESCRIPTOR.message_types_by_name[parts[0]]
    for p in parts[1:]:
        desc = desc.nested_types_by_name[p]
    return desc


def test_package_is_csi_v1():
    assert pb2.DESCRIPTOR.package == "csi.v1"
    assert pb2.DESCRIPTOR.name == "tierfs/rpc/csi.proto"


def test_method_paths_and_message_types():
    paths = {}
    for service in pb2.DESCRIPTOR.services_by_name.values():
        for m in service.methods:
            paths[f"/{service.full_name}/{m.name}"] = (m.input_type.name, m.output_type.name)
            assert not m.client_streaming and not m.server_streaming, m.full_name
    assert paths == METHODS
    assert set(server.METHOD_PATHS) == set(METHODS)
    assert set(pb2.DESCRIPTOR.services_by_name) == {"Identity", "Node"}


@pytest.mark.parametrize("name", sorted(FIELDS))
def test_field_numbers_and_types(name):
    desc = _nested(name)
    got = {f.name: f for f in desc.fields}
    assert set(got) == set(FIELDS[name]), name
    for fname, spec in FIELDS[name].items():
        f = got[fname]
        number, ftype = spec[0], spec[1]
        assert f.number == number, f"{name}.{fname}"
        if ftype == MAP:
            entry = f.message_type
            assert entry.GetOptions().map_entry, f"{name}.{fname} is not a map"
            assert [(x.name, x.number, x.type) for x in entry.fields] == [
                ("key", 1, STR),
                ("value", 2, STR),
            ]
            continue
        assert f.type == ftype, f"{name}.{fname}"
        repeated = len(spec) > 2 and spec[2] == "repeated"
        is_repeated = getattr(f, "is_repeated", None)
        if is_repeated is None:
            is_repeated = f.label == FD.LABEL_REPEATED
        assert is_repeated == repeated, f"{name}.{fname}"
        if len(spec) > 3 and spec[3]:
            typ = f.message_type if ftype == MSG else f.enum_type
            assert typ.full_name == spec[3], f"{name}.{fname}"


@pytest.mark.parametrize("name", sorted(ONEOFS))
def test_oneofs(name):
    desc = _nested(name)
    got = {o.name: {f.name for f in o.fields} for o in desc.oneofs}
    assert got == ONEOFS[name]


@pytest.mark.parametrize("name", sorted(ENUMS))
def test_enum_values(name):
    parts = name.split(".")
    desc = _nested(".".join(parts[:-1])).enum_types_by_name[parts[-1]]
    assert {v.name: v.number for v in desc.values} == ENUMS[name]


def test_wire_bytes_of_a_publish_request():
    """Hand-computed tags: field 4 string (0x22), field 6 varint (0x30), field 8 map (0x42)."""
    req = pb2.NodePublishVolumeRequest(target_path="/t", readonly=True, volume_context={"k": "v"})
    assert req.SerializeToString() == (b"\x22\x02/t" + b"\x30\x01" + b"\x42\x06\x0a\x01k\x12\x01v")
