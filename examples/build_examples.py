"""Build the bundled example: a small chat dataset and a small fast tokenizer with a ChatML template.

Everything is generated from a fixed seed, offline:

    python examples/build_examples.py            # writes examples/data/ and examples/tokenizer/

The same generator makes the benchmark corpus at a realistic size (benchmarks/run.py imports it).
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_WORDS = (
    "the model data token cache shard arrow memory train loss mask batch worker slice flow task retry "
    "prefect dataset stream write read byte offset line row column schema file disk index value answer "
    "question explain compute result fast small large every first last order source target chat turn "
    "user assistant system template reply because however therefore example function return number "
    "string list python error check test output input length window context learning rate gradient step "
    "epoch sample "
).split()
_UNICODE = ["café", "naïve", "über", "日本語", "中文字符", "emoji 🚀", "Ωmega", "façade", "résumé", "Дата"]


def sentence(rng: random.Random, words: int) -> str:
    picked = [rng.choice(_WORDS) for _ in range(words)]
    if rng.random() < 0.15:
        picked.insert(rng.randrange(len(picked) + 1), rng.choice(_UNICODE))
    if rng.random() < 0.1:
        picked.append(str(rng.randrange(10_000)))
    return " ".join(picked).capitalize() + rng.choice([".", "?", "!", "."])


def paragraph(rng: random.Random, sentences: int, words: tuple[int, int] = (5, 18)) -> str:
    return " ".join(sentence(rng, rng.randint(*words)) for _ in range(sentences))


def conversation(rng: random.Random, turns: tuple[int, int] = (1, 4), sentences: tuple[int, int] = (1, 5)) -> dict:
    """One chat row: optional system message, then alternating user/assistant turns."""
    messages = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": paragraph(rng, 1)})
    for _ in range(rng.randint(*turns)):
        messages.append({"role": "user", "content": paragraph(rng, rng.randint(*sentences))})
        messages.append({"role": "assistant", "content": paragraph(rng, rng.randint(*sentences))})
    return {"messages": messages}


def conversations(seed: int, count: int, **shape) -> Iterator[dict]:
    rng = random.Random(seed)
    for _ in range(count):
        yield conversation(rng, **shape)


def write_jsonl(path: Path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        for row in rows:
            out.write(json.dumps(row, ensure_ascii=False) + "\n")


def train_tokenizer(corpus: Iterator[str], vocab_size: int, out_dir: Path, template: str = CHATML_TEMPLATE) -> None:
    """A byte-level BPE saved as a `transformers` fast tokenizer with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>",
                                        pad_token="<|endoftext|>", model_max_length=1_000_000)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(str(out_dir))


def corpus_text(rows) -> Iterator[str]:
    for row in rows:
        for message in row["messages"]:
            yield message["content"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=HERE)
    args = parser.parse_args()
    rows = list(conversations(seed=0, count=240))
    rows[7]["messages"][-1]["content"] = ""  # an empty assistant reply still trains its end-of-turn token
    write_jsonl(args.out / "data" / "chat-00000.jsonl", rows[:150])
    write_jsonl(args.out / "data" / "chat-00001.jsonl", rows[150:])
    train_tokenizer(corpus_text(conversations(seed=1, count=2000)), 2000, args.out / "tokenizer")
    print(f"wrote {args.out / 'data'} (240 conversations) and {args.out / 'tokenizer'}")


if __name__ == "__main__":
    main()
