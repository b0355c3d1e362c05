"""Images made with Pillow for the image tests: every kind a processor treats apart (sizes below and above its
pixel limits, extreme aspect ratios, EXIF orientations, alpha, grayscale, CMYK, palettes), encoded."""

from __future__ import annotations

import io
import struct

import numpy as np
from PIL import Image

ORIENTATION = 0x0112


def pattern(width: int, height: int) -> np.ndarray:
    """Pixels that differ along both axes, so a rotation or a mirror shows in the processor's pixels."""
    y, x = np.mgrid[0:height, 0:width]
    return np.stack([(x * 7) % 256, (y * 13) % 256, (x + 3 * y) % 256], axis=-1).astype(np.uint8)


def encoded(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def exif(orientation: int) -> Image.Exif:
    tags = Image.Exif()
    tags[ORIENTATION] = orientation
    return tags


def chunk_after_pixels(png: bytes, kind: bytes) -> bytes:
    """The PNG with its `kind` chunk moved after the last IDAT, where PIL sees it only on load."""
    chunks, offset = [], 8
    while offset < len(png):
        (length,) = struct.unpack(">I", png[offset:offset + 4])
        chunks.append(png[offset:offset + 12 + length])
        offset += 12 + length
    moved = [c for c in chunks if c[4:8] == kind]
    rest = [c for c in chunks if c[4:8] != kind]
    last_idat = max(i for i, c in enumerate(rest) if c[4:8] == b"IDAT")
    return png[:8] + b"".join(rest[:last_idat + 1] + moved + rest[last_idat + 1:])


def sample_images() -> dict[str, bytes]:
    """One image of each kind the processors treat apart, encoded."""
    rgb = Image.fromarray(pattern(64, 32))
    palette = Image.fromarray(pattern(50, 30)).convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    palette.info["transparency"] = 0
    rgba = Image.fromarray(np.dstack([pattern(45, 70), np.full((70, 45), 128, np.uint8)]), "RGBA")
    return {
        "tiny": encoded(Image.fromarray(pattern(10, 10)), "PNG"),  # below every min_pixels
        "photo": encoded(Image.fromarray(pattern(300, 200)), "JPEG", quality=90),
        "wide": encoded(Image.fromarray(pattern(3000, 40)), "PNG"),  # aspect ratio 75
        "tall": encoded(Image.fromarray(pattern(40, 3000)).convert("L"), "PNG"),
        "exif6": encoded(rgb, "JPEG", exif=exif(6)),  # displayed 32 x 64
        "png-exif8": encoded(rgb, "PNG", exif=exif(8)),
        "webp-exif5": encoded(rgb, "WEBP", exif=exif(5)),
        "png-exif8-after-pixels": chunk_after_pixels(encoded(rgb, "PNG", exif=exif(8)), b"eXIf"),
        "rgba": encoded(rgba, "PNG"),
        "gray": encoded(Image.fromarray(pattern(77, 33)[..., 0], "L"), "PNG"),
        "cmyk": encoded(Image.fromarray(pattern(90, 60)).convert("CMYK"), "JPEG"),
        "palette": encoded(palette, "PNG"),
        "huge": encoded(Image.new("RGB", (4000, 3000), (20, 120, 220)), "JPEG"),  # above every max_pixels here
    }


def write_image_chats(folder, files: int = 2, rows: int = 24) -> list:
    """`files` JSONL files of `rows` chats each under `folder`, every third one text-only, the others with one
    or two of the sample images (saved beside them, named by relative paths); returns the files' paths."""
    import json
    from pathlib import Path

    folder = Path(folder)
    (folder / "img").mkdir(parents=True, exist_ok=True)
    names = ["photo", "rgba", "exif6", "cmyk", "gray", "tiny", "wide", "palette"]
    for name, data in sample_images().items():
        if name in names:
            (folder / "img" / f"{name}.bin").write_bytes(data)
    paths = []
    for f in range(files):
        lines = []
        for r in range(rows):
            n = f * rows + r
            parts = [{"type": "image", "image": f"img/{names[(n + k) % len(names)]}.bin"} for k in range(1 + n % 2)]
            user = f"Row {n}: what do you see?"
            content = user if n % 3 == 0 else [*parts, {"type": "text", "text": user}]
            messages = [{"role": "user", "content": content}, {"role": "assistant", "content": f"Answer {n}."}]
            if n % 4 == 1:
                messages += [{"role": "user", "content": "More?"}, {"role": "assistant", "content": "No more."}]
            lines.append(json.dumps({"messages": messages}))
        paths.append(folder / f"chats-{f}.jsonl")
        paths[-1].write_text("\n".join(lines) + "\n")
    return paths
