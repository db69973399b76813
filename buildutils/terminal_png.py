"""Draw a terminal screen captured by tmux as a PNG (docs/top.png, the README's ``coordkit top``).

    tmux capture-pane -e -p -N -t SESSION > screen.ansi      # -e: colours, -N: trailing spaces
    python buildutils/terminal_png.py screen.ansi docs/top.png

Each cell is drawn as the terminal shows it: its background, then its character
in DejaVu Sans Mono (bold where the escapes say so). rich (the ``top`` extra)
reads the escapes; Pillow (the ``bench`` extra, through matplotlib) draws.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont
from rich.color import Color
from rich.console import Console
from rich.terminal_theme import MONOKAI
from rich.text import Text

FONTS = Path("/usr/share/fonts/truetype/dejavu")
SIZE = 16  # points
PADDING = 12  # pixels around the screen


def rgb(color: Color | None, foreground: bool) -> tuple[int, int, int]:
    if color is None or color.is_default:
        return (MONOKAI.foreground_color if foreground else MONOKAI.background_color).rgb
    return color.get_truecolor(MONOKAI, foreground).rgb


def draw(screen: str) -> Image.Image:
    regular = ImageFont.truetype(str(FONTS / "DejaVuSansMono.ttf"), SIZE)
    bold = ImageFont.truetype(str(FONTS / "DejaVuSansMono-Bold.ttf"), SIZE)
    width = math.ceil(regular.getlength("M"))
    ascent, descent = regular.getmetrics()
    height = ascent + descent + 2
    lines = [Text.from_ansi(line) for line in screen.splitlines()]
    columns = max(len(line.plain) for line in lines)
    image = Image.new(
        "RGB",
        (columns * width + 2 * PADDING, len(lines) * height + 2 * PADDING),
        MONOKAI.background_color.rgb,
    )
    pen = ImageDraw.Draw(image)
    console = Console(color_system="256")
    for row, line in enumerate(lines):
        y = PADDING + row * height
        for column, char in enumerate(line.plain):
            style = line.get_style_at_offset(console, column)
            fg, bg = rgb(style.color, True), rgb(style.bgcolor, False)
            if style.reverse:
                fg, bg = bg, fg
            x = PADDING + column * width
            pen.rectangle((x, y, x + width - 1, y + height - 1), fill=bg)
            if not char.isspace():
                pen.text((x, y + 1), char, font=bold if style.bold else regular, fill=fg)
    return image


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("capture", type=Path, help="tmux capture-pane -e -p -N's output")
    parser.add_argument("png", type=Path)
    args = parser.parse_args()
    draw(args.capture.read_text()).save(args.png, optimize=True)


if __name__ == "__main__":
    main()
