"""Pretrain a Qwen3-MoE preset on offline text and save it as an HF checkpoint (``quads-pretrain``; see its --help).

    python tools/pretrain_moe.py --preset moe-240m --train-iters 600 --save runs/moe-240m-hf
"""

from quads_megatron.apps.pretrain import console_main

if __name__ == "__main__":
    console_main()
