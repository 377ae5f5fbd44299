"""Model descriptions: the names, shapes and parallel layouts of the architectures QUADS knows (Qwen3-MoE)."""
