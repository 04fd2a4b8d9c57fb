"""python -m app: chat with Gemma 4 in the browser.

    python -m app                                   # google/gemma-4-E2B-it, converted to 4-bit on first use
    python -m app --model ./gemma-4-31b-4bit        # a converted folder, an HF folder or a Hub repo id
    python -m app --demo                            # a tiny random model: try the interface, no download
    python -m app --api-only --api-key SECRET       # the OpenAI-compatible API (/v1) without the page
"""

from __future__ import annotations

import argparse
import errno
import os
import socket
import sys

from gemma4_mlx.distributed import PARALLEL_MODES, world
from gemma4_mlx.distributed.watchdog import EXIT_CODE as EXIT_PEER_LOST
from gemma4_mlx.errors import PeerLostError

from .backend import CACHE_DIR, DEFAULT_MODEL, E2B_DOWNLOAD, ModelHolder

EXIT_PORT_IN_USE = 2


def port_problem(host: str, port: int) -> str | None:
    """Why the app cannot listen on ``host:port`` (in use, not allowed), or None if it can."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        return f"cannot listen on {host}: {e.strerror}"
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # As uvicorn binds (SO_REUSEADDR): a port that only has connections closing is free.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return f"port {port} is in use (another app, or another copy of this one?); try --port {port + 1}"
            return f"cannot listen on {host}:{port}: {e.strerror}"
    return None


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(f"a port is a number from 1 to 65535, not {text!r}")
    return port


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m app", description="A local multimodal chat with Gemma 4 on MLX.")
    p.add_argument("--model", default=None, help=f"converted folder, HF folder or Hub repo id (default: {DEFAULT_MODEL}; "
                   f"the first run downloads {E2B_DOWNLOAD} and converts it)")  # fmt: skip
    p.add_argument("--quantize", type=int, default=None, choices=[4, 8], metavar="BITS",
                   help=f"convert an unquantized checkpoint to BITS (4 or 8) on first use, cached in {CACHE_DIR} "
                        "(default: 4 for the default model, none otherwise)")  # fmt: skip
    p.add_argument("--no-quantize", action="store_true", help="load the default model unconverted (bf16)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None)
    p.add_argument("--demo", action="store_true", help="use a tiny random model built locally (replies are gibberish)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: localhost only)")
    p.add_argument("--port", type=_port, default=7860, help="port to listen on, 1-65535 (default: 7860)")
    p.add_argument("--share", action="store_true", help="also publish a temporary public gradio.live link")
    p.add_argument("--no-browser", action="store_true", help="do not open the browser")
    p.add_argument("--draft-model", default=None, help="a Gemma 4 assistant (folder or Hub id) for speculative decoding "
                   "(default: the model's own, <repo>-assistant, when it can be found)")  # fmt: skip
    p.add_argument("--no-draft", action="store_true", help="no speculative decoding")
    api = p.add_argument_group("OpenAI-compatible API (served at /v1 beside the page)")
    api.add_argument("--api-key", default=os.environ.get("GEMMA4_MLX_API_KEY"),
                     help="require this bearer token on API requests (default: $GEMMA4_MLX_API_KEY, else none)")  # fmt: skip
    api.add_argument("--no-api", action="store_true", help="serve the page only")
    api.add_argument("--api-only", action="store_true", help="serve the API only, without the page")
    api.add_argument("--allow-fetch", action="store_true", help="let API requests name media by http(s) URL, which the server downloads")
    several = p.add_argument_group("several Macs (under mlx.launch: process 0 serves, the others follow)")
    several.add_argument("--parallel", choices=PARALLEL_MODES, default="pipeline",
                         help="how the processes share the model (pipeline: a run of layers each; tensor: every layer split)")  # fmt: skip
    several.add_argument("--split", default=None, help="pipeline: layers per process, e.g. 40,20 (default: by memory)")
    args = p.parse_args(argv)
    if args.no_api and args.api_only:
        p.error("--no-api and --api-only exclude each other")
    if args.api_key is not None and not args.api_key.strip():
        p.error("--api-key is empty")
    if args.host not in ("127.0.0.1", "localhost", "::1") and args.api_key is None and not args.no_api:
        print("python -m app: the API is reachable from the network with no key; consider --api-key", file=sys.stderr)

    group = world()  # under mlx.launch with several processes: process 0 serves, the others follow
    if group is not None and group.rank() != 0:
        return follow(args, group)

    # Checked before anything starts: Gradio would only fail after the model began loading, with a
    # traceback. (Another program can still take the port in between; Gradio then reports it.)
    problem = port_problem(args.host, args.port)
    if problem:
        print(f"python -m app: {problem}", file=sys.stderr)
        return EXIT_PORT_IN_USE

    from .api import make_router

    holder = model_holder(args, group).start()
    router = None if args.no_api else make_router(holder, args.api_key, args.allow_fetch)
    if args.api_only:
        return serve_api(router, holder, args.host, args.port)
    from .ui import build_app, launch

    app = build_app(holder)
    try:
        # Blocks until Ctrl-C (Gradio catches it and closes the server).
        launch(app, api=router, server_name=args.host, server_port=args.port, share=args.share, inbrowser=not args.no_browser)
    finally:
        shutdown(app, holder)
    return 0


def model_holder(args, group) -> ModelHolder:
    """The model as the command line asks for it (the default model is converted to 4-bit)."""
    bits = args.quantize
    if bits is None and args.model is None and not args.no_quantize:
        bits = 4
    draft = False if args.no_draft else (args.draft_model or True)
    return ModelHolder(args.model, bits, demo=args.demo, dtype=args.dtype, draft=draft, group=group, parallel=args.parallel, split=args.split)


def follow(args, group) -> int:
    """A process other than 0 under ``mlx.launch``: load this process's part of the model as process
    0 does, then run process 0's requests until it stops."""
    holder = model_holder(args, group)
    holder._load()
    if holder.engine is None:
        print(f"python -m app (process {group.rank()}): {holder.status}", file=sys.stderr)
        return 1
    print(f"python -m app (process {group.rank()}): {holder.status}; following process 0", file=sys.stderr, flush=True)
    try:
        holder.engine.follow()
    except PeerLostError as e:
        print(f"error: {e}. Stopping.", file=sys.stderr)
        return EXIT_PEER_LOST
    return 0


def serve_api(router, holder: ModelHolder, host: str, port: int) -> int:
    """The API alone, on the server Gradio uses (FastAPI on uvicorn), until Ctrl-C."""
    import uvicorn
    from fastapi import FastAPI

    server = FastAPI(title="Gemma 4 on MLX", docs_url=None, redoc_url=None)
    server.include_router(router)
    print(f"OpenAI-compatible API: http://{host}:{port}/v1", flush=True)
    try:
        uvicorn.run(server, host=host, port=port, log_level="warning")
    finally:
        if holder.engine is not None:
            holder.engine.close()
        holder.close(timeout=60)
    return 0


def shutdown(app, holder: ModelHolder) -> None:
    """Stop what the app started before the interpreter exits: a thread still inside MLX or writing a
    conversion when it is killed aborts the process ("terminate called without an active exception")
    or leaves half a folder. The library's engine joins its own thread at exit."""
    app.replies.stop_all()
    app.close(verbose=False)
    if not holder.ready.is_set():
        print("Stopping the model loader…", file=sys.stderr, flush=True)
    holder.close(timeout=60)


if __name__ == "__main__":
    sys.exit(main())
