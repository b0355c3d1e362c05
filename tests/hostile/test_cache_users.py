"""A cache's users after the cache root changes under them: `gc` beside a mixture index that reads an older
version, `inspect` of an index whose source is gone, and a published data file whose bytes changed at the same
size (`inspect --verify`). The caches are built by the data plane; gc, inspect and pack run from the command
line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from support.caches import flip
from support.cli import assert_rejected, cli
from support.paths import EXAMPLE_DATA, EXAMPLE_TOKENIZER

from sft_tokenize.build.options import TokenizeOptions
from sft_tokenize.build.protocol import run_locally
from sft_tokenize.errors import CacheError
from sft_tokenize.read.cache import open_cache, read_manifest, verify_digests
from sft_tokenize.read.mixed_rows import open_mixture
from sft_tokenize.read.mixture_index import mix_caches
from sft_tokenize.read.mixture_options import MixtureOptions, MixtureSource

FIRST = EXAMPLE_DATA / "chat-00000.jsonl"  # version A; version B adds chat-00001.jsonl


def build(root: Path, *sources: Path) -> Path:
    return run_locally(TokenizeOptions(sources=[str(s) for s in sources], tokenizer=str(EXAMPLE_TOKENIZER),
                                       cache_dir=str(root), name="chat", shard_size="100KB"))


@pytest.fixture(scope="module")
def versions(tmp_path_factory) -> tuple[Path, Path]:
    """A cache root holding version A of `chat` and the newer version B."""
    root = tmp_path_factory.mktemp("users") / "cache"
    return build(root, FIRST), build(root, *sorted(EXAMPLE_DATA.glob("*.jsonl")))


@pytest.fixture
def mixed(versions, tmp_path) -> tuple[Path, Path, Path]:
    """A copy of the root with a mixture index over version A (as a recipe run before B was built leaves it):
    (version A, version B, the index)."""
    root = Path(shutil.copytree(versions[0].parent, tmp_path / "cache"))
    old, new = root / versions[0].name, root / versions[1].name
    index = mix_caches(MixtureOptions(sources=[MixtureSource(cache=str(old), epochs=1)])).path
    return old, new, index


def test_gc_keeps_a_version_that_a_mixture_index_reads_and_says_so(mixed, tmp_path, cli_home):
    old, new, index = mixed
    collected = cli("gc", str(old.parent), home=cli_home)
    assert collected.returncode == 0, collected.stderr
    assert f"kept {old}: the mixture index {index} reads it" in collected.stdout
    assert f"removed {old}" not in collected.stdout
    assert old.is_dir() and new.is_dir()
    assert len(open_mixture(index)) == len(open_mixture(index).caches[0])
    assert cli("inspect", str(index), home=cli_home).returncode == 0
    packed = cli("pack", str(index), "--length", "2048", home=cli_home)
    assert packed.returncode == 0, packed.stderr

    shutil.rmtree(index)  # the index removed, its version is garbage like any other old one
    collected = cli("gc", str(old.parent), home=cli_home)
    assert f"removed {old}\n" in collected.stdout and not old.exists() and new.is_dir()


def test_inspect_of_a_mixture_index_whose_source_is_gone_names_it(mixed, tmp_path, cli_home):
    old, _, index = mixed
    shutil.rmtree(old)
    inspected = cli("inspect", str(index), home=cli_home)
    assert_rejected(inspected, f"{index}: source {old.name} is unreadable: {old}: not a published cache "
                               "(manifest.json is missing)")


@pytest.fixture
def copied(versions, tmp_path) -> Path:
    """Version B in a copy of the cache root: its data files are no longer links to the store's shards."""
    root = Path(shutil.copytree(versions[1].parent, tmp_path / "cache"))
    return root / versions[1].name


def test_inspect_verify_reads_every_byte_and_names_a_flipped_data_file(copied, tmp_path, cli_home):
    verified = cli("inspect", str(copied), "--verify", home=cli_home)
    assert verified.returncode == 0 and verified.stderr == "", verified.stderr
    files = len(read_manifest(copied)["files"])
    assert f"every byte of {files} data files matches its recorded digest" in verified.stdout

    victim = sorted(copied.glob("data-*.arrow"))[1]
    flip(victim)
    assert len(open_cache(copied)) == read_manifest(copied)["rows"]  # opening checks sizes only, as documented
    assert cli("inspect", str(copied), home=cli_home).returncode == 0
    assert_rejected(cli("inspect", str(copied), "--verify", home=cli_home),
                    f"{victim}: its bytes do not match the digest recorded when it was written")
    with pytest.raises(CacheError, match="its bytes do not match"):
        verify_digests(copied)


def test_a_cache_whose_manifest_has_no_digests_is_verified_by_its_shards_sidecars(copied, tmp_path, cli_home):
    manifest = json.loads((copied / "manifest.json").read_text())
    for entry in manifest["files"]:
        del entry["digest"]
    (copied / "manifest.json").write_text(json.dumps(manifest))
    assert verify_digests(copied) == []
    victim = sorted(copied.glob("data-*.arrow"))[0]
    flip(victim)
    with pytest.raises(CacheError, match=f"{victim}: its bytes do not match"):
        verify_digests(copied)

    shutil.rmtree(copied.parent / ".shards")  # no digest left anywhere: said, and the sizes still checked
    noted = cli("inspect", str(copied), "--verify", home=cli_home)
    assert noted.returncode == 0
    assert f"{len(manifest['files'])} of {len(manifest['files'])} data files have no recorded digest" in noted.stderr
