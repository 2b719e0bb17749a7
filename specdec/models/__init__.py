"""Model loading, one module per job; `load_pair` (pair.py) is the one entry point.

Imports point one way, from the bottom: startup (the start-up log), cache (where things are kept) and
checkpoint (safetensors files, no torch); default_pair (the default pair converted into the cache); weights
(checkpoints read into memory, ready forms); sources (model sources, devices, dtypes); tokenizers; memory
(process memory); quantization (the int8 draft); kernels (CPU kernels for a loaded pair); load (one model);
pair (`load_pair`). This file imports nothing, so that the torch-free modules stay torch-free.
"""
