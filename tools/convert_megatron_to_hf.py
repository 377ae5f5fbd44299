"""Thin wrapper: same as the `quads-convert-megatron-to-hf` console script (quads_megatron.convert.megatron_to_hf)."""

from quads_megatron.convert.megatron_to_hf import console_main

if __name__ == "__main__":
    console_main()
