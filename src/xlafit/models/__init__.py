"""Models, in Flax NNX."""

from xlafit.models.cnn import MnistCNN

__all__ = ["MnistCNN"]
