"""The kernel-selection API (nanospec_fx.kernels.selection): scoped overrides, env defaults read once, the cache key."""
from __future__ import annotations

import contextvars
import threading

import pytest
import torch

import nanospec_fx
from nanospec_fx.kernels import dispatch, host, reference, selection
from nanospec_fx.kernels.selection import KernelConfig, KernelSelectionWarning, current_config, use_kernels
from helpers import run_python


@pytest.fixture
def fresh_env(monkeypatch):
    """The environment is read again at the next kernel call (and forgotten again after the test)."""
    for name in ("NANOSPEC_KERNELS", "NANOSPEC_HEAD_CONFIG", "NANOSPEC_TRITON_OP"):
        monkeypatch.delenv(name, raising=False)
    selection._reset_for_tests()
    yield monkeypatch
    selection._reset_for_tests()  # monkeypatch restores the environment next; the next call reads it again


def test_exported_from_the_package():
    assert nanospec_fx.use_kernels is use_kernels and nanospec_fx.KernelConfig is KernelConfig


def test_blocks_nest_and_restore():
    base = current_config("cpu")
    with use_kernels("reference"):
        assert dispatch.path_for("cpu") == "reference"
        with use_kernels(head_config="c64_w8"):  # an unset field keeps the enclosing choice
            assert current_config("cpu") == KernelConfig("reference", "c64_w8")
            with use_kernels("host"):
                assert dispatch.path_for("cpu") == "host"
                assert current_config("cpu").head_config == "c64_w8"
            assert dispatch.path_for("cpu") == "reference"
        assert current_config("cpu").head_config == base.head_config
    assert current_config("cpu") == base


def test_a_device_override_applies_to_that_device_type_only():
    cpu = torch.zeros(2)
    with use_kernels("auto"):
        with use_kernels("reference", device="cpu"):
            assert dispatch.implementation_for("compact_logits", cpu) is reference.compact_logits
            assert current_config("cuda").kernels == "auto"
            assert current_config(None).kernels == "auto"  # the all-devices choice
        with use_kernels("reference", device="cuda:1"):  # a device names its type: every CUDA device
            assert current_config("cuda").kernels == "reference"
            assert dispatch.implementation_for("compact_logits", cpu) is host.compact_logits
        with use_kernels("host", device="cpu"), use_kernels("reference"):  # the inner, wider one wins
            assert current_config("cpu").kernels == "reference"


def test_overrides_do_not_leak_between_threads_or_contexts():
    seen = {}
    started, release = threading.Event(), threading.Event()

    def other():
        started.set()
        release.wait(30)
        seen["thread"] = current_config("cpu").kernels

    with use_kernels("host"):
        thread = threading.Thread(target=other)
        thread.start()
        started.wait(30)
        with use_kernels("reference"):
            release.set()
            thread.join(30)
        seen["copied"] = contextvars.copy_context().run(lambda: current_config("cpu").kernels)
    assert seen["thread"] == selection.default_config().kernels  # a new thread starts with no override
    assert seen["copied"] == "host"  # a copied context (an asyncio task) inherits, then diverges on its own


@pytest.mark.parametrize("kwargs, match", [
    (dict(kernels="fast"), "auto, reference, host, triton"),
    (dict(head_config="fastest"), "default"),
])
def test_bad_values_raise_at_the_block(kwargs, match):
    with pytest.raises(ValueError, match=match), use_kernels(**kwargs):
        pass
    with pytest.raises(ValueError, match=match):
        KernelConfig(**kwargs)


def test_environment_gives_the_defaults_and_is_read_once(fresh_env):
    fresh_env.setenv("NANOSPEC_KERNELS", " Reference ")
    fresh_env.setenv("NANOSPEC_HEAD_CONFIG", "c16_k128_s4")
    assert current_config("cpu") == KernelConfig("reference", "c16_k128_s4")
    assert dispatch.path_for("cpu") == "reference"
    with use_kernels("host"):
        assert dispatch.path_for("cpu") == "host"
    fresh_env.setenv("NANOSPEC_KERNELS", "host")
    with pytest.warns(KernelSelectionWarning, match="NANOSPEC_KERNELS changed .* no effect"):
        assert dispatch.path_for("cpu") == "reference"


@pytest.mark.parametrize("name, value", [
    ("NANOSPEC_KERNELS", "fast"), ("NANOSPEC_HEAD_CONFIG", "fastest"), ("NANOSPEC_TRITON_OP", "yes"),
])
def test_a_bad_environment_value_raises_at_the_first_call(fresh_env, name, value):
    fresh_env.setenv(name, value)
    with pytest.raises(ValueError, match=f"{name}='{value}' is not one of"):
        current_config("cpu") if name != "NANOSPEC_TRITON_OP" else selection.triton_op_choice()


def test_cache_key_names_the_effective_config():
    keys = set()
    with use_kernels("reference"):
        keys.add(selection.cache_key())
        with use_kernels(head_config="c64_w8", device="cuda"):
            keys.add(selection.cache_key())
    with use_kernels("triton", device="cuda"):
        keys.add(selection.cache_key())
    keys.add(selection.cache_key())
    assert len(keys) == 4
    with use_kernels("reference"):
        assert selection.cache_key() in keys  # the same config: the same key
        assert f"triton_op={selection.triton_op_choice()}" in selection.cache_key()


def test_the_backend_compiles_with_the_key_in_inductors_cache_tag(monkeypatch):
    """lowering.compile_graph hands inductor the kernel config as part of torch.compiler.config.cache_key_tag (part of
    the FX-graph and AOTAutograd cache keys)."""
    import torch._inductor.compile_fx as cfx
    import torch.compiler.config as cconfig

    from nanospec_fx.compiler import lowering

    tags = []
    monkeypatch.setattr(cfx, "compile_fx", lambda *a, **k: tags.append(cconfig.cache_key_tag))
    with use_kernels("reference"):
        lowering.compile_graph(None, [], True, {})
        want = selection.cache_key()
    assert tags == [want] and cconfig.cache_key_tag == ""


_CACHE_SCRIPT = r"""
import torch
from torch._dynamo.utils import counters
from torch._inductor.utils import fresh_cache
from nanospec_fx.compiler.lowering import compile_graph
from nanospec_fx.kernels.selection import use_kernels

def fn(x):
    return torch.sin(x) + 1

def backend(gm, example_inputs):  # the nanospec backend's inductor step, on a graph with no head to rewrite
    return compile_graph(gm, example_inputs, True, {})

def compile_under(mode):
    torch._dynamo.reset()  # the subject: Dynamo compiles fn again, so the graph reaches inductor's caches each time
    with use_kernels(mode):
        torch.compile(fn, backend=backend)(torch.randn(4))
    return counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"]  # so far

with fresh_cache():
    print(compile_under("reference"), compile_under("host"), compile_under("reference"))
"""


@pytest.mark.slow
def test_inductor_does_not_reuse_a_graph_compiled_under_another_config():
    """Through inductor's real caches (fresh; FX-graph and AOTAutograd): the same graph compiled by the backend
    under "reference" then "host" misses both (without the tag the second would hit); under "reference" again,
    it hits. (A fresh process: the counters and the cache directory are its own.)"""
    proc = run_python(_CACHE_SCRIPT, timeout=600)
    hits = [int(n) for n in proc.stdout.split()[-3:]]
    assert hits[0] == hits[1] == 0 and hits[2] > 0, (hits, proc.stderr[-3000:])


def test_the_environment_sets_a_fresh_process_defaults():
    """Set before the first kernel call (here: before the process starts), the variables are its defaults."""
    proc = run_python("""
        import nanospec_fx.kernels
        from nanospec_fx.kernels.dispatch import path_for
        from nanospec_fx.kernels.selection import current_config
        print(path_for("cpu"), current_config("cuda").head_config)
    """, env={"NANOSPEC_KERNELS": "reference", "NANOSPEC_HEAD_CONFIG": "c64_w8"}, timeout=300)
    assert proc.stdout.split()[-2:] == ["reference", "c64_w8"], proc.stderr[-3000:]


def _count_calls(monkeypatch, name):
    """Wrap ``name`` in the host and reference modules: the list of which of the two each op call ran."""
    ran = []
    for module, tag in ((host, "host"), (reference, "reference")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _tag=tag: ran.append(_tag) or _real(*a))
    return ran


def test_a_switch_inside_a_loop_takes_effect_at_the_next_op_call(monkeypatch):
    """The config is resolved once per scope and device type and kept (issue 39): entering or leaving a block, even
    a device-only one, still switches the very next op call, in eager calls under inference_mode as a decode
    loop makes them."""
    from nanospec_fx.kernels import ops  # noqa: F401 - registers the ops

    ran = _count_calls(monkeypatch, "compact_topk")
    ids, cursor = torch.tensor([4, 9, 1, 7]), torch.tensor([3])
    logits = torch.tensor([[0.5, 2.0, 1.0, -1.0]])
    want = []
    with torch.inference_mode(), use_kernels("host"):
        for i in range(6):
            if i % 3 == 0:
                values, tokens = torch.ops.nanospec.compact_topk(logits, ids, cursor, 2)
                want.append("host")
            elif i % 3 == 1:
                with use_kernels("reference", device="cpu"):
                    values, tokens = torch.ops.nanospec.compact_topk(logits, ids, cursor, 2)
                    want.append("reference")
                    with use_kernels("host", device="cuda"):  # another device's block: CPU calls keep "reference"
                        torch.ops.nanospec.compact_topk(logits, ids, cursor, 2)
                        want.append("reference")
            else:
                with use_kernels("reference"), use_kernels("host"):  # the inner block wins
                    values, tokens = torch.ops.nanospec.compact_topk(logits, ids, cursor, 2)
                    want.append("host")
            assert tokens.tolist() == [[9, 1]] and values.tolist() == [[2.0, 1.0]]
    assert ran == want


def test_a_thread_resolves_its_own_config_while_another_holds_a_block(monkeypatch):
    """Resolved configs are kept per scope: a thread that starts with no block runs the defaults' path even after
    the main thread resolved a block's config, and the main thread's next call after the block runs the defaults."""
    from nanospec_fx.kernels import ops  # noqa: F401 - registers the ops

    ran = _count_calls(monkeypatch, "compact_argmax")
    ids, cursor, logits = torch.tensor([4, 9]), torch.tensor([2]), torch.tensor([[0.5, 2.0]])
    default = "reference" if dispatch.path_for("cpu") == "reference" else "host"
    with use_kernels("reference" if default == "host" else "host"):
        assert torch.ops.nanospec.compact_argmax(logits, ids, cursor).tolist() == [9]
        thread = threading.Thread(target=lambda: torch.ops.nanospec.compact_argmax(logits, ids, cursor))
        thread.start()
        thread.join(30)
    torch.ops.nanospec.compact_argmax(logits, ids, cursor)
    assert ran[1:] == [default, default] and ran[0] != default


def test_the_opaque_ops_run_their_own_cpu_kernel():
    """On CPU the opaque ops dispatch to a kernel on the CPU key (issue 39: not custom_op's generic one behind
    CompositeExplicitAutograd); the fake, autograd and composite registrations stay in place."""
    from nanospec_fx.kernels import ops

    for name in ("observe", "compact_logits", "scatter_logits", "head_logits", "compact_topk", "compact_argmax"):
        qualname = f"nanospec::{name}"
        if ops.USES_TRITON_OP and name != "observe":
            continue  # a triton_op is traced into by inductor: torch owns its kernels
        assert torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "CPU"), name
        assert torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "CompositeExplicitAutograd"), name
