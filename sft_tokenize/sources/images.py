"""Images in a conversation: the shapes real data holds them in, normalized; their bytes loaded; their headers read.

A message's image arrives in one of these shapes, all normalized to `{"type": "image", "image": ImageRef}`:

    {"type": "image", "image": PATH | URL | data URI | bytes}     (also "url" / "path" / "base64" keys)
    {"type": "image_url", "image_url": {"url": ...}}  or  "image_url": "..."     (OpenAI; also "input_image")
    {"bytes": b | None, "path": p | None}             a `datasets` Image() cell, as any of the values above
    "<image>" in a message's text, or a payload-less {"type": "image"} part, with a row's `images` list:
                                                      the k-th placeholder of the conversation is images[k]

Images are numbered 1, 2, … in the order the conversation shows them, and every error says "image N" and
what was wrong; the caller adds the file and the line (`BadRow.at`). Loading goes through fsspec, so local
paths, file://, s3://, gs://, hf:// and http(s):// take the same code; data: URIs are decoded here.

The header is read without decoding pixels: `PIL.Image.open` is lazy and only the size, format and EXIF
orientation are read. Size is the displayed one, after the EXIF orientation transformers' `load_image` applies
(`ImageOps.exif_transpose`), since that is the image its processor resizes. PIL stays imported inside the
functions, so code that only plans or reads a cache does not load it.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import posixpath
import re
import struct
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

from sft_tokenize.errors import BadRow
from sft_tokenize.files import image_access_refusal, is_chained, network_failure, with_timeouts
from sft_tokenize.sources.records import file_identity, filesystem

PLACEHOLDER = "<image>"
IMAGE_PART_TYPES = ("image", "image_url", "input_image")
# What PIL decodes itself (no external delegate such as Ghostscript for EPS): anything else is refused up front,
# and Image.open tries only these plugins (multi-picture JPEGs, MPO, come through the JPEG one).
FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")
# EXIF orientations 5-8 rotate by 90 or 270 degrees (some also mirror): the displayed image is h x w.
SWAPPING_ORIENTATIONS = (5, 6, 7, 8)
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# Chunks that can carry an orientation (EXIF, or XMP / raw EXIF in a text chunk); PIL sees them only on load
# when they follow the pixel data.
_PNG_METADATA_CHUNKS = (b"eXIf", b"tEXt", b"zTXt", b"iTXt")


def _numbered(index: int | None, text: str) -> str:
    return f"image {index}: {text}" if index is not None else text


@dataclass(frozen=True)
class ImageRef:
    """Where one image's encoded bytes come from: inline `data`, or a `url` (absolute local path or fsspec URL)."""

    url: str | None = None
    data: bytes | None = field(default=None, repr=False)
    # As the row wrote it (a datasets cell's original file name, say): for messages only, so the same bytes
    # compare equal whatever shape carried them.
    name: str | None = field(default=None, compare=False)

    def __post_init__(self):
        if (self.url is None) == (self.data is None):
            raise ValueError("an ImageRef holds exactly one of url and data")

    def describe(self) -> str:
        if self.url is not None:
            return self.url if not self.url.startswith("data:") else self.url[:40] + "…"
        return f"{self.name} ({len(self.data):,} inline bytes)" if self.name else f"{len(self.data):,} inline bytes"

    def load(self, max_bytes: int | None = None, *, index: int | None = None,
             storage_options: dict | None = None, timeout: float | None = None) -> tuple[bytes, tuple]:
        """The image's encoded bytes and its file's identity (records.file_identity; () for inline bytes),
        refusing more than `max_bytes`, a remote one waiting at most `timeout` seconds for its connection and
        for each read; errors are BadRows saying "image <index>"."""
        if self.data is not None:
            _check_size(len(self.data), max_bytes, index, self.describe())
            return self.data, ()
        return _read_url(self.url, max_bytes, index, storage_options, timeout)


def _check_size(size: int, max_bytes: int | None, index: int | None, what: str) -> None:
    if max_bytes is not None and size > max_bytes:
        raise BadRow("image_too_large", _numbered(index, f"{what} is {size:,} bytes, over the {max_bytes:,}-byte "
                                                         "limit (--max-image-bytes)"))


def check_scheme(url: str, index: int | None = None) -> None:
    """Refuse a URL whose scheme fsspec does not know, or whose filesystem package is not installed."""
    import fsspec

    match = _SCHEME.match(url)
    if not match:
        return
    scheme = match.group(1).lower()
    try:
        fsspec.get_filesystem_class(scheme)
    except ValueError:
        raise BadRow("image_url_scheme", _numbered(index, f"unsupported URL scheme {scheme!r} in {url!r}: use a "
                                                          "local path, file://, data:, http(s)://, s3://, gs://, "
                                                          "hf:// or another scheme fsspec reads")) from None
    except ImportError as error:
        raise BadRow("image_url_scheme", _numbered(index, f"reading {scheme}:// URLs needs a package that is not "
                                                          f"installed ({error})")) from None


def _read_url(url: str, max_bytes: int | None, index: int | None,
              storage_options: dict | None, timeout: float | None = None) -> tuple[bytes, tuple]:
    check_scheme(url, index)
    try:
        fs, path = filesystem(url, with_timeouts(url, storage_options, timeout))
        try:
            info = fs.info(path)
        except (NotImplementedError, OSError, ValueError) as error:  # some servers answer no HEAD: the read
            if network_failure(error):  # below limits, but none answers a refused connection
                raise
            info = {}
        if info.get("type") == "directory":
            raise IsADirectoryError(path)
        identity = file_identity(fs, path, info)
        if info.get("size") is not None:
            _check_size(info["size"], max_bytes, index, url)
        with fs.open(path, "rb") as f:
            data = f.read() if max_bytes is None else f.read(max_bytes + 1)
    except BadRow:
        raise
    except Exception as error:
        if failure := network_failure(error):
            within = f" within {timeout:g} s (--image-timeout)" if failure == "no answer" and timeout else ""
            raise BadRow("image_unreadable", _numbered(index, f"{url}: {failure}{within}")) from None
        if isinstance(error, FileNotFoundError):
            raise BadRow("image_missing", _numbered(index, f"{url}: file not found")) from None
        if isinstance(error, IsADirectoryError):
            raise BadRow("image_missing", _numbered(index, f"{url} is a directory, not an image file")) from None
        # fsspec backends raise their own types (aiohttp, botocore, …): name it, one line
        detail = " ".join(str(error).split())[:200] or type(error).__name__
        raise BadRow("image_unreadable", _numbered(index, f"{url} could not be read: {detail}")) from None
    _check_size(len(data), max_bytes, index, url)
    return data, identity


def changed_file(files: Sequence[Sequence], storage_options: dict | None = None,
                 timeout: float | None = None) -> str | None:
    """The first of these image files (`[url, *identity]`, as `ImageRef.load` gave them) whose identity is not
    the same now, or that is gone; None if none changed. A stat each here, a HEAD request each remotely, which
    waits at most `timeout` seconds for its connection and its answer (a file that does not answer changed)."""
    for url, *identity in files:
        fs, path = filesystem(url, with_timeouts(url, storage_options, timeout))
        try:
            now = file_identity(fs, path, fs.info(path))
        except (OSError, ValueError):
            return url
        if list(now) != list(identity):
            return url
    return None


def _decode_data_uri(uri: str, index: int) -> bytes:
    header, comma, payload = uri.partition(",")
    if not comma:
        raise BadRow("image_unreadable", _numbered(index, "its data: URI has no ',' before the data"))
    if header.endswith(";base64"):
        try:
            # Lenient as transformers' load_image (base64.decodebytes): line breaks and spaces are skipped.
            return base64.b64decode("".join(payload.split()), validate=True)
        except (binascii.Error, ValueError):
            raise BadRow("image_unreadable", _numbered(index, "its data: URI is not valid base64")) from None
    return urllib.parse.unquote_to_bytes(payload)


def image_base(url: str) -> str:
    """The directory of an input file (a local path or a URL): where its rows' relative image paths start."""
    return url.rsplit("/", 1)[0] if "://" in url else os.path.dirname(url)


def resolve_location(location: str, base: str | None) -> str:
    """A path or URL as written in a row, made absolute: a relative path joins `base` (the input file's
    directory, or an image root; a local path or a URL), or the working directory without one."""
    if _SCHEME.match(location) or is_chained(location):  # a URL, or a chain of them (simplecache::s3://...)
        return location
    location = os.path.expanduser(location)
    if os.path.isabs(location):
        return os.path.normpath(location)
    if base and _SCHEME.match(base):
        scheme, rest = base.split("://", 1)
        return f"{scheme}://{posixpath.normpath(posixpath.join(rest, location))}"
    return os.path.abspath(os.path.join(base or os.getcwd(), location))


def image_ref(value: Any, index: int, base: str | None = None, access: str | None = None) -> ImageRef:
    """One image's value, in any shape the module docstring lists, as an ImageRef; a location the image access
    policy `access` (files.IMAGE_ACCESS; None: no check) does not allow under `base` is a BadRow."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return ImageRef(data=bytes(value))
    if isinstance(value, Mapping):
        if "bytes" in value or "path" in value:  # a datasets Image() cell: bytes win, the path names them
            data, path = value.get("bytes"), value.get("path")
            if data is not None:
                if not isinstance(data, (bytes, bytearray, memoryview)):
                    raise BadRow("image_part", _numbered(index, f"its 'bytes' holds a {type(data).__name__}"))
                return ImageRef(data=bytes(data), name=path if isinstance(path, str) else None)
            if isinstance(path, str) and path:
                return image_ref(path, index, base, access)
            raise BadRow("image_part", _numbered(index, "its datasets cell has neither bytes nor a path"))
        if isinstance(value.get("url"), str):
            return image_ref(value["url"], index, base, access)
    if isinstance(value, str):
        text = value.strip()
        if not text:
            raise BadRow("image_part", _numbered(index, "its path or URL is empty"))
        if text[:5].lower() == "data:":
            return ImageRef(data=_decode_data_uri(text, index))
        url = resolve_location(text, base)
        if access is not None and (refused := image_access_refusal(url, [base or os.getcwd()], access, text)):
            why, allowed_by = refused
            raise BadRow("image_access", _numbered(index, f"{why} (--image-access {allowed_by} allows it): a "
                                                          "dataset's images are read only where the run allows"))
        check_scheme(url, index)
        return ImageRef(url=url, name=text)
    shown = "nothing" if value is None else f"a value of type {type(value).__name__}"
    raise BadRow("image_part", _numbered(index, f"holds {shown}, not a path, URL, data URI, bytes or a datasets "
                                                "Image() cell"))


def _part_value(part: Mapping) -> tuple[bool, Any]:
    """(has a payload, the payload) of an image part; a part without one stands for the next of `images`."""
    kind = part.get("type")
    if kind == "image":
        for key in ("image", "url", "path"):
            if part.get(key) is not None:
                return True, part[key]
        if part.get("base64") is not None:
            return True, "data:;base64," + part["base64"]
        return False, None
    value = part.get("image_url")  # image_url (OpenAI chat) and input_image (OpenAI responses)
    if isinstance(value, Mapping):
        value = value.get("url")
    return True, value


def _text_pieces(text: str, placeholder: str) -> list[str | None]:
    """The text split at each placeholder; None marks where an image goes; empty text pieces are dropped."""
    out: list[str | None] = []
    for k, piece in enumerate(text.split(placeholder)):
        if k:
            out.append(None)
        if piece:
            out.append(piece)
    return out


def normalize_images(messages: Sequence[Mapping[str, Any]], images: Sequence[Any] | None = None, *,
                     base: str | None = None, access: str | None = None,
                     placeholder: str = PLACEHOLDER) -> tuple[list[Mapping[str, Any]], list[ImageRef]]:
    """Messages whose images are `{"type": "image", "image": ImageRef}` parts between `{"type": "text"}` parts,
    in their order, and the conversation's ImageRefs in that order (image 1 first).

    With an `images` list (a row's `images` column), each `placeholder` in a message's text and each image part
    without a payload stands for the next image in it, and their count must equal its length. Without one
    (None), the placeholder is ordinary text. A message without images is returned as it is. Locations are
    checked against the image access policy `access` (see `image_ref`).
    """
    refs: list[ImageRef] = []
    pending = list(images) if images is not None else None
    used = 0  # how many of `images` the placeholders have taken

    def take() -> ImageRef:
        nonlocal used
        used += 1
        index = len(refs) + 1
        if used > len(pending):
            raise BadRow("image_count", _numbered(index, f"has no entry in images: the conversation has more image "
                                                         f"placeholders than the row's {len(pending)} images"))
        return image_ref(pending[used - 1], index, base, access)

    def text_parts(text: str) -> list[dict] | None:
        if pending is None or placeholder not in text:
            return None
        parts = []
        for piece in _text_pieces(text, placeholder):
            if piece is None:
                refs.append(take())
                parts.append({"type": "image", "image": refs[-1]})
            else:
                parts.append({"type": "text", "text": piece})
        return parts

    out: list[Mapping[str, Any]] = []
    for message in messages:
        content = message.get("content")
        parts: list | None = None
        if isinstance(content, str):
            parts = text_parts(content)
        elif isinstance(content, list):
            changed, parts = False, []
            for part in content:
                kind = part.get("type") if isinstance(part, Mapping) else None
                if kind in IMAGE_PART_TYPES:
                    has_payload, value = _part_value(part)
                    refs.append(image_ref(value, len(refs) + 1, base, access) if has_payload or pending is None
                                else take())
                    parts.append({"type": "image", "image": refs[-1]})
                    changed = True
                elif kind == "text" and isinstance(part.get("text"), str) and (split := text_parts(part["text"])):
                    parts += split
                    changed = True
                else:
                    parts.append(part)
            parts = parts if changed else None
        out.append(message if parts is None else {**message, "content": parts})
    if pending is not None and used != len(pending):
        raise BadRow("image_count", _numbered(used + 1, f"has no placeholder: the row has {len(pending)} images, "
                                                        f"its conversation {used} placeholders ({placeholder!r} "
                                                        "or image parts without a payload)"))
    return out, refs


def content_hash(data: bytes) -> str:
    """The image's content hash: xxh3-128, as the shard keys hash the bytes a slice reads (build/keys.py)."""
    return xxhash.xxh3_128(data).hexdigest()


@dataclass(frozen=True)
class ImageHeader:
    width: int  # as displayed: after the EXIF orientation
    height: int
    format: str
    orientation: int  # the EXIF orientation, 1 when absent or out of range

    @property
    def stored_size(self) -> tuple[int, int]:
        """(width, height) as the pixels are stored, before the orientation."""
        return (self.height, self.width) if self.orientation in SWAPPING_ORIENTATIONS else (self.width, self.height)


def _png_metadata_after_pixels(data: bytes) -> bool:
    """Whether a PNG has a metadata chunk after its first IDAT: walks the chunk headers, inflating nothing."""
    offset, seen_pixels = len(_PNG_SIGNATURE), False
    while offset + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[offset:offset + 8])
        if kind == b"IDAT":
            seen_pixels = True
        elif seen_pixels and kind in _PNG_METADATA_CHUNKS:
            return True
        elif kind == b"IEND":
            return False
        offset += 12 + length
    return False


def _orientation(image: Any, data: bytes) -> int:
    from PIL import Image

    if image.format == "PNG" and "exif" not in image.info:
        # PIL's PNG getexif() loads (decodes) the image to see chunks after the pixels; only a PNG that has
        # such chunks pays that, so the orientation is always the one exif_transpose sees.
        if _png_metadata_after_pixels(data):
            image.load()
            exif = image.getexif()
        else:
            exif = Image.Image.getexif(image)
    else:
        exif = image.getexif()
    value = exif.get(0x0112, 1)  # ExifTags.Base.Orientation
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


def read_header(data: bytes, index: int | None = None) -> ImageHeader:
    """The image's displayed size, format and EXIF orientation, read without decoding its pixels."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data), formats=FORMATS) as image:
            width, height = image.size
            orientation = _orientation(image, data)
            fmt = image.format or "?"
    except UnidentifiedImageError:
        fmt = _format_of(data)
        what = (f"its format {fmt} is not supported (only {', '.join(FORMATS)})" if fmt
                else "not an image PIL can read (corrupt, or not an image file)")
        raise BadRow("image_format" if fmt else "image_corrupt", _numbered(index, what)) from None
    except Image.DecompressionBombError as error:
        raise BadRow("image_too_large", _numbered(index, f"too many pixels: {error}")) from None
    except Exception as error:  # a plugin's own parse errors (SyntaxError, struct.error, OSError, …)
        detail = " ".join(str(error).split())[:200] or type(error).__name__
        raise BadRow("image_corrupt", _numbered(index, f"a corrupt image header: {detail}")) from None
    if width < 1 or height < 1:
        raise BadRow("image_corrupt", _numbered(index, f"a {width}x{height} image has no pixels"))
    if orientation in SWAPPING_ORIENTATIONS:
        width, height = height, width
    return ImageHeader(width=width, height=height, format=fmt, orientation=orientation)


def _format_of(data: bytes) -> str | None:
    """The name of a format PIL knows but this module refuses, for the message; None if not an image at all."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.format
    except Exception:
        return None


@dataclass(frozen=True)
class LoadedImage:
    ref: ImageRef
    data: bytes = field(repr=False)
    digest: str  # content_hash(data)
    header: ImageHeader
    identity: tuple = ()  # its file's (records.file_identity) when it was read from one


def load_images(refs: Sequence[ImageRef], max_bytes: int | None = None, *,
                storage_options: dict | None = None, timeout: float | None = None) -> list[LoadedImage]:
    """Each image's bytes, content hash and header; the first bad one raises a BadRow saying "image N"."""
    loaded = []
    for index, ref in enumerate(refs, start=1):
        data, identity = ref.load(max_bytes, index=index, storage_options=storage_options, timeout=timeout)
        loaded.append(LoadedImage(ref=ref, data=data, digest=content_hash(data), header=read_header(data, index),
                                  identity=identity))
    return loaded
