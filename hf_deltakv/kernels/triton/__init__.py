"""Triton kernels, one op per file; each computes what the function of the same name in `kernels/reference.py`
specifies. Importing a file here needs Triton (an optional extra); `kernels.use_triton` decides when to."""
