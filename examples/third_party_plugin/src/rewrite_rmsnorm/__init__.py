"""Example third-party plugin for ``rewrite``: RMSNorm subgraphs -> ONNX ``RMSNormalization`` (opset 23)."""
