"""Read-only HF weight sources: a safetensors directory (lazy) or a GGUF file (de-quantised).

Design: docs/design.md §1 step 7 (weight sync).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Iterator, Optional

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM


class SafetensorsSource(Mapping):
    """Lazy ``Mapping[hf_name, Tensor]`` over an HF safetensors directory.

    Reads ``model.safetensors.index.json`` when present, else every ``*.safetensors``
    file in the directory. A tensor is read from disk only when indexed, so each rank of
    an import touches only the tensors it needs (and the whole tensor, not just its shard:
    the mapping needs the full tensor for QKV / gate-up interleaving).

    Raises:
        FileNotFoundError: the directory has no safetensors file.
        ValueError: two files define the same tensor.
    """

    def __init__(self, path: str):
        self.path = path
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors")) if os.path.isdir(path) else []
        if not files:
            raise FileNotFoundError(f"no *.safetensors file in {path!r} (pass --gguf-file for a GGUF model)")
        self._where: dict[str, str] = {}
        for fname in files:
            with safe_open(os.path.join(path, fname), framework="pt") as f:
                for key in f.keys():
                    if key in self._where:
                        raise ValueError(f"tensor {key!r} is in both {self._where[key]} and {fname}")
                    self._where[key] = fname

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise KeyError(f"HF tensor {name!r} is not in {self.path}")
        with safe_open(os.path.join(self.path, self._where[name]), framework="pt") as f:
            return f.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def load_gguf_state_dict(path: str, gguf_file: str, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """De-quantise a GGUF model to an HF-named state dict through transformers.

    transformers' GGUF loader (``from_pretrained(dir, gguf_file=...)``) undoes llama.cpp's
    q/k row permutation and de-quantises to ``dtype``. Tied embeddings appear once
    (``model.embed_tokens.weight``); an aliased ``lm_head.weight`` is dropped.

    Raises:
        FileNotFoundError: the GGUF file is missing.
    """
    if not os.path.isfile(os.path.join(path, gguf_file)):
        raise FileNotFoundError(f"gguf_file {gguf_file!r} not found in {path!r}")
    model = AutoModelForCausalLM.from_pretrained(path, gguf_file=gguf_file, dtype=dtype)
    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return {k: v.detach() for k, v in state.items()}


def open_hf_source(path: str, gguf_file: Optional[str] = None) -> Mapping:
    """HF weights at ``path``: :class:`SafetensorsSource` or a de-quantised GGUF state dict."""
    if gguf_file:
        return load_gguf_state_dict(path, gguf_file)
    return SafetensorsSource(path)
