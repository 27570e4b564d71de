"""The ``vllm.general_plugins`` entry point (``nanospec_fx.vllm_plugin:register``) and the names earlier releases
exported; the plugin itself is :mod:`nanospec_fx.integrations.vllm` (docs/vllm.md)."""
from __future__ import annotations

from nanospec_fx.integrations.vllm import SUPPORTED_VLLM, check_version, enabled, heads, install, register, status
from nanospec_fx.integrations.vllm.config import (ENV_CAPACITY, ENV_MAX_REQUESTS, ENV_POLICY, ENV_RECORD,
                                                  ENV_RECORD_DIR, ENV_STATIC, ENV_STATIC_SIZE, ENV_SWITCH, ENV_TOPK,
                                                  ENV_V2, static_tokens)
from nanospec_fx.integrations.vllm.head import STATIC_ROW, NanoSpecHead

__all__ = ["ENV_CAPACITY", "ENV_MAX_REQUESTS", "ENV_POLICY", "ENV_RECORD", "ENV_RECORD_DIR", "ENV_STATIC",
           "ENV_STATIC_SIZE", "ENV_SWITCH", "ENV_TOPK", "ENV_V2", "STATIC_ROW", "SUPPORTED_VLLM", "NanoSpecHead", "check_version",
           "enabled", "heads", "install", "register", "static_tokens", "status"]
