"""Model specs from what callers give: a name or a spec plus options, checked; the LRU key.

The session, the server and the ``--server`` client build specs the same way here.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from attnviz.errors import UsageError
from attnviz.models import ModelSpec

_SPEC_KEYS = ("revision", "trust_remote_code", "device", "dtype", "toy", "device_map",
              "max_memory")


def make_spec(model: str | ModelSpec | None = None, **options: Any) -> ModelSpec:
    """A :class:`~attnviz.models.ModelSpec` from a name (default model when ``None``)."""
    from attnviz.models import default_model

    unknown = set(options) - set(_SPEC_KEYS)
    if unknown:
        raise UsageError(f"unknown model option(s): {', '.join(sorted(unknown))}",
                         f"model options are {', '.join(_SPEC_KEYS)}")
    from attnviz.models import check_spec

    if "toy" in options:
        options["toy"] = _toy_config(options["toy"])
    if isinstance(model, ModelSpec):
        spec = dataclasses.replace(model, **options) if options else model
    elif model is not None and not isinstance(model, str):
        raise UsageError(f"model must be a name such as \"minilm\", \"toy\", a Hugging Face id "
                         f"or a folder, not {type(model).__name__}",
                         "for a model object you already hold, use "
                         "attnviz.capture(model, tokenizer, text)")
    else:
        spec = ModelSpec(name=model or default_model(), **options)
    check_spec(spec)  # before the cache is asked: a cached entry must not hide a bad option
    return spec


def _toy_config(value: Any) -> Any:
    """The toy model's settings from a :class:`ToyConfig` or a dict of its fields."""
    from attnviz.models.toy import ToyConfig

    if value is None or isinstance(value, ToyConfig):
        return value
    fields = [f.name for f in dataclasses.fields(ToyConfig)]
    if not isinstance(value, dict):
        raise UsageError(f"toy must be a ToyConfig or a dict, not {type(value).__name__}",
                         f"e.g. toy={{\"layers\": 2, \"heads\": 4}} (fields: "
                         f"{', '.join(fields)})")
    unknown = sorted(str(k) for k in set(value) - set(fields))
    if unknown:
        raise UsageError(f"unknown toy setting(s): {', '.join(unknown)}",
                         f"the toy model's settings are {', '.join(fields)}")
    for name, item in value.items():
        flag = name in ("causal", "scale")
        if isinstance(item, bool) != flag or not isinstance(item, int):
            raise UsageError(f"toy setting {name} must be "
                             f"{'True or False' if flag else 'a whole number'}, not {item!r:.40}")
    return ToyConfig(**value)


def spec_key(spec: ModelSpec) -> str:
    """A stable text key of a model spec (the session's LRU key)."""
    return json.dumps(dataclasses.asdict(spec), sort_keys=True, default=str)


def _text_pairs(texts: Any) -> list[tuple[str, str | None]]:
    """``(text, pair)`` tuples from a list of texts, each a string or a ``(text, pair)``."""
    if isinstance(texts, (str, bytes)) or not hasattr(texts, "__iter__"):
        raise UsageError(f"captures() takes a list of texts, not {type(texts).__name__}",
                         "e.g. session.captures([\"The cat sat\", (\"A question\", "
                         "\"an answer\")])")
    pairs: list[tuple[str, str | None]] = []
    example = "e.g. \"The cat sat\" or (\"A question\", \"an answer\") or (\"A text\", None)"
    for number, item in enumerate(texts):
        if isinstance(item, str):
            pairs.append((item, None))
        elif isinstance(item, (tuple, list)) and len(item) == 2:
            if not isinstance(item[0], str) or not (item[1] is None or isinstance(item[1], str)):
                raise UsageError(f"text {number} must be a (text, pair) of strings (pair may be "
                                 f"None), not {item!r:.60}", example)
            pairs.append((item[0], item[1]))
        else:
            raise UsageError(f"each text must be a string or a (text, pair) tuple, not "
                             f"{item!r:.60}", example)
    return pairs
