"""Seeds every test and, on machines without a GPU, turns on Triton's interpreter before anything
imports triton, so that the kernels themselves run on CPU tensors."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:  # every launch through tileattn.kernels.launch is checked against the build Triton selects
    os.environ.setdefault("TILEATTN_VERIFY_LAUNCH", "1")

import pytest  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
# Where the attention runs: "cuda" (the kernels on the GPU), "torch" (the CPU path) and
# "interpret" (the kernels under Triton's interpreter, on CPU tensors).
BACKENDS = ["cuda"] if HAS_CUDA else ["torch", "interpret"]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param
