"""Draft-model quantization: INT4 GPTQ layout, round-to-nearest and GPTQ quantizers, draft files."""
from specter.quant.int4 import GROUP_SIZE, Int4Linear, dequantize, quantize_rtn

__all__ = ["GROUP_SIZE", "Int4Linear", "dequantize", "quantize_rtn"]
