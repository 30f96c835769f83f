"""A local model is named by its folder in every title a person reads; the record keeps the path."""

from __future__ import annotations

import numpy as np

from attnviz.capture import Capture

PATH = "/home/someone/checkpoints/run-17/my-llama"


def _capture() -> Capture:
    rng = np.random.default_rng(0)
    weights = rng.random((2, 2, 4, 4)).astype(np.float32)
    weights /= weights.sum(-1, keepdims=True)
    tokens = ["a", "b", "c", "d"]
    return Capture(tokens=tokens, word_ids=[0, 1, 2, 3], special=[False] * 4, weights=weights,
                   layers=[0, 1], heads=[0, 1], num_layers=2, num_heads=2, model=PATH,
                   causal=False, text="a b c d")


def test_report_documents_carry_the_label_and_the_path():
    from attnviz.render.html import doc_data

    doc = doc_data(_capture())
    assert doc["model"] == PATH
    assert doc["model_label"] == "my-llama"


def test_served_capture_and_topk_titles_use_the_label():
    from attnviz.server.engine import capture_payload, topk_payload
    from attnviz.server.requests import TopkRequest

    payload = capture_payload(_capture())
    assert payload["model_label"] == "my-llama" and payload["model"] == PATH
    params = TopkRequest.model_construct(text="a b c d", pair=None, model=None, layer=1, head=0,
                                         k=2, query=None, words=False, exclude_special=False,
                                         format="json")
    title = topk_payload(_capture(), params)["title"]
    assert title.startswith("my-llama: layer 1, head 0") and PATH not in title


def test_notebook_summaries_use_the_label(monkeypatch):
    import attnviz.notebook as notebook

    monkeypatch.setattr(notebook, "MAX_REPR_WEIGHTS", 1)  # the summary of a large capture
    text = notebook.capture_html(_capture())
    assert "attnviz capture</b> of my-llama:" in text and PATH not in text
    view = notebook.AttentionView(_capture())
    assert "my-llama" in repr(view) and PATH not in repr(view)


def test_the_front_end_titles_name_the_label():
    from attnviz.render.html import _asset

    script = _asset("report.js")
    assert "function modelName(meta)" in script
    assert "meta.model +" not in script  # every title goes through modelName
