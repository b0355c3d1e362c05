"""Image rows encoded against the real processors, Qwen2.5-VL's and Gemma 3's (built offline, PIL backend): on
200 generated conversations with 0 to 3 images each (every kind of tests/support/images.py, in user and in
assistant turns, over several turns), every row's input_ids equal `processor.apply_chat_template(...,
tokenize=True, return_dict=True)`, its grids equal the processor's, no vision token is trained, and its trained
text is the text-only definition's on the same conversation with the images removed. A cut by max_length
inside an image's run drops the row; an image row without a processor is a row error."""

from __future__ import annotations

import random

import numpy as np
import pytest
from support.images import sample_images
from support.vision import gemma3, qwen_vl

from sft_tokenize.encoding.chat_encoder import ChatEncoder
from sft_tokenize.encoding.vision import load_family
from sft_tokenize.errors import BadRow
from sft_tokenize.sources.conversations import Conversation
from sft_tokenize.sources.images import load_images, normalize_images

CONVERSATIONS = 200
WORDS = "the cat sat on a mat and looked at what was there Über naïve 12 34 ,".split()
BUILDERS = {"qwen2.5-vl": qwen_vl, "gemma3": gemma3}


@pytest.fixture(scope="module")
def image_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("images")
    paths = {}
    for name, data in sample_images().items():
        paths[name] = folder / f"{name}.img"
        paths[name].write_bytes(data)
    return paths


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def family(request, tmp_path_factory):
    tokenizer, processor, config = BUILDERS[request.param](tmp_path_factory.mktemp(request.param))
    return request.param, tokenizer, processor, load_family(config, tokenizer)


def conversations(image_files, seed: int = 0) -> list[list[dict]]:
    """Chats of 1 to 3 exchanges with 0 to 3 images, as users write them (image parts with a path)."""
    rng = random.Random(seed)
    names = sorted(image_files)

    def text() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 8)))

    out = []
    for _ in range(CONVERSATIONS):
        budget, messages = rng.randint(0, 3), []
        plain = budget == 0 and rng.random() < 0.5  # a text row: string contents
        for _ in range(rng.randint(1, 3)):
            for role in ("user", "assistant"):
                if plain:
                    messages.append({"role": role, "content": text()})
                    continue
                parts = []
                for _ in range(rng.randint(1, 3)):
                    if budget and rng.random() < (0.5 if role == "user" else 0.2):
                        parts.append({"type": "image", "path": str(image_files[rng.choice(names)])})
                        budget -= 1
                    else:
                        parts.append({"type": "text", "text": text()})
                messages.append({"role": role, "content": parts})
        out.append(messages)
    return out


def image_row(messages: list[dict], vision) -> Conversation:
    """The conversation as the encoder takes it: payload-less image parts and each image's grid from its header."""
    normalized, refs = normalize_images(messages)
    grids = tuple(vision.grid(image.header, k) for k, image in enumerate(load_images(refs), start=1))
    bare = [m if isinstance(m["content"], str) else
            {**m, "content": [{"type": "image"} if p["type"] == "image" else p for p in m["content"]]}
            for m in normalized]
    return Conversation(bare, image_grids=grids)


def without_images(conv: Conversation) -> Conversation:
    return Conversation([m if isinstance(m["content"], str) else
                         {**m, "content": [p for p in m["content"] if p["type"] != "image"]} for m in conv.messages])


def test_image_rows_equal_the_processors_and_train_only_their_text(family, image_files):
    name, tokenizer, processor, vision = family
    chats = conversations(image_files)
    rows = [image_row(messages, vision) for messages in chats]
    assert sum(len(r.image_grids) for r in rows) > CONVERSATIONS  # about one image a row
    assert {len(r.image_grids) for r in rows} == {0, 1, 2, 3}
    assert any(isinstance(m["content"], list) and any(p["type"] == "image" for p in m["content"])
               for chat in chats for m in chat if m["role"] == "assistant")  # images in assistant turns too
    results = ChatEncoder(tokenizer, vision=vision).encode_batch(rows).results()
    text_only = ChatEncoder(tokenizer).encode_batch([without_images(r) for r in rows]).results()
    vision_ids = np.array(sorted(vision.vision_token_ids))
    for k, (messages, row, got, plain) in enumerate(zip(chats, rows, results, text_only, strict=True)):
        want = processor.apply_chat_template(messages, tokenize=True, return_dict=True)
        assert got.input_ids.tolist() == list(want["input_ids"][0]), f"{name} row {k}"
        if name == "qwen2.5-vl" and row.image_grids:
            assert [tuple(g) for g in want["image_grid_thw"].tolist()] == list(row.image_grids), f"row {k}"
        elif name == "gemma3":
            assert len(want.get("pixel_values", [])) == len(row.image_grids), f"row {k}"
        assert not got.loss_mask[np.isin(got.input_ids, vision_ids)].any(), f"{name} row {k}: a vision token trained"
        trained = tokenizer.decode(got.input_ids[got.loss_mask == 1].tolist())
        assert trained == tokenizer.decode(
            plain.input_ids[plain.loss_mask == 1].tolist()), f"{name} row {k}"
        assert got.loss_mask.any()


def test_a_cut_inside_an_image_run_drops_the_row_and_a_cut_after_it_truncates(family, image_files):
    name, tokenizer, _, vision = family
    messages = [{"role": "user", "content": [{"type": "text", "text": "Look:"},
                                             {"type": "image", "path": str(image_files["photo"])}]},
                {"role": "assistant", "content": "A pattern of stripes, in three colours."}]
    row = image_row(messages, vision)
    whole = ChatEncoder(tokenizer, vision=vision).encode_batch([row]).row(0)
    ids = whole.input_ids.tolist()
    first, last = ids.index(vision.run(row.image_grids[0])[0]), len(ids) - 1 - ids[::-1].index(
        vision.run(row.image_grids[0])[-1])
    inside = ChatEncoder(tokenizer, max_length=(first + last) // 2, vision=vision).encode_batch([row])
    assert inside.outcomes == ["image_truncated"]
    after = ChatEncoder(tokenizer, max_length=len(ids) - 2, vision=vision).encode_batch([row])
    assert after.row(0).input_ids.tolist() == ids[:len(ids) - 2]


def test_an_image_row_without_a_processor_is_a_row_error(family, image_files):
    _, tokenizer, _, vision = family
    row = image_row([{"role": "user", "content": [{"type": "image", "path": str(image_files["tiny"])}]},
                     {"role": "assistant", "content": "Small."}], vision)
    (got,) = ChatEncoder(tokenizer).encode_batch([row]).results()
    assert isinstance(got, BadRow) and got.reason == "image_without_processor"
