"""attnlib inside other frameworks: ``attnlib.integrations.torch`` (a ``torch.library`` custom op)
and ``attnlib.integrations.transformers`` (``attn_implementation="attnlib"``). Each imports its
framework when it is imported itself; ``import attnlib`` imports neither."""
