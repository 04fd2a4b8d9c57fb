"""Benchmarks, side by side with mlx-lm in one run. Tools: the library never imports them.

    python -m gemma4_mlx.bench           # speed (prefill and decode tokens/s), see bench/speed.py
    python -m gemma4_mlx.bench.memory    # resident memory with the PLE table mapped or loaded
    python -m gemma4_mlx.bench.chat      # the cost of a new chat turn, with and without prefix reuse
"""
