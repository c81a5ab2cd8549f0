"""State caches of the Qwen backend: the key under which a prefix state is cached, and the
vision embeddings of recently seen images."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Sequence

import numpy as np
import torch

from ...runtime.requests import Image


def prefix_cache_key(ids: np.ndarray, images: Sequence[Image]) -> np.ndarray:
    """Prefix-cache key: the tokens, with each image's identity written in as negative words
    at the end (never a token id), so prefixes with different images never match."""
    if not images:
        return ids
    words = [np.frombuffer(hashlib.blake2b(im.key, digest_size=16).digest(), dtype="<i8")
             for im in images]
    return np.concatenate([ids] + [-(w & np.int64(0x7FFFFFFFFFFFFFFF)) - 1 for w in words])


class ImageEmbeddingCache:
    """Vision embeddings by image key, least recently used evicted beyond a byte budget (the
    same image or crop is asked for by many requests: every claim of a caption)."""

    def __init__(self, capacity_bytes: int):
        self.capacity = capacity_bytes
        self.bytes = 0
        self.entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()

    def __contains__(self, key: bytes) -> bool:
        return key in self.entries

    def get(self, key: bytes) -> torch.Tensor:
        self.entries.move_to_end(key)
        return self.entries[key]

    def put(self, key: bytes, embeds: torch.Tensor) -> None:
        if key in self.entries:
            return
        self.entries[key] = embeds
        self.bytes += embeds.numel() * embeds.element_size()
        while self.bytes > self.capacity and len(self.entries) > 1:
            _, old = self.entries.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()
