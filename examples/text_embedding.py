"""A text-embedding encoder as a snapfn function: BERT-base built through transformers.

Serve it (from the repository root), on CPU or a GPU:

    snapfn serve --function examples.text_embedding:handler [--device cuda]
    curl -s localhost:8000/invoke -d '{"texts": ["snapshots restore fast", "cold starts"]}'
    # {"dim": 768, "embeddings": [[...], [...]], "tokens": [5, 4], "sha256": "..."}

    snapfn init --function examples.text_embedding:handler --snapshot snapshots/embed [--device cuda]
    snapfn serve --function examples.text_embedding:handler --snapshot snapshots/embed

The model is `transformers.BertModel` from a `BertConfig` of BERT-base's shape (12 layers,
hidden 768, 110 M parameters) with random weights, seeded so that every init builds the same
model; a real deployment would call `from_pretrained` in the same init hook. Texts are
tokenized by hashing lower-cased words into the vocabulary (no vocabulary file to download).
Each embedding is the mean of the last hidden states over the text's tokens, L2-normalised.
On CUDA the model runs in float16.
"""

from __future__ import annotations

import hashlib
import re
import zlib

import torch

from snapfn.handler.api import BadRequest, Context, device, health_event, init

MAX_TEXTS = 64
MAX_TOKENS = 128
CLS, SEP, PAD = 101, 102, 0
FIRST_WORD_ID = 1000
WORD = re.compile(r"[a-z0-9]+")


class Encoder:
    def __init__(self) -> None:
        self.model = None
        self.device = torch.device("cpu")
        self.vocab_size = 0

    def load(self) -> None:
        # NOTE: transformers is imported here, in the init hook: what it costs is part of the
        # init a snapshot saves
        from transformers import BertConfig, BertModel

        self.device = torch.device(device())
        dtype = torch.float16 if self.device.type == "cuda" else torch.float32
        config = BertConfig()  # BERT-base: 12 layers, 12 heads, hidden 768, vocab 30522
        torch.manual_seed(0)  # random weights, the same at every init
        self.model = BertModel(config, add_pooling_layer=False).eval().to(self.device, dtype)
        self.vocab_size = config.vocab_size
        self.embed({"texts": ["warm up"]})  # the first forward's lazy work happens now

    def tokenize(self, text: str) -> list[int]:
        words = WORD.findall(text.lower())[: MAX_TOKENS - 2]
        span = self.vocab_size - FIRST_WORD_ID
        return [CLS, *(FIRST_WORD_ID + zlib.crc32(w.encode()) % span for w in words), SEP]

    @torch.inference_mode()
    def embed(self, event: dict) -> dict:
        texts = event.get("texts")
        if isinstance(texts, str):
            texts = [texts]
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise BadRequest("send {'texts': [string, ...]} (or one string)")
        if len(texts) > MAX_TEXTS:
            raise BadRequest(f"at most {MAX_TEXTS} texts at a time, got {len(texts)}")
        ids = [self.tokenize(t) for t in texts]
        width = max(len(i) for i in ids)
        batch = torch.full((len(ids), width), PAD, dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.long)
        for row, tokens in enumerate(ids):
            batch[row, : len(tokens)], mask[row, : len(tokens)] = torch.tensor(tokens), 1
        batch, mask = batch.to(self.device), mask.to(self.device)
        hidden = self.model(input_ids=batch, attention_mask=mask).last_hidden_state.float()
        weights = mask.unsqueeze(-1).float()
        pooled = (hidden * weights).sum(1) / weights.sum(1)
        vectors = torch.nn.functional.normalize(pooled, dim=-1).cpu()
        return {
            "dim": vectors.shape[1],
            "embeddings": [[round(x, 6) for x in v] for v in vectors.tolist()],
            "tokens": [len(i) for i in ids],
            "sha256": hashlib.sha256(vectors.numpy().tobytes()).hexdigest(),  # the exact bits
        }


encoder = Encoder()
init(encoder.load)
health_event({"texts": ["health check"]})


def handler(event: dict, context: Context) -> dict:
    return encoder.embed(event)
