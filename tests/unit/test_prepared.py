"""A tokenizer prepared once per content (encoding/prepared.py): later processes skip transformers' load and the
encoder check, and encode the same bytes; an edited tokenizer or a damaged entry is prepared again."""

from __future__ import annotations

import json
import logging
import shutil

import numpy as np
import pytest
from support.data import example_rows
from support.paths import EXAMPLE_TOKENIZER

from sft_tokenize.encoding import exact as encoders
from sft_tokenize.encoding.chat_encoder import ChatEncoder
from sft_tokenize.encoding.prepared import PartsTokenizer, keep_boundaries, prepared_dir, prepared_encoding
from sft_tokenize.encoding.tokenizer import load_tokenizer
from sft_tokenize.fingerprint import hash_directory
from sft_tokenize.sources.conversations import ColumnMap, to_example

pytest.importorskip("fastokens")

COLUMNS = ColumnMap("chat", {"messages": "messages"})


class Counted:
    """load() for prepared_encoding, counting the transformers loads; and the encoder checks of this test."""

    def __init__(self, directory, monkeypatch):
        self.directory, self.loads, self.checks = directory, 0, 0
        check = encoders._fastokens_candidate

        def counted_check(backend, text, build=False):
            self.checks += 1
            return check(backend, text, build)

        monkeypatch.setattr(encoders, "_fastokens_candidate", counted_check)
        monkeypatch.setattr(encoders, "_chosen", {})  # no choice remembered from other tests

    def __call__(self):
        self.loads += 1
        return load_tokenizer(self.directory)


def entry(tmp_path, tokenizer_dir):
    return prepared_dir(hash_directory(tokenizer_dir), False)


@pytest.fixture(autouse=True)
def own_home(tmp_path, monkeypatch):
    monkeypatch.setenv("SFT_TOKENIZE_HOME", str(tmp_path / "home"))


def encoded(tokenizer, fast, rows):
    batch = ChatEncoder(tokenizer, fast=fast).encode_batch([to_example(row, COLUMNS) for row in rows])
    return batch.input_ids.tobytes(), batch.loss_mask.tobytes(), batch.offsets.tobytes(), batch.rows_verified


@pytest.mark.parametrize("requested", ["auto", "hf"])
def test_a_prepared_tokenizer_skips_the_load_and_the_check_and_encodes_the_same_bytes(tmp_path, monkeypatch,
                                                                                       requested):
    directory = entry(tmp_path, EXAMPLE_TOKENIZER)
    load = Counted(EXAMPLE_TOKENIZER, monkeypatch)
    first, first_fast = prepared_encoding(directory, load, requested)
    assert (load.loads, load.checks) == (1, requested != "hf")
    # The fast encoder is checked where its tables are built (here, as it first encodes): the entry is written
    # with the verdict.
    assert (directory / "prepared.json").is_file() == (requested == "hf")
    assert first_fast is None or first_fast.verdict() == ""
    assert (directory / "prepared.json").is_file() and (directory / "backend.json").is_file()
    encoders._chosen.clear()
    again, again_fast = prepared_encoding(directory, load, requested)
    assert (load.loads, load.checks) == (1, requested != "hf")  # neither loaded nor checked again
    assert isinstance(again, PartsTokenizer) and (again_fast is None) == (requested == "hf")
    rows = example_rows()[:40]
    want = encoded(first, first_fast, rows)
    assert encoded(again, again_fast, rows) == want
    assert want[3] == (16 if requested != "hf" else 0)  # a slice's first rows are still checked against HF's


def test_a_templates_boundaries_kept_in_the_entry_spare_a_later_process_hfs_tokenizer(tmp_path, monkeypatch):
    directory = entry(tmp_path, EXAMPLE_TOKENIZER)
    load = Counted(EXAMPLE_TOKENIZER, monkeypatch)
    first, first_fast = prepared_encoding(directory, load, "auto")
    assert first_fast.verdict() == ""
    learned = ChatEncoder(first, fast=first_fast).template.learned_boundaries
    keep_boundaries(first, learned)
    assert learned and json.loads((directory / "boundaries.json").read_text()) == learned
    encoders._chosen.clear()
    again, again_fast = prepared_encoding(directory, load, "auto")
    assert ChatEncoder(again, fast=again_fast).template.learned_boundaries == learned
    assert again._backend is None  # learned from the entry, not from HF's tokenizer built again
    rows = example_rows()[:40]
    assert encoded(again, again_fast, rows) == encoded(first, first_fast, rows)


def test_an_entry_made_for_hf_is_checked_when_the_fast_encoder_is_asked_for(tmp_path, monkeypatch):
    directory = entry(tmp_path, EXAMPLE_TOKENIZER)
    load = Counted(EXAMPLE_TOKENIZER, monkeypatch)
    prepared_encoding(directory, load, "hf")
    _, fast = prepared_encoding(directory, load, "auto")
    assert fast is not None and (load.loads, load.checks) == (2, 1) and fast.verdict() == ""
    assert json.loads((directory / "prepared.json").read_text())["encoder"] == {"accepted": True, "nfc": fast.nfc}


def test_a_refusal_is_kept_and_said_again_without_checking(tmp_path, monkeypatch, metaspace_tokenizer, caplog):  # noqa: F811
    source = tmp_path / "metaspace"
    metaspace_tokenizer.save_pretrained(str(source))
    directory = entry(tmp_path, source)
    load = Counted(source, monkeypatch)
    assert prepared_encoding(directory, load, "auto")[1] is None
    encoders._chosen.clear()
    with caplog.at_level(logging.INFO, logger="sft_tokenize"):
        tokenizer, fast = prepared_encoding(directory, load, "auto")
    assert fast is None and (load.loads, load.checks) == (1, 1)
    assert "not fastokens: its pre-tokenizer (Metaspace) is not byte-level" in caplog.text


def test_a_fast_encoder_wrong_on_purpose_is_refused_where_it_is_built_and_the_entry_keeps_it(tmp_path, monkeypatch):
    """HF's answers altered for one check string stand in for a fastokens that gets it wrong: the process that
    builds its tables refuses it as it first encodes, HF encodes every row, and no later process uses it."""
    from dataclasses import replace

    directory = entry(tmp_path, EXAMPLE_TOKENIZER)
    load = Counted(EXAMPLE_TOKENIZER, monkeypatch)
    tokenizer, fast = prepared_encoding(directory, load, "auto")
    special = list(fast.cases.ids[1])
    special[0] = [*special[0], 7]
    fast.cases = replace(fast.cases, ids=(fast.cases.ids[0], tuple(special)))
    rows = example_rows()[:40]
    got = encoded(tokenizer, fast, rows)
    assert fast.refused == "fastokens gives other ids than tokenizers for ''"  # HARD_STRINGS[0], with specials
    assert got == encoded(tokenizer, None, rows)  # HF's bytes, nothing of fastokens' to check
    assert json.loads((directory / "prepared.json").read_text())["encoder"] == {"accepted": False,
                                                                                 "refusal": fast.refused}
    encoders._chosen.clear()
    assert prepared_encoding(directory, load, "auto")[1] is None and load.loads == 1


def test_an_edited_tokenizer_file_or_a_library_version_names_another_entry(tmp_path, monkeypatch):
    edited = shutil.copytree(EXAMPLE_TOKENIZER, tmp_path / "edited")
    config = json.loads((edited / "tokenizer_config.json").read_text())
    (edited / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 77}))
    assert entry(tmp_path, edited) != entry(tmp_path, EXAMPLE_TOKENIZER)
    from sft_tokenize.encoding import prepared

    before = entry(tmp_path, EXAMPLE_TOKENIZER)
    assert before.parent == tmp_path / "home" / "tokenizers"
    monkeypatch.setattr(prepared, "_version", lambda name: "0.0.1" if name == "fastokens" else None)
    assert entry(tmp_path, EXAMPLE_TOKENIZER) != before


@pytest.mark.parametrize("damage", ["truncated", "no_backend", "no_lengths"])
def test_a_damaged_entry_is_prepared_again(tmp_path, monkeypatch, damage):
    directory = entry(tmp_path, EXAMPLE_TOKENIZER)
    load = Counted(EXAMPLE_TOKENIZER, monkeypatch)
    want = encoded(*prepared_encoding(directory, load, "auto"), example_rows()[:8])
    if damage == "truncated":
        meta = directory / "prepared.json"
        meta.write_bytes(meta.read_bytes()[:50])
    else:
        (directory / ("backend.json" if damage == "no_backend" else "byte_lengths.npy")).unlink()
    encoders._chosen.clear()
    tokenizer, fast = prepared_encoding(directory, load, "auto")
    assert (load.loads, load.checks) == (2, 2)
    assert encoded(tokenizer, fast, example_rows()[:8]) == want
    assert np.load(directory / "byte_lengths.npy").shape == fast.byte_lengths.shape


def test_a_template_override_applies_to_both_loads_and_the_entry_keeps_the_tokenizers_own(tmp_path):
    from sft_tokenize.build.workers import process_encoding

    directory = entry(tmp_path, EXAMPLE_TOKENIZER)
    override = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    own = (EXAMPLE_TOKENIZER / "chat_template.jinja").read_text()
    for _ in range(2):  # prepared, then read from the entry
        process_encoding.cache_clear()
        tokenizer, fast = process_encoding(str(EXAMPLE_TOKENIZER), override, False, "auto", str(directory))
        assert tokenizer.chat_template == override and fast.verdict() == ""  # checked: the entry is written
    assert isinstance(tokenizer, PartsTokenizer)
    assert json.loads((directory / "prepared.json").read_text())["chat_template"].strip() == own.strip()


def test_the_process_that_prepares_keeps_what_a_later_one_reads_not_transformers_tokenizer(tmp_path, monkeypatch):
    directory = entry(tmp_path, EXAMPLE_TOKENIZER)
    load = Counted(EXAMPLE_TOKENIZER, monkeypatch)
    tokenizer, fast = prepared_encoding(directory, load, "auto")
    assert load.loads == 1 and isinstance(tokenizer, PartsTokenizer)
    assert tokenizer._backend is not None  # HF's Rust tokenizer, built by the load, is kept rather than built again
    encoders._chosen.clear()
    assert encoded(tokenizer, fast, example_rows()[:40]) == encoded(*prepared_encoding(directory, load, "auto"),
                                                                    example_rows()[:40])


def test_what_a_resident_prepares_is_the_last_runs_encoding_with_both_tokenizers_built(tmp_path):
    from sft_tokenize.build.workers import encodings_made, prepare_encodings, process_encoding

    arguments = (str(EXAMPLE_TOKENIZER), None, False, "auto", str(entry(tmp_path, EXAMPLE_TOKENIZER)))
    process_encoding.cache_clear()
    try:
        _, fast = process_encoding(*arguments)  # a run: it prepares the entry, written once its encoder is checked
        assert fast.verdict() == ""  # as the run's first encode checks it
        assert encodings_made(forget=True)[-1] == arguments and encodings_made() == []
        process_encoding.cache_clear()  # the resident process the run starts
        prepare_encodings([arguments])
        tokenizer, fast = process_encoding(*arguments)  # its command
        assert process_encoding.cache_info().hits == 1
        assert tokenizer._backend is not None and not isinstance(fast._native, encoders.PendingNative)
    finally:
        process_encoding.cache_clear()
