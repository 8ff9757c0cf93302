"""The tools that drive both paths: the equivalence harness (``compare``) and the ``kimi`` command line.

Layering (every import points down)::

    kimi_tools/                  compare, cli, and the train / generate / ablate tools
        |            \\
    reference_jax/   kernels_torch/     the two paths; they never import each other
        \\            /
    kimi/                        config, layout, checkpoint I/O, MXFP4, init, tokenizer
"""
