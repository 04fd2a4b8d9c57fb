"""``python -m convert``: Hugging Face Gemma 4 checkpoints -> MLX weights, optionally quantized."""

from .converter import ConversionError, OutputFolderError, QuantizationPlan, convert, quantize_model

__all__ = ["convert", "quantize_model", "QuantizationPlan", "ConversionError", "OutputFolderError"]
