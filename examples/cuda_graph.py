"""A function that captures a CUDA graph once and replays it for every request.

Serve it (from the repository root):

    snapfn serve --function examples.cuda_graph:handler --device cuda
    curl -s localhost:8000/invoke -d '{"seed": 3}'
    # {"rows": 8, "first": [...], "sha256": "...", "graph": true}

    snapfn init --function examples.cuda_graph:handler --snapshot snapshots/graph --device cuda
    snapfn serve --function examples.cuda_graph:handler --snapshot snapshots/graph

The model is a stack of square float16 linear layers, each followed by a GELU and a layer norm
(random weights, seeded; the norm keeps 32 layers' activations from vanishing in float16). The init hook allocates a static input and output for a fixed batch, warms the
stack up on a side stream and captures one forward as a CUDA graph; a request copies its batch
into the static input and replays the graph: one launch, no Python per layer. A process
snapshot keeps the weights and the static tensors in its releasable pool (streamed back to the
same addresses) and the graph in the CUDA checkpoint, so the restored graph replays unchanged.

Size: GRAPH_MLP_WIDTH (default 4096 on CUDA, 256 on CPU) and GRAPH_MLP_LAYERS (default 8, 4):
width 8192 with 32 layers holds 4.3 GB of weights. On CPU there are no CUDA graphs: the same
stack runs eagerly, in float32.

Weights from a file, as a deployed function loads them: GRAPH_MLP_CHECKPOINT=PATH (safetensors,
`layers.{i}.weight`) makes the init hook read them from PATH onto the device instead of drawing
them; the file's shapes set the size. Write one of the size above with

    python -m examples.cuda_graph --write-checkpoint weights.safetensors
"""

from __future__ import annotations

import hashlib
import os
import threading

import torch

from snapfn.handler.api import BadRequest, Context, device, health_event, init

BATCH = 8


class GraphedStack:
    def __init__(self) -> None:
        self.layers: list[torch.Tensor] = []
        self.static_in = self.static_out = None
        self.graph = None
        self.device = torch.device("cpu")
        self.lock = threading.Lock()  # one request at a time uses the static input and output

    def load(self) -> None:
        self.device = torch.device(device())
        on_cuda = self.device.type == "cuda"
        width = int(os.environ.get("GRAPH_MLP_WIDTH", 4096 if on_cuda else 256))
        num_layers = int(os.environ.get("GRAPH_MLP_LAYERS", 8 if on_cuda else 4))
        dtype = torch.float16 if on_cuda else torch.float32
        checkpoint = os.environ.get("GRAPH_MLP_CHECKPOINT")
        if checkpoint:
            self.layers = read_layers(checkpoint, self.device, dtype)
            width = self.layers[0].shape[1]
        else:
            g = torch.Generator(device=self.device).manual_seed(0)  # the same weights every init
            self.layers = random_layers(width, num_layers, g, self.device, dtype)
        self.static_in = torch.zeros(BATCH, width, device=self.device, dtype=dtype)
        if not on_cuda:
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up: cuBLAS picks its kernels before the capture
            for _ in range(2):
                self.forward(self.static_in)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.static_out = self.forward(self.static_in)
        torch.cuda.synchronize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        width = x.shape[-1]
        for w in self.layers:
            x = torch.nn.functional.layer_norm(torch.nn.functional.gelu(x @ w), (width,))
        return x

    @torch.inference_mode()
    def run(self, event: dict) -> dict:
        seed = event.get("seed", 0)
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise BadRequest("send {'seed': integer}")
        g = torch.Generator().manual_seed(seed)
        batch = torch.randn(BATCH, self.static_in.shape[1], generator=g)
        with self.lock:
            self.static_in.copy_(batch.to(self.static_in.dtype))
            if self.graph is not None:
                self.graph.replay()
                out = self.static_out.float().cpu()
            else:
                out = self.forward(self.static_in).float()
        return {
            "rows": out.shape[0],
            "first": [round(v, 6) for v in out[:, 0].tolist()],
            "sha256": hashlib.sha256(out.numpy().tobytes()).hexdigest(),  # the exact bits
            "graph": self.graph is not None,
        }


def random_layers(width: int, num_layers: int, g, device, dtype) -> list[torch.Tensor]:
    scale = width**-0.5
    return [
        torch.randn(width, width, generator=g, device=device, dtype=dtype) * scale
        for _ in range(num_layers)
    ]


def read_layers(path: str, device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
    from safetensors.torch import load_file

    tensors = load_file(path, device=str(device))
    count = len(tensors)
    try:
        return [tensors.pop(f"layers.{i}.weight").to(dtype) for i in range(count)]
    except KeyError as exc:
        raise ValueError(f"{path}: no tensor {exc.args[0]} (layers.0.weight … expected)") from None


stack = GraphedStack()
init(stack.load)
health_event({"seed": 0})


def handler(event: dict, context: Context) -> dict:
    return stack.run(event)


if __name__ == "__main__":  # python -m examples.cuda_graph --write-checkpoint PATH
    import argparse

    from safetensors.torch import save_file

    p = argparse.ArgumentParser(description="write the stack's weights as a safetensors file")
    p.add_argument("--write-checkpoint", required=True, metavar="PATH")
    a = p.parse_args()
    width = int(os.environ.get("GRAPH_MLP_WIDTH", 4096))
    num_layers = int(os.environ.get("GRAPH_MLP_LAYERS", 8))
    g = torch.Generator().manual_seed(0)
    layers = random_layers(width, num_layers, g, "cpu", torch.float16)
    save_file({f"layers.{i}.weight": w for i, w in enumerate(layers)}, a.write_checkpoint)
    print(
        f"{a.write_checkpoint}: {num_layers} layers of {width}², {width * width * num_layers * 2 / 1e9:.2f} GB"
    )
