"""CPU kernels for a loaded pair, chosen in place: the int8 draft, few-rows (or packed) linear layers, grouped-head
attention, and the weights in the process's own memory. Models on CUDA or in float16 keep the library's kernels."""

import torch

from .memory import use_own_memory
from .quantization import quantizes_draft


def apply_cpu_kernels(draft_model, target_model, draft_quantization: str = "none", cpu_kernels: bool = True) -> bool:
    """What `load_pair` does to a loaded pair, in place: the int8 draft, few-rows (or packed) linears, grouped-head
    attention, CPU weights in the process's own memory.

    Each step touches float32 or bfloat16 (or sdpa) CPU layers only; models on CUDA or in float16 are left as
    loaded.
    Returns whether the target's forward changed (so its verification cost may have).
    """
    prepare_draft(draft_model, draft_quantization, cpu_kernels)
    if not cpu_kernels:
        return False
    changed = use_cpu_kernels(target_model)
    for model in (draft_model, target_model):
        use_own_memory(model)
    return changed


def prepare_draft(draft_model, draft_quantization: str = "none", cpu_kernels: bool = True) -> None:
    """The draft's half of `apply_cpu_kernels`: int8 if asked and it applies (`quantizes_draft`; a bfloat16 draft
    made float32 first, as `load_draft` loads one), then CPU kernels for what stays float."""
    from ..cpu.linear import quantize_linears

    param = next(draft_model.parameters())
    if quantizes_draft(param.device, param.dtype, draft_quantization):
        if param.dtype != torch.float32:  # not one that load_draft gave, already float32
            draft_model.float()
        quantize_linears(draft_model)
    if cpu_kernels:
        use_cpu_kernels(draft_model)


def use_cpu_kernels(model) -> bool:
    """Few-rows (or packed) linears and grouped-head attention for one model, in place. Returns whether anything
    changed."""
    from ..cpu.attention import use_gqa_attention
    from ..cpu.linear import pack_linears

    return bool(pack_linears(model) + use_gqa_attention(model))


def use_stock_kernels(model) -> bool:
    """Undo `use_cpu_kernels`: the library's linear layers and attention again, on the same weights where the
    few-rows kernel was used (nothing copied). Returns whether anything changed."""
    from ..cpu.attention import restore_attention
    from ..cpu.linear import unpack_linears

    return bool(unpack_linears(model) + restore_attention(model))


def layer_kinds(model) -> str:
    """What computes a model's linear layers and attention, e.g. "169 DynamicQuantizedLinear, sdpa"."""
    from collections import Counter

    kinds = Counter(m._get_name() for m in model.modules() if hasattr(m, "in_features") and hasattr(m, "out_features"))
    linears = ", ".join(f"{count} {kind}" for kind, count in kinds.most_common())
    return f"{linears or 'no linear layers'}, attention {model.config._attn_implementation}"
