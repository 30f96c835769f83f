"""Fast raster figures: draw a figure's frame once, then paint each head's matrix into it.

Drawing a labelled heatmap with matplotlib costs about 0.5 s, almost all of it in the tick
labels, axis labels, colour bar and title, and for one text those are the same for every head.
A :class:`FrameTemplate` draws that frame once (with the very figure code of
:func:`attnviz.render.heatmap.draw_head` or :func:`~attnviz.render.heatmap.draw_grid`, its images
hidden) and remembers where each image lies in pixels. Figures are laid out by hand (no layout
engine), so one frame serves every figure of its shape. Each head then costs:

* colour-mapping the ``[query, key]`` matrix through the lookup table of the colour map and
  the colour scale (:meth:`~attnviz.render.heatmap.ResolvedScale.colours`, the same function
  ``draw_head`` paints with);
* a nearest-neighbour upscale into the image's pixel box; whatever the frame draws over the
  image (spines, panel borders, a sentence pair's white divider) is composited back exactly,
  from the frame drawn over white and, where needed, over black;
* the texts that change from figure to figure: the title and the colour bar's tick labels
  (their values follow the data's maximum), drawn once per string by matplotlib into alpha
  masks and blended;
* for annotated heads, the cell values ``"0.00"``..``"1.00"``, drawn once per string as alpha
  sprites and blended in white or black with the same contrast rule as ``draw_head``;
* a PNG encoder written for these images: the PNG "Up" filter turns every pixel row repeated
  by the nearest-neighbour upscale into zeros, and runs of zero rows are emitted as
  precompressed deflate blocks instead of going through zlib (level 1) again.

The result looks like ``attnviz heatmap --layer L --head H`` (same layout, fonts, colours; text
may sit one pixel apart) at a few per cent of the cost.
"""

from __future__ import annotations

import dataclasses
import struct
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.colors import to_rgb  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.text import Text  # noqa: E402
from matplotlib.transforms import IdentityTransform  # noqa: E402

from attnviz.render import heatmap  # noqa: E402
from attnviz.render.heatmap import (  # noqa: E402, F401  (re-exported)
    ColourScale,
    ColourTable,
    colour_table,
    figure_bytes,
    plain_text,
)

PNG_LEVEL = 1  # zlib level: 1 is ~3x faster than 6 for ~1.5x the bytes on these images


# --------------------------------------------------------------------------- PNG
def _chunk(kind: bytes, data: bytes) -> bytes:
    return (struct.pack(">I", len(data)) + kind + data
            + struct.pack(">I", zlib.crc32(data, zlib.crc32(kind)) & 0xFFFFFFFF))


class PngWriter:
    """Encodes ``[height, width, 3]`` uint8 RGB images of one size as PNG bytes.

    Every row uses the "Up" filter (row minus the row above), so a row repeated by a nearest
    upscale becomes zeros. Such zero rows are not fed to zlib at all: one zero row is
    compressed once, into self-contained deflate blocks, and repeated; zlib (level 1) only
    sees the other rows, each run ended with a full flush so the pieces join into one valid
    stream. A full flush makes a run's compressed bytes depend on that run alone. Runs also
    break at fixed ``breaks`` (a figure's cell edges), so how an image is cut into runs
    depends on that image alone; told which rows may have changed since the last image
    (:meth:`encode`'s ``changed``), the writer reuses the compressed bytes of the runs that
    did not (the labels beside and under a heatmap, between the rows where its cells change).
    The bytes are the same as a fresh writer with the same ``breaks`` writes: deterministic
    whatever came before. The filter buffer is kept between calls.
    """

    def __init__(self, height: int, width: int, dpi: float = heatmap.DEFAULT_DPI,
                 breaks: Sequence[int] | np.ndarray = ()) -> None:
        self.height, self.width = height, width
        cuts = np.asarray(sorted({int(b) for b in breaks}), dtype=np.intp)
        self._breaks = cuts[(cuts > 0) & (cuts < height)]
        self._raw = np.empty((height, width * 3 + 1), dtype=np.uint8)
        self._raw[:, 0] = 2  # filter type Up
        self._raw[0, 0] = 0  # the first row has no row above: filter None
        per_metre = round(dpi / 0.0254)
        self._head = (b"\x89PNG\r\n\x1a\n"
                      + _chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
                      + _chunk(b"pHYs", struct.pack(">IIB", per_metre, per_metre, 1))
                      + _chunk(b"tEXt", b"Software\x00attnviz"))
        zero_row = bytes([2]) + bytes(width * 3)
        packer = zlib.compressobj(PNG_LEVEL, zlib.DEFLATED, -15)
        self._zero_row = packer.compress(zero_row) + packer.flush(zlib.Z_FULL_FLUSH)
        self._runs: dict[tuple[int, int], bytes] = {}  # the last image's runs: rows -> deflated

    def encode(self, image: np.ndarray, changed: np.ndarray | None = None) -> bytes:
        """PNG bytes of ``image`` ``[height, width, 3]`` uint8.

        Args:
            image: the pixels.
            changed: ``[height]`` bool, the rows whose filtered bytes (the row minus the row
                above) may differ from the last image this writer encoded; every row not
                marked must be equal. ``None``: every row may differ (nothing is reused).
        """
        if image.shape != (self.height, self.width, 3) or image.dtype != np.uint8:
            raise ValueError(f"expected a ({self.height}, {self.width}, 3) uint8 image, "
                             f"got {image.shape} {image.dtype}")
        flat = image.reshape(self.height, self.width * 3)
        raw = self._raw
        raw[0, 1:] = flat[0]
        np.subtract(flat[1:], flat[:-1], out=raw[1:, 1:])  # wraps modulo 256, as PNG wants
        zero = np.asarray(~raw[:, 1:].any(axis=1), dtype=bool)
        zero[0] = False
        edges = np.union1d(np.flatnonzero(np.diff(zero.view(np.int8))) + 1, self._breaks)
        starts = [0, *edges.tolist()]
        ends = [*edges.tolist(), self.height]
        row_bytes = raw.shape[1]
        data = raw.data.cast("B")
        packer = zlib.compressobj(PNG_LEVEL, zlib.DEFLATED, -15)  # raw deflate
        pieces = [b"\x78\x01"]  # zlib header: deflate, 32K window, fastest
        check_a, check_b = 1, 0  # Adler-32 of everything, kept by hand for the zero rows
        last, runs = self._runs, {}
        for start, end in zip(starts, ends):
            if zero[start]:
                rows = end - start
                pieces.append(self._zero_row * rows)
                # Each row adds 2 (the filter byte) to A, then row_bytes times A to B.
                check_b = (check_b + row_bytes * (rows * check_a + rows * (rows + 1))) % 65521
                check_a = (check_a + 2 * rows) % 65521
                continue
            piece = data[start * row_bytes:end * row_bytes]
            value = zlib.adler32(piece, (check_b << 16) | check_a)
            check_a, check_b = value & 0xFFFF, value >> 16
            deflated = (None if changed is None or changed[start:end].any()
                        else last.get((start, end)))
            if deflated is None:
                deflated = packer.compress(piece) + packer.flush(zlib.Z_FULL_FLUSH)
            runs[(start, end)] = deflated
            pieces.append(deflated)
        self._runs = runs
        pieces.append(packer.flush(zlib.Z_FINISH))
        pieces.append(struct.pack(">I", (check_b << 16) | check_a))
        return self._head + _chunk(b"IDAT", b"".join(pieces)) + _chunk(b"IEND", b"")


def encode_png(image: np.ndarray, dpi: float = heatmap.DEFAULT_DPI) -> bytes:
    """PNG bytes of one ``[height, width, 3]`` uint8 RGB image."""
    return PngWriter(image.shape[0], image.shape[1], dpi).encode(np.ascontiguousarray(image))


# --------------------------------------------------------------------------- figure pieces
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
    longest = max(heatmap.text_width(line, float(like.get_fontsize())) * dpi
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
        return heatmap.wrap_text(string, self.wrap, float(self.like.get_fontsize()))

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



# --------------------------------------------------------------------------- templates
@dataclass
class FrameTemplate:
    """A figure drawn once without its images; :meth:`compose` paints one figure's data in.

    Attributes:
        frame: ``[height, width, 3]`` uint8 pixels of the figure without images or changing
            texts (over white).
        boxes: the image boxes, in the order :meth:`compose` takes matrices.
        colours: the colour map's lookup tables.
        dpi: resolution the frame was drawn at.
        scale: the colour scale; an ``auto`` top follows each figure's data.
    """

    frame: np.ndarray
    boxes: list[_Box]
    colours: ColourTable
    dpi: float
    scale: ColourScale = field(default_factory=ColourScale)
    extents: list[tuple[float, float, float, float]] = field(default_factory=list)
    uses_tokens: bool = True
    strings: frozenset[str] = frozenset()
    title: _Slot | None = None
    ticks: list[_Slot] = field(default_factory=list)
    annotations: _Annotations | None = None
    black: np.ndarray | None = None  # the frame over black images, when not all overlays are
    _buffer: np.ndarray | None = None
    _dirty: list[tuple[int, int, int, int]] = field(default_factory=list)
    _writer: PngWriter | None = None
    _changed: np.ndarray | None = None  # rows changed since the last PNG (see png)

    @property
    def size(self) -> tuple[int, int]:
        """``(width, height)`` in pixels."""
        return int(self.frame.shape[1]), int(self.frame.shape[0])

    def for_tokens(self, num_tokens: int) -> FrameTemplate:
        """The same frame for ``[num_tokens, num_tokens]`` matrices (grids without labels).

        Shares the frame and the drawn texts; has its own pixel buffer.
        """
        if not self.extents or self.annotations is not None:
            raise ValueError("only grid templates can be reused for another token count")
        boxes = [_box_from_extent(extent, self.frame, num_tokens, num_tokens, self.black)
                 for extent in self.extents]
        return dataclasses.replace(self, boxes=boxes, _buffer=None, _dirty=[], _writer=None)

    def prepare(self, titles: Sequence[str] = (),
                figures: Iterable[Sequence[np.ndarray]] = ()) -> None:
        """Draw these titles and the colour bar labels of these figures (each a sequence of
        ``[query, key]`` matrices) now, in one matplotlib pass; others are drawn on demand."""
        labels = [self.scale.resolve(list(matrices)).tick_labels() for matrices in figures]
        work: list[tuple[_Slot, Sequence[str]]] = []
        if self.title is not None and titles:
            work.append((self.title, titles))
        for number, slot in enumerate(self.ticks):
            work.append((slot, [row[number] for row in labels if number < len(row)]))
        _prepare(work, self.frame.shape[0], self.dpi)

    def compose(self, matrices: Sequence[np.ndarray], title: str = "") -> np.ndarray:
        """Pixels of the figure showing ``matrices`` (one ``[query, key]`` per box).

        The returned array is reused by the next call: encode or copy it first.
        """
        if len(matrices) != len(self.boxes):
            raise ValueError(f"expected {len(self.boxes)} matrices, got {len(matrices)}")
        if self._buffer is None:
            self._buffer = self.frame.copy()
        out = self._buffer
        if self._changed is None:
            self._changed = np.zeros(out.shape[0], dtype=bool)
        changed = self._changed
        for top, left, bottom, right in self._dirty:  # undo the last texts and sprites
            out[top:bottom, left:right] = self.frame[top:bottom, left:right]
            changed[top:bottom + 1] = True
        self._dirty = []
        for box in self.boxes:  # inside a box only these rows can differ from the last image
            changed[box.edge_rows[box.edge_rows < len(changed)]] = True
        arrays = [np.asarray(m, dtype=np.float32) for m in matrices]
        resolved = self.scale.resolve(arrays)
        for box, matrix in zip(self.boxes, arrays):
            self._paint(out, box, matrix, resolved)
        height = self.frame.shape[0]
        for slot, text in zip(self.ticks, resolved.tick_labels()):
            self._stamp(out, slot, text, height)
        if title and self.title is not None:
            self._stamp(out, self.title, title, height)
        for top, _, bottom, _ in self._dirty:  # the new texts and sprites
            changed[top:bottom + 1] = True
        return out

    def png(self, matrices: Sequence[np.ndarray], title: str = "") -> bytes:
        """PNG bytes of :meth:`compose`."""
        image = self.compose(matrices, title)
        if self._writer is None:
            breaks: np.ndarray = np.concatenate(
                [np.concatenate([b.edge_rows, b.edge_rows + 1]) for b in self.boxes]
                + [np.zeros(0, np.intp)])
            self._writer = PngWriter(image.shape[0], image.shape[1], self.dpi, breaks)
        # The rows that can differ from the last PNG: box edges, texts, cell values (every
        # compose since then adds to them).
        changed, self._changed = self._changed, None
        return self._writer.encode(image, changed)

    def _stamp(self, out: np.ndarray, slot: _Slot, text: str, height: int) -> None:
        if text not in slot.stamps:
            _prepare([(slot, [text])], height, self.dpi)
        stamp = slot.stamps.get(text)
        if stamp is None or not stamp.alpha.size:
            return
        top, left, bottom, right = self._clip(stamp.rect)
        if bottom > top and right > left:
            alpha = stamp.alpha[top - stamp.top:bottom - stamp.top,
                                left - stamp.left:right - stamp.left]
            _blend(out[top:bottom, left:right], alpha, slot.colour)
            self._dirty.append((top, left, bottom, right))

    def _clip(self, rect: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
        height, width = self.frame.shape[:2]
        top, left, bottom, right = rect
        return max(top, 0), max(left, 0), min(bottom, height), min(right, width)

    def _paint(self, out: np.ndarray, box: _Box, matrix: np.ndarray,
               resolved: heatmap.ResolvedScale) -> None:
        if matrix.shape != (box.num_query, box.num_key):
            raise ValueError(f"matrix has shape {matrix.shape}, the figure was drawn for "
                             f"{(box.num_query, box.num_key)}")
        rgb, bins = resolved.colours(matrix, self.colours)
        lines = rgb[:, box.col_index]  # [query, box width, 3]
        region = out[box.top:box.bottom, box.left:box.right]
        np.take(lines, box.row_index, axis=0, out=region, mode="clip")  # the nearest upscale
        if len(box.ring_rows):  # what the frame draws over the image: composite it back
            spots = region[box.ring_rows, box.ring_cols].astype(np.int32)
            mixed = (box.ring_black.astype(np.int32) * 255
                     + (box.ring_white.astype(np.int32) - box.ring_black) * spots + 127) // 255
            region[box.ring_rows, box.ring_cols] = np.clip(mixed, 0, 255).astype(np.uint8)
        notes = self.annotations
        if notes is not None:
            values = [f"{v:.2f}" for v in matrix.ravel().tolist()]
            missing = [v for v in dict.fromkeys(values) if v not in notes.index]
            if missing:
                self._add_sprites(missing)
            ids = np.fromiter((notes.index[v] for v in values), dtype=np.intp,
                              count=len(values)).reshape(matrix.shape)
            alpha = notes.sprites[ids].astype(np.int32)  # [query, key, h, w]
            light = self.colours.light_text[bins].astype(np.int32)  # [query, key]
            # Row of the blend table: (text colour, alpha); the channel value picks the column.
            rows = ((light[:, :, None, None] << 16) | (alpha << 8)).reshape(-1, 1)
            channels = out.reshape(-1)  # the buffer is contiguous: a view
            values_now = channels[notes.channels].reshape(-1, 3)
            channels[notes.channels] = _BLEND.take((rows + values_now).ravel())
            if not notes.inside:  # glyphs reach past the box: undo them before the next head
                self._dirty.append(notes.rect)
            elif self._changed is not None:  # cell values change the rows inside the cells
                self._changed[notes.rect[0]:notes.rect[2] + 1] = True

    def _add_sprites(self, strings: Sequence[str]) -> None:
        notes = self.annotations
        assert notes is not None  # only called when annotating
        with plain_text():
            sprites, row, col = _annotation_sprites(strings, notes.fontsize, self.dpi,
                                                    notes.frac)
        h, w = notes.sprites.shape[1:]
        canvas = np.zeros((len(strings), h, w), dtype=np.uint8)
        # Align the new sprites' centres with the existing ones; crop what does not fit.
        dr, dc = notes.anchor_row - row, notes.anchor_col - col
        src_r0, src_c0 = max(0, -dr), max(0, -dc)
        dst_r0, dst_c0 = max(0, dr), max(0, dc)
        rows = min(sprites.shape[1] - src_r0, h - dst_r0)
        cols = min(sprites.shape[2] - src_c0, w - dst_c0)
        if rows > 0 and cols > 0:
            canvas[:, dst_r0:dst_r0 + rows, dst_c0:dst_c0 + cols] = \
                sprites[:, src_r0:src_r0 + rows, src_c0:src_c0 + cols]
        start = notes.sprites.shape[0]
        notes.sprites = np.concatenate([notes.sprites, canvas])
        for offset, string in enumerate(strings):
            notes.index[string] = start + offset


_SPRITES: dict[tuple[float, float, float, float], tuple[np.ndarray, int, int]] = {}


def _with_annotations(template: FrameTemplate) -> None:
    box = template.boxes[0]
    fontsize = heatmap.ANNOT_PT
    strings = [f"{i / 100:.2f}" for i in range(101)]
    # Whole cells of whole pixels share the sub-pixel part of their centres: draw with it.
    frac = (round(float(box.centre_x[0] % 1.0) * 8) / 8 % 1.0,
            round(float(box.centre_y[0] % 1.0) * 8) / 8 % 1.0)
    key = (fontsize, float(template.dpi), *frac)
    if key not in _SPRITES:  # the same for every text with this font size: draw once
        with plain_text():
            _SPRITES[key] = _annotation_sprites(strings, fontsize, template.dpi, frac)
    sprites, anchor_row, anchor_col = _SPRITES[key]
    h, w = sprites.shape[1:]
    height, width = template.frame.shape[:2]
    text_rows = (height - np.floor(box.centre_y - frac[1] + 0.5)).astype(np.intp)
    text_cols = np.floor(box.centre_x - frac[0] + 0.5).astype(np.intp)
    rows = (text_rows[:, None, None, None] - anchor_row
            + np.arange(h)[None, None, :, None])  # [query, 1, h, 1]
    cols = (text_cols[None, :, None, None] - anchor_col
            + np.arange(w)[None, None, None, :])  # [1, key, 1, w]
    rows = np.clip(rows, 0, height - 1)
    cols = np.clip(cols, 0, width - 1)
    pixels = (rows * width + cols).ravel()  # [query * key * h * w] flat pixel index
    channels = (pixels[:, None] * 3 + np.arange(3)).ravel()
    rect = (int(rows.min()), int(cols.min()), int(rows.max()) + 1, int(cols.max()) + 1)
    inside = (rect[0] >= box.top and rect[1] >= box.left and rect[2] <= box.bottom
              and rect[3] <= box.right)
    template.annotations = _Annotations(
        fontsize, anchor_row, anchor_col, sprites.copy(), {s: i for i, s in enumerate(strings)},
        channels, rect, inside, frac)


def _figure_strings(fig: Figure) -> Iterator[str]:
    """Every visible string of a figure (titles, axis labels, tick labels, free texts)."""
    for text in fig.findobj(Text):
        if text.get_visible() and text.get_text():
            yield text.get_text()


def _layout_title(titles: Sequence[str], width: float, size: float, fallback: str) -> str:
    """The title a frame is laid out with: the one that wraps to the most lines."""
    if not titles:
        return fallback
    return max(titles, key=lambda t: (heatmap.title_lines(t, width, size), len(t)))


def _scale_of(scale: ColourScale | None) -> ColourScale:
    return scale if scale is not None else ColourScale()


def head_template(rows: Sequence[str], cols: Sequence[str], *, cmap: str = "viridis",
                  dpi: float = heatmap.DEFAULT_DPI, annot: bool | None = None,
                  titles: Sequence[str] = (), scale: ColourScale | None = None,
                  row_divider: int | None = None, col_divider: int | None = None,
                  figures: Iterable[Sequence[np.ndarray]] = ()) -> FrameTemplate:
    """The frame of :func:`~attnviz.render.heatmap.draw_head` for these token labels.

    Args:
        rows: query token labels (``query`` of the ``[query, key]`` matrices to come).
        cols: key token labels.
        cmap: colour map name.
        dpi: resolution; the image is ``head_figure_size(...) * dpi`` pixels, like
            ``attnviz heatmap --dpi``.
        annot: write cell values; ``None`` means "at most 30 tokens", as in ``draw_head``.
        titles: titles to pre-render (the layout is made for the one with the most lines).
        scale: the colour scale (default: :class:`~attnviz.render.heatmap.ColourScale`).
        row_divider, col_divider: a sentence pair's divider, as in ``draw_head``.
        figures: data of figures to come (each a ``[matrix]``): their colour bar labels are
            drawn with the titles, in one pass.
    """
    num_query, num_key = len(rows), len(cols)
    colour_scale = _scale_of(scale)
    probe = heatmap.head_layout(num_query, num_key, annot=annot, dpi=dpi)
    layout_title = _layout_title(titles, probe.title_width, heatmap.TITLE_PT, "layer 0, head 0")
    lines = heatmap.title_lines(layout_title, probe.title_width)
    dividers = row_divider is not None or col_divider is not None
    with plain_text():
        art = heatmap.draw_head_artists(
            np.zeros((num_query, num_key), np.float32), list(rows), list(cols),
            title=layout_title, cmap=cmap, annot=annot, scale=colour_scale, dpi=dpi,
            row_divider=row_divider, col_divider=col_divider, title_lines_hint=lines,
            write_values=False)
        title = _Slot.of(art.title, wrap=art.title_width)
        ticks = [_Slot.of(text) for text in art.ticks]
        art.image.set_visible(False)
        for text in [art.title, *art.ticks]:
            text.set_text("")
        frame = _canvas_rgb(art.fig)
        black = None
        if dividers:
            art.image.set_data(np.zeros((num_query, num_key, 3), np.uint8))
            art.image.set_visible(True)
            black = _canvas_rgb(art.fig)
        box = _box_from_extent(_extent(art.ax.get_window_extent()), frame, num_query, num_key,
                               black)
    template = FrameTemplate(frame, [box], colour_table(cmap), dpi, colour_scale, title=title,
                             ticks=ticks, black=black)
    if art.annot:
        _with_annotations(template)
    template.prepare(titles, figures)
    return template


def grid_template(num_rows: int, num_cols: int, num_tokens: int, row_labels: Sequence[str],
                  col_labels: Sequence[str], *, tokens: Sequence[str] | None = None,
                  cmap: str = "viridis", dpi: float = heatmap.DEFAULT_DPI,
                  titles: Sequence[str] = (), scale: ColourScale | None = None,
                  num_keys: int | None = None, key_tokens: Sequence[str] | None = None,
                  row_divider: int | None = None, col_divider: int | None = None,
                  figures: Iterable[Sequence[np.ndarray]] = ()) -> FrameTemplate:
    """The frame of :func:`~attnviz.render.heatmap.draw_grid` for ``[rows, cols, T, T]`` data
    (``[rows, cols, num_tokens, num_keys]`` with a window).

    :meth:`FrameTemplate.compose` then takes the matrices in row-major order
    (``matrices[r, c]`` for ``r`` in rows, ``c`` in columns).
    """
    num_keys = num_tokens if num_keys is None else num_keys
    colour_scale = _scale_of(scale)
    data = np.zeros((num_rows, num_cols, num_tokens, num_keys), np.float32)
    probe = heatmap.grid_layout(num_rows, num_cols, num_tokens, num_keys, dpi=dpi,
                                row_labels=row_labels)
    layout_title = _layout_title(titles, probe.title_width, heatmap.GRID_TITLE_PT, "overview")
    with plain_text():
        art = heatmap.draw_grid_artists(
            data, list(row_labels), list(col_labels), title=layout_title, cmap=cmap,
            tokens=list(tokens) if tokens is not None else None,
            key_tokens=list(key_tokens) if key_tokens is not None else None,
            scale=colour_scale, dpi=dpi, row_divider=row_divider, col_divider=col_divider,
            with_images=False)
        note = art.layout.note
        title = _Slot.of(art.title, wrap=art.layout.title_width)
        ticks = [_Slot.of(text) for text in art.ticks]
        extents = art.extents
        for text in [art.title, *art.ticks]:
            text.set_text("")
        frame = _canvas_rgb(art.fig)
        black = None
        if row_divider is not None or col_divider is not None:
            from matplotlib.collections import PolyCollection

            # Black where the panels go (as the images would be: no anti-aliased edge).
            art.ax.add_collection(PolyCollection(art.panels, facecolors="black",
                                                 edgecolors="none", antialiaseds=False,
                                                 zorder=1))
            black = _canvas_rgb(art.fig)
        strings = frozenset(_figure_strings(art.fig))
        # A token that merely equals another label only costs a missed reuse.
        uses_tokens = any(token in strings for token in [*(tokens or []), *(key_tokens or [])])
    if note:
        title.suffix = f"\n{note}"
    boxes = [_box_from_extent(extent, frame, num_tokens, num_keys, black) for extent in extents]
    template = FrameTemplate(frame, boxes, colour_table(cmap), dpi, colour_scale,
                             extents=extents, uses_tokens=uses_tokens, strings=strings,
                             title=title, ticks=ticks, black=black)
    template.prepare(titles, figures)
    return template


# --------------------------------------------------------------------------- vector formats
class HeadFigure:
    """One :func:`~attnviz.render.heatmap.draw_head` figure reused for every head of a text.

    For SVG and PDF, which need matplotlib's own drawing: only the image, the title, the
    colour bar's tick labels and the cell values change between heads, so the figure is built
    (and laid out) once.
    """

    def __init__(self, rows: Sequence[str], cols: Sequence[str], *, cmap: str = "viridis",
                 annot: bool | None = None, title: str = "", scale: ColourScale | None = None,
                 dpi: float = heatmap.DEFAULT_DPI, row_divider: int | None = None,
                 col_divider: int | None = None, titles: Sequence[str] = ()) -> None:
        self.scale = _scale_of(scale)
        probe = heatmap.head_layout(len(rows), len(cols), annot=annot, dpi=dpi)
        layout_title = _layout_title([title, *titles], probe.title_width, heatmap.TITLE_PT,
                                     title)
        with plain_text():
            self.art = heatmap.draw_head_artists(
                np.zeros((len(rows), len(cols)), np.float32), list(rows), list(cols),
                title=layout_title, cmap=cmap, annot=annot, scale=self.scale, dpi=dpi,
                row_divider=row_divider, col_divider=col_divider,
                title_lines_hint=heatmap.title_lines(layout_title, probe.title_width))
        self.fig = self.art.fig
        self.ax = self.art.ax
        self.image = self.art.image
        self.cells = self.art.cells  # the cell values, in np.ndenumerate order
        self.colours = colour_table(cmap)

    def render(self, matrix: np.ndarray, title: str, fmt: str, dpi: float) -> bytes:
        """The figure for one ``[query, key]`` matrix, saved as ``fmt``."""
        matrix = np.asarray(matrix, dtype=np.float32)
        resolved = self.scale.resolve(matrix)
        rgb, bins = resolved.colours(matrix, self.colours)
        self.image.set_data(rgb)
        self.art.title.set_text(heatmap.wrap_text(title, self.art.title_width, heatmap.TITLE_PT))
        for text, label in zip(self.art.ticks, resolved.tick_labels()):
            text.set_text(label)
        if self.cells:
            light = self.colours.light_text[bins].ravel().tolist()
            for text, value, white in zip(self.cells, matrix.ravel().tolist(), light):
                text.set_text(f"{value:.2f}")
                text.set_color("white" if white else "black")
        return figure_bytes(self.fig, fmt, dpi)
