"""The performance layers of nano_quant: Triton kernels that stand in for the torch references of the
quantized linears (`linear.py`); a fork may delete any of them and the rest still runs, slower."""
