"""Image rows at training time: caches built by the pipeline with Qwen2.5-VL's and Gemma 3's processors (built
offline), collated by `ImageCollator`. Its pixels,
grids, token ids and token types equal the real processor's on the same conversations; labels are -100
exactly where nothing is trained; a reference-mode image that changed, or a stored grid the configured
processor no longer makes, is a CacheError naming the image; and TRL's SFTTrainer trains a tiny random
Qwen2.5-VL (built from a config: no hub) through it."""

from __future__ import annotations

import json
import math
import pickle
import random
from pathlib import Path

import numpy as np
import pytest

from sft_tokenize.build.options import TokenizeOptions
from sft_tokenize.build.protocol import run_locally
from sft_tokenize.errors import CacheError
from sft_tokenize.read.image_collator import ImageCollator
from sft_tokenize.read.layouts import IGNORE_INDEX

ROWS = 20
BATCH = 4
WORDS = "the cat sat on a mat and looked at what was there Über naïve 12 34 ,".split()


def conversations(image_files, seed: int = 0) -> list[list[dict]]:
    """Text rows (string contents) and rows with 1 or 2 images, in user and assistant turns."""
    rng = random.Random(seed)
    names = sorted(image_files)

    def text() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 8)))

    out = []
    for k in range(ROWS):
        if k % 3 == 0:
            out.append([{"role": role, "content": text()} for role in ("user", "assistant")])
            continue
        paths = [str(image_files[rng.choice(names)]) for _ in range(1 + k % 2)]
        user = [{"type": "text", "text": text()}, {"type": "image", "path": paths[0]}]
        assistant = [{"type": "text", "text": text()}]
        if len(paths) > 1:
            (user if rng.random() < 0.5 else assistant).append({"type": "image", "path": paths[1]})
        out.append([{"role": "user", "content": user}, {"role": "assistant", "content": assistant}])
    return out


def as_dataset(chats: list[list[dict]], vision, tokenizer, *, mode: str = "embed", layout: str = "skyrl"):
    """The rows written as JSON lines and built into a cache by the pipeline (the tokenizer's directory is its
    processor's: tests/support/vision.py), in `mode` and `layout`, loaded as a trainer loads it."""
    from datasets import load_from_disk

    processor_dir = Path(tokenizer.name_or_path)
    work = processor_dir.parent / f"{processor_dir.name}-data"
    data = work / f"{mode}-{layout}" / "rows.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text("".join(json.dumps({"messages": messages}) + "\n" for messages in chats))
    path = run_locally(TokenizeOptions(sources=[str(data)], processor=str(processor_dir), images=mode,
                                       layout=layout, cache_dir=str(work / "cache"),
                                       image_access="local"))  # the images lie outside the data's directory
    assert json.loads((path / "manifest.json").read_text())["images"]["family"] == vision.name
    return load_from_disk(str(path))


def record_for(vision, dataset, mode: str = "embed") -> dict:
    """The manifest's images record of the cache the dataset was loaded from."""
    manifest = Path(dataset.cache_files[0]["filename"]).parent / "manifest.json"
    record = json.loads(manifest.read_text())["images"]
    assert record["mode"] == mode
    return record


@pytest.fixture(scope="module")
def cache(vision_family, image_files):
    """(family, tokenizer, processor, vision, chats, dataset, record) for the generated rows, embedded."""
    name, tokenizer, processor, vision = vision_family
    chats = conversations(image_files)
    dataset = as_dataset(chats, vision, tokenizer)
    return name, tokenizer, processor, vision, chats, dataset, record_for(vision, dataset)


def batches(dataset, size: int = BATCH) -> list[list[dict]]:
    return [[dataset[j] for j in range(i, min(i + size, len(dataset)))] for i in range(0, len(dataset), size)]


def test_the_rows_mix_text_and_images_and_keep_the_schema(cache):
    _, _, _, _, _, dataset, record = cache
    counts = [len(row) for row in dataset["images"]]
    assert set(counts) == {0, 1, 2} and len(dataset) == ROWS
    assert str(dataset.features["images"]) == (
        "List({'bytes': Value('binary'), 'path': Value('string'), 'hash': Value('string'), 'size': Value('int64')})")
    assert record["images"] == sum(counts)
    assert record["image_bytes"] == sum(cell["size"] for row in dataset["images"] for cell in row)


def test_the_batches_equal_the_processors(cache):
    name, tokenizer, processor, _, chats, dataset, record = cache
    collate = ImageCollator(record, pad_token_id=tokenizer.pad_token_id)
    types_key = "mm_token_type_ids" if name.startswith("qwen") else "token_type_ids"
    for b, rows in enumerate(batches(dataset)):
        batch = collate(rows)
        wants = [processor.apply_chat_template(chats[b * BATCH + k], tokenize=True, return_dict=True,
                                               return_tensors="np") for k in range(len(rows))]
        for k, want in enumerate(wants):
            n = want["input_ids"].shape[1]
            assert batch["input_ids"][k, :n].tolist() == want["input_ids"][0].tolist(), f"batch {b} row {k}"
            assert batch["attention_mask"][k].tolist() == [1] * n + [0] * (batch["input_ids"].shape[1] - n)
            assert batch[types_key][k, :n].tolist() == want[types_key][0].tolist(), f"batch {b} row {k}"
            assert not batch[types_key][k, n:].any()
        with_pixels = [want for want in wants if "pixel_values" in want]
        if not with_pixels:
            assert not {"pixel_values", "image_grid_thw"} & set(batch)
            continue
        pixels = np.concatenate([want["pixel_values"] for want in with_pixels])
        assert np.array_equal(batch["pixel_values"].numpy(), pixels), f"batch {b}"
        if name.startswith("qwen"):
            grids = np.concatenate([want["image_grid_thw"] for want in with_pixels])
            assert batch["image_grid_thw"].tolist() == grids.tolist(), f"batch {b}"
        else:
            assert "image_grid_thw" not in batch


def test_a_text_only_batch_has_no_pixel_keys(cache):
    _, tokenizer, _, _, _, dataset, record = cache
    text_rows = [row for row in dataset if not row["images"]]
    batch = ImageCollator(record, pad_token_id=tokenizer.pad_token_id)(text_rows[:3])
    assert set(batch) == {"input_ids", "attention_mask", "labels",
                          "mm_token_type_ids" if record["family"].startswith("qwen") else "token_type_ids"}


@pytest.mark.parametrize("layout", ["skyrl", "trl"])
def test_labels_are_ignored_exactly_where_nothing_is_trained(cache, layout):
    _, tokenizer, _, vision, chats, dataset, record = cache
    stored = dataset if layout == "skyrl" else as_dataset(chats, vision, tokenizer, layout="trl")
    collate = ImageCollator(record, pad_token_id=tokenizer.pad_token_id)
    vision_ids = sorted(vision.vision_token_ids)
    for b, rows in enumerate(batches(stored)):
        batch = collate(rows)
        for k in range(len(rows)):
            ids, mask = np.array(dataset[b * BATCH + k]["input_ids"]), np.array(dataset[b * BATCH + k]["loss_mask"])
            labels = batch["labels"][k].numpy()
            assert labels[:len(ids)].tolist() == np.where(mask == 1, ids, IGNORE_INDEX).tolist()
            assert (labels[len(ids):] == IGNORE_INDEX).all()
            assert (batch["input_ids"][k, len(ids):] == tokenizer.pad_token_id).all()
            assert (labels[:len(ids)][np.isin(ids, vision_ids)] == IGNORE_INDEX).all()


def test_reference_mode_reads_the_files_and_refuses_one_that_changed(cache, image_files, tmp_path):
    import torch

    _, tokenizer, _, vision, chats, dataset, record = cache
    moved = {}  # copies the test may change
    for path in image_files.values():
        moved[str(path)] = str(tmp_path / path.name)
        (tmp_path / path.name).write_bytes(path.read_bytes())
    chats = [[m if isinstance(m["content"], str) else {**m, "content": [
        {**p, "path": moved[p["path"]]} if p["type"] == "image" else p for p in m["content"]]} for m in chat]
        for chat in chats]
    referenced = as_dataset(chats, vision, tokenizer, mode="reference")
    assert all(cell["bytes"] is None for row in referenced["images"] for cell in row)
    embed = ImageCollator(record, pad_token_id=tokenizer.pad_token_id)
    reference = ImageCollator({**record, "mode": "reference"}, pad_token_id=tokenizer.pad_token_id)
    for rows, stored_rows in zip(batches(dataset), batches(referenced), strict=True):
        want, got = embed(rows), reference(stored_rows)
        assert set(got) == set(want) and all(torch.equal(got[key], want[key]) for key in want)

    k, row = next((k, row) for k, row in enumerate(referenced) if row["images"])
    changed = row["images"][0]["path"]
    data = bytearray(Path(changed).read_bytes())
    data[-3] ^= 0xFF  # the same size, other bytes
    Path(changed).write_bytes(bytes(data))
    rows = [referenced[j] for j in range(k - k % BATCH, min(k - k % BATCH + BATCH, len(referenced)))]
    with pytest.raises(CacheError, match=rf"^batch row {k % BATCH} image 1 \({changed}\): .* does not hash to "):
        reference(rows)
    Path(changed).write_bytes(bytes(data) + b"more")
    with pytest.raises(CacheError, match=rf"^batch row {k % BATCH} image 1 \({changed}\): .* bytes, the cache "
                                         rf"recorded {len(data):,}"):
        reference(rows)


def test_a_stored_grid_the_processor_no_longer_makes_is_refused(cache):
    name, tokenizer, _, _, _, dataset, record = cache
    settings = ({**record["settings"], "min_pixels": 28 * 28 * 20, "max_pixels": 28 * 28 * 24}
                if name.startswith("qwen") else {**record["settings"], "size": {"height": 56, "width": 56}})
    collate = ImageCollator({**record, "settings": settings}, pad_token_id=tokenizer.pad_token_id)
    rows = [row for row in dataset if row["images"]][:BATCH]
    with pytest.raises(CacheError, match=r"^batch row \d image \d \(.*\.img\): the processor makes grid \(1, \d+, \d+\)"
                                         r" but the cache holds \(1, \d+, \d+\): the cache was built with another "
                                         "processor configuration"):
        collate(rows)


def test_a_row_whose_grids_do_not_fit_its_tokens_is_refused(cache):
    name, tokenizer, _, _, _, dataset, record = cache
    row = dict(next(row for row in dataset if len(row["images"]) == 1))
    row["images"] = row["images"] * 2
    row["image_grid_thw"] = row["image_grid_thw"] * 2
    with pytest.raises(CacheError, match=r"^batch row 0: \d+ image feature tokens for images whose grids make \d+"):
        ImageCollator(record, pad_token_id=tokenizer.pad_token_id)([row])


def tiny_qwen2_5_vl(tokenizer, vision):
    """A random Qwen2.5-VL of 1 text layer and a 1-block vision tower, wired to this tokenizer's vision ids."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    heads, hidden = 4, 64
    head_dim = hidden // heads
    config = Qwen2_5_VLConfig(
        text_config={"vocab_size": len(tokenizer), "hidden_size": hidden, "intermediate_size": 2 * hidden,
                     "num_hidden_layers": 1, "num_attention_heads": heads, "num_key_value_heads": 2,
                     "max_position_embeddings": 4096, "pad_token_id": tokenizer.pad_token_id,
                     "bos_token_id": None, "eos_token_id": tokenizer.eos_token_id,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                         "mrope_section": [2, 3, head_dim // 2 - 5]}},
        vision_config={"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                       "out_hidden_size": hidden, "fullatt_block_indexes": [0], "patch_size": vision.patch_size,
                       "spatial_merge_size": vision.merge_size, "temporal_patch_size": vision.temporal_patch_size},
        image_token_id=vision.image_id, video_token_id=tokenizer.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=vision.vision_start_id, vision_end_token_id=vision.vision_end_id)
    torch.manual_seed(0)
    return Qwen2_5_VLForConditionalGeneration(config)


@pytest.mark.parametrize("vision_family", ["qwen2.5-vl"], indirect=True)
def test_trl_sft_trainer_trains_a_qwen2_5_vl_through_the_collator(cache, tmp_path):
    import torch

    _, tokenizer, processor, vision, _, dataset, record = cache
    from trl import SFTConfig, SFTTrainer

    # Three image rows and a text row: the two batches of one epoch both hold images, one of them mixed.
    picked = [k for k, row in enumerate(dataset["images"]) if row][:3] + [
        k for k, row in enumerate(dataset["images"]) if not row][:1]
    train = dataset.select(picked)
    seen: list[dict] = []

    class Recording(SFTTrainer):  # what reaches the model
        def compute_loss(self, model, inputs, *args, **kwargs):
            seen.append({k: v.detach().clone() for k, v in inputs.items() if torch.is_tensor(v)})
            return super().compute_loss(model, inputs, *args, **kwargs)

    args = SFTConfig(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=2, use_cpu=True,
                     report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True, dataloader_num_workers=0,
                     dataset_kwargs={"skip_prepare_dataset": True}, remove_unused_columns=False, max_length=None)
    model = tiny_qwen2_5_vl(tokenizer, vision)
    patch_embedding = model.model.visual.patch_embed.proj.weight.detach().clone()
    trainer = Recording(model=model, args=args, train_dataset=train, processing_class=processor,
                        data_collator=ImageCollator(record, pad_token_id=tokenizer.pad_token_id))
    trainer.train()
    assert trainer.state.global_step == 2
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses), trainer.state.log_history
    assert len(seen) == 2
    assert all({"pixel_values", "image_grid_thw", "mm_token_type_ids", "labels"} <= set(batch) for batch in seen)
    assert sum(len(batch["image_grid_thw"]) for batch in seen) == sum(len(row) for row in train["images"])
    assert not torch.equal(model.model.visual.patch_embed.proj.weight.detach(), patch_embedding), \
        "the vision tower was not trained: the images did not reach the model"


def published(dataset, directory: Path, images: dict | None) -> Path:
    """The rows saved as `datasets` saves a cache's data files, with a manifest holding `images`."""
    dataset.save_to_disk(str(directory))
    state = json.loads((directory / "state.json").read_text())
    files = [{"name": entry["filename"], "bytes": (directory / entry["filename"]).stat().st_size}
             for entry in state["_data_files"]]
    manifest = {"name": "images", "fingerprint": "0" * 16, "fingerprint_inputs": {}, "rows": len(dataset),
                "tokens": sum(len(ids) for ids in dataset["input_ids"]), "trained_tokens": 0, "dropped": {},
                "lengths": {}, "files": files, "shards": [], **({"images": images} if images else {})}
    (directory / "manifest.json").write_text(json.dumps(manifest))
    return directory


def test_the_collator_reads_its_record_from_a_cache_path(cache, tmp_path):
    import torch
    from datasets import load_from_disk

    _, tokenizer, _, _, _, dataset, record = cache
    path = published(dataset, tmp_path / "cache", record)
    rows = list(load_from_disk(str(path)))[:BATCH]
    want = ImageCollator(record, pad_token_id=tokenizer.pad_token_id)(rows)
    got = pickle.loads(pickle.dumps(ImageCollator(path, pad_token_id=tokenizer.pad_token_id)))(rows)  # as workers
    assert set(got) == set(want) and all(torch.equal(got[key], want[key]) for key in want)
    text_only = published(dataset, tmp_path / "text", None)
    with pytest.raises(CacheError, match="manifest holds no images record"):
        ImageCollator(text_only, pad_token_id=tokenizer.pad_token_id)
