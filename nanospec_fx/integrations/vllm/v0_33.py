"""The adapter for vLLM 0.33.x.

Checked against the 0.33.0 source (the contract test): the V1 model runner's hooked methods, their parameters and
every attribute the 0.32 adapter reads are unchanged (0.33's new ``SchedulerOutput.skip_drafts`` is read only by
Model Runner V2), so this adapter reuses the 0.32 hooks and declares its own contract. Model Runner V2, which 0.33
picks by default where Triton is available, has no such hooks: the adapter asks for V1 (``choose_v1_runner``) and
the step counter reports the plugin inactive where V2 runs anyway.
"""
from __future__ import annotations

from nanospec_fx.integrations.vllm import v0_32

RELEASE = "0.33.0"
WHEEL = "vllm"  # the CUDA build's wheel (~340 MB); only the contract's .py files are read from it
SUPPORTED_METHODS = v0_32.SUPPORTED_METHODS
CONTRACT = v0_32.CONTRACT
install = v0_32.install
