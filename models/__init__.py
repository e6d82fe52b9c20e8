"""Applications of the runtime: real models, their loaders, tokenizers and single-process NumPy
references (`reference`: every op of the table written again in plain NumPy, the oracle the tests,
the demo and the stress run compare against).

`minilm`: all-MiniLM-L6-v2 sentence embeddings, tensor-parallel.
"""
