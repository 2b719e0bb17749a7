"""The compiled static-cache path: a model's KV cache preallocated once, where rollback moves a position, and its
forwards of a few tokens (the draft's step, the target's verification) compiled with `torch.compile`.

gpt-fast's answer to rounds bound by per-operation overhead rather than bytes (a GPU, or a small pair): one
`StaticCache` per model, sized at load time and reused by each request in turn (batch size 1, one request at a
time), and one compiled graph per forward width (inductor on CPU, its wrapper in C++ for a small model;
`reduce-overhead`, CUDA graphs, on CUDA). After width 1, torch.compile makes the width dynamic, so two
compilations serve every width up to `max_width`; wider forwards (a prompt's prefill) run eagerly on the same
cache. A request that could outgrow the cache uses the dynamic cache (kv_cache.CachedModel) instead.

The static cache also serves the prompt cache: a request that keeps its caches (the prompt cache on, and
`cache_prompt`) leaves its committed tokens' keys and values in it (`StaticDecoding.held`), and the next request
that shares a prefix with them prefills only the rest of its prompt: a conversation's next turn, an agent's next
step, the same system prompt again. A request that would write over them first gives a copy to the prompt cache
(`held_cache`, prompt_cache.py's entries), and a request that an entry serves better than the static cache has the
entry's keys and values copied in (`claim`): conversations taking turns each find theirs.

    compile_model(model, device)                # what load_pair(compile=...) does to each model of the pair
    cached = cache_for(model, needed, prompt)   # the engine: a StaticCachedModel where the model has a compiled
                                                # form, starting from the prefix of `prompt` it holds
"""

import logging
import types
import weakref

import torch
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import StaticLayer

from .errors import SpecDecError
from .kv_cache import CachedModel, context_length, growing_cache, input_device
from .prompt_cache import cache_length, common_prefix
from .threads import gevent_patched, unpatched

logger = logging.getLogger(__name__)

COMPILE_CHOICES = ("auto", "true", "false")
# The longest sequence a static cache holds (capped by the model's context): the service's default prompt and
# completion limits (max_prompt_tokens 4096 + max_new_tokens_limit 1024). Every step attends over all of it,
# masked, so a larger one costs every token; a longer request takes the dynamic cache.
STATIC_CACHE_TOKENS = 5120
MAX_WIDTH = 17  # the widest compiled forward: gamma up to 16 and its bonus position
# On CPU a model this small (parameters and buffers, in elements) takes inductor's C++ wrapper: its steps are bound
# by the Python that calls each kernel, which the wrapper removes. A larger one keeps the Python wrapper, whose
# compile is far shorter: the default pair's load with compile took 1,437 s with the C++ wrapper against 171 s
# without, for steps of 154 against 212 ms (and its eager steps take 49 ms: bench/README.md).
CPP_WRAPPER_MAX_ELEMENTS = 100_000_000


def resolve_compile(value, device: torch.device) -> bool:
    """"auto" | True | False (or "true" / "false"): whether the pair takes the compiled path. `auto` is on for
    CUDA, where a small pair's rounds are bound by kernel launches, and off on CPU, where the default pair's
    compiled path measured several times slower than its eager one (bench/README.md, "Rounds bound by
    overhead")."""
    name = str(value).strip().lower() if value is not None else "auto"
    if isinstance(value, bool):
        name = "true" if value else "false"
    if name not in COMPILE_CHOICES:
        raise SpecDecError(f"compile must be auto, true or false, got {value!r}", field="compile")
    if name == "auto":
        return torch.device(device).type == "cuda"
    return name == "true"


class StaticDecoding:
    """One model's compiled form: its static cache and its compiled step. Requests take turns with the cache
    (`claim`); a cache a newer request has claimed refuses the older one's forwards instead of mixing them. While a
    request holds it (`busy`: it has neither ended nor been dropped), another that starts beside it (two streams
    of one decoder read in turn) decodes on a dynamic cache instead (`cache_for`)."""

    def __init__(self, model, max_len: int, cuda_graphs: bool):
        self.model = model
        self.max_len = max_len
        self.cache = StaticCache(config=model.config, max_cache_len=max_len)
        # the latest claim's owner: a request's cache by a weak reference (a request dropped unended frees the
        # cache), another owner (the warm-up's) as it is; `_released` once its request has ended
        self._owner: weakref.ref | object | None = None
        self._released = True
        # the token ids whose keys and values the cache holds, left by the last request that kept them (`hold`)
        self.held: list[int] = []
        # only full-attention layers keep every position: a sliding-window (or recurrent) layer forgets what left
        # its window, so such a cache cannot go back to a prefix
        self.reusable = all(type(layer) is StaticLayer for layer in self.cache.layers)
        self.cuda_graphs = cuda_graphs
        # A code object of its own: torch.compile keeps its graphs and guards per code object, so this model's
        # graphs (two: width 1, and every width after it) are never another's, and only the guards on tensors
        # (shapes, dtypes, devices) need checking per call: the model and its settings do not change once
        # compiled. The guards on Python objects cost more than a small model's forward (bench/README.md).
        own = types.FunctionType(_step.__code__.replace(), _step.__globals__, _step.__name__)
        self._own = own
        # on CPU, once warmed up: the code torch.compile made for width 1 and for wider forwards, called directly
        # (`_call_directly`), by whether the width is over 1
        self._direct: dict[bool, types.FunctionType] = {}
        options = {"guard_filter_fn": torch.compiler.keep_tensor_guards_unsafe}
        if cuda_graphs:
            options["triton.cudagraphs"] = True  # mode "reduce-overhead", which cannot be named beside options
        elif input_device(model).type == "cpu" and _elements(model) <= CPP_WRAPPER_MAX_ELEMENTS:
            # the graph's wrapper in C++, not Python: one call from Python a step, not one per kernel, with the GIL
            # released inside it (the tiny pair's compiled target-only decode 7,676 against 5,660 tokens/s,
            # Google 1,859 against 1,410: bench/README.md, "Rounds bound by overhead")
            options["cpp_wrapper"] = True
        self.step = torch.compile(own, fullgraph=True, options=options)

    def claim(self, owner: object, prompt: list[int] | None = None, reused: DynamicCache | None = None) -> int:
        """The cache for a new request (only its position moves): emptied, or with `prompt`, cut to the longest
        prefix of it that the cache holds, at most all but its last token (whose logits the prefill must give);
        where `reused` (a prompt-cache entry's cache, holding such a prefix) holds a longer one, its keys and values
        written over the cache's. The number of tokens kept."""
        self._owner = weakref.ref(owner) if isinstance(owner, StaticCachedModel) else owner
        self._released = owner is None
        length = int(self.cache.get_seq_length())
        keep = 0
        if prompt is not None and self.reusable:
            keep = min(common_prefix(self.held, prompt), len(prompt) - 1, length)
        self.held = []  # the new owner writes over the rest; it says what the cache holds when it ends (`hold`)
        self.cache.crop(keep - length)
        if reused is not None and self.reusable and cache_length(reused) > keep:
            keep = self._load(reused)
        return keep

    @torch.inference_mode()
    def _load(self, cache: DynamicCache) -> int:
        """The cache emptied, then given `cache`'s keys and values (copies, in place: the static addresses stay);
        how many positions."""
        self.cache.crop(-int(self.cache.get_seq_length()))
        for index, layer in enumerate(cache.layers):
            self.cache.update(layer.keys, layer.values, index)
        return int(self.cache.get_seq_length())

    @property
    def owner(self) -> object | None:
        """Whose the cache is: the latest claim's owner, while it exists."""
        return self._owner() if isinstance(self._owner, weakref.ref) else self._owner

    @property
    def busy(self) -> bool:
        """Whether a request holds the cache: it claimed it and has neither released it nor been dropped."""
        return not self._released and isinstance(self._owner, weakref.ref) and self._owner() is not None

    def release(self, owner: object) -> None:
        """`owner`'s request has ended: the cache is free for the next (what it holds stays, `hold`)."""
        if owner is self.owner:
            self._released = True

    def overwritten_by(self, prompt: list[int]) -> bool:
        """Whether a request for `prompt` that takes this cache writes over some of what it holds."""
        return bool(self.held) and common_prefix(self.held, prompt) < len(self.held)

    @torch.inference_mode()
    def held_cache(self) -> DynamicCache:
        """A dynamic cache holding copies of the keys and values of `held` (a prompt-cache entry's)."""
        held, copied = len(self.held), growing_cache(self.model.config)
        for index, layer in enumerate(self.cache.layers):
            copied.update(layer.keys[:, :, :held], layer.values[:, :, :held], index)
        return copied

    def hold(self, owner: object, token_ids: list[int]) -> None:
        """`owner`'s request ended, its cache holding the keys and values of the first tokens of `token_ids` (a
        prefix of its sequence; the cache is cut to them where it holds more): the next request may start from them.
        Nothing if a newer request has claimed the cache since."""
        if owner is not self.owner or not self.reusable:
            return
        length = int(self.cache.get_seq_length())
        kept = min(len(token_ids), length)
        self.cache.crop(kept - length)
        self.held = list(token_ids[:kept])

    @torch.inference_mode()
    def forward(self, owner: object, ids: torch.Tensor) -> torch.Tensor:
        """(n, V): the logits of the n new tokens, after the cached ones."""
        if owner is not self.owner:
            raise SpecDecError("this model's static cache was taken by a newer request")
        if ids.shape[1] > MAX_WIDTH:
            return self.model(input_ids=ids, cache=self.cache, use_cache=True).logits[0]
        out = self.compiled_step(ids)
        return out.clone() if self.cuda_graphs else out  # a CUDA graph's output is overwritten by the next call

    @property
    def called_directly(self) -> bool:
        """Whether the compiled code is called past torch.compile's wrapper and guards (`_call_directly`)."""
        return bool(self._direct)

    def compiled_step(self, ids: torch.Tensor) -> torch.Tensor:
        """The compiled forward of `ids` (1, width <= MAX_WIDTH): its code called directly where it can be
        (`_call_directly`), else through torch.compile's guards."""
        return self._direct.get(ids.shape[1] > 1, self.step)(self, ids)

    def warm_up(self) -> None:
        """Compile (and on CUDA, record) every width up to MAX_WIDTH on a throwaway sequence; on CPU, then call
        the compiled code directly (`_call_directly`)."""
        device = input_device(self.model)
        ids = torch.zeros(1, MAX_WIDTH + 1, dtype=torch.long, device=device)
        owner = object()
        self.claim(owner)
        with torch.no_grad():  # the cache's tensors are made here, outside inference mode: CUDA graphs update them
            self.model(input_ids=ids[:, :1], cache=self.cache, use_cache=True)  # outside it too
        with torch.inference_mode():
            for width in range(1, MAX_WIDTH + 1):
                self.forward(owner, ids[:, :width])
                self.cache.crop(-width)
            if not self.cuda_graphs:
                try:
                    self._call_directly(owner, ids)
                except Exception:  # noqa: BLE001 - dynamo's internals moved: the guarded calls serve as before
                    logger.debug("not calling the compiled code directly", exc_info=True)
                    self._direct = {}
        self.claim(None)

    def _call_directly(self, owner: object, ids: torch.Tensor) -> None:
        """From now on call the code torch.compile made directly, without its wrapper and guards (vLLM's dispatch
        to the compiled code): 20-25 us less a forward, a fifth of the tiny pair's compiled step (bench/README.md,
        "Rounds bound by overhead"). The guards it skips are those on tensors (the others are dropped already):
        this model's parameters and cache, always the same tensors, and `ids`, always (1, width) integers on the
        model's device, width at most MAX_WIDTH; they pick the graph by width, and so does `forward` here: the
        graph made for width 1 alone where there is one, and the one whose guards take every wider width. Taken
        only where there is such a graph and, at every width, the direct call gives the very logits of the
        guarded one; else the guarded calls stay."""
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        entries = _debug_get_cache_entry_list(self._own.__code__)

        def takes(entry, width: int) -> bool:
            return bool(entry.guard_manager.check({"decoding": self, "ids": ids[:, :width]}))

        wide = [entry for entry in entries if all(takes(entry, width) for width in range(2, MAX_WIDTH + 1))]
        one = [entry for entry in entries if takes(entry, 1) and not takes(entry, 2)] or \
            [entry for entry in wide if takes(entry, 1)]
        if not wide or not one:
            logger.debug("not calling the compiled code directly: no graph for %s", "width 1" if wide else "widths 2+")
            return
        codes = {wider: types.FunctionType(entries_[0].code, self._own.__globals__, self._own.__name__)
                 for wider, entries_ in ((False, one), (True, wide))}
        prefix = ids[:, :3]  # a few positions in, as a request's steps are
        self.forward(owner, prefix)
        for width in range(1, MAX_WIDTH + 1):
            with torch.inference_mode(False):  # a tensor of its own, as a request's (StaticCachedModel.forward)
                step = ids[:, :width].clone()
            guarded = self.step(self, step).clone()
            self.cache.crop(-width)
            direct = codes[width > 1](self, step)
            self.cache.crop(-width)
            if not torch.equal(guarded, direct):
                logger.warning("the compiled code called directly differs at width %d; it is called guarded", width)
                return
        self.cache.crop(-prefix.shape[1])
        self._direct = codes


def _elements(model) -> int:
    """How many elements the model's parameters and buffers hold (packed weights count their bytes)."""
    return sum(t.numel() for t in model.parameters()) + sum(t.numel() for t in model.buffers())


def _step(decoding: StaticDecoding, ids: torch.Tensor) -> torch.Tensor:
    """The compiled step: the logits of `ids` after the cached tokens, (n, V); the cache takes their keys."""
    return decoding.model(input_ids=ids, cache=decoding.cache, use_cache=True).logits[0]


class StaticCachedModel(CachedModel):
    """CachedModel over a model's StaticDecoding: the same `length`, `forward` and `rollback`, on the
    preallocated cache."""

    def __init__(self, static: StaticDecoding, prompt: list[int] | None = None, reused: DynamicCache | None = None):
        self.model = static.model
        self.device = input_device(static.model)
        self.static = static
        self.cache = static.cache
        self._length = static.claim(self, prompt, reused)  # tokens of `prompt` the cache holds

    @property
    def length(self) -> int:
        return self._length

    def forward(self, tokens: list[int], keep: int = 1) -> torch.Tensor:
        if self._length + len(tokens) > self.static.max_len:
            raise SpecDecError(f"the static cache holds {self.static.max_len} tokens")
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        logits = self.static.forward(self, ids)
        self._length += len(tokens)
        return logits[-keep:]

    def rollback(self, length: int) -> None:
        extra = self._length - length
        if extra > 0:
            self.cache.crop(-extra)
            self._length = length

    def hold(self, token_ids: list[int]) -> None:
        """The request ends: the cache holds the keys and values of `token_ids[:length]` (StaticDecoding.hold)."""
        self.static.hold(self, token_ids[: self._length])
        self._length = min(self._length, len(token_ids))

    def release(self) -> None:
        """The request has ended: another may take the static cache."""
        self.static.release(self)


def takes_static_cache(model, needed: int) -> bool:
    """Whether a request that may hold `needed` tokens decodes `model` on its static cache (`cache_for`): it has
    one that holds them, and no other request holds it now."""
    static = getattr(model, "specdec_static", None)
    return static is not None and needed <= static.max_len and not static.busy


def cache_for(model, needed: int, prompt: list[int] | None = None, reused: DynamicCache | None = None) -> CachedModel:
    """The model's cache for a request that may hold `needed` tokens: its static cache where it has a compiled
    form that holds them and no other request holds it (with `prompt`, starting from the longest prefix of it
    that the cache or `reused`, a prompt-cache entry's cache, holds), else a dynamic one (`reused`, or a new one),
    decoded eagerly. The request releases a static cache when it ends (`StaticCachedModel.release`)."""
    if takes_static_cache(model, needed):
        return StaticCachedModel(model.specdec_static, prompt, reused)
    return CachedModel(model, reused)


def compile_model(model, device: torch.device, role: str | None = None) -> bool:
    """Give `model` its compiled form (`model.specdec_static`) and compile every width. Returns whether it did: a
    model whose forward cannot be compiled whole (one warning says why, naming the model's `role`) keeps the eager
    path.

    The model's attention goes back to the library's sdpa first: ours (specdec.cpu.attention) decides per call
    from the mask's values, which a compiled graph cannot. Our few-rows linear layers stay: their operator has a
    shape function, so they compile into the graph as calls.
    """
    from .cpu.attention import restore_attention, use_gqa_attention

    ours = restore_attention(model)
    limit = context_length(model) or STATIC_CACHE_TOKENS
    static = StaticDecoding(model, min(limit, STATIC_CACHE_TOKENS), cuda_graphs=torch.device(device).type == "cuda")
    try:
        # under gevent the compiler runs as a child process, one at a time (a pool's threads would be greenlets)
        threads = {"compile_threads": 1} if gevent_patched() else {}
        with unpatched("os", "subprocess", "signal"), torch._inductor.config.patch(**threads):
            static.warm_up()
    except Exception as error:  # anything torch.compile refuses leaves the model as it was
        if ours:
            use_gqa_attention(model)  # its eager forwards row-invariant again
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        if any(type(module).__module__.startswith("torch.ao.nn.quantized") for module in model.modules()):
            reason += "; torch's int8 layers do not compile: draft_quantization int4 or none does"
        logger.warning("%s (%s) cannot be compiled whole (%s); it stays eager", f"the {role}" if role else "the model",
                       type(model).__name__, reason, exc_info=logger.isEnabledFor(logging.DEBUG))
        return False
    model.specdec_static = static
    return True
