"""Failures the pass fuzzer found, shrunk to small recipes and kept as explicit cases.

Each case runs ``run_case`` (or ``run_scenario``; tests/passes/fuzz_judge.py, the fuzzer's judge): the compiled
drafter must equal the oracle of issue 16's contract (masked where a chain tensor is read from outside the chain, IEEE after),
or warn and equal the dense drafter. A case whose defect is still open is an xfail naming its issue-16 class
(``strict=False`` while the pass is rewritten; the lead flips them to plain cases once fixed).
"""
from __future__ import annotations


import pytest

from fuzz_drafters import Recipe
from nanospec_fx.kernels.selection import use_kernels
from fuzz_judge import Scenario, run_case, run_scenario  # beside this file


def _open(reason: str):
    return pytest.mark.xfail(strict=True, reason=reason)


def _issue16(n: int, what: str):
    """A shrunk case of issue 16's class ``n`` (``what`` the pass did wrong before it was closed): no mark, it
    must pass."""
    return ()


def _open16(n: int, what: str):
    return (pytest.mark.xfail(strict=True, reason=f"issue 16 class {n}, open: {what}"),)


B = dict(vocab=60, hidden=16, head="linear", batch=2, seq=3, seq2=3)


def R(**kw) -> Recipe:
    return Recipe(**{**B, **kw})


_TOPK_SMALLEST = ()  # the contract: top-k(largest=False) over the masked logits selects inactive tokens (-inf)

# name -> (recipe, marks): found on f9ba722 (before the issue-9 fixes) or on the issue-9 branch (fuzz_findings.md).
CASES = {
    # found by a long run: two lookups of one table in a call (a vmap'd embedding and a second lookup) observed by two
    # observe ops: the second's new tokens evicted a token the first fed (already active, at an old slot) from a full
    # ring; now one observe of all of a call's ids
    "two_lookups_in_one_call_fill_a_small_ring": (Recipe(vocab=40, hidden=24, head='functional_tied', head_bias=False, head_pad=0, embed_pad=0, position=True, body=('mlp',), order='embed_first', chain=(('gumbel',), ('softmax',), ('softmax',)), return_logits=True, extra_outputs=('hidden',), dtype='float16', mode='no_grad', autocast=False, capacity=4, batch=1, seq=2, seq2=2, feed_padded_ids=False, extra_active=20, n_ban=1, seed=720, lookup='vmap_embedding', head_break='', hook=False, draft_steps=0, draft_feed='argmax', extra_heads=0, head_vmap=False, second_lookup='same_table', bad_call='', bad_at='ids', d2t=''), ()),
    # found by a long run with the small-tables grammar (issue 40): the real head not found (a padded table), a router
    # as wide as a 4-row segment table (read at ``ids % 3``) was taken for the head and masked to the active set
    "router_as_wide_as_a_segment_table": (Recipe(vocab=99, hidden=16, head='dequant', head_bias=False, head_pad=24, embed_pad=3, position=True, body=('mlp', 'clamp_fn_'), order='embed_first', chain=(('log_softmax',), ('vslice',)), return_logits=True, extra_outputs=('router', 'hidden'), dtype='float16', mode='no_grad', autocast=False, capacity=4, batch=1, seq=2, seq2=2, feed_padded_ids=False, extra_active=3, n_ban=3, seed=46117, lookup='embedding', head_break='', hook=False, draft_steps=0, draft_feed='argmax', extra_heads=0, head_vmap=False, second_lookup='', bad_call='past_table', bad_at='ids', d2t='', small_tables=2), ()),
    # in-place writes of the logits lost or applied to stale compact values
    "setitem_then_softcap": (R(chain=(("setitem", "-inf"), ("softcap", 2.0))), ()),
    "setitem_view_then_masked_fill_": (R(chain=(("setitem_view", 0.0), ("masked_fill_", 0.0), ("scale", 0.5)),
                                         dtype="bfloat16", batch=1, seq=1, seq2=2), ()),
    "setitem_finite_value": (R(chain=(("setitem", 0.0),)), ()),
    "setitem_view_then_clamp": (R(chain=(("setitem_view", "-inf"), ("clamp", -2.0))), ()),
    "setitem_then_sort": (R(vocab=111, head="functional_tied", body=(),
                            chain=(("setitem", 0.0), ("sort", True, "none")), batch=2, seq=2, n_ban=3, seed=665), ()),
    "clamp_method_then_log_softmax_topk": (R(chain=(("clamp_", -2.0), ("topk", 4, True, "log_softmax"))), ()),
    "clamp_function_form": (R(chain=(("clamp_fn_", -2.0),)), ()),
    "nan_to_num_function_form": (R(chain=(("masked_fill_", "-inf"), ("nan_to_num_fn", -50.0))), ()),
    "div_out_self": (R(chain=(("out_self", 0.7),)), ()),
    "log_softmax_then_out_softcap": (R(chain=(("log_softmax",), ("out_new_softcap", 2.0))), ()),
    # head selection and the projection that is rewritten
    "position_table_dynamic_seq": (R(vocab=40, head="matmul_T", position=True, extra_outputs=("hidden",), seq2=2), ()),
    "position_table_dynamic_seq_padded_embedding": (R(vocab=40, head="matmul_T", position=True, embed_pad=3,
                                                      extra_outputs=("hidden",), seq2=4), ()),
    "wider_projection_returned": (R(extra_outputs=("wide_proj",)), ()),
    "padded_table_and_wider_projection": (R(embed_pad=16, extra_outputs=("wide_proj",)), ()),
    "padded_table_buffer_head_and_wider_projection": (R(head="buffer", embed_pad=16, extra_outputs=("wide_proj",)), ()),
    "dequantised_head_and_router": (R(head="dequant", extra_outputs=("router",)), ()),
    # consumers reading the head output directly
    # top-k(largest=False) follows the contract literally: inactive tokens are -inf, so they are the smallest
    "topk_smallest_on_head_output": (R(chain=(("topk", 4, False, "none"),)), _TOPK_SMALLEST),
    "topk_smallest_after_out_write": (R(chain=(("out_new_softcap", 2.0), ("topk", 1, False, "none"))), _TOPK_SMALLEST),
    "topk_smallest_after_softcap": (R(chain=(("softcap", 2.0), ("topk", 4, False, "none"))), _TOPK_SMALLEST),
    # state reachability, observation
    "head_weight_in_buffer": (R(head="buffer"), ()),
    "padded_embedding_table": (R(embed_pad=3), ()),
    "graph_break_between_embedding_and_head": (R(body=("mlp", "graph_break")), ()),
    "eviction_of_reobserved_token": (R(capacity=16, extra_active=20), ()),
    "head_before_embedding": (R(order="head_first", chain=(("softcap", 2.0),)), ()),
    # side effects in the body removed by dead-code elimination
    "body_clamp_function_form": (R(body=("mlp", "clamp_fn_")), ()),
    "body_tanh_function_form": (R(body=("mlp", "tanh_fn_")), ()),
    "body_out_argument": (R(body=("mlp", "out_mul")), ()),
    # training the body with a frozen head
    "grad_mode_frozen_head": (R(mode="grad"), ()),
    # graph breaks after the head
    "graph_break_softcap_then_log_softmax": (R(vocab=133, hidden=8, head="linear_tied", head_bias=True, chain=(
        ("sub_lse",), ("graph_break",), ("out_new_softcap", 2.0), ("sub_max",), ("log_softmax",)), return_logits=False,
        capacity=4, batch=2, seq=2, seq2=2, extra_active=3, seed=168), ()),
    "graph_break_softcap_log_softmax": (R(chain=(("graph_break",), ("softcap", 2.0), ("log_softmax",))), ()),
    # found by a review (issue 40's find): an op elementwise only in one form, an operand cast like the logits, a copy
    # of the logits taken for them (each failed before the fix: SILENT, or a crash where eager runs)
    "global_max_then_softcap": (R(chain=(("sub_global_max",), ("softcap", 2.0)), batch=1), ()),
    "global_max_returned": (R(chain=(("global_max",),), batch=1), ()),
    "bias_type_as_then_softcap": (R(chain=(("bias_like", "type_as"), ("softcap", 2.0)), capacity=16), ()),
    "bias_to_logits_then_softcap": (R(chain=(("bias_like", "to"), ("softcap", 2.0))), ()),
    "contiguous_copy_banned": (R(chain=(("last",), ("copy_ban", "contiguous", "-inf"), ("softcap", 2.0))), ()),
    "to_copy_banned": (R(chain=(("last",), ("copy_ban", "to_copy", 0.0), ("softcap", 2.0))), ()),
    "float_alias_of_materialised_logits": (R(chain=(("setitem", "-inf"), ("copy_ban", "float", 0.0),
                                                    ("softcap", 2.0))), ()),
}


# Found by the issue-16 grammar and oracle (this branch, against the pass of 1e66396), shrunk.
_LOOKUP = _issue16(3, "a lookup other than nn.Embedding/E[ids] is not observed: fed ids inactive, head rewritten, "
                      "no warning")
_POST_NORM = _issue16(5, "re-masking after a normalisation: IEEE gives 0 / +inf / finfo.min / NaN / "
                         "a finite entropy there")
CASES.update({
    # class 3: lookups
    **{f"lookup_{k}": (R(lookup=k), _LOOKUP) for k in (
        "index_select", "index_select_method", "gather", "take", "one_hot", "embedding_bag", "python_ids", "buffer_ids",
        "cond")},
    "lookup_f_embedding": (R(lookup="f_embedding"), ()),
    "lookup_index": (R(lookup="index"), ()),
    # class 4: views in the chain
    "last_ellipsis_then_softcap": (R(chain=(("last_ellipsis",), ("softcap", 2.0), ("topk", 3, True, "none"))),
                                   _issue16(4, "z[..., -1, :] drops the mask: "
                                               "a later soft-cap leaves inactive tokens at -cap")),
    "flatten_then_softcap": (R(chain=(("flatten",), ("softcap", 2.0), ("topk", 3, True, "none"))), ()),
    "transpose_then_clamp": (R(chain=(("transpose",), ("clamp", -2.0))), ()),
    "unsqueeze_clamp_squeeze": (R(chain=(("unsqueeze",), ("clamp", -2.0), ("squeeze",), ("argmax", "none"))), ()),
    # class 5: after a normalisation, plain IEEE arithmetic
    "log_softmax_then_softcap": (R(chain=(("to_log_softmax",), ("softcap", 2.0))), _POST_NORM),
    "neg_log_softmax_then_clamp": (R(chain=(("to_neg_log_softmax",), ("clamp", -2.0))), _POST_NORM),
    **{f"post_{k}": (R(chain=((k,),)), _POST_NORM) for k in (
        "exp_log_softmax", "neg_log_softmax", "exp_inplace", "logp_clamp_min", "entropy_plogp", "entropy_nansum",
        "categorical_entropy", "typical", "eta")},
    "post_entropy_entr": (R(chain=(("entropy_entr",),)), ()),
    "post_inverse_cdf": (R(chain=(("inverse_cdf", "none"),)), ()),
    # class 2: the head scored before the ids are embedded, with each kind of break (dense with a warning today)
    **{f"head_first_break_{k}": (R(order="head_first", head_break=k,
                                   chain=(("masked_fill", "-inf"), ("temperature", 0.7))), ())
       for k in ("item", "int", "print", "branch", "helper_item", "helper_branch", "dynamo")},
    # class 8: a draft loop in forward whose later ids are given: not active when the first head reads the set
    "draft_loop_given_ids": (R(draft_steps=2, draft_feed="input"),
                             _issue16(8, "ids embedded by later draft steps are -inf at the earlier heads "
                                         "of the same call")),
    "draft_loop_argmax": (R(draft_steps=3), ()),
    # review of the passes: a LoRA head in a draft loop: the later step's delta (its add is computed from the earlier
    # step's logits too) was given to both head calls, compacted with the first and then read erased (a crash)
    "draft_loop_lora_head": (R(head="lora", draft_steps=2), ()),
    # (and with given ids, in grad mode: each step computed from its own ids alone)
    "draft_loop_lora_head_given_ids_grad": (R(head="lora", draft_steps=3, draft_feed="input", mode="grad"), ()),
    "draft_loop_graph_break_in_body": (R(vocab=40, hidden=8, head="functional_tied", body=("mlp", "graph_break"),
                                         return_logits=False, capacity=512, batch=1, seq=1, seq2=1, n_ban=1,
                                         draft_steps=2),
                                       _issue16(8, "a draft loop after a graph break in the body: "
                                                   "the fed-back ids are not active, "
                                                   "the loop's argmax differs from the dense drafter")),
    "draft_loop_with_gradients": (R(vocab=40, hidden=8, body=(), mode="grad", draft_steps=2),
                                  _issue16(8, "a draft loop under autograd: the compiled backward raises "
                                              "'modified by an inplace operation' where eager works")),
    # review of the passes: a post-op operand that needs gradients (a trainable [V] logit scale or bias, frozen head,
    # grad mode): run on the compact logits, its gradient read their -inf unused slots (NaN); now dense, warned
    "trainable_logit_scale": (R(mode="grad", chain=(("scale_vec",), ("softcap", 2.0)), trainable_post=True), ()),
    "trainable_logit_scale_after_a_ban": (R(mode="grad", chain=(("setitem", -1e4), ("scale_vec",)), trainable_post=True), ()),
    "trainable_logit_bias_in_place": (R(mode="enable_grad_inside", chain=(("iadd_bias",), ("log_softmax",)), trainable_post=True), ()),
    # class 11: max_norm renormalises the tied table in place during the lookup, after the rows were copied
    "max_norm_tied_embedding": (R(lookup="max_norm", head="linear_tied"),
                                _issue16(11, "embedding max_norm renormalises the tied head rows "
                                             "after the pass copied them")),
    # classes 12 and 15: gradient modes inside forward
    "enable_grad_inside_no_grad": (R(mode="enable_grad_inside"), ()),
    "no_grad_forward_in_grad_mode": (R(mode="no_grad_forward"), ()),
    "forward_hook_on_head": (R(hook=True, chain=(("softcap", 2.0), ("argmax", "none"))), ()),
    # found by a long run: a head with a computed (dequantised) weight next to a wider returned projection, ids from
    # a buffer: the wider projection was taken for the head and masked
    "computed_head_next_to_a_wider_projection": (R(vocab=164, head="dequant", chain=(("last",),), return_logits=False,
                                                   extra_outputs=("wide_proj", "router"), lookup="buffer_ids"), ()),
    # found by a long run: an out= step into a buffer made like a transposed view of the logits; with seq=1 the
    # buffer is contiguous and the whole call is rewritten; with seq=2 Dynamo recompiles, breaks at the out= op, and
    # that call runs dense with a warning. Both calls are right; the fuzzer's judge mixed the two calls' verdicts
    "transpose_then_out_softcap": (R(vocab=150, head="linear_tied", chain=(("transpose",), ("out_new_softcap", 5.0)),
                                     return_logits=False, dtype="float16", batch=3, seq=1, seq2=2, lookup="python_ids",
                                     hook=True),
                                   ()),
    # found by a long run: top-k of softmax probabilities with k above the active count pads with 0 (inactive
    # tokens' probability), not -inf: softmax -> top-k no longer runs on the compact logits
    "softmax_topk_more_than_active": (R(vocab=40, hidden=32, head="einsum", head_bias=True, head_pad=24, position=True,
                                        order="head_first", chain=(("gather_probe",), ("entropy_nansum",),
                                                                   ("temperature", 2.0), ("topk", 4, True, "softmax"),
                                                                   ("mT", "scale", 1.5)),
                                        return_logits=False, extra_outputs=("hidden",), mode="grad", capacity=64,
                                        batch=1, seq=2, seq2=2, extra_active=3, n_ban=1, seed=2), ()),
    # found by a long run: inverse-CDF sampling from softmax(-log_softmax(masked z)): inf - inf makes the oracle's
    # probabilities NaN, which the judge read as "sampled an id of probability 0"; the sample must equal the oracle's
    "inverse_cdf_over_neg_log_softmax": (R(vocab=142, hidden=24, head="linear_tied", chain=(
        ("contiguous",), ("last",), ("to_neg_log_softmax",), ("inverse_cdf", "none"), ("contiguous",),
        ("cast", "bfloat16")), mode="enable_grad_inside", lookup="index_select_method", batch=2, seq=1, seq2=1,
        extra_active=3, n_ban=3, capacity=512, body=("mlp_vocab_width", "counter", "clamp_fn_")), ()),
    # found by a long run: a value written with out= is computed from the logits (z - lse after it is no chain step)
    "out_softcap_then_categorical_entropy": (R(vocab=160, hidden=8, head="matmul_bias",
                                               chain=(("out_new_softcap", 5.0), ("categorical_entropy",)),
                                               return_logits=False, mode="no_grad", batch=1, seq=1, seq2=1,
                                               n_ban=1), ()),
    # found by a long run: bans written out of place (scatter of a constant) are steps of the chain
    "scatter_ban_then_index_fill_then_sample": (R(vocab=184, hidden=32, head="functional_tied", order="head_first",
                                                  chain=(("out_self", 0.7), ("scatter_ban", "-inf"), ("out_self", 0.5),
                                                         ("index_fill_", 0.0), ("multinomial", "log_softmax")),
                                                  return_logits=False, mode="no_grad_forward", capacity=16, batch=1,
                                                  seq=2, seq2=2, extra_active=3, n_ban=1), ()),
    # found by the CI draws of cov16: a row-wise parametrised head (W / ||W||) in grad mode: a slot never filled has a
    # zero cached row, NaN after the parametrisation, and 0 * NaN reached the body's gradient through the masked slot
    "row_norm_parametrised_head_frozen_in_grad_mode": (R(vocab=40, hidden=8, head="param_rownorm", return_logits=False,
                                                         mode="grad", capacity=4, batch=1, seq=1, seq2=1, n_ban=1), ()),
    # the several-heads block: extra nn.Linear(H, V) heads beside the head raised HeadSelectionError where eager runs;
    # each is now rewritten with its own state (or dense with a warning naming why)
    "several_heads_with_a_chain": (R(extra_heads=2, chain=(("softcap", 2.0), ("topk", 3, True, "none"))), ()),
    "several_heads_tied_head_first": (R(head="functional_tied", extra_heads=1, order="head_first",
                                        chain=(("last",), ("masked_fill_", "-inf"))), ()),
    "several_heads_hv_evicting": (R(head="matmul_hv", extra_heads=2, capacity=4, extra_active=20), ()),
    "several_heads_grad_mode": (R(extra_heads=1, mode="grad", chain=(("log_softmax",),)), ()),
    "several_heads_computed_weight_head_dense": (R(head="param_colnorm", extra_heads=1), ()),
    # a returned projection wider than the vocabulary and a graph break in the body: the graph with the head has no
    # token embedding, so nothing says which projection is the head: dense with a warning (it raised before)
    "wide_projection_after_a_body_break": (R(extra_outputs=("wide_proj",), body=("mlp", "graph_break")), ()),
})

# -- issue 32, items 4-5: functorch transforms and Python calls whose only result is an effect (each crashed or
# lost the effect before: dead-code elimination removed _vmap_increment_nesting / the call; observe ran on the
# transform's batched ids; the head's compact ops ran on batched tensors)
CASES.update({
    "vmap_body": (R(body=("mlp", "vmap_mlp")), ()),
    "vmap_lookup": (R(lookup="vmap_embedding"), ()),
    "vmap_lookup_head_first": (R(lookup="vmap_embedding", order="head_first"), ()),
    "vmap_lookup_draft_loop": (R(lookup="vmap_embedding", draft_steps=2), ()),
    # a padded table the head does not match: a head-less graph whose looked-up ids are kept for the next call
    "vmap_lookup_padded_table": (R(lookup="vmap_embedding", embed_pad=16, feed_padded_ids=True), ()),
    "vmap_head": (R(head_vmap=True, chain=(("softcap", 2.0),)), ()),
    "vmap_head_tied_log_softmax": (R(head="linear_tied", head_vmap=True, chain=(("log_softmax",),)), ()),
    "effect_call_in_body": (R(body=("mlp", "effect_call")), ()),
    "effect_call_vmap_body_grad": (R(body=("vmap_mlp", "effect_call"), mode="grad"), ()),
})

# -- issues 40 item 2 / 45 item 2: two heads' logits meet in one op (the grammar's ``combine``): silent on main for
# sub/mul/hypot/atan2 (one head's chain went on through the op, masked with its set alone)
CASES.update({
    f"heads_meet_{op}{'_grad' if mode == 'grad' else ''}": (R(extra_heads=2, combine=op, extra_active=20, mode=mode), ())
    for op, mode in (("sub", "inference"), ("mul", "inference"), ("hypot", "inference"), ("atan2", "inference"),
                     ("maximum", "grad"), ("gather_at_topk", "inference"), ("stack_amax", "no_grad"))
})


@pytest.mark.slow
def test_draft_loop_in_grad_mode_under_inductor():
    """Found by the CI draws of cov16 (test_fuzz_inductor): inductor's decompose_auto_functionalized failed on the
    observe ops of a draft loop's training graph, because AOT autograd gave the state inputs symbolic sizes
    (nanospec_fx/compiler/lowering._static_extra_inputs)."""
    with use_kernels("reference"):
        _run_inductor_draft_loop()


def _run_inductor_draft_loop():
    run_case(R(vocab=139, hidden=8, head="einsum", head_bias=True, return_logits=True,
               extra_outputs=("hidden", "wide_proj"), mode="grad", capacity=512, batch=3, seq=4, seq2=4, seed=2,
               draft_steps=3), {"inductor": True})


@pytest.mark.parametrize("name", [pytest.param(n, marks=m) for n, (_, m) in CASES.items()])
def test_fuzzer_regression(name):
    with use_kernels("reference"):
        run_case(CASES[name][0])


def test_fuzzer_regression_state_leaks_between_drafters():
    """Two drafters in one process (found by a long run: the second failed only after the first)."""
    first = Recipe(vocab=142, hidden=8, head="matmul_T", head_bias=True, embed_pad=3, position=True,
                   body=("mlp", "tanh_fn_", "tanh_fn_"), order="head_first",
                   chain=(("max", "none"), ("sub_max",), ("sub_max",)), return_logits=False,
                   extra_outputs=("wide_proj",), dtype="bfloat16", mode="no_grad", capacity=32, batch=1, seq=4, seq2=4,
                   feed_padded_ids=True, extra_active=20, n_ban=3, seed=1)
    second = R(vocab=140, hidden=8, head="matmul_bias", body=("mlp", "graph_break"), capacity=16, extra_active=20,
               batch=2, seq=4, seq2=4)
    with use_kernels("reference"):
        run_case(first)
        run_case(second)


_SAVE = _issue16(6, "the ActiveVocab lives in the head weight's __dict__: saving or pickling after a call raises")
SCENARIOS = {
    # class 1: a prefill call (no head) embeds the prompt; the next call's set must still hold it
    "prefill_then_call": (Scenario(drafters=(R(),), schedule=((0, "prefill"), (0, "call"))),
                          _issue16(1, "ids embedded by a prefill call without the head were lost")),
    "two_instances_prefill_then_call": (Scenario(drafters=(R(), R(seed=5)), schedule=(
        (0, "prefill"), (1, "prefill"), (1, "call"), (0, "call"))), ()),
    # found by a long run: a prefill after calls (the state exists) must make its ids active at once
    "call_then_prefill": (Scenario(drafters=(R(),), schedule=((0, "call"), (0, "prefill"), (0, "call"))), ()),
    # found by a long run: a second instance running a graph whose head nanospec could not find (padded table) must
    # be warned too (a prefill-recording graph had skipped the per-instance warning)
    "two_instances_head_not_found": (Scenario(drafters=tuple(
        R(head="buffer", embed_pad=3, lookup="embedding_bag", draft_steps=2, draft_feed="input", batch=1, seq=3,
          seq2=3, seed=s) for s in (0, 5)), schedule=((0, "call"), (1, "call"))), ()),
    # found by a long run: a prefill whose lookup is a one-hot matmul (the one-hot tensor is vocabulary-wide) was
    # taken for a missed head, so its ids were not kept for the next call
    "one_hot_prefill_then_call": (Scenario(drafters=(R(vocab=40, lookup="one_hot", position=True, hook=True, batch=3,
                                                       seq=1, seq2=1, dtype="float16", extra_outputs=("hidden",)),),
                                           schedule=((0, "call"), (0, "prefill"), (0, "call"))), ()),
    # found by a long run: a prefill whose body is vocabulary-wide warns (maybe a missed head) but must still keep its
    # ids for the head's next call
    "vocab_wide_prefill_then_call": (Scenario(drafters=(R(body=("mlp_vocab_width",), seq=3, seq2=4),), schedule=(
        (0, "prefill"), (0, "call"))), ()),
    "two_instances_alternate": (Scenario(drafters=(R(), R(seed=5)),
                                         schedule=((0, "call"), (1, "call"), (0, "call"))), ()),
    "two_models_reset_between": (Scenario(drafters=(R(), R(vocab=70, head="matmul_T")),
                                          schedule=((0, "call"), (0, "reset"), (1, "call"))), ()),
    **{f"save_{how}_after_call": (Scenario(drafters=(R(),),
                                           schedule=((0, "call"), (0, f"save:{how}"), (0, "call"))), _SAVE)
       for how in ("torch_save", "pickle", "state_dict_keep_vars", "weight")},
    "deepcopy_after_call": (Scenario(drafters=(R(),), schedule=((0, "call"), (0, "save:deepcopy"), (0, "call"))), ()),
    # found by a long run: two drafters sharing one nn.Embedding run one compiled graph whose head is dense (a lookup
    # inside torch.cond); the second was told apart by its first parameter, the shared table, so it was never warned
    "two_instances_sharing_an_embedding_dense_head": (Scenario(
        drafters=(R(lookup="cond"), R(lookup="cond", seed=5)), schedule=((0, "call"), (1, "call")),
        shared_embedding=True), ()),
    # found by a long run: three drafters on one shared, tied embedding (one head weight, one state) split by a graph
    # break run one dense graph holding only shared tensors: the warning names that head for all three (the judge
    # groups drafters by head weight)
    "three_drafters_sharing_a_tied_head_split_by_a_break": (Scenario(drafters=(Recipe(vocab=142, hidden=32, head='functional_tied', head_bias=False, head_pad=0, embed_pad=0, position=True, body=('mlp',), order='embed_first', chain=(('unsqueeze',), ('to_probs',)), return_logits=False, extra_outputs=(), dtype='float32', mode='inference', autocast=True, capacity=512, batch=1, seq=4, seq2=5, feed_padded_ids=False, extra_active=0, n_ban=3, seed=374, lookup='embedding', head_break='helper_print', hook=False, draft_steps=0, draft_feed='argmax', extra_heads=0, head_vmap=False, second_lookup='', bad_call='past_table', bad_at='ids', d2t=''), Recipe(vocab=142, hidden=32, head='functional_tied', head_bias=False, head_pad=0, embed_pad=0, position=True, body=('mlp',), order='embed_first', chain=(('unsqueeze',), ('to_probs',)), return_logits=False, extra_outputs=(), dtype='float32', mode='inference', autocast=True, capacity=512, batch=1, seq=4, seq2=5, feed_padded_ids=False, extra_active=0, n_ban=3, seed=1024, lookup='embedding', head_break='helper_print', hook=False, draft_steps=0, draft_feed='argmax', extra_heads=0, head_vmap=False, second_lookup='', bad_call='past_table', bad_at='ids', d2t=''), Recipe(vocab=142, hidden=32, head='functional_tied', head_bias=False, head_pad=0, embed_pad=0, position=True, body=('mlp',), order='embed_first', chain=(('unsqueeze',), ('to_probs',)), return_logits=False, extra_outputs=(), dtype='float32', mode='inference', autocast=True, capacity=512, batch=1, seq=4, seq2=5, feed_padded_ids=False, extra_active=0, n_ban=3, seed=163, lookup='embedding', head_break='helper_print', hook=False, draft_steps=0, draft_feed='argmax', extra_heads=0, head_vmap=False, second_lookup='', bad_call='past_table', bad_at='ids', d2t='')), schedule=((2, 'call'), (2, 'prefill'), (0, 'call'), (2, 'reset'), (1, 'prefill'), (0, 'call')), shared_embedding=True), ()),
    # found by a long run (stop 37, seed 37): a graph break in the loop of drafter 0's body makes Dynamo skip that
    # function for every instance of the class; drafter 1's prefill then ran its body eager and only its lookup
    # helper compiled, as a frame of its own taken for the whole call: the lookup the eager body made (the second
    # lookup of the shared table) was never observed, and no warning said so. Now a frame called from eager code
    # inside the compiled call is a piece of it (passes/graph_position.py), said at once when it looks up ids
    "prefill_under_a_body_dynamo_skipped_for_another_instance": (Scenario(drafters=(
        R(head="functional_tied", body=("mlp", "graph_break")), R(vocab=90, head="matmul_T", second_lookup="same_table")),
        schedule=((0, "call"), (1, "call"), (1, "prefill"))), ()),
    # found by a long run (a fuzzer defect, not the pass's): a draft loop over a draft vocabulary fed its head rows
    # back as target ids; the generator now maps them through d2t first, as EAGLE-3 does
    "draft_loop_over_a_draft_vocabulary": (Scenario(drafters=(R(
        vocab=183, hidden=8, body=(), embed_pad=16, batch=2, seq=1, seq2=1, draft_steps=3, second_lookup="other_table",
        d2t="option"),), schedule=((0, "call"),)), ()),
    # found by a long run: two instances of a class whose head reads a plain tensor attribute (F.linear(h, self.W))
    # after a graph break run one dense graph that receives no parameter or buffer; the second instance was never
    # told apart from the first (no warning, and explain blamed a head outside the compiled call). Now every tensor
    # the model holds tells instances apart (compiler/runtime.weight_positions)
    "two_instances_of_an_attribute_head_dense_after_a_break": (Scenario(drafters=(
        R(head="attr_tensor", head_break="dynamo", seq=1, seq2=1), R(head="attr_tensor", head_break="dynamo", seq=1,
                                                                     seq2=1, seed=1)),
        schedule=((1, "call"), (0, "call"), (0, "call"))), ()),
    # found by a long run (a fuzzer defect, not the pass's): ``c = z.reshape(-1, V)`` is z itself in eager, so an
    # output ``c`` is written by the chain's later in-place steps; the oracle masked a copy of it at once and missed
    # them (the compiled drafter was right). The oracle now masks such an output when the chain ends
    "an_output_that_is_the_logits_written_after_it_is_emitted": (Scenario(drafters=(R(
        chain=(("copy_ban", "reshape", -10000.0), ("copy_ban", "reshape", -10000.0))),),
        schedule=((0, "call"), (0, "call"), (0, "call"))), ()),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=m) for n, (_, m) in SCENARIOS.items()])
def test_fuzzer_scenario_regression(name):
    with use_kernels("reference"):
        run_scenario(SCENARIOS[name][0])
