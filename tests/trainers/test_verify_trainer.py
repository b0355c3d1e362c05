"""`verify_trainer` / `sft-tokenize verify CACHE --trainer NAME`: a trainer's own data path over the cache, checked
token for token against the loss mask. It passes on the bundled example, and fails naming the row on a cache
whose mask was altered and on a collator that trains the prompt."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from support.cli import cli
from support.paths import EXAMPLE_DATA, EXAMPLE_TOKENIZER

from sft_tokenize.build.options import TokenizeOptions
from sft_tokenize.build.protocol import run_locally
from sft_tokenize.consumers.verify_trainer import verify_trainer
from sft_tokenize.errors import BadInput
from sft_tokenize.read.cache import open_cache

EPOCH = 1000  # batches: more than an epoch of the example's 240 rows, so every row is drawn and checked


@pytest.fixture(scope="module")
def caches(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("verify-caches")
    made = {layout: run_locally(TokenizeOptions(sources=[str(EXAMPLE_DATA)], tokenizer=str(EXAMPLE_TOKENIZER),
                                                cache_dir=str(root), layout=layout))
            for layout in ("skyrl", "trl", "axolotl")}
    made["skyrl+labels"] = run_locally(TokenizeOptions(sources=[str(EXAMPLE_DATA)], tokenizer=str(EXAMPLE_TOKENIZER),
                                                       cache_dir=str(root), extra_columns=["labels"]))
    return {name: Path(path) for name, path in made.items()}


def altered_mask(cache: Path, out: Path, row: int) -> Path:
    """A copy of `cache` whose loss_mask of `row` has its first trained token set to 0 (its labels kept), the
    manifest's sizes updated so that it opens: a mask altered on purpose."""
    copy = Path(shutil.copytree(cache, out / cache.name))
    manifest = json.loads((copy / "manifest.json").read_text())
    first = 0
    for entry in manifest["files"]:
        path = copy / entry["name"]
        table = pa.ipc.open_stream(pa.memory_map(str(path))).read_all()
        if first <= row < first + table.num_rows:
            masks = table.column("loss_mask").to_pylist()
            local = masks[row - first]
            local[local.index(1)] = 0
            table = table.set_column(table.schema.get_field_index("loss_mask"), table.schema.field("loss_mask"),
                                     pa.array(masks, type=table.schema.field("loss_mask").type))
            path.unlink()
            with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
                writer.write_table(table)
            entry["bytes"] = path.stat().st_size
            entry.pop("digest", None)
        first += table.num_rows
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


def prompt_training_collator():
    """A collator that re-derives labels from the ids, as a language-modelling collator does: it trains the prompt."""
    from transformers import AutoTokenizer, DataCollatorForLanguageModeling

    collate = DataCollatorForLanguageModeling(AutoTokenizer.from_pretrained(str(EXAMPLE_TOKENIZER)), mlm=False)
    return lambda rows: collate([{"input_ids": row["input_ids"]} for row in rows])


@pytest.mark.parametrize(("trainer", "layout"), [("trl", "skyrl"), ("trl", "trl"), ("axolotl", "axolotl")])
def test_each_trainer_trains_exactly_the_example_caches_mask(caches, trainer, layout):
    check = verify_trainer(caches[layout], trainer, EPOCH)
    assert check.rows == len(open_cache(caches[layout]))  # a whole epoch: every row drawn once
    assert 0 < check.trained < check.tokens
    assert check.trained == open_cache(caches[layout]).manifest["trained_tokens"]


def test_a_cache_whose_mask_was_altered_fails_naming_the_row(caches, tmp_path):
    altered = altered_mask(caches["skyrl+labels"], tmp_path, row=37)
    assert verify_trainer(caches["skyrl+labels"], "trl", EPOCH).rows == 240
    with pytest.raises(BadInput, match=r"row 37: trl's data path differs .* though its loss_mask is 0"):
        verify_trainer(altered, "trl", EPOCH)


def test_a_collator_that_trains_the_prompt_fails_naming_a_row(caches):
    for trainer, layout in (("trl", "trl"), ("axolotl", "axolotl")):
        differs = rf"row \d+: {trainer}'s data path differs from the cache at token 0 .* its loss_mask is 0"
        with pytest.raises(BadInput, match=differs):
            verify_trainer(caches[layout], trainer, 2, collator=prompt_training_collator())


def test_the_command_exits_0_on_the_example_and_2_naming_the_row(caches, tmp_path, cli_home):
    done = cli("verify", str(caches["trl"]), "--trainer", "trl", "--batches", "3", home=cli_home)
    assert done.returncode == 0, done.stderr
    assert "trl: 3 batches, 12 rows" in done.stdout and "exactly the cache's loss mask" in done.stdout
    altered = altered_mask(caches["skyrl+labels"], tmp_path, row=5)
    failed = cli("verify", str(altered), "--trainer", "trl", "--batches", str(EPOCH), home=cli_home)
    assert failed.returncode == 2 and "row 5:" in failed.stderr and len(failed.stderr.strip().splitlines()) == 1
    assert np.all(open_cache(caches["trl"]).lengths > 0)


def test_trainers_whose_data_path_cannot_run_here_say_what_to_install_and_why(example_cache, cli_home):
    for trainer, why in (("llamafactory", "torchaudio"), ("skyrl", "Python 3.12")):
        with pytest.raises(BadInput, match=rf"--trainer {trainer}: not checked here: .*{why}.*pip install {trainer}"):
            verify_trainer(example_cache, trainer, 1)
    refused = cli("verify", str(example_cache), "--trainer", "skyrl", home=cli_home)
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1
    assert "skyrl==0.3.0" in refused.stderr and "Python 3.12" in refused.stderr
