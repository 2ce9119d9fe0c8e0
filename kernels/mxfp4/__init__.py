"""Routing data for the MXFP4 experts' Triton GEMMs (triton_kernels' layout), prepared in few launches."""
