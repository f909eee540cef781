"""`snapfn make-model`: synthetic checkpoints in the exact Hugging Face layout.

presets.py               named shapes: llama tiny/small/8b, qwen3/qwen2 tiny, glm tiny/5-reduced
hf_layout.py             tensor names + shapes per architecture, storage dtypes (fp8 scales)
hf_config.py             config.json / generation_config.json as transformers writes them
tokenizer.py             byte-level tokenizer padded to exactly vocab_size entries
safetensors_writer.py    shard planning + streaming writer (one tensor in RAM) + index
build.py                 make_model(): generate, quantize, write, publish atomically
cli.py                   MakeModelArgs, add_arguments(), run()
"""
