"""Attention for decoding and multi-token verification on CPU: one token at a time after cached tokens, each
token's query heads as the rows of one call per key/value head; grouped heads not copied.

For a forward over several new tokens with a KV cache (a verification over gamma+1 tokens), transformers' sdpa
path has a mask and then copies every key and value head `num_key_value_groups` times (`repeat_kv`) in every
layer: Qwen2.5-1.5B (12 query heads, 2 key/value heads) copies its whole cache six-fold twice per layer, about
10 ms of a 350 ms verification. torch's SDPA takes grouped heads directly (`enable_gqa=True`), with the same
results. And one masked call over all new tokens sums in another order than decoding them one by one does, so
with the plain causal mask (one sequence, no padding) each new token gets the unmasked call that decoding it
makes (`one_query_attention`, which a decoded token gets too, and which is 2-10x faster than torch's one-query
call with `enable_gqa` on CPU): with the few-rows linears (specdec.cpu.linear), a verification forward gives
bitwise the logits of target-only decoding, float32 or bfloat16, and greedy speculative output equals greedy
target-only output by construction, not only away from near ties. Padded masks keep the single grouped call, and so
do forwards wider than any verification (ROW_BY_ROW_MAX rows): after cached tokens such a forward is the prefill of
what the prompt cache did not hold, the same forward in every method. The
function is registered through transformers' AttentionInterface under its own name and selected per model
(`set_attn_implementation`), so other models in the process keep the library's behaviour.
"""

import logging

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..kv_cache import input_device
from ..params import MAX_GAMMA

logger = logging.getLogger(__name__)

GQA_ATTENTION = "specdec_sdpa_gqa"
# the widest verification forward: a hybrid round's gamma model and up to as many lookup proposals, and the bonus
ROW_BY_ROW_MAX = 2 * MAX_GAMMA + 1


def gqa_sdpa_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention, except that a token decoded after cached ones and the new tokens of a
    verification are attended to one by one, each by `one_query_attention`, and that several masked queries over
    grouped heads skip `repeat_kv`."""
    grouped = getattr(module, "num_key_value_groups", 1) > 1
    plain = all(kwargs.get(name) is None for name in ("position_bias", "softcap")) \
        and not kwargs.get("output_attentions", False)
    rows, keys = query.shape[2], key.shape[2]
    # a wider forward after cached tokens is a prefill of what the prompt cache did not hold: every method runs the
    # same one, so it takes the single call (row by row, hundreds of rows cost seconds per layer)
    one_by_one = rows == 1 and attention_mask is None or \
        rows <= ROW_BY_ROW_MAX and rows < keys and is_causal_mask(attention_mask, rows, keys)
    if plain and one_by_one:
        # Each query row gets the call that decoding its token makes, on the same keys and values, so the output
        # is bitwise the same whatever the number of rows; one masked call over all rows sums in another order
        # (1e-6 apart in float32, a rounding step of bfloat16). A 5-token verification of the default target at
        # 450 cached tokens costs about what one masked call does (`python -m bench.attention`)
        out = torch.cat([one_query_attention(query[:, :, i:i + 1], key[:, :, :keys - rows + i + 1],
                                             value[:, :, :keys - rows + i + 1], dropout, scaling)
                         for i in range(rows)], dim=2)
        return out.transpose(1, 2).contiguous(), None
    if not (grouped and plain and attention_mask is not None and rows > 1):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                           dropout_p=dropout, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


# read by cpu/decoder.py: its native layers attend to up to this many rows after cached ones as this function does
gqa_sdpa_forward.row_by_row = ROW_BY_ROW_MAX


def one_query_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout: float = 0.0,
                        scaling: float | None = None) -> torch.Tensor:
    """One token's attention, (batch, heads, 1, dim), over every key and value given, (batch, kv_heads, n, dim).

    The query heads that share a key/value head are the rows of one unmasked SDPA call over it (one token sees
    every key): the same result as a one-query call with `enable_gqa`, which torch's CPU kernel runs several times
    slower (at 450 keys about 2x in float32 and 5-10x in bfloat16, `python -m bench.attention`)."""
    batch, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(batch, kv_heads, heads // kv_heads, dim), key, value, dropout_p=dropout, scale=scaling)
    return out.reshape(batch, heads, 1, dim)


def is_causal_mask(mask: torch.Tensor | None, rows: int, keys: int) -> bool:
    """Whether `mask` is the plain causal mask of `rows` new tokens after `keys - rows` cached ones, one sequence:
    each new token sees every cached token and the new ones up to itself, and nothing is padded."""
    if mask is None or mask.dtype != torch.bool or tuple(mask.shape) != (1, 1, rows, keys):
        return False
    return torch.equal(mask[0, 0], torch.ones(rows, keys, dtype=torch.bool, device=mask.device).tril(keys - rows))


def _is_grouped(model) -> bool:
    config = model.config.get_text_config(decoder=True)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None)
    return bool(heads and kv_heads and kv_heads < heads)


def use_gqa_attention(model) -> bool:
    """Switch a CPU model that uses sdpa over grouped heads to `gqa_sdpa_forward`. Returns whether it did.

    CUDA models, other attention implementations and models without grouped heads are left as loaded.
    """
    if (model.config._attn_implementation != "sdpa" or not _is_grouped(model)
            or input_device(model).type != "cpu"
            or not model._can_set_attn_implementation()):
        return False
    AttentionInterface.register(GQA_ATTENTION, gqa_sdpa_forward)  # idempotent: a named entry in the registry
    AttentionMaskInterface.register(GQA_ATTENTION, sdpa_mask)  # the same masks as sdpa
    model.set_attn_implementation(GQA_ATTENTION)
    logger.debug("grouped-query attention without repeated heads for %s", type(model).__name__)
    return True


def restore_attention(model) -> bool:
    """Undo `use_gqa_attention`: the library's sdpa again. Returns whether anything changed."""
    if model.config._attn_implementation != GQA_ATTENTION:
        return False
    model.set_attn_implementation("sdpa")
    return True
