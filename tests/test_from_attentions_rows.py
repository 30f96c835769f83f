"""``Capture.from_attentions`` on a padded batch: which row, whose tokens, and padding read
without its mask are refused with a message naming the keyword to pass."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnviz.capture import Capture
from attnviz.errors import UsageError

SHORT = "Short one."
LONG = "The cat sat on the mat because it was warm."


@pytest.fixture(scope="module")
def batch(minilm):
    """A right-padded batch: row 0 is the short text (padded), row 1 the long one."""
    tokenizer = minilm.tokenizer
    enc = tokenizer([SHORT, LONG], padding=True, return_tensors="pt")
    with torch.no_grad():
        outputs = minilm.model(**enc, output_attentions=True)
    tokens = [tokenizer.convert_ids_to_tokens(row) for row in enc["input_ids"]]
    assert "[PAD]" in tokens[0] and "[PAD]" not in tokens[1]
    return outputs.attentions, tokens, enc, tokenizer


def test_a_batch_of_two_without_batch_index_is_refused(batch):
    attentions, tokens, enc, _ = batch
    for given in (tokens[1], tokens):  # one row's tokens, or the whole batch of tokens
        with pytest.raises(UsageError, match=r"batch of 2 rows: pass batch_index="):
            Capture.from_attentions(attentions, given)
    with pytest.raises(UsageError, match=r"batch_index="):
        Capture.from_attentions(attentions, tokens[1], attention_mask=enc["attention_mask"])
    # A batch of one needs no index, and an explicit index still works.
    single = [a[1:2] for a in attentions]
    assert Capture.from_attentions(single, tokens[1]).num_tokens == len(tokens[1])
    chosen = Capture.from_attentions(attentions, tokens[1], batch_index=1)
    np.testing.assert_array_equal(chosen.weights[0, 0],
                                  attentions[0][1, 0].numpy().astype(np.float32))


def test_tokens_of_another_row_are_refused(batch, minilm):
    attentions, tokens, enc, tokenizer = batch
    mask = enc["attention_mask"]
    # Row 1's tokens under row 0's (padded) weights: real words where row 0 pads.
    with pytest.raises(UsageError, match=r"padding in row 0 of the attention mask") as info:
        Capture.from_attentions(attentions, tokens[1], batch_index=0, attention_mask=mask)
    assert "batch_index" in str(info.value.hint)
    with pytest.raises(UsageError, match=r"padding in row 0"):  # the tokenizer changes nothing
        Capture.from_attentions(attentions, tokens[1], batch_index=0, attention_mask=mask,
                                tokenizer=tokenizer)
    # Row 0's padded tokens under row 1's weights: [PAD] where row 1 has real tokens.
    with pytest.raises(UsageError, match=r"is '\[PAD\]', but row 1 of the attention mask"):
        Capture.from_attentions(attentions, tokens[0], batch_index=1, attention_mask=mask)
    # Neither the padded length nor the row's real length: the message says both.
    real = int(mask[0].sum())
    with pytest.raises(UsageError, match=rf"got {real + 1} tokens for {len(tokens[1])} "
                                         rf"positions \({real} real in row 0"):
        Capture.from_attentions(attentions, tokens[1][:real + 1], batch_index=0,
                                attention_mask=mask)
    # The right row's tokens, padded or not, give the unbatched capture.
    reference = minilm.capture(SHORT)
    for given in (tokens[0], tokens[0][:real]):
        built = Capture.from_attentions(attentions, given, batch_index=0, attention_mask=mask)
        assert built.tokens == reference.tokens
        np.testing.assert_allclose(built.weights, reference.weights, atol=1e-5, rtol=0)


def test_padding_read_without_its_mask_is_refused(batch):
    attentions, tokens, enc, _ = batch
    real = int(enc["attention_mask"][0].sum())
    with pytest.raises(UsageError, match=r"no attention from any query, layer or head") as info:
        Capture.from_attentions(attentions, tokens[0], batch_index=0)
    assert f"key positions {real}, " in info.value.message  # the first padding position
    assert "attention_mask=" in str(info.value.hint)
    # Without padding, the same call is fine.
    assert Capture.from_attentions(attentions, tokens[1], batch_index=1).num_tokens == len(
        tokens[1])


def test_zero_columns_need_a_mask_only_when_not_causal():
    size = 4
    weights = np.zeros((1, 1, size, size), dtype=np.float32)
    weights[..., :3] = 1 / 3  # key 3 is never attended to
    tokens = ["a", "b", "c", "d"]
    with pytest.raises(UsageError, match=r"key position 3 gets no attention"):
        Capture.from_attentions([weights], tokens)
    # A mask of ones says every key is real: accepted as it is.
    kept = Capture.from_attentions([weights], tokens, attention_mask=np.ones(size))
    np.testing.assert_array_equal(kept.weights[0, 0], weights[0, 0])
    # A causal capture's last key is seen by the last query only: never refused.
    causal = np.tril(np.ones((size, size), dtype=np.float32))
    causal /= causal.sum(-1, keepdims=True)
    assert Capture.from_attentions([causal[None, None]], tokens).causal is True
