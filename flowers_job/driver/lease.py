"""One writer per output: the lease a command takes on ``paths.output_dir`` before it writes
anything there (driver side, no Spark), held for the whole run, automatic restarts
included. A second command on the same output stops with :class:`OutputInUseError` naming
the holder. On a disk the lease is an OS lock (``flock``, through :class:`filelock.FileLock`)
beside the holder's record; on S3, an object created by a conditional put and renewed every
:data:`HEARTBEAT_SECONDS`, stale after :data:`STALE_AFTER_SECONDS`; elsewhere none, with a
warning. The lease is per process and re-entrant (the CLI, then
:func:`~flowers_job.driver.pipeline.run_job` inside it, hold one lease), and it is what lets
VACUUM use a short retention (:func:`flowers_job.ingest.retention.sole_writer`). The
protocol, stale leases and the limits: docs/failures.md, "One writer per output".
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

from filelock import FileLock, Timeout

from flowers_job.errors import OutputInUseError
from flowers_job.ingest.retention import sole_writer
from flowers_job.location import S3_SCHEMES, Location, conditional_writes_missing
from flowers_job.runtime.parent_watch import driver_identity, process_alive

__all__ = [
    "HEARTBEAT_SECONDS",
    "LOCK_NAME",
    "RECORD_NAME",
    "STALE_AFTER_SECONDS",
    "Holder",
    "OutputInUseError",
    "OutputLease",
    "output_lease",
    "read_holder",
]

log = logging.getLogger(__name__)

LOCK_NAME = ".flowers_job.lease"
"""The lock file of a lease on a disk (``flock`` through :class:`filelock.FileLock`)."""
RECORD_NAME = ".flowers_job.lease.json"
"""The holder's record: beside the lock file on a disk; the lease object itself on S3."""
HEARTBEAT_SECONDS = 30.0
"""How often the holder of an S3 lease rewrites its object (seconds)."""
STALE_AFTER_SECONDS = 3 * HEARTBEAT_SECONDS
"""An S3 lease not rewritten for this long (three missed heartbeats, seconds) is stale."""
RECORD_WAIT_SECONDS = 2.0
"""On a disk, how long a refused command waits for the holder's record (written just after
its lock) before it names what it found."""


@dataclass(frozen=True)
class Holder:
    """Who holds a lease: the record in :data:`RECORD_NAME` (JSON of these fields).

    Attributes:
        host, pid, create_time: the driver process (:func:`driver_identity`;
            ``create_time`` in seconds since the epoch tells a reused pid apart).
        started: when it took the lease, ISO 8601 in UTC, to the second.
        command: ``run``, ``train`` or ``ingest``.
        output: the output location.
        heartbeat: when the record was last written (seconds since the epoch, the holder's
            clock; S3 staleness uses the store's clock instead).
    """

    host: str
    pid: int
    create_time: float
    started: str
    command: str
    output: str
    heartbeat: float = field(default_factory=time.time)

    @classmethod
    def me(cls, command: str, output: Location) -> Holder:
        """This process, taking the lease now."""
        now = time.time()
        started = datetime.fromtimestamp(now, tz=UTC).isoformat(timespec="seconds")
        return cls(**driver_identity(), started=started, command=command, output=output.url)

    @classmethod
    def parse(cls, data: bytes) -> Holder | None:
        """The record in ``data``, or None when it is not one."""
        try:
            raw = json.loads(data)
            return cls(
                host=str(raw["host"]),
                pid=int(raw["pid"]),
                create_time=float(raw["create_time"]),
                started=str(raw["started"]),
                command=str(raw.get("command", "?")),
                output=str(raw.get("output", "?")),
                heartbeat=float(raw.get("heartbeat", 0.0)),
            )
        except (ValueError, KeyError, TypeError):
            return None

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    def beat(self) -> Holder:
        """The same holder, heartbeat now."""
        return Holder(**{**asdict(self), "heartbeat": time.time()})

    def describe(self) -> str:
        """``flowers-job run, pid 123 on host h, started <UTC time, ISO 8601>``."""
        return f"flowers-job {self.command}, pid {self.pid} on host {self.host}, started {self.started}"

    def gone(self) -> bool:
        """The holder ran on this host and no longer runs (a pid reused since does not count
        as it)."""
        return self.host == socket.gethostname() and not process_alive(asdict(self))


def _refused(output: Location, holder: Holder | None, detail: str = "") -> OutputInUseError:
    who = holder.describe() if holder is not None else f"a process whose record {detail}"
    return OutputInUseError(
        f"paths.output_dir: {output} is in use by {who}: one command writes an output at a "
        "time. Wait for it to end, or give another --output-dir. Nothing was written."
    )


def read_holder(output: Location | str | os.PathLike[str]) -> Holder | None:
    """The record of the lease on ``output``, or None (no lease, or an unreadable record).
    It may be a stale lease's."""
    try:
        return Holder.parse((Location.of(output) / RECORD_NAME).read_bytes())
    except (OSError, ValueError):
        return None


class _DiskLease:
    """The lease on a disk: an OS lock, and the holder's record beside it."""

    def __init__(self, output: Location, holder: Holder) -> None:
        self.output, self.holder = output, holder
        self.record = output / RECORD_NAME
        self.lock_path = (output / LOCK_NAME).local_path
        self.lock = FileLock(str(self.lock_path), timeout=0)

    def acquire(self) -> None:
        self.created = not self.output.exists()  # then release removes it if still empty
        self.output.mkdir()
        self._lock()
        stale = read_holder(self.output)
        if stale is not None:
            log.warning(
                "took over the stale lease of %s on %s (its process ended without releasing it)",
                stale.describe(),
                self.output,
            )
        try:
            self.record.write_bytes(self.holder.to_json())
        except BaseException:
            self.release()
            raise

    def _lock(self) -> None:
        """Take the OS lock, tried at once; while it is held, wait up to
        :data:`RECORD_WAIT_SECONDS` for the holder's record and raise naming it. A holder
        that is just ending (its record gone or naming a dead process, its lock file
        unlinked) is waited for within that bound."""
        deadline = time.monotonic() + RECORD_WAIT_SECONDS
        while True:
            try:
                self.lock.acquire()
            except Timeout:
                holder = read_holder(self.output)
                if holder is not None and not holder.gone():
                    raise _refused(self.output, holder) from None
                if time.monotonic() > deadline:
                    detail = "is missing" if holder is None else f"names {holder.describe()}, gone"
                    raise _refused(self.output, None, f"{self.record} {detail}") from None
            else:
                if self.lock_path.exists():
                    return
                # locked the inode of a lock file its holder unlinked on release: try again
                self.lock.release()
            time.sleep(0.1)

    def release(self) -> None:
        """Remove the record and the lock file while the lock is held, then unlock: the
        output is left as it was found (a folder the lease created and nothing else wrote
        is removed too)."""
        try:
            self.record.unlink(missing_ok=True)
            self.lock_path.unlink(missing_ok=True)
        finally:
            self.lock.release()
        if getattr(self, "created", False):
            with contextlib.suppress(OSError):  # not empty: the command wrote there
                os.rmdir(self.lock_path.parent)


class _S3Lease:
    """The lease on S3: one object, created and renewed with conditional puts."""

    def __init__(
        self, output: Location, holder: Holder, heartbeat_seconds: float, stale_after: float
    ) -> None:
        import boto3

        self.output, self.holder = output, holder
        bucket, _, prefix = (output / RECORD_NAME).sdk_url.removeprefix("s3://").partition("/")
        self.bucket, self.key = bucket, prefix
        self.client = boto3.client("s3")  # the standard chain: AWS_*, ~/.aws, a profile
        self.heartbeat_seconds, self.stale_after = heartbeat_seconds, stale_after
        self.etag: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _put(self, holder: Holder, **condition: str) -> str | None:
        """Write ``holder`` under ``condition``; its new ETag, or None if the condition failed."""
        from botocore.exceptions import ClientError

        try:
            reply = self.client.put_object(
                Bucket=self.bucket,
                Key=self.key,
                Body=holder.to_json(),
                ContentType="application/json",
                **condition,
            )
        except ClientError as exc:
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            # 412: the condition failed; 409: a concurrent conditional write to the same key
            if status in (409, 412):
                return None
            raise
        return str(reply["ETag"])

    def _current(self) -> tuple[Holder | None, str, float] | None:
        """The lease object: its record, ETag and age (seconds, by the store's clock); None
        when there is none."""
        from botocore.exceptions import ClientError

        try:
            reply = self.client.get_object(Bucket=self.bucket, Key=self.key)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise
        body = reply["Body"].read()
        date = reply.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
        now = parsedate_to_datetime(date) if date else datetime.now(tz=UTC)
        age = (now - reply["LastModified"]).total_seconds()
        return Holder.parse(body), str(reply["ETag"]), age

    def acquire(self) -> None:
        for _ in range(3):  # a lease released between our put and our read: try again
            self.etag = self._put(self.holder, IfNoneMatch="*")
            if self.etag is not None:
                break
            found = self._current()
            if found is None:
                continue
            stale, etag, age = found
            if stale is not None and age < self.stale_after and not stale.gone():
                raise _refused(self.output, stale)
            self.etag = self._put(self.holder, IfMatch=etag)
            if self.etag is None:  # another driver took it over first
                raise _refused(self.output, (self._current() or (None,))[0])
            log.warning(
                "took over the stale lease of %s on %s (%s)",
                stale.describe() if stale is not None else "an unreadable record",
                self.output,
                f"not renewed for {age:.0f} s" if age >= self.stale_after else "its process ended",
            )
            break
        else:
            raise _refused(self.output, None, f"s3://{self.bucket}/{self.key} kept changing")
        self._thread = threading.Thread(
            target=self._renew, name=f"lease {self.output}", daemon=True
        )
        self._thread.start()

    def _renew(self) -> None:
        """Every ``heartbeat_seconds``: rewrite the record, if it is still ours."""
        while not self._stop.wait(self.heartbeat_seconds):
            assert self.etag is not None
            try:
                etag = self._put(self.holder.beat(), IfMatch=self.etag)
            except Exception as exc:  # a network error: try again at the next beat
                log.warning("could not renew the lease on %s: %s", self.output, exc)
                continue
            if etag is None:
                taker = self._current()
                log.error(
                    "the lease on %s was taken over by %s: another command may now write there",
                    self.output,
                    taker[0].describe() if taker and taker[0] else "another process",
                )
                return
            self.etag = etag

    def release(self) -> None:
        from botocore.exceptions import ClientError

        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self.etag is None:
            return
        with contextlib.suppress(ClientError):  # taken over meanwhile: it is not ours to delete
            self.client.delete_object(Bucket=self.bucket, Key=self.key, IfMatch=self.etag)


_HELD: dict[str, tuple[OutputLease, int]] = {}
_HELD_LOCK = threading.Lock()


class OutputLease:
    """The lease of one command on ``output`` (module docstring); a context manager.

    Args:
        output: ``paths.output_dir``.
        command: what holds it (``run``, ``train``, ``ingest``), for the record.
        heartbeat_seconds, stale_after_seconds: S3 only: how often the record is renewed,
            and how old a record is stale.

    Raises:
        OutputInUseError: (on entering) another live process holds the lease; the message
            names it (host, pid, start time). Nothing was written.
        botocore.exceptions.ClientError: the S3 store refused the lease for another reason
            (credentials, permissions).
    """

    def __init__(
        self,
        output: Location | str | os.PathLike[str],
        command: str,
        *,
        heartbeat_seconds: float = HEARTBEAT_SECONDS,
        stale_after_seconds: float = STALE_AFTER_SECONDS,
    ) -> None:
        self.output = Location.of(output)
        self.holder = Holder.me(command, self.output)
        self._impl: _DiskLease | _S3Lease | None
        scheme = self.output.url.partition("://")[0]
        if self.output.is_local:
            self._impl = _DiskLease(self.output, self.holder)
        elif scheme in S3_SCHEMES and (missing := conditional_writes_missing()) is None:
            self._impl = _S3Lease(self.output, self.holder, heartbeat_seconds, stale_after_seconds)
        else:
            why = missing if scheme in S3_SCHEMES else f"{scheme}:// has no conditional write"
            log.warning(
                "no lease taken on %s: %s; two commands on this output would not be stopped "
                "(docs/failures.md)",
                self.output,
                why,
            )
            self._impl = None
        self._writer = sole_writer(self.output)

    def __enter__(self) -> OutputLease:
        if self._impl is not None:
            self._impl.acquire()
            log.info("holding the lease on %s (%s)", self.output, self.holder.describe())
            self._writer.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._impl is not None:
            try:
                self._writer.__exit__(None, None, None)
            finally:
                self._impl.release()


@contextlib.contextmanager
def output_lease(output: Location | str | os.PathLike[str], command: str) -> Iterator[OutputLease]:
    """:class:`OutputLease` on ``output``, re-entrant in this process: an inner request for
    an output this process holds already gets the held lease (errors as
    :class:`OutputLease`'s)."""
    url = Location.of(output).url
    with _HELD_LOCK:
        held = _HELD.get(url)
        if held is not None:
            _HELD[url] = (held[0], held[1] + 1)
    if held is not None:
        try:
            yield held[0]
        finally:
            with _HELD_LOCK:
                lease, depth = _HELD[url]
                _HELD[url] = (lease, depth - 1)
        return
    with OutputLease(url, command) as lease:
        with _HELD_LOCK:
            _HELD[url] = (lease, 1)
        try:
            yield lease
        finally:
            with _HELD_LOCK:
                del _HELD[url]
