"""Example third-party package: an IREE CUDA lowering of rewrite's built-in ``MoERouterTopK`` op."""
