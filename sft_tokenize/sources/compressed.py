"""Compressed input files: which codec a name asks for, and reading one with its errors named.

A compression suffix follows the format's extension (`train.jsonl.gz`); fsspec's codecs decompress as the
file is read. A truncated or corrupt archive fails as a BadInput naming the file, whichever codec it is.
"""

from __future__ import annotations

import io
import lzma
import os
import zlib

import fsspec

from sft_tokenize.errors import BadInput

# Compression suffixes after the format's extension, as fsspec names their codecs.
COMPRESSIONS = {".gz": "gzip", ".bz2": "bz2", ".zst": "zstd", ".xz": "xz"}
DECOMPRESSION_ERRORS = (EOFError, OSError, zlib.error, lzma.LZMAError)
try:  # fsspec's zstd codec (the standard library's from Python 3.14)
    from compression.zstd import ZstdError
except ImportError:
    try:
        from backports.zstd import ZstdError
    except ImportError:
        ZstdError = OSError
DECOMPRESSION_ERRORS += (ZstdError,)


def compression_of(url: str) -> str | None:
    """fsspec's name of the file's compression codec, from its suffix; None if it is not compressed."""
    return COMPRESSIONS.get(os.path.splitext(url.rstrip("/"))[1].lower())


def format_extension(url: str) -> str:
    """The extension naming the file's format, under any compression suffix: `a.jsonl.gz` → `.jsonl`."""
    base = url.rstrip("/")
    if compression_of(base):
        base = os.path.splitext(base)[0]
    return os.path.splitext(base)[1].lower()


class _CheckedDecompression(io.RawIOBase):
    """A decompressing file whose codec errors (a truncated or corrupt archive) are BadInput naming the file."""

    def __init__(self, file, url: str, codec: str):
        self._file, self._url, self._codec = file, url, codec

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        try:
            data = self._file.read(len(buffer))
        except DECOMPRESSION_ERRORS as error:
            raise BadInput(f"{self._url}: truncated or corrupt {self._codec} archive "
                           f"({type(error).__name__}: {error})") from None
        buffer[:len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self._file.close()
        super().close()


def open_decompressed(fs: fsspec.AbstractFileSystem, path: str, url: str, buffer_size: int = 1 << 20, **options):
    """The file's bytes, decompressed as they are read when its suffix names a codec."""
    codec = compression_of(url)
    if codec is None:
        return fs.open(path, "rb", **options)
    if codec not in fsspec.available_compressions():
        raise BadInput(f"{url}: cannot read {codec} files: install its codec (for .zst: pip install backports.zstd)")
    file = fs.open(path, "rb", compression=codec, **options)
    return io.BufferedReader(_CheckedDecompression(file, url, codec), buffer_size)
