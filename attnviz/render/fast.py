"""Fast raster figures: draw a figure's frame once, then paint each head's matrix into it.

Drawing a labelled heatmap with matplotlib costs about 0.5 s, almost all of it in the tick
labels, axis labels, colour bar and title, and for one text those are the same for every head.
A :class:`FrameTemplate` draws that frame once (with the very figure code of
:func:`attnviz.render.head.draw_head` or :func:`~attnviz.render.grid.draw_grid`, its images
hidden) and remembers where each image lies in pixels. Figures are laid out by hand (no layout
engine), so one frame serves every figure of its shape. Each head then costs:

* colour-mapping the ``[query, key]`` matrix through the lookup table of the colour map and
  the colour scale (:meth:`~attnviz.render.colours.ResolvedScale.colours`, the same function
  ``draw_head`` paints with);
* a nearest-neighbour upscale into the image's pixel box; whatever the frame draws over the
  image (spines, panel borders, a sentence pair's white divider) is composited back exactly,
  from the frame drawn over white and, where needed, over black (the pixel pieces live in
  :mod:`attnviz.render.stamps`);
* the texts that change from figure to figure: the title and the colour bar's tick labels
  (their values follow the data's maximum), drawn once per string by matplotlib into alpha
  masks and blended;
* for annotated heads, the cell values ``"0.00"``..``"1.00"``, drawn once per string as alpha
  sprites and blended in white or black with the same contrast rule as ``draw_head``;
* a PNG encoder written for these images (:mod:`attnviz.render.png`): the PNG "Up" filter
  turns every pixel row repeated by the nearest-neighbour upscale into zeros, and runs of zero
  rows are emitted as precompressed deflate blocks instead of going through zlib (level 1)
  again.

The result looks like ``attnviz heatmap --layer L --head H`` (same layout, fonts, colours; text
may sit one pixel apart) at a few per cent of the cost.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.text import Text  # noqa: E402

from attnviz.render.colours import ResolvedScale  # noqa: E402
from attnviz.render.grid import draw_grid_artists  # noqa: E402
from attnviz.render.head import draw_head_artists  # noqa: E402
from attnviz.render.heatmap import (  # noqa: E402, F401  (re-exported)
    ColourScale,
    ColourTable,
    colour_table,
    figure_bytes,
    plain_text,
)
from attnviz.render.layout import (  # noqa: E402
    ANNOT_PT,
    DEFAULT_DPI,
    GRID_TITLE_PT,
    TITLE_PT,
    grid_layout,
    head_layout,
    title_lines,
    wrap_text,
)
from attnviz.render.parts import cell_text  # noqa: E402
from attnviz.render.png import PNG_LEVEL, PngWriter, encode_png  # noqa: E402, F401  (re-exported)
from attnviz.render.stamps import (  # noqa: E402
    _BLEND,
    _annotation_sprites,
    _Annotations,
    _blend,
    _Box,
    _box_from_extent,
    _canvas_rgb,
    _extent,
    _prepare,
    _Slot,
)


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
    masked: np.ndarray | None = None  # [query, key] cells a query cannot see: grey, no value
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
               resolved: ResolvedScale) -> None:
        if matrix.shape != (box.num_query, box.num_key):
            raise ValueError(f"matrix has shape {matrix.shape}, the figure was drawn for "
                             f"{(box.num_query, box.num_key)}")
        masked = self.masked if (self.masked is not None
                                 and self.masked.shape == matrix.shape) else None
        rgb, bins = resolved.colours(matrix, self.colours, masked)
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
            values = [cell_text(v) for v in matrix.ravel().tolist()]
            if masked is not None:
                values = ["" if hidden else value
                          for value, hidden in zip(values, masked.ravel().tolist())]
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
    fontsize = ANNOT_PT
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
    return max(titles, key=lambda t: (title_lines(t, width, size), len(t)))


def _scale_of(scale: ColourScale | None) -> ColourScale:
    return scale if scale is not None else ColourScale()


def head_template(rows: Sequence[str], cols: Sequence[str], *, cmap: str = "viridis",
                  dpi: float = DEFAULT_DPI, annot: bool | None = None,
                  titles: Sequence[str] = (), scale: ColourScale | None = None,
                  row_divider: int | None = None, col_divider: int | None = None,
                  figures: Iterable[Sequence[np.ndarray]] = (),
                  label: str = "attention weight",
                  masked: np.ndarray | None = None) -> FrameTemplate:
    """The frame of :func:`~attnviz.render.head.draw_head` for these token labels.

    Args:
        rows: query token labels (``query`` of the ``[query, key]`` matrices to come).
        cols: key token labels.
        cmap: colour map name.
        dpi: resolution; the image is ``head_figure_size(...) * dpi`` pixels, like
            ``attnviz heatmap --dpi``.
        annot: write cell values; ``None`` means "at most 30 tokens", as in ``draw_head``.
        titles: titles to pre-render (the layout is made for the one with the most lines).
        scale: the colour scale (default: :class:`~attnviz.render.colours.ColourScale`).
        row_divider, col_divider: a sentence pair's divider, as in ``draw_head``.
        figures: data of figures to come (each a ``[matrix]``): their colour bar labels are
            drawn with the titles, in one pass.
        label: what the colour bar shows (a measure's name, e.g. ``norm ||αf(x)||``).
        masked: boolean ``[query, key]``: the cells a query cannot see (a causal model's later
            keys), drawn grey and without a value, as ``draw_head`` draws them.
    """
    num_query, num_key = len(rows), len(cols)
    colour_scale = _scale_of(scale)
    probe = head_layout(num_query, num_key, annot=annot, dpi=dpi, row_labels=list(rows),
                        col_labels=list(cols))
    layout_title = _layout_title(titles, probe.title_width, TITLE_PT, "layer 0, head 0")
    lines = title_lines(layout_title, probe.title_width)
    dividers = row_divider is not None or col_divider is not None
    with plain_text():
        art = draw_head_artists(
            np.zeros((num_query, num_key), np.float32), list(rows), list(cols),
            title=layout_title, cmap=cmap, annot=annot, scale=colour_scale, dpi=dpi,
            row_divider=row_divider, col_divider=col_divider, title_lines_hint=lines,
            write_values=False, label=label)
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
                             ticks=ticks, black=black, masked=masked)
    if art.annot:
        _with_annotations(template)
    template.prepare(titles, figures)
    return template


def grid_template(num_rows: int, num_cols: int, num_tokens: int, row_labels: Sequence[str],
                  col_labels: Sequence[str], *, tokens: Sequence[str] | None = None,
                  cmap: str = "viridis", dpi: float = DEFAULT_DPI,
                  titles: Sequence[str] = (), scale: ColourScale | None = None,
                  num_keys: int | None = None, key_tokens: Sequence[str] | None = None,
                  row_divider: int | None = None, col_divider: int | None = None,
                  figures: Iterable[Sequence[np.ndarray]] = (),
                  label: str = "attention weight",
                  masked: np.ndarray | None = None) -> FrameTemplate:
    """The frame of :func:`~attnviz.render.grid.draw_grid` for ``[rows, cols, T, T]`` data
    (``[rows, cols, num_tokens, num_keys]`` with a window); ``masked`` (boolean
    ``[num_tokens, num_keys]``): every panel's cells a query cannot see, drawn grey.

    :meth:`FrameTemplate.compose` then takes the matrices in row-major order
    (``matrices[r, c]`` for ``r`` in rows, ``c`` in columns).
    """
    num_keys = num_tokens if num_keys is None else num_keys
    colour_scale = _scale_of(scale)
    data = np.zeros((num_rows, num_cols, num_tokens, num_keys), np.float32)
    probe = grid_layout(num_rows, num_cols, num_tokens, num_keys, dpi=dpi,
                                row_labels=row_labels)
    layout_title = _layout_title(titles, probe.title_width, GRID_TITLE_PT, "overview")
    with plain_text():
        art = draw_grid_artists(
            data, list(row_labels), list(col_labels), title=layout_title, cmap=cmap,
            tokens=list(tokens) if tokens is not None else None,
            key_tokens=list(key_tokens) if key_tokens is not None else None,
            scale=colour_scale, dpi=dpi, row_divider=row_divider, col_divider=col_divider,
            with_images=False, label=label)
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
                             title=title, ticks=ticks, black=black, masked=masked)
    template.prepare(titles, figures)
    return template


# --------------------------------------------------------------------------- vector formats
class HeadFigure:
    """One :func:`~attnviz.render.head.draw_head` figure reused for every head of a text.

    For SVG and PDF, which need matplotlib's own drawing: only the image, the title, the
    colour bar's tick labels and the cell values change between heads, so the figure is built
    (and laid out) once.
    """

    def __init__(self, rows: Sequence[str], cols: Sequence[str], *, cmap: str = "viridis",
                 annot: bool | None = None, title: str = "", scale: ColourScale | None = None,
                 dpi: float = DEFAULT_DPI, row_divider: int | None = None,
                 col_divider: int | None = None, titles: Sequence[str] = (),
                 masked: np.ndarray | None = None) -> None:
        self.scale = _scale_of(scale)
        self.masked = masked  # [query, key] cells a query cannot see: grey, no value
        probe = head_layout(len(rows), len(cols), annot=annot, dpi=dpi,
                            row_labels=list(rows), col_labels=list(cols))
        layout_title = _layout_title([title, *titles], probe.title_width, TITLE_PT,
                                     title)
        with plain_text():
            self.art = draw_head_artists(
                np.zeros((len(rows), len(cols)), np.float32), list(rows), list(cols),
                title=layout_title, cmap=cmap, annot=annot, scale=self.scale, dpi=dpi,
                row_divider=row_divider, col_divider=col_divider,
                title_lines_hint=title_lines(layout_title, probe.title_width))
        self.fig = self.art.fig
        self.ax = self.art.ax
        self.image = self.art.image
        self.cells = self.art.cells  # the cell values, in np.ndenumerate order
        self.colours = colour_table(cmap)

    def render(self, matrix: np.ndarray, title: str, fmt: str, dpi: float) -> bytes:
        """The figure for one ``[query, key]`` matrix, saved as ``fmt``."""
        matrix = np.asarray(matrix, dtype=np.float32)
        resolved = self.scale.resolve(matrix)
        masked = self.masked if (self.masked is not None
                                 and self.masked.shape == matrix.shape) else None
        rgb, bins = resolved.colours(matrix, self.colours, masked)
        self.image.set_data(rgb)
        self.art.title.set_text(wrap_text(title, self.art.title_width, TITLE_PT))
        for text, label in zip(self.art.ticks, resolved.tick_labels()):
            text.set_text(label)
        if self.cells:
            light = self.colours.light_text[bins].ravel().tolist()
            hidden = (masked.ravel().tolist() if masked is not None
                      else [False] * matrix.size)
            for text, value, white, gone in zip(self.cells, matrix.ravel().tolist(), light,
                                                hidden):
                text.set_text("" if gone else cell_text(value))
                text.set_color("white" if white else "black")
        return figure_bytes(self.fig, fmt, dpi)
