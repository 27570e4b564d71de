"""What a new user meets with the README's API: the backend's options as keywords, as attach takes them."""
import pytest
import torch

import nanospec_fx
from drafters import TinyDrafter


def test_compile_takes_the_backends_options_as_keywords():
    torch.manual_seed(0)
    model = TinyDrafter(97, 8).eval()
    compiled = nanospec_fx.compile(model, capacity=8, inductor=False, dynamic=False)  # dynamic: torch.compile's
    with torch.no_grad():
        compiled(torch.randint(0, 97, (1, 4)))
    assert nanospec_fx.active_vocab(model).capacity == 8
    with pytest.raises(ValueError, match="capacity must be a positive int"):
        nanospec_fx.compile(TinyDrafter(97, 8), capacity=0)
    with pytest.raises(ValueError, match="both in options= and as keywords"):
        nanospec_fx.compile(TinyDrafter(97, 8), {"capacity": 8}, capacity=16)
