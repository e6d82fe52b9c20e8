"""How far 8-bit activations move the logits, ours beside llama.cpp's, on the same file and prompts.

    python bench/activations.py [--quick] [--json PATH] [--workers 1] [--model PATH ...]

For each file (the packaged SmolLM2-135M Q4_1 and, where llama-cpp-python is installed, that file
requantized by llama.cpp's own quantizer to Q4_K_M, made once under results/) and each prompt: the
last prompt position's logits of our exact products (`activations="f32"`), of our 8-bit ones
(`"q8"`, the default) and of llama.cpp (its KV caches float32, as ours here: the default
float16 caches would add their own rounding), and the RMS distances
between them. The issue's bound: ours from the exact path no farther than llama.cpp's. The runs
are in-process (the simulator runs the workers' kernels: the same numerics as worker processes).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.llm import have_llama_cpp  # noqa: E402
from bench.report import cli, table  # noqa: E402

PROMPTS = (
    "The capital of France is",
    "Once upon a time, there was a little",
    "def fibonacci(n):\n    ",
    "The quick brown fox jumps over the lazy dog. Then the",
    "Water boils at a temperature of",
    "In 1492, Columbus",
)
LLAMA_FTYPE_MOSTLY_Q4_K_M = 15  # llama.h's llama_ftype


def q4_k_m_of(source: str, folder: str = "results") -> str | None:
    """`source` requantized to Q4_K_M by llama.cpp's quantizer (once; then reused), or None
    without llama-cpp-python."""
    if not have_llama_cpp():
        return None
    target = Path(folder) / (Path(source).stem + ".requantized-Q4_K_M.gguf")
    if not target.exists():
        import llama_cpp

        target.parent.mkdir(parents=True, exist_ok=True)
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = LLAMA_FTYPE_MOSTLY_Q4_K_M
        params.allow_requantize = True
        if llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), params) != 0:
            raise RuntimeError(f"llama.cpp could not requantize {source}")
    return str(target)


def _rms(values: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(values, dtype=np.float64))))


def distances(path: str, prompts, workers: int) -> list[dict]:
    from meta.device import MetaDevice
    from models.generate import LLM
    from models.gguf_model import GGUFModel
    from workers.simulator import SimulatedCluster

    model = GGUFModel(path)
    llama = None
    if have_llama_cpp():
        from llama_cpp import GGML_TYPE_F32, Llama

        llama = Llama(
            path, n_threads=2, n_ctx=256, logits_all=True, verbose=False, type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32
        )
    dev = MetaDevice(SimulatedCluster(workers))
    rows = []
    try:
        # float32 caches on both paths (and llama.cpp's): the activations' rounding alone
        llms = {a: LLM(dev, model, ctx=64, activations=a, cache_types=("f32", "f32")) for a in ("f32", "q8")}
        for prompt in prompts:
            logits = {}
            for activations, llm in llms.items():
                llm.generate([prompt], max_new_tokens=1, keep_logits=True)
                logits[activations] = llm.last_logits[0].astype(np.float64)
            row = {"prompt": prompt, "logits_rms": _rms(logits["f32"]), "ours_q8": _rms(logits["q8"] - logits["f32"])}
            if llama is not None:
                ids = model.tokenizer.encode(prompt)
                llama.reset()
                llama.eval(ids)
                theirs = np.asarray(llama.scores[len(ids) - 1], np.float64)
                row |= {"llama_cpp": _rms(theirs - logits["f32"]), "ours_q8_vs_llama_cpp": _rms(logits["q8"] - theirs)}
            rows.append(row)
    finally:
        dev.close()
        if llama is not None:
            llama.close()
    return rows


def run(quick: bool, workers: int, models: list[str]) -> dict:
    from models.gguf_model import GGUFModel

    packaged = str(GGUFModel(None).path)
    paths = models or [packaged] + [p for p in [q4_k_m_of(packaged)] if p]
    prompts = PROMPTS[:2] if quick else PROMPTS
    files = []
    for path in paths:
        rows = distances(path, prompts, workers)
        summary = {"file": Path(path).name, "rows": rows, "ours_q8_mean": float(np.mean([r["ours_q8"] for r in rows]))}
        if "llama_cpp" in rows[0]:
            summary["llama_cpp_mean"] = float(np.mean([r["llama_cpp"] for r in rows]))
        files.append(summary)
    return {"workers": workers, "files": files}


def show(results: dict) -> None:
    cols = ["file", "prompt", "logits RMS", "ours q8 - exact", "llama.cpp - exact", "ours q8 - llama.cpp"]
    rows = []
    for f in results["files"]:
        for r in f["rows"]:
            rows.append([f["file"], repr(r["prompt"][:28]), r["logits_rms"], r["ours_q8"]])
            rows[-1] += [r.get("llama_cpp", "-"), r.get("ours_q8_vs_llama_cpp", "-")]
        rows.append([f["file"], "mean", "", f["ours_q8_mean"], f.get("llama_cpp_mean", "-"), ""])
    title = f"RMS distance of the last prompt position's logits from our exact products, {results['workers']} worker(s)"
    print(table(title, cols, rows))


def main(argv: list[str] | None = None) -> int:
    def options(ap) -> None:
        ap.add_argument("--workers", type=int, default=1)
        ap.add_argument("--model", nargs="*", default=[], help="GGUF files (default: SmolLM2 and its Q4_K_M)")

    return cli(__doc__, "activations", lambda a: run(a.quick, a.workers, a.model), show, argv, options)


if __name__ == "__main__":
    sys.exit(main())
