"""Fused GPU ops (Triton) with readable torch twins: ``sparse_mla`` (DSA sparse MLA forward), ``situ`` (SiTU-GLU)."""
