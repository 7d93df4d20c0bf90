"""Kernel tests run the Triton kernels on CUDA when there is one, else on CPU under
Triton's interpreter; TRITON_INTERPRET must be set before any kernel module is imported."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
