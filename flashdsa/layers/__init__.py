"""Model layers: the lightning indexer and DSA attention (MLA, absorbed form), HF parameter names."""

from flashdsa.layers.attention import DSAAttention, RMSNorm
from flashdsa.layers.indexer import Indexer, IndexerOutput
from flashdsa.layers.rope import RotaryEmbedding

__all__ = ["DSAAttention", "Indexer", "IndexerOutput", "RMSNorm", "RotaryEmbedding"]
