"""The built-in components, one module per part: embedding, norm, rope, attention, mlp, block, head."""
