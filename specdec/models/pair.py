"""`load_pair`, the one entry point of model loading: a draft and a target (hub id, local folder, GGUF file or
alias) and the pair's one tokenizer, each step logged with its seconds.

    draft, target, tokenizer = load_pair()                      # the default pair, from the local cache
    draft, target, tokenizer = load_pair("org/small", "org/big", device_map="auto")

Local folders, GGUF files and the default pair never touch the hub; a hub id that cannot be loaded is one
SpecDecError sentence.
"""

from ..compiled import MAX_WIDTH, compile_model, resolve_compile
from ..errors import SpecDecError
from .draft_vocab import limit_draft_vocab, resolve_draft_vocab_size
from .kernels import apply_cpu_kernels, layer_kinds
from .load import load_draft, load_model, read_soon
from .memory import release_free_memory
from .quantization import resolve_draft_quantization
from .shipped import (
    four_bit_layers,
    gguf_origin,
    int4_draft_applies,
    keeps_shipped,
    load_kept,
    quantize_applies,
    resolve_quantize,
    resolve_weights,
    shipped_applies,
    use_shipped_weights,
)
from .sources import names_default_pair, resolve_device, resolve_device_map, resolve_dtype, resolve_source
from .startup import startup_step
from .tokenizers import load_and_check_tokenizers


def int4pack_layers(model, source) -> str:
    """`model`'s linear layers on torch's int4 kernel (specdec.cuda.int4pack), in place: a model from a GGUF takes
    its Q4_K layers as shipped and keeps its other layers as converted; a float model has every layer quantized.
    Says how many of each."""
    import torch

    from ..cuda.int4pack import int4pack_model

    shipped = four_bit_layers(model, source) if gguf_origin(source) is not None else None
    count = int4pack_model(model, shipped, quantize_rest=shipped is None)
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return f"{count} layers ({'as shipped' if shipped is not None else 'quantized'})"


def load_pair(draft: str | None = None, target: str | None = None, device: str = "auto", dtype: str = "auto",
              device_map=None, trust_remote_code: bool = False, cpu_kernels: bool = True,
              draft_quantization: str | None = "auto", compile: str | bool = "auto", weights: str = "shipped",
              quantize: str | None = "none", draft_vocab_size: int | str | None = "auto"):
    """(draft_model, target_model, tokenizer) ready for SpeculativeDecoder; None or "default" is the default pair.

    `device_map` (e.g. "auto") spreads the target over several GPUs with accelerate; the draft stays on `device`.
    `cpu_kernels`: float32 and bfloat16 CPU linear layers computed by our few-rows kernel (float32 ones packed once
    by oneDNN where it cannot be built; specdec.cpu.linear), so verifying gamma tokens in one target forward costs
    about what one token does, CPU attention over grouped heads skips copying the cache per head (specdec.cpu.attention), and
    CPU weights are read straight into the process's memory, tensor by tensor, not memory-mapped (`load_model`);
    models elsewhere or in float16 keep the library's kernels.
    `draft_quantization`: "auto" (default) is "int4" for the default pair's shipped draft (measured 1.05x faster
    Google with the confidence stop, its 4-bit form kept in the cache: bench/README.md, "A 4-bit draft") and "int8"
    for any other draft. "int8" quantizes a CPU draft's linear layers to int8 (the draft loaded in
    float32 for it, beside a float32 or bfloat16 target; not float16), which makes proposing 2.5-3x cheaper;
    outputs stay exactly the target's, since the rejection rule uses the quantized draft's own probabilities.
    "int4" quantizes a CPU draft's linear layers to 4-bit groups for the grouped kernel (`cpu.grouped.quantize`;
    a shipped draft's Q5_0, Q6_K and Q8_0 layers requantized from the GGUF's values, its form kept in the cache
    like the shipped one's): proposing about 1.2x cheaper than the shipped draft, with acceptance a little lower on
    some prompts. "none" (or None) keeps the draft as loaded. The target is never quantized. The default pair's
    int8 draft is kept in the cache and read from there at later starts (`load_draft`).

    `compile`: "auto" (default), True or False: the compiled static-cache path (specdec.compiled): each model's
    KV cache preallocated, and its forwards of up to `compiled.MAX_WIDTH` tokens compiled with torch.compile, every
    width before this returns. "auto" is on for CUDA and off on CPU (`compiled.resolve_compile`).

    `weights`: "shipped" (default) or "float". "shipped": a CPU model that comes from a GGUF file (the default
    pair, or a .gguf path) serves its linear layers and token embedding in the GGUF's own low-bit forms, computed
    by a few-rows integer kernel with x quantized to int8 per group (specdec.cpu.grouped; specdec.models.shipped):
    the same weights, about a fifth of the bytes per token. Such a draft is then not quantized again, but for
    draft_quantization = "int4". It is the default because it measured faster on our CPUs
    (target-only 14.1 against 4.5 tokens/s, Google 18.3 against 12.6 on code; bench/results/peers). "float": every
    layer in float, as dequantized when the GGUF was converted. CUDA models and other models are loaded as they
    are either way.

    `quantize`: "none" (default), "int4" or "int8". Any CPU model not served in GGUF form has its linear layers
    quantized per group of 32 for the grouped kernel (`cpu.grouped.quantize`): 4 bits with a scale and a minimum
    per group, or 8 bits symmetric. This changes the model: speculative decoding then samples exactly the quantized
    target's distribution, not the float one's. A quantized draft is not quantized again (draft_quantization).
    On one GPU, "int4" puts the linear layers on torch's int4 kernel (specdec.cuda.int4pack): a GGUF model's Q4_K
    layers as shipped (its other layers stay bfloat16), a float model's quantized; "int8" does not apply there.

    `draft_vocab_size`: the draft's output layer over its first N token ids and the special tokens only, every
    other logit -inf (models/draft_vocab.py): cheaper proposals, the output still exactly the target's. "auto"
    (default): 65,536 for the default pair, whose draft measured faster so; 0: the whole vocabulary.

    Each step logs one line with its seconds ("start-up: ...").
    """
    from ..engine import check_vocabularies

    with startup_step("checked the model sources"):
        draft_quantization = resolve_draft_quantization(draft_quantization)
        device = resolve_device(device)
        device_map = resolve_device_map(device_map)
        compiled = resolve_compile(compile, device)
        dtype = resolve_dtype(dtype, device)
        weights = resolve_weights(weights)
        target_source = resolve_source(target, "target")
        draft_source = resolve_source(draft, "draft")
        shipped = shipped_applies(weights, device, device_map, (draft_source, target_source))
        quantize = resolve_quantize(quantize)
        # float models quantized for the grouped kernel (bits, or None): shipped ones keep the GGUF's own forms
        applies = quantize_applies(quantize, device, device_map)
        bits = {role: (4 if quantize == "int4" else 8) if applies and not (shipped and gguf_origin(source)) else None
                for role, source in (("draft", draft_source), ("target", target_source))}
        draft_requantize = None  # a shipped draft's wider layers requantized to 4 bits
        draft_vocab_size = resolve_draft_vocab_size(draft_vocab_size, default_pair=names_default_pair(draft))
        if shipped and gguf_origin(draft_source) is not None:
            # "auto": the default pair's draft in 4-bit groups (its form kept in the cache); a .gguf path as shipped
            four_bit = draft_quantization == "int4" or (draft_quantization == "auto" and names_default_pair(draft))
            draft_requantize = 4 if four_bit else None
            draft_quantization = "none"  # its own low-bit weights instead
        elif draft_quantization == "auto":
            draft_quantization = "int8"  # a float draft: torch's int8, as measured
        elif draft_quantization == "int4" and bits["draft"] is None and int4_draft_applies(device):
            bits["draft"] = 4
        if bits["draft"]:
            draft_quantization = "none"  # quantized for the grouped kernel instead
        elif draft_quantization == "int4":
            draft_quantization = "int8"  # no grouped kernel here (int4_draft_applies warned): torch's int8

    # the target's weights start coming in at once, beside the tokenizers and the draft: reading waits on the disk
    # and on fresh memory, the others on one core; a pair that fails its checks drops them
    # a default-pair model whose GGUF weights are kept packed is read from them, and never its float linears
    keeps = {"draft": shipped and cpu_kernels and keeps_shipped(draft_source),
             "target": shipped and cpu_kernels and keeps_shipped(target_source)}
    pending = read_soon(target_source, dtype, trust_remote_code) \
        if cpu_kernels and device.type == "cpu" and device_map is None and not keeps["target"] else None
    try:
        tokenizer = load_and_check_tokenizers(draft_source, target_source, trust_remote_code)
        draft_model = load_kept(draft_source, "draft", dtype, trust_remote_code, draft_requantize) \
            if keeps["draft"] else None
        kept = {"draft": draft_model is not None}  # read from its kept form (one still unusable: packed below)
        if draft_model is None:
            draft_model = load_draft(draft_source, device, dtype, draft_quantization, trust_remote_code, cpu_kernels)
    except BaseException:
        if pending is not None:
            pending.drop()
        raise
    target_model = load_kept(target_source, "target", dtype, trust_remote_code) if keeps["target"] else None
    kept["target"] = target_model is not None
    if target_model is None:
        target_model = load_model(target_source, "target", device, dtype, device_map, trust_remote_code, cpu_kernels,
                                  pending)
    check_vocabularies(draft_model, target_model, tokenizer)
    vocab_size = target_model.config.get_text_config(decoder=True).vocab_size
    if len(tokenizer) > vocab_size:
        raise SpecDecError(f"the tokenizer has {len(tokenizer)} tokens but the models only {vocab_size} logits",
                           field="target_model")
    # (models read from their kept forms have their GGUF layers in place already: no step, no "0 layers" line)
    if shipped and (gguf_origin(draft_source) or gguf_origin(target_source)) and not (kept["draft"] and kept["target"]):
        with startup_step("the GGUF's own weights") as note:
            counts = [use_shipped_weights(draft_model, draft_source, draft_requantize),
                      use_shipped_weights(target_model, target_source)]
            release_free_memory()
            note["detail"] = "; ".join(
                f"{role}: " + ("from its kept form" if kept[role] else
                               f"{count} layers{' (4-bit)' if role == 'draft' and draft_requantize else ''}")
                for role, count in zip(("draft", "target"), counts))
    if (bits["target"] or bits["draft"]) and device.type == "cuda":
        with startup_step("int4 layers for torch's CUDA kernel (a GGUF's Q4_K layers as shipped, a float model's "
                          "quantized: this changes the model)") as note:
            counts = [int4pack_layers(model, source) if bits[role] else "0 layers"
                      for role, model, source in (("draft", draft_model, draft_source),
                                                  ("target", target_model, target_source))]
            note["detail"] = f"draft: {counts[0]}; target: {counts[1]}"
    elif bits["target"] or bits["draft"]:
        from ..cpu.grouped import quantize_model

        what = f"the float models to {quantize}" if bits["target"] else "the draft to int4"
        with startup_step(f"quantized {what} (this changes the model)") as note:
            counts = [quantize_model(model, bits[role]) if bits[role] else 0
                      for role, model in (("draft", draft_model), ("target", target_model))]
            release_free_memory()
            note["detail"] = f"draft: {counts[0]} layers; target: {counts[1]} layers"
    with startup_step("CPU kernels for the pair") as note:
        apply_cpu_kernels(draft_model, target_model, draft_quantization, cpu_kernels)
        release_free_memory()
        note["detail"] = f"draft: {layer_kinds(draft_model)}; target: {layer_kinds(target_model)}"
    if draft_vocab_size:
        with startup_step("the draft's vocabulary") as note:
            rows = limit_draft_vocab(draft_model, tokenizer, draft_vocab_size)
            note["detail"] = f"{rows} of {vocab_size} logits computed" if rows else "the whole vocabulary"
    if compiled:
        for role, model in (("draft", draft_model), ("target", target_model)):
            with startup_step(f"compiled the {role}'s forwards of 1 to {MAX_WIDTH} tokens") as note:
                if compile_model(model, device, role):
                    note["detail"] = f"static cache of {model.specdec_static.max_len} tokens"
                else:  # the warning before this line says why
                    note["what"] = f"tried to compile the {role}'s forwards: it stays eager"
    return draft_model, target_model, tokenizer
