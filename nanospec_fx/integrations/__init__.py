"""Where nanospec meets a serving stack: transformers (``transformers``: compile, attach, speculative_pair;
``mtp``: drafters that score the target's head) and vLLM (``vllm/``)."""
