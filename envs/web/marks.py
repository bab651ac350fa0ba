"""Set-of-marks images: element ids drawn on a screenshot at their boxes, with Pillow.

The marks are drawn on a copy of the screenshot, never in the page, so the page an agent acts on is
exactly what it was. Each mark is a box outline at the element's bounds and its bid in a filled
label at the box's top left corner (inside the box when there is no room above it), in one of a few
colours that alternate so that neighbouring marks can be told apart. Pillow is imported on first
use, so a run without set-of-marks never loads it.
"""

from __future__ import annotations

import io
from typing import Any, Mapping, Sequence

# Dark colours under white text: readable on light and dark pages alike.
MARK_COLOURS = ((214, 39, 40), (31, 119, 180), (44, 160, 44), (148, 103, 189), (255, 127, 14), (23, 190, 207))
LABEL_FONT_SIZE = 12


def _font() -> Any:
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=LABEL_FONT_SIZE)
    except (TypeError, OSError):  # a Pillow without FreeType has only its fixed bitmap font
        return ImageFont.load_default()


def draw_marks(png: bytes, marks: Sequence[Mapping[str, Any]]) -> bytes:
    """A PNG of the screenshot with each mark ({bid, x, y, width, height}, in image pixels) drawn."""
    from PIL import Image, ImageDraw

    image = Image.open(io.BytesIO(png)).convert("RGB")
    draw = ImageDraw.Draw(image)
    font = _font()
    for index, mark in enumerate(marks):
        colour = MARK_COLOURS[index % len(MARK_COLOURS)]
        left, top = int(mark["x"]), int(mark["y"])
        right, bottom = left + int(mark["width"]) - 1, top + int(mark["height"]) - 1
        draw.rectangle((left, top, right, bottom), outline=colour, width=2)
        label = str(mark["bid"])
        text_left, text_top, text_right, text_bottom = draw.textbbox((0, 0), label, font=font)
        label_width, label_height = text_right - text_left + 4, text_bottom - text_top + 2
        label_top = top - label_height if top >= label_height else top
        label_left = min(left, max(0, image.width - label_width))
        draw.rectangle((label_left, label_top, label_left + label_width - 1, label_top + label_height - 1), fill=colour)
        draw.text((label_left + 2 - text_left, label_top + 1 - text_top), label, fill=(255, 255, 255), font=font)
    output = io.BytesIO()
    image.save(output, format="PNG", compress_level=1)  # made every step: speed over size
    return output.getvalue()
