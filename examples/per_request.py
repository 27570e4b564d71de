"""Per-request active vocabularies: one head, many requests in one batch, each row against its own set.

    python examples/per_request.py

What a serving engine does around its drafter's head (vLLM calls ``compute_logits`` eagerly): give each
request a row when it starts, observe its prompt and the tokens it accepts, compute the draft rows of a
batch each against its own request's set, and release the row when the request finishes or is preempted.
"""
from __future__ import annotations

import torch

from nanospec_fx import RequestVocabs

torch.manual_seed(0)
V, H = 1000, 64
head = torch.nn.Linear(H, V, bias=False).requires_grad_(False)
vocabs = RequestVocabs(head.weight, max_requests=4, capacity=256)

prompts = {"req-A": [5, 17, 17, 42, 99], "req-B": [7, 8, 9]}
for request_id, prompt in prompts.items():
    vocabs.assign(request_id)  # a free row, emptied
    vocabs.observe(request_id, prompt)  # seed: the prompt (a server would add the target's top-k too)

batch = ["req-A", "req-B", "req-A"]  # draft rows of the step: two for A, one for B
rows = vocabs.rows_for(batch)  # batch row -> request row, on the head's device
hidden = torch.randn(len(batch), H)
with torch.inference_mode():
    logits = vocabs.logits(hidden, rows)  # [3, V]: -inf outside each row's request set
    dense = head(hidden)
    for i, request_id in enumerate(batch):
        active = torch.isfinite(logits[i]).nonzero().flatten().tolist()
        allowed = sorted(set(prompts[request_id]))
        exact = torch.allclose(logits[i, allowed], dense[i, allowed], atol=1e-5)
        print(f"row {i} ({request_id}): active tokens {active}, logits equal the full head's there: {exact}")
    values, tokens = vocabs.topk(hidden, rows, 2)  # never builds [3, V]
    print("top-2 per row:", tokens.tolist())
    isolated = not torch.isfinite(logits[1, prompts["req-A"]]).any()
    print(f"isolation: a token of req-A is never active for req-B: {isolated}")

    # after verification: the tokens each request accepted join its own set (-1 pads; sync-free)
    vocabs.observe_rows(vocabs.rows_for(["req-A", "req-B"]), torch.tensor([[3, -1], [4, 5]]))
    print("req-A now holds", sorted(vocabs.token_ids("req-A").tolist()))
    print("req-B now holds", sorted(vocabs.token_ids("req-B").tolist()))

    vocabs.release("req-A")  # finished or preempted: its row is emptied and freed
    row = vocabs.assign("req-C")
    print(f"req-C got row {row}, holding {vocabs.active_count('req-C')} tokens after release: "
          f"{vocabs.active_count('req-C') == 0}")
    print(f"compact head evaluations: {vocabs.head_calls}")
