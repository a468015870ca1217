"""Optional packages a run may need (`transformers` for a Hugging Face model): the error that names the missing
one and how to install it. Kept free of torch so that commands which only check a run (`shoal run create`) stay
quick to start."""

from __future__ import annotations

HINT = "pip install 'shoal[hf]' (transformers, tokenizers, safetensors, datasets)"


class MissingPackage(RuntimeError):
    """An optional package a run needs is not installed; the message says which and how to install it."""


def require_transformers():
    try:
        import transformers
    except ImportError:
        raise MissingPackage(f"this run's model is a Hugging Face model, which needs `transformers`: {HINT}") from None
    return transformers
