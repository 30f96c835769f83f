"""Colour maps and colour scales of attention figures.

A :class:`ColourScale` (linear, power or log; the top fixed or the shown data's maximum)
resolves against the data into a :class:`ResolvedScale`, which maps weights to ``0..1``; a
:class:`ColourTable` turns those into the bytes matplotlib paints. The matplotlib figures and
the fast renderer (:mod:`attnviz.render.fast`) colour through the same two functions.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import matplotlib
import numpy as np

from attnviz.errors import UsageError

# Colour scales. The default makes a typical head readable: most heads put 0.1-0.4 on their
# strongest key and a few hundredths elsewhere, so a fixed 0..1 linear scale leaves them dark.
SCALES = ("linear", "power", "log")
DEFAULT_SCALE = "power"
DEFAULT_GAMMA = 0.5  # power 0.5: a weight a quarter of the maximum gets half the colour range
DEFAULT_VMAX = "auto"
GAMMA_RANGE = (0.05, 5.0)
VMAX_LIMIT = 1e6
LOG_DECADES = 3  # the log scale shows weights from top / 1000 to top
#: The colour of masked cells (a key the query cannot see), as the long view draws them.
MASKED_RGB = (232, 233, 236)


#: seaborn's perceptually uniform colour maps (``_r`` reverses each): selectable by name
#: wherever a colour map is. seaborn registers them with matplotlib when it is imported,
#: which takes about a second, so it is imported only when one of them is asked for.
SEABORN_CMAPS = ("rocket", "mako", "flare", "crest", "vlag", "icefire")


def is_seaborn_cmap(name: str) -> bool:
    """Whether ``name`` is one of :data:`SEABORN_CMAPS`, or one reversed (``rocket_r``)."""
    return name.removesuffix("_r") in SEABORN_CMAPS


def _register_seaborn(name: str) -> None:
    """Import seaborn, which registers its colour maps with matplotlib."""
    try:
        import seaborn  # noqa: F401  (registers rocket, mako, ... with matplotlib)
    except ImportError:  # pragma: no cover - seaborn is a dependency
        raise UsageError(f"the colour map {name!r} comes from seaborn, which is not installed",
                         "pip install seaborn, or use a matplotlib colour map such as "
                         "viridis") from None


def check_cmap(name: str) -> str:
    """Validate a colour map name: matplotlib's, or one of seaborn's :data:`SEABORN_CMAPS`
    (seaborn is imported then, and only then)."""
    if name not in matplotlib.colormaps and is_seaborn_cmap(name):
        _register_seaborn(name)
    if name not in matplotlib.colormaps:
        names = sorted({*matplotlib.colormaps, *SEABORN_CMAPS})
        close = [c for c in names if c.lower().startswith(name[:3].lower())]
        hint = (f"try one of: {', '.join(close[:6])}" if close else
                f"try viridis, magma or Blues, or seaborn's {', '.join(SEABORN_CMAPS)}")
        raise UsageError(f"unknown colour map {name!r}", hint)
    return name


@dataclass(frozen=True)
class ColourTable:
    """A colour map as lookup tables: ``rgb[i]`` bytes and whether text on it should be white."""

    name: str
    rgb: np.ndarray  # [N, 3] uint8, what matplotlib paints for bin i
    light_text: np.ndarray  # [N] bool: luminance < 0.5 -> white text

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
        scaled = np.asarray(matrix, dtype=np.float64) / (vmax or 1.0)
        return self.unit_bins(scaled)

    def unit_bins(self, unit: np.ndarray) -> np.ndarray:
        """Bin index of values already mapped to ``0..1`` (NaN -> 0)."""
        size = self.size
        scaled = np.nan_to_num(np.asarray(unit, dtype=np.float64), nan=0.0)
        return np.clip(scaled * size, 0, size - 1).astype(np.intp)


@functools.lru_cache(maxsize=16)
def colour_table(name: str) -> ColourTable:
    """The lookup tables of a named matplotlib colour map."""
    cmap = matplotlib.colormaps[check_cmap(name)]
    index = np.arange(cmap.N)
    rgb = np.ascontiguousarray(cmap(index, bytes=True)[:, :3], dtype=np.uint8)
    floats = cmap(index)[:, :3]
    luminance = 0.299 * floats[:, 0] + 0.587 * floats[:, 1] + 0.114 * floats[:, 2]
    rgb.setflags(write=False)
    light = luminance < 0.5
    light.setflags(write=False)
    return ColourTable(name, rgb, light)


def parse_vmax(value: str | float | None) -> float | None:
    """``--vmax``: ``auto`` (or ``None``) is the shown data's maximum; else a number > 0."""
    if value is None:
        return None
    if isinstance(value, str):
        if value.strip().lower() in ("auto", ""):
            return None
        try:
            number = float(value)
        except ValueError:
            raise UsageError(f"--vmax {value!r} is not a number",
                             "use auto (the largest weight shown) or a number such as 1 or "
                             "0.5") from None
    else:
        number = float(value)
    if not math.isfinite(number) or not 0 < number <= VMAX_LIMIT:
        raise UsageError(f"--vmax {value} is out of range",
                         f"use auto or a number above 0 and at most {VMAX_LIMIT:g}; "
                         "--vmax 1 keeps the fixed 0..1 scale")
    return number


@dataclass(frozen=True)
class ColourScale:
    """How weights map to colours.

    Attributes:
        kind: ``linear``, ``power`` (``(w / top) ** gamma``) or ``log`` (three decades below
            the top).
        gamma: the exponent of the power scale (0.5 lifts small weights; 1 is linear).
        vmax: the weight drawn in the top colour; ``None`` (``auto``): the largest weight shown.
    """

    kind: str = DEFAULT_SCALE
    gamma: float = DEFAULT_GAMMA
    vmax: float | None = None

    @classmethod
    def of(cls, scale: str | None = None, gamma: float | None = None,
           vmax: str | float | None = DEFAULT_VMAX) -> ColourScale:
        """A checked scale from option values (``None`` for the defaults)."""
        if gamma is not None and (scale or DEFAULT_SCALE) != "power" \
                and (scale or DEFAULT_SCALE) in SCALES:
            raise UsageError(f"--gamma only applies to --scale power, not --scale {scale}",
                             "drop --gamma, or use --scale power")
        made = cls(scale or DEFAULT_SCALE, DEFAULT_GAMMA if gamma is None else float(gamma),
                   parse_vmax(vmax))
        made.check()
        return made

    def check(self) -> None:
        """Raise :class:`UsageError` for an unknown scale or a gamma out of range."""
        if self.kind not in SCALES:
            raise UsageError(f"unknown colour scale {self.kind!r}",
                             f"use one of {', '.join(SCALES)}")
        low, high = GAMMA_RANGE
        if not (math.isfinite(self.gamma) and low <= self.gamma <= high):
            raise UsageError(f"--gamma {self.gamma:g} is out of range",
                             f"use {low:g} to {high:g} (0.5 lifts small weights; 1 is linear)")
        if self.vmax is not None:
            parse_vmax(self.vmax)

    def resolve(self, data: np.ndarray | Sequence[np.ndarray]) -> ResolvedScale:
        """The scale for this data: an ``auto`` top becomes the data's largest finite value."""
        top = self.vmax
        if top is None:
            arrays = [data] if isinstance(data, np.ndarray) else list(data)
            finite = [float(np.nanmax(a)) for a in arrays if np.size(a)]
            top = max([v for v in finite if math.isfinite(v)], default=0.0)
            if top <= 0:
                top = 1.0
        return ResolvedScale(self.kind, self.gamma, float(top), self.vmax is None)


def _format_value(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 0.1:
        return f"{value:.2f}"
    return f"{value:.2g}"


@dataclass(frozen=True)
class ResolvedScale:
    """A colour scale with its top known: maps weights to ``0..1``."""

    kind: str
    gamma: float
    top: float
    auto: bool

    @property
    def floor(self) -> float:
        """The lowest weight the log scale tells apart (``top / 1000``)."""
        return self.top / 10.0 ** LOG_DECADES

    def unit(self, values: np.ndarray) -> np.ndarray:
        """Weights -> ``0..1`` (float64), computed as matplotlib's norms compute them."""
        data = np.asarray(values, dtype=np.float64)
        if self.kind == "linear":
            return data / self.top
        if self.kind == "power":
            positive = np.where(data > 0, data, 0.0)
            return np.power(positive, self.gamma) / self.top ** self.gamma
        low, high = math.log10(self.floor), math.log10(self.top)
        with np.errstate(divide="ignore", invalid="ignore"):
            logs = np.log10(np.clip(data, self.floor, self.top))
        return (logs - low) / (high - low)

    def tick_units(self) -> list[float]:
        """Where the colour bar's ticks sit, in ``0..1`` (the same for every top)."""
        if self.kind == "log":
            return [i / LOG_DECADES for i in range(LOG_DECADES + 1)]
        return [0.0, 0.5, 1.0]

    def tick_values(self) -> list[float]:
        """The weight at each tick."""
        units = self.tick_units()
        if self.kind == "linear":
            return [u * self.top for u in units]
        if self.kind == "power":
            return [self.top * u ** (1.0 / self.gamma) for u in units]
        return [self.floor * 10.0 ** (u * LOG_DECADES) for u in units]

    def tick_labels(self) -> list[str]:
        """The tick labels; the top one is the maximum, the log scale's bottom one ``<=``."""
        labels = [_format_value(v) for v in self.tick_values()]
        if self.kind == "log":
            labels[0] = "\u2264" + labels[0]
        return labels

    @property
    def name(self) -> str:
        if self.kind == "power":
            return "sqrt scale" if self.gamma == 0.5 else f"power {self.gamma:g} scale"
        return f"{self.kind} scale"

    def label(self, what: str = "attention weight") -> str:
        """The colour bar's label: what is shown, the scale, and what the top is."""
        top = "top = max shown" if self.auto else f"top = {_format_value(self.top)} (fixed)"
        return f"{what}\n{self.name}, {top}"

    def colours(self, matrix: np.ndarray, table: ColourTable,
                masked: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(rgb, bins)`` of a ``[query, key]`` matrix: uint8 ``[query, key, 3]`` and bins;
        ``masked`` cells (boolean ``[query, key]``) are drawn in :data:`MASKED_RGB`."""
        bins = table.unit_bins(self.unit(matrix))
        rgb = table.rgb[bins]
        if masked is not None and masked.any():
            rgb = rgb.copy()
            rgb[masked] = MASKED_RGB
        return rgb, bins
