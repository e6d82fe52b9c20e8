"""`launch.py embed`: sentence embeddings with all-MiniLM-L6-v2, tensor-parallel."""

from __future__ import annotations

import argparse
import time

import numpy as np

from cli.display import print_table, progress
from cli.options import add_cluster_options, open_cluster
from split_state.errors import MetaError


def embed(args: argparse.Namespace) -> int:
    from models.minilm import Model, TensorParallelEncoder

    sentences = list(args.sentences)
    if args.file:
        with open(args.file, encoding="utf-8") as f:
            sentences += [line.rstrip("\n") for line in f if line.strip()]
    if not sentences:
        raise MetaError("embed: give sentences as arguments or --file PATH (one sentence per line)")
    model = Model.load()
    with open_cluster(args) as dev:
        start = time.perf_counter()
        encoder = TensorParallelEncoder(
            dev, model.weights, model.cfg, progress=lambda i, n: progress(i, n, "placing weights", start)
        )
        batches = range(0, len(sentences), args.batch)
        out, start = [], time.perf_counter()
        for i, at in enumerate(batches):
            out.append(encoder.embed(model.tokenizer(sentences[at : at + args.batch])))
            progress(i + 1, len(batches), "embedding", start)
        emb = np.concatenate(out)
    print_table(
        f"{len(sentences)} sentences on {dev.n} workers: embedding norms",
        ["#", "sentence", "norm"],
        [[i, s[:60], f"{np.linalg.norm(e):.4f}"] for i, (s, e) in enumerate(zip(sentences, emb))],
    )
    if len(sentences) <= 12:
        sims = emb @ emb.T
        print_table(
            "cosine similarity",
            ["#", *map(str, range(len(sentences)))],
            [[i, *(f"{v:.3f}" for v in row)] for i, row in enumerate(sims)],
        )
    if args.out:
        np.save(args.out, emb.astype(np.float32))
        print(f"wrote {args.out}: {emb.shape[0]} x {emb.shape[1]} float32, one row per sentence in input order")
    return 0


def add(sub) -> None:
    p = sub.add_parser("embed", help="sentence embeddings with all-MiniLM-L6-v2, tensor-parallel")
    p.add_argument("sentences", nargs="*", help="sentences to embed")
    p.add_argument("--file", default="", help="one sentence per line")
    p.add_argument("--out", default="", help="write the embeddings here (.npy, float32)")
    p.add_argument("--batch", type=int, default=32, help="sentences per run (default: %(default)s)")
    add_cluster_options(p)
    p.set_defaults(fn=embed)
