"""The examples the function tests run, the event each answers, and a check that an answer
carries information: bit-equal answers prove nothing when every value is the same."""

from __future__ import annotations

EXAMPLES = {
    "examples.cuda_graph:handler": {"seed": 3},
    "examples.text_embedding:handler": {"texts": ["snapshots restore fast", "a cold start"]},
    "examples.image_classifier:handler": {"seed": 5},
}


def assert_informative(spec: str, answer: dict) -> None:
    """The answer's numbers are not all one value (zeros from an underflow, a constant)."""
    if spec.startswith("examples.cuda_graph"):
        values = answer["first"]
    elif spec.startswith("examples.text_embedding"):
        values = [x for row in answer["embeddings"] for x in row]
        assert answer["embeddings"][0] != answer["embeddings"][1], "two texts, one embedding"
    else:
        values = [p for _, p in answer["top5"]]
    assert len(set(values)) > 1, f"{spec} answered one value throughout: {values[:8]}"
