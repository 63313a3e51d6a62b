"""An in-memory Google Cloud Storage with fault injection, behind the seam
:class:`tierfs.backup.bucket.GcsBackend` takes: its ``client`` argument.

``GcsBackend(spec, client=FakeClient(server))`` runs the real backend code
(retry objects, deadlines, the :class:`~tierfs.backup.bucket.BucketMonitor`,
crc32c checks, round judging) against :class:`FakeGcs` instead of HTTP. The
fake stands in for the few google-cloud-storage calls the backend makes
(``client.bucket``, ``client.list_blobs``, ``bucket.exists``, ``bucket.blob``,
``blob.upload_from_string/upload_from_file/download_as_bytes/download_to_file/
delete`` and the blob properties ``name, size, crc32c, updated``), with the
library's behaviour where tierfs depends on it:

* every call runs its request through the ``retry=`` object it is given
  (google.api_core ``Retry``, as the library does), so a transient fault is
  retried by tierfs's own policy and a persistent one ends in ``RetryError``;
* every request goes through ``client._http.request`` (a session object the
  real :func:`~tierfs.backup.bucket.monitor_of` wraps), so request deadlines
  cap the timeout a stalled request waits for;
* HTTP errors are answered as responses (status 429, 503, 400, 404) and
  raised as ``google.api_core.exceptions.from_http_status``, the exceptions
  the library raises and :func:`~tierfs.backup.bucket.is_transient` classifies;
  connection resets raise ``requests.exceptions.ConnectionError``, a stall that
  outlives its timeout ``requests.exceptions.ReadTimeout``;
* an upload carrying ``blob.crc32c`` is refused with 400 when the bytes that
  arrive have another crc32c (GCS does this; ``enforce_crc=False`` behaves like
  an emulator that stores them), and the answer sets ``blob.crc32c``/``size``
  from what was stored; ``download_as_bytes`` with its default ``checksum``
  checks the bytes' crc32c and raises the library's ``DataCorruption``;
  ``download_to_file(checksum=None)`` hands over whatever it has.

Faults (:meth:`FakeGcs.inject`, :meth:`FakeGcs.stall`, :meth:`FakeGcs.rot`):
an HTTP status, a reset, a stall until released, bytes corrupted in transit on
a write or a read, a wrong crc32c in an answer or a listing, bit rot at rest.
Each fault matches an operation (``exists``, ``get``, ``put``, ``delete``,
``list``) and a substring of the object name (or listing prefix), for a number
of requests (``times``; None: until removed). :attr:`FakeGcs.log` records every
request (op, name, outcome).
"""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import google_crc32c
import requests
from google.api_core import exceptions as gexc

OPS = ("exists", "get", "put", "delete", "list")
#: a stalled request gives up after this many seconds even without a timeout (no test hangs)
STALL_LIMIT = 60.0


def crc32c(data: bytes) -> int:
    return int(google_crc32c.value(bytes(data)))


def _b64(crc: int) -> str:
    return base64.b64encode((crc & 0xFFFFFFFF).to_bytes(4, "big")).decode("ascii")


def _unb64(text: str | None) -> int | None:
    if not text:
        return None
    return int.from_bytes(base64.b64decode(text), "big")


def flip(data: bytes, at: int = 0) -> bytes:
    """``data`` with one bit flipped at byte ``at`` (mod length); b"\\0" for empty data."""
    if not data:
        return b"\0"
    i = at % len(data)
    return data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1 :]


def _data_corruption() -> type[Exception]:
    try:
        from google.cloud.storage.exceptions import DataCorruption  # google-cloud-storage 3.x
    except ImportError:  # 2.x
        from google.resumable_media.common import DataCorruption  # type: ignore[no-redef]
    return DataCorruption  # type: ignore[no-any-return]


@dataclasses.dataclass
class Stored:
    """One object: its bytes, the crc32c GCS computed at upload, its generation."""

    data: bytes
    crc32c: int
    generation: int
    updated: dt.datetime
    content_type: str = "application/octet-stream"


@dataclasses.dataclass
class Fault:
    """One injected fault.

    Attributes:
        kind: ``status`` (answer ``status``), ``reset`` (connection reset),
            ``stall`` (block until :meth:`release` or the request's timeout),
            ``corrupt_write`` (a bit of an upload flipped in transit),
            ``corrupt_read`` (a bit of a download flipped in transit),
            ``wrong_crc`` (the answer of a put, or a listing, names another crc32c).
        op: the operation it matches (None: any).
        match: a substring of the object name or listing prefix (None: any).
        times: requests it still hits (None: every one until removed).
        status: the HTTP status of a ``status`` fault (429, 503, 403...).
    """

    kind: str
    op: str | None = None
    match: str | None = None
    times: int | None = 1
    status: int = 503
    hits: int = 0
    released: threading.Event = dataclasses.field(default_factory=threading.Event)
    waiting: threading.Event = dataclasses.field(default_factory=threading.Event)

    def matches(self, op: str, name: str) -> bool:
        if self.times is not None and self.times <= 0:
            return False
        if self.op is not None and self.op != op:
            return False
        return self.match is None or self.match in name

    def release(self) -> None:
        """Let every request this stall holds (and later ones) go on."""
        self.released.set()


class FakeResponse:
    def __init__(self, status_code: int, text: str = "") -> None:
        self.status_code = status_code
        self.text = text


class FakeGcs:
    """The "server": buckets of objects, the faults, the request log. Thread-safe.

    Args:
        buckets: bucket names that exist.
        enforce_crc: refuse an upload whose bytes do not match the crc32c the
            client sent (GCS); False stores them (an emulator that does not check).
    """

    def __init__(self, buckets: tuple[str, ...] = ("bkt",), enforce_crc: bool = True) -> None:
        self.buckets: dict[str, dict[str, Stored]] = {b: {} for b in buckets}
        self.enforce_crc = enforce_crc
        self.faults: list[Fault] = []
        self.log: list[tuple[str, str, str]] = []
        self._lock = threading.RLock()  # work() runs under it and takes faults
        self._generation = 0

    # ------------------------------------------------------------------ faults

    def inject(
        self, kind: str, op: str | None = None, match: str | None = None, **kw: Any
    ) -> Fault:
        """Add a fault (see :class:`Fault`); returns it (a stall: call ``release``)."""
        assert op is None or op in OPS, op
        fault = Fault(kind, op, match, **kw)
        with self._lock:
            self.faults.append(fault)
        return fault

    def stall(
        self, op: str | None = None, match: str | None = None, times: int | None = None
    ) -> Fault:
        """Requests matching block until the returned fault is released (or their
        timeout passes: ``ReadTimeout``)."""
        return self.inject("stall", op, match, times=times)

    def clear_faults(self) -> None:
        with self._lock:
            faults, self.faults = self.faults, []
        for f in faults:
            f.release()

    def _take(self, op: str, name: str, kinds: tuple[str, ...]) -> Fault | None:
        with self._lock:
            for f in self.faults:
                if f.kind in kinds and f.matches(op, name):
                    f.hits += 1
                    if f.times is not None:
                        f.times -= 1
                    return f
        return None

    # ------------------------------------------------------------------ objects

    def objects(self, bucket: str = "bkt") -> dict[str, Stored]:
        """A copy of the bucket's objects by name."""
        with self._lock:
            return dict(self.buckets[bucket])

    def put_object(self, bucket: str, name: str, data: bytes) -> None:
        """Store an object directly (no request, no fault)."""
        with self._lock:
            self._store(bucket, name, data, crc32c(data), "application/octet-stream")

    def delete_object(self, bucket: str, name: str) -> bool:
        """Remove an object directly (e.g. a round cut off half-way)."""
        with self._lock:
            return self.buckets[bucket].pop(name, None) is not None

    def rot(self, bucket: str, name: str, at: int = 0) -> None:
        """Bit rot at rest: flip a bit of the stored bytes, keeping the crc32c GCS
        recorded at upload (a download then shows the damage)."""
        with self._lock:
            obj = self.buckets[bucket][name]
            obj.data = flip(obj.data, at)

    def _store(self, bucket: str, name: str, data: bytes, crc: int, ctype: str) -> Stored:
        self._generation += 1
        obj = Stored(bytes(data), crc, self._generation, dt.datetime.now(dt.UTC), ctype)
        self.buckets[bucket][name] = obj
        return obj

    # ------------------------------------------------------------------ requests

    def handle(self, op: str, bucket: str, name: str, timeout: Any, work: Callable[[], Any]) -> Any:
        """One request: faults first (stall, reset, status), then ``work()`` under the lock.

        Returns (response, result)."""
        stall = self._take(op, name, ("stall",))
        if stall is not None:
            stall.waiting.set()
            read = timeout[1] if isinstance(timeout, tuple) else timeout
            limit = STALL_LIMIT if read is None else min(float(read), STALL_LIMIT)
            if not stall.released.wait(limit):
                self.log.append((op, name, "timeout"))
                raise requests.exceptions.ReadTimeout(f"fake GCS: {op} {name} stalled")
        if self._take(op, name, ("reset",)) is not None:
            self.log.append((op, name, "reset"))
            raise requests.exceptions.ConnectionError(
                ConnectionResetError(104, "Connection reset by peer")
            )
        failing = self._take(op, name, ("status",))
        if failing is not None:
            self.log.append((op, name, str(failing.status)))
            return FakeResponse(failing.status, f"fake GCS: {op} {name}"), None
        if bucket not in self.buckets:
            self.log.append((op, name, "404"))
            return FakeResponse(404, f"bucket {bucket} not found"), None
        with self._lock:
            status, result = work()
        self.log.append((op, name, str(status)))
        return FakeResponse(status, f"fake GCS: {op} {name}"), result


class FakeSession:
    """The client's HTTP session (``client._http``): every request of the fake goes
    through :meth:`request`, which :func:`tierfs.backup.bucket.monitor_of` wraps."""

    def __init__(self, server: FakeGcs) -> None:
        self.server = server

    def request(self, method: str, url: str, *, timeout: Any = None, **kw: Any) -> FakeResponse:
        op, bucket, name, work = kw["fake"]
        response, result = self.server.handle(op, bucket, name, timeout, work)
        response.result = result  # type: ignore[attr-defined]
        return response


def _raise_for(response: FakeResponse) -> None:
    if response.status_code >= 400:
        raise gexc.from_http_status(response.status_code, response.text)


class FakeClient:
    """Stands in for ``google.cloud.storage.Client`` (the calls GcsBackend makes)."""

    def __init__(self, server: FakeGcs | None = None, project: str | None = None) -> None:
        self.server = server if server is not None else FakeGcs()
        self.project = project
        self._http = FakeSession(self.server)

    def bucket(self, name: str) -> FakeBucket:
        return FakeBucket(self, name)

    def _call(
        self, op: str, bucket: str, name: str, work: Callable[[], Any], retry: Any, timeout: Any
    ) -> Any:
        def attempt() -> Any:
            response = self._http.request(
                op.upper(),
                f"fake://{bucket}/{name}",
                timeout=timeout,
                fake=(op, bucket, name, work),
            )
            _raise_for(response)
            return response.result  # type: ignore[attr-defined]

        return retry(attempt)() if retry is not None else attempt()

    def list_blobs(
        self,
        bucket: Any,
        prefix: str | None = None,
        delimiter: str | None = None,
        retry: Any = None,
        timeout: Any = None,
        **_: Any,
    ) -> FakeIterator:
        bname = bucket.name if isinstance(bucket, FakeBucket) else str(bucket)
        pre = prefix or ""
        server = self.server

        def work() -> tuple[int, Any]:
            blobs, prefixes = [], set()
            for name in sorted(server.buckets[bname]):
                if not name.startswith(pre):
                    continue
                rest = name[len(pre) :]
                if delimiter and delimiter in rest:
                    prefixes.add(pre + rest.split(delimiter, 1)[0] + delimiter)
                    continue
                obj = server.buckets[bname][name]
                listed = obj.crc32c
                if server._take("list", name, ("wrong_crc",)) is not None:
                    listed ^= 0x5A5A5A5A
                blobs.append((name, len(obj.data), listed, obj.updated))
            return 200, (blobs, prefixes)

        blobs, prefixes = self._call("list", bname, pre, work, retry, timeout)
        fb = FakeBucket(self, bname)
        out = []
        for name, size, crc, updated in blobs:
            b = FakeBlob(fb, name)
            b.size, b.crc32c, b.updated = size, _b64(crc), updated
            out.append(b)
        return FakeIterator(out, prefixes)


class FakeIterator:
    """``list_blobs``' page iterator: the blobs, then ``prefixes``."""

    def __init__(self, blobs: list[FakeBlob], prefixes: set[str]) -> None:
        self._blobs = blobs
        self.prefixes = prefixes

    def __iter__(self) -> Iterator[FakeBlob]:
        return iter(self._blobs)


class FakeBucket:
    def __init__(self, client: FakeClient, name: str) -> None:
        self.client = client
        self.name = name

    def exists(self, retry: Any = None, timeout: Any = None, **_: Any) -> bool:
        try:  # the library answers a 404 with False
            self.client._call("exists", self.name, "", lambda: (200, True), retry, timeout)
        except gexc.NotFound:
            return False
        return True

    def blob(self, name: str, chunk_size: int | None = None, **_: Any) -> FakeBlob:
        return FakeBlob(self, name, chunk_size)


class FakeBlob:
    """``google.cloud.storage.Blob``: the properties and calls tierfs uses."""

    def __init__(self, bucket: FakeBucket, name: str, chunk_size: int | None = None) -> None:
        self.bucket = bucket
        self.name = name
        self.chunk_size = chunk_size
        self.size: int | None = None
        self.crc32c: str | None = None
        self.updated: dt.datetime | None = None
        self.generation: int | None = None

    @property
    def _server(self) -> FakeGcs:
        return self.bucket.client.server

    def _objects(self) -> dict[str, Stored]:
        return self._server.buckets[self.bucket.name]

    # ------------------------------------------------------------------ writes

    def _upload(self, data: bytes, content_type: str | None, retry: Any, timeout: Any) -> None:
        sent = _unb64(self.crc32c)
        server = self._server

        def work() -> tuple[int, Stored | None]:
            arrived = data
            if server._take("put", self.name, ("corrupt_write",)) is not None:
                arrived = flip(data, len(data) // 2)
            crc = crc32c(arrived)
            if sent is not None and crc != sent and server.enforce_crc:
                return 400, None  # "Provided CRC32C ... doesn't match calculated CRC32C"
            obj = server._store(self.bucket.name, self.name, arrived, crc, content_type or "")
            if server._take("put", self.name, ("wrong_crc",)) is not None:
                return 200, dataclasses.replace(obj, crc32c=obj.crc32c ^ 0x5A5A5A5A)
            return 200, obj

        obj = self.bucket.client._call("put", self.bucket.name, self.name, work, retry, timeout)
        self.size, self.crc32c = len(obj.data), _b64(obj.crc32c)
        self.updated, self.generation = obj.updated, obj.generation

    def upload_from_string(
        self,
        data: bytes | str,
        content_type: str = "text/plain",
        checksum: str | None = None,
        retry: Any = None,
        timeout: Any = None,
        **_: Any,
    ) -> None:
        raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
        self._upload(raw, content_type, retry, timeout)

    def upload_from_file(
        self,
        file_obj: Any,
        size: int | None = None,
        content_type: str | None = None,
        checksum: str | None = None,
        retry: Any = None,
        timeout: Any = None,
        crc32c_checksum_value: str | None = None,
        **_: Any,
    ) -> None:
        chunks = []
        left = size
        while left is None or left > 0:
            piece = file_obj.read(min(left, 1 << 20) if left is not None else 1 << 20)
            if not piece:
                break
            chunks.append(piece)
            if left is not None:
                left -= len(piece)
        if crc32c_checksum_value is not None and self.crc32c is None:
            self.crc32c = crc32c_checksum_value
        self._upload(b"".join(chunks), content_type, retry, timeout)

    def delete(self, retry: Any = None, timeout: Any = None, **_: Any) -> None:
        objects = self._objects

        def work() -> tuple[int, None]:
            return (200 if objects().pop(self.name, None) is not None else 404), None

        self.bucket.client._call("delete", self.bucket.name, self.name, work, retry, timeout)

    # ------------------------------------------------------------------ reads

    def _read(self, retry: Any, timeout: Any) -> tuple[bytes, int]:
        server = self._server

        def work() -> tuple[int, tuple[bytes, int] | None]:
            obj = self._objects().get(self.name)
            if obj is None:
                return 404, None
            data = obj.data
            if server._take("get", self.name, ("corrupt_read",)) is not None:
                data = flip(data, len(data) // 2)
            return 200, (data, obj.crc32c)

        result: tuple[bytes, int] = self.bucket.client._call(
            "get", self.bucket.name, self.name, work, retry, timeout
        )
        return result

    def download_as_bytes(
        self, checksum: str | None = "auto", retry: Any = None, timeout: Any = None, **_: Any
    ) -> bytes:
        data, crc = self._read(retry, timeout)
        if checksum is not None and crc32c(data) != crc:
            raise _data_corruption()(None, f"fake GCS: {self.name}: checksum mismatch")
        return data

    def download_to_file(
        self,
        file_obj: Any,
        checksum: str | None = "auto",
        retry: Any = None,
        timeout: Any = None,
        **_: Any,
    ) -> None:
        data, crc = self._read(retry, timeout)
        if checksum is not None and crc32c(data) != crc:
            raise _data_corruption()(None, f"fake GCS: {self.name}: checksum mismatch")
        for i in range(0, len(data), 1 << 20):
            file_obj.write(data[i : i + (1 << 20)])
        if not data:
            file_obj.write(b"")


def fast_settings(deadline: float = 2.0, threads: int = 2) -> Any:
    """GcsSettings for tests: short backoff, ``deadline`` seconds of retries per request."""
    from tierfs.backup.bucket import GcsSettings

    return GcsSettings(
        threads=threads,
        retry_deadline=deadline,
        retry_initial=0.005,
        retry_max=0.02,
        connect_timeout=deadline,
        read_timeout=deadline,
    )


def backend(server: FakeGcs | None = None, spec: str = "bkt", deadline: float = 2.0) -> Any:
    """A real :class:`~tierfs.backup.bucket.GcsBackend` on the fake (``server``: a new one)."""
    from tierfs.backup.bucket import GcsBackend

    return GcsBackend(
        spec, client=FakeClient(server), settings=fast_settings(deadline), widen_pool=False
    )


def wait_for(cond: Callable[[], bool], timeout: float = 30.0) -> None:
    """Poll ``cond`` until true (AssertionError after ``timeout`` seconds)."""
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("condition not reached")
        time.sleep(0.005)


def seal(ram: Any, job: str, rank: int, step: int, files: dict[str, bytes]) -> Any:
    """A real sealed shard of ``files`` (paths under the step directory ``<step>``) in
    the RAM store ``ram`` (:class:`tierfs.store.ramstore.RamStore`), by
    :meth:`tierfs.store.shards.ShardStore.snapshot` from the view. The view's copy
    is removed afterwards (the snapshot keeps its hard links)."""
    import os
    import shutil

    from tierfs.store.shards import ShardKey, ShardStore

    top = os.path.join(ram.view, str(step))
    shutil.rmtree(top, ignore_errors=True)
    for path, data in files.items():
        full = os.path.join(top, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "wb") as f:
            f.write(data)
    shard = ShardStore(ram).snapshot(
        ram.view, ShardKey(job, rank, step), str(step), [str(step)], "generic"
    )
    shutil.rmtree(top)
    return shard


def gcs_tier(server: FakeGcs, deadline: float = 2.0) -> Any:
    """A real :class:`~tierfs.backup.tier.GcsTier` (the restore's bucket reader) on the
    fake, with in-process ports (no RAM store)."""
    import fake_ports

    from tierfs.backup.tier import GcsTier

    t = GcsTier(
        backend(server).spec,
        catalog=fake_ports.catalog(),
        job=fake_ports.FakeJob(),
        reporter=fake_ports.FakeJob(),
        shards=None,  # type: ignore[arg-type]
        budget=fake_ports.FakeBudget(),
        settings=fast_settings(deadline),
    )
    t.access.backend = backend(server, deadline=deadline)  # the seam: get_backend() returns it
    return t
