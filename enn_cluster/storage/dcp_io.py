"""DCP storage plumbing: a writer that checksums as it writes, a reader that is safe and fast.

Writer: checkpoint files are checksummed as their bytes pass (no read-back at commit) and
torch's per-record zip CRC is skipped (our own checksum covers every byte of the file;
torch.load still reads such files). Reader: `.metadata` goes through an allow-list
unpickler, non-tensor entries must load with weights_only=True, and a tensor whose bytes
are one contiguous range is read straight into its destination (`preadv`) instead of
torch.load + narrow + copy. Anything else takes DCP's own path. The files stay plain DCP:
stock `dcp.load` reads them.
"""
from __future__ import annotations

import dataclasses
import io
import logging
import os
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import LoadItemType

from enn_cluster.storage.checksum import RunningChecksum, algorithm_of, file_checksum
from enn_cluster.storage.commits import is_shard, owner_rank
from enn_cluster.storage.dcp_metadata import load_metadata
from enn_cluster.storage.torch_save_layout import DESCRIPTOR_MAX, descriptor_ok
from enn_cluster.storage.torch_save_layout import parse as layout_of
from enn_cluster.storage.writeback import WritebackTracker

log = logging.getLogger("enn_cluster.storage.dcp_io")
_HEAD = 16 << 10  # a tensor record's headers and pickle fit well inside this

# -- writing: checksum while writing, no zip CRC ----------------------------------------------

_crc_lock = threading.Lock()


@contextmanager
def _zip_crc_off():
    """torch.save's per-record CRC costs as much as writing the bytes; ours covers them.
    A torch without the switch writes the CRC as before."""
    get = getattr(torch.serialization, "get_crc32_options", None)
    put = getattr(torch.serialization, "set_crc32_options", None)
    if get is None or put is None:
        yield
        return
    with _crc_lock:
        before = get()
        put(False)
        try:
            yield
        finally:
            put(before)


class _HashingStream:
    """A write-only file that checksums what passes and starts the disk writing each
    32 MB behind it (the closing fsync then waits for little); `intact` is False after
    any seek."""

    def __init__(self, fh) -> None:
        self._fh = fh
        self.running = RunningChecksum()
        self.intact = True
        self.final_size: Optional[int] = None
        self._writeback = WritebackTracker()

    def write(self, data) -> int:
        n = self._fh.write(data)
        self.running.update(data)
        if self.intact:
            self._writeback.wrote(self.fileno, n)
        return n

    def seek(self, *args) -> int:
        self.intact = False
        return self._fh.seek(*args)

    def fileno(self) -> int:
        """Flushed first: DCP fsyncs `fileno()` before it closes the stream, and the bytes
        still in the buffer would otherwise miss that fsync."""
        self._fh.flush()
        return self._fh.fileno()

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.flush()
            self.final_size = self._fh.tell()
        self._fh.close()

    def __getattr__(self, name):  # tell, flush, fileno, closed, writable ...
        return getattr(self._fh, name)


class _HashingFileSystem(FileSystem):
    def __init__(self, sink: dict) -> None:
        super().__init__()
        self.sink = sink

    @contextmanager
    def create_stream(self, path, mode: str):
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            hashing = _HashingStream(stream)
            yield hashing
            hashing.close()
            # every file is named (its rank need not list the directory to find it);
            # one whose checksum the stream cannot vouch for is read back (None)
            self.sink[Path(path).name] = None
            if hashing.intact and hashing.final_size == hashing.running.size:
                self.sink[Path(path).name] = {"size": hashing.running.size,
                                              "checksum": hashing.running.hexdigest()}


class ChecksummingWriter(FileSystemWriter):
    """FileSystemWriter (one fsynced file per rank) that records each file's checksum in
    `checksums` as it writes it; safe from the async checkpoint thread."""

    def __init__(self, path, thread_count: int = 1) -> None:
        super().__init__(str(path), single_file_per_rank=True, sync_files=True,
                         thread_count=thread_count)  # a file per thread: __RANK_I.distcp
        self.checksums: dict = {}
        self.fs = _HashingFileSystem(self.checksums)

    def write_data(self, plan, planner):
        with _zip_crc_off():
            return super().write_data(plan, planner)


# -- reading: nothing unpickled beyond plain data, tensors read in place ----------------------
# DCP's FileSystemReader reads `.metadata` with plain pickle.load, and its DefaultLoadPlanner
# reads non-tensor entries (optimizer param_groups) with torch.load(weights_only=False):
# whoever can write a checkpoint directory could run code in every process that loads it.

def _tensor_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _narrow(t: torch.Tensor, offsets, lengths) -> torch.Tensor:
    """The requested chunk of a saved tensor (what DCP's reader slices out, with public ops)."""
    for dim, (offset, length) in enumerate(zip(offsets, lengths)):
        if length < t.size(dim):
            t = t.narrow(dim, offset, length)
    return t


def _read_exact(fd: int, views: list, pos: int) -> None:
    """preadv until every buffer is full; a short file is a truncated checkpoint."""
    views = [v for v in views if len(v)]
    while views:
        n = os.preadv(fd, views, pos)
        if n <= 0:
            raise OSError(f"checkpoint file ends {sum(map(len, views))} bytes early (truncated)")
        pos += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


class _DirectReads:
    """Positional reads of one file (no checksum); `count`: bytes read from it."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.count = 0

    def read(self, n: int, at: int) -> bytes:
        data = os.pread(self.fd, n, at)
        self.count += len(data)
        return data

    def read_into(self, views: list, at: int) -> None:
        self._exact(views, at)

    def _exact(self, views: list, at: int) -> None:
        _read_exact(self.fd, views, at)
        self.count += sum(len(v) for v in views)


class _StreamingReads(_DirectReads):
    """Positional reads that checksum the whole file as they go, front to back, so that a
    load verifies the bytes it reads with no second pass: a gap before a read is read (and
    hashed) on the way, a read that starts before the frontier is served from the last
    headers read. `finish` hashes the rest of the file. A read the frontier cannot serve
    (never expected: requests come in file order) leaves the checksum to a full re-read."""

    def __init__(self, fd: int, running: RunningChecksum) -> None:
        super().__init__(fd)
        self.running, self.pos, self.whole = running, 0, True
        self._last, self._last_at = b"", 0

    def _advance_to(self, at: int) -> None:
        while self.pos < at:
            chunk = os.pread(self.fd, min(at - self.pos, 8 << 20), self.pos)
            if not chunk:
                raise OSError(f"checkpoint file ends at {self.pos}, before {at} (truncated)")
            self.running.update(chunk)
            self.pos += len(chunk)
            self.count += len(chunk)

    def _from_last(self, views: list, at: int) -> tuple[list, int]:
        """Fill the front of `views` from the bytes already read before the frontier."""
        if at >= self.pos or not self.whole:
            return views, at
        if at < self._last_at:
            self.whole = False
            return views, at
        views = [v for v in views if len(v)]
        while views and at < self.pos:
            k = min(len(views[0]), self.pos - at)
            views[0][:k] = self._last[at - self._last_at:at - self._last_at + k]
            at += k
            views[0] = views[0][k:]
            if not len(views[0]):
                views.pop(0)
        return views, at

    def read(self, n: int, at: int) -> bytes:
        buf = bytearray(n)
        self.read_into([memoryview(buf)], at)
        if at + n == self.pos:  # ends at the frontier: the next read may start inside it
            self._last, self._last_at = bytes(buf), at
        return bytes(buf)

    def read_into(self, views: list, at: int) -> None:
        views, at = self._from_last(views, at)
        if not views:
            return
        if not self.whole or at < self.pos:
            self.whole = False
            self._exact(views, at)
            return
        self._advance_to(at)
        views = [v for v in views if len(v)]
        self._exact(list(views), at)
        for v in views:
            self.running.update(v)
            self.pos += len(v)
        self._last, self._last_at = b"", self.pos

    def finish(self, path: str) -> tuple[int, str]:
        """(size, checksum) of the whole file: the rest hashed, or all of it re-read."""
        if not self.whole:
            size, checksum = file_checksum(Path(path), like=self.running.hexdigest())
            self.count += size
            return size, checksum
        self._advance_to(os.fstat(self.fd).st_size)
        return self.pos, self.running.hexdigest()


class ShardVerifier:
    """The shard files one rank checksums while it loads, against the commit record: DCP's
    `__K_I.distcp` goes to rank K mod world, which at an unchanged world size is the rank
    that reads all of it anyway. A file none of its requests reach is read for its
    checksum alone."""

    def __init__(self, record: dict, names: list, rank: int, world: int) -> None:
        self.record = record
        self.mine = [n for n in names if is_shard(n) and owner_rank(n) % world == rank]
        self.found: dict = {}
        self.bytes_read = 0  # by `problems`, for files no request reached

    def running(self, name: str) -> Optional[RunningChecksum]:
        if name not in self.mine:
            return None
        return RunningChecksum(algorithm_of(self.record["files"][name]["checksum"]))

    def problems(self, path) -> list:
        """What disagrees with the record; files no request reached are read here."""
        out = []
        for name in self.mine:
            if name not in self.found:
                try:
                    self.found[name] = file_checksum(Path(path) / name,
                                                     like=self.record["files"][name]["checksum"])
                    self.bytes_read += self.found[name][0]
                except FileNotFoundError:
                    out.append(f"{name}: missing")
                    continue
            size, checksum = self.found[name]
            info = self.record["files"][name]
            if size != info["size"]:
                out.append(f"{name}: size {size}, recorded {info['size']}")
            elif checksum != info["checksum"]:
                out.append(f"{name}: checksum {checksum}, recorded {info['checksum']}")
        return out


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader with an allow-list `.metadata` unpickler and in-place tensor reads;
    with a `verifier`, the files it names are checksummed as they are read. `bytes_read`:
    the shard bytes this rank read from the filesystem."""

    def __init__(self, path, verifier: Optional[ShardVerifier] = None) -> None:
        super().__init__(path)
        self.verifier = verifier
        self.bytes_read = 0

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import StorageMeta

        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        metadata = load_metadata(Path(str(self.path)) / name)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner):
        per_file: dict = {}
        for req in plan.items:
            per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        if self.verifier is not None:
            for name in self.verifier.mine:  # verified in this pass even if nothing is read
                per_file.setdefault(name, [])
        rest = []
        for relative_path, reqs in per_file.items():
            reqs.sort(key=lambda r: self.storage_data[r.storage_index].offset)
            full = os.path.join(str(self.path), relative_path)
            running = self.verifier.running(relative_path) if self.verifier else None
            try:
                fd = os.open(full, os.O_RDONLY)
            except FileNotFoundError:
                if reqs:
                    raise
                continue  # reported missing by the verifier
            try:
                reads = _DirectReads(fd) if running is None else _StreamingReads(fd, running)
                rest += [r for r in reqs if not self._read_in_place(reads, r, planner)]
                if running is not None:
                    self.verifier.found[relative_path] = reads.finish(full)
            finally:
                os.close(fd)
                self.bytes_read += reads.count
        self.bytes_read += sum(self.storage_data[r.storage_index].length for r in rest)
        return super().read_data(dataclasses.replace(plan, items=rest), planner)

    def _read_in_place(self, reads: _DirectReads, req, planner) -> bool:
        """Read one tensor's bytes front to back straight into its destination; False
        when they are not one contiguous range (DCP's own path takes those)."""
        info = self.storage_data[req.storage_index]
        if req.type != LoadItemType.TENSOR or getattr(info, "transform_descriptors", None):
            return False
        head = reads.read(min(_HEAD, info.length), info.offset)
        layout = layout_of(head)
        if layout is None or not layout.little_endian:
            return False
        part = _narrow(layout.saved, req.storage_offsets, req.lengths)
        target = planner.resolve_tensor(req).detach()
        start = layout.data_start + part.storage_offset() * part.element_size()
        nbytes = part.numel() * part.element_size()
        desc_at = layout.data_start + layout.nbytes
        if not part.is_contiguous() or nbytes == 0 \
                or part.size() != target.size() or desc_at + 16 > info.length:
            return False
        direct = target.device.type == "cpu" and target.is_contiguous() and \
            part.dtype == target.dtype
        # another dtype (prediction reads fp32 into bf16): one tensor's bytes, cast on copy
        dest = target if direct else torch.empty(target.size(), dtype=part.dtype)
        view = _tensor_bytes(dest)
        have = max(0, min(len(head) - start, nbytes))  # bytes already in `head`
        view[:have] = head[start:start + have]
        desc = bytearray(min(DESCRIPTOR_MAX, info.length - desc_at))
        if desc_at + len(desc) <= len(head):  # a small tensor: its record came whole
            desc[:] = head[desc_at:desc_at + len(desc)]
        elif start + nbytes == desc_at:  # the usual case: one read up to the descriptor
            reads.read_into([view[have:], memoryview(desc)], info.offset + start + have)
        else:
            reads.read_into([view[have:]], info.offset + start + have)
            reads.read_into([memoryview(desc)], info.offset + desc_at)
        if not descriptor_ok(bytes(desc), layout.nbytes):
            log.warning("%s: tensor record at %d does not end where its header says; "
                        "reading it the slow way", self.path, info.offset)
            return False
        if not direct:
            target.copy_(dest)
        planner.commit_tensor(req, target)
        return True


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner whose non-tensor entries must load with weights_only=True (plain
    data and tensors); only bytes that passed that are handed to DCP's own loader."""

    def load_bytes(self, read_item, value) -> None:
        data = value.read()
        torch.load(io.BytesIO(data), weights_only=True)  # raises on any other object
        super().load_bytes(read_item, io.BytesIO(data))


def safe_load(state: dict, path, process_group=None, verifier: Optional[ShardVerifier] = None,
              planner: Optional[SafeLoadPlanner] = None) -> int:
    """dcp.load that never unpickles arbitrary objects from the checkpoint; with a
    `verifier`, its files are checksummed in the same pass (see `verifier.problems`).
    Returns the shard bytes this rank read."""
    import torch.distributed as dist

    no_dist = process_group is None and not dist.is_initialized()
    with warnings.catch_warnings():  # in one process on purpose (API, export): no warning
        if no_dist:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=(reader := SafeFileSystemReader(str(path), verifier)),
                 planner=planner or SafeLoadPlanner(), process_group=process_group,
                 no_dist=no_dist)
    return reader.bytes_read
