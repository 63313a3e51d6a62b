"""The optional tierfs operator: one node DaemonSet per ``CheckpointConfiguration``.

Run it with kopf (``pip install 'tierfs[operator]'``)::

    kopf run --standalone --all-namespaces -m tierfs.csi.operator

For every ``checkpointing.tierfs.dev/v1`` ``CheckpointConfiguration`` it
renders the node DaemonSet (:func:`tierfs.csi.render.render_node_daemonset`,
a pure function) and applies it with server-side apply; the DaemonSet is
owned by the configuration, so deleting the configuration lets Kubernetes'
garbage collector delete the DaemonSet. The outcome goes into the
configuration's ``status`` (``daemonSet``, ``observedGeneration``, ``error``).
This is what GKE's checkpointing controller does for its own
CheckpointConfiguration.

The API calls are plain HTTPS with the pod's ServiceAccount
(:class:`InClusterApi`); kopf itself brings no client for other resources.
Environment: ``TIERFS_IMAGE`` (the node image), ``TIERFS_NAMESPACE``
(default ``tierfs-system``), ``TIERFS_DRIVER_NAME``.
"""

from __future__ import annotations

import json
import os
import ssl
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any, Protocol

from tierfs.core import settings as tierfs_settings
from tierfs.core.errors import TierfsError
from tierfs.csi import render

FIELD_MANAGER = "tierfs-operator"
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


class ApiError(TierfsError, RuntimeError):
    """The API server refused a request (status code and its message)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class Applier(Protocol):
    """Something that can server-side-apply an object."""

    def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Apply ``obj``; returns the object as stored."""


class InClusterApi:
    """Server-side apply against the API server with the pod's ServiceAccount.

    Args:
        server: API server URL (default: ``https://$KUBERNETES_SERVICE_HOST:$..._PORT``).
        token: bearer token (default: read from the ServiceAccount mount on every call,
            so rotated tokens are picked up).
        ca_file: CA bundle (default: the ServiceAccount's ``ca.crt``); None with an
            ``http://`` server.
        timeout: seconds per request.
    """

    def __init__(
        self,
        server: str | None = None,
        token: str | None = None,
        ca_file: str | None = os.path.join(SA_DIR, "ca.crt"),
        timeout: float = 30.0,
    ) -> None:
        if server is None:
            host = os.environ.get("KUBERNETES_SERVICE_HOST", "kubernetes.default.svc")
            port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
            server = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
        self.server = server.rstrip("/")
        self._token = token
        self.ca_file = ca_file
        self.timeout = timeout

    def _bearer(self) -> str:
        if self._token is not None:
            return self._token
        with open(os.path.join(SA_DIR, "token"), encoding="utf-8") as f:
            return f.read().strip()

    @staticmethod
    def path_of(obj: Mapping[str, Any]) -> str:
        """The REST path of a namespaced apps/v1 or core/v1 object (what tierfs applies)."""
        api = obj["apiVersion"]
        kind = obj["kind"]
        plural = {"DaemonSet": "daemonsets", "ConfigMap": "configmaps"}.get(kind)
        if plural is None:
            raise ValueError(f"the operator does not apply {kind}")
        prefix = "/api/v1" if api == "v1" else f"/apis/{api}"
        meta = obj["metadata"]
        return f"{prefix}/namespaces/{meta['namespace']}/{plural}/{meta['name']}"

    def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply ``obj`` (PATCH, ``application/apply-patch+yaml``, force).

        Raises:
            ApiError: the API server answered with an error status.
            OSError: it could not be reached.
        """
        url = f"{self.server}{self.path_of(obj)}?fieldManager={FIELD_MANAGER}&force=true"
        req = urllib.request.Request(url, data=json.dumps(obj).encode(), method="PATCH")
        req.add_header("Content-Type", "application/apply-patch+yaml")
        req.add_header("Accept", "application/json")
        req.add_header("Authorization", f"Bearer {self._bearer()}")
        context = None
        if url.startswith("https:"):
            context = ssl.create_default_context(cafile=self.ca_file)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout, context=context) as resp:
                return json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as exc:
            body = exc.read().decode(errors="replace")
            try:
                message = json.loads(body).get("message", body)
            except ValueError:
                message = body
            raise ApiError(exc.code, message) from None


def settings_from_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Render options from the operator's environment (image, namespace, driver name)."""
    return {
        "image": tierfs_settings.IMAGE.get(env),
        "namespace": tierfs_settings.NAMESPACE.get(env),
        "driver_name": tierfs_settings.DRIVER_NAME.get(env),
    }


def reconcile(
    body: Mapping[str, Any], api: Applier, settings: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """Render and apply the DaemonSet of one configuration; returns the new ``status``.

    Raises:
        render.RenderError: the configuration is invalid (permanent until it changes).
        ApiError, OSError: applying failed (worth retrying).
    """
    opts = dict(settings_from_env() if settings is None else settings)
    ds = render.render_node_daemonset(body, **opts)
    api.apply(ds)
    meta = ds["metadata"]
    return {
        "daemonSet": f"{meta['namespace']}/{meta['name']}",
        "observedGeneration": (body.get("metadata") or {}).get("generation", 0),
        "error": "",
    }


_api: Applier | None = None


def api() -> Applier:
    """The API client of this process (created on first use)."""
    global _api
    if _api is None:
        _api = InClusterApi()
    return _api


def apply_configuration(body: Mapping[str, Any], patch: Any, logger: Any, **_: Any) -> None:
    """kopf handler: keep the node DaemonSet of this configuration in line with its spec.

    Writes ``status.daemonSet``/``observedGeneration`` (and clears ``status.error``)
    on success; on failure writes ``status.error`` and raises kopf's
    PermanentError (invalid spec: wait for the next change) or TemporaryError
    (API unreachable or refusing: retry in 30 s).
    """
    import kopf

    try:
        status = reconcile(body, api())
    except render.RenderError as exc:
        patch.status["error"] = str(exc)
        raise kopf.PermanentError(str(exc)) from None
    except (ApiError, OSError) as exc:
        patch.status["error"] = str(exc)
        raise kopf.TemporaryError(str(exc), delay=30) from None
    patch.status.update(status)
    logger.info("applied DaemonSet %s", status["daemonSet"])


def _register() -> None:
    """Register :func:`apply_configuration` with kopf for create, update and resume."""
    import kopf

    resource = (render.API_GROUP, "v1", "checkpointconfigurations")
    kopf.on.resume(*resource)(apply_configuration)
    kopf.on.create(*resource)(apply_configuration)
    kopf.on.update(*resource, field="spec")(apply_configuration)


try:
    import kopf as _kopf  # noqa: F401
except ImportError:  # the operator extra is not installed: the module still imports
    pass
else:
    _register()
