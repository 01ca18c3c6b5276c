"""GPU kernels written in Triton. Each module imports triton at its top. So it is imported only once a
backend that needs it is chosen (triton_backend.py), because TRITON_INTERPRET is read when a kernel is defined."""
