"""Loading the pair once per process, on the engine thread: /healthz answers at once, /readyz says 503 until the
draft, the target and the tokenizer are resident and warmed up.

Under gunicorn this runs in the worker, after fork (CUDA cannot be re-initialised in a forked child), and on the
engine's own OS thread (concurrency.py), so the event loop keeps answering while the models load.
"""

import gc
import json
import logging
import os
import threading
import time
from collections.abc import Callable

from ..engine import SpeculativeDecoder, eos_token_ids
from ..errors import SpecDecError
from ..grammar import GrammarCompiler
from ..kv_cache import input_device
from ..models.startup import startup_step
from ..prompt_cache import default_budget, memory_bytes, weights_bytes
from ..text import concatenates, decoder_of, longest_token
from .concurrency import EngineThread
from .config import Settings
from .errors import ApiError
from .metrics import peak_resident_memory_bytes, resident_memory_bytes
from .structured import CALL_BEGIN, CALL_END

logger = logging.getLogger(__name__)


class ModelHost:
    """The resident pair of one app: `decoder`, `tokenizer` and `eos_token_ids` once loaded, or `load_error`."""

    # whether the loaded heap is frozen (`freeze_heap`) before the pair is served: set by the gunicorn worker, in a
    # process that serves one app until it exits; not elsewhere (a test's process makes many apps, and a frozen
    # one's cycles would never be collected)
    freezes_heap = False

    def __init__(self, settings: Settings, engine: EngineThread,
                 on_ready: Callable[[float], None] = lambda load_seconds: None):
        self.settings = settings
        self.engine = engine
        self.decoder: SpeculativeDecoder | None = None
        self.tokenizer = None
        self.decode_text: Callable[[list[int]], str] | None = None  # text.decoder_of(tokenizer)
        self.text_concatenates = False  # text.concatenates(tokenizer): decode_text joins the tokens' texts
        self.eos_token_ids: list[int] = []
        self.grammars: GrammarCompiler | None = None  # structured outputs' compiler, for the served tokenizer
        self.special_tool_tokens = False  # <tool_call> and </tool_call> are tokens of the tokenizer
        self.longest_token = 1  # text.longest_token(tokenizer): a bound on the characters one token covers
        self.info: dict = {}
        self.load_error: str | None = None
        self._on_ready = on_ready
        self._loaded = threading.Event()
        self._lock = threading.Lock()
        self._failure_callbacks: list[Callable[[str], None]] = []

    def start(self) -> None:
        self.engine.submit(self._load)

    def wait(self, timeout: float | None = None) -> bool:
        """True once loading has finished (successfully or not) within `timeout` seconds."""
        return self._loaded.wait(timeout)

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Call `callback(message)` if loading fails (at once, if it already has). gunicorn exits the worker."""
        with self._lock:
            if self.load_error is None:
                self._failure_callbacks.append(callback)
                return
        callback(self.load_error)

    def require_ready(self) -> None:
        if self.decoder is not None:
            return
        if self.load_error is not None:  # the reason (paths and all) is in the log, not in answers
            raise ApiError(503, "not_ready", "model loading failed; the server log says why")
        raise ApiError(503, "not_ready", "the models are still loading",
                       headers={"Retry-After": str(self.settings.retry_after)})

    def _load(self) -> None:
        s = self.settings
        start = time.perf_counter()
        logger.info("loading draft %s and target %s (device %s, dtype %s)", s.draft_model, s.target_model,
                    s.device, s.dtype)
        try:
            draft, target, tokenizer = (s.loader or load_configured_pair)(s)
            decoder = SpeculativeDecoder(draft, target, tokenizer, lookup=s.lookup,
                                         prompt_cache_bytes=prompt_cache_budget(s, draft, target))
            # those the pair can produce (a checkpoint's config may name one past its vocabulary: it ends nothing)
            self.eos_token_ids = sorted(i for i in eos_token_ids(target, tokenizer) if 0 <= i < decoder.vocab_size)
            with startup_step("warmed up (two greedy tokens)"):
                warmup = tokenizer.encode("Hello", add_special_tokens=False)[:1] or [0]
                decoder.generate(warmup, params=s.sampling.replace(max_new_tokens=2, temperature=0.0,
                                                                   cache_prompt=False))
            self.info = {"models": {"draft": display_name(draft, s.draft_model),
                                    "target": display_name(target, s.target_model)},
                         "device": str(input_device(target)), "dtype": str(target.dtype).removeprefix("torch."),
                         "context_length": decoder.context_length,
                         # 0: off
                         "prompt_cache_bytes": decoder.prompt_cache.budget
                         if decoder.caches_prompt(s.sampling.replace(cache_prompt=True)) else 0,
                         "load_seconds": round(time.perf_counter() - start, 2),
                         "resident_memory_bytes": resident_memory_bytes(),
                         "peak_resident_memory_bytes": peak_resident_memory_bytes()}
            with startup_step("built the grammar tables (structured outputs)"):
                self.grammars = grammar_compiler(tokenizer, decoder.vocab_size)
                self.special_tool_tokens = all(tokenizer.convert_tokens_to_ids(token) not in (None, tokenizer.unk_token_id)
                                               for token in (CALL_BEGIN, CALL_END))
            self.longest_token = longest_token(tokenizer)  # before the decoder: it makes the service ready
            if self.freezes_heap:
                with startup_step("froze the loaded heap (gc.freeze)") as note:
                    frozen, before, after = freeze_heap()
                    note["detail"] = (f"{frozen} objects; a full collection took {1e3 * before:.1f} ms before, "
                                      f"{1e3 * after:.1f} ms after")
            self.tokenizer, self.decode_text, self.decoder = tokenizer, decoder_of(tokenizer), decoder
            self.text_concatenates = concatenates(tokenizer)
            self._on_ready(self.info["load_seconds"])
            logger.info("models ready in %.1f s, resident memory %s (peak %s): %s", self.info["load_seconds"],
                        _gigabytes(self.info["resident_memory_bytes"]),
                        _gigabytes(self.info["peak_resident_memory_bytes"]), json.dumps(self.info))
        except Exception as error:  # noqa: BLE001 - any failure must be reported, and stops a gunicorn worker
            message = str(error) if isinstance(error, SpecDecError) else f"{type(error).__name__}: {error}"
            logger.error("model loading failed: %s", message, exc_info=not isinstance(error, SpecDecError))
            with self._lock:
                self.load_error = message
                callbacks = list(self._failure_callbacks)
            for callback in callbacks:
                callback(message)
        finally:
            self._loaded.set()


def freeze_heap() -> tuple[int, float, float]:
    """Collect what is garbage, then move every object left (the models, torch's and transformers' modules, the
    compiled code) to the collector's permanent generation, as vLLM, SGLang and TensorRT-LLM do once started: a
    collection of the oldest generation, which stops the process (the engine thread and every connection) for as
    long as it walks the heap, then walks only what was made since. (objects frozen, seconds of a full collection
    before, after)"""
    started = time.perf_counter()
    gc.collect()
    before = time.perf_counter() - started
    gc.freeze()
    started = time.perf_counter()
    gc.collect()
    after = time.perf_counter() - started
    return gc.get_freeze_count(), before, after  # (counting the frozen objects walks them too: tens of ms)


def grammar_compiler(tokenizer, vocab_size: int) -> GrammarCompiler | None:
    """The compiler of structured outputs' grammars, or None (logged) for a tokenizer llguidance cannot read."""
    try:
        return GrammarCompiler(tokenizer, vocab_size)
    except Exception as error:  # noqa: BLE001 - the service runs on without structured outputs
        logger.warning("structured outputs are off: llguidance cannot read the tokenizer (%s: %s)",
                       type(error).__name__, error)
        return None


def load_configured_pair(settings: Settings):
    """specdec.load_pair with the model settings (the default loader)."""
    from ..models.pair import load_pair  # the model-loading stack is imported only when a pair is loaded

    return load_pair(draft=settings.draft_model, target=settings.target_model, device=settings.device,
                     dtype=settings.dtype, device_map=settings.device_map,
                     trust_remote_code=settings.trust_remote_code,
                     draft_quantization=settings.draft_quantization, compile=settings.compile,
                     weights=settings.weights, quantize=settings.quantize,
                     draft_vocab_size="auto" if settings.draft_vocab_size is None else settings.draft_vocab_size)


def prompt_cache_budget(settings: Settings, draft, target) -> int:
    """The configured prompt_cache_bytes, or for "auto" the default from the weights and the memory of the
    target's device (prompt_cache.default_budget)."""
    if settings.prompt_cache_bytes is not None:
        return settings.prompt_cache_bytes
    return default_budget(weights_bytes(draft, target), memory_bytes(input_device(target)))


def _gigabytes(count: int | None) -> str:
    return "unknown" if count is None else f"{count / 1e9:.2f} GB"


def display_name(model, configured: str) -> str:
    """The model's name for /readyz: a Hugging Face id as is, a local folder or file by its last component only
    (answers never show server paths)."""
    name = str(getattr(model, "name_or_path", None) or configured)
    return os.path.basename(os.path.normpath(name)) if os.path.exists(name) else name
