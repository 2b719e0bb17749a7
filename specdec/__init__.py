"""specdec: exact speculative decoding (Leviathan et al. 2023, Chen et al. 2023) for Hugging Face causal LMs."""

from .engine import Chunk, GenerationResult, SpeculativeDecoder, Stream
from .errors import SpecDecError
from .params import METHODS, SamplingParams
from .stats import GenerationStats

__all__ = ["METHODS", "Chunk", "GenerationResult", "GenerationStats", "SamplingParams", "SpecDecError",
           "SpeculativeDecoder", "Stream", "load_pair"]


def __getattr__(name):
    # load_pair pulls in the model-loading stack; import it only when asked for
    if name == "load_pair":
        from .loading import load_pair

        return load_pair
    raise AttributeError(f"module 'specdec' has no attribute {name!r}")
