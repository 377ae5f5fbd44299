"""QUADS rollout side: the `--quantization quads` SGLang plugin and the W4A4 NVFP4 (+RAC) kernels.

This package file imports nothing, so `quads_megatron.kernels` works without SGLang installed;
`sglang_ext.plugin.register` (the `sglang.srt.plugins` entry point) is what touches SGLang.
"""
