"""Gemma 4 across several machines with MLX's distributed layer (``mx.distributed``, started by
``mlx.launch``: the ring backend over TCP, JACCL over Thunderbolt RDMA).

``load_sharded(path, group, parallel=...)`` gives each process its part of the model: a run of the
decoder's layers (:mod:`.pipeline`) or a share of every layer (:mod:`.tensor`). Every process then
runs the same generation code (``stream_generate``), or process 0 takes a chat's requests and the
others follow (:mod:`.lockstep`, ``ChatEngine.follow``). :mod:`.traffic` counts what crosses between
them; :mod:`.watchdog` bounds every wait on the others.
"""

from __future__ import annotations

import os
from pathlib import Path

import mlx.core as mx

from ..config import ModelConfig
from ..errors import OptionError
from .pipeline import PipelineStage, parse_split, split_layers
from .tensor import check_divisible, shard_layers
from .traffic import Traffic, measure_link
from .watchdog import TIMEOUT_VARIABLE, Watchdog, connecting, default_timeout

PARALLEL_MODES = ("pipeline", "tensor")


def world() -> mx.distributed.Group | None:
    """The group this process was launched in (``mlx.launch``), or None when it runs alone. Gives
    up with a clear message when the other processes cannot be reached in time (see :mod:`.watchdog`)."""
    if not mx.distributed.is_available():
        return None
    if "MLX_RANK" not in os.environ:  # not started by mlx.launch: nothing to connect to
        group = mx.distributed.init()
    else:
        timeout = default_timeout()
        message = (
            f"error: process {os.environ['MLX_RANK']} could not connect to the other processes in {timeout:.0f} s: "
            "check that every machine started (mlx.launch), the addresses in the hostfile, and the firewall. "
            f"(The limit is {TIMEOUT_VARIABLE}.)"
        )
        with connecting(timeout, message):
            group = mx.distributed.init()
    return group if group.size() > 1 else None


def machine_memory() -> int:
    """What this machine offers the model, in bytes (see :func:`gemma4_mlx.memory.device_memory`)."""
    from ..memory import device_memory

    return device_memory()


def plan_pipeline(config: ModelConfig, group: mx.distributed.Group, split: str | list[int] | None = None) -> PipelineStage:
    """This process's :class:`PipelineStage`: layers per rank as ``split`` gives them (``"20,15"`` or a
    list), else in proportion to each machine's memory (every process tells the others its own)."""
    layers = config.text_config.num_hidden_layers
    if isinstance(split, str):
        counts = parse_split(split, group.size(), layers)
    elif split is not None:
        counts = parse_split(",".join(map(str, split)), group.size(), layers)
    else:
        mine = mx.array([machine_memory() / 2**30], dtype=mx.float32)
        memory = mx.distributed.all_gather(mine, group=group, stream=mx.cpu).tolist()
        counts = split_layers(layers, group.size(), memory)
    return PipelineStage(group, config.text_config, counts)


def own_shards(model_path: Path, stage: PipelineStage) -> list[str]:
    """The safetensors files of ``model_path`` (from its index; all when it has none) holding a
    weight of ``stage``'s part."""
    import json

    from ..loading.checkpoint import rename

    index = model_path / "model.safetensors.index.json"
    if not index.exists():
        return ["*.safetensors"]
    weight_map = json.loads(index.read_text()).get("weight_map", {})
    return sorted({str(f) for k, f in weight_map.items() if stage.keeps(rename(str(k)))})


def load_sharded(
    path_or_repo_id: str | Path,
    group: mx.distributed.Group | None = None,
    parallel: str = "pipeline",
    split: str | list[int] | None = None,
    dtype: str | None = None,
    revision: str | None = None,
    lazy_ple: bool = True,
):
    """``model, processor`` for this process's part of a model shared by ``group`` (default: the
    group ``mlx.launch`` started). ``parallel="pipeline"`` gives each process a run of layers (see
    :func:`plan_pipeline` for ``split``); only that part's weights are read. ``parallel="tensor"``
    splits every layer among the processes (:mod:`.tensor`). Every process must call this, and then
    run the same generation calls."""
    from ..loading import load_config, load_model, resolve_model_path
    from ..processing.processor import Processor

    if parallel not in PARALLEL_MODES:
        raise OptionError(f"parallel must be one of {', '.join(PARALLEL_MODES)}, not {parallel!r}")
    group = group or mx.distributed.init()
    local = Path(path_or_repo_id).expanduser().is_dir()
    # From the Hub, each process fetches the config first, then only the shards its part needs.
    model_path = resolve_model_path(path_or_repo_id, revision=revision, weights=None if local else [])
    config = load_config(model_path)
    watchdog = Watchdog(group.rank(), group.size())
    if parallel == "tensor":
        if split is not None:
            raise OptionError("--split sets the layers of a pipeline; tensor parallelism splits every layer")
        check_divisible(config.text_config, group.size())
        if not local:
            model_path = resolve_model_path(path_or_repo_id, revision=revision)
        model = load_model(model_path, dtype=dtype, lazy_ple=lazy_ple, shard=lambda m: shard_layers(m, group))
    else:
        watchdog.expect("planning the split", watchdog.timeout)
        stage = plan_pipeline(config, group, split)
        watchdog.idle()
        if not local:
            model_path = resolve_model_path(path_or_repo_id, revision=revision, weights=own_shards(model_path, stage))
        model = load_model(model_path, dtype=dtype, lazy_ple=lazy_ple, stage=stage)
        stage.dtype = model.language_model.norm.weight.dtype  # the activations' type, sent between processes
    model.language_model.watchdog = watchdog
    model.language_model.group = group  # a ChatEngine on it leads (process 0) or follows (see lockstep.py)
    # Every process has its part in memory before any runs (a slow reader would look like a dead
    # peer). The others may still be downloading their shards: a far longer limit, an hour at least.
    watchdog.expect("waiting for the others to load their weights", max(10 * watchdog.timeout, 3600))
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))
    watchdog.expect("measuring the link", watchdog.timeout)
    latency, bandwidth = measure_link(group, config.text_config.hidden_size, model.language_model.norm.weight.dtype)
    traffic = Traffic(latency=latency, bandwidth=bandwidth)  # counted as the forward passes are built
    model.language_model.traffic = traffic
    if model.stage is not None:
        model.stage.traffic = traffic
    watchdog.idle()
    processor = Processor.from_pretrained(model_path, model.config)
    return model, processor


__all__ = ["load_sharded", "plan_pipeline", "world", "PipelineStage", "split_layers", "Traffic", "PARALLEL_MODES"]
