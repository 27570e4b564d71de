"""nanospec-fx: NanoSpec's dynamic active vocabulary as a torch.compile backend.

    compiled = torch.compile(drafter, backend="nanospec")
    nanospec_fx.active_vocab(drafter)   # the ActiveVocab of its LM head

The pass lives in ``nanospec_fx.passes``, the kernels in ``nanospec_fx.kernels``, the state
in ``nanospec_fx.state`` and the backend in ``nanospec_fx.backend``.
"""
from nanospec_fx.state import DEFAULT_CAPACITY, ActiveVocab, active_vocab
from nanospec_fx.backend import BACKEND_NAME, NanoSpecWarning, nanospec_backend
from nanospec_fx.options import NanoSpecOptions
from nanospec_fx.policies import POLICIES, FrequencyTable
from nanospec_fx.integrations import attach, speculative_pair
from nanospec_fx.explain import explain
from nanospec_fx.cost_model import HeadCost

__version__ = "0.1.0"


def register() -> None:
    """Register the ``nanospec`` backend with Dynamo, unless it is known already.

    After ``pip install`` the ``torch_dynamo_backends`` entry point makes it known without
    any import; registering a second time would fail with "duplicate name".
    """
    from torch._dynamo import list_backends, register_backend

    if BACKEND_NAME not in list_backends(exclude_tags=()):
        register_backend(compiler_fn=nanospec_backend, name=BACKEND_NAME)


register()

__all__ = [
    "ActiveVocab", "active_vocab", "attach", "speculative_pair", "explain", "HeadCost", "FrequencyTable", "POLICIES",
    "DEFAULT_CAPACITY", "NanoSpecOptions", "NanoSpecWarning", "nanospec_backend", "register", "BACKEND_NAME",
]
