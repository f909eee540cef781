"""The default model shipped inside snapfn: a tiny Llama trained on Shakespeare (see README.md)."""

from pathlib import Path


def embedded_model_dir() -> Path:
    """Folder of the embedded Hugging Face checkpoint (config, safetensors, tokenizer)."""
    return Path(__file__).parent / "model"
