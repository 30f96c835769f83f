"""The fast renderer: frames drawn once, heads composited in, a PNG writer of its own."""

from __future__ import annotations

import io
import zlib

import matplotlib
import numpy as np
import pytest
from PIL import Image

from attnviz.render import fast, heatmap


def _attention(rng: np.random.Generator, n: int, sharp: float = 4.0) -> np.ndarray:
    m = rng.random((n, n)).astype(np.float32) ** sharp
    return m / m.sum(axis=1, keepdims=True)


def _pixels(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).astype(np.int16)


def _reference(matrix: np.ndarray, labels: list[str], title: str, dpi: int = 100,
               **kwargs: object) -> np.ndarray:
    fig = heatmap.draw_head(matrix, labels, labels, title=title, dpi=dpi,
                            **kwargs)  # type: ignore[arg-type]
    return _pixels(fast.figure_bytes(fig, "png", dpi))


def test_png_writer_round_trips_exactly() -> None:
    rng = np.random.default_rng(1)
    image = rng.integers(0, 256, size=(37, 53, 3), dtype=np.uint8)
    image[10:20] = image[10]  # repeated rows: the Up filter's zeros
    data = fast.encode_png(image, dpi=150)
    decoded = Image.open(io.BytesIO(data))
    assert decoded.mode == "RGB" and decoded.size == (53, 37)
    assert np.array_equal(np.asarray(decoded), image)
    assert decoded.info["dpi"] == pytest.approx((150, 150), abs=0.1)
    assert decoded.info.get("Software") == "attnviz"


def _idat(data: bytes) -> bytes:
    """The concatenated IDAT payload of a PNG."""
    position, payload = 8, b""
    while position < len(data):
        length = int.from_bytes(data[position:position + 4], "big")
        kind = data[position + 4:position + 8]
        if kind == b"IDAT":
            payload += data[position + 8:position + 8 + length]
        position += 12 + length
    return payload


@pytest.mark.parametrize("seed", range(6))
def test_png_writer_stream_is_valid_zlib_with_zero_row_runs(seed: int) -> None:
    rng = np.random.default_rng(seed)
    height, width = rng.integers(1, 300), rng.integers(1, 200)
    image = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    for _ in range(6):  # runs of repeated rows, as a nearest upscale makes
        start = rng.integers(0, height)
        image[start:start + rng.integers(1, 80)] = image[start]
    data = fast.encode_png(image)
    # zlib.decompress checks the Adler-32 the writer computes by hand for skipped rows.
    raw = np.frombuffer(zlib.decompress(_idat(data)), np.uint8).reshape(height, width * 3 + 1)
    assert raw[0, 0] == 0 and (raw[1:, 0] == 2).all()
    rows = np.cumsum(raw[:, 1:], axis=0, dtype=np.uint8)  # undo the Up filter
    assert np.array_equal(rows.reshape(height, width, 3), image)


def test_png_writer_rejects_other_shapes() -> None:
    writer = fast.PngWriter(4, 5)
    with pytest.raises(ValueError, match="expected"):
        writer.encode(np.zeros((5, 4, 3), np.uint8))


@pytest.mark.parametrize("name", ["viridis", "magma", "Blues"])
def test_colour_table_bins_like_matplotlib(name: str) -> None:
    table = fast.colour_table(name)
    values = np.concatenate([np.linspace(0, 1, 2049), [0.0, 1.0, 1 - 1e-9, 0.5, 1e-9]])
    expected = matplotlib.colormaps[name](values, bytes=True)[:, :3]
    assert np.array_equal(table.rgb[table.bins(values)], expected)
    # The contrast rule of draw_head: luminance of the cell colour below 0.5 -> white text.
    r, g, b = matplotlib.colormaps[name](values)[:, :3].T
    assert np.array_equal(table.light_text[table.bins(values)], 0.299 * r + 0.587 * g
                          + 0.114 * b < 0.5)


@pytest.mark.parametrize(("tokens", "annot"), [(8, True), (40, False)])
def test_head_template_matches_draw_head(tokens: int, annot: bool) -> None:
    rng = np.random.default_rng(tokens)
    labels = [f"tok{i}" for i in range(tokens)]
    titles = ["minilm: layer 0, head 1", "minilm: layer 3, head 11"]
    template = fast.head_template(labels, labels, titles=titles)
    assert (template.annotations is not None) == annot
    for title in titles:
        matrix = _attention(rng, tokens)
        ours = _pixels(template.png([matrix], title))
        reference = _reference(matrix, labels, title)
        assert ours.shape == reference.shape
        width, height = heatmap.head_figure_size(tokens)
        assert ours.shape[:2] == (round(height * 100), round(width * 100))
        difference = np.abs(ours - reference).max(axis=2)
        # Same layout, fonts and colours: at most a pixel's shift in a few text glyphs.
        assert difference.mean() < 2.0
        assert (difference > 40).mean() < 0.02


def test_cells_have_the_colour_map_colour() -> None:
    rng = np.random.default_rng(7)
    labels = [f"t{i}" for i in range(40)]
    template = fast.head_template(labels, labels, cmap="magma", titles=["t"],
                                  scale=heatmap.ColourScale("linear", vmax=1.0))
    matrix = _attention(rng, 40, sharp=1.0)
    image = template.compose([matrix], "t")
    box = template.boxes[0]
    rows, cols = box.cell_rows, box.cell_cols
    expected = matplotlib.colormaps["magma"](matrix, bytes=True)[..., :3]
    assert np.array_equal(image[rows[:, None], cols[None, :]], expected)


def test_compose_leaves_nothing_of_the_previous_head() -> None:
    rng = np.random.default_rng(3)
    labels = ["The", "cat", "sat", "on", "the", "mat"]
    first, second = _attention(rng, 6), _attention(rng, 6)
    reused = fast.head_template(labels, labels, titles=["a long first title", "b"])
    reused.compose([first], "a long first title")
    after = reused.compose([second], "b").copy()
    fresh = fast.head_template(labels, labels, titles=["a long first title", "b"])
    assert np.array_equal(after, fresh.compose([second], "b"))


def test_values_outside_the_sprites_are_drawn_on_demand() -> None:
    labels = ["a", "b"]
    template = fast.head_template(labels, labels, titles=["t"], annot=True)
    matrix = np.array([[0.5, 0.5], [0.25, 0.75]], np.float32)
    base = template.compose([matrix], "t").copy()
    odd = np.array([[0.5, 0.5], [-0.25, 1.25]], np.float32)  # "-0.25", "1.25": new strings
    changed = template.compose([odd], "t")
    assert {"-0.25", "1.25"} <= set(template.annotations.index)  # type: ignore[union-attr]
    assert not np.array_equal(base, changed)


def test_dpi_scales_the_image() -> None:
    labels = [f"w{i}" for i in range(10)]
    template = fast.head_template(labels, labels, dpi=50, titles=["t"])
    width, height = heatmap.head_figure_size(10)
    assert template.size == (round(width * 50), round(height * 50))
    reference = _reference(np.full((10, 10), 0.1, np.float32), labels, "t", dpi=50)
    ours = _pixels(template.png([np.full((10, 10), 0.1, np.float32)], "t"))
    assert np.abs(ours - reference).max(axis=2).mean() < 3.0


def test_grid_template_matches_draw_grid() -> None:
    rng = np.random.default_rng(5)
    weights = np.stack([np.stack([_attention(rng, 20) for _ in range(4)]) for _ in range(3)])
    rows = [f"layer {i}" for i in range(3)]
    cols = [f"head {i}" for i in range(4)]
    tokens = [f"w{i}" for i in range(20)]
    template = fast.grid_template(3, 4, 20, rows, cols, tokens=tokens, titles=["overview!"])
    ours = _pixels(template.png([m for block in weights for m in block], "overview!"))
    fig = heatmap.draw_grid(weights, rows, cols, title="overview!", tokens=tokens)
    reference = _pixels(fast.figure_bytes(fig, "png", 100))
    assert ours.shape == reference.shape
    assert np.abs(ours - reference).max(axis=2).mean() < 1.0
    assert "layer 1" in template.strings and "overview!" not in template.strings
    # The same frame serves another token count (the grid shows no token labels).
    assert not template.uses_tokens
    other = template.for_tokens(7)
    image = other.compose([np.full((7, 7), 1 / 7, np.float32)] * 12, "overview!")
    assert image.shape == ours.shape


def test_head_figure_renders_reproducible_vectors() -> None:
    rng = np.random.default_rng(2)
    labels = ["The", "$cat$", "sat"]  # a '$' pair must not start mathtext
    figure = fast.HeadFigure(labels, labels, title="toy: layer 0, head 0")
    matrix = _attention(rng, 3)
    svg = figure.render(matrix, "toy: layer 0, head 1", "svg", 100)
    assert svg == figure.render(matrix, "toy: layer 0, head 1", "svg", 100)
    assert b"<svg" in svg and b"layer 0, head 1" in svg or b"head 1" in svg
    from attnviz.render.parts import cell_text  # "0.25", or "2e-4" for what reads 0.00

    assert [t.get_text() for t in figure.cells] == [cell_text(v) for v in matrix.ravel().tolist()]
    pdf = figure.render(matrix, "t", "pdf", 100)
    assert pdf.startswith(b"%PDF") and pdf == figure.render(matrix, "t", "pdf", 100)
