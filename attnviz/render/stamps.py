"""Pixel pieces of the fast renderer (:mod:`attnviz.render.fast`): where an image lies in a
drawn frame, and texts drawn once by matplotlib as alpha masks, then blended into each figure.

* :class:`_Box`: the pixel rectangle of one ``[query, key]`` image, which pixel row and column
  shows which cell, and what the frame draws over the image (composited back exactly).
* :class:`_Slot`: a text that changes from figure to figure (title, colour bar tick label),
  each string drawn once into a :class:`_Stamp`.
* :func:`_annotation_sprites`: the cell values ``"0.00"``..``"1.00"`` as alpha sprites.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.colors import to_rgb  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.text import Text  # noqa: E402
from matplotlib.transforms import IdentityTransform  # noqa: E402

from attnviz.render.layout import plain_text, text_width, wrap_text  # noqa: E402


def _canvas_rgb(fig: Figure) -> np.ndarray:
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.array(np.asarray(canvas.buffer_rgba())[..., :3])


@dataclass
class _Box:
    """Where one ``[query, key]`` image goes: a pixel rectangle and its cell layout."""

    top: int
    left: int
    bottom: int
    right: int
    num_query: int
    num_key: int
    row_index: np.ndarray  # [height] query index of each pixel row
    col_index: np.ndarray  # [width] key index of each pixel column
    ring_rows: np.ndarray  # pixels in the box the frame draws over: rows
    ring_cols: np.ndarray  # ... and columns, relative to the box
    ring_white: np.ndarray  # [len(ring), 3] uint16: the frame there, drawn over white
    ring_black: np.ndarray  # [len(ring), 3] uint16: ... over black (zeros: black overlays)
    cell_rows: np.ndarray  # [query] pixel row of each cell centre (absolute)
    cell_cols: np.ndarray  # [key] pixel column of each cell centre (absolute)
    centre_x: np.ndarray  # [key] display x of each cell centre (float)
    centre_y: np.ndarray  # [query] display y of each cell centre (float)
    edge_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.intp))
    # ^ absolute rows whose filtered bytes follow the data: cell edges, overlay edges, the
    #   first row and the row below the box (see FrameTemplate.png)


def _extent(bbox: object) -> tuple[float, float, float, float]:
    x0, y0, x1, y1 = (float(v) for v in bbox.extents)  # type: ignore[attr-defined]
    return x0, y0, x1, y1


def _box_from_extent(extent: tuple[float, float, float, float], frame: np.ndarray,
                     num_query: int, num_key: int,
                     black: np.ndarray | None = None) -> _Box:
    """Pixel layout of an ``imshow`` at display ``extent`` (x0, y0, x1, y1).

    ``frame`` is the figure drawn without the image (white beneath); ``black`` the same figure
    with the image painted black, when something not black (a white divider) is drawn over
    the image. A pixel the frame draws over with colour ``C`` and coverage ``a`` is then
    ``a C + (1 - a) image = B + (W - B) / 255 * image``.
    """
    height, width = frame.shape[:2]
    x0, y0, x1, y1 = extent
    # Agg snaps the image to whole pixels: it covers the pixels whose centres are inside.
    top = max(int(np.round(height - y1)), 0)
    bottom = min(int(np.round(height - y0)), height)
    left = max(int(np.round(x0)), 0)
    right = min(int(np.round(x1)), width)
    # Pixel centres -> cell index; rows count down from the top edge (origin="upper").
    centres_y = height - (np.arange(top, bottom) + 0.5)
    rows = np.clip(np.floor((y1 - centres_y) * num_query / max(y1 - y0, 1e-9)), 0,
                   num_query - 1).astype(np.intp)
    centres_x = np.arange(left, right) + 0.5
    cols = np.clip(np.floor((centres_x - x0) * num_key / max(x1 - x0, 1e-9)), 0,
                   num_key - 1).astype(np.intp)
    region = frame[top:bottom, left:right]
    drawn = (region != 255).any(axis=2)
    dark = None
    if black is not None:
        dark = black[top:bottom, left:right]
        drawn |= (dark != 0).any(axis=2)
    ring_rows, ring_cols = np.nonzero(drawn)
    white = region[ring_rows, ring_cols].astype(np.uint16)
    under = (dark[ring_rows, ring_cols].astype(np.uint16) if dark is not None
             else np.zeros_like(white))
    cell_x = x0 + (np.arange(num_key) + 0.5) * (x1 - x0) / num_key
    cell_y = y1 - (np.arange(num_query) + 0.5) * (y1 - y0) / num_query
    # A row inside a cell repeats the row above, also where the frame draws over it, unless
    # the overlay itself changes from that row to the next (a horizontal line).
    overlay = (region[1:] != region[:-1]).any(axis=(1, 2))
    if dark is not None:
        overlay |= (dark[1:] != dark[:-1]).any(axis=(1, 2))
    edges = np.union1d(np.flatnonzero(np.diff(rows, prepend=-1)), np.flatnonzero(overlay) + 1)
    edge_rows = np.append(top + edges, bottom).astype(np.intp)
    return _Box(top, left, bottom, right, num_query, num_key, rows, cols, ring_rows, ring_cols,
                white, under, cell_rows=(height - np.round(cell_y)).astype(np.intp),
                cell_cols=np.round(cell_x).astype(np.intp), centre_x=cell_x, centre_y=cell_y,
                edge_rows=edge_rows)


@dataclass
class _Stamp:
    """An alpha mask placed at a pixel position, blended in one colour."""

    top: int
    left: int
    alpha: np.ndarray  # [h, w] uint16, 0..255

    @property
    def rect(self) -> tuple[int, int, int, int]:
        return self.top, self.left, self.top + self.alpha.shape[0], self.left + self.alpha.shape[1]


def _blend_table() -> np.ndarray:
    """``table[(white << 16) | (alpha << 8) | value]``: black or white text over ``value``.

    One channel of one pixel: ``(value * (255 - alpha) + text * alpha + 127) // 255``.
    """
    alpha = np.arange(256, dtype=np.uint32)[:, None]
    value = np.arange(256, dtype=np.uint32)[None, :]
    dark = (value * (255 - alpha) + 127) // 255
    light = (value * (255 - alpha) + 255 * alpha + 127) // 255
    return np.stack([dark, light]).astype(np.uint8).ravel()


_BLEND = _blend_table()


def _blend(region: np.ndarray, alpha: np.ndarray, colour: np.ndarray) -> None:
    """Blend ``colour`` over ``region`` ``[..., 3]`` uint8 in place with ``alpha`` (0..255)."""
    a = alpha[..., None]
    mixed = (region.astype(np.uint16) * (255 - a) + colour.astype(np.uint16) * a + 127) // 255
    region[...] = mixed.astype(np.uint8)


def _text_masks(items: Sequence[tuple[str, tuple[float, float], Text]], *, height: int,
                dpi: float) -> list[tuple[int, int, np.ndarray]]:
    """Render each string as its ``like`` text would at its display ``anchor`` of a figure.

    ``items`` holds ``(string, anchor, like)``. All strings are drawn in one figure (one strip
    each, shifted from the real anchor by whole pixels so Agg rounds glyph positions the same
    way), then cut apart.

    Returns:
        For each item ``(top, left, alpha)``: the mask's first pixel row and column in a figure
        ``height`` pixels tall, and the alpha mask ``[h, w]`` uint16.
    """
    if not items:
        return []
    size_px = max(float(like.get_fontsize()) for _, _, like in items) * dpi / 72.0
    lines = max(t.count("\n") + 1 for t, _, _ in items)
    strip = int(np.ceil(size_px * (2.6 * lines + 1))) + 8  # the anchor is in the middle
    longest = max(text_width(line, float(like.get_fontsize())) * dpi
                  for t, _, like in items for line in t.split("\n"))
    width = int(np.ceil(longest * 1.1 + 8 * size_px)) + 8  # wider than any glyph run
    total = strip * len(items)
    fig = Figure(figsize=(width / dpi, total / dpi), dpi=dpi)
    fig.patch.set_facecolor("white")
    shifts = []
    for index, (string, (ax_x, ax_y), like) in enumerate(items):
        align = like.get_horizontalalignment()
        target_x = {"left": 4 * size_px, "right": width - 4 * size_px}.get(align, width / 2)
        shift_x = int(np.round(ax_x - target_x))
        target = total - (index * strip + strip // 2)
        shift = int(np.round(ax_y - target))
        shifts.append((shift_x, shift))
        fig.add_artist(Text(ax_x - shift_x, ax_y - shift, string, color="black",
                            fontproperties=like.get_fontproperties(),
                            horizontalalignment=align,
                            verticalalignment=like.get_verticalalignment(),
                            multialignment=getattr(like, "_multialignment", None),
                            linespacing=getattr(like, "_linespacing", None),
                            rotation=like.get_rotation(), transform=IdentityTransform(),
                            parse_math=False))
    alpha_all = 255 - _canvas_rgb(fig)[..., 0].astype(np.uint16)  # black text: R = G = B
    used_rows = np.asarray(alpha_all.any(axis=1), dtype=bool)
    masks = []
    for index, (shift_x, shift) in enumerate(shifts):
        band = alpha_all[index * strip:(index + 1) * strip]
        rows = np.flatnonzero(used_rows[index * strip:(index + 1) * strip])
        cols = np.flatnonzero(band[rows[0]:rows[-1] + 1].any(axis=0)) if len(rows) else rows
        if not len(rows):
            masks.append((0, 0, np.zeros((0, 0), dtype=np.uint16)))
            continue
        r0, r1, c0, c1 = rows[0], rows[-1] + 1, cols[0], cols[-1] + 1
        # strip pixel -> figure pixel: figure display = strip display + (shift_x, shift).
        top = height - total + index * strip + int(r0) - shift
        masks.append((top, int(c0) + shift_x, band[r0:r1, c0:c1].copy()))
    return masks


@dataclass
class _Slot:
    """A text of the figure that changes from figure to figure (title, colour bar ticks)."""

    like: Text  # a detached copy: font, alignment, rotation
    anchor: tuple[float, float]  # display position
    colour: np.ndarray  # uint8 RGB
    wrap: float = 0.0  # wrap strings to this many inches (titles), 0: as given
    suffix: str = ""  # added to every string (a grid's downsampling note)
    stamps: dict[str, _Stamp] = field(default_factory=dict)

    @classmethod
    def of(cls, text: Text, wrap: float = 0.0) -> _Slot:
        position = text.get_transform().transform(text.get_position())
        like = Text(0, 0, "", fontproperties=text.get_fontproperties().copy(),
                    horizontalalignment=text.get_horizontalalignment(),
                    verticalalignment=text.get_verticalalignment(),
                    multialignment=getattr(text, "_multialignment", None),
                    linespacing=getattr(text, "_linespacing", None),
                    rotation=text.get_rotation())
        colour = np.round(np.array(to_rgb(text.get_color())) * 255).astype(np.uint8)
        return cls(like, (float(position[0]), float(position[1])), colour, wrap)

    def shown(self, string: str) -> str:
        string += self.suffix
        if not self.wrap:
            return string
        return wrap_text(string, self.wrap, float(self.like.get_fontsize()))

    def todo(self, strings: Iterable[str]) -> list[str]:
        """The strings not drawn yet."""
        return [s for s in dict.fromkeys(strings) if s and s not in self.stamps]


def _prepare(work: Sequence[tuple[_Slot, Sequence[str]]], height: int, dpi: float) -> None:
    """Draw the strings each slot has not drawn yet: short ones (colour bar labels) in one
    matplotlib pass, long ones (titles) in another, so neither pays for the other's width."""
    jobs = [(slot, slot.shown(string), string) for slot, strings in work
            for string in slot.todo(strings)]
    for short in (True, False):
        batch = [job for job in jobs if (len(job[1]) <= 12) == short]
        if not batch:
            continue
        with plain_text():
            masks = _text_masks([(shown, slot.anchor, slot.like) for slot, shown, _ in batch],
                                height=height, dpi=dpi)
        for (slot, _, string), (top, left, alpha) in zip(batch, masks):
            slot.stamps[string] = _Stamp(top, left, alpha)


@dataclass
class _Annotations:
    """Cell-value sprites for one box: ``"0.00"``..``"1.00"`` as alpha masks."""

    fontsize: float
    anchor_row: int  # sprite pixel that sits on the cell centre
    anchor_col: int
    sprites: np.ndarray  # [n, h, w] uint8 alpha
    index: dict[str, int]
    channels: np.ndarray  # [query * key * h * w * 3] flat byte index of each sprite pixel
    rect: tuple[int, int, int, int]  # union of every sprite's rectangle
    inside: bool  # every sprite lies inside the image box (repainted for each head anyway)
    frac: tuple[float, float] = (0.0, 0.0)  # sub-pixel part of the cell centres


def _annotation_sprites(strings: Sequence[str], fontsize: float, dpi: float,
                        frac: tuple[float, float] = (0.0, 0.0)) -> tuple[np.ndarray, int, int]:
    """Alpha sprites ``[n, h, w]`` uint8 of ``strings`` drawn centred, and the centre pixel.

    ``frac`` is the sub-pixel part of the real cell centres (display x, y): the sprites are
    drawn with the same, so Agg places the glyphs as it does in the figure.
    """
    size_px = fontsize * dpi / 72.0
    cell_w = int(np.ceil(size_px * 6)) + 4
    cell_h = int(np.ceil(size_px * 3)) + 4
    per_row = 16
    rows = (len(strings) + per_row - 1) // per_row
    width, height = cell_w * per_row, cell_h * rows
    fig = Figure(figsize=(width / dpi, height / dpi), dpi=dpi)
    fig.patch.set_facecolor("white")
    for index, string in enumerate(strings):
        r, c = divmod(index, per_row)
        fig.add_artist(Text(c * cell_w + cell_w // 2 + frac[0],
                            height - (r * cell_h + cell_h // 2) + frac[1], string,
                            fontsize=fontsize, color="black", ha="center", va="center",
                            transform=IdentityTransform(), parse_math=False))
    alpha = 255 - _canvas_rgb(fig)[..., 0].astype(np.uint16)  # black text: R = G = B
    cells = alpha[:rows * cell_h, :per_row * cell_w].reshape(rows, cell_h, per_row, cell_w)
    cells = cells.transpose(0, 2, 1, 3).reshape(rows * per_row, cell_h, cell_w)[:len(strings)]
    used_rows = np.flatnonzero(cells.any(axis=(0, 2)))
    used_cols = np.flatnonzero(cells.any(axis=(0, 1)))
    if not len(used_rows):
        return np.zeros((len(strings), 1, 1), np.uint8), 0, 0
    r0, r1 = int(used_rows[0]), int(used_rows[-1]) + 1
    c0, c1 = int(used_cols[0]), int(used_cols[-1]) + 1
    centre_row, centre_col = cell_h // 2, cell_w // 2
    return (np.ascontiguousarray(cells[:, r0:r1, c0:c1], dtype=np.uint8), centre_row - r0,
            centre_col - c0)
