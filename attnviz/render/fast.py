"""Fast raster figures: draw a figure's frame once, then paint each head's matrix into it.

Drawing a labelled heatmap with matplotlib costs about 0.5 s, almost all of it in the tick
labels, axis labels, colour bar and title, and for one text those are the same for every head.
A :class:`FrameTemplate` draws that frame once (with the very figure code of
:func:`attnviz.render.heatmap.draw_head` or :func:`~attnviz.render.heatmap.draw_grid`, its images
hidden) and remembers where each image's axes lie in pixels. Each head then costs:

* colour-mapping the ``[query, key]`` matrix through a lookup table of the colour map, exactly as
  matplotlib bins values (``int(value * N)``);
* a nearest-neighbour upscale into the axes' pixel box (the spines, drawn black over the image by
  matplotlib, are multiplied back in);
* the per-figure title, drawn once per title string by matplotlib into an alpha mask and blended;
* for annotated heads, the cell values ``"0.00"``..``"1.00"``, drawn once per string as alpha
  sprites and blended in white or black with the same contrast rule as ``draw_head``;
* a PNG encoder written for these images: the PNG "Up" filter turns every pixel row repeated
  by the nearest-neighbour upscale into zeros, and runs of zero rows are emitted as
  precompressed deflate blocks instead of going through zlib (level 1) again.

The result looks like ``attnviz heatmap --layer L --head H`` (same layout, fonts, colours; cell
edges and text may sit one pixel apart) at a few per cent of the cost.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import struct
import warnings
import zlib
from collections.abc import Iterator, Sequence
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

PNG_LEVEL = 1  # zlib level: 1 is ~3x faster than 6 for ~1.5x the bytes on these images


@contextlib.contextmanager
def plain_text() -> Iterator[None]:
    """Draw labels as plain text: no mathtext for ``$`` in tokens, no glyph or layout warnings.

    Also makes SVG output reproducible (fixed hash salt for element ids).
    """
    with matplotlib.rc_context({"text.parse_math": False, "svg.hashsalt": "attnviz"}), \
            warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*[Gg]lyph .* missing from")
        warnings.filterwarnings("ignore", message=r".*[Mm]atplotlib currently does not support")
        warnings.filterwarnings("ignore", message=r".*[Tt]ight layout not applied")
        yield


# --------------------------------------------------------------------------- colour maps
@dataclass(frozen=True)
class ColourTable:
    """A colour map as lookup tables: ``rgb[i]`` bytes and whether text on it should be white."""

    name: str
    rgb: np.ndarray  # [N, 3] uint8, what matplotlib paints for bin i
    light_text: np.ndarray  # [N] bool, draw_head's rule: luminance < 0.5 -> white text

    @property
    def size(self) -> int:
        return int(self.rgb.shape[0])

    def bins(self, matrix: np.ndarray, vmax: float = 1.0) -> np.ndarray:
        """Bin index of each value, as ``Colormap.__call__`` bins ``value / vmax``.

        Args:
            matrix: any shape, e.g. ``[query, key]``.

        Returns:
            ``intp`` array of the same shape, in ``0..N-1`` (NaN -> 0).
        """
        size = self.size
        scaled = np.nan_to_num(np.asarray(matrix, dtype=np.float64) / (vmax or 1.0), nan=0.0)
        return np.clip(scaled * size, 0, size - 1).astype(np.intp)


def colour_table(name: str) -> ColourTable:
    """The lookup tables of a named matplotlib colour map."""
    cmap = matplotlib.colormaps[heatmap.check_cmap(name)]
    index = np.arange(cmap.N)
    rgb = np.ascontiguousarray(cmap(index, bytes=True)[:, :3], dtype=np.uint8)
    floats = cmap(index)[:, :3]
    luminance = 0.299 * floats[:, 0] + 0.587 * floats[:, 1] + 0.114 * floats[:, 2]
    return ColourTable(name, rgb, luminance < 0.5)


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
    stream. The filter buffer is kept between calls.
    """

    def __init__(self, height: int, width: int, dpi: float = heatmap.DEFAULT_DPI) -> None:
        self.height, self.width = height, width
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

    def encode(self, image: np.ndarray) -> bytes:
        """PNG bytes of ``image`` ``[height, width, 3]`` uint8."""
        if image.shape != (self.height, self.width, 3) or image.dtype != np.uint8:
            raise ValueError(f"expected a ({self.height}, {self.width}, 3) uint8 image, "
                             f"got {image.shape} {image.dtype}")
        flat = image.reshape(self.height, self.width * 3)
        raw = self._raw
        raw[0, 1:] = flat[0]
        np.subtract(flat[1:], flat[:-1], out=raw[1:, 1:])  # wraps modulo 256, as PNG wants
        zero = np.asarray(~raw[:, 1:].any(axis=1), dtype=bool)
        zero[0] = False
        edges = np.flatnonzero(np.diff(zero.view(np.int8))) + 1
        starts = [0, *edges.tolist()]
        ends = [*edges.tolist(), self.height]
        row_bytes = raw.shape[1]
        data = raw.data.cast("B")
        packer = zlib.compressobj(PNG_LEVEL, zlib.DEFLATED, -15)  # raw deflate
        pieces = [b"\x78\x01"]  # zlib header: deflate, 32K window, fastest
        check_a, check_b = 1, 0  # Adler-32 of everything, kept by hand for the zero rows
        for start, end in zip(starts, ends):
            if zero[start]:
                rows = end - start
                pieces.append(self._zero_row * rows)
                # Each row adds 2 (the filter byte) to A, then row_bytes times A to B.
                check_b = (check_b + row_bytes * (rows * check_a + rows * (rows + 1))) % 65521
                check_a = (check_a + 2 * rows) % 65521
            else:
                piece = data[start * row_bytes:end * row_bytes]
                value = zlib.adler32(piece, (check_b << 16) | check_a)
                check_a, check_b = value & 0xFFFF, value >> 16
                pieces.append(packer.compress(piece))
                pieces.append(packer.flush(zlib.Z_FULL_FLUSH))
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
    row_runs: list[tuple[int, int, int]]  # (query, first row, end row), rows relative to top
    col_index: np.ndarray  # [width] key index of each pixel column
    ring_rows: np.ndarray  # pixels in the box where the frame is not white (spines): rows
    ring_cols: np.ndarray  # ... and columns, relative to the box
    ring_frame: np.ndarray  # [len(ring), 3] uint16 frame values there
    cell_rows: np.ndarray  # [query] pixel row of each cell centre (absolute)
    cell_cols: np.ndarray  # [key] pixel column of each cell centre (absolute)


def _extent(bbox: object) -> tuple[float, float, float, float]:
    x0, y0, x1, y1 = (float(v) for v in bbox.extents)  # type: ignore[attr-defined]
    return x0, y0, x1, y1


def _box_from_extent(extent: tuple[float, float, float, float], frame: np.ndarray,
                     num_query: int, num_key: int) -> _Box:
    """Pixel layout of an ``imshow`` filling axes at display ``extent`` (x0, y0, x1, y1)."""
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
    runs: list[tuple[int, int, int]] = []
    starts = np.flatnonzero(np.diff(rows, prepend=-1))
    ends = np.append(starts[1:], len(rows))
    for start, end in zip(starts.tolist(), ends.tolist()):
        runs.append((int(rows[start]), start, end))
    region = frame[top:bottom, left:right]
    ring_rows, ring_cols = np.nonzero((region != 255).any(axis=2))
    cell_x = x0 + (np.arange(num_key) + 0.5) * (x1 - x0) / num_key
    cell_y = y1 - (np.arange(num_query) + 0.5) * (y1 - y0) / num_query
    return _Box(top, left, bottom, right, num_query, num_key, runs, cols, ring_rows, ring_cols,
                region[ring_rows, ring_cols].astype(np.uint16),
                cell_rows=(height - np.round(cell_y)).astype(np.intp),
                cell_cols=np.round(cell_x).astype(np.intp))


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


def _text_masks(texts: Sequence[str], anchor: tuple[float, float], like: Text, *,
                height: int, dpi: float) -> list[tuple[int, int, np.ndarray]]:
    """Render each string as ``like`` would at display position ``anchor`` of a figure.

    All strings are drawn in one figure (one strip per string, each shifted from the real
    anchor by whole pixels so Agg rounds glyph positions the same way), then cut apart.

    Returns:
        For each string ``(top, left, alpha)``: the mask's first pixel row and column in a
        figure ``height`` pixels tall, and the alpha mask ``[h, w]`` uint16.
    """
    size_px = float(like.get_fontsize()) * dpi / 72.0
    strip = int(np.ceil(size_px * 4)) + 8
    longest = max((len(t) for t in texts), default=1)
    width = int(np.ceil(size_px * 1.3 * longest + 4 * size_px)) + 8  # wider than any glyph run
    total = strip * len(texts)
    fig = Figure(figsize=(width / dpi, total / dpi), dpi=dpi)
    fig.patch.set_facecolor("white")
    ax_x, ax_y = anchor
    align = like.get_horizontalalignment()
    target_x = {"left": 4 * size_px, "right": width - 4 * size_px}.get(align, width / 2)
    shift_x = int(np.round(ax_x - target_x))
    shifts = []
    for index, string in enumerate(texts):
        target = total - (index * strip + strip // 2)
        shift = int(np.round(ax_y - target))
        shifts.append(shift)
        fig.add_artist(Text(ax_x - shift_x, ax_y - shift, string, color="black",
                            fontproperties=like.get_fontproperties(),
                            horizontalalignment=align,
                            verticalalignment=like.get_verticalalignment(),
                            rotation=like.get_rotation(), transform=IdentityTransform(),
                            parse_math=False))
    alpha_all = 255 - _canvas_rgb(fig)[..., 0].astype(np.uint16)  # black text: R = G = B
    used_rows = np.asarray(alpha_all.any(axis=1), dtype=bool)
    masks = []
    for index, shift in enumerate(shifts):
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


def _annotation_sprites(strings: Sequence[str], fontsize: float,
                        dpi: float) -> tuple[np.ndarray, int, int]:
    """Alpha sprites ``[n, h, w]`` uint8 of ``strings`` drawn centred, and the centre pixel."""
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
        fig.add_artist(Text(c * cell_w + cell_w // 2, height - (r * cell_h + cell_h // 2), string,
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


def annotation_fontsize(num_tokens: int) -> float:
    """Font size of cell values in ``draw_head`` (shrinks as tokens are added)."""
    return max(5.0, 9.0 - num_tokens / 6)


# --------------------------------------------------------------------------- templates
def _freeze_layout(fig: Figure, dpi: float) -> None:
    """Lay the figure out at ``dpi`` with its real title, then keep that layout.

    A layout engine (constrained layout) would re-run at every draw and move the axes once
    the title is blanked for the frame.
    """
    fig.set_dpi(dpi)
    engine = fig.get_layout_engine()
    if engine is not None and type(engine).__name__ != "PlaceHolderLayoutEngine":
        fig.draw_without_rendering()
        fig.set_layout_engine("none")


@dataclass
class FrameTemplate:
    """A figure drawn once without its images; :meth:`compose` paints one figure's data in.

    Attributes:
        frame: ``[height, width, 3]`` uint8 pixels of the figure without images or title.
        boxes: the image boxes, in the order :meth:`compose` takes matrices.
        colours: the colour map's lookup tables.
        dpi: resolution the frame was drawn at.
    """

    frame: np.ndarray
    boxes: list[_Box]
    colours: ColourTable
    dpi: float
    extents: list[tuple[float, float, float, float]] = field(default_factory=list)
    uses_tokens: bool = True
    strings: frozenset[str] = frozenset()
    title_like: Text | None = None
    title_anchor: tuple[float, float] = (0.0, 0.0)
    title_colour: np.ndarray = field(default_factory=lambda: np.zeros(3, np.uint8))
    annotations: _Annotations | None = None
    _titles: dict[str, _Stamp] = field(default_factory=dict)
    _buffer: np.ndarray | None = None
    _dirty: list[tuple[int, int, int, int]] = field(default_factory=list)
    _writer: PngWriter | None = None

    @property
    def size(self) -> tuple[int, int]:
        """``(width, height)`` in pixels."""
        return int(self.frame.shape[1]), int(self.frame.shape[0])

    def for_tokens(self, num_tokens: int) -> FrameTemplate:
        """The same frame for ``[num_tokens, num_tokens]`` matrices (grids without labels).

        Shares the frame and the drawn titles; has its own pixel buffer.
        """
        if not self.extents or self.annotations is not None:
            raise ValueError("only grid templates can be reused for another token count")
        boxes = [_box_from_extent(extent, self.frame, num_tokens, num_tokens)
                 for extent in self.extents]
        return dataclasses.replace(self, boxes=boxes, _buffer=None, _dirty=[], _writer=None)

    def prepare_titles(self, titles: Sequence[str]) -> None:
        """Draw the given titles now, in one matplotlib pass (later ones are drawn on demand)."""
        todo = [t for t in dict.fromkeys(titles) if t not in self._titles]
        if not todo or self.title_like is None:
            return
        height = self.frame.shape[0]
        with plain_text():
            masks = _text_masks(todo, self.title_anchor, self.title_like, height=height,
                                dpi=self.dpi)
        for string, (top, left, alpha) in zip(todo, masks):
            self._titles[string] = _Stamp(top, left, alpha)

    def compose(self, matrices: Sequence[np.ndarray], title: str = "") -> np.ndarray:
        """Pixels of the figure showing ``matrices`` (one ``[query, key]`` per box).

        The returned array is reused by the next call: encode or copy it first.
        """
        if len(matrices) != len(self.boxes):
            raise ValueError(f"expected {len(self.boxes)} matrices, got {len(matrices)}")
        if self._buffer is None:
            self._buffer = self.frame.copy()
        out = self._buffer
        for top, left, bottom, right in self._dirty:  # undo the last title and sprites
            out[top:bottom, left:right] = self.frame[top:bottom, left:right]
        self._dirty = []
        for box, matrix in zip(self.boxes, matrices):
            self._paint(out, box, matrix)
        if title:
            if title not in self._titles:
                self.prepare_titles([title])
            stamp = self._titles.get(title)
            if stamp is not None and stamp.alpha.size:
                top, left, bottom, right = self._clip(stamp.rect)
                if bottom > top and right > left:
                    alpha = stamp.alpha[top - stamp.top:bottom - stamp.top,
                                        left - stamp.left:right - stamp.left]
                    _blend(out[top:bottom, left:right], alpha, self.title_colour)
                    self._dirty.append((top, left, bottom, right))
        return out

    def png(self, matrices: Sequence[np.ndarray], title: str = "") -> bytes:
        """PNG bytes of :meth:`compose`."""
        image = self.compose(matrices, title)
        if self._writer is None:
            self._writer = PngWriter(image.shape[0], image.shape[1], self.dpi)
        return self._writer.encode(image)

    def _clip(self, rect: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
        height, width = self.frame.shape[:2]
        top, left, bottom, right = rect
        return max(top, 0), max(left, 0), min(bottom, height), min(right, width)

    def _paint(self, out: np.ndarray, box: _Box, matrix: np.ndarray) -> None:
        matrix = np.asarray(matrix)
        if matrix.shape != (box.num_query, box.num_key):
            raise ValueError(f"matrix has shape {matrix.shape}, the figure was drawn for "
                             f"{(box.num_query, box.num_key)}")
        bins = self.colours.bins(matrix)
        lines = self.colours.rgb[bins[:, box.col_index]]  # [query, box width, 3]
        region = out[box.top:box.bottom, box.left:box.right]
        for query, start, end in box.row_runs:
            region[start:end] = lines[query]
        if len(box.ring_rows):  # spines are black lines over the image: multiply them back in
            spots = region[box.ring_rows, box.ring_cols].astype(np.uint16)
            region[box.ring_rows, box.ring_cols] = ((spots * box.ring_frame + 127)
                                                    // 255).astype(np.uint8)
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
            values = channels[notes.channels].reshape(-1, 3)
            channels[notes.channels] = _BLEND.take((rows + values).ravel())
            if not notes.inside:  # glyphs reach past the box: undo them before the next head
                self._dirty.append(notes.rect)

    def _add_sprites(self, strings: Sequence[str]) -> None:
        notes = self.annotations
        assert notes is not None  # only called when annotating
        with plain_text():
            sprites, row, col = _annotation_sprites(strings, notes.fontsize, self.dpi)
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


_SPRITES: dict[tuple[float, float], tuple[np.ndarray, int, int]] = {}


def _with_annotations(template: FrameTemplate, num_tokens: int) -> None:
    box = template.boxes[0]
    fontsize = annotation_fontsize(num_tokens)
    strings = [f"{i / 100:.2f}" for i in range(101)]
    key = (fontsize, float(template.dpi))
    if key not in _SPRITES:  # the same for every text with this font size: draw once
        with plain_text():
            _SPRITES[key] = _annotation_sprites(strings, fontsize, template.dpi)
    sprites, anchor_row, anchor_col = _SPRITES[key]
    h, w = sprites.shape[1:]
    height, width = template.frame.shape[:2]
    rows = (box.cell_rows[:, None, None, None] - anchor_row
            + np.arange(h)[None, None, :, None])  # [query, 1, h, 1]
    cols = (box.cell_cols[None, :, None, None] - anchor_col
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
        channels, rect, inside)


def _title_setup(template: FrameTemplate, title: Text) -> None:
    title_pos = title.get_transform().transform(title.get_position())
    # A detached copy: the figure's own Text would keep the whole figure alive.
    template.title_like = Text(0, 0, "", fontproperties=title.get_fontproperties().copy(),
                               horizontalalignment=title.get_horizontalalignment(),
                               verticalalignment=title.get_verticalalignment(),
                               rotation=title.get_rotation())
    template.title_anchor = (float(title_pos[0]), float(title_pos[1]))
    template.title_colour = np.round(np.array(to_rgb(title.get_color())) * 255).astype(np.uint8)


def _figure_strings(fig: Figure) -> Iterator[str]:
    """Every visible string of a figure (titles, axis labels, tick labels, free texts)."""
    for text in fig.findobj(Text):
        if text.get_visible() and text.get_text():
            yield text.get_text()


def head_template(rows: Sequence[str], cols: Sequence[str], *, cmap: str = "viridis",
                  dpi: float = heatmap.DEFAULT_DPI, annot: bool | None = None,
                  titles: Sequence[str] = ()) -> FrameTemplate:
    """The frame of :func:`~attnviz.render.heatmap.draw_head` for these token labels.

    Args:
        rows: query token labels (``query`` of the ``[query, key]`` matrices to come).
        cols: key token labels.
        cmap: colour map name.
        dpi: resolution; the image is ``head_figure_size(...) * dpi`` pixels, like
            ``attnviz heatmap --dpi``.
        annot: write cell values; ``None`` means "at most 30 tokens", as in ``draw_head``.
        titles: titles to pre-render (the layout is made with the longest one).
    """
    num_query, num_key = len(rows), len(cols)
    if annot is None:
        annot = max(num_query, num_key) <= heatmap.ANNOT_MAX_TOKENS
    layout_title = max(titles, key=len) if titles else "layer 0, head 0"
    with plain_text():
        fig = heatmap.draw_head(np.zeros((num_query, num_key), np.float32), list(rows),
                                list(cols), title=layout_title, cmap=cmap, annot=False)
        _freeze_layout(fig, dpi)
        ax = fig.axes[0]
        ax.images[0].set_visible(False)
        ax.title.set_text("")
        frame = _canvas_rgb(fig)
        box = _box_from_extent(_extent(ax.get_window_extent()), frame, num_query, num_key)
    template = FrameTemplate(frame, [box], colour_table(cmap), dpi)
    _title_setup(template, ax.title)
    if annot:
        _with_annotations(template, max(num_query, num_key))
    template.prepare_titles(titles)
    return template


def grid_template(num_rows: int, num_cols: int, num_tokens: int, row_labels: Sequence[str],
                  col_labels: Sequence[str], *, tokens: Sequence[str] | None = None,
                  cmap: str = "viridis", dpi: float = heatmap.DEFAULT_DPI,
                  titles: Sequence[str] = ()) -> FrameTemplate:
    """The frame of :func:`~attnviz.render.heatmap.draw_grid` for ``[rows, cols, T, T]`` data.

    :meth:`FrameTemplate.compose` then takes the matrices in row-major order
    (``matrices[r, c]`` for ``r`` in rows, ``c`` in columns).
    """
    count = num_rows * num_cols
    codes = ((np.arange(count, dtype=np.float32) + 1) / (count + 1)).reshape(num_rows, num_cols)
    data = np.broadcast_to(codes[:, :, None, None],
                           (num_rows, num_cols, num_tokens, num_tokens)).astype(np.float32)
    layout_title = max(titles, key=len) if titles else "overview"
    with plain_text():
        fig = heatmap.draw_grid(data, list(row_labels), list(col_labels), title=layout_title,
                                cmap=cmap, tokens=list(tokens) if tokens is not None else None)
        _freeze_layout(fig, dpi)
        title = next((t for t in fig.texts if t.get_text() == layout_title), None)
        if title is not None:
            title.set_text("")
        placed: dict[int, object] = {}
        images = []
        for ax in fig.axes:
            for image in ax.images:
                code = int(round(float(np.asarray(image.get_array())[0, 0]) * (count + 1))) - 1
                placed[code] = ax
                images.append(image)
        for image in images:
            image.set_visible(False)
        frame = _canvas_rgb(fig)
        if sorted(placed) != list(range(count)):
            raise RuntimeError("draw_grid did not draw one image per matrix")
        extents = [_extent(placed[i].get_window_extent())  # type: ignore[attr-defined]
                   for i in range(count)]
        strings = frozenset(_figure_strings(fig))
        # A token that merely equals another label only costs a missed reuse.
        uses_tokens = tokens is not None and any(token in strings for token in tokens)
    boxes = [_box_from_extent(extent, frame, num_tokens, num_tokens) for extent in extents]
    template = FrameTemplate(frame, boxes, colour_table(cmap), dpi, extents=extents,
                             uses_tokens=uses_tokens, strings=strings)
    if title is not None:
        _title_setup(template, title)
    template.prepare_titles(titles)
    return template


# --------------------------------------------------------------------------- vector formats
_METADATA: dict[str, dict[str, str | None]] = {
    "png": {"Software": "attnviz"},
    "svg": {"Date": None, "Creator": "attnviz"},
    "pdf": {"CreationDate": None, "ModDate": None, "Creator": "attnviz"},
}


def figure_bytes(fig: Figure, fmt: str, dpi: float) -> bytes:
    """``fig`` saved as ``fmt`` (png, svg or pdf) without dates, so output is reproducible."""
    buffer = io.BytesIO()
    with plain_text():
        fig.savefig(buffer, format=fmt, dpi=dpi, metadata=_METADATA[fmt])
    return buffer.getvalue()


class HeadFigure:
    """One :func:`~attnviz.render.heatmap.draw_head` figure reused for every head of a text.

    For SVG and PDF, which need matplotlib's own drawing: only the image data, the title and
    the cell values change between heads, so the figure is built (and laid out) once.
    """

    def __init__(self, rows: Sequence[str], cols: Sequence[str], *, cmap: str = "viridis",
                 annot: bool | None = None, title: str = "") -> None:
        with plain_text():
            self.fig = heatmap.draw_head(np.zeros((len(rows), len(cols)), np.float32),
                                         list(rows), list(cols), title=title, cmap=cmap,
                                         annot=annot)
        self.ax = self.fig.axes[0]
        self.image = self.ax.images[0]
        self.cells = list(self.ax.texts)  # the cell values, in np.ndenumerate order
        self.colours = colour_table(cmap)

    def render(self, matrix: np.ndarray, title: str, fmt: str, dpi: float) -> bytes:
        """The figure for one ``[query, key]`` matrix, saved as ``fmt``."""
        self.image.set_data(np.asarray(matrix, dtype=np.float32))
        self.ax.title.set_text(title)
        if self.cells:
            light = self.colours.light_text[self.colours.bins(matrix)].ravel().tolist()
            for text, value, white in zip(self.cells, np.asarray(matrix).ravel().tolist(),
                                          light):
                text.set_text(f"{value:.2f}")
                text.set_color("white" if white else "black")
        return figure_bytes(self.fig, fmt, dpi)
