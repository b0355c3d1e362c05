"""What a source directory holds: every file in it is read, or named as ignored, or refused by name.

A directory never drops a file quietly. Symbolic links are followed (a Hugging Face snapshot directory is
made of them); a link to nowhere, a FIFO or a device under a data file's name is refused, naming it. Files
that are clearly not data (documentation, licences, dataset cards' metadata) are ignored, and the run lists
them in its log and manifest. Nothing under the cache root is ever read, so a cache dir inside the input
directory does not feed a run its own output.
"""

from __future__ import annotations

import fnmatch
import os
import stat

import fsspec

from sft_tokenize.errors import BadInput

# Not data, whatever directory they are in: read by people, not by a trainer. Matched case-insensitively.
NOT_DATA = ("readme", "readme.*", "*.md", "*.markdown", "*.rst", "license", "license.*", "licence", "licence.*",
            "copying", "notice", "*.cff", "*.yaml", "*.yml", "dataset_infos.json", "dataset_info.json")


# Images beside the rows that name them (an image dataset's usual layout): read through those rows, and
# counted among the ignored files as one entry per directory rather than listed one by one.
IMAGE_FILES = ("*.jpg", "*.jpeg", "*.png", "*.webp", "*.gif", "*.bmp", "*.tif", "*.tiff")


def is_image(path: str) -> bool:
    name = os.path.basename(path).lower()
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in IMAGE_FILES)


def is_not_data(path: str) -> bool:
    name = os.path.basename(path).lower()
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in NOT_DATA) or is_image(path)


def _summarized(ignored: list[str]) -> list[str]:
    """The ignored files, each image directory's images as one entry saying how many."""
    images: dict[str, int] = {}
    out = []
    for path in ignored:
        if is_image(path):
            folder = path.rsplit("/", 1)[0] if "/" in path else "."
            images[folder] = images.get(folder, 0) + 1
        else:
            out.append(path)
    out += [f"{folder}/ ({count} image file{'s' * (count != 1)}: read through the rows that name them)"
            for folder, count in images.items()]
    return sorted(out)


def is_under(path: str, root: str | None) -> bool:
    """`path` is `root` or inside it (both local; symbolic links resolved)."""
    if root is None:
        return False
    path, root = os.path.realpath(path), os.path.realpath(root)
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def check_regular_file(path: str) -> None:
    """Refuse a local path that cannot be read as a data file, saying what it is instead."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if os.path.islink(path):
            raise BadInput(f"{path}: a symbolic link to {os.readlink(path)}, which does not exist") from None
        raise BadInput(f"no such file: {path}") from None
    except OSError as error:
        raise BadInput(f"{path}: cannot read it ({error.strerror})") from None
    if not stat.S_ISREG(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else \
            "a socket" if stat.S_ISSOCK(mode) else "a device"
        raise BadInput(f"{path}: {kind}, not a regular file: a data file cannot be read from it")
    if not os.access(path, os.R_OK):
        raise BadInput(f"{path}: cannot read it (permission denied)")


def _local_files(top: str, exclude: str | None) -> list[str]:
    """Every non-hidden entry below `top` that is not a directory, following links to directories once, and
    not descending into `exclude`."""
    found, seen = [], set()
    for directory, subdirectories, names in os.walk(top, followlinks=True):
        real = os.path.realpath(directory)
        if real in seen or is_under(real, exclude):  # a link back up the tree, or the cache root
            subdirectories[:] = []
            continue
        seen.add(real)
        subdirectories[:] = sorted(d for d in subdirectories if not d.startswith("."))
        found += [os.path.join(directory, name) for name in names if not name.startswith(".")]
    return found


def list_directory(fs: fsspec.AbstractFileSystem, path: str, local: bool,
                   exclude: str | None = None) -> tuple[list[str], list[str]]:
    """(data files, ignored files) below `path`, each sorted; a file that is neither is refused by name."""
    if local:
        entries = [p for p in _local_files(path, exclude) if not is_under(p, exclude)]
        for entry in entries:
            if not is_not_data(entry):
                check_regular_file(entry)
    else:
        listed = fs.find(path, detail=True)
        entries = []
        for entry, info in listed.items():
            if any(part.startswith(".") for part in entry[len(path):].split("/")):
                continue
            if info.get("type") != "file":
                raise BadInput(f"{fs.unstrip_protocol(entry)}: not a regular file (type {info.get('type')!r})")
            entries.append(entry)
    ignored = _summarized([p for p in entries if is_not_data(p)])
    return sorted(p for p in entries if not is_not_data(p)), ignored
