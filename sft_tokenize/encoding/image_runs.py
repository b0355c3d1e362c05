"""Image rows: each image's marker in the rendered text becomes the run of tokens its processor puts there.

The chat template renders an image part as its family's marker (`<|vision_start|><|image_pad|><|vision_end|>`
for Qwen-VL, `<start_of_image>` for Gemma 3). Here the k-th marker of a rendered row is replaced, in the
text and before tokenizing, by the family's margins and the k-th image's run of special tokens, as the
processor replaces it before it tokenizes: the row's ids are then the processor's by construction, margins
that tokenize together with the text around them included.

The trained spans move with the text and lose every image's span: a vision token is never trained, and an
image inside an assistant turn leaves the rest of that turn trained as it is without it (the ids of the
vision tokens are also masked after tokenizing, `vision_mask`). A cut by max_length inside a run is found by
`cuts_a_run` (the run's first and last ids do not pair up in the kept prefix).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from sft_tokenize.chat.turns import Rendered
from sft_tokenize.encoding.vision import VisionFamily
from sft_tokenize.errors import BadRow


class ImageRuns:
    """One vision family's runs in a row's text: what replaces a marker, and what is never trained."""

    def __init__(self, vision: VisionFamily) -> None:
        self.vision = vision
        self._marker = re.compile(re.escape(vision.image_marker))
        self._vision_ids = np.array(sorted(vision.vision_token_ids), dtype=np.int32)
        probe = vision.run(vision.probe_grid)
        self.run_bounds = (probe[0], probe[-1])

    def expand(self, rendered: Rendered, grids: Sequence[Sequence[int]]) -> Rendered:
        """The row with each image's marker replaced by its run (see the module docstring)."""
        found = list(self._marker.finditer(rendered.text))
        if len(found) != len(grids):
            raise BadRow("image_count", f"the chat template rendered {len(found)} image markers "
                                        f"({self.vision.image_marker!r}) for the row's {len(grids)} images")
        pieces, moves, spans, position, shift = [], [], [], 0, 0
        for match, grid in zip(found, grids, strict=True):
            run = self.vision.run_text(grid)
            pieces += [rendered.text[position:match.start()], run]
            start = match.start() + shift
            spans.append((start, start + len(run)))
            moves.append((match.start(), match.end(), start, len(run) - (match.end() - match.start())))
            shift += moves[-1][3]
            position = match.end()
        pieces.append(rendered.text[position:])

        def moved(p: int) -> int:
            """A position of the rendered text in the expanded one."""
            shift = 0
            for old_start, old_end, new_start, delta in moves:
                if p < old_end:
                    return new_start + (p - old_start) if p > old_start else p + shift
                shift += delta
            return p + shift

        regions = []
        for a, b in rendered.regions:
            a, b = moved(a), moved(b)
            for s, e in spans:  # the image spans inside a trained span are cut out of it
                if s >= b or e <= a:
                    continue
                if s > a:
                    regions.append((a, s))
                a = max(a, e)
            if b > a:
                regions.append((a, b))
        fields = tuple((m, moved(a), moved(b)) for m, a, b in rendered.fields)
        return replace(rendered, text="".join(pieces), regions=regions, fields=fields)

    def vision_mask(self, input_ids: np.ndarray) -> np.ndarray:
        """Where the ids are vision tokens (never trained)."""
        return np.isin(input_ids, self._vision_ids)

    def cuts_a_run(self, kept: np.ndarray) -> bool:
        """Whether a row's kept prefix ends inside an image's run."""
        first, last = self.run_bounds
        return int(np.count_nonzero(kept == first)) != int(np.count_nonzero(kept == last))
