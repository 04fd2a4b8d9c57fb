"""The benchmark runs here (scaled-down shapes) and compares like with like."""

import gemma4_mlx.bench as bench


def test_variant_configs_keep_the_layer_pattern_and_kv_sharing():
    e2b = bench.variant_config("e2b", layers=10)
    assert e2b["layer_types"] == ["sliding_attention"] * 4 + ["full_attention"] + ["sliding_attention"] * 4 + ["full_attention"]
    # 20 of 35 layers share K/V in E2B; scaled down, the share is kept but one period still owns K/V.
    assert e2b["num_kv_shared_layers"] == 5
    assert bench.variant_config("31b", layers=6)["layer_types"][-1] == "full_attention"
    assert bench.variant_config("26b-a4b")["num_hidden_layers"] == 30


def test_bench_prints_a_side_by_side_table(capsys):
    rows = bench.main([
        "--variants", "e2b", "--layers", "10", "--vocab", "2048", "--dtype", "float32",
        "--prompt-tokens", "24", "--gen-tokens", "6", "--repeats", "1",
    ])
    out = capsys.readouterr().out
    assert "| variant | layers | prefill tok/s (ours / mlx-lm / ratio)" in out
    assert "| e2b | 10 |" in out
    (row,) = rows
    assert row["ours"].prefill_tps > 0 and row["mlx_lm"].decode_tps > 0
    # Same weights, same greedy decoding, fp32: both models must produce the same tokens.
    assert row["ours"].tokens == row["mlx_lm"].tokens
    assert len(row["ours"].tokens) == 6


def test_memory_bench_folder_loads_in_both_and_measures(tmp_path):
    """bench_memory's checkpoint (mlx-lm's gemma4_text layout, converter's quantization rules) loads
    in ours, mapped or not, and in mlx-lm, with the same greedy tokens; the table is filled in."""
    from checkpoints import text_config

    from gemma4_mlx import bench_memory

    text = text_config("e2b", hidden_size_per_layer_input=32, vocab_size=2048, vocab_size_per_layer_input=2048)
    folder = bench_memory.write_checkpoint(tmp_path / "ckpt", text=text, progress=lambda _: None)
    config = __import__("json").loads((folder / "config.json").read_text())
    assert config["quantization"]["model.embed_tokens_per_layer"]["bits"] == 8  # the converter's PLE rule
    results = [bench_memory.measure(kind, folder, prompt_tokens=8, gen_tokens=3) for kind in bench_memory.KINDS]
    assert results[0]["tokens"] == results[1]["tokens"] == results[2]["tokens"] and len(results[0]["tokens"]) == 3
    assert all(r["loaded"]["VmRSS"] > 0 and r["generated"]["VmHWM"] >= r["generated"]["VmRSS"] for r in results)
    table = bench_memory.memory_table(results)
    assert table.count("\n") == 4 and "RSS at start" in table and "| ours-lazy-ple |" in table and "| mlx-lm |" in table
