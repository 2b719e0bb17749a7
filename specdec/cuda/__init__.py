"""CUDA forms of the layers: 4-bit groups on torch's own int4 kernel (int4pack)."""
