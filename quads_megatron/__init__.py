"""QUADS: NVFP4 numerics, Megatron-Core AQAT integration, RL loop and converters."""
