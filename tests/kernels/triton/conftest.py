"""Kernel tests run compiled on CUDA when there is a GPU, else under the Triton interpreter.

TRITON_INTERPRET must be in the environment before any kernel module is imported (`triton.jit`
decides at decoration time whether a kernel is interpreted), so it is set here, before the test
modules of this folder are collected. Each test module skips itself when triton is missing.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
