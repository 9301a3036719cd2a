"""Test-wide settings, chosen once for the whole process before any test module imports.

- Never touch the network, never send analytics.
- `TRITON_INTERPRET=1` on machines without CUDA, so the Triton kernels run in the
  interpreter. Triton reads this variable once, when a `@triton.jit` kernel is
  defined (when `kernels.*` is first imported), and a kernel keeps that choice for
  the life of the process: it cannot be set per test with `monkeypatch`, so it is
  set here, process-wide, before anything imports `kernels`. This is the one
  environment setting no test undoes. Tests that need the opposite (Triton on CPU
  *without* the interpreter) run in a subprocess whose environment lacks the
  variable, so no test depends on the order tests run in. With CUDA the kernels
  are compiled and the variable is left alone.

Every other environment change in a test goes through `monkeypatch`.
"""

import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
