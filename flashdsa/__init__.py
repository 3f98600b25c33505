"""flashdsa: DeepSeek Sparse Attention end to end (PyTorch + Triton)."""

from flashdsa.config import DSAConfig, is_dsa

__version__ = "0.1.0"  # the package version: pyproject.toml reads it from here
__all__ = ["DSAConfig", "is_dsa", "__version__"]
