"""QUADS rollout side: the SGLang "quads" quantization method, its W4A4 NVFP4 kernels and RAC."""
