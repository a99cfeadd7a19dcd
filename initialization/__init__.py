"""Asset preparation: model download with checksums, draft quantization, dataset preparation."""
