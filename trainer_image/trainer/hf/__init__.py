"""Hugging Face interoperability: start from a Llama-family checkpoint (``model.from_hf``), export to one
(``python -m trainer.export``). Our own state dict never learns Hugging Face names: everything foreign goes
through these modules.

- ``adapter``: ``LlamaAdapter``, the one mapping between our parameter names and ``LlamaForCausalLM``'s (as data),
  the q/k RoPE permutation beside it, and ``config.json`` <-> ``ModelConfig``;
- ``source``: a model directory or URI (``hf://``, ``s3://``, ``gs://``, ``file://``), downloaded into a node-local
  cache by local rank 0 (``BaseModel``);
- ``reader``: safetensors files read by slices: each rank reads only its own FSDP shards;
- ``safetensors_out``: a streaming, sharded safetensors writer (one tensor in memory at a time).
"""

from trainer.hf.errors import BaseModelFilesError
from trainer.hf.source import BaseModel

__all__ = ["BaseModel", "BaseModelFilesError"]
