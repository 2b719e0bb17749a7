"""The draft's output layer over part of the vocabulary (`draft_vocab_size`): the first N token ids and the
tokenizer's special tokens, every other logit -inf (FR-Spec, Zhao et al. 2025; EAGLE-3's draft vocabulary).

The default draft's output layer is over a third of the bytes a draft step reads (151,936 rows of 896). The rejection
rule is exact for any draft distribution q, so a draft that gives the other tokens probability 0 leaves the output
the target's: where the target wants one of them, the proposal is rejected and the residual draws it. Byte-level
BPE tokenizers (GPT-2's, Qwen's, Llama 3's) number their tokens in the order their merges were learned, most
frequent first, so the first N ids stand for the most frequent N (FR-Spec counts a corpus instead).

    limit_draft_vocab(draft, tokenizer, 65536)   # load_pair(draft_vocab_size=...) does this
"""

import logging

import torch
from torch import nn

from ..cpu.grouped import TILE, GroupedLinear, Tiled
from ..cpu.linear import FewRowsLinear, int8_linear
from ..errors import SpecDecError

logger = logging.getLogger(__name__)

# "auto": the default pair's draft over its first 65,536 ids (measured: bench/README.md, "The draft's vocabulary");
# any other pair over its whole vocabulary
DEFAULT_PAIR_DRAFT_VOCAB = 65536


def resolve_draft_vocab_size(value, default_pair: bool) -> int:
    """"auto" (or None): DEFAULT_PAIR_DRAFT_VOCAB for the default pair, else 0; 0: the whole vocabulary; N > 0: the
    first N ids and the special tokens."""
    if value is None or isinstance(value, str) and value.strip().lower() == "auto":
        return DEFAULT_PAIR_DRAFT_VOCAB if default_pair else 0
    try:
        size = int(value)
    except (TypeError, ValueError):
        raise SpecDecError(f"draft_vocab_size must be auto or a whole number, got {value!r}",
                           field="draft_vocab_size") from None
    if size < 0 or isinstance(value, bool) or size != float(value):
        raise SpecDecError(f"draft_vocab_size must be auto or a whole number >= 0, got {value!r}",
                           field="draft_vocab_size")
    return size


def _ranges(ids: list[int], align: int, end: int) -> list[tuple[int, int]]:
    """Sorted ids as [start, stop) ranges, widened to multiples of `align` (stop capped at `end`), overlaps merged."""
    ranges: list[list[int]] = []
    for i in sorted(ids):
        start, stop = i // align * align, min(end, (i // align + 1) * align)
        if ranges and start <= ranges[-1][1]:
            ranges[-1][1] = max(ranges[-1][1], stop)
        else:
            ranges.append([start, stop])
    return [(a, b) for a, b in ranges]


def _grouped_rows(head: GroupedLinear, start: int, stop: int) -> GroupedLinear:
    """Rows start..stop of a grouped linear (whole tiles), holding views of its buffers."""
    part = GroupedLinear.__new__(GroupedLinear)
    nn.Module.__init__(part)
    part.in_features, part.out_features = head.in_features, stop - start
    part.bits, part.group = head.bits, head.group
    for name in Tiled.BUFFERS:
        tensor = getattr(head, name)
        part.register_buffer(name, None if tensor is None else tensor[start // TILE: -(-stop // TILE)])
    part.bias = None if head.bias is None else nn.Parameter(head.bias[start:stop], requires_grad=False)
    return part


class PartialHead(nn.Module):
    """An output layer computed for some row ranges only, the other logits -inf: (..., K) -> (..., V)."""

    def __init__(self, head: nn.Module, ranges: list[tuple[int, int]]):
        super().__init__()
        self.out_features, self.in_features = head.out_features, head.in_features
        self.starts = [start for start, _ in ranges]
        if type(head) is GroupedLinear:
            self.parts = nn.ModuleList(_grouped_rows(head, start, stop) for start, stop in ranges)
        elif _is_int8(head):
            self.parts = nn.ModuleList(_int8_rows(head, start, stop) for start, stop in ranges)
        else:  # nn.Linear, or the few-rows kernel's: its weight's rows as views (a tied embedding stays shared)
            parts = []
            for start, stop in ranges:
                part = nn.Linear(head.in_features, stop - start, bias=head.bias is not None,
                                 device="meta", dtype=head.weight.dtype)
                part.weight = nn.Parameter(head.weight[start:stop], requires_grad=False)
                if head.bias is not None:
                    part.bias = nn.Parameter(head.bias[start:stop], requires_grad=False)
                parts.append(FewRowsLinear(part) if type(head) is FewRowsLinear else part)
            self.parts = nn.ModuleList(parts)

    @property
    def rows(self) -> int:
        """How many logits are computed."""
        return sum(part.out_features for part in self.parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_full((*x.shape[:-1], self.out_features), float("-inf"))
        for start, part in zip(self.starts, self.parts):
            out[..., start:start + part.out_features] = part(x)
        return out

    def extra_repr(self) -> str:
        spans = ", ".join(f"{start}..{start + part.out_features}" for start, part in zip(self.starts, self.parts))
        return f"in_features={self.in_features}, out_features={self.out_features}, computed: {spans}"


def _is_int8(head: nn.Module) -> bool:
    """Whether `head` is torch's int8 linear layer (the int8 draft's, cpu/linear.py)."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantizedLinear

    return type(head) is DynamicQuantizedLinear


def _int8_rows(head: nn.Module, start: int, stop: int) -> nn.Module:
    """Rows start..stop of torch's int8 linear layer: its int8 weight's rows (per-row scales) packed again. The
    activations are quantized per forward with one scale, the same in every part: the rows' logits are the
    whole layer's."""
    weight, bias = head._packed_params._weight_bias()
    return int8_linear(weight[start:stop], None if bias is None else bias[start:stop])


def partial_head(head: nn.Module, tokenizer, size: int) -> PartialHead | None:
    """`head` over its first `size` ids and the tokenizer's special tokens, or None where `size` leaves none out or
    the head is of another kind than a grouped, float (the few-rows kernel's too) or int8 linear one (said in a
    warning)."""
    vocab = getattr(head, "out_features", None)
    if size <= 0 or vocab is None or size >= vocab:
        return None
    if type(head) not in (GroupedLinear, nn.Linear, FewRowsLinear) and not _is_int8(head):
        logger.warning("draft_vocab_size applies to a grouped, float or int8 output layer; the draft's is %s.%s: "
                       "it keeps its whole vocabulary", type(head).__module__, type(head).__name__)
        return None
    align = TILE if type(head) is GroupedLinear else 1
    special = [i for i in getattr(tokenizer, "added_tokens_decoder", {}) if i >= size]
    special += [i for i in getattr(tokenizer, "all_special_ids", []) if i >= size]
    return PartialHead(head, _ranges(list(range(0, size, align)) + [i for i in special if i < vocab], align, vocab))


def limit_draft_vocab(draft: nn.Module, tokenizer, size: int) -> int:
    """Give the draft its `partial_head` as output layer, where it has one. Returns the logits it computes (0:
    unchanged)."""
    partial = partial_head(draft.get_output_embeddings(), tokenizer, size)
    if partial is None:
        return 0
    draft.set_output_embeddings(partial)
    return partial.rows
