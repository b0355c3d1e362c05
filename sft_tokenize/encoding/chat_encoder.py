"""Encoding: conversations (or plain text) become input_ids and a loss mask, a batch at a time.

Rendering and probing a template live in `template.py`, finding the trained turns in `turns.py`, loading the
tokenizer in `tokenizer.py`; this module tokenizes each batch with one call, turns trained character spans into
trained tokens, and applies max_length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from sft_tokenize.chat.mask_settings import MaskSettings
from sft_tokenize.chat.skeleton import SkeletonMismatch
from sft_tokenize.chat.template import ChatTemplate, special_pattern
from sft_tokenize.chat.turns import Rendered, TurnFinder
from sft_tokenize.encoding.exact import VERIFY_ROWS, EncoderMismatch, FastEncoder
from sft_tokenize.encoding.image_runs import ImageRuns
from sft_tokenize.encoding.placement import FlatPlacement, running_totals
from sft_tokenize.encoding.token_mask import encoding_spans, flat_mask
from sft_tokenize.encoding.vision import VisionFamily
from sft_tokenize.errors import BadInput, BadRow
from sft_tokenize.sources.conversations import REASONING_FIELDS, Conversation
from sft_tokenize.sources.readers import Rows

DEFAULT_MASKS = MaskSettings()


@dataclass(frozen=True)
class Encoded:
    input_ids: np.ndarray  # int32
    loss_mask: np.ndarray  # int8, same length, 0/1


@dataclass(frozen=True)
class EncodedBatch:
    """The kept rows of a batch, concatenated (numpy, no per-row objects), and what became of each candidate
    row. An example is one candidate row, or several with --reasoning-turns expand; `origins` says whose."""

    input_ids: np.ndarray  # int32, every kept row back to back
    loss_mask: np.ndarray  # int8
    offsets: np.ndarray  # int64, kept rows + 1: row k is [offsets[k], offsets[k+1])
    outcomes: list  # per candidate: its kept row's number, a drop reason (str), or the BadRow it raised
    origins: list[int]  # per candidate: the index of the example it came from
    rows_exact: int = 0  # rows whose mask took the exact (prefix-rendering) path
    rows_expanded: int = 0  # extra rows made by --reasoning-turns expand
    rows_special_text: int = 0  # rows with a control token's text inside a message, encoded as plain text
    rows_verified: int = 0  # rows the fast encoder gave that HF encoded too, and agreed on
    rows_filled: int = 0  # rows filled from a skeleton (chat/skeleton.py) rather than rendered
    rows_checked: int = 0  # of those, rows also rendered in full and compared
    skeleton_mismatches: int = 0  # fills that differed from their full render: the batch was rendered in full
    skeletons_dropped: bool = False  # the encoder uses no skeleton any more (a mismatch, here or in another batch)
    tokens_straddling: int = 0  # trained tokens holding untrained characters too: across an edge of a trained span
    # With verify="defer": the rows to check, as (rendered rows, the fast encoder's encodings, add_special_tokens)
    unverified: tuple = ()

    @property
    def rows(self) -> int:
        return len(self.offsets) - 1

    def row(self, k: int) -> Encoded:
        a, b = self.offsets[k], self.offsets[k + 1]
        return Encoded(self.input_ids[a:b], self.loss_mask[a:b])

    def results(self) -> list[Encoded | str | BadRow]:
        """Per candidate: an Encoded row, a drop reason, or a BadRow."""
        return [self.row(o) if isinstance(o, int) else o for o in self.outcomes]


def _usual_texts(example: Conversation, texts: list[str]) -> bool:
    """Add the example's string contents and reasoning fields to `texts`; False if a message's content is not a
    string (an image row's parts), whose text this leaves out."""
    plain = True
    for message in example.messages:
        content = message.get("content")
        if type(content) is str:
            texts.append(content)
        elif content is not None:
            plain = False
        if len(message) > 2:
            texts += [value for key in REASONING_FIELDS if type(value := message.get(key)) is str]
    return plain


class _Segments:
    """A row encoded piece by piece (control-token text inside messages encoded as plain text): ids and where
    each token starts and ends, as the mask code reads them (token_mask.py)."""

    def __init__(self, ids: list[int], offsets: list[tuple[int, int]]):
        self.ids, self.offsets = ids, offsets
        bounds = np.array(offsets, dtype=np.int64).reshape(-1, 2)
        self.starts, self.ends = bounds[:, 0].copy(), bounds[:, 1].copy()


class ChatEncoder:
    """Turns conversations (or plain text) into input_ids and a loss mask, a batch at a time.

    `masks`: the run's mask settings (chat/mask_settings.py), given as they are to the turn finder; among them
    special_text, what a control token's text inside a message becomes: "literal", ordinary text (never the
    control token); "error", a row error; "keep", the control token, as apply_chat_template does."""

    def __init__(self, tokenizer, masks: MaskSettings = DEFAULT_MASKS, *, fast: FastEncoder | None = None,
                 vision: VisionFamily | None = None):
        self.tokenizer = tokenizer
        self.masks = masks
        source = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None
        self.template = ChatTemplate(source, tokenizer, masks.template_kwargs) if source else None
        self.turns = TurnFinder(self.template, masks) if self.template else None
        self.eos_id: int | None = tokenizer.eos_token_id
        self.special = special_pattern(tokenizer)
        self._literal = None  # a copy of the tokenizer that encodes control-token text as plain text
        self.fast = fast  # ids (and token positions) from a faster exact encoder; HF checks its first rows
        self.images = ImageRuns(vision) if vision is not None else None  # image rows' runs

    @property
    def backend(self):
        """HF's tokenizer: the reference, and the encoder of rows the fast one cannot place."""
        return self.tokenizer.backend_tokenizer

    def template_overhead(self) -> int:
        """Tokens the template adds around an empty exchange: max_length must leave room past it."""
        if self.template is None:
            raise BadInput("the tokenizer has no chat template: pass --chat-template FILE, or use text data")
        return self.template.overhead()

    # -- rows to render --------------------------------------------------------------------------------------

    def _render_rows(self, example: Conversation | str, literal: bool) -> list[Rendered | str | BadRow]:
        """What one example becomes before tokenizing: rows to encode, or a drop reason, or a BadRow."""
        if isinstance(example, str):
            if self.masks.train_on != "all":
                return [BadRow("text_needs_train_on_all", "text rows train on every token: use train_on='all'")]
            return [Rendered(example, [(0, len(example))], token_rule="text")]
        if self.template is None:
            raise BadInput("the tokenizer has no chat template: pass --chat-template FILE, or use text data")
        try:
            if example.image_grids and self.images is None:
                raise BadRow("image_without_processor", "the row has images: tokenize it with --processor")
            if self.masks.train_on == "all":
                rows = [self.turns.whole(example, with_fields=literal)]
            else:
                targets = self.turns.targets(example)
                if not targets:
                    return ["no_assistant_turn"]
                rows = self.turns.find(example, targets, fields=literal)
            if example.image_grids:
                rows = [self.images.expand(row, example.image_grids) for row in rows]
            return rows
        except BadRow as bad:
            return [bad]
        except SkeletonMismatch:
            raise
        except Exception as error:  # the template raised (e.g. roles must alternate)
            detail = (str(error).strip().splitlines() or [type(error).__name__])[0]
            return [BadRow("template_error", f"chat template failed: {detail}")]

    def _may_hold_control_text(self, examples: Sequence[Conversation | str | BadRow]) -> bool:
        """Whether a row of the batch may hold a control token's text: one search over the usual fields of them
        all (no control token holds NUL); False only where none does, True where a row is to be looked at."""
        special = self.special
        if special is None:
            return False
        texts: list[str] = []
        for example in examples:
            if isinstance(example, BadRow):
                continue
            if isinstance(example, str):
                texts.append(example)
                continue
            if not _usual_texts(example, texts):
                return True  # parts: _control_text walks them
        return special.search("\0".join(texts)) is not None

    def _control_text(self, example: Conversation | str) -> tuple[str, str] | None:
        """(where, token) of the first control token's text inside the example's own text, if any."""
        special = self.special
        if special is None:
            return None
        if isinstance(example, str):
            found = special.search(example)
            return ("text", found.group()) if found else None
        # One search over the usual fields joined (no control token holds NUL); the walk below says where.
        texts: list[str] = []
        if _usual_texts(example, texts) and not special.search("\0".join(texts)):
            return None
        for i, message in enumerate(example.messages):
            for key in ("content", *REASONING_FIELDS):
                value = message.get(key)
                found = special.search(value) if isinstance(value, str) else None
                if found:
                    return f"messages[{i}].{key}", found.group()
            if isinstance(message.get("content"), list):  # an image row's parts
                for k, part in enumerate(message["content"]):
                    text = part.get("text") if part.get("type") == "text" else None
                    found = special.search(text) if isinstance(text, str) else None
                    if found:
                        return f"messages[{i}].content[{k}].text", found.group()
        return None

    # -- tokens ----------------------------------------------------------------------------------------------

    def encode_batch(self, examples: Sequence[Conversation | str | BadRow] | Rows, verify_rows: int = VERIFY_ROWS,
                     defer_verify: bool = False) -> EncodedBatch:
        """Render and mask every example, then one tokenizer call for the batch's ordinary rows; HF encodes the
        first `verify_rows` rows the fast encoder gives as well, and they must agree. `defer_verify`: those rows
        come back in `unverified`, for `verify` in another process (the encode pool's processes need no HF
        tokenizer then). Read rows (`Rows`) become examples here; an example that is a BadRow is that row's
        outcome."""
        if isinstance(examples, Rows):
            examples = examples.examples()
        try:
            return self._encode_batch(examples, verify_rows, defer_verify)
        except SkeletonMismatch:
            # A filled row differed from its full render: the template's skeletons are dropped (TurnFinder), and
            # every row of the batch is rendered again in full. Never raised: the caller sees it counted.
            batch = self._encode_batch(examples, verify_rows, defer_verify)
            return replace(batch, skeleton_mismatches=batch.skeleton_mismatches + 1)

    def _encode_batch(self, examples: Sequence[Conversation | str | BadRow], verify_rows: int,
                      defer_verify: bool) -> EncodedBatch:
        counts = dict.fromkeys(("rows_exact", "rows_expanded", "rows_special_text", "rows_filled", "rows_checked"), 0)
        outcomes: list[int | str | BadRow | None] = []
        origins: list[int] = []
        rows: list[tuple[int, Rendered, bool]] = []  # (candidate, row, encode control-token text literally)
        look = self.masks.special_text != "keep" and self._may_hold_control_text(examples)
        for index, example in enumerate(examples):
            if isinstance(example, BadRow):
                outcomes.append(example)
                origins.append(index)
                continue
            literal, control = False, None
            if look:
                control = self._control_text(example)
                if control and self.masks.special_text == "error":
                    where, token = control
                    outcomes.append(BadRow("control_token_in_text",
                                           f"{where} holds the control token {token!r} as text (--special-text "
                                           "error); use --special-text literal to encode it as plain text"))
                    origins.append(index)
                    continue
                literal = control is not None
            try:
                results = self._render_rows(example, literal)
            except SkeletonMismatch as mismatch:
                raise SkeletonMismatch(str(mismatch), index) from None
            for result in results:
                origins.append(index)
                outcomes.append(None)
                if isinstance(result, Rendered) and literal and not result.fields and result.token_rule != "text":
                    # Its control-token text cannot be told from the template's: the row's own outcome.
                    where, token = control
                    result = BadRow("control_token_in_text", f"{where} holds the control token {token!r} as text, "
                                                             "and this chat template's turns cannot be located field "
                                                             "by field to encode it as plain text: use --special-text "
                                                             "keep or error")
                if isinstance(result, Rendered):
                    rows.append((len(outcomes) - 1, result, literal))
                    counts["rows_exact"] += result.exact
                    counts["rows_expanded"] += result.expanded
                    counts["rows_special_text"] += literal
                    counts["rows_filled"] += result.filled
                    counts["rows_checked"] += result.checked
                else:
                    outcomes[-1] = result
        unverified: list[tuple] = []
        encodings, verified, flat = self._encode(rows, verify_rows, unverified if defer_verify else None)
        if flat is not None and len(flat[0]) == len(rows) and not any(r.append_eos for _, r, _ in rows):
            (loss_mask, straddling), input_ids, starts = self._flat_mask(rows, *flat), flat[1].ids, flat[1].bounds
        else:
            input_ids, loss_mask, starts, straddling = self._assemble(rows, encodings, flat)
        if self.images is not None:
            loss_mask[self.images.vision_mask(input_ids)] = 0
        batch = self._apply_max_length(outcomes, origins, [c for c, _, _ in rows], input_ids, loss_mask, starts,
                                       straddling)
        skeletons = self.turns.skeletons if self.turns is not None else None
        return replace(batch, **counts, rows_verified=verified, unverified=tuple(unverified),
                       skeletons_dropped=skeletons is not None and skeletons.dropped)

    def _assemble(self, rows: list[tuple[int, Rendered, bool]], encodings: list[Any],
                  flat: tuple[list[int], FlatPlacement] | None
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Every row's ids and mask end to end: the flat placement's rows sliced, the others one by one; and the
        tokens trained for straddling an edge (positions in those ids)."""
        flat_mask, in_flat_straddling = self._flat_mask(rows, *flat) if flat is not None else (None, None)
        straddling, position = [], 0
        in_flat = {k: j for j, k in enumerate(flat[0])} if flat is not None else {}
        ids_parts, mask_parts = [], []
        for k, ((_, rendered, _), enc) in enumerate(zip(rows, encodings, strict=True)):
            j = in_flat.get(k)
            if j is not None:
                a, b = flat[1].bounds[j], flat[1].bounds[j + 1]
                ids_parts.append(flat[1].ids[a:b])
                mask_parts.append(flat_mask[a:b])
                low, high = np.searchsorted(in_flat_straddling, (a, b))  # sorted
                straddling += (in_flat_straddling[low:high] - a + position).tolist()
                position += b - a
                if rendered.append_eos and self.eos_id is not None:  # no end-of-turn token after the last turn
                    ids_parts.append(np.array([self.eos_id], dtype=np.int32))
                    mask_parts.append(np.ones(1, dtype=np.int8))
                    position += 1
                continue
            ids = list(enc.ids)
            if rendered.token_rule == "text" and self.eos_id is not None and (not ids or ids[-1] != self.eos_id):
                ids.append(self.eos_id)  # plain text: BOS as the tokenizer adds it, then EOS
            elif rendered.append_eos and self.eos_id is not None:
                ids.append(self.eos_id)  # the template wrote no end-of-turn token after the last turn
            mask = np.zeros(len(ids), dtype=np.int8)
            spans, across = self._token_edges(rendered, enc, len(ids))
            straddling += [position + token for token in across]
            position += len(ids)
            for first, stop in spans:
                mask[first:stop] = 1
            ids_parts.append(np.asarray(ids, dtype=np.int32))
            mask_parts.append(mask)
        lengths = np.fromiter(map(len, ids_parts), dtype=np.int64, count=len(ids_parts))
        per_row = np.zeros(len(rows) + 1, dtype=np.int64)
        owners = np.repeat(np.arange(len(rows)), [2 if (k in in_flat and rows[k][1].append_eos and
                                                       self.eos_id is not None) else 1 for k in range(len(rows))])
        np.add.at(per_row, owners + 1, lengths)
        empty = (np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int8))
        return (np.concatenate(ids_parts) if ids_parts else empty[0], np.concatenate(mask_parts) if mask_parts
                else empty[1], np.cumsum(per_row), np.asarray(straddling, dtype=np.int64))

    @staticmethod
    def _flat_mask(rows: list[tuple[int, Rendered, bool]], chosen: list[int], placed: FlatPlacement
                   ) -> tuple[np.ndarray, np.ndarray]:
        """The loss mask of the flat placement's rows, for all rows at once (token_mask.py), and the tokens
        trained for straddling an edge (positions in the placement's ids)."""
        return flat_mask([rows[k][1].regions for k in chosen], placed)

    def verify(self, batch: EncodedBatch) -> EncodedBatch:
        """Check the rows another process's encoder deferred (see encode_batch) against HF's."""
        for rendered, placed, add_special in batch.unverified:
            self._verify(rendered, placed, add_special)
        return replace(batch, unverified=())

    def _token_spans(self, rendered: Rendered, enc, length: int) -> list[tuple[int, int]]:
        """Token index ranges [first, stop) trained for a row's character regions."""
        return self._token_edges(rendered, enc, length)[0]

    def _token_edges(self, rendered: Rendered, enc, length: int) -> tuple[list[tuple[int, int]], list[int]]:
        """Token index ranges [first, stop) trained for a row's character regions (a token holding any trained
        character is trained: token_mask.py), and how many of them straddle an edge."""
        if rendered.token_rule == "text":
            return [(0, length)], []
        spans, straddling = encoding_spans(enc, rendered.regions, len(rendered.text))
        if rendered.append_eos and self.eos_id is not None:
            spans.append((len(enc.ids), len(enc.ids) + 1))
        return spans, straddling

    def _apply_max_length(self, outcomes, origins, candidates, input_ids, loss_mask, starts, straddling
                          ) -> EncodedBatch:
        """Truncate or drop rows over max_length, drop rows left with no trained token; `straddling`: the
        positions of tokens trained for straddling an edge, counted where kept. Per row only where a row is cut
        or dropped: numpy over the batch otherwise."""
        lengths = np.diff(starts)
        keep = lengths if self.masks.max_length is None else np.minimum(lengths, self.masks.max_length)
        cut = keep < lengths
        if cut.any():
            trained_before = running_totals(loss_mask)
            trained = trained_before[starts[:-1] + keep] - trained_before[starts[:-1]]
        else:  # each row's trained tokens, summed where rows have tokens (rows without any have none)
            trained = np.zeros(len(lengths), dtype=np.int64)
            if (filled := lengths > 0).any():
                trained[filled] = np.add.reduceat(loss_mask, starts[:-1][filled], dtype=np.int64)
        dropped: dict[int, str] = {}
        for row in np.flatnonzero(cut).tolist():
            if self.masks.truncation == "drop":
                dropped[row] = "too_long"
            elif self.images is not None and self.images.cuts_a_run(input_ids[starts[row]:starts[row] + keep[row]]):
                dropped[row] = "image_truncated"  # an image's run is never cut: its pixels need all of it
        for row in np.flatnonzero(trained == 0).tolist():
            dropped.setdefault(row, "truncated_away" if cut[row] else "no_trained_tokens")
        if not dropped and not cut.any():  # every row kept whole
            for row, candidate in enumerate(candidates):
                outcomes[candidate] = row
            return EncodedBatch(input_ids, loss_mask, starts, outcomes, origins, tokens_straddling=len(straddling))
        kept = np.ones(len(lengths), dtype=bool)
        kept[list(dropped)] = False
        for row, (candidate, number) in enumerate(zip(candidates, (np.cumsum(kept) - 1).tolist(), strict=True)):
            outcomes[candidate] = dropped.get(row, number)
        taken = np.where(kept, keep, 0)  # each row's tokens kept: its first `taken`
        selection = np.arange(len(input_ids)) - np.repeat(starts[:-1], lengths) < np.repeat(taken, lengths)
        return EncodedBatch(input_ids[selection], loss_mask[selection], running_totals(taken[kept]), outcomes, origins,
                            tokens_straddling=int(np.count_nonzero(selection[straddling])))

    def _encode(self, rows: list[tuple[int, Rendered, bool]], verify_rows: int, deferred: list[tuple] | None = None
                ) -> tuple[list[Any], int, tuple[list[int], FlatPlacement] | None]:
        """One batch call for ordinary rows; rows with control-token text in them are encoded in pieces. Also
        the number of rows verified (see encode_batch), or put in `deferred` to be verified elsewhere, and the
        chat rows the fast encoder placed, as (their indices in `rows`, the placement), whose encodings are None."""
        encodings: list[Any] = [None] * len(rows)
        verified, flat = 0, None
        for add_special in (False, True):  # rendered chats carry their own special tokens; text rows do not
            chosen = [k for k, (_, rendered, literal) in enumerate(rows)
                      if not literal and (rendered.token_rule == "text") == add_special]
            if chosen and self.fast is not None and not self.fast.verdict():  # refused by its check: HF's
                placement = self.fast.encode_flat([rows[k][1].text for k in chosen], add_special_tokens=add_special)
                verify = min(max(verify_rows - verified, 0), len(chosen))
                checked = ([rows[k][1] for k in chosen[:verify]], [placement.row(j) for j in range(verify)],
                           add_special)
                if deferred is None:
                    self._verify(*checked)
                elif checked[0]:
                    deferred.append(checked)
                verified += verify
                if not add_special and all(rows[k][1].token_rule == "spans" for k in chosen):
                    flat = ([k for j, k in enumerate(chosen) if placement.placed[j]],
                            placement.kept())
                else:
                    for k, encoding in zip(chosen, placement.rows(), strict=True):
                        encodings[k] = encoding
                placed = set(flat[0]) if flat is not None and not add_special else set()
                chosen = [k for k in chosen if encodings[k] is None and k not in placed]  # rows it could not place
            if chosen:
                batch = self.backend.encode_batch([rows[k][1].text for k in chosen], add_special_tokens=add_special)
                for k, enc in zip(chosen, batch, strict=True):
                    encodings[k] = enc
        for k, (_, rendered, literal) in enumerate(rows):
            if literal:
                encodings[k] = self._encode_literally(rendered)
        return encodings, verified, flat

    def _verify(self, rendered: list[Rendered], placed: list, add_special: bool) -> None:
        """The first rows the fast encoder gives: the same ids and trained spans as HF's, or a loud failure."""
        if not rendered:
            return
        reference = self.backend.encode_batch([r.text for r in rendered], add_special_tokens=add_special)
        for k, (row, fast, hf) in enumerate(zip(rendered, placed, reference, strict=True)):
            if fast is None:
                continue
            n = len(hf.ids)
            if fast.ids != list(hf.ids) or self._token_spans(row, fast, n) != self._token_spans(row, hf, n):
                raise EncoderMismatch(f"{self.fast.name} and HF tokenizers disagree on row {k} of this batch "
                                      f"({row.text[:60]!r}...): run with --encoder hf, and report the row")

    def _literal_tokenizer(self):
        if self._literal is None:
            from tokenizers import Tokenizer

            self._literal = Tokenizer.from_str(self.backend.to_str())
            self._literal.encode_special_tokens = True
        return self._literal

    def _encode_literally(self, rendered: Rendered) -> _Segments:
        """The template's own text as usual, and each message field holding control-token text as plain text."""
        literal = self._literal_tokenizer()
        if rendered.token_rule == "text":
            enc = literal.encode(rendered.text, add_special_tokens=True)
            return _Segments(list(enc.ids), list(enc.offsets))
        ids, offsets, pieces, position = [], [], [], 0
        for _, start, end in sorted(rendered.fields, key=lambda field: field[1]):
            if start >= position:
                pieces.append((position, start, self.backend))
                pieces.append((start, end, literal))
                position = end
        pieces.append((position, len(rendered.text), self.backend))
        for start, end, tokenizer in pieces:
            if end <= start:
                continue
            enc = tokenizer.encode(rendered.text[start:end], add_special_tokens=False)
            ids += enc.ids
            offsets += [(a + start, b + start) for a, b in enc.offsets]
        return _Segments(ids, offsets)
