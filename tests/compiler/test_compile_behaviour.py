"""How the backend behaves under torch.compile: registration, recompiles, state binding."""
from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend

import nanospec_fx
from drafters import TinyDrafter
from helpers import active_mask, compile_nanospec, run_python


def _run_fresh(code: str) -> str:
    return run_python(code, timeout=300).stdout


@pytest.mark.slow
def test_backend_works_in_a_fresh_process_without_importing_the_package():
    out = _run_fresh("""
        import sys, torch
        m = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 50)).eval()
        c = torch.compile(m, backend="nanospec", options={"capacity": 4, "inductor": False})
        with torch.no_grad():
            out = c(torch.tensor([[3, 4]]))
        print(int(torch.isfinite(out).sum()), "nanospec_fx" in sys.modules)
    """)
    assert out.split() == ["4", "True"]  # 2 rows x 2 active tokens finite; loaded via the entry point


@pytest.mark.slow
def test_importing_the_package_after_the_entry_point_does_not_duplicate():
    out = _run_fresh("""
        import torch
        from torch._dynamo import list_backends, lookup_backend
        lookup_backend("nanospec")          # loads the entry point
        import nanospec_fx
        nanospec_fx.register()              # a second registration is a no-op
        print(list_backends(exclude_tags=()).count("nanospec"))
    """)
    assert out.strip() == "1"


def test_active_set_changes_do_not_recompile():
    torch.manual_seed(0)
    model = TinyDrafter(120, 8, post="softcap").eval()
    counter = CompileCounterWithBackend("nanospec")
    compiled = torch.compile(model, backend=counter)
    with torch.no_grad():
        compiled(torch.randint(0, 120, (1, 4)))
        state = nanospec_fx.active_vocab(model)
        with torch.compiler.set_stance("fail_on_recompile"):
            for i in range(5):
                ids = torch.randint(0, 120, (1, 4))
                state.observe(torch.randint(0, 120, (7,)))
                if i == 3:
                    state.reset()
                out = compiled(ids)
                torch.testing.assert_close(out, model(ids, _mask=active_mask(model)))
    assert counter.frame_count == 1


def test_state_is_updated_in_place_and_keeps_addresses_across_calls():
    model = TinyDrafter(60, 8).eval()
    compiled = compile_nanospec(model, capacity=10, inductor=True)
    with torch.no_grad():
        compiled(torch.tensor([[1, 2, 3]]))
        state = nanospec_fx.active_vocab(model)
        addresses = [t.data_ptr() for t in state.tensors()]
        compiled(torch.tensor([[4, 5]]))
    assert sorted(state.token_ids().tolist()) == [1, 2, 3, 4, 5]
    assert [t.data_ptr() for t in state.tensors()] == addresses


def test_a_second_instance_reusing_the_compiled_graph_gets_its_own_state():
    torch.manual_seed(0)
    a, b = TinyDrafter(70, 8).eval(), TinyDrafter(70, 8).eval()
    ca = torch.compile(a, backend="nanospec", options={"capacity": 8, "inductor": False})
    cb = torch.compile(b, backend="nanospec", options={"capacity": 8, "inductor": False})
    ids = torch.tensor([[5, 6]])
    with torch.no_grad():
        ca(ids)
        out_b = cb(torch.tensor([[9]]))
        expected_b = b(torch.tensor([[9]]), _mask=active_mask(b))
    torch.testing.assert_close(out_b, expected_b)
    assert nanospec_fx.active_vocab(a) is not nanospec_fx.active_vocab(b)
    assert nanospec_fx.active_vocab(b).token_ids().tolist() == [9]


def test_dynamic_row_dims():
    torch.manual_seed(0)
    model = TinyDrafter(90, 8, post="last_position").eval()
    compiled = torch.compile(model, backend="nanospec", dynamic=True, options={"capacity": 16, "inductor": False})
    with torch.no_grad():
        for batch, seq in [(1, 3), (3, 5), (2, 7)]:
            ids = torch.randint(0, 90, (batch, seq))
            out = compiled(ids)
            torch.testing.assert_close(out, model(ids, _mask=active_mask(model)))
