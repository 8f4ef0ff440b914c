"""Reading tar shards: WebDataset's ``tarfile_to_samples``, with a faster member reader.

WebDataset reads shards with Python's ``tarfile`` in streaming mode (``"r|*"``), whose
per-member Python work is a visible share of a training pass's time per image (figures:
``docs/reference/benchmarks.md``). The shards ``distnorm-shards`` writes are plain ustar
(regular members, integer fields, no PAX or GNU extension headers), which
:func:`tar_members` reads from the same stream with less work per member: one 512-byte
header read, its checksum, name and size, then the data. At the first block that is
anything else — a compressed stream, a PAX or GNU extension header, a pre-POSIX header —
it hands the rest of the stream, that block included, to WebDataset's ``tarfile`` reader, so
every shard reads as before; only where the two differ on a broken shard is this stricter: a
shard that ends inside a header raises (``tarfile`` takes it for the end of the archive).

Opening the URLs (``pipe:``, ``file:``, local paths) and grouping the members into samples
by key stay WebDataset's (``url_opener``, ``group_by_keys``), as do the error handler's
arguments: the exception carries the stream and the URL.
"""

from __future__ import annotations

import re
import tarfile
from typing import Any, Callable, Iterable, Iterator

__all__ = ["tar_members", "tarfile_to_samples"]

_BLOCK = 512
_ZERO_BLOCK = bytes(_BLOCK)
_POSIX, _GNU = b"ustar\x0000", b"ustar  \x00"
_REGULAR, _SKIPPED = (b"0", b"7", b"\x00"), (b"1", b"2", b"3", b"4", b"5", b"6")  # tarfile's regular types, sans sparse
_META = re.compile(r"__[^/]*__($|/)")  # WebDataset's skip_meta


class _Prefixed:
    """A read-only stream with ``head`` put back in front of ``stream``."""

    def __init__(self, head: bytes, stream: Any):
        self.head, self.stream = head, stream

    def read(self, size: int = -1) -> bytes:
        if not self.head:
            return self.stream.read(size)
        if size is None or size < 0:
            out, self.head = self.head + self.stream.read(), b""
            return out
        out, self.head = self.head[:size], self.head[size:]
        return out + (self.stream.read(size - len(out)) if len(out) < size else b"")

    def __str__(self) -> str:  # WebDataset's messages name the stream
        return str(self.stream)


def _read_exactly(read: Callable[[int], bytes], size: int) -> bytes:
    data = read(size)
    while len(data) < size:  # pipes may return less than asked before their end
        more = read(size - len(data))
        if not more:
            raise tarfile.ReadError(f"unexpected end of data ({len(data)} of {size} bytes)")
        data += more
    return data


def tar_members(stream: Any, handler: Callable[[BaseException], bool]) -> Iterator[dict]:
    """``{"fname", "data"}`` for the regular members of a tar stream, in order, as WebDataset's
    ``tar_file_iterator`` gives them (metadata members ``__*__`` skipped); see the module docs."""
    from webdataset.tariterators import tar_file_iterator

    read, first = stream.read, True
    while True:
        block = read(_BLOCK)
        if 0 < len(block) < _BLOCK:  # a pipe may return less than asked: complete it
            block += _read_exactly(read, _BLOCK - len(block))
        if not first and (not block or block == _ZERO_BLOCK):
            return  # the end-of-archive blocks (or a stream that ends at a member boundary)
        first, magic, kind = False, block[257:265], block[156:157]
        if (magic not in (_POSIX, _GNU) or not (kind in _REGULAR or kind in _SKIPPED) or block[124] & 0x80
                or sum(block) - sum(block[148:156]) + 256 != tarfile.nti(block[148:156])):
            # An empty stream, a compressed one, an extension header, a signed checksum:
            # tarfile reads (or refuses) the rest, this block included.
            yield from tar_file_iterator(_Prefixed(block, stream), handler=handler)
            return
        size = tarfile.nti(block[124:136])
        name = block[:100].split(b"\x00", 1)[0]
        if magic == _POSIX and block[345] != 0:
            name = block[345:500].split(b"\x00", 1)[0] + b"/" + name
        data = _read_exactly(read, size) if size else b""
        if size % _BLOCK:
            _read_exactly(read, _BLOCK - size % _BLOCK)
        fname = name.decode("utf-8", "surrogateescape")
        if kind in _SKIPPED or name.endswith(b"/") or (fname.startswith("__") and _META.match(fname)):
            continue  # not a regular file (tarfile: a name ending in "/" is a directory), or metadata
        yield {"fname": fname, "data": data}


def _expand(sources: Iterable[dict], handler: Callable[[BaseException], bool]) -> Iterator[dict]:
    """WebDataset's ``tar_file_expander`` with :func:`tar_members` as the member reader."""
    for source in sources:
        url = source["url"]
        try:
            for member in tar_members(source["stream"], handler):
                member["__url__"] = url
                yield member
            yield {}  # end of shard: samples of two shards are not merged
        except Exception as exn:  # noqa: BLE001 - the handler decides, as in WebDataset
            exn.args = exn.args + (source.get("stream"), url)
            if handler(exn):
                continue
            break


def _samples(src: Iterable[dict], handler: Callable[[BaseException], bool]) -> Iterator[dict]:
    from webdataset.tariterators import group_by_keys, url_opener

    return group_by_keys(_expand(url_opener(src, handler=handler), handler), handler=handler)


def tarfile_to_samples(handler: Callable[[BaseException], bool]) -> Callable[[Iterable[dict]], Iterator[dict]]:
    """A pipeline stage, ``webdataset.tarfile_to_samples(handler=handler)`` with
    :func:`tar_members` reading the members."""
    return lambda src: _samples(src, handler)
