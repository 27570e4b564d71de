"""Train a drafter's body through the nanospec head (EAGLE-style: head frozen, body trainable).

The compiled drafter computes its head only over the active vocabulary; the gradient that reaches the
body is exactly the dense head's, masked to the active tokens. When the weights change afterwards
(here: ``load_state_dict`` of a checkpoint), the next compiled call re-copies the cached head rows
by itself.

    python examples/train_drafter_body.py [--inductor]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import nanospec_fx

V, H = 500, 32


class Drafter(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.body = nn.Sequential(nn.Linear(H, 2 * H), nn.SiLU(), nn.Linear(2 * H, H))
        self.lm_head = nn.Linear(H, V, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        return self.lm_head(h + self.body(h))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--inductor", action="store_true", help="compile with inductor (slower to start)")
    args = parser.parse_args()
    torch.manual_seed(0)
    drafter = Drafter()
    drafter.lm_head.requires_grad_(False)  # frozen head, trainable body
    compiled = torch.compile(drafter, backend="nanospec", options={"capacity": 64, "inductor": args.inductor})
    state = nanospec_fx.active_vocab(drafter, head="lm_head")  # exists before the first call
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)

    # Next-token data over a small part of the vocabulary. The tokens fed to the drafter become active by
    # themselves; a target token outside the active set would have logit -inf (an infinite loss), so the
    # targets are observed too (as the target model's top-k would be at inference).
    data = torch.randint(0, 40, (8, 17))
    inputs, targets = data[:, :-1], data[:, 1:]
    state.observe(targets)
    for step in range(31):
        logits = compiled(inputs)  # -inf outside the active vocabulary
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 10 == 0:
            print(f"step {step:2d}  loss {loss.item():.3f}  active {len(state)}")
    print("head gradient:", drafter.lm_head.weight.grad)  # None: the head stays frozen

    # A checkpoint with another head: the next call picks the new rows up (no refresh() needed).
    checkpoint = {k: v.clone() for k, v in drafter.state_dict().items()}
    checkpoint["lm_head.weight"] = torch.randn(V, H)
    drafter.load_state_dict(checkpoint)
    with torch.no_grad():
        got = compiled(inputs[:1])
        active = state.contains(torch.arange(V))
        want = drafter(inputs[:1]).masked_fill(~active, float("-inf"))
    print("after load_state_dict, compiled == dense head on the active tokens:", torch.allclose(got, want, atol=1e-5))


if __name__ == "__main__":
    main()
