"""Convert a Hugging Face Gemma 4 checkpoint (or a Gemma 4 assistant, the drafter for speculative
decoding) into MLX weights, optionally quantized.

The output folder holds sharded safetensors with an index, ``config.json`` (the original plus a
``quantization`` section), the tokenizer files, chat template and processor configs, and a short
model card. It is written to a temporary folder beside the target and renamed at the end, so an
interrupted or failed conversion never leaves a folder that looks complete.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from gemma4_mlx.config import read_json
from gemma4_mlx.loading import load_config, load_model, resolve_model_path
from gemma4_mlx.loading.assistant import load_drafter
from gemma4_mlx.loading.quantization import MODES, RECIPES, QuantizationPlan, quantize_model
from gemma4_mlx.models.assistant import ASSISTANT_MODEL_TYPES

DTYPES = ("bfloat16", "float16", "float32")
# Everything a checkpoint folder needs besides its weights and config.json.
SIDE_FILES = (
    "tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "chat_template.json", "generation_config.json", "processor_config.json",
    "preprocessor_config.json", "feature_extractor_config.json", "video_preprocessor_config.json",
)  # fmt: skip


class ConversionError(RuntimeError):
    """The conversion could not be completed; nothing was left at the output path."""


class OutputFolderError(FileExistsError):
    """``--mlx-path`` names a folder that a conversion must not replace."""


# The names a conversion writes. `--force` replaces only a folder holding nothing else: anything more
# (a user's file, a subfolder) means the folder is not ours to delete.
_OUTPUT_NAMES = {"config.json", "README.md", "model.safetensors.index.json", *SIDE_FILES}
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
# Temporary siblings of the output: `.NAME.partial-PID-…` (being written), `.NAME.old-PID-…` (being replaced).
_TEMP_KINDS = ("partial", "old")


def _is_conversion_output(folder: Path) -> tuple[bool, str]:
    """Whether ``folder`` is what an earlier conversion wrote (and nothing else), with the reason if not."""
    entries = sorted(folder.iterdir())
    other = [p.name for p in entries if not (p.is_file() and (p.name in _OUTPUT_NAMES or _SHARD_NAME.fullmatch(p.name)))]
    if other:
        return False, f"it holds {', '.join(other[:3])}{' and more' if len(other) > 3 else ''}, which a conversion does not write"
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False, "it has no readable config.json"
    if not isinstance(config, dict) or "mlx_dtype" not in config:
        return False, "its config.json was not written by python -m convert"
    return True, ""


def check_output_folder(out: Path, src: Path | None, force: bool) -> None:
    """Refuse an output folder that must not be written: the input checkpoint or a folder containing
    it (always), an existing non-empty folder (without ``force``), or, with ``force``, anything but the
    output of an earlier conversion. Raises :class:`OutputFolderError`."""
    target = out.resolve()
    if src is not None:
        source = src.resolve()
        if target == source:
            raise OutputFolderError(f"--mlx-path {out} is the input checkpoint itself; choose another output folder")
        if target in source.parents:
            raise OutputFolderError(f"--mlx-path {out} contains the input checkpoint {src}; choose another output folder")
    if not out.exists() and not out.is_symlink():
        return
    if not out.is_dir() or out.is_symlink():
        raise OutputFolderError(f"--mlx-path {out} exists and is not a folder; choose another output path")
    if not any(out.iterdir()):
        return  # an empty folder (made beforehand, say): nothing to lose
    if not force:
        raise OutputFolderError(f"{out} already exists; pass --force to replace an earlier conversion there")
    ours, why = _is_conversion_output(out)
    if not ours:
        raise OutputFolderError(f"--force replaces only the output of an earlier conversion, and {out} is not one: {why}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def remove_stale_temporaries(out: Path) -> list[Path]:
    """Delete the temporary siblings of ``out`` left by conversions that were killed (their process is
    gone); a conversion still running keeps its own. Returns what was removed."""
    removed = []
    pattern = re.compile(rf"\.{re.escape(out.name)}\.({'|'.join(_TEMP_KINDS)})-(\d+)-\w+")
    if not out.parent.is_dir():
        return removed
    for p in out.parent.iterdir():
        m = pattern.fullmatch(p.name)
        if m and p.is_dir() and not p.is_symlink() and int(m.group(2)) != os.getpid() and not _pid_alive(int(m.group(2))):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def _temporary_sibling(out: Path, kind: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.{kind}-{os.getpid()}-", dir=out.parent))


def _check_options(dtype: str, bits: int, group_size: int, mode: str, recipe: str | None) -> None:
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    if mode not in MODES:
        raise ValueError(f"--q-mode must be one of {', '.join(MODES)}, not {mode!r}")
    if bits not in MODES[mode]:
        raise ValueError(f"{mode} quantization supports {MODES[mode]} bits, not {bits}")
    if mode != "affine" and group_size != 32:
        raise ValueError(f"{mode} quantization needs --q-group-size 32")
    if mode == "affine" and group_size not in (32, 64, 128):
        raise ValueError(f"--q-group-size must be 32, 64 or 128, not {group_size}")
    if recipe is not None and recipe not in RECIPES:
        raise ValueError(f"--quant-recipe must be one of {', '.join(RECIPES)}, not {recipe!r}")


def _shards(weights: dict[str, mx.array], max_bytes: int) -> list[dict[str, mx.array]]:
    """Tensors in name order, cut into shards of at most ``max_bytes`` (one tensor may exceed it).
    Not mlx-lm's ``make_shards``: it takes whole GiB (an int shifted by 30), where ``--max-shard-gb``
    is a fraction of GB, and it keeps the caller's order (ours is sorted, so shards are reproducible)."""
    shards, current, size = [], {}, 0
    for k in sorted(weights):
        v = weights[k]
        if current and size + v.nbytes > max_bytes:
            shards.append(current)
            current, size = {}, 0
        current[k] = v
        size += v.nbytes
    if current:
        shards.append(current)
    return shards


def write_shards(folder: Path, weights: dict[str, mx.array], max_bytes: int, progress: Callable[[str], None] = print) -> int:
    """Save ``weights`` into ``folder`` as numbered safetensors shards of at most ``max_bytes`` (one
    tensor may exceed it) with a ``model.safetensors.index.json``; returns the tensor bytes written."""
    shards = _shards(weights, max_bytes)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        mx.save_safetensors(str(folder / name), shard, metadata={"format": "mlx"})
        nbytes = sum(v.nbytes for v in shard.values())
        total += nbytes
        weight_map.update(dict.fromkeys(shard, name))
        progress(f"[{i}/{len(shards)}] {name}: {len(shard)} tensors, {nbytes / 1e9:.2f} GB")
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    return total


def _model_card(source: str, config: dict, plan: QuantizationPlan | None, dtype: str, total_bytes: int) -> str:
    quant = "not quantized" if plan is None else (
        f"{plan.recipe or f'{plan.bits}-bit'} {plan.mode}, group size {plan.group_size}"
        + ("" if plan.towers else "; vision/audio towers in float")
    )
    return (
        f"# {Path(source).name} (MLX)\n\n"
        f"Converted from `{source}` with `python -m convert` (gemma4-mlx) for Apple's MLX.\n\n"
        f"- dtype: {dtype}\n- quantization: {quant}\n- weights: {total_bytes / 1e9:.2f} GB\n\n"
        "```python\nimport gemma4_mlx\nmodel, processor = gemma4_mlx.load(\"PATH\")\n```\n"
    )


def is_assistant(src: Path) -> bool:
    """Whether ``src`` holds a Gemma 4 assistant (drafter) rather than a Gemma 4 model."""
    raw = read_json(src / "config.json", what="a model config", missing=f"no config.json in {src}: is this a model folder?")
    return isinstance(raw, dict) and raw.get("model_type") in ASSISTANT_MODEL_TYPES


def cast_and_quantize(
    model: nn.Module,
    dtype: str = "bfloat16",
    quantize: bool = False,
    q_bits: int = 4,
    q_group_size: int = 64,
    q_mode: str = "affine",
    quant_recipe: str | None = None,
    quantize_towers: bool = False,
) -> QuantizationPlan | None:
    """Cast ``model``'s floats to ``dtype`` and, with ``quantize``, quantize it by the converter's rules:
    the tensors :func:`convert` writes (``convert.sizes`` counts them on a lazy model). Returns the
    applied plan, or None when nothing was quantized."""
    _check_options(dtype, q_bits, q_group_size, q_mode, quant_recipe if quantize else None)
    model.set_dtype(getattr(mx, dtype))
    if not quantize:
        return None
    return quantize_model(model, QuantizationPlan(q_bits, q_group_size, q_mode, quant_recipe, quantize_towers))


def convert(
    hf_path: str,
    mlx_path: str | Path,
    dtype: str = "bfloat16",
    quantize: bool = False,
    q_bits: int = 4,
    q_group_size: int = 64,
    q_mode: str = "affine",
    quant_recipe: str | None = None,
    quantize_towers: bool = False,
    force: bool = False,
    max_shard_gb: float = 5.0,
    progress: Callable[[str], None] = print,
) -> Path:
    """Convert ``hf_path`` (folder or Hub repo id) into an MLX folder at ``mlx_path``.

    An existing ``mlx_path`` is refused unless it is empty or, with ``force``, the output of an earlier
    conversion (nothing else in it); the input checkpoint and folders containing it are always refused.
    """
    # Checked again by cast_and_quantize, but here before a download or a read of the weights.
    _check_options(dtype, q_bits, q_group_size, q_mode, quant_recipe if quantize else None)
    if not (isinstance(max_shard_gb, (int, float)) and math.isfinite(max_shard_gb) and max_shard_gb > 0):
        raise ValueError(f"--max-shard-gb must be a positive number of GB, not {max_shard_gb!r}")
    out = Path(mlx_path).expanduser().absolute()
    local = Path(hf_path).expanduser()
    check_output_folder(out, local if local.is_dir() else None, force)
    src = resolve_model_path(hf_path)
    check_output_folder(out, src, force)  # a Hub download lands in the cache: never write over it
    if is_assistant(src):  # a drafter (google/gemma-4-*-it-assistant): small, loaded whole
        model = load_drafter(src, dtype=dtype)
    else:
        load_config(src)  # a clear error for anything that is not Gemma 4, before reading weights
        # The whole PLE table in memory: it is about to be written out (and maybe quantized).
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the CPU expert upcast below is undone, its warning is noise here
            model = load_model(src, dtype=dtype, lazy=True, lazy_ple=False, merge_projections=False)
    # load_model upcasts MoE experts to float32 on a CPU (a backend limit at run time); the files
    # must hold ``dtype`` whatever machine converts them. Every other float is ``dtype`` already.
    plan = cast_and_quantize(model, dtype, quantize, q_bits, q_group_size, q_mode, quant_recipe, quantize_towers)
    for note in plan.notes if plan else ():
        progress(f"note: {note}")
    weights = dict(tree_flatten(model.parameters()))

    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in remove_stale_temporaries(out):
        progress(f"removed {stale.name}, left by an interrupted conversion")
    tmp = _temporary_sibling(out, "partial")
    try:
        total = _write_folder(tmp, src, str(hf_path), weights, plan, dtype, int(max_shard_gb * 1e9), progress)
        _replace(out, tmp, force)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        if isinstance(e, OutputFolderError):
            raise
        raise ConversionError(f"conversion to {out} failed, nothing was written: {e}") from e
    progress(f"wrote {out} ({total / 1e9:.2f} GB)")
    return out


def _write_folder(folder: Path, src: Path, source: str, weights: dict, plan, dtype: str, max_bytes: int, progress) -> int:
    """Everything a converted folder holds: shards, config.json (with the quantization plan), the
    source's tokenizer and processor files, and a model card. Returns the tensor bytes written."""
    total = write_shards(folder, weights, max_bytes, progress)
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    config.pop("quantization", None)
    if plan is not None:
        config["quantization"] = plan.config()
    config["mlx_dtype"] = dtype  # also marks the folder as ours, for a later --force
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for name in SIDE_FILES:
        if (src / name).exists():
            shutil.copy2(src / name, folder / name)
    (folder / "README.md").write_text(_model_card(source, config, plan, dtype, total))
    return total


def _replace(out: Path, new: Path, force: bool) -> None:
    """Move the finished folder ``new`` to ``out``. An earlier output is checked once more (it may
    have changed during the conversion) and moved aside first, so ``out`` is never half written."""
    check_output_folder(out, None, force)
    if out.is_dir() and any(out.iterdir()):
        old = _temporary_sibling(out, "old")
        out.rename(old / out.name)
        new.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        if out.is_dir():
            out.rmdir()  # empty
        new.rename(out)
