"""A checkpoint's tensors on their way into a model.

checkpoint.py  a Hugging Face model folder: which tensor lives in which safetensors shard
quant.py       FP8 block quantization (128x128 blocks, DeepSeek-V3 / GLM-5 layout)
sharding.py    which slice of each tensor a tensor- or expert-parallel rank loads
loader.py      tensors into a model's parameters, with the coverage check
"""
