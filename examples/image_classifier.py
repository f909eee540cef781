"""An image classifier as a snapfn function: a ResNet-50-shaped convnet, `torch.compile`d.

Serve it (from the repository root), on CPU or a GPU:

    snapfn serve --function examples.image_classifier:handler [--device cuda]
    curl -s localhost:8000/invoke -d '{"seed": 7}'
    # {"top5": [[class, probability], ...], "device": "cpu", "sha256": "..."}

    # or snapshot it once and serve every cold start from the snapshot:
    snapfn init --function examples.image_classifier:handler --snapshot snapshots/classifier \\
        [--device cuda]
    snapfn serve --function examples.image_classifier:handler --snapshot snapshots/classifier

The event is `{"seed": N}` (a synthetic image, the same for the same seed) or `{"pixels":
base64 of height*width*3 uint8 RGB, "height": H, "width": W}`. The weights are random
(seeded, so every init builds the same model: no download); a real model would load its
checkpoint in the same init hook. On CUDA the model runs in float16, channels-last.

What the init hook does is what a snapshot saves: building the model, moving it to the device
and `torch.compile` (inductor), warmed on one image so the compiled kernels exist. A process
snapshot (tier 1) restores all of it, the weights streamed back into the same device addresses;
the portable one (tier 0) re-runs this hook against the compile caches it carries, compiling
nothing. SNAPFN_EXAMPLE_COMPILE=0 runs the model eagerly.
"""

from __future__ import annotations

import base64
import hashlib
import os

import torch
from torch import nn

from snapfn.handler.api import BadRequest, Context, device, health_event, init

IMAGE_SIZE = 224
MAX_SIDE = 1024
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


class Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * 4
        self.conv1, self.bn1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            down = nn.Conv2d(cin, cout, 1, stride, bias=False)
            self.down = nn.Sequential(down, nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        y = torch.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return torch.relu(y + (x if self.down is None else self.down(x)))


class ResNet50(nn.Module):
    """ResNet-50's shape: 25.6 M parameters, stages of 3, 4, 6 and 3 bottlenecks."""

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        stem = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.stem = nn.Sequential(stem, nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        blocks, cin = [], 64
        for width, count, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            for i in range(count):
                blocks.append(Bottleneck(cin, width, stride if i == 0 else 1))
                cin = width * 4
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, 3, H, W] -> [N, classes]
        pooled = nn.functional.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1)
        return self.fc(torch.flatten(pooled, 1))


class Classifier:
    def __init__(self) -> None:
        self.model = None
        self.device = torch.device("cpu")
        self.dtype = torch.float32

    def load(self) -> None:
        self.device = torch.device(device())
        self.dtype = torch.float16 if self.device.type == "cuda" else torch.float32
        torch.manual_seed(0)  # random weights, the same at every init
        model = ResNet50().eval().to(self.device, self.dtype, memory_format=torch.channels_last)
        if os.environ.get("SNAPFN_EXAMPLE_COMPILE", "1") != "0":
            model = torch.compile(model)
        self.model = model
        self.classify({"seed": 0})  # compiles (and autotunes) now, not in the first request

    @torch.inference_mode()
    def classify(self, event: dict) -> dict:
        image = self.image(event)
        x = (image.float() / 255 - torch.tensor(MEAN)) / torch.tensor(STD)  # [H, W, 3]
        x = x.permute(2, 0, 1).unsqueeze(0)
        x = nn.functional.interpolate(x, size=(IMAGE_SIZE, IMAGE_SIZE), mode="bilinear")
        x = x.to(self.device, self.dtype, memory_format=torch.channels_last)
        logits = self.model(x).float().cpu()
        probs = torch.softmax(logits, dim=-1)[0]
        top = torch.topk(probs, 5)
        pairs = zip(top.indices.tolist(), top.values.tolist(), strict=True)
        return {
            "top5": [[i, round(p, 6)] for i, p in pairs],
            "device": str(self.device),
            "sha256": hashlib.sha256(logits.numpy().tobytes()).hexdigest(),  # the exact bits
        }

    @staticmethod
    def image(event: dict) -> torch.Tensor:
        """[H, W, 3] uint8 from the event."""
        if "pixels" in event:
            h, w = event.get("height"), event.get("width")
            if not all(isinstance(v, int) and 0 < v <= MAX_SIDE for v in (h, w)):
                raise BadRequest(f"height and width must be integers in 1..{MAX_SIDE}")
            try:
                raw = base64.b64decode(event["pixels"], validate=True)
            except (TypeError, ValueError):
                raise BadRequest("pixels must be base64") from None
            if len(raw) != h * w * 3:
                raise BadRequest(f"pixels hold {len(raw)} bytes, not height*width*3 = {h * w * 3}")
            return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(h, w, 3)
        seed = event.get("seed", 0)
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise BadRequest("send {'seed': integer} or {'pixels', 'height', 'width'}")
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, 256, (IMAGE_SIZE, IMAGE_SIZE, 3), dtype=torch.uint8, generator=g)


classifier = Classifier()
init(classifier.load)
health_event({"seed": 0})


def handler(event: dict, context: Context) -> dict:
    return classifier.classify(event)
