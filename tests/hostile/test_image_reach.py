"""Where a dataset's image locations may reach under `--image-access`: a URL that fsspec resolves to this machine's
files (`local://`, a chain with `file://` or a bare path in it) is a local path, whatever its first protocol, and
`+urls` reads only the network protocols it names."""

from __future__ import annotations

import re
import zipfile

import pytest

from sft_tokenize.errors import BadRow
from sft_tokenize.sources.images import image_ref


@pytest.fixture
def secret(tmp_path):
    """A local file outside the image root, and a zip archive holding it."""
    path = tmp_path / "outside" / "secret.img"
    path.parent.mkdir()
    path.write_bytes(b"not for the cache")
    with zipfile.ZipFile(tmp_path / "outside" / "pack.zip", "w") as archive:
        archive.write(path, "secret.img")
    return path


@pytest.mark.parametrize("written", [
    "local://{secret}",
    "zip://secret.img::file://{zip}",
    "zip://secret.img::{zip}",
    "simplecache::file://{secret}",
    "tar://secret.img::local://{zip}",
])
@pytest.mark.parametrize("access", ["root+urls", "root"])
def test_a_url_that_resolves_to_a_local_file_is_a_local_path_to_the_image_access_policy(tmp_path, secret, written,
                                                                                     access):
    written = written.format(secret=secret, zip=secret.parent / "pack.zip")
    root = tmp_path / "root"
    root.mkdir()
    needs = "local+urls" if access == "root+urls" else "local"
    expected = rf"fsspec reads it from this machine's files .*\(--image-access {re.escape(needs)} allows it\)"
    with pytest.raises(BadRow, match=expected) as refused:
        image_ref(written, 0, str(root), access)
    assert refused.value.reason == "image_access" and written in str(refused.value)
    assert image_ref(written, 0, str(root), "local+urls").url  # the policy that names local files reads it


@pytest.mark.parametrize("written", ["memory://x/cat.png", "git://repo/cat.png", "reference://cat.png"])
def test_plus_urls_reads_only_the_network_protocols_it_names(tmp_path, written):
    with pytest.raises(BadRow, match=r"is not a network URL"):
        image_ref(written, 0, str(tmp_path), "root+urls")


@pytest.mark.parametrize("written", ["http://127.0.0.1:9/cat.png", "s3://bucket/cat.png",
                                     "simplecache::s3://bucket/cat.png", "zip://cat.png::https://host/a.zip"])
def test_network_urls_stay_readable_under_plus_urls(tmp_path, written):
    assert image_ref(written, 0, str(tmp_path), "root+urls").url
