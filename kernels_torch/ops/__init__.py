"""Fused GPU ops (Triton) with readable torch twins: ``sparse_mla`` (DSA sparse MLA forward), ``situ`` (SiTU-GLU),
``kda_prep`` (the KDA q/k L2 norm and lower-bound gate before cuDNN's KDA op; twins ``kernels_torch.kda.l2norm`` /
``kda_gate``); ``linears`` (several projections of one input, its gradient summed inside the backward GEMMs; plain
torch); ``moe_grouped`` (the grouped experts' layout and gather-sums); ``custom`` (the ``torch.library`` machinery
that makes these and the layers' other kernels ``kimi::`` ops for ``torch.compile``: ``kernels_torch.compile``)."""
