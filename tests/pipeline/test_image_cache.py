"""Image rows through the pipeline (plan, slices, shards, publish), with a Qwen2.5-VL processor directory built
offline (tests/support/vision.py): the four input shapes give the same rows; a mixed file gives one cache whose
text rows equal a text-only run's; rows equal the processor's; images are stored embedded or as references; a cut
inside an image is a counted drop; the writer's record batches are bounded by bytes whatever the images; each bad
image is one line naming its file, line and image (exit 2), or a counted skip."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import xxhash
from PIL import Image
from support.cli import assert_rejected, cli
from support.images import encoded, sample_images, write_image_chats
from support.vision import gemma3, qwen_vl

from sft_tokenize.build import workers
from sft_tokenize.build.options import TokenizeOptions
from sft_tokenize.build.plan import plan_slices
from sft_tokenize.build.protocol import run_locally
from sft_tokenize.build.shard import tokenize_slice
from sft_tokenize.build.shard_check import sidecar_path
from sft_tokenize.encoding.pool import EncodePool
from sft_tokenize.errors import BadInput, CacheError
from sft_tokenize.read.cache import TokenizedCache

QUESTION, ANSWER = "What is in the picture?", "Stripes in three colours."


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    """(processor directory, its tokenizer, the real processor)."""
    directory = tmp_path_factory.mktemp("qwen-vl-processor")
    tokenizer, real, _ = qwen_vl(directory)
    return directory, tokenizer, real


@pytest.fixture(scope="module")
def pictures(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("pictures")
    paths = {}
    for name in ("photo", "rgba", "exif6", "cmyk", "wide"):
        paths[name] = folder / f"{name}.img"
        paths[name].write_bytes(sample_images()[name])
    return paths


def _options(sources, processor_dir: Path, root: Path, **extra) -> TokenizeOptions:
    """Most rows here name their images by absolute paths (another temporary directory than the data's): the
    access policy is allowed every location unless a test says otherwise."""
    return TokenizeOptions(sources=[str(s) for s in sources], processor=str(processor_dir), cache_dir=str(root),
                           **{"image_access": "local+urls", **extra})


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _chat(first: dict, second: dict | None = None) -> list[dict]:
    """A user turn with one or two images, its reply, and a second exchange (the second image in the reply)."""
    messages = [{"role": "user", "content": [first, {"type": "text", "text": QUESTION}]},
                {"role": "assistant", "content": ANSWER}]
    if second is not None:
        messages += [{"role": "user", "content": "And this?"},
                     {"role": "assistant", "content": [{"type": "text", "text": "This: "}, second]}]
    return messages


def _columns(cache: TokenizedCache) -> dict[str, list]:
    table = cache.table
    out = {name: table[name].to_pylist() for name in ("input_ids", "loss_mask", "image_grid_thw", "image_sizes")}
    out["hashes"] = [[image["hash"] for image in row] for row in table["images"].to_pylist()]
    return out


def test_the_four_input_shapes_give_the_same_rows_and_the_processors_ids(tmp_path, processor, pictures):
    directory, _, real = processor
    photo, rgba = pictures["photo"], pictures["rgba"]
    uri = "data:image/png;base64," + base64.b64encode(rgba.read_bytes()).decode()
    shapes = {
        "parts": [{"messages": _chat({"type": "image", "image": str(photo)}, {"type": "image", "image": str(rgba)})}],
        "openai": [{"messages": _chat({"type": "image_url", "image_url": {"url": f"file://{photo}"}},
                                      {"type": "image_url", "image_url": {"url": uri}})}],
        "placeholders": [{"messages": [{"role": "user", "content": f"<image>{QUESTION}"},
                                       {"role": "assistant", "content": ANSWER},
                                       {"role": "user", "content": "And this?"},
                                       {"role": "assistant", "content": "This: <image>"}],
                          "images": [str(photo), str(rgba)]}],
    }
    caches = {}
    for name, rows in shapes.items():
        data = _write_jsonl(tmp_path / name / "rows.jsonl", rows)
        caches[name] = TokenizedCache(run_locally(_options([data], directory, tmp_path / "cache")))
    # datasets' Image() cells ({bytes, path}) in a Parquet file, with the images column of placeholders
    cells = [{"bytes": photo.read_bytes(), "path": "photo.jpg"}, {"bytes": None, "path": str(rgba)}]
    table = pa.table({"messages": [json.dumps(shapes["placeholders"][0]["messages"])], "images": [cells]})
    (tmp_path / "parquet").mkdir()
    pq.write_table(table, tmp_path / "parquet" / "rows.parquet")
    caches["parquet"] = TokenizedCache(run_locally(_options([tmp_path / "parquet"], directory, tmp_path / "cache")))

    expected = _columns(caches["parts"])
    for name, cache in caches.items():
        assert _columns(cache) == expected, name
    assert len(expected["image_grid_thw"][0]) == 2
    messages = _chat({"type": "image", "path": str(photo)}, {"type": "image", "path": str(rgba)})
    want = real.apply_chat_template(messages, tokenize=True, return_dict=True)
    assert expected["input_ids"][0] == list(want["input_ids"][0])
    assert expected["image_grid_thw"][0] == want["image_grid_thw"].tolist()


def test_a_mixed_file_is_one_cache_whose_text_rows_equal_a_text_only_runs(tmp_path, processor, pictures):
    directory, _, _ = processor
    text_rows = [{"messages": [{"role": "user", "content": f"Question {i}?"},
                               {"role": "assistant", "content": f"Answer {i}."}]} for i in range(6)]
    image_rows = [{"messages": _chat({"type": "image", "image": f"{name}.img"})}
                  for name in ("photo", "exif6", "cmyk")]
    mixed = [row for pair in zip(text_rows[:3], image_rows, strict=True) for row in pair] + text_rows[3:]
    # Relative paths resolve against --image-root here (the file's own directory is the default).
    data = _write_jsonl(tmp_path / "mixed" / "rows.jsonl", mixed)
    cache = TokenizedCache(run_locally(_options([data], directory, tmp_path / "cache",
                                                image_root=str(pictures["photo"].parent))))
    text_only = TokenizedCache(run_locally(TokenizeOptions(
        sources=[str(_write_jsonl(tmp_path / "text" / "rows.jsonl", text_rows))], tokenizer=str(directory),
        cache_dir=str(tmp_path / "cache"))))
    assert len(cache) == 9
    images = cache.table["images"].to_pylist()
    text_positions = [k for k, row in enumerate(images) if not row]
    assert text_positions == [0, 2, 4, 6, 7, 8]
    for column in ("input_ids", "loss_mask"):
        values = cache.table[column].to_pylist()
        assert [values[k] for k in text_positions] == text_only.table[column].to_pylist()
    assert [row[0]["hash"] for row in images if row] == [
        xxhash.xxh3_128(pictures[name].read_bytes()).hexdigest() for name in ("photo", "exif6", "cmyk")]
    manifest = json.loads((cache.path / "manifest.json").read_text())
    assert manifest["images"]["images"] == 3
    assert manifest["images"]["image_bytes"] == sum(pictures[n].stat().st_size for n in ("photo", "exif6", "cmyk"))
    assert manifest["images"]["image_tokens"] == sum(
        (t * h * w) // 4 + 2 for row in cache.table["image_grid_thw"].to_pylist() for t, h, w in row)


def test_reference_mode_stores_where_each_image_is_not_its_bytes(tmp_path, processor, pictures):
    directory, _, _ = processor
    row = {"messages": _chat({"type": "image", "image": str(pictures["wide"])})}
    data = _write_jsonl(tmp_path / "rows.jsonl", [row])
    embedded = TokenizedCache(run_locally(_options([data], directory, tmp_path / "cache")))
    referenced = TokenizedCache(run_locally(_options([data], directory, tmp_path / "cache", images="reference")))
    assert embedded.fingerprint != referenced.fingerprint
    (stored,), (kept,) = referenced.table["images"].to_pylist()[0], embedded.table["images"].to_pylist()[0]
    assert stored == {"bytes": None, "path": str(pictures["wide"]), "hash": kept["hash"],
                      "size": pictures["wide"].stat().st_size}
    assert kept["bytes"] == pictures["wide"].read_bytes()
    assert referenced.table["input_ids"].to_pylist() == embedded.table["input_ids"].to_pylist()


def test_a_cut_inside_an_image_is_a_counted_drop(tmp_path, processor, pictures):
    directory, _, _ = processor
    rows = [{"messages": _chat({"type": "image", "image": str(pictures["photo"])})},
            {"messages": [{"role": "user", "content": "Short?"}, {"role": "assistant", "content": "Yes."}]}]
    data = _write_jsonl(tmp_path / "rows.jsonl", rows)
    cache = TokenizedCache(run_locally(_options([data], directory, tmp_path / "cache", max_length=60)))
    manifest = json.loads((cache.path / "manifest.json").read_text())
    assert manifest["dropped"] == {"image_truncated": 1}
    assert len(cache) == 1 and cache.table["images"].to_pylist() == [[]]


def test_record_batches_are_bounded_by_bytes_whatever_the_images(tmp_path, processor):
    directory, _, _ = processor
    folder = tmp_path / "big"
    folder.mkdir()
    sizes = []
    for k in range(12):  # noise PNGs of about 40-120 KB: a record batch of 100 KB holds one to three
        side = 120 + 40 * (k % 3)
        noise = Image.fromarray(np.random.default_rng(k).integers(0, 256, (side, side, 3), dtype=np.uint8))
        (folder / f"{k}.png").write_bytes(encoded(noise, "PNG"))
        sizes.append((folder / f"{k}.png").stat().st_size)
    rows = [{"messages": _chat({"type": "image", "image": f"{k}.png"})} for k in range(12)]
    data = _write_jsonl(folder / "rows.jsonl", rows)
    path = run_locally(_options([data], directory, tmp_path / "cache", writer_batch_bytes="100KB"))
    (shard,) = sorted(path.glob("*.arrow"))
    with pa.memory_map(str(shard)) as source:
        batches = list(pa.ipc.open_stream(source))
    assert sum(b.num_rows for b in batches) == 12 and len(batches) > 1
    for batch in batches:
        stored = sum(len(image["bytes"]) for row in batch.column("images").to_pylist() for image in row)
        assert stored < 100_000 + max(sizes)  # flushed once past the limit: at most one row over it


@pytest.mark.parametrize(("image", "reason", "detail"), [
    ("missing.png", "image_missing", "image 1: "),
    ("corrupt.png", "image_corrupt", "image 1: "),
    ("gopher://example.com/a.png", "image_url_scheme", "image 1: "),
    ("big.png", "image_too_large", "image 1: "),
])
def test_each_bad_image_names_its_file_line_and_image_or_is_a_counted_skip(tmp_path, processor, pictures, image,
                                                                           reason, detail):
    directory, _, _ = processor
    (tmp_path / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40)
    big = Image.fromarray(np.random.default_rng(0).integers(0, 256, (200, 200, 3), dtype=np.uint8))  # 120 KB
    (tmp_path / "big.png").write_bytes(encoded(big, "PNG"))
    good = {"messages": _chat({"type": "image", "image": str(pictures["photo"])})}
    data = _write_jsonl(tmp_path / "rows.jsonl", [good, {"messages": _chat({"type": "image", "image": image})}, good])
    with pytest.raises(BadInput, match=rf"^{data}:2: {detail}") as raised:
        run_locally(_options([data], directory, tmp_path / "cache", max_image_bytes="100KB"))
    assert "\n" not in str(raised.value)
    skipped = TokenizedCache(run_locally(_options([data], directory, tmp_path / "cache", max_image_bytes="100KB",
                                                  on_bad_row="skip")))
    assert len(skipped) == 2
    assert json.loads((skipped.path / "manifest.json").read_text())["dropped"] == {reason: 1}


def test_a_bad_image_exits_2_in_one_line_and_a_processor_it_cannot_serve_is_refused(tmp_path, processor, cli_home,
                                                                                     api_url):
    directory, _, _ = processor
    data = _write_jsonl(tmp_path / "rows.jsonl", [{"messages": _chat({"type": "image", "image": "nowhere.png"})}])
    result = cli("run", str(data), "--processor", str(directory), "--cache-dir", str(tmp_path / "cache"),
                 home=cli_home, api_url=api_url)
    assert_rejected(result, f"{data}:1: image 1: ", "nowhere.png")
    other = tmp_path / "llava"
    shutil.copytree(directory, other)
    (other / "preprocessor_config.json").write_text(json.dumps({"processor_class": "LlavaProcessor",
                                                                "image_processor_type": "CLIPImageProcessor"}))
    result = cli("run", str(data), "--processor", str(other), "--cache-dir", str(tmp_path / "cache"),
                 home=cli_home, api_url=api_url)
    assert_rejected(result, "processor 'LlavaProcessor' / 'CLIPImageProcessor' is not supported")
    (other / "preprocessor_config.json").unlink()
    result = cli("run", str(data), "--processor", str(other), "--cache-dir", str(tmp_path / "cache"),
                 home=cli_home, api_url=api_url)
    assert_rejected(result, f"{other}: no processor_config.json or preprocessor_config.json")


def test_without_a_processor_an_image_row_says_to_give_one(tmp_path, processor, pictures):
    directory, _, _ = processor
    row = {"messages": _chat({"type": "image", "image": str(pictures["photo"])})}
    data = _write_jsonl(tmp_path / "rows.jsonl", [row])
    with pytest.raises(BadInput, match=r":1: messages\[0\]\.content\[0\] is a part of type 'image'.*--processor"):
        run_locally(TokenizeOptions(sources=[str(data)], tokenizer=str(directory), cache_dir=str(tmp_path / "c")))


def test_inspect_shows_each_images_run_as_one_item(tmp_path, processor, pictures, cli_home):
    directory, _, _ = processor
    photo, wide = ({"type": "image", "image": str(pictures[name])} for name in ("photo", "wide"))
    messages = _chat(photo, wide)
    data = _write_jsonl(tmp_path / "rows.jsonl", [{"messages": messages}])
    path = run_locally(_options([data], directory, tmp_path / "cache"))
    row = TokenizedCache(path)[0]
    (height, width), (wide_h, wide_w) = row["image_sizes"].tolist()
    runs = [t * h * w // 4 for t, h, w in row["image_grid_thw"].tolist()]
    shown = cli("inspect", str(path), "--row", "0", home=cli_home)
    assert shown.returncode == 0, shown.stderr
    assert f"user\n<image {width}×{height} → {runs[0]:,} tokens>{QUESTION}" in shown.stdout
    # the image in the reply is not trained, the text around it is
    assert f"[[This: ]]<image {wide_w}×{wide_h} → {runs[1]:,} tokens>[[<|im_end|>]]" in shown.stdout
    manifest = json.loads((path / "manifest.json").read_text())["images"]
    summary = cli("inspect", str(path), home=cli_home).stdout
    assert manifest["image_tokens"] == sum(runs) + 4  # with the margins, <|vision_start|> and <|vision_end|>
    stored = pictures["photo"].stat().st_size + pictures["wide"].stat().st_size
    assert f"\nimages{' ' * 18}2 (qwen2_5_vl), {sum(runs) + 4:,} vision tokens, {stored:,} bytes embedded\n" in summary
    assert "<|image_pad|>" not in shown.stdout and "<|vision_start|>" not in shown.stdout


@pytest.mark.parametrize("mode", ["embed", "reference"])
def test_an_image_file_that_changes_makes_its_slice_and_the_cache_stale(tmp_path, processor, pictures, mode):
    """The image files are read only while a slice is tokenized: the shard's sidecar and the cache list them,
    so a changed one rebuilds the slices that read it (the others are reused) and republishes the cache."""
    directory, _, _ = processor
    folder = tmp_path / "data"
    folder.mkdir()
    for name in ("photo", "wide"):
        shutil.copy(pictures[name], folder / f"{name}.img")
        _write_jsonl(folder / f"{name}.jsonl", [{"messages": _chat({"type": "image", "image": f"{name}.img"})}])
    inputs = [folder / "photo.jsonl", folder / "wide.jsonl"]
    options = _options(inputs, directory, tmp_path / "cache", images=mode, shard_size="256")  # a slice a file
    path = run_locally(options)
    first = json.loads((path / "manifest.json").read_text())
    assert first["images"]["image_files"] == 2
    assert run_locally(options) == path  # unchanged: a hit, not rebuilt
    assert json.loads((path / "manifest.json").read_text())["build"] == first["build"]

    changed = folder / "photo.img"
    changed.write_bytes(pictures["cmyk"].read_bytes())
    os.utime(changed, ns=(1_000_000_000, 1_000_000_000))  # whatever the clock's resolution
    assert run_locally(options) == path  # the same inputs as listed: the same name, republished
    again = TokenizedCache(path)
    assert again.manifest["build"]["slices_reused"] == 1 and again.manifest["build"]["slices_tokenized"] == 1
    hashes = sorted(row[0]["hash"] for row in again.table["images"].to_pylist())
    assert hashes == sorted(xxhash.xxh3_128(p.read_bytes()).hexdigest() for p in (changed, folder / "wide.img"))
    state = json.loads((path / "state.json").read_text())
    clean = TokenizedCache(run_locally(_options(inputs, directory, tmp_path / "clean", images=mode, shard_size="256")))
    assert _columns(again) == _columns(clean)
    assert state["_fingerprint"] == json.loads((clean.path / "state.json").read_text())["_fingerprint"]
    assert state["_fingerprint"] != first["fingerprint"]


def test_the_encode_pool_writes_the_image_shards_the_slices_thread_writes(tmp_path, processor):
    """Image rows go through the same pool as text (their grids travel with the examples; the processes
    rebuild the family from the job), and its shards are the thread's byte for byte."""
    directory, _, _ = processor
    inputs = write_image_chats(tmp_path / "data")
    plan = plan_slices(_options(inputs, directory, tmp_path / "cache", shard_size="2KB"))
    assert len(plan.slices) >= 3

    def shards() -> dict[str, bytes]:
        out = {}
        for slice_ in plan.slices:
            tokenize_slice(plan.job, slice_)
            path = plan.job.shard_path(slice_)
            out[slice_.key] = path.read_bytes()
            path.unlink()
            sidecar_path(path).unlink()
        return out

    inline = shards()
    with workers.encoding_processes(plan.job, 2):
        assert isinstance(workers.slice_encoding(plan.job)[0], EncodePool)
        assert shards() == inline


def _pixel_rows(cache: TokenizedCache) -> list[np.ndarray]:
    """Each row's stored pixel_values as a (patches, patch size) float32 array."""
    out = []
    for cell in cache.table["pixel_values"].combine_chunks():
        patches = cell.values
        width = len(patches[0]) if len(patches) else 1
        out.append(patches.flatten().to_numpy(zero_copy_only=False).reshape(-1, width))
    return out


def test_pixel_values_for_skyrls_reader_equal_the_processors_and_are_bounded(tmp_path, processor, pictures, cli_home):
    """--extra-column pixel_values stores each image row's float32 patches as the processor makes them (what
    SkyRL's pretokenized reader reads); the other columns are the cache's without them; record batches stay
    bounded by bytes, pixels included; a text row holds none."""
    directory, _, real = processor
    image = {name: {"type": "image", "image": str(pictures[name])} for name in pictures}
    conversations = [_chat(image["photo"], image["exif6"]), _chat(image["cmyk"]),
                     [{"role": "user", "content": "No picture?"}, {"role": "assistant", "content": "None."}],
                     _chat(image["rgba"], image["wide"])]
    data = _write_jsonl(tmp_path / "rows.jsonl", [{"messages": m} for m in conversations])
    plain = TokenizedCache(run_locally(_options([data], directory, tmp_path / "cache")))
    path = run_locally(_options([data], directory, tmp_path / "cache", extra_columns=["pixel_values"],
                                writer_batch_bytes="150KB"))
    cache = TokenizedCache(path)
    assert cache.fingerprint != plain.fingerprint
    assert _columns(cache) == _columns(plain)
    assert cache.table.schema.field("pixel_values").type == pa.list_(pa.list_(pa.float32()))
    stored = _pixel_rows(cache)
    for messages, pixels in zip(conversations, stored, strict=True):
        want = real.apply_chat_template(messages, tokenize=True, return_dict=True)
        if "pixel_values" not in want:
            assert pixels.size == 0
            continue
        assert pixels.dtype == np.float32 and np.array_equal(pixels, np.asarray(want["pixel_values"]))
    manifest = json.loads((path / "manifest.json").read_text())["images"]
    assert manifest["pixel_bytes"] == sum(p.nbytes for p in stored) > 0
    summary = cli("inspect", str(path), home=cli_home).stdout
    assert f" bytes embedded, {manifest['pixel_bytes']:,} bytes of pixel_values\n" in summary

    (shard,) = sorted(path.glob("*.arrow"))
    with pa.memory_map(str(shard)) as source:
        batches = list(pa.ipc.open_stream(source))
    assert len(batches) > 1
    largest_row = max(p.nbytes + sum(len(i["bytes"]) for i in images)
                      for p, images in zip(stored, cache.table["images"].to_pylist(), strict=True))
    for batch in batches:
        held = sum(len(i["bytes"]) for row in batch.column("images").to_pylist() for i in row) + 4 * len(
            pc.list_flatten(pc.list_flatten(batch.column("pixel_values"))))
        assert held < 150_000 + largest_row


def test_pixel_values_need_a_qwen_processor_and_decodable_images(tmp_path, processor, pictures, cli_home, api_url):
    directory, _, _ = processor
    data = _write_jsonl(tmp_path / "rows.jsonl", [{"messages": _chat({"type": "image", "image": "cut.jpg"})}])
    photo = pictures["photo"].read_bytes()
    (tmp_path / "cut.jpg").write_bytes(photo[: len(photo) // 2])  # its header reads, its pixels do not
    with pytest.raises(BadInput, match=rf"^{data}:1: image 1: its pixels cannot be decoded: .*truncated"):
        run_locally(_options([data], directory, tmp_path / "cache", extra_columns=["pixel_values"]))
    assert run_locally(_options([data], directory, tmp_path / "cache"))  # without pixels, the header is enough
    result = cli("run", str(data), "--tokenizer", str(directory), "--extra-column", "pixel_values",
                 "--cache-dir", str(tmp_path / "cache"), home=cli_home, api_url=api_url)
    assert_rejected(result, "--extra-column pixel_values needs --processor")
    gemma = tmp_path / "gemma"
    gemma3(gemma)
    result = cli("run", str(data), "--processor", str(gemma), "--extra-column", "pixel_values",
                 "--cache-dir", str(tmp_path / "cache"), home=cli_home, api_url=api_url)
    assert_rejected(result, "--extra-column pixel_values: a gemma3 processor's pixels are whole images")


# -- which image locations a dataset may name (--image-access) ------------------------------------------------

@pytest.fixture
def strangers_data(tmp_path, pictures) -> Path:
    """A data directory with an image inside it and, beside it, files a stranger's dataset could name."""
    data = tmp_path / "data"
    (data / "img").mkdir(parents=True)
    shutil.copy(pictures["photo"], data / "img" / "photo.img")
    shutil.copy(pictures["rgba"], tmp_path / "outside.img")
    (data / "img" / "link.img").symlink_to(tmp_path / "outside.img")
    return data


@pytest.mark.parametrize(("written", "needs"), [
    ("../outside.img", "local"),
    ("img/../../outside.img", "local"),
    ("img/link.img", "local"),  # a link inside that leads outside
    ("{outside}", "local"),  # an absolute path
    ("file://{outside}", "local"),
    ("~/outside.img", "local"),
    ("http://127.0.0.1:9/cat.png", "root+urls or local+urls"),
    ("s3://bucket/cat.png", "root+urls or local+urls"),
])
def test_by_default_an_image_outside_the_image_root_is_refused_naming_its_row(tmp_path, processor, strangers_data,
                                                                              written, needs):
    directory, _, _ = processor
    written = written.format(outside=tmp_path / "outside.img")
    good = {"messages": _chat({"type": "image", "image": "img/photo.img"})}
    data = _write_jsonl(strangers_data / "rows.jsonl", [good, good, {"messages": _chat({"type": "image",
                                                                                        "image": written})}])
    options = TokenizeOptions(sources=[str(data)], processor=str(directory), cache_dir=str(tmp_path / "cache"))
    expected = rf"^{data}:3: image 1: {re.escape(written)} .*\(--image-access {re.escape(needs)} allows it\)"
    with pytest.raises(BadInput, match=expected) as raised:
        run_locally(options)
    assert "\n" not in str(raised.value)
    skipped = TokenizedCache(run_locally(options.model_copy(update={"on_bad_row": "skip"})))
    assert len(skipped) == 2 and skipped.manifest["dropped"] == {"image_access": 1}
    if needs == "local" and not written.startswith("~"):  # the flag reads it (~ is the user's home, not here)
        allowed = TokenizedCache(run_locally(options.model_copy(update={"image_access": "local"})))
        assert allowed.table["images"].to_pylist()[2][0]["hash"] == xxhash.xxh3_128(
            (tmp_path / "outside.img").read_bytes()).hexdigest()


def test_an_image_root_is_where_relative_paths_must_stay_and_the_cli_says_so_in_one_line(tmp_path, processor,
                                                                                         strangers_data, cli_home,
                                                                                         api_url):
    directory, _, _ = processor
    rows = [{"messages": _chat({"type": "image", "image": "photo.img"})},
            {"messages": _chat({"type": "image", "image": "../outside.img"})}]
    data = _write_jsonl(tmp_path / "elsewhere" / "rows.jsonl", rows)
    root = strangers_data / "img"
    with pytest.raises(BadInput, match=rf"^{data}:2: image 1: \.\./outside\.img resolves outside the image root "
                                       rf"\({root}\)"):
        run_locally(TokenizeOptions(sources=[str(data)], processor=str(directory), cache_dir=str(tmp_path / "c"),
                                    image_root=str(root)))
    result = cli("run", str(data), "--processor", str(directory), "--image-root", str(root),
                 "--cache-dir", str(tmp_path / "cache"), home=cli_home, api_url=api_url)
    assert_rejected(result, f"{data}:2: image 1: ../outside.img resolves outside the image root",
                    "--image-access local allows it")


def test_the_collator_reads_referenced_images_under_the_policy_the_cache_was_built_with(tmp_path, processor,
                                                                                        strangers_data):
    from sft_tokenize.read.image_collator import ImageCollator, image_bytes

    directory, _, _ = processor
    row = {"messages": _chat({"type": "image", "image": "img/photo.img"})}
    data = _write_jsonl(strangers_data / "rows.jsonl", [row])
    path = run_locally(TokenizeOptions(sources=[str(data)], processor=str(directory), images="reference",
                                       cache_dir=str(tmp_path / "cache")))
    record = json.loads((path / "manifest.json").read_text())["images"]
    assert (record["access"], record["roots"]) == ("root", [str(strangers_data)])
    (cell,) = TokenizedCache(path).table["images"].to_pylist()[0]
    collator = ImageCollator(path, pad_token_id=0)
    assert image_bytes(cell, "row 0 image 1", None, collator.access) == (strangers_data / "img/photo.img").read_bytes()
    outside = tmp_path / "outside.img"  # a cache whose rows name another file: refused before it is opened
    elsewhere = {**cell, "path": str(outside), "size": outside.stat().st_size,
                 "hash": xxhash.xxh3_128(outside.read_bytes()).hexdigest()}
    with pytest.raises(CacheError,
                       match=rf"^row 0 image 1: {outside} resolves outside the image root \({strangers_data}\); "
                             "the collator reads it only with image_access=local"):
        image_bytes(elsewhere, "row 0 image 1", None, collator.access)
    for url in ("http://127.0.0.1:9/cat.png", "s3://bucket/cat.png"):
        with pytest.raises(CacheError, match=f"^row 0 image 1: {url} is a URL, and URLs are read only where allowed; "
                                             "the collator reads it only with image_access=root\\+urls or local"):
            image_bytes({**cell, "path": url}, "row 0 image 1", None, collator.access)
    widened = ImageCollator(path, pad_token_id=0, image_access="local")
    assert image_bytes(elsewhere, "row 0 image 1", None, widened.access) == outside.read_bytes()
    with pytest.raises(ValueError, match="image_access must be one of root, root\\+urls, local, local\\+urls"):
        ImageCollator(path, pad_token_id=0, image_access="anything")
