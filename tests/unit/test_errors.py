"""The one exception tree (tierfs/core/errors.py): every exception class tierfs defines is a
TierfsError in its family, and keeps the builtin base code catches it by."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import pkgutil

import pytest

import tierfs
from tierfs.core import errors

#: modules too slow to import in the fast layer (torch: ~25 s on a busy 2-core machine);
#: their source is checked instead (:func:`test_slow_modules_define_no_other_exception`)
SLOW = {"tierfs.demo.trainer"}


def tierfs_exceptions() -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for info in pkgutil.walk_packages(tierfs.__path__, "tierfs."):
        if info.name in SLOW or info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for _name, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, BaseException) and obj.__module__.startswith("tierfs."):
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return found


def test_every_tierfs_exception_is_a_tierfs_error():
    found = tierfs_exceptions()
    assert len(found) >= 35  # the walk found them (a broken walk must not pass)
    outside = sorted(n for n, c in found.items() if not issubclass(c, errors.TierfsError))
    assert outside == []


def test_slow_modules_define_no_other_exception():
    for name in SLOW:
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin is not None
        tree = ast.parse(open(spec.origin, encoding="utf-8").read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = {ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases}
                assert not any(b.endswith(("Error", "Exception")) for b in bases) or (
                    bases & {"TierfsError", "ConfigurationError", "ProtocolError"}
                ), (name, node.name)


FAMILIES = {
    "tierfs.core.config.ConfigError": (errors.ConfigurationError, ValueError),
    "tierfs.core.settings.SettingError": (errors.ConfigurationError, ValueError),
    "tierfs.core.sizes.SizeError": (errors.ConfigurationError, ValueError),
    "tierfs.fuse.options.MountOptionError": (errors.ConfigurationError, ValueError),
    "tierfs.csi.volume_context.ContextError": (errors.ConfigurationError, ValueError),
    "tierfs.csi.crd.CrdError": (errors.ConfigurationError, ValueError),
    "tierfs.core.control.ControlError": (errors.ProtocolError, ValueError),
    "tierfs.csi.abort.Abort": (errors.ProtocolError,),
    "tierfs.csi.records.TargetBusy": (errors.ProtocolError,),
    "tierfs.store.manifest.ManifestError": (errors.StorageError, ValueError),
    "tierfs.store.shards.SealBusy": (errors.StorageError,),
    "tierfs.store.validators.archive.BadArchive": (errors.StorageError, ValueError),
    "tierfs.store.validators.model.ReadFailed": (errors.StorageError,),
    "tierfs.store.validators.dcp_pickle.BadMetadata": (errors.StorageError, ValueError),
    "tierfs.store.validators.dcp_pickle.UnsafeMetadata": (errors.StorageError,),
    "tierfs.store.validators.numpy_npy.BadNpy": (errors.StorageError, ValueError),
    "tierfs.store.validators.safetensors.BadSafetensors": (errors.StorageError, ValueError),
    "tierfs.backup.errors.GcsError": (errors.BackupError,),
    "tierfs.backup.errors.ChecksumMismatch": (errors.BackupError,),
    "tierfs.backup.errors.BucketTimeout": (errors.BackupError,),
    "tierfs.core.rounds.LayoutError": (errors.BackupError, ValueError),
    "tierfs.backup.errors.BackupCopyError": (errors.BackupError,),
    "tierfs.replication.transfer.TransferError": (errors.ClusterError,),
    "tierfs.replication.transfer.BadCopy": (errors.ClusterError,),
    "tierfs.replication.service.HostGone": (errors.ClusterError,),
    "tierfs.cluster.rounds.Rejected": (errors.ClusterError,),
    "tierfs.node.agreement.RestoreFailed": (errors.RestoreError,),
    "tierfs.node.agreement.NodesMissing": (errors.RestoreError,),
    "tierfs.node.agreement.RestoreRefused": (errors.RestoreError,),
    "tierfs.node.sources.CopyFailed": (errors.RestoreError,),
    "tierfs.csi.operator.ApiError": (errors.TierfsError, RuntimeError),
    "tierfs.demo.orchestrator.DemoError": (errors.TierfsError, RuntimeError),
    "tierfs.demo.emulator.EmulatorError": (errors.TierfsError, RuntimeError),
}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_and_builtin_base(name):
    cls = tierfs_exceptions_cache()[name]
    for base in FAMILIES[name]:
        assert issubclass(cls, base), (name, base)


def test_families_do_not_overlap():
    fams = [
        errors.ConfigurationError,
        errors.ProtocolError,
        errors.StorageError,
        errors.BackupError,
        errors.ClusterError,
        errors.RestoreError,
    ]
    for cls in tierfs_exceptions_cache().values():
        assert sum(issubclass(cls, f) for f in fams) <= 1, cls


def test_messages_and_catching_are_unchanged():
    from tierfs.core.config import ConfigError
    from tierfs.node.agreement import RestoreTimeout

    with pytest.raises(ValueError, match=r"^bad size$"):
        raise ConfigError("bad size")
    exc = RestoreTimeout("nodes 1, 2 did not join")
    assert str(exc) == "nodes 1, 2 did not join" and exc.outcome == "timeout"
    assert isinstance(exc, errors.RestoreError) and isinstance(exc, Exception)


_CACHE: dict[str, type[BaseException]] = {}


def tierfs_exceptions_cache() -> dict[str, type[BaseException]]:
    if not _CACHE:
        _CACHE.update(tierfs_exceptions())
    return _CACHE
