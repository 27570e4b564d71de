"""The transactional observe checks every lookup of a call before it observes (passes/observe_inputs.py): each check
is inserted where its lookup's ids exist, so the graph grows while the checks are placed. Graphs with several tables
read at the same ids (token-type or segment tables, GPT-OSS's attention sinks and MoE beside its token embedding) put
each new check next to the previous one; the pass must place them by the graph as it is then (issue 40: a node-order
index computed once raised ``KeyError: ge_2`` at compile, where eager runs).

Oracle: the eager drafter, its logits masked to the active set the state reports after the call."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import nanospec_fx
from helpers import active_mask, compile_nanospec

V, H = 64, 16


class SegmentTables(nn.Module):
    """A token embedding and ``n`` small tables read at one segment id computed from the tokens, and a type table
    read at an input of its own: every small lookup is checked by the observe's transaction, at the same place."""

    def __init__(self, n: int):
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.small = nn.ModuleList(nn.Embedding(3 + i, H) for i in range(n))
        self.types = nn.Embedding(2, H)
        self.lm_head = nn.Linear(H, V, bias=False)

    def forward(self, ids, type_ids):
        segment = ids % 3
        h = self.embed(ids) + self.types(type_ids)
        for table in self.small:
            h = h + table(segment)
        return self.lm_head(torch.tanh(h))


@pytest.mark.parametrize("n", [1, 2, 3])
def test_several_tables_read_at_the_same_ids_compile_and_match_the_oracle(n):
    torch.manual_seed(0)
    model = SegmentTables(n).eval()
    compiled = compile_nanospec(model, capacity=32)
    ids, types = torch.tensor([[5, 9, 40, 2]]), torch.tensor([[0, 1, 1, 0]])
    with torch.inference_mode():
        out, ref = compiled(ids, types), model(ids, types)
    mask = active_mask(model)
    assert mask[ids].all(), "the fed ids are active"
    assert torch.isinf(out[..., ~mask]).all()
    torch.testing.assert_close(out[..., mask], ref[..., mask])
    with torch.inference_mode(), pytest.raises(IndexError):  # a type id past its table: the call observes nothing
        compiled(torch.tensor([[7, 8, 9, 10]]), torch.tensor([[0, 2, 0, 0]]))
    assert not nanospec_fx.active_vocab(model).contains(torch.tensor([7, 8, 10])).any()


def test_a_tiny_gpt_oss_compiles_and_matches_the_oracle():
    """transformers' GptOssForCausalLM (attention sinks, MoE routing): a compile crash on main (issue 40)."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "GptOssForCausalLM"):
        pytest.skip("this transformers has no GPT-OSS")
    config = transformers.GptOssConfig(
        vocab_size=300, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        sliding_window=8, layer_types=["sliding_attention"])
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).eval()
    compiled = compile_nanospec(model, capacity=64)
    ids = torch.randint(0, 300, (1, 6), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        out, ref = compiled(ids).logits, model(ids).logits
    mask = active_mask(model)
    assert mask[ids].all() and 0 < int(mask.sum()) < 300
    assert torch.isinf(out[..., ~mask]).all()
    torch.testing.assert_close(out[..., mask], ref[..., mask], rtol=1e-5, atol=1e-5)
