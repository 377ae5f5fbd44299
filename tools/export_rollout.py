"""Thin wrapper: same as the `quads-export-rollout` console script (quads_megatron.convert.rollout_export)."""

from quads_megatron.convert.rollout_export import console_main

if __name__ == "__main__":
    console_main()
