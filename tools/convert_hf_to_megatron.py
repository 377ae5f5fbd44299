"""Thin wrapper: same as the `quads-convert-hf-to-megatron` console script (quads_megatron.convert.hf_to_megatron)."""

from quads_megatron.convert.hf_to_megatron import console_main

if __name__ == "__main__":
    console_main()
