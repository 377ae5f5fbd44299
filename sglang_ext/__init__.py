"""The `--quantization quads` SGLang plugin: a thin adapter (SGLang classes, parameter registration,
weight loaders) over `quads_megatron.kernels` and the checkpoint schema of `quads_megatron.plan`.

This package file imports nothing; `sglang_ext.plugin.register` (the `sglang.srt.plugins` entry
point) is what touches SGLang. Nothing in `quads_megatron` imports this package (import-linter).
"""
