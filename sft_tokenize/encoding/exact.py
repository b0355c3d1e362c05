"""A faster exact encoder beside HF `tokenizers`: chosen per tokenizer, verified, and never trusted blindly.

`fastokens` (the `fast` extra) encodes byte-level BPE tokenizers many times faster than `tokenizers`, but gives
ids only. For byte-level BPE each id stands for a fixed run of UTF-8 bytes, so prefix sums of those lengths
place every token in the text, which is all the loss mask needs. A tokenizer is accepted only if its pieces
make that exact (byte-level pre-tokenizer and decoder, no offset trimming, no normalizer but NFC) and
fastokens gives HF's ids and positions on a set of hard strings (HF's answers are `CheckCases`: the process
that builds fastokens' tables checks them, an encode pool's too); a row whose byte lengths do not add up to its
text is encoded by HF. HF stays the reference: callers also compare each slice's first rows against it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import unicodedata
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from sft_tokenize.encoding.placement import FlatPlacement, IdsEncoding, TextBytes, running_totals
from sft_tokenize.errors import BadInput

logger = logging.getLogger("sft_tokenize")

ENCODERS = ("auto", "hf", "fastokens")

# Strings tokenizers get wrong in different ways: scripts, combining marks, emoji sequences, whitespace runs,
# digit runs, control characters, long inputs. Special and added tokens are mixed into them at check time.
HARD_STRINGS = (
    "", " ", "  ", "\n", "\n\n\n", " \n \n", "\t\t x", "a\r\nb", "   leading", "trailing   ", "x \u00a0 y",
    "12345678901234567890", "3.14159 -42 1e10 0x1F 1,000,000", "١٢٣٤ ۴۵۶ ४५६",
    "Ünïcödé façade naïve résumé", "e\u0301 a\u0308 \u212b \ufb01", "中文字符测试，标点。", "日本語のテキスト",
    "한국어 텍스트", "Ελληνικά Русский עברית العربية", "ไทย ภาษา", "😀👍🏽👨‍👩‍👧‍👦🏳️‍🌈 🇫🇷",
    "def f(x):\n    return x  # comment\n\n\n", "```json\n{\"a\": [1, 2]}\n```", "<b>html</b> &amp; &#x27;",
    "\x00\x01\x7f \ufeff \u200b\u200d", "'s 't 're 've 'm 'll 'd 'S 'T", "a" * 3000, "ab " * 2000,
    " " * 500 + "x" + "\n" * 300, "9" * 1200, ("word " * 40 + "\n") * 50, "😀" * 400,
)

# Rows of each slice encoded by both encoders and compared, ids and mask spans.
VERIFY_ROWS = 16


class EncoderMismatch(RuntimeError):
    """The fast encoder disagreed with HF `tokenizers` on a real row: never written, always raised."""


def _bytes_to_unicode() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character each byte is written as in a byte-level vocabulary."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _pieces(component: dict | None) -> list[dict]:
    if component is None:
        return []
    if component.get("type") == "Sequence":
        key = next((k for k in ("pretokenizers", "processors", "normalizers", "decoders") if k in component), None)
        return [p for sub in component.get(key, []) for p in _pieces(sub)]
    return [component]


def _byte_level_refusal(config: dict) -> str | None:
    """Why token byte lengths would not give this tokenizer's positions exactly, or None if they do."""
    model = config.get("model") or {}
    if model.get("type") != "BPE":
        return f"its model is {model.get('type')}, not byte-level BPE"
    if model.get("dropout"):
        return "its BPE has dropout (ids are random)"
    normalizers = [p.get("type") for p in _pieces(config.get("normalizer"))]
    if any(kind != "NFC" for kind in normalizers):
        return f"its normalizer ({', '.join(normalizers)}) changes the text"
    pre = [p.get("type") for p in _pieces(config.get("pre_tokenizer"))]
    if not pre or pre[-1] != "ByteLevel" or any(kind not in ("ByteLevel", "Split", "Digits") for kind in pre):
        return f"its pre-tokenizer ({', '.join(pre) or 'none'}) is not byte-level"
    if [p.get("type") for p in _pieces(config.get("decoder"))] != ["ByteLevel"]:
        return "its decoder is not byte-level"
    for processor in _pieces(config.get("post_processor")):
        if processor.get("type") == "ByteLevel" and processor.get("trim_offsets"):
            return "its post-processor trims offsets (HF's token positions are not the tokens' bytes)"
        if processor.get("type") not in ("ByteLevel", "TemplateProcessing"):
            return f"its post-processor is {processor.get('type')}"
    return None


def _token_byte_lengths(backend, config: dict) -> np.ndarray:
    """Each id's length in UTF-8 bytes of the text; -1 where the vocabulary does not say."""
    # The model's vocabulary as the JSON already parsed holds it: asking the Rust tokenizer for it builds a second
    # dict (a second of a first run's start, for a 151k vocabulary).
    vocab = (config.get("model") or {}).get("vocab")
    if not isinstance(vocab, dict):
        vocab = backend.get_vocab(with_added_tokens=False)
    added = backend.get_added_tokens_decoder()
    size = max([*vocab.values(), *added.keys()], default=-1) + 1
    lengths = np.full(size, -1, dtype=np.int64)
    outside = str.maketrans("", "", "".join(_bytes_to_unicode()))  # deletes the alphabet: what is left is not in it
    for token, index in vocab.items():
        if token and not token.translate(outside):
            lengths[index] = len(token)  # one alphabet character per byte
    for index, token in added.items():
        lengths[index] = len(token.content.encode("utf-8")) or -1
    return lengths


class PendingNative:
    """fastokens' tokenizer for a JSON, not built yet: built in a background thread once `start()`ed (fastokens
    builds its tables, most of a second for a 151k vocabulary, without holding the GIL), or at first use. A
    process that never encodes (the planner of a run whose encode pool encodes) never builds it."""

    def __init__(self, tokenizer_json: str):
        self.tokenizer_json = tokenizer_json
        self._built: Future | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        with self._lock:
            if self._built is not None:
                return
            self._built = built = Future()

        def build() -> None:
            import fastokens

            try:
                built.set_result(fastokens.Tokenizer.from_json_str(self.tokenizer_json))
            except BaseException as error:  # noqa: BLE001 - raised to whoever waits for the encoder
                built.set_exception(error)

        # Not a daemon: the interpreter waits for it at exit. A daemon thread still inside fastokens when a
        # process ends (a run failing on its first bad row, before it encodes) is cancelled by the interpreter's
        # shutdown as it takes the GIL back, and that cancellation, caught in PyO3's panic guard, aborts the
        # process (glibc: "FATAL: exception not rethrown", exit 134) instead of letting it exit with its code.
        threading.Thread(target=build, name="fastokens-build").start()

    def result(self):
        self.start()
        return self._built.result()


class FastEncoder:
    """fastokens for one tokenizer, with each id's byte length; `encode` gives None for a row it cannot place."""

    name = "fastokens"

    def __init__(self, native, byte_lengths: np.ndarray, nfc: bool, cases: CheckCases | None = None):
        """`native`: fastokens' tokenizer, or one not built yet (whose JSON lets `release` drop the tables).
        `cases`: HF's answers it must give back before it encodes (a tokenizer seen for the first time): checked
        once its tables are built, wherever they are built (`verdict`, or an encode pool's processes and
        `settle`)."""
        self._native, self.byte_lengths, self.nfc = native, byte_lengths, nfc
        self._lengths = np.append(byte_lengths, -1)  # the last for every id past the table
        self._source = native.tokenizer_json if isinstance(native, PendingNative) else None
        self.cases = cases  # None once checked
        self.refused = ""  # why the check refused it: it then places no row, and HF encodes them all
        self.on_verdict: Callable[[str], None] | None = None  # told the check's verdict (prepared.py keeps it)
        self._checking, self._settling = threading.Lock(), threading.Lock()

    def verdict(self, say: bool = True) -> str:
        """The check's verdict, running it here (its tables built) if it is still to run: "" or the refusal.
        `say`: log it (an encode pool's process leaves that to the run's, which `settle`s it)."""
        if self.cases is not None:
            with self._checking:
                if self.cases is not None:
                    try:
                        refusal = self.cases.refusal(self.native, self._place)
                    except Exception as error:  # noqa: BLE001 - fastokens refuses what it does not implement
                        refusal = f"fastokens cannot load it ({type(error).__name__}: {str(error).strip()[:200]})"
                    self.settle(refusal, say)
        return self.refused

    def settle(self, refusal: str, say: bool = True) -> None:
        """The check's verdict, run here or by the encode pool's processes: "" accepted, else the refusal."""
        with self._settling:
            if self.cases is None:
                return  # settled already
            strings, self.cases, self.refused = len(self.cases.strings), None, refusal
        if refusal and say:
            logger.warning("encoder: HF tokenizers, not fastokens: %s", refusal)
        elif say:
            logger.info("encoder: fastokens (its ids equal tokenizers' on %d check strings)", strings)
        if self.on_verdict is not None:
            self.on_verdict(refusal)

    @property
    def source(self) -> str | None:
        """The tokenizer JSON fastokens was built from (its backend's `to_str()`), if kept."""
        return self._source

    @property
    def native(self):
        """fastokens' tokenizer; a pending one is built, or waited for, here."""
        if isinstance(self._native, PendingNative):
            self._native = self._native.result()
        return self._native

    def release(self) -> None:
        """Drop fastokens' tables (~170 MB for a 151k vocabulary) in a process that stops encoding (its encode pool
        does): built again if it encodes after all."""
        if self._source is not None and not isinstance(self._native, PendingNative):
            self._native = PendingNative(self._source)

    def warm(self) -> None:
        """Start building a pending tokenizer in the background, for a process about to encode."""
        if isinstance(self._native, PendingNative):
            self._native.start()

    def encode(self, texts: list[str], add_special_tokens: bool) -> list[IdsEncoding | None]:
        return self.encode_flat(texts, add_special_tokens).rows()

    def encode_flat(self, texts: list[str], add_special_tokens: bool) -> FlatPlacement:
        """Every row's ids end to end and where each token falls in the row's bytes, for the whole batch at once
        (numpy over the batch, no per-row work where the batch is ASCII). A refused encoder places none of them."""
        if self.verdict():
            return FlatPlacement.none(len(texts))
        return self._place(self.native, texts, add_special_tokens)

    def _place(self, native, texts: list[str], add_special_tokens: bool) -> FlatPlacement:
        flat, bounds = native.encode_batch_flat(texts, add_special_tokens=add_special_tokens)
        ids = np.frombuffer(flat, dtype=np.uint32)
        bounds = np.frombuffer(bounds, dtype=np.uint64).astype(np.int64)
        lengths = self._lengths[np.minimum(ids, len(self._lengths) - 1)]  # an id past the table: -1, unknown
        text = TextBytes.of(texts)
        byte_ends = running_totals(lengths)
        # The tokens cover the text byte for byte,
        placed = byte_ends[bounds[1:]] - byte_ends[bounds[:-1]] == text.row_bytes
        if (unknown := lengths <= 0).any():  # and none of them is of unknown length
            unknown_before = running_totals(unknown)
            placed &= unknown_before[bounds[1:]] == unknown_before[bounds[:-1]]
        if self.nfc and not text.ascii:  # the tokens cover the normalized text, not this one
            placed &= np.fromiter((unicodedata.is_normalized("NFC", t) for t in texts), dtype=bool, count=len(texts))
        return FlatPlacement(ids.astype(np.int32), bounds, byte_ends, placed, text)


def rebuilt_encoder(tokenizer_json: str, byte_lengths: np.ndarray, nfc: bool,
                    cases: CheckCases | None = None) -> FastEncoder:
    """The FastEncoder that another process of this install (or an earlier run, prepared.py) chose and checked for
    this tokenizer JSON (the same JSON, the same fastokens): rebuilt without checking it again, its tables built
    when it is `warm`ed or first used. With `cases`, the check that process left to this one."""
    return FastEncoder(PendingNative(tokenizer_json), byte_lengths, nfc, cases=cases)


def _check_strings(backend) -> list[str]:
    added = [token.content for token in backend.get_added_tokens_decoder().values()]
    mixed = [f"{a}{text}{a}{text[:7]} {a} x{a}\n" for text in HARD_STRINGS[:12] for a in added[:64]]
    return [*HARD_STRINGS, *mixed, " ".join(added), "".join(added)]


@dataclass(frozen=True)
class CheckCases:
    """HF `tokenizers`' answers on the check strings: the ids (without and with special tokens) and the token
    positions (without) that fastokens and the byte lengths must give back. Plain data: an encode pool's
    processes run the check where they build fastokens' tables, so that a first run builds them once."""

    strings: tuple[str, ...]
    ids: tuple[tuple[list[int], ...], tuple[list[int], ...]]
    offsets: tuple[list[tuple[int, int]], ...]

    @classmethod
    def of(cls, backend) -> CheckCases:
        strings = _check_strings(backend)
        plain, special = (backend.encode_batch(strings, add_special_tokens=add) for add in (False, True))
        return cls(tuple(strings), (tuple(list(e.ids) for e in plain), tuple(list(e.ids) for e in special)),
                   tuple([tuple(o) for o in e.offsets] for e in plain))

    def refusal(self, native, place: Callable[..., FlatPlacement]) -> str:
        """Why fastokens' tokenizer `native` (placing tokens with `place`) may not encode, or ""."""
        strings = list(self.strings)
        for add_special in (False, True):
            got = native.encode_batch(strings, add_special_tokens=add_special)
            for string, want, have in zip(strings, self.ids[add_special], got, strict=True):
                if want != list(have.ids):
                    return f"fastokens gives other ids than tokenizers for {string[:40]!r}"
        for string, want in zip(strings, self.offsets, strict=True):
            placed = place(native, [string], False).row(0)
            if placed is not None and placed.offsets != want:
                return f"token positions from byte lengths differ from tokenizers' offsets for {string[:40]!r}"
        return ""


def _fastokens_candidate(backend, text: str, build: bool = False) -> tuple[FastEncoder | None, str]:
    """fastokens for this tokenizer before its check (FastEncoder.verdict), or None and why its pieces refuse
    it. `text`: `backend.to_str()` (~0.1 s for a 151k vocabulary: serialized once per check); `build`: start
    building its tables now."""
    try:
        import fastokens  # noqa: F401 - whether it is installed; PendingNative builds with it
    except ImportError:
        return None, "fastokens is not installed (pip install 'sft-tokenize[fast]')"
    pending = PendingNative(text)
    if build:
        pending.start()  # fastokens builds outside the GIL while this thread parses the same JSON
    refusal = _byte_level_refusal(config := json.loads(text))
    if refusal:
        return None, refusal  # a build ends unused in its thread
    nfc = [p.get("type") for p in _pieces(config.get("normalizer"))] == ["NFC"]
    return FastEncoder(pending, _token_byte_lengths(backend, config), nfc, cases=CheckCases.of(backend)), ""


_chosen: dict[tuple[str, str], tuple[FastEncoder | None, str]] = {}
_choosing = threading.Lock()


def check_encoder(tokenizer: Any, requested: str) -> tuple[FastEncoder | None, str]:
    """The fast encoder for this tokenizer, or None for HF `tokenizers` with the reason it was refused (empty
    when HF was asked for); says in the log why it was refused. Chosen once per process and tokenizer (the
    planner and every worker thread share the choice)."""
    if requested not in ENCODERS:
        raise BadInput(f"--encoder must be one of {', '.join(ENCODERS)}, not {requested!r}")
    if requested == "hf":
        return None, ""
    backend = tokenizer.backend_tokenizer
    text = backend.to_str()
    key = (hashlib.sha256(text.encode()).hexdigest(), requested)
    with _choosing:
        if key not in _chosen:
            _chosen[key] = _choose(backend, text, requested)
        return _chosen[key]


def choose_encoder(tokenizer: Any, requested: str) -> FastEncoder | None:
    """The fast encoder for this tokenizer, or None for HF `tokenizers` (see check_encoder)."""
    return check_encoder(tokenizer, requested)[0]


def log_refusal(requested: str, refusal: str) -> None:
    """Say why HF `tokenizers` encodes instead of fastokens; --encoder fastokens without fastokens is an error."""
    installed = not refusal.startswith("fastokens is not installed")
    if requested == "fastokens" and not installed:
        raise BadInput(f"--encoder fastokens: {refusal}")
    log = logger.warning if installed or requested == "fastokens" else logger.info
    log("encoder: HF tokenizers, not fastokens: %s", refusal)


def _choose(backend, text: str, requested: str) -> tuple[FastEncoder | None, str]:
    encoder, refusal = _fastokens_candidate(backend, text, build=True)
    if encoder is None:
        log_refusal(requested, refusal)
        return None, refusal
    refusal = encoder.verdict()  # checked here, the verdict logged
    return (None, refusal) if refusal else (encoder, "")


def fast_candidate(tokenizer: Any, requested: str) -> tuple[FastEncoder | None, str]:
    """check_encoder's choice with the check left to the process that builds fastokens' tables (FastEncoder.verdict,
    or an encode pool's processes, which build them anyway): None and the refusal only if its pieces refuse it."""
    if requested not in ENCODERS:
        raise BadInput(f"--encoder must be one of {', '.join(ENCODERS)}, not {requested!r}")
    if requested == "hf":
        return None, ""
    backend = tokenizer.backend_tokenizer
    encoder, refusal = _fastokens_candidate(backend, backend.to_str())
    if encoder is None:
        log_refusal(requested, refusal)
    return encoder, refusal
