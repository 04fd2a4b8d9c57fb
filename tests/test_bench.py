"""The benchmark runs here (scaled-down shapes) and compares like with like."""

import os
import time
import re

import pytest

import gemma4_mlx.bench.speed as bench
from gemma4_mlx.variants import variant_config


def test_variant_configs_keep_the_layer_pattern_and_kv_sharing():
    e2b = variant_config("e2b", layers=10)
    assert e2b["layer_types"] == ["sliding_attention"] * 4 + ["full_attention"] + ["sliding_attention"] * 4 + ["full_attention"]
    # 20 of 35 layers share K/V in E2B; scaled down, the share is kept but one period still owns K/V.
    assert e2b["num_kv_shared_layers"] == 5
    assert variant_config("31b", layers=6)["layer_types"][-1] == "full_attention"
    assert variant_config("26b-a4b")["num_hidden_layers"] == 30


def test_bench_prints_a_side_by_side_table(capsys):
    tic = time.perf_counter()
    rows = bench.main([
        "--variants", "e2b", "--layers", "10", "--vocab", "2048", "--dtype", "float32", "--narrow",
        "--prompt-tokens", "24", "--gen-tokens", "6", "--repeats", "1",
    ])
    elapsed = time.perf_counter() - tic
    out = capsys.readouterr().out
    assert "float32, narrow widths" in out and "| variant | layers | prefill tok/s (ours / mlx-lm / ratio)" in out
    assert "| e2b | 10 |" in out
    (row,) = rows
    # Both ran within the call: their rates cannot be below the counts over the whole call's time.
    for side in ("ours", "mlx_lm"):
        assert row[side].prefill_tps >= 24 / elapsed and row[side].decode_tps >= 5 / elapsed
    # Same weights, same greedy decoding, fp32: both models must produce the same tokens.
    assert row["ours"].tokens == row["mlx_lm"].tokens
    assert len(row["ours"].tokens) == 6


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="the memory benchmark reads Linux's /proc (macOS has no /proc)")
def test_memory_bench_folder_loads_in_both_and_measures(tmp_path):
    """bench_memory's checkpoint (mlx-lm's gemma4_text layout, converter's quantization rules) loads
    in ours, mapped or not, and in mlx-lm, with the same greedy tokens; the table is filled in."""
    from checkpoints import text_config

    from gemma4_mlx.bench import memory as bench_memory

    text = text_config("e2b", hidden_size_per_layer_input=32, vocab_size=2048, vocab_size_per_layer_input=2048)
    folder = bench_memory.write_checkpoint(tmp_path / "ckpt", text=text, progress=lambda _: None)
    config = __import__("json").loads((folder / "config.json").read_text())
    assert config["quantization"]["model.embed_tokens_per_layer"]["bits"] == 8  # the converter's PLE rule
    results = [bench_memory.measure(kind, folder, prompt_tokens=8, gen_tokens=3) for kind in bench_memory.KINDS]
    assert results[0]["tokens"] == results[1]["tokens"] == results[2]["tokens"] and len(results[0]["tokens"]) == 3
    for r in results:
        # Bytes, not kB or pages: a Python process with MLX and a model holds 50 MB to a few GB; and on
        # this CPU backend the arrays MLX holds are this process's resident memory.
        assert 50e6 < r["loaded"]["VmRSS"] < 16e9 and 50e6 < r["generated"]["VmHWM"] < 16e9
        assert r["mlx_active_loaded"] < r["loaded"]["VmRSS"] and r["mlx_peak_generating"] < r["generated"]["VmHWM"]
    table = bench_memory.memory_table(results)
    assert table.count("\n") == 4 and "RSS at start" in table and "| ours-lazy-ple |" in table and "| mlx-lm |" in table


def test_long_context_bench_prints_every_setting(capsys):
    """bench --long on E2B's attention shapes (narrow widths, a short context): ours with each cache,
    mlx-lm's 8-bit cache failing on the sliding layers; KV bytes per token as the caches hold them."""
    import gemma4_mlx.bench.long as long

    rows = long.main(["--variants", "e2b", "--contexts", "96", "--layers", "5", "--narrow", "--vocab", "1024", "--gen-tokens", "3"])
    out = capsys.readouterr().out
    assert "| e2b (10) | 96 | ours, 4-bit |" in out and "| e2b (10) | 96 | mlx-lm, 8-bit | fails: NotImplementedError" in out
    by = {(r["kind"], r["kv_bits"]): r for r in rows}
    assert by[("ours", None)]["kv_per_token"] == by[("mlx-lm", None)]["kv_per_token"]  # the same cache layout
    assert by[("ours", 8)]["kv_per_token"] < 0.55 * by[("ours", None)]["kv_per_token"]
    assert by[("ours", 4)]["kv_per_token"] < 0.3 * by[("ours", None)]["kv_per_token"]


def test_chat_bench_prints_reuse_and_decoding_beside_mlx_lm(capsys):
    """bench.chat: the second turn with and without reuse, then a reply's decoding speed, the
    engine's beside mlx-lm's on the same weights."""
    from gemma4_mlx.bench import chat as bench_chat

    bench_chat.main(["--layers", "3", "--vocab", "2048", "--narrow", "--dtype", "float32", "--history", "24", "--new", "4", "--reply", "2", "--decode", "6"])
    out = capsys.readouterr().out
    reuse_row = next(line for line in out.splitlines() if line.startswith("| 24 |"))
    assert "x |" in reuse_row
    rates = re.search(r"\| tok/s \| ([0-9.]+) \| ([0-9.]+) \| ([0-9.]+)x \|", out)
    assert rates and float(rates[1]) > 0 and float(rates[2]) > 0
