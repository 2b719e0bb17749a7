"""specdec: exact speculative decoding (Leviathan et al. 2023, Chen et al. 2023) for Hugging Face causal LMs."""

from .errors import SpecDecError
from .params import METHODS, LookupSettings, SamplingParams
from .stats import GenerationStats

__all__ = ["METHODS", "Chunk", "GenerationResult", "GenerationStats", "LookupSettings", "SamplingParams",
           "SpecDecError", "SpeculativeDecoder", "Stream", "load_pair"]
ENGINE_NAMES = ("Chunk", "GenerationResult", "SpeculativeDecoder", "Stream")


def __getattr__(name):
    # the engine pulls in torch and load_pair the model-loading stack: each is imported when first asked for, so
    # that what only reads settings (`python serving.py` before it becomes gunicorn, gunicorn's master) starts in
    # a fraction of a second instead of importing torch first
    if name in ENGINE_NAMES:
        from . import engine

        return getattr(engine, name)
    if name == "load_pair":
        from .models.pair import load_pair

        return load_pair
    raise AttributeError(f"module 'specdec' has no attribute {name!r}")
